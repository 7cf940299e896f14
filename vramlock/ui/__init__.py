"""``vramlock ui``: a live page of one arena, its members, their VRAM, a timeline and the
journal, for any browser (a phone's too).

The page (``page.html``) is self-contained: no CDN, nothing fetched but this server's
``api/state``, which it polls every second. That JSON is made by ``state``, in a worker
thread, from the kernel's lock state and the records (as ``vramlock who``) and the
journal (as ``vramlock stats``), re-read only when its files changed. Nothing is locked
or written in the arena: watching is never activity. Needs the ``serve`` extra
(aiohttp), imported here only.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import os
import secrets
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict
from importlib import resources
from typing import TYPE_CHECKING, Any

from ..arena import journal
from ..arena.directory import Arena
from ..arena.roster import budget_view, gpu_view, snapshot, with_vram
from ..errors import VramlockError
from ..net.web import bind_until_signalled
from ..observe.prometheus import waiters
from ..observe.stats import compute

if TYPE_CHECKING:
    from aiohttp import web

DEFAULT_LISTEN = "127.0.0.1:8090"
# A fixed secret for the page's address (a bookmark that outlives a restart); unset: a
# fresh one each start.
TOKEN_VARIABLE = "VRAMLOCK_UI_TOKEN"
EXPOSED = (
    "whoever can reach it and has the address below sees the arena's members, their"
    " commands and its journal (over plain HTTP)"
)
FORBIDDEN = "vramlock ui: open the address vramlock ui printed, its ?token= included\n"
# The timeline's window, and how many journal lines and switches the page lists.
WINDOW = 600.0
RECENT = 15


class Watch:
    """One arena, as the page shows it; the journal kept between calls while unchanged."""

    def __init__(self, arena: Arena, gpu: int | None, window: float = WINDOW) -> None:
        self.arena = arena
        self.gpu = gpu
        self.window = window
        self._signature: tuple[tuple[str, int, int], ...] | None = None
        self._events: list[journal.Event] = []

    def events(self) -> list[journal.Event]:
        now = journal.signature(self.arena)
        if now != self._signature:
            self._signature, self._events = now, journal.read(self.arena)
        return self._events

    def state(self) -> dict[str, Any]:
        """What the page shows, as JSON-ready data."""
        now = time.time()
        rows = snapshot(self.arena)
        view = gpu_view(self.gpu)
        if view is not None:
            rows = with_vram(rows, view)
        budget = budget_view(self.arena)
        events = self.events()
        # The timeline from the first event of the window: a quiet arena's is not a sliver.
        first = next((e.time for e in events if e.time >= now - self.window), now - self.window)
        report = compute(events, first, now)
        gpu = view.gpus[0] if view is not None and len(view.gpus) == 1 else None
        return {
            "arena": self.arena.path,
            "now": now,
            "gpu": None if gpu is None else asdict(gpu),
            "budget": None if budget is None else {
                "unit": budget.budget.unit, "units": budget.budget.units, "held": budget.held
            },
            "members": [
                {"pid": r.pid, "name": r.name, "state": r.state, "strategy": r.strategy,
                 "vram": r.vram, "footprint": r.footprint}
                for r in rows
            ],
            "waiters": waiters(rows),
            "handoffs": report.handoffs,
            "timeline": {
                "start": report.start,
                "end": report.end,
                # Live or gone (an exit said, or the process no longer there): the page
                # gives each live member a row and folds the gone ones into one.
                "members": [{"name": m.name, "pid": m.pid, "live": m.state != "gone"}
                            for m in report.members],
                "segments": [s._asdict() for s in report.segments],
            },
            "switches": [s._asdict() for s in reversed(report.switches[-RECENT:])],
            "journal": [
                {"time": e.time, "event": e.event, "name": e.name, "pid": e.pid,
                 "trusted": e.trusted}
                for e in reversed(events[-RECENT:])
            ],
        }  # fmt: skip


def page() -> str:
    return resources.files(__package__).joinpath("page.html").read_text(encoding="utf-8")


def merge(states: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Several arenas' ``Watch.state`` as one page's: their members, switches and journal
    together (the latter two by time), the timeline's rows one after another."""
    if len(states) == 1:
        return states[0]
    rows: list[dict[str, Any]] = []
    segments: list[dict[str, Any]] = []
    for s in states:
        t = s["timeline"]
        segments += [{**seg, "member": seg["member"] + len(rows)} for seg in t["segments"]]
        rows += t["members"]
    newest = max(states, key=lambda s: s["now"])
    return {
        **newest,
        "arena": ", ".join(s["arena"] for s in states),
        "members": [m for s in states for m in s["members"]],
        "waiters": sum(s["waiters"] for s in states),
        "handoffs": sum(s["handoffs"] for s in states),
        "timeline": {
            "start": min(s["timeline"]["start"] for s in states),
            "end": max(s["timeline"]["end"] for s in states),
            "members": rows,
            "segments": segments,
        },
        "switches": sorted((w for s in states for w in s["switches"]),
                           key=lambda w: -w["time"])[:RECENT],
        "journal": sorted((e for s in states for e in s["journal"]),
                          key=lambda e: -e["time"])[:RECENT],
    }  # fmt: skip


def app(state: Callable[[], Awaitable[dict[str, Any]]]) -> web.Application:
    """The page at ``/`` and its data, what ``state`` gives, at ``/api/state`` (an
    application that ``vramlock serve`` mounts too, at ``/ui/``)."""
    from aiohttp import web

    html = page()

    async def index(request: web.Request) -> web.Response:
        return web.Response(text=html, content_type="text/html")

    async def data(request: web.Request) -> web.Response:
        return web.json_response(await state(), headers={"Cache-Control": "no-store"})

    application = web.Application()
    application.router.add_get("/", index)
    application.router.add_get("/api/state", data)
    return application


def token() -> str:
    """The secret the page's address carries: $VRAMLOCK_UI_TOKEN, else a fresh one."""
    return os.environ.get(TOKEN_VARIABLE) or secrets.token_urlsafe(32)


def _token_wanted(secret: str) -> Any:
    """A middleware that answers 403 to a request whose ``?token=`` is not ``secret``:
    the page and its data are for whoever has the printed address, not for every local
    user (loopback is every user of the host, and a team arena's data is its group's)."""
    from aiohttp import web

    wanted = secret.encode()

    @web.middleware
    async def check(request: web.Request, handler: Any) -> web.StreamResponse:
        given = request.query.get("token", "").encode()
        if hmac.compare_digest(given, wanted):
            return await handler(request)  # type: ignore[no-any-return]
        return web.Response(status=403, text=FORBIDDEN)

    return check


def loopback(host: str) -> bool:
    """Does ``host`` (as ``--listen`` gives it) reach this host's users only?"""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name, or a wildcard's empty host


def serve(watch: Watch, listen: str, warn: Callable[[str], None]) -> int:
    """Serve the page until SIGTERM, SIGINT or SIGHUP; 0 then. UsageError for a bad
    ``listen``, AddressError when it cannot be listened on."""
    try:
        import aiohttp  # noqa: F401
    except ImportError:
        raise VramlockError("vramlock ui needs aiohttp: pip install aiohttp") from None
    from ..net.address import parse

    host, port = parse(listen, "--listen")
    return asyncio.run(_main(watch, listen, host, port, warn))


async def _main(
    watch: Watch, listen: str, host: str, port: int, warn: Callable[[str], None]
) -> int:
    from urllib.parse import quote

    from aiohttp import web

    from ..net.address import connect_host, show

    secret = token()
    application = app(lambda: asyncio.to_thread(watch.state))
    application.middlewares.append(_token_wanted(secret))
    runner = web.AppRunner(application, access_log=None)
    await runner.setup()
    stop = await bind_until_signalled(runner, host, port, listen)
    if not loopback(host):
        warn(f"--listen {listen} is not loopback: {EXPOSED}")
    where = show((connect_host(host), port))
    warn(f"showing {watch.arena.path} at http://{where}/?token={quote(secret, safe='')}")
    try:
        await stop.wait()
    finally:
        await runner.cleanup()
    return 0
