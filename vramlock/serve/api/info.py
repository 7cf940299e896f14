"""llama-swap's API group that its page reads: profiles, the version, the recorded
activity and its captures, the requests in progress (and their cancel), performance
samples, the hardware, and ``/api/events`` (see ..events)."""

from __future__ import annotations

import json
import re

from aiohttp import web

from ... import __version__
from ..activity import Query, rfc3339
from ..errors import error_response as _error
from . import Serving, get, only

_ID = re.compile(r"[+-]?\d{1,18}")


class Info:
    """The handlers, reading ``s`` when asked."""

    def __init__(self, s: Serving) -> None:
        self.s = s

    async def profiles(self, request: web.Request) -> web.Response:
        """GET /api/profiles: the active profile (or null) and every one."""
        return web.json_response(self.s.resolver.profiles())

    async def active_profile(self, request: web.Request) -> web.Response:
        """PUT /api/profiles/active, {"name": NAME or null}."""
        try:
            doc = json.loads(await request.read())
        except (ValueError, RecursionError):
            doc = None
        if not isinstance(doc, dict):
            return _error(400, "invalid profile request")
        if "name" not in doc:
            return _error(400, "profile name is required")
        name = doc["name"]
        if name is not None and not isinstance(name, str):
            return _error(400, "profile name must be a string or null")
        try:
            self.s.resolver.set_active(name or None)
        except KeyError:
            return _error(404, f"profile {name!r} not found")
        self.s.events.check()  # told to /api/events before it is answered
        return web.json_response({"active": self.s.resolver.active})

    async def version(self, request: web.Request) -> web.Response:
        """GET /api/version: vramlock's version; no commit or build date is recorded in
        the package."""
        return web.json_response({"version": __version__, "commit": "", "build_date": ""})

    async def activity(self, request: web.Request) -> web.Response:
        """GET /api/metrics/activity: a page of the recorded requests."""
        try:
            query = Query(request.query)
        except ValueError as err:
            return _error(400, str(err))
        return web.json_response(self.s.activity.page(query))

    async def stats(self, request: web.Request) -> web.Response:
        """GET /api/metrics/stats[?model=NAME]: totals and histograms."""
        return web.json_response(self.s.activity.stats(request.query.get("model", "").strip()))

    async def capture(self, request: web.Request) -> web.Response:
        """GET /api/captures/ID: a recorded request and its answer."""
        raw = request.match_info["id"]
        if not _ID.fullmatch(raw):
            return _error(400, "invalid capture ID")
        found = self.s.activity.capture(int(raw))
        if found is None:
            return _error(404, "capture not found")
        return web.json_response(found)

    async def cancel(self, request: web.Request) -> web.Response:
        """POST /api/inflight/ID/cancel: the request ends (see ..inflight)."""
        if not self.s.flights.cancel(request.match_info["id"]):
            return _error(404, "inflight request not found")
        return web.json_response({"msg": "ok"})

    async def performance(self, request: web.Request) -> web.Response:
        """GET /api/performance[?after=RFC3339]: the samples kept (after)."""
        performance = self.s.performance
        if performance is None:
            return _error(503, "performance monitoring is disabled", enabled=False)
        after = None
        raw = request.query.get("after", "")
        if raw:
            after = rfc3339(raw)
            if after is None:
                return _error(400, "invalid 'after' timestamp, use RFC3339 format")
        return web.json_response(performance.current(after))

    async def hardware(self, request: web.Request) -> web.Response:
        """GET /api/hardware: the machine, described on the first request."""
        found = await self.s.hardware.get()
        if found is None:
            return _error(503, "hardware detection unavailable")
        return web.json_response(found)


def register(app: web.Application, s: Serving) -> None:
    info = Info(s)
    get(app, "/api/profiles", info.profiles)
    get(app, "/api/events", s.events.stream)
    get(app, "/api/version", info.version)
    get(app, "/api/metrics/activity", info.activity)
    get(app, "/api/metrics/stats", info.stats)
    get(app, "/api/performance", info.performance)
    get(app, "/api/hardware", info.hardware)
    get(app, "/api/captures/{id}", info.capture)
    only(app, "POST", "/api/inflight/{id}/cancel", info.cancel)
    only(app, "PUT", "/api/profiles/active", info.active_profile)
