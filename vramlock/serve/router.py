"""The one address of ``vramlock serve``: requests routed by model to the wrappers.

A POST whose JSON body names a ``model`` goes to that model's wrapper (its ``vramlock
run`` listen address); the response is passed back as it comes, chunk by chunk.
``/upstream/MODEL/PATH`` passes any request through unread. A request for a released
model is demand: the wrapper holds it while the model comes back.

Every request to a local model goes the one way of .exchange (choose, turn, flight,
forward, count), from either door: front.py's common request (.fast) or aiohttp's
handlers here (.forward). The API's other routes register themselves (.api).
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Middleware

from .. import __version__
from . import doors
from .activity import Activity
from .api import get, info, models, only, page, refuse_others
from .by_model import ByModel
from .config import Config
from .doors import Keys
from .errors import error_response as _error
from .errors import negotiated
from .events import Events, model_status
from .exchange import Chosen, Exchange
from .fast import FastPath
from .forward import Forwarder
from .front import Front, Head
from .hardware import Hardware, Performance
from .inflight import Flights
from .logs import Logs, add_routes
from .members import Wrapper, states
from .metrics import Requests
from .peers import Peers
from .reading import MAX_BODY
from .selectors import Resolver
from .turns import GROUP_WAIT as GROUP_WAIT

# Once serve ends, a request that was told why has this long to say it.
ANSWER_GRACE = 1.0


class Router:
    """The aiohttp application: its doors, the routes by model, the unloads."""

    def __init__(
        self, config: Config, wrappers: dict[str, Wrapper], logs: Logs | None = None
    ) -> None:
        self.config = config
        self.wrappers = wrappers
        self.fronts: set[Front] = set()  # connections whose requests front.py takes
        self._not_fast: tuple[str, ...] | None = None
        self._others = False  # a middleware other than the count of requests
        self.requests = Requests()
        self.activity = Activity(config.activity_kept, config.capture_mb << 20, self._priority)
        self.flights = Flights(self.activity.record, self.activity.keep_bytes)
        self.exchange = Exchange(lambda: self.config, wrappers, self.flights, self.requests)
        self.pools = self.exchange.pools  # watch.py drops a changed model's
        self.common = FastPath(self.exchange)  # front.py's requests
        self.forwarder = Forwarder(self.exchange)
        self.hardware = Hardware(__version__)
        every = config.performance_every
        self.performance = None if every is None else Performance(every)
        self.peers = Peers(self.exchange)
        self.resolver = Resolver(config, self._state_of)
        self.events = Events(self._model_status, self._active_profile, logs, self.flights,
                             self.activity, self._ui)  # fmt: skip
        self._plain_for: Config | None = None  # the config _plain was found for
        self._plain_value = True
        middlewares: list[Middleware] = [negotiated]  # front.py hands such clients over
        self.keys = Keys(config.api_keys)  # front.py asks it as this middleware does
        self._doors = doors.middleware(self.keys)
        middlewares.append(self._doors)
        self.app = web.Application(client_max_size=MAX_BODY, middlewares=middlewares)
        self._routes(logs)
        self.app.on_startup.append(self._begin)
        self.app.on_shutdown.append(self._end_streams)
        self.app.on_cleanup.append(self._close)

    def _routes(self, logs: Logs | None) -> None:
        """llama-swap's routes: the API's modules register theirs; a model's are here."""
        app, r = self.app, self.app.router
        routes = ByModel(self)
        page.register(app, self, logs)
        models.register(app, self)
        only(app, "POST", "/models/unload", self.unload_all)
        only(app, "POST", "/models/unload/{model}", self.unload_one)
        get(app, "/unload", self.unload_all_plain)
        only(app, "POST", "/api/models/unload", self.api_unload_all)
        only(app, "POST", "/api/models/unload/{model:.+}", self.api_unload_one)
        routes.register_passing(app)
        if logs is not None:
            add_routes(r, logs, self._name)
            r.add_route("*", "/logs", refuse_others("GET", "HEAD"))
            r.add_route("*", "/logs/stream", refuse_others("GET", "HEAD"))
            r.add_route("*", "/logs/stream/{which:.+}", refuse_others("GET", "HEAD"))
        info.register(app, self)
        self._by_model = routes.register_routed(app)
        r.add_route("*", "/{path:.*}", self.no_route)

    async def _begin(self, app: web.Application) -> None:
        if self.performance is not None:
            self.performance.start()

    async def _end_streams(self, app: web.Application) -> None:
        """/api/events streams end before the server waits for its requests."""
        self.events.end()

    async def _close(self, app: web.Application) -> None:
        for pool in self.pools.values():
            pool.close()
        await self.peers.close()
        if self.performance is not None:
            await self.performance.stop()

    async def observe(self, config: Config) -> None:
        """A configuration read again: its metricsMaxInMemory, captureBuffer and
        performance taken (the activity and the samples kept so far stay, within the new
        bounds, as llama-swap keeps its store and restarts its monitor)."""
        self.activity.resize(config.activity_kept, config.capture_mb << 20)
        every = config.performance_every
        now = None if self.performance is None else self.performance.every
        if every != now:
            if self.performance is not None:
                await self.performance.stop()
            self.performance = None if every is None else Performance(every)
            if self.performance is not None:
                self.performance.start()

    def _priority(self, model: str) -> int:
        """The model's fifo priority (llama-swap's activity metadata)."""
        return self.config.routing.priority.get(model, 0)

    @property
    def _plain(self) -> bool:
        """Names that may mean another model (profiles, selectors, peers) and loading
        state are the aiohttp path's alone: without them, front.py may take requests.
        Found again when --watch-config gives the router another config."""
        c = self.config
        if self._plain_for is not c:
            loading = any(m.loading_state for m in c.models.values())
            self._plain_value = not (c.peers or c.selectors or c.profiles or loading)
            self._plain_for = c
        return self._plain_value

    def _model_status(self) -> list[dict[str, Any]]:
        """/api/events' modelStatus: the models in their states, the peers' models."""
        return model_status(self.config, states(self.wrappers.values()))

    def _ui(self) -> dict[str, Any]:
        """/api/events' uiConfig: the config's ``ui``, as llama-swap tells it."""
        return {"activity": {"session_id": list(self.config.session_headers)}}

    def _active_profile(self) -> str | None:
        return self.resolver.active  # the resolver is another after a reload

    def _state_of(self, name: str) -> str | None:
        """Model ``name``'s member state; None when its wrapper is not running."""
        w = self.wrappers.get(name)
        return w.member_state() if w is not None and w.alive() else None

    def _name(self, name: str) -> str | None:
        """The model ``name`` names (directly or as an alias); None if none."""
        model = self.config.find(name)
        return None if model is None else model.name

    # -- the common request, taken by front.py ---------------------------------------

    def fast_path(self, path: str) -> bool:
        """Would a POST to ``path`` reach ``by_model``, through no middleware but the
        keys' check and the count of requests (which front.py and ``fast`` do the same
        way)?"""
        if self._not_fast is None:
            # Found once: the application's routes and middlewares are frozen once it
            # serves.
            prefixes = []
            for resource in self.app.router.resources():
                if resource is self._by_model:
                    break
                if any(route.method in ("POST", "*") for route in resource):
                    prefixes.append(resource.canonical.split("{")[0])
            self._not_fast = tuple(prefixes)
            mine = (negotiated, self._doors)
            self._others = any(m not in mine for m in self.app.middlewares)
        return self._plain and not self._others and not path.startswith(self._not_fast)

    def express(self, front: Front, head: Head, body: bytes) -> Chosen | None:
        """front.py's request started where nothing need wait (``FastPath.express``)."""
        return self.common.express(front, head, body)

    def fast(
        self, front: Front, head: Head, body: bytes, chosen: Chosen | None = None
    ) -> Coroutine[Any, Any, None]:
        """front.py's request, the exchange's way (``FastPath.fast``)."""
        return self.common.fast(front, head, body, chosen)

    async def close_fronts(self, grace: float) -> None:
        """Let the requests in progress end, for ``grace`` at most; then those whose
        answer has not begun are answered why (``Flights.interrupt``), and what is left
        on front.py's connections is cut. aiohttp's are its runner's to end."""
        if await self._settled(grace):
            return
        self.flights.interrupt()
        await self._settled(ANSWER_GRACE)
        for front in list(self.fronts):
            if front.transport is not None:
                front.transport.abort()

    async def _settled(self, within: float) -> bool:
        """Have the requests in progress (front.py's and aiohttp's) ended ``within``?"""
        tasks: set[asyncio.Future[Any]] = {f.task for f in self.fronts if f.task is not None}
        tasks |= {f.express.waiter() for f in self.fronts if f.express is not None}
        tasks |= {f.task for f in self.flights.now.values() if f.task is not None}
        if not tasks:
            return True
        _, pending = await asyncio.wait(tasks, timeout=within)
        return not pending

    def wrapper(self, name: str) -> Wrapper | web.Response:
        model = self.config.find(name)
        if model is None:
            return _error(404, f"model {name!r} not found", models=self.config.known())
        return self.wrappers[model.name]

    async def unload_one(self, request: web.Request) -> web.Response:
        found = self.wrapper(request.match_info["model"])
        if isinstance(found, web.Response):
            return found
        done = await self.exchange.unload(found)
        if done.failure is not None:
            return _not_unloaded({found.model.name: done.failure})
        return web.json_response({"model": found.model.name, "released": done.released})

    async def _unload_all(self) -> tuple[list[str], dict[str, str]]:
        """Release every resident model: the names of those that were, and why each
        that could not be was not."""
        tasks = {name: self.exchange.unload(w) for name, w in self.wrappers.items()}
        done = {name: await task for name, task in tasks.items()}
        failed = {name: d.failure for name, d in done.items() if d.failure is not None}
        return [name for name, d in done.items() if d.released and d.failure is None], failed

    async def unload_all(self, request: web.Request) -> web.Response:
        released, failed = await self._unload_all()
        return _not_unloaded(failed) if failed else web.json_response({"released": released})

    async def unload_all_plain(self, request: web.Request) -> web.Response:
        """llama-swap's GET /unload: "OK" once every model is released."""
        _, failed = await self._unload_all()
        return _not_unloaded(failed) if failed else web.Response(text="OK")

    async def api_unload_all(self, request: web.Request) -> web.Response:
        """llama-swap's POST /api/models/unload."""
        _, failed = await self._unload_all()
        return _not_unloaded(failed) if failed else web.json_response({"msg": "ok"})

    async def api_unload_one(self, request: web.Request) -> web.Response:
        """llama-swap's POST /api/models/unload/MODEL: "OK" once it is released."""
        found = self.wrapper(request.match_info["model"])
        if isinstance(found, web.Response):
            return found
        done = await self.exchange.unload(found)
        if done.failure is not None:
            return _not_unloaded({found.model.name: done.failure})
        return web.Response(text="OK")

    async def no_route(self, request: web.Request) -> web.Response:
        return _error(404, f"{request.method} {request.path}: no such route")

    # -- what is there -------------------------------------------------------------


def _not_unloaded(failed: dict[str, str]) -> web.Response:
    """A 500 for an unload that left models running: why, model by model."""
    said = "; ".join(f"model {name}: {why}" for name, why in failed.items())
    return _error(500, f"not unloaded: {said}")
