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
import base64
import binascii
import hmac
import json
import time
from typing import Any
from urllib.parse import unquote

import aiohttp
from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from ..arena.records import HOLDING, State
from .config import Config
from .loading import Loading, wanted
from .logs import Logs, add_routes
from .members import Wrapper
from .peers import Peers, entries, resolve, upstream_peer
from .selectors import Refused, Resolver
from .upstream import Pool

# Once a request for another model has waited this long, new requests for the model
# being served queue behind it: grouping never starves a model for longer.
GROUP_WAIT = 2.0
# When the model being served has no request left, its turn lasts this much longer, for
# a client's next request (within the wrappers' 300 ms --idle, so it costs no time).
LINGER = 0.1
# A response of known length up to this size is read whole and sent in one write;
# others (streams, chunked, large) are passed on chunk by chunk as they come.
WHOLE = 1 << 20
# A request body larger than this is refused (413): bodies are read whole, to find the
# model, and several large ones at once must not exhaust memory.
MAX_BODY = 64 << 20
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
    request of the model waiting longest is admitted. With nothing in progress, a model
    other than the last one served waits ``LINGER`` first, so that a burst starts with
    the model that is likely resident. A B A B arriving together are served A A B B;
    clients that never pause take turns of about ``GROUP_WAIT``, so a request waits at
    most that long for each other model's turn (and its swap).
    """

    def __init__(self) -> None:
        self.current: str | None = None
        self.active = 0
        self._queued: dict[str, list[tuple[float, asyncio.Future[None]]]] = {}
        self._switch: asyncio.TimerHandle | None = None
        self._turn_began = 0.0
        self._last: str | None = None  # the model of the last turn: likely resident

    def _overdue(self) -> bool:
        """Has the current turn lasted GROUP_WAIT since it began and since somebody
        else started waiting?"""
        oldest = min((q[0][0] for q in self._queued.values() if q), default=None)
        if oldest is None:
            return False
        return time.monotonic() - max(oldest, self._turn_began) > GROUP_WAIT

    async def enter(self, model: str) -> None:
        idle = self.current is None and self._last in (None, model)
        if idle or (self.current == model and not self._overdue()):
            if self._switch is not None:
                self._switch.cancel()
                self._switch = None
            if self.current is None:
                self._begin(model)
            self.active += 1
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        queue = self._queued.setdefault(model, [])
        queue.append((time.monotonic(), fut))
        if self.current is None and self._switch is None:
            # Nothing in progress, but this model is likely not resident: a request for
            # the one that is, arriving within LINGER (a burst), goes first.
            self._switch = asyncio.get_running_loop().call_later(LINGER, self._next)
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
        self.current = self._last = model
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
        model = min(waiting, key=lambda m: waiting[m][0][0])
        self._begin(model)
        for _, fut in self._queued.pop(model):
            self.active += 1
            fut.set_result(None)


# OpenAI's error.type for the statuses that have their own.
_KINDS = {401: "authentication_error", 429: "rate_limit_error"}


def _error(status: int, message: str, **extra: Any) -> web.Response:
    """An error as the OpenAI API answers one (``error.message`` and ``error.type``)."""
    kind = _KINDS.get(status, "invalid_request_error" if status < 500 else "server_error")
    body = {"error": {"code": status, "message": message, "type": kind, "param": None}, **extra}
    return web.json_response(body, status=status)


async def _body(request: web.Request) -> bytes | web.Response:
    """The request's body, or a 413 when it is over ``MAX_BODY`` (said before any of it
    is read where Content-Length tells)."""
    too_large = _error(413, f"the request body is over {MAX_BODY >> 20} MiB")
    if (request.content_length or 0) > MAX_BODY:
        return too_large
    try:
        return await request.read()
    except web.HTTPRequestEntityTooLarge:
        return too_large


def _key(request: web.Request) -> str | None:
    """The API key a request carries, as llama-swap reads it: Authorization's Basic
    password, else its Bearer token, else x-api-key."""
    scheme, _, credentials = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() == "basic":
        try:
            _, colon, password = base64.b64decode(credentials, validate=True).partition(b":")
        except (ValueError, binascii.Error):
            colon = b""
        if colon and password:
            return password.decode("utf-8", "replace")
    if scheme.lower() == "bearer" and credentials:
        return credentials
    return request.headers.get("x-api-key")


def _auth(keys: tuple[str, ...]) -> Middleware:
    """Every route but /health wants one of ``keys``: 401 without it."""
    wanted = [k.encode() for k in keys]

    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        given = _key(request)
        ok = given is not None and any(
            hmac.compare_digest(given.encode(), k) for k in wanted
        )  # fmt: skip
        if ok or request.path == "/health":
            return await handler(request)
        refused = _error(401, "unauthorized: invalid or missing API key")
        refused.headers["WWW-Authenticate"] = 'Basic realm="vramlock"'
        return refused

    return check


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
        self.peers = Peers()
        self.resolver = Resolver(config, self._state_of)
        middlewares = [_auth(config.api_keys)] if config.api_keys else []
        self.app = web.Application(client_max_size=MAX_BODY, middlewares=middlewares)
        r = self.app.router
        r.add_get("/health", self.health)
        r.add_get("/v1/models", self.list_models)
        r.add_get("/v1/models/{model:.+}", self.one_model)
        r.add_get("/running", self.running)
        r.add_post("/models/unload", self.unload_all)
        r.add_post("/models/unload/{model}", self.unload_one)
        r.add_get("/unload", self.unload_all_plain)
        r.add_post("/api/models/unload", self.api_unload_all)
        r.add_post("/api/models/unload/{model:.+}", self.api_unload_one)
        r.add_get("/upstream", self.upstream_list)
        r.add_route("*", "/upstream/{model}/{path:.*}", self.upstream)
        if logs is not None:
            add_routes(r, logs, self._name)
        r.add_get("/api/profiles", self.api_profiles)
        r.add_put("/api/profiles/active", self.api_active_profile)
        r.add_post("/{path:.*}", self.by_model)
        r.add_route("*", "/{path:.*}", self.no_route)
        self.app.on_cleanup.append(self._close)

    async def _close(self, app: web.Application) -> None:
        for pool in self.pools.values():
            pool.close()
        await self.peers.close()

    def _state_of(self, name: str) -> str | None:
        """Model ``name``'s member state; None when its wrapper is not running."""
        w = self.wrappers.get(name)
        return w.member_state() if w is not None and w.alive() else None

    def _name(self, name: str) -> str | None:
        """The model ``name`` names (directly or as an alias); None if none."""
        model = self.config.find(name)
        return None if model is None else model.name

    def _wrapper(self, name: str) -> Wrapper | web.Response:
        model = self.config.find(name)
        if model is None:
            return _error(404, f"model {name!r} not found", models=self.config.known())
        return self.wrappers[model.name]

    def _turns(self, w: Wrapper) -> Turns:
        return self.turns.setdefault((w.model.arena, w.model.gpu), Turns())

    # -- forwarding ----------------------------------------------------------------

    async def by_model(self, request: web.Request) -> web.StreamResponse:
        body = await _body(request)
        if isinstance(body, web.Response):
            return body
        try:
            doc = json.loads(body)
            name = doc.get("model")
        except (ValueError, AttributeError, RecursionError):  # RecursionError: nested deep
            name = None
        if not isinstance(name, str):
            return _error(400, 'the request body must be JSON with a "model" field')
        try:
            target, done = self.resolver.resolve(name)
        except Refused as err:
            return _error(err.status, err.message)
        try:
            if target != name:
                doc["model"] = target
                body = json.dumps(doc).encode()
            return await self._by_name(request, target, doc, body)
        finally:
            done()

    async def _by_name(
        self, request: web.Request, name: str, doc: Any, body: bytes
    ) -> web.StreamResponse:
        """A request for ``name`` (profiles and selectors applied): to a peer or a model."""
        remote = resolve(self.config, name) if self.config.peers else None
        if remote is not None:
            return await self.peers.forward(request, *remote, name, doc)
        found = self._wrapper(name)
        if isinstance(found, web.Response):
            return found
        if found.model.filters:
            body = json.dumps(found.model.filters.apply(doc, name)).encode()
        show = bool(found.model.loading_state) and wanted(request.path, doc)
        path = found.model.prefix + request.path_qs
        return await self._forward(request, found, path, body, show_loading=show)

    async def api_profiles(self, request: web.Request) -> web.Response:
        """llama-swap's GET /api/profiles: the active profile (or null) and every one."""
        return web.json_response(self.resolver.profiles())

    async def api_active_profile(self, request: web.Request) -> web.Response:
        """llama-swap's PUT /api/profiles/active, {"name": NAME or null}."""
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
            self.resolver.set_active(name or None)
        except KeyError:
            return _error(404, f"profile {name!r} not found")
        return web.json_response({"active": self.resolver.active})

    async def upstream(self, request: web.Request) -> web.StreamResponse:
        # The longest name that the path starts with: a model's name may hold "/".
        rest = request.raw_path[len("/upstream/") :]
        names = [*self.config.models, *(a for m in self.config.models.values() for a in m.aliases)]
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
        body: bytes | None,
        show_loading: bool = False,
    ) -> web.StreamResponse:
        limit = w.model.concurrency
        if w.admitted >= limit:
            return _error(429, f"model {w.model.name}: {limit} requests at once already"
                               " (concurrencyLimit)")  # fmt: skip
        loading = None
        if show_loading and not (w.alive() and w.member_state() == State.RESIDENT.value):
            loading = Loading(w.model.name, lambda: w.member_state() if w.alive() else None)
            await loading.start(request)
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
            await self._make_room(w)
            w.ensure_running()
            out = await self._pass(request, w, path, body, loading)
            w.info(
                f"{request.method} {request.path} {out.status} in {time.monotonic() - began:.3f} s"
            )
            return out
        finally:
            w.in_flight -= 1
            w.admitted -= 1
            turns.leave()
            self._arm_ttl(w)
            if loading is not None:
                await loading.cancel()

    async def _make_room(self, w: Wrapper) -> None:
        """A model of ``w``'s arena that holds the GPU for good (``auto`` found no way
        to release it) would make ``w`` wait forever: it is restarted, as llama-swap
        does to every model. Its turn is over (``Turns``): none of its requests runs.
        Looked for once a model of the arena takes over from another, not per request."""
        where = (w.model.arena, w.model.gpu)
        if self.served.get(where) == w.model.name:
            return
        self.served[where] = w.model.name
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
        body: bytes | None,
        loading: Loading | None = None,
    ) -> web.StreamResponse:
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in _HOP]
        if body is None:
            read = await _body(request)
            if isinstance(read, web.Response):
                return read
            body = read
        pool = self.pools.setdefault(w.model.name, Pool(w.port))
        try:
            up = await w.unless_exited(pool.request(request.method, path, headers, body))
        except OSError as err:
            cause = await w.cause(err)
            message = f"model {w.model.name}: its server did not answer: {cause}"
            return _error(502, message) if loading is None else await loading.fail(message)
        if loading is not None:
            try:
                return await loading.relay(request, up)
            finally:
                await up.body.aclose()
        headers = [(k, v) for k, v in up.headers if k.lower() not in _HOP]
        try:
            if up.length is not None and up.length <= WHOLE:
                try:
                    whole = b"".join([chunk async for chunk in up.body])
                except OSError as err:
                    return _error(502, f"model {w.model.name}: its server did not answer: {err}")
                return web.Response(status=up.status, reason=up.reason, headers=headers, body=whole)
            out = web.StreamResponse(status=up.status, reason=up.reason, headers=headers)
            if up.length is not None:
                out.content_length = up.length
            try:
                await out.prepare(request)
                async for chunk in up.body:
                    await out.write(chunk)
                await out.write_eof()
            except OSError:
                # Cut in the middle: cut the client's connection too, so that it sees the
                # answer end early rather than wait for the rest.
                if request.transport is not None:
                    request.transport.abort()
            return out
        finally:
            # Also when the client went away (cancelled): the connection to the wrapper
            # is closed at once, not left looking like a request awaiting its answer.
            await up.body.aclose()

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
            w.unloading = asyncio.get_running_loop().create_task(
                w.unload(self.config.health_timeout)
            )
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

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="OK")

    def _entry(self, w: Wrapper, alias: str | None = None) -> dict[str, Any]:
        """A model's /v1/models entry (or its alias's, for includeAliasesInList), with
        llama-swap's meta.llamaswap (metadata and type) and capabilities."""
        m = w.model
        entry: dict[str, Any] = {"id": alias or m.name, "object": "model", "owned_by": "vramlock"}
        if m.title is not None:
            entry["name"] = m.title
        if m.description is not None:
            entry["description"] = m.description
        entry["aliases"] = list(m.aliases)
        entry["state"] = w.state().value
        kind = {"type": "alias", "modelID": m.name} if alias else {"type": "model"}
        entry["meta"] = {"llamaswap": {**m.metadata, **kind}}
        if m.capabilities:
            entry["capabilities"] = m.capabilities
            if isinstance(m.capabilities.get("context"), int):
                entry["meta"]["n_ctx"] = m.capabilities["context"]
        return entry

    async def list_models(self, request: web.Request) -> web.Response:
        data = []
        for w in self.wrappers.values():
            if not w.model.unlisted:
                data.append(self._entry(w))
                if self.config.aliases_listed:
                    data += [self._entry(w, alias) for alias in w.model.aliases]
        data += entries(self.config)
        data += self.resolver.entries({*self.config.known(), *(d["id"] for d in data)})
        return web.json_response({"object": "list", "data": data})

    async def one_model(self, request: web.Request) -> web.Response:
        """OpenAI's GET /v1/models/ID: one model's entry (by name or alias)."""
        found = self._wrapper(request.match_info["model"])
        if isinstance(found, web.Response):
            return found
        return web.json_response(self._entry(found))

    async def upstream_list(self, request: web.Request) -> web.Response:
        """The models whose servers /upstream/MODEL/PATH reaches, with that path."""
        data = [{"id": name, "upstream": f"/upstream/{name}/"} for name in self.wrappers]
        return web.json_response({"object": "list", "data": data})

    async def running(self, request: web.Request) -> web.Response:
        states = {name: w.state().value for name, w in self.wrappers.items()}
        running = [
            {"model": name, "state": state, "proxy": f"http://{self.wrappers[name].model.upstream}"}
            for name, state in states.items()
            if state in HOLDING
        ]
        return web.json_response({"running": running})
