"""serve's errors as the OpenAI API answers them: ``error.message`` and ``error.type``."""

from __future__ import annotations

from typing import Any

from aiohttp import web

# OpenAI's error.type for the statuses that have their own.
_KINDS = {401: "authentication_error", 429: "rate_limit_error"}


def error_doc(status: int, message: str, **extra: Any) -> dict[str, Any]:
    """An error as the OpenAI API answers one (``error.message`` and ``error.type``)."""
    kind = _KINDS.get(status, "invalid_request_error" if status < 500 else "server_error")
    return {"error": {"code": status, "message": message, "type": kind, "param": None}, **extra}


def error_response(status: int, message: str, **extra: Any) -> web.Response:
    """``error_doc`` as aiohttp's JSON response."""
    return web.json_response(error_doc(status, message, **extra), status=status)
