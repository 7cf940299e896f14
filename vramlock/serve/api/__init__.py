"""serve's API: llama-swap's routes that are not a model's, each module registering its
own (``register(app, serving)``) on the application the router makes.

A handler reads serve's state from ``Serving`` when it is asked, not when it is
registered: ``--watch-config`` gives serve another config and resolver while it runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from aiohttp import web
from aiohttp.typedefs import Handler

from ..errors import error_response

if TYPE_CHECKING:
    from ..activity import Activity
    from ..config import Config
    from ..events import Events
    from ..hardware import Hardware, Performance
    from ..inflight import Flights
    from ..members import Wrapper
    from ..metrics import Requests
    from ..selectors import Resolver


class Serving(Protocol):
    """What the API reads of serve (the router has it)."""

    config: Config
    wrappers: dict[str, Wrapper]
    resolver: Resolver
    requests: Requests
    activity: Activity
    flights: Flights
    events: Events
    hardware: Hardware
    performance: Performance | None


def refuse_others(*methods: str) -> Handler:
    """A route's other methods: 405 with Allow (as llama-swap's routes answer them). A
    prefix's handler also gets the paths under it that nothing took: for ``methods``
    those are 404."""
    allowed = ", ".join(methods)

    async def refuse(request: web.Request) -> web.StreamResponse:
        if request.method in methods:
            return error_response(404, f"{request.method} {request.path}: no such route")
        out = error_response(405, f"{request.method} {request.path}: method not allowed;"
                                  f" allowed: {allowed}")  # fmt: skip
        out.headers["Allow"] = allowed
        return out

    return refuse


def get(app: web.Application, path: str, handler: Handler) -> None:
    """A GET route (and HEAD); its other methods 405, as llama-swap's."""
    app.router.add_get(path, handler)
    app.router.add_route("*", path, refuse_others("GET", "HEAD"))


def only(app: web.Application, method: str, path: str, handler: Handler) -> None:
    """A route for ``method`` alone; its other methods 405, as llama-swap's."""
    app.router.add_route(method, path, handler)
    app.router.add_route("*", path, refuse_others(method))
