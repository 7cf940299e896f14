"""serve's errors as llama-swap answers them: the OpenAI API's ``error`` object (message,
type, param, code) in an envelope whose ``src`` says the answer is serve's own, not a
model's server's; plain text or HTML to a client that asks for either."""

from __future__ import annotations

import html
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Handler

SRC = "vramlock"
# OpenAI's error.type and llama-swap's default error.code, by status.
_KINDS = {
    400: ("invalid_request_error", "bad_request"),
    401: ("authentication_error", "unauthorized"),
    403: ("authentication_error", "forbidden"),
    404: ("invalid_request_error", "not_found"),
    409: ("invalid_request_error", "conflict"),
    429: ("rate_limit_error", "rate_limit_exceeded"),
    502: ("server_error", "bad_gateway"),
    503: ("server_error", "service_unavailable"),
    504: ("server_error", "gateway_timeout"),
}
# The message of an error response, kept on it for ``negotiated``.
MESSAGE = "vramlock.error"


def error_doc(status: int, message: str, code: str | None = None, **extra: Any) -> dict[str, Any]:
    """An error as llama-swap answers one: ``error.code`` is ``code``, else the status's."""
    kind, default = _KINDS.get(
        status,
        ("invalid_request_error", "invalid_request") if status < 500
        else ("server_error", "internal_error"),
    )  # fmt: skip
    error = {"message": message, "type": kind, "param": None, "code": code or default}
    return {"src": SRC, "error": error, **extra}


def error_response(
    status: int, message: str, code: str | None = None, **extra: Any
) -> web.Response:
    """``error_doc`` as aiohttp's JSON response."""
    out = web.json_response(error_doc(status, message, code, **extra), status=status)
    out[MESSAGE] = message
    return out


# A request over a model's concurrencyLimit: its code, and when to try again (seconds).
BUSY = "concurrency_limit"
RETRY_AFTER = "1"


def busy_response(message: str) -> web.Response:
    """A 429 for a request over a model's concurrencyLimit, as llama-swap answers it."""
    out = error_response(429, message, BUSY)
    out.headers["Retry-After"] = RETRY_AFTER
    return out


def wants_text(accept: str) -> bool:
    """Does a client that sends this Accept get its errors as text or HTML?"""
    return "text/plain" in accept or "text/html" in accept


@web.middleware
async def negotiated(request: web.Request, handler: Handler) -> web.StreamResponse:
    """serve's errors to a client whose Accept names text/plain (``vramlock: MESSAGE``) or
    text/html (a page), as llama-swap answers them; JSON to any other."""
    out = await handler(request)
    message = out.get(MESSAGE)
    accept = request.headers.get("Accept", "")
    if message is None or not wants_text(accept):
        return out
    if "text/plain" in accept:
        text, kind = f"{SRC}: {message}", "text/plain"
    else:
        text = f"<html><body><h1>{SRC}</h1><p>{html.escape(message)}</p></body></html>"
        kind = "text/html"
    other = web.Response(status=out.status, text=text, content_type=kind)
    for name in ("WWW-Authenticate", "Allow", "Retry-After"):
        if name in out.headers:
            other.headers[name] = out.headers[name]
    return other
