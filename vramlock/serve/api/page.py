"""What is there to see without asking a model: health, ``/metrics``, the page at
``/ui/`` (``vramlock ui``'s, of serve's arenas and models) and the redirects to it.

None of it is activity: no model starts, none stays resident for it (see ..metrics).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from aiohttp import web
from aiohttp.typedefs import Handler

from ..errors import error_response
from ..metrics import Requests, gpu_of, metrics, places, registry
from ..passing import briefly
from . import Serving, get, refuse_others

if TYPE_CHECKING:
    from ..logs import Logs
    from ..members import Wrapper

# The page shows serve's last this many log lines.
LINES = 30


async def health(request: web.Request) -> web.Response:
    return web.Response(text="OK")


async def to_ui(request: web.Request) -> web.Response:
    """/ui: to the page."""
    raise web.HTTPFound("/ui/")


async def to_models(request: web.Request) -> web.Response:
    """/upstream: to the page's models, as llama-swap redirects it (the same page)."""
    raise web.HTTPFound("/ui/models")


async def root(request: web.Request) -> web.Response:
    """GET /: to /ui, as llama-swap redirects it (and /ui to the page, /ui/)."""
    raise web.HTTPFound("/ui")


def ui_app(
    wrappers: dict[str, Wrapper], requests: Requests, logs: Logs | None = None
) -> web.Application:
    """``vramlock ui``'s page, of serve's arenas, with each model's state and requests,
    and serve's last ``LINES`` log lines. The models' states are read as /v1/models reads
    them (no wrapper is started)."""
    from ...ui import Watch, app, merge, page

    watches = []
    for w in places(wrappers.values()).values():
        watches.append(Watch(w.arena(), gpu_of(w)))

    async def state() -> dict[str, Any]:
        models = [{"name": name, "state": w.state().value, **requests.of(name)}
                  for name, w in wrappers.items()]  # fmt: skip
        shown = await briefly(lambda: merge([watch.state() for watch in watches]))
        recent = {} if logs is None else {"lines": logs.proxy.lines(LINES)}
        return {**shown, "models": models, **recent}

    async def close(application: web.Application) -> None:
        for watch in watches:
            watch.arena.close()

    application = app(state)
    html = page()

    async def models(request: web.Request) -> web.Response:
        return web.Response(text=html, content_type="text/html")

    application.router.add_get("/models", models)  # llama-swap's view of its models
    application.on_cleanup.append(close)
    application.middlewares.append(_json_errors)
    return application


@web.middleware
async def _json_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """The page's errors (a path it has not, a method) as serve's others: JSON."""
    try:
        return await handler(request)
    except web.HTTPException as err:
        if err.status < 400:
            raise
        why = "no such route" if err.status == 404 else err.reason.lower()
        allowed = ", ".join(m.strip() for m in err.headers.get("Allow", "").split(",") if m)
        if err.status == 405 and allowed:  # as serve's other routes say it
            why = f"{why}; allowed: {allowed}"
        out = error_response(err.status, f"{request.method} {request.path}: {why}")
        if allowed:
            out.headers["Allow"] = allowed
        return out


def register(app: web.Application, s: Serving, logs: Logs | None) -> None:
    app.router.add_get("/", root)  # a POST to / is routed by its model: no 405 here
    get(app, "/health", health)
    get(app, "/wol-health", health)

    exposed = registry(s.wrappers, s.requests)

    async def exposition(request: web.Request) -> web.Response:
        return await metrics(exposed)

    get(app, "/metrics", exposition)
    get(app, "/ui", to_ui)
    app.add_subapp("/ui/", ui_app(s.wrappers, s.requests, logs))
    app.router.add_route("*", "/ui/{path:.*}", refuse_others("GET", "HEAD"))  # what it has not
    get(app, "/upstream", to_models)
