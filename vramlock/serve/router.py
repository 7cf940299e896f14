"""The one address of ``vramlock serve``: requests routed by model to the wrappers.

A POST whose JSON body names a ``model`` goes to that model's wrapper (its ``vramlock
run`` listen address); the response is passed back as it comes, chunk by chunk.
``/upstream/MODEL/PATH`` passes any request through unread. A request for a released
model is demand: the wrapper holds it while the model comes back.

Requests are admitted a model at a time per arena (``Turns``), so a burst for several
models is served grouped by model instead of swapping on every request.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar
from urllib.parse import unquote

import aiohttp
from aiohttp import web
from aiohttp.typedefs import Middleware

from .. import __version__
from ..arena.records import HOLDING, State
from . import body as bodies
from . import doors
from .activity import Activity
from .api import get, info, models, only, page, refuse_others
from .config import COMFYUI_MODEL, Config
from .doors import Keys
from .errors import busy_response, negotiated
from .errors import error_response as _error
from .events import Events, model_status
from .front import Front, Head
from .hardware import Hardware, Performance
from .inflight import CANCELLED, Flight, Flights, uncancel
from .loading import Loading, wanted
from .logs import Logs, add_routes
from .members import Wrapper, states
from .metrics import GONE, MODEL, Requests, counting
from .peers import Peers, resolve, upstream_peer
from .selectors import Refused, Resolver
from .upstream import Body, Peek, Pool, Response, Stream, UpstreamTimeout

T = TypeVar("T")
# Once a request for another model has waited this long, new requests for the model
# being served queue behind it: grouping never starves a model for longer.
GROUP_WAIT = 2.0
# When the model being served has no request left and others are waiting, its turn
# lasts this much longer, for its client's next request. A request that finds nothing in
# progress goes at once: a client alternating models waits for nothing but the switch
# (it once waited this much more each time: 0.23 s through serve against 0.13 s through
# run's proxy, two 5 GiB llama-servers on an H100).
LINGER = 0.1
# A response of known length up to this size is read whole and sent in one write;
# others (streams, chunked, large) are passed on chunk by chunk as they come.
WHOLE = 1 << 20
# A request body up to this size may be sent from front.py's data callback (in one
# write, which the transport takes whole).
EXPRESS_BODY = 64 * 1024
# A request body larger than this is refused (413): a JSON body is held whole, to find
# its model, and several large ones at once must not exhaust memory. Other bodies are
# passed on as they come, and cut (413) once this much has passed.
MAX_BODY = 64 << 20
# A multipart form's model field must be within its first this many bytes.
FORM_PREFIX = 1 << 20
_STREAM_CHUNK = 256 * 1024
# A JSON body up to this size is parsed whole to find its model (faster than skipping
# over its members, and a copy of it costs nothing); a larger one is scanned.
_PARSED = 64 * 1024
# llama-swap's GET routes whose request names its model as ?model=NAME.
BY_QUERY = ("/props", "/v1/audio/voices", "/sdapi/v1/loras")
# Prefixes that llama-swap strips before a POST is routed by its model: /v/ (clients that
# add their own version, /v/chat/completions reaching /v1/...'s server as
# /chat/completions) and /audioapi/ (audio.cpp's /v1/tasks/run).
STRIPPED = ("/v", "/audioapi")
# The request key of the selector whose name a request used (for its activity).
SELECTOR = "vramlock.selector"
# Hop-by-hop headers (RFC 9110 7.6.1) and those the two HTTP stacks set themselves.
_HOP = frozenset(
    {"connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding",
     "upgrade", "host", "content-length"}
)  # fmt: skip


class Turns:
    """Admission for one arena's models: one model's requests at a time.

    Requests for the model being served are admitted at once, unless a request for
    another model has waited ``GROUP_WAIT``; others queue. When no admitted request is
    left (and none came within ``LINGER``, or somebody waited too long), every queued
    request of the model waiting longest is admitted. A request that finds nothing in
    progress and nobody waiting is admitted at once, whatever its model. A B A B
    arriving together are served A A B B; clients that never pause take turns of about
    ``GROUP_WAIT``, so a request waits at most that long for each other model's turn
    (and its swap).

    ``priority`` (llama-swap's fifo priorities, model -> priority, 0 by default): of
    the models waiting when a turn ends, one of the highest priority goes next, the
    one waiting longest among them.
    """

    def __init__(self, priority: dict[str, int] | None = None) -> None:
        self.priority = priority or {}
        self.current: str | None = None
        self.active = 0
        self._queued: dict[str, list[tuple[float, asyncio.Future[None]]]] = {}
        self._switch: asyncio.TimerHandle | None = None
        self._turn_began = 0.0

    def _overdue(self) -> bool:
        """Has the current turn lasted GROUP_WAIT since it began and since somebody
        else started waiting?"""
        oldest = min((q[0][0] for q in self._queued.values() if q), default=None)
        if oldest is None:
            return False
        return time.monotonic() - max(oldest, self._turn_began) > GROUP_WAIT

    def enter_now(self, model: str) -> bool:
        """Let a request for ``model`` in if it need not wait; whether it was."""
        if self.current is None or (self.current == model and not self._overdue()):
            if self._switch is not None:
                self._switch.cancel()
                self._switch = None
            if self.current is None:
                self._begin(model)
            self.active += 1
            return True
        return False

    async def enter(self, model: str) -> None:
        if self.enter_now(model):
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        queue = self._queued.setdefault(model, [])
        queue.append((time.monotonic(), fut))
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.leave()  # admitted in the same instant it was cancelled
            else:
                queue[:] = [q for q in queue if q[1] is not fut]
                if not queue:
                    self._queued.pop(model, None)
                    if self.active == 0 and not any(self._queued.values()):
                        self.current = None
            raise

    def _begin(self, model: str) -> None:
        self.current = model
        self._turn_began = time.monotonic()

    def leave(self) -> None:
        self.active -= 1
        if self.active > 0:
            return
        if not any(self._queued.values()):
            self.current = None
        elif self._overdue():
            self._next()
        elif self._switch is None:
            self._switch = asyncio.get_running_loop().call_later(LINGER, self._next)

    def _next(self) -> None:
        self._switch = None
        if self.active > 0:
            return  # the model's next request came in time
        waiting = {m: q for m, q in self._queued.items() if q}
        if not waiting:
            self.current = None
            return
        model = min(waiting, key=lambda m: (-self.priority.get(m, 0), waiting[m][0][0]))
        self._begin(model)
        for _, fut in self._queued.pop(model):
            self.active += 1
            fut.set_result(None)


@dataclass
class Refusal:
    """An error to answer instead of passing a request on."""

    status: int
    message: str
    extra: dict[str, Any] = field(default_factory=dict)


NO_MODEL = Refusal(400, 'the request body must be JSON with a "model" field')
# What a request body chose: the model's wrapper and the body to send it, or a refusal.
Chosen = tuple[Wrapper, Body] | Refusal


class Express:
    """A request that ``Router.express`` sent from front.py's data callback: its answer
    passed on from the wrapper connection's (``Peek``), or the rest in a task."""

    def __init__(
        self,
        router: Router,
        front: Front,
        w: Wrapper,
        turns: Turns,
        head: Head,
        pool: Pool,
        pair: tuple[asyncio.StreamReader, asyncio.StreamWriter],
        data: tuple[bytes, Body],
    ) -> None:
        self.router, self.front, self.w, self.turns = router, front, w, turns
        self.head, self.pool, self.pair, self.data = head, pool, pair, data
        self.began = time.monotonic()
        self._ended: asyncio.Future[None] | None = None
        flight = front.flight
        assert flight is not None
        self.flight: Flight = flight
        flight.on_cancel = self._cancel_asked
        self.peek = Peek(pool, pair, WHOLE, self._answered, self._missed)

    @property
    def shown(self) -> str:
        return f"POST {self.head.target.partition('?')[0]}"

    def waiter(self) -> asyncio.Future[None]:
        """Done once the request has ended (here or in its task)."""
        if self._ended is None:
            self._ended = asyncio.get_running_loop().create_future()
        return self._ended

    def _end(self, status: str) -> None:
        self.front.express = None
        self.front.flight = None
        self.router.leave(self.w, self.turns)
        self.router.requests.add(self.w.model.name, status, time.monotonic() - self.began)
        self.router.flights.end(self.flight, status)
        if self._ended is not None and not self._ended.done():
            self._ended.set_result(None)

    def _answered(
        self, status: int, reason: str, headers: list[tuple[str, str]], body: bytes
    ) -> None:
        try:
            self.front.answer(status, reason, headers, body)
        except OSError:
            self._end(GONE)
            self.front.lost()
            return
        self.w.info(f"{self.shown} {status} in {time.monotonic() - self.began:.3f} s")
        self._end(str(status))
        self.front.ended()

    def _missed(self) -> None:
        self.front.express = None
        self.flight.on_cancel = None  # the task has it (resume)
        task = self.front.run(self.router.resume(self))
        if self._ended is not None:
            ended = self._ended

            def end(_: asyncio.Task[None]) -> None:
                if not ended.done():
                    ended.set_result(None)

            task.add_done_callback(end)

    def cancel(self) -> None:
        """The client went away: so does its request."""
        self.peek.cancel()
        self._end(GONE)

    def _cancel_asked(self) -> None:
        """POST /api/inflight/ID/cancel: ended soon (not in the middle of that request)."""
        asyncio.get_running_loop().call_soon(self._cancelled)

    def _cancelled(self) -> None:
        if self.front.express is not self:
            return  # answered meanwhile, or gone on in a task (which sees it cancelled)
        self.peek.cancel()  # the wrapper's connection closed: its server's request ends
        self.w.info(f"{self.shown} cancelled")
        try:
            status = self.front.refuse(502, CANCELLED)
        except OSError:
            self._end(GONE)
            self.front.lost()
            return
        self._end(str(status))
        self.front.ended()


def _named(body: bytes | bytearray) -> str | None:
    """The model a JSON body names; None when it names none."""
    try:
        if len(body) <= _PARSED:
            doc = json.loads(body)
            name = doc.get("model") if isinstance(doc, dict) else None
        else:
            name = bodies.json_model(body)
    except (ValueError, RecursionError):  # RecursionError: nested deep
        name = None
    return name if isinstance(name, str) else None


class _TooLarge(Exception):
    """A body went over ``MAX_BODY`` as it was read."""


def _too_large() -> web.Response:
    return _error(413, f"the request body is over {MAX_BODY >> 20} MiB")


async def _body(request: web.Request) -> bytearray | web.Response:
    """The request's body, held once, or a 413 when it is over ``MAX_BODY`` (said
    before any of it is read where Content-Length tells)."""
    if (request.content_length or 0) > MAX_BODY:
        return _too_large()
    try:
        return await _read(request, MAX_BODY)
    except _TooLarge:
        return _too_large()


async def _read(request: web.Request, limit: int) -> bytearray:
    """The body; _TooLarge past ``limit`` bytes."""
    held = bytearray()
    async for chunk in request.content.iter_any():
        held += chunk
        if len(held) > limit:
            raise _TooLarge
    return held


async def _read_some(request: web.Request, into: bytearray) -> None:
    """What of the body has come (some of it, or the end), appended to ``into``."""
    into += await request.content.readany()


async def _counted(request: web.Request, first: bytes = b"") -> AsyncIterator[bytes]:
    """The body as it comes (after ``first``, read already); _TooLarge once more than
    ``MAX_BODY`` bytes have passed."""
    passed = len(first)
    if first:
        yield first
    async for chunk in request.content.iter_chunked(_STREAM_CHUNK):
        passed += len(chunk)
        if passed > MAX_BODY:
            raise _TooLarge
        yield chunk


async def _relay(src: Any, dst: Any) -> None:
    """Pass a websocket's (``src``'s) messages on to another (``dst``) until either
    closes (aiohttp's client and server websockets, which share these methods)."""
    async for msg in src:
        if msg.type is aiohttp.WSMsgType.TEXT:
            await dst.send_str(msg.data)
        elif msg.type is aiohttp.WSMsgType.BINARY:
            await dst.send_bytes(msg.data)
        else:
            break
    await dst.close()


def _bare(path: str, prefix: str) -> str:
    """The path a model's server is asked for (``path``, after the proxy's ``prefix``),
    without its query: what inflight and activity show."""
    return path.partition("?")[0][len(prefix) :] or "/"


_ID = re.compile(r"[+-]?\d{1,18}")


def _with_model(request: web.Request, model: str) -> str:
    """The request's path and query, its ``model`` parameter ``model``."""
    return str(request.rel_url.update_query(model=model))


class Router:
    """The aiohttp application: routes, the per-arena turns, ttl timers."""

    def __init__(
        self, config: Config, wrappers: dict[str, Wrapper], logs: Logs | None = None
    ) -> None:
        self.config = config
        self.wrappers = wrappers
        self.turns: dict[tuple[str | None, str | None], Turns] = {}
        self.served: dict[tuple[str | None, str | None], str] = {}  # per arena: its last model
        self.pools: dict[str, Pool] = {}
        self.fronts: set[Front] = set()  # connections whose requests front.py takes
        self._not_fast: tuple[str, ...] | None = None
        self._others = False  # a middleware other than the count of requests
        self.requests = Requests()
        self.activity = Activity(config.activity_kept, config.capture_mb << 20, self._priority)
        self.flights = Flights(self.activity.record, self.activity.keep_bytes)
        self.hardware = Hardware(__version__)
        every = config.performance_every
        self.performance = None if every is None else Performance(every)
        self._seen_resident: str | None = None  # the routing rules' last model found resident
        self.peers = Peers()
        self.resolver = Resolver(config, self._state_of)
        self.events = Events(self._model_status, self._active_profile, logs, self.flights,
                             self.activity)  # fmt: skip
        self._plain_for: Config | None = None  # the config _plain was found for
        self._plain_value = True
        middlewares: list[Middleware] = [negotiated]  # front.py hands such clients over
        self.keys = Keys(config.api_keys)  # front.py asks it as this middleware does
        self._doors = doors.middleware(self.keys)
        middlewares.append(self._doors)
        self._counting = counting(self.requests)  # front.py counts its own the same way
        middlewares.append(self._counting)
        self.app = web.Application(client_max_size=MAX_BODY, middlewares=middlewares)
        self._routes(logs)
        self.app.on_startup.append(self._begin)
        self.app.on_shutdown.append(self._end_streams)
        self.app.on_cleanup.append(self._close)

    def _routes(self, logs: Logs | None) -> None:
        """llama-swap's routes: the API's modules register theirs; a model's are here."""
        app, r = self.app, self.app.router
        page.register(app, self, logs)
        models.register(app, self)
        only(app, "POST", "/models/unload", self.unload_all)
        only(app, "POST", "/models/unload/{model}", self.unload_one)
        get(app, "/unload", self.unload_all_plain)
        only(app, "POST", "/api/models/unload", self.api_unload_all)
        only(app, "POST", "/api/models/unload/{model:.+}", self.api_unload_one)
        r.add_route("*", "/upstream/{model}", self.upstream)
        r.add_route("*", "/upstream/{model}/{path:.*}", self.upstream)
        r.add_route("*", "/comfyui", self.to_comfyui)
        r.add_route("*", "/comfyui/{path:.*}", self.comfyui)
        if logs is not None:
            add_routes(r, logs, self._name)
            r.add_route("*", "/logs", refuse_others("GET", "HEAD"))
            r.add_route("*", "/logs/stream", refuse_others("GET", "HEAD"))
            r.add_route("*", "/logs/stream/{which:.+}", refuse_others("GET", "HEAD"))
        info.register(app, self)
        for path in BY_QUERY:
            # llama-swap routes a POST /v1/audio/voices by its body, as any POST
            if path == "/v1/audio/voices":
                r.add_get(path, self.by_query)
            else:
                get(app, path, self.by_query)
        for prefix in STRIPPED:
            r.add_post(prefix + "/{path:.*}", self.stripped)
        self._by_model = r.add_post("/{path:.*}", self.by_model).resource
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
            mine = (self._counting, negotiated, self._doors)
            self._others = any(m not in mine for m in self.app.middlewares)
        return self._plain and not self._others and not path.startswith(self._not_fast)

    def express(self, front: Front, head: Head, body: bytes) -> Chosen | None:
        """Start ``fast``'s request from front.py's data callback, with no task, where
        nothing need wait: the model is the one its arena serves now and its turn lets
        the request in at once (the routing rules look at nothing), its wrapper runs, a
        kept-alive connection to it is idle, and no responseHeader bound runs. Its
        answer is passed on from the connection's data callback (``Peek``); what does
        not come whole at once goes on in a task, as ``fast`` would. None: started;
        else what the body chose, for ``fast``, nothing done."""
        chosen = self.choose(body)
        if isinstance(chosen, Refusal):
            return chosen
        w, sent = chosen
        model = w.model
        pool = self.pools.get(model.name)
        if (
            pool is None
            or isinstance(sent, Stream)
            or pool.header is not None
            or len(sent) > EXPRESS_BODY
            or w.admitted >= model.concurrency
            or (self.config.routing.engine is not None and self._seen_resident != model.name)
            or self.served.get((model.arena, model.gpu)) != model.name
            or (w.exited is not None and w.exited.done())
            or not w.alive()
        ):
            return chosen
        pair = pool.take()
        if pair is None:
            return chosen
        turns = self._turns(w)
        if not turns.enter_now(model.name):
            pool.keep(*pair)
            return chosen
        w.admitted += 1
        w.in_flight += 1
        if w.ttl_timer is not None:
            w.ttl_timer.cancel()
            w.ttl_timer = None
        headers = [(k, v) for k, v in head.headers if k.lower() not in _HOP]
        data = pool.encode("POST", model.prefix + head.target, headers, sent)
        held = sent if isinstance(sent, bytes | bytearray) else None
        front.flight = self.flights.start(model.name, "POST", head.target.partition("?")[0],
                                          head.headers, front.peer, held)  # fmt: skip
        front.express = Express(self, front, w, turns, head, pool, pair, data)
        pair[1].write(data[0] + sent)  # one segment: the wrapper wakes once
        return None

    async def fast(
        self, front: Front, head: Head, body: bytes, chosen: Chosen | None = None
    ) -> None:
        """``by_model`` for the request that ``front`` parsed (``chosen``: what its body
        chose, if that is known already)."""
        if chosen is None:
            chosen = self.choose(body)
        if isinstance(chosen, Refusal):
            front.refuse(chosen.status, chosen.message, chosen.extra)
            return
        w, sent = chosen
        headers = [(k, v) for k, v in head.headers if k.lower() not in _HOP]
        path = w.model.prefix + head.target
        bare = head.target.partition("?")[0]
        held = sent if isinstance(sent, bytes | bytearray) else None
        flight = front.flight = self.flights.start(w.model.name, "POST", bare, head.headers,
                                                   front.peer, held)  # fmt: skip
        flight.task = asyncio.current_task()

        async def send() -> int:
            pool = self._pool(w)
            return await self._relay(front, w, lambda: pool.request("POST", path, headers,
                                                                  sent, w.exited))  # fmt: skip

        shown = f"POST {bare}"
        began, status = time.monotonic(), GONE
        try:
            try:
                answered = await self.in_turn(w, shown, send, int, front.busy)
            except asyncio.CancelledError:
                if not flight.cancelled:
                    raise
                uncancel()
                w.info(f"{shown} cancelled")
                answered = front.refuse(502, CANCELLED)
            status = str(answered)
        finally:
            front.flight = None
            self.requests.add(w.model.name, status, time.monotonic() - began)
            self.flights.end(flight, status)

    async def _relay(
        self, front: Front, w: Wrapper, response: Callable[[], Awaitable[Response]]
    ) -> int:
        """The wrapper's ``response()`` passed on to ``front``'s client, or the error
        that says why there is none; the status answered."""
        try:
            up = await response()
        except UpstreamTimeout as err:
            return front.refuse(504, f"model {w.model.name}: {err}")
        except OSError as err:
            cause = await w.cause(err)
            return front.refuse(502, f"model {w.model.name}: its server did not answer: {cause}")
        try:
            return await front.relay(w, up, WHOLE)
        finally:
            await up.body.aclose()

    async def resume(self, x: Express) -> None:
        """An express request whose answer did not come whole at once: the rest as
        ``fast`` does it, from its request sent."""
        w, flight = x.w, x.flight
        flight.task = asyncio.current_task()
        status = GONE
        try:
            pool, pair, data = x.pool, x.pair, x.data
            try:
                if flight.cancelled:  # asked between the data callback and this task
                    raise asyncio.CancelledError
                answered = await self._relay(
                    x.front, w, lambda: pool.resume(pair[0], pair[1], data, w.exited)
                )
                w.info(f"{x.shown} {answered} in {time.monotonic() - x.began:.3f} s")
            except asyncio.CancelledError:
                if not flight.cancelled:
                    raise
                uncancel()
                pair[1].close()  # the wrapper's connection: its server's request ends
                w.info(f"{x.shown} cancelled")
                answered = x.front.refuse(502, CANCELLED)
            status = str(answered)
        finally:
            x.front.flight = None
            self.leave(w, x.turns)
            self.requests.add(w.model.name, status, time.monotonic() - x.began)
            self.flights.end(flight, status)

    def leave(self, w: Wrapper, turns: Turns) -> None:
        """A request of ``w``'s that ``in_turn`` let in has ended."""
        w.in_flight -= 1
        w.admitted -= 1
        turns.leave()
        self._arm_ttl(w)

    def _pool(self, w: Wrapper) -> Pool:
        """The connections to ``w``'s wrapper, bounded by the model's timeouts."""
        pool = self.pools.get(w.model.name)
        if pool is None:
            bounds = w.model.timeouts
            pool = self.pools[w.model.name] = Pool(w.port, connect=bounds.connect,
                                                   header=bounds.header)  # fmt: skip
        return pool

    async def close_fronts(self, grace: float) -> None:
        """Let the requests in progress on front.py's connections end, for ``grace`` at
        most, then cut what is left."""
        tasks: list[asyncio.Future[None]] = [f.task for f in self.fronts if f.task is not None]
        tasks += [f.express.waiter() for f in self.fronts if f.express is not None]
        if tasks:
            await asyncio.wait(tasks, timeout=grace)
        for front in list(self.fronts):
            if front.transport is not None:
                front.transport.abort()

    def _wrapper(self, name: str) -> Wrapper | web.Response:
        model = self.config.find(name)
        if model is None:
            return _error(404, f"model {name!r} not found", models=self.config.known())
        return self.wrappers[model.name]

    def _turns(self, w: Wrapper) -> Turns:
        where = (w.model.arena, w.model.gpu)
        if where not in self.turns:
            self.turns[where] = Turns(self.config.routing.priority)
        return self.turns[where]

    # -- forwarding ----------------------------------------------------------------

    async def by_model(self, request: web.Request) -> web.StreamResponse:
        mark = bodies.boundary(request.headers.get("Content-Type", ""))
        if mark is not None:
            return await self._by_form(request, mark)
        body = await _body(request)
        if isinstance(body, web.Response):
            return body
        name = _named(body)
        if name is None:
            return _error(NO_MODEL.status, NO_MODEL.message)
        try:
            target, done = self.resolver.resolve(name)
        except Refused as err:
            return _error(err.status, err.message)
        if name in self.config.selectors:
            request[SELECTOR] = name
        try:
            return await self._by_name(request, name, target, body)
        finally:
            done()

    async def _by_name(
        self, request: web.Request, name: str, target: str, body: bytes | bytearray
    ) -> web.StreamResponse:
        """A request for ``name``, which profiles and selectors made ``target``: to a
        peer or a model."""
        doc: Any = None
        if target != name:
            try:
                doc = json.loads(body)
            except (ValueError, RecursionError):
                return _error(NO_MODEL.status, NO_MODEL.message)
            doc["model"] = target
            body = json.dumps(doc).encode()
        remote = resolve(self.config, target) if self.config.peers else None
        if remote is not None:
            return await self.peers.forward(request, *remote, target, doc or json.loads(body))
        chosen = self.choose(body, target)
        if isinstance(chosen, Refusal):
            return _error(chosen.status, chosen.message, **chosen.extra)
        found, sent = chosen
        show = False
        if found.model.loading_state:
            show = wanted(request.path, doc or json.loads(body))
        path = found.model.prefix + request.path_qs
        return await self._forward(request, found, path, sent, show_loading=show)

    async def by_query(self, request: web.Request) -> web.StreamResponse:
        """A GET of ``BY_QUERY`` (llama-server's /props...): routed by its ``?model=`` as a
        POST is by its body, the query passed on (its model the target's, where profiles,
        selectors or a peer's name made it another)."""
        name = request.query.get("model")
        if not name:
            return _error(400, "the request must name its model: ?model=NAME")
        try:
            target, done = self.resolver.resolve(name)
        except Refused as err:
            return _error(err.status, err.message)
        if name in self.config.selectors:
            request[SELECTOR] = name
        try:
            remote = resolve(self.config, target) if self.config.peers else None
            if remote is not None:
                path = _with_model(request, remote[1])
                return await self.peers.forward(request, *remote, target, None, path)
            found = self._wrapper(target)
            if isinstance(found, web.Response):
                return found
            path = request.path_qs if target == name else _with_model(request, target)
            return await self._forward(request, found, found.model.prefix + path, b"")
        finally:
            done()

    def choose(
        self, body: bytes | bytearray, name: str | None = None
    ) -> tuple[Wrapper, Body] | Refusal:
        """The model a JSON body names (or ``name``), and the body to send it (its
        filters applied)."""
        if name is None:
            name = _named(body)
        if name is None:
            return NO_MODEL
        model = self.config.find(name)
        if model is None:
            return Refusal(404, f"model {name!r} not found", {"models": self.config.known()})
        found = self.wrappers[model.name]
        if not model.filters:
            return found, body
        try:
            doc = json.loads(body)
        except (ValueError, RecursionError):
            return NO_MODEL
        return found, json.dumps(model.filters.apply(doc, name)).encode()

    async def _by_form(self, request: web.Request, mark: bytes) -> web.StreamResponse:
        """A multipart form (an audio transcription, say): routed by its ``model`` field,
        read from its first bytes; the rest is passed on as it comes."""
        prefix = bytearray()
        name: str | None = None
        try:
            while name is None and not request.content.at_eof():
                await _read_some(request, prefix)
                name = bodies.form_model(prefix, mark)
                if name is None and len(prefix) > FORM_PREFIX:
                    raise bodies.Malformed("too far in")
        except bodies.Malformed:
            name = None
        if name is None:
            return _error(400, "the form must have a model field, before any file"
                               f" and within its first {FORM_PREFIX >> 20} MiB")  # fmt: skip
        found = self._wrapper(name)
        if isinstance(found, web.Response):
            return found
        length = request.content_length if "chunked" not in request.headers.get(
            "Transfer-Encoding", "").lower() else None  # fmt: skip
        if (length or 0) > MAX_BODY:
            return _too_large()
        stream = Stream(_counted(request, bytes(prefix)), length)
        del prefix
        path = found.model.prefix + request.path_qs
        return await self._forward(request, found, path, stream)

    async def stripped(self, request: web.Request) -> web.StreamResponse:
        """llama-swap's /v/... and /audioapi/... (``STRIPPED``): the prefix taken off,
        then routed by its model as any POST."""
        prefix = next(p for p in STRIPPED if request.raw_path.startswith(p + "/"))
        inner = request.clone(rel_url=request.raw_path[len(prefix) :])
        try:
            return await self.by_model(inner)
        finally:
            if MODEL in inner:  # counted (.metrics) by the request the middleware has
                request[MODEL] = inner[MODEL]

    async def to_comfyui(self, request: web.Request) -> web.Response:
        """llama-swap's /comfyui: to /comfyui/ (301 for GET and HEAD, else 308, which
        keeps the method), with the query."""
        query = request.rel_url.raw_query_string
        location = "/comfyui/" + (f"?{query}" if query else "")
        if request.method in ("GET", "HEAD"):
            raise web.HTTPMovedPermanently(location)
        raise web.HTTPPermanentRedirect(location)

    async def comfyui(self, request: web.Request) -> web.StreamResponse:
        """llama-swap's /comfyui/PATH: model ``comfyui_auto``'s server at /PATH, as
        /upstream/comfyui_auto/PATH but that only /comfyui/ itself may start the model
        (a page left open must not bring it back once it was released)."""
        w = self.wrappers.get(COMFYUI_MODEL)
        if w is None:
            return _error(404, f"local model {COMFYUI_MODEL} not found")
        rest = request.raw_path[len("/comfyui") :]
        if rest.partition("?")[0] != "/" and not (
            w.alive() and w.member_state() == State.RESIDENT.value
        ):
            return _error(409, f"model {COMFYUI_MODEL} is not loaded; only /comfyui/ can start it")
        path = w.model.prefix + rest
        if request.headers.get("Upgrade", "").lower() == "websocket":
            return await self._websocket(request, w, path)
        return await self._forward(request, w, path, None)

    async def upstream(self, request: web.Request) -> web.StreamResponse:
        # The longest name that the path starts with: a model's name may hold "/".
        rest = request.raw_path[len("/upstream/") :]
        names = [*self.config.models, *(a for m in self.config.models.values() for a in m.aliases)]
        bare, mark, query = rest.partition("?")
        if bare in names:
            # /upstream/MODEL: to /upstream/MODEL/, so that its page's relative URLs
            # resolve under it (301 for GET and HEAD, else 308, which keeps the method).
            location = f"/upstream/{bare}/{mark}{query}"
            if request.method in ("GET", "HEAD"):
                raise web.HTTPMovedPermanently(location)
            raise web.HTTPPermanentRedirect(location)
        name = max((n for n in names if rest.startswith(f"{n}/")), key=len, default=None)
        if name is None and self.config.peers:
            remote = upstream_peer(self.config, rest)
            if remote is not None:
                peer, model, path = remote
                return await self.peers.forward(request, peer, model, model, None, path)
        found = self._wrapper(request.match_info["model"] if name is None else name)
        if isinstance(found, web.Response):
            return found
        path = rest[len(name) + 1 :] if name is not None else ""
        if self._ignored(found, path):
            return _error(409, f"model {found.model.name} is not loaded;"
                               " path matches upstream.ignorePaths")  # fmt: skip
        if request.headers.get("Upgrade", "").lower() == "websocket":
            return await self._websocket(request, found, f"{found.model.prefix}/{path}")
        return await self._forward(request, found, f"{found.model.prefix}/{path}", None)

    def _ignored(self, w: Wrapper, path: str) -> bool:
        """Is ``path`` (after /upstream/MODEL/) one of upstream.ignorePaths, for a model
        that is not resident? Such a request does not bring its model in."""
        bare = "/" + unquote(path.partition("?")[0])
        if not any(p.search(bare) for p in self.config.ignore_paths):
            return False
        return not (w.alive() and w.member_state() == State.RESIDENT.value)

    async def _websocket(self, request: web.Request, w: Wrapper, path: str) -> web.StreamResponse:
        """A websocket through /upstream: taken here, and its messages relayed both ways
        over one opened to the model's server (through its wrapper, which holds it as
        it holds any connection while the model is released)."""
        await self._evict_for(w)
        w.ensure_running()
        # The handshake's own headers are aiohttp's client's to make.
        headers = {
            k: v
            for k, v in request.headers.items()
            if k.lower() not in _HOP and not k.lower().startswith("sec-websocket")
        }
        protocols = [
            p.strip() for p in request.headers.get("Sec-WebSocket-Protocol", "").split(",")
        ]
        async with aiohttp.ClientSession() as client:
            try:
                up = await client.ws_connect(f"http://127.0.0.1:{w.port}{path}", headers=headers,
                                              protocols=[p for p in protocols if p])  # fmt: skip
            except (aiohttp.ClientError, OSError) as err:
                return _error(502, f"model {w.model.name}: no websocket from its server: {err}")
            async with up:
                out = web.WebSocketResponse(protocols=[up.protocol] if up.protocol else ())
                await out.prepare(request)
                relays = [
                    asyncio.ensure_future(_relay(out, up)),
                    asyncio.ensure_future(_relay(up, out)),
                ]
                await asyncio.wait(relays, return_when=asyncio.FIRST_COMPLETED)
                for relay in relays:
                    relay.cancel()
                await out.close()
        return out

    async def _forward(
        self,
        request: web.Request,
        w: Wrapper,
        path: str,
        body: Body | None,
        show_loading: bool = False,
    ) -> web.StreamResponse:
        """``request`` passed to ``w`` in its turn; with ``show_loading``, a streaming
        chat for a model that is not resident is answered at once with its progress.
        In progress (``inflight``) until answered, and cancelled as llama-swap cancels."""
        request[MODEL] = w.model.name  # counted (.metrics)
        sent = body if isinstance(body, bytes | bytearray) else None  # a Stream is not held
        peer = None if request.transport is None else request.transport.get_extra_info("peername")
        flight = self.flights.start(w.model.name, request.method, _bare(path, w.model.prefix),
                                    request.headers.items(), peer, sent)  # fmt: skip
        flight.task = asyncio.current_task()
        flight.selector = request.get(SELECTOR)
        loading = None
        shown = f"{request.method} {request.path}"
        status = GONE
        try:
            try:
                if (
                    show_loading
                    and w.admitted < w.model.concurrency
                    and not (w.alive() and w.member_state() == State.RESIDENT.value)
                ):
                    loading = Loading(w.model.name,
                                      lambda: w.member_state() if w.alive() else None)  # fmt: skip
                    await loading.start(request)
                    flight.head(200, loading.out.headers.items())
                    self.flights.started(flight)

                async def send() -> web.StreamResponse:
                    return await self._pass(request, w, path, body, flight, loading)

                def status_of(out: web.StreamResponse) -> int:
                    return out.status

                out = await self.in_turn(w, shown, send, status_of, busy_response)
            except asyncio.CancelledError:
                if not flight.cancelled:
                    raise
                uncancel()
                w.info(f"{shown} cancelled")
                if loading is not None and loading.out.prepared:
                    out = await loading.fail(CANCELLED)
                else:
                    out = _error(502, CANCELLED)
            answer = out.body if isinstance(out, web.Response) else None
            if flight.resp_headers is None and isinstance(answer, bytes):  # serve's own
                flight.answered(out.status, out.headers.items(), answer)
            status = str(out.status)
            return out
        finally:
            if loading is not None:
                await loading.cancel()
            self.flights.end(flight, status)

    async def in_turn(
        self,
        w: Wrapper,
        shown: str,
        send: Callable[[], Awaitable[T]],
        status: Callable[[T], int],
        busy: Callable[[str], T],
    ) -> T:
        """``send()``'s answer, in the model's turn (``busy(why)``, a 429, over its
        concurrencyLimit); logged as ``shown`` with ``status(answer)``."""
        limit = w.model.concurrency
        if w.admitted >= limit:
            return busy(f"model {w.model.name}: {limit} requests at once already"
                        " (concurrencyLimit)")  # fmt: skip
        w.admitted += 1
        try:
            turns = self._turns(w)
            await turns.enter(w.model.name)
        except BaseException:
            w.admitted -= 1
            raise
        w.in_flight += 1
        if w.ttl_timer is not None:
            w.ttl_timer.cancel()
            w.ttl_timer = None
        began = time.monotonic()
        try:
            await self._evict_for(w)
            await self._make_room(w)
            w.ensure_running()
            out = await send()
            w.info(f"{shown} {status(out)} in {time.monotonic() - began:.3f} s")
            return out
        finally:
            self.leave(w, turns)

    async def _evict_for(self, w: Wrapper) -> None:
        """Release, through their release strategies, the models that the routing rules
        (groups, matrix) evict for ``w``'s, before it is let in; nothing when it is
        resident already, or without rules."""
        rules = self.config.routing
        if rules.engine is None or self._seen_resident == w.model.name:
            return
        if w.alive() and w.member_state() in HOLDING:
            # Until a request for another model comes, none can have become resident
            # beside it (models start on their requests): it need not be looked at again.
            self._seen_resident = w.model.name
            return
        self._seen_resident = None
        running = [n for n, o in self.wrappers.items()
                   if o is not w and o.alive() and o.member_state() in HOLDING]  # fmt: skip
        evicted = [self.wrappers[name] for name in rules.evict(w.model.name, running)]
        for other in evicted:
            other.info(f"releasing it for model {w.model.name} (routing)")
        # Shielded: a request cancelled meanwhile leaves the releases to finish.
        await asyncio.shield(asyncio.gather(*(self._unload(other) for other in evicted)))

    async def _make_room(self, w: Wrapper) -> None:
        """A model of ``w``'s arena that holds the GPU for good (``auto`` found no way
        to release it) would make ``w`` wait forever: it is restarted, as llama-swap
        does to every model. Its turn is over (``Turns``): none of its requests runs.
        Looked for once a model of the arena takes over from another, not per request."""
        where = (w.model.arena, w.model.gpu)
        last = self.served.get(where)
        if last == w.model.name:
            return
        self.served[where] = w.model.name
        if last is not None and last in self.pools:
            # Its kept-alive connections would keep its wrapper busy for its --idle
            # (run's 300 ms) after their last traffic: closed, it releases at once. Its
            # turn is over, so none of them is in use.
            self.pools[last].close()
        for other in self.wrappers.values():
            same = (other.model.arena, other.model.gpu) == where
            maybe = other.model.release == "auto" and other.in_flight == 0 and other.alive()
            if other is not w and same and maybe and other.holds_for_good():
                other.info(f"restarting it (it cannot release) for model {w.model.name}")
                await other.restart()

    async def _pass(
        self,
        request: web.Request,
        w: Wrapper,
        path: str,
        body: Body | None,
        flight: Flight,
        loading: Loading | None = None,
    ) -> web.StreamResponse:
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in _HOP]
        if body is None:  # /upstream: passed on as it comes
            if (request.content_length or 0) > MAX_BODY:
                return _too_large()
            chunked = "chunked" in request.headers.get("Transfer-Encoding", "").lower()
            length = None if chunked else request.content_length
            body = Stream(_counted(request), length) if chunked or length else b""
        try:
            up = await self._pool(w).request(request.method, path, headers, body, w.exited)
        except UpstreamTimeout as err:
            message = f"model {w.model.name}: {err}"
            return _error(504, message) if loading is None else await loading.fail(message)
        except _TooLarge:
            return _too_large()
        except OSError as err:
            cause = await w.cause(err)
            message = f"model {w.model.name}: its server did not answer: {cause}"
            return _error(502, message) if loading is None else await loading.fail(message)
        if loading is not None:
            try:
                return await loading.relay(request, up, flight.took)
            finally:
                await up.body.aclose()
        headers = [(k, v) for k, v in up.headers if k.lower() not in _HOP]
        try:
            if up.length is not None and up.length <= WHOLE:
                try:
                    whole = b"".join([chunk async for chunk in up.body])
                except OSError as err:
                    return _error(502, f"model {w.model.name}: its server did not answer: {err}")
                flight.answered(up.status, headers, whole)
                return web.Response(status=up.status, reason=up.reason, headers=headers, body=whole)
            out = web.StreamResponse(status=up.status, reason=up.reason, headers=headers)
            if up.length is not None:
                out.content_length = up.length
            try:
                await out.prepare(request)
                flight.head(up.status, headers)
                self.flights.started(flight)
                async for chunk in up.body:
                    await out.write(chunk)
                    flight.took(chunk)
                await out.write_eof()
            except OSError:
                # Cut in the middle: cut the client's connection too, so that it sees the
                # answer end early rather than wait for the rest.
                if request.transport is not None:
                    request.transport.abort()
            except asyncio.CancelledError:
                if not (flight.cancelled and out.prepared):
                    raise
                # Cancelled (POST /api/inflight/ID/cancel): the answer ends where it
                # stands, as llama-swap's; one of announced length cannot, and is cut.
                uncancel()
                self._ended_early(request, out, up.length is None)
                w.info(f"{request.method} {request.path} cancelled")
            return out
        finally:
            # Also when the client went away (cancelled): the connection to the wrapper
            # is closed at once, not left looking like a request awaiting its answer.
            await up.body.aclose()

    @staticmethod
    def _ended_early(request: web.Request, out: web.StreamResponse, chunked: bool) -> None:
        """A cancelled answer's end: its last chunk where it is chunked, else the client's
        connection cut."""
        if chunked and "chunked" in out.headers.get("Transfer-Encoding", ""):
            return  # aiohttp writes the last chunk once the handler returns it
        if request.transport is not None:
            request.transport.abort()

    # -- ttl and unload ------------------------------------------------------------

    def _arm_ttl(self, w: Wrapper) -> None:
        if w.model.ttl > 0 and w.in_flight == 0:
            loop = asyncio.get_running_loop()
            w.ttl_timer = loop.call_later(w.model.ttl, self._ttl_expired, w)

    def _ttl_expired(self, w: Wrapper) -> None:
        w.ttl_timer = None
        if w.in_flight == 0:
            self._unload(w)

    def _unload(self, w: Wrapper) -> asyncio.Task[bool]:
        if w.unloading is None or w.unloading.done():
            w.unloading = asyncio.get_running_loop().create_task(w.unload_bounded())
        return w.unloading

    async def unload_one(self, request: web.Request) -> web.Response:
        found = self._wrapper(request.match_info["model"])
        if isinstance(found, web.Response):
            return found
        released = await self._unload(found)
        return web.json_response({"model": found.model.name, "released": released})

    async def _unload_all(self) -> list[str]:
        """Release every resident model; the names of those that were."""
        tasks = {name: self._unload(w) for name, w in self.wrappers.items()}
        done = {name: await task for name, task in tasks.items()}
        return [name for name, ok in done.items() if ok]

    async def unload_all(self, request: web.Request) -> web.Response:
        return web.json_response({"released": await self._unload_all()})

    async def unload_all_plain(self, request: web.Request) -> web.Response:
        """llama-swap's GET /unload: "OK" once every model is released."""
        await self._unload_all()
        return web.Response(text="OK")

    async def api_unload_all(self, request: web.Request) -> web.Response:
        """llama-swap's POST /api/models/unload."""
        await self._unload_all()
        return web.json_response({"msg": "ok"})

    async def api_unload_one(self, request: web.Request) -> web.Response:
        """llama-swap's POST /api/models/unload/MODEL: "OK" once it is released."""
        found = self._wrapper(request.match_info["model"])
        if isinstance(found, web.Response):
            return found
        await self._unload(found)
        return web.Response(text="OK")

    async def no_route(self, request: web.Request) -> web.Response:
        return _error(404, f"{request.method} {request.path}: no such route")

    # -- what is there -------------------------------------------------------------
