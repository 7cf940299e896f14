"""The routes that reach a model: a POST by its body's ``model`` (JSON, or a form's
field), a GET by its ``?model=``, llama-swap's stripped prefixes, ``/upstream/MODEL/``
and ``/comfyui/`` passed through, a peer's model to its peer. Each goes the exchange's
way through the forwarder (.forward), a peer's through .peers."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import unquote

from aiohttp import web
from aiohttp.web_urldispatcher import AbstractResource

from ..arena.records import State
from . import body as bodies
from .api import get
from .config import COMFYUI_MODEL
from .errors import error_response as _error
from .exchange import NO_MODEL, Refusal
from .forward import SELECTOR
from .inflight import dispatched
from .loading import wanted
from .peers import resolve, upstream_peer
from .reading import FORM_PREFIX, MAX_BODY, counted, held, named, read_some, too_large
from .selectors import Refused
from .upstream import Stream

if TYPE_CHECKING:
    from .config import Config
    from .exchange import Exchange
    from .forward import Forwarder
    from .members import Wrapper
    from .peers import Peers
    from .selectors import Resolver

Done = Callable[[], None]
# llama-swap's GET routes whose request names its model as ?model=NAME.
BY_QUERY = ("/props", "/v1/audio/voices", "/sdapi/v1/loras")
# Prefixes that llama-swap strips before a POST is routed by its model: /v/ (clients that
# add their own version, /v/chat/completions reaching /v1/...'s server as
# /chat/completions) and /audioapi/ (audio.cpp's /v1/tasks/run).
STRIPPED = ("/v", "/audioapi")


def _with_model(request: web.Request, model: str) -> str:
    """The request's path and query, its ``model`` parameter ``model``."""
    return str(request.rel_url.update_query(model=model))


class Reaching(Protocol):
    """What these routes read of serve (the router has it), when asked."""

    config: Config
    resolver: Resolver
    wrappers: dict[str, Wrapper]
    peers: Peers
    exchange: Exchange
    forwarder: Forwarder

    def wrapper(self, name: str) -> Wrapper | web.Response: ...


class ByModel:
    """The handlers."""

    def __init__(self, s: Reaching) -> None:
        self.s = s

    def register_passing(self, app: web.Application) -> None:
        """/upstream/MODEL/... and /comfyui/...: passed through unread."""
        r = app.router
        r.add_route("*", "/upstream/{model}", self.upstream)
        r.add_route("*", "/upstream/{model}/{path:.*}", self.upstream)
        r.add_route("*", "/comfyui", self.to_comfyui)
        r.add_route("*", "/comfyui/{path:.*}", self.comfyui)

    def register_routed(self, app: web.Application) -> AbstractResource | None:
        """The routes by ``?model=`` and by body, last: the catch-all POST's resource."""
        r = app.router
        for path in BY_QUERY:
            # llama-swap routes a POST /v1/audio/voices by its body, as any POST
            if path == "/v1/audio/voices":
                r.add_get(path, self.by_query)
            else:
                get(app, path, self.by_query)
        for prefix in STRIPPED:
            r.add_post(prefix + "/{path:.*}", self.stripped)
        return r.add_post("/{path:.*}", self.by_model).resource

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
        resolved = self._resolved(request, name)
        if isinstance(resolved, web.Response):
            return resolved
        target, done = resolved
        try:
            return await self._by_name(request, name, target, body)
        finally:
            done()

    def _resolved(self, request: web.Request, name: str) -> tuple[str, Done] | web.Response:
        """The name that serves ``name`` (profiles and selectors applied) and what to call
        once its request is done, the selector it reaches marked on ``request`` for its
        activity; the refusal where the active profile disables ``name``."""
        try:
            target, done = self.s.resolver.resolve(name)
        except Refused as err:
            return _error(err.status, err.message)
        if (selector := self.s.resolver.selector_of(name)) is not None:
            request[SELECTOR] = selector
        return target, done

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
        remote = resolve(self.s.config, target) if self.s.config.peers else None
        if remote is not None:
            return await self.s.peers.forward(request, *remote, target, doc or json.loads(body))
        chosen = self.s.exchange.choose(body, target)
        if isinstance(chosen, Refusal):
            return _error(chosen.status, chosen.message, **chosen.extra)
        found, sent = chosen
        show = False
        if found.model.loading_state:
            show = wanted(request.path, doc or json.loads(body))
        path = found.model.prefix + request.path_qs
        return await self.s.forwarder.forward(request, found, path, sent, show_loading=show)

    async def by_query(self, request: web.Request) -> web.StreamResponse:
        """A GET of ``BY_QUERY`` (llama-server's /props...): routed by its ``?model=`` as a
        POST is by its body, the query passed on (its model the target's, where profiles,
        selectors or a peer's name made it another)."""
        name = request.query.get("model")
        if not name:
            return _error(400, "the request must name its model: ?model=NAME")
        resolved = self._resolved(request, name)
        if isinstance(resolved, web.Response):
            return resolved
        target, done = resolved
        try:
            remote = resolve(self.s.config, target) if self.s.config.peers else None
            if remote is not None:
                path = _with_model(request, remote[1])
                return await self.s.peers.forward(request, *remote, target, None, path)
            found = self.s.wrapper(target)
            if isinstance(found, web.Response):
                return found
            path = request.path_qs if target == name else _with_model(request, target)
            return await self.s.forwarder.forward(request, found, found.model.prefix + path, b"")
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
        found = self.s.wrapper(name)
        if isinstance(found, web.Response):
            return found
        length = request.content_length if "chunked" not in request.headers.get(
            "Transfer-Encoding", "").lower() else None  # fmt: skip
        if (length or 0) > MAX_BODY:
            return too_large()
        use = found.model.filters.model  # useModelName: the form's field says it
        if use is not None and use != name:
            sent = bodies.form_with_model(prefix, mark, use)
            length = None if length is None else length + len(sent) - len(prefix)
            prefix = bytearray(sent)
        stream = Stream(counted(request, bytes(prefix)), length)
        del prefix
        path = found.model.prefix + request.path_qs
        return await self.s.forwarder.forward(request, found, path, stream)

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
        w = self.s.wrappers.get(COMFYUI_MODEL)
        if w is None:
            return _error(404, f"local model {COMFYUI_MODEL} not found")
        rest = request.raw_path[len("/comfyui") :]
        if rest.partition("?")[0] != "/" and not (
            w.alive() and w.member_state() == State.RESIDENT.value
        ):
            return _error(409, f"model {COMFYUI_MODEL} is not loaded; only /comfyui/ can start it")
        path = w.model.prefix + rest
        if request.headers.get("Upgrade", "").lower() == "websocket":
            return await self.s.forwarder.websocket(request, w, path)
        return await self.s.forwarder.forward(request, w, path, None)

    async def upstream(self, request: web.Request) -> web.StreamResponse:
        # The longest name that the path starts with: a model's name may hold "/".
        rest = request.raw_path[len("/upstream/") :]
        names = [
            *self.s.config.models,
            *(a for m in self.s.config.models.values() for a in m.aliases),
        ]
        try:
            pinned = self.s.resolver.pinned(rest)  # the active profile's pins first
        except Refused as err:
            return _error(err.status, err.message)
        if pinned is not None:
            found = self.s.wrapper(pinned[0])
            if isinstance(found, web.Response):
                return found
            told = dispatched(request.method, f"/{pinned[1]}")
            path = f"{found.model.prefix}/{pinned[1]}"
            return await self.s.forwarder.forward(request, found, path, None, told=told)
        bare, mark, query = rest.partition("?")
        if bare in names:
            # /upstream/MODEL: to /upstream/MODEL/, so that its page's relative URLs
            # resolve under it (301 for GET and HEAD, else 308, which keeps the method).
            location = f"/upstream/{bare}/{mark}{query}"
            if request.method in ("GET", "HEAD"):
                raise web.HTTPMovedPermanently(location)
            raise web.HTTPPermanentRedirect(location)
        # "author%2Fmodel/..." names model author/model too, as in llama-swap
        named = [(len(f), n) for n in names for f in {n, n.replace("/", "%2F")}
                 if rest.replace("%2f", "%2F").startswith(f"{f}/")]  # fmt: skip
        cut, name = max(named, default=(0, None))
        if name is None and self.s.config.peers:
            remote = upstream_peer(self.s.config, rest)
            if remote is not None:
                peer, model, path = remote
                asked = rest[: len(rest) - len(path)]  # the name the path used
                return await self.s.peers.forward(request, peer, model, asked, None, path)
        found = self.s.wrapper(request.match_info["model"] if name is None else name)
        if isinstance(found, web.Response):
            return found
        path = rest[cut + 1 :] if name is not None else ""
        if self._ignored(found, path):
            return _error(409, f"model {found.model.name} is not loaded;"
                               " path matches upstream.ignorePaths")  # fmt: skip
        if request.headers.get("Upgrade", "").lower() == "websocket":
            return await self.s.forwarder.websocket(request, found, f"{found.model.prefix}/{path}")
        told = dispatched(request.method, f"/{path}")  # a probe is forwarded, not told
        path = f"{found.model.prefix}/{path}"
        return await self.s.forwarder.forward(request, found, path, None, told=told)

    def _ignored(self, w: Wrapper, path: str) -> bool:
        """Is ``path`` (after /upstream/MODEL/) one of upstream.ignorePaths, for a model
        that is not resident? Such a request does not bring its model in."""
        bare = "/" + unquote(path.partition("?")[0])
        if not any(p.search(bare) for p in self.s.config.ignore_paths):
            return False
        return not (w.alive() and w.member_state() == State.RESIDENT.value)

    # -- ttl and unload ------------------------------------------------------------
