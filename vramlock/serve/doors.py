"""What every request to serve passes first: the API keys' check and CORS.

With ``apiKeys`` set, a request carries one of them (``Authorization``'s Basic password,
else its Bearer token, else ``x-api-key``, as llama-swap reads them) or is answered 401,
whatever its method and path, except those llama-swap leaves open: ``GET``/``HEAD`` of
``/health``, ``/wol-health``, ``/`` (a redirect to the page), ``/upstream`` (a redirect)
and ``/favicon.ico``, and every ``OPTIONS`` (a CORS preflight). The same ``Keys`` is asked
by aiohttp's middleware and by front.py, which parses the common request itself: no
request reaches a route, a model or its server without passing it.
"""

from __future__ import annotations

import base64
import binascii
import hmac
from collections.abc import Iterable

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from .errors import error_response

# (method, path) that llama-swap answers without a key; OPTIONS is open on every path.
OPEN = frozenset(
    (method, path)
    for method in ("GET", "HEAD")
    for path in ("/health", "/wol-health", "/", "/upstream", "/favicon.ico")
)
REFUSED = "unauthorized: invalid or missing API key"
CHALLENGE = ("WWW-Authenticate", 'Basic realm="vramlock"')
_TOKEN = frozenset("!#$%&'*+-.^_`|~")


def is_open(method: str, path: str) -> bool:
    """Is ``method path`` answered without a key?"""
    return method == "OPTIONS" or (method, path) in OPEN


def key_of(authorization: str, x_api_key: str | None) -> str | None:
    """The API key a request carries, as llama-swap reads it: ``authorization``'s Basic
    password, else its Bearer token, else ``x_api_key``."""
    scheme, _, credentials = authorization.partition(" ")
    if scheme.lower() == "basic":
        try:
            _, colon, password = base64.b64decode(credentials, validate=True).partition(b":")
        except (ValueError, binascii.Error):
            colon = b""
        if colon and password:
            return password.decode("utf-8", "replace")
    if scheme.lower() == "bearer" and credentials:
        return credentials
    return x_api_key


class Keys:
    """The configured API keys; with none, every request is let in."""

    def __init__(self, keys: Iterable[str]) -> None:
        self.keys = tuple(k.encode() for k in keys)

    def admits(self, method: str, path: str, headers: Iterable[tuple[str, str]]) -> bool:
        """Is a request with these ``headers`` (name, value: the first of each name
        counts) let in to ``method path``?"""
        if not self.keys or is_open(method, path):
            return True
        authorization, x_api_key = "", None
        seen: set[str] = set()
        for name, value in headers:
            lower = name.lower()
            if lower in seen:
                continue
            seen.add(lower)
            if lower == "authorization":
                authorization = value
            elif lower == "x-api-key":
                x_api_key = value
        given = key_of(authorization, x_api_key)
        if given is None:
            return False
        # every key compared, in constant time each: no early answer tells which matched
        matched = [hmac.compare_digest(given.encode(), k) for k in self.keys]
        return any(matched)


def refusal() -> web.Response:
    """The 401 of a request without a key, as llama-swap answers it."""
    out = error_response(401, REFUSED)
    out.headers[CHALLENGE[0]] = CHALLENGE[1]
    return out


def middleware(keys: Keys) -> Middleware:
    """aiohttp's side of ``keys``: every route, the page's included, asks it. A CORS
    preflight (OPTIONS, any path) is answered here, before any route, as llama-swap
    answers it before its routes."""

    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.method == "OPTIONS":
            return preflight(request)
        if keys.admits(request.method, request.path, request.headers.items()):
            return await handler(request)
        return refusal()

    return check


def preflight(request: web.Request) -> web.Response:
    """A CORS preflight (any OPTIONS), answered as llama-swap answers it: any origin."""
    asked = request.headers.get("Access-Control-Request-Headers", "")
    names = [h.strip() for h in asked.split(",")]
    # only header names made of token characters are echoed back
    names = [h for h in names if h and all((c.isascii() and c.isalnum()) or c in _TOKEN for c in h)]
    headers = {
        "Access-Control-Allow-Origin": "*",
        "Access-Control-Allow-Methods": "GET, POST, PUT, PATCH, DELETE, OPTIONS",
        "Access-Control-Allow-Headers": ", ".join(names) if asked
        else "Content-Type, Authorization, Accept, X-Requested-With",
        "Access-Control-Max-Age": "86400",
    }  # fmt: skip
    return web.Response(status=204, headers=headers)


def allow_origin(request: web.Request, out: web.StreamResponse) -> None:
    """A listing a browser page of another origin may read: its Origin echoed (as
    llama-swap's /v1/models)."""
    origin = request.headers.get("Origin")
    if origin:
        out.headers["Access-Control-Allow-Origin"] = origin
