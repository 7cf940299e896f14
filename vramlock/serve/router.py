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
import json
from collections.abc import Coroutine
from typing import Any
from urllib.parse import unquote

from aiohttp import web
from aiohttp.typedefs import Middleware

from .. import __version__
from ..arena.records import State
from . import body as bodies
from . import doors
from .activity import Activity
from .api import get, info, models, only, page, refuse_others
from .config import COMFYUI_MODEL, Config
from .doors import Keys
from .errors import error_response as _error
from .errors import negotiated
from .events import Events, model_status
from .exchange import NO_MODEL, Chosen, Exchange, Refusal
from .fast import FastPath
from .forward import SELECTOR, Forwarder
from .front import Front, Head
from .hardware import Hardware, Performance
from .inflight import Flights
from .loading import wanted
from .logs import Logs, add_routes
from .members import Wrapper, states
from .metrics import Requests
from .peers import Peers, resolve, upstream_peer
from .reading import FORM_PREFIX, MAX_BODY, counted, held, named, read_some, too_large
from .selectors import Refused, Resolver
from .turns import GROUP_WAIT as GROUP_WAIT
from .upstream import Stream

# Once serve ends, a request that was told why has this long to say it.
ANSWER_GRACE = 1.0
# llama-swap's GET routes whose request names its model as ?model=NAME.
BY_QUERY = ("/props", "/v1/audio/voices", "/sdapi/v1/loras")
# Prefixes that llama-swap strips before a POST is routed by its model: /v/ (clients that
# add their own version, /v/chat/completions reaching /v1/...'s server as
# /chat/completions) and /audioapi/ (audio.cpp's /v1/tasks/run).
STRIPPED = ("/v", "/audioapi")


def _with_model(request: web.Request, model: str) -> str:
    """The request's path and query, its ``model`` parameter ``model``."""
    return str(request.rel_url.update_query(model=model))


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

    def _wrapper(self, name: str) -> Wrapper | web.Response:
        model = self.config.find(name)
        if model is None:
            return _error(404, f"model {name!r} not found", models=self.config.known())
        return self.wrappers[model.name]

    # -- forwarding ----------------------------------------------------------------

    async def by_model(self, request: web.Request) -> web.StreamResponse:
        mark = bodies.boundary(request.headers.get("Content-Type", ""))
        if mark is not None:
            return await self._by_form(request, mark)
        body = await held(request)
        if isinstance(body, web.Response):
            return body
        name = named(body)
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
        chosen = self.exchange.choose(body, target)
        if isinstance(chosen, Refusal):
            return _error(chosen.status, chosen.message, **chosen.extra)
        found, sent = chosen
        show = False
        if found.model.loading_state:
            show = wanted(request.path, doc or json.loads(body))
        path = found.model.prefix + request.path_qs
        return await self.forwarder.forward(request, found, path, sent, show_loading=show)

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
            return await self.forwarder.forward(request, found, found.model.prefix + path, b"")
        finally:
            done()

    async def _by_form(self, request: web.Request, mark: bytes) -> web.StreamResponse:
        """A multipart form (an audio transcription, say): routed by its ``model`` field,
        read from its first bytes; the rest is passed on as it comes."""
        prefix = bytearray()
        name: str | None = None
        try:
            while name is None and not request.content.at_eof():
                await read_some(request, prefix)
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
            return too_large()
        stream = Stream(counted(request, bytes(prefix)), length)
        del prefix
        path = found.model.prefix + request.path_qs
        return await self.forwarder.forward(request, found, path, stream)

    async def stripped(self, request: web.Request) -> web.StreamResponse:
        """llama-swap's /v/... and /audioapi/... (``STRIPPED``): the prefix taken off,
        then routed by its model as any POST."""
        prefix = next(p for p in STRIPPED if request.raw_path.startswith(p + "/"))
        inner = request.clone(rel_url=request.raw_path[len(prefix) :])
        return await self.by_model(inner)

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
            return await self.forwarder.websocket(request, w, path)
        return await self.forwarder.forward(request, w, path, None)

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
            return await self.forwarder.websocket(request, found, f"{found.model.prefix}/{path}")
        return await self.forwarder.forward(request, found, f"{found.model.prefix}/{path}", None)

    def _ignored(self, w: Wrapper, path: str) -> bool:
        """Is ``path`` (after /upstream/MODEL/) one of upstream.ignorePaths, for a model
        that is not resident? Such a request does not bring its model in."""
        bare = "/" + unquote(path.partition("?")[0])
        if not any(p.search(bare) for p in self.config.ignore_paths):
            return False
        return not (w.alive() and w.member_state() == State.RESIDENT.value)

    # -- ttl and unload ------------------------------------------------------------

    async def unload_one(self, request: web.Request) -> web.Response:
        found = self._wrapper(request.match_info["model"])
        if isinstance(found, web.Response):
            return found
        released = await self.exchange.unload(found)
        return web.json_response({"model": found.model.name, "released": released})

    async def _unload_all(self) -> list[str]:
        """Release every resident model; the names of those that were."""
        tasks = {name: self.exchange.unload(w) for name, w in self.wrappers.items()}
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
        await self.exchange.unload(found)
        return web.Response(text="OK")

    async def no_route(self, request: web.Request) -> web.Response:
        return _error(404, f"{request.method} {request.path}: no such route")

    # -- what is there -------------------------------------------------------------
