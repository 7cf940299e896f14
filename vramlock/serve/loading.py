"""llama-swap's ``sendLoadingState``: a chat stream that waits for its model says so.

A streaming ``/v1/chat/completions`` request for a model that is not resident gets its
response (200, an event stream) at once: while the model loads or is restored, chunks
whose ``choices[0].delta.reasoning_content`` tell it (a dot every ``TICK``, and the
model's member state each time it changes); once the model answers, ``Done! (N.NNs)``
and then the model's own stream, in the same response.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable
from typing import Any

from aiohttp import web

from .upstream import Response

TICK = 0.75
RULE = "━━━━━"
# What each member state means to somebody waiting for the model.
_SAYS = {
    "waiting": "waiting for the GPU",
    "restoring": "restoring the model",
    "releasing": "the model is releasing",
    "released": "starting",
}


def wanted(path: str, doc: Any) -> bool:
    """Is this a request llama-swap streams loading state into (a streaming chat)?"""
    return path.startswith("/v1/chat/completions") and isinstance(doc, dict) and (
        doc.get("stream") is True
    )  # fmt: skip


class Loading:
    """The response of one request while its model loads, then the model's stream."""

    def __init__(self, model: str, state: Callable[[], str | None]) -> None:
        self.model, self.state = model, state
        self.out = web.StreamResponse(
            status=200, headers={"Content-Type": "text/event-stream",
                                 "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        )  # fmt: skip
        self.began = time.monotonic()
        self._ticker: asyncio.Task[None] | None = None

    async def start(self, request: web.Request) -> None:
        await self.out.prepare(request)
        await self._send(f"{RULE}\n")
        await self._send(f"vramlock loading model: {self.model}\n")
        self._ticker = asyncio.ensure_future(self._tick())

    async def _send(self, text: str) -> None:
        chunk = {"choices": [{"delta": {"reasoning_content": text}}]}
        await self.out.write(f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n".encode())

    async def _tick(self) -> None:
        said = None
        while True:
            await asyncio.sleep(TICK)
            try:  # in the loop, not a thread: a few small reads of the arena
                now = self.state()
            except (AssertionError, OSError):  # the wrapper ended in between
                now = None
            if now != said and now in _SAYS:
                said = now
                await self._send(f"\n{_SAYS[now]} ")
            else:
                await self._send(".")

    async def _stop(self) -> None:
        if self._ticker is not None:
            self._ticker.cancel()
            with contextlib.suppress(asyncio.CancelledError, OSError):
                await self._ticker
            self._ticker = None

    async def relay(
        self, request: web.Request, up: Response, took: Callable[[bytes], None] | None = None
    ) -> web.StreamResponse:
        """The model answered: say so, then pass its body on in this response (each
        piece to ``took`` too)."""
        await self._stop()
        try:
            await self._send(f"\nDone! ({time.monotonic() - self.began:.2f}s)\n")
            await self._send(f"{RULE}\n")
            await self._send(" \n")
            async for chunk in up.body:
                await self.out.write(chunk)
                if took is not None:
                    took(chunk)
            await self.out.write_eof()
        except OSError:
            if request.transport is not None:
                request.transport.abort()
        return self.out

    async def fail(self, message: str) -> web.StreamResponse:
        """The model did not answer: ``message`` in the stream, then its end."""
        await self._stop()
        with contextlib.suppress(OSError):
            await self._send(f"\n{message}\n")
            await self.out.write(b"data: [DONE]\n\n")
            await self.out.write_eof()
        return self.out

    async def cancel(self) -> None:
        await self._stop()
