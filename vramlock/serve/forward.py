"""aiohttp's requests to a local model (a POST routed by its model, /upstream, ComfyUI,
a websocket), taken the exchange's way (.exchange) and forwarded through the model's
pool of connections to its wrapper, the answer passed on as it comes."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import aiohttp
from aiohttp import web

from ..arena.records import State
from .errors import busy_response
from .errors import error_response as _error
from .exchange import Exchange
from .fast import HOP, WHOLE
from .inflight import Flight, Flights, uncancel
from .loading import Loading
from .members import Wrapper
from .reading import MAX_BODY, TooLarge, counted, too_large
from .upstream import Body, Response, Stream, UpstreamTimeout

# The request key of the selector whose name a request used (for its activity).
SELECTOR = "vramlock.selector"


def _bare(path: str, prefix: str) -> str:
    """The path a model's server is asked for (``path``, after the proxy's ``prefix``),
    without its query: what inflight and activity show."""
    return path.partition("?")[0][len(prefix) :] or "/"


def _status(out: web.StreamResponse) -> int:
    return out.status


async def _ws_relay(src: Any, dst: Any) -> None:
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


class Forwarder:
    """aiohttp's side of the exchange."""

    def __init__(self, exchange: Exchange) -> None:
        self.exchange = exchange

    async def forward(
        self,
        request: web.Request,
        w: Wrapper,
        path: str,
        body: Body | None,
        show_loading: bool = False,
        told: bool = True,
    ) -> web.StreamResponse:
        """``request`` passed to ``w`` the exchange's way; with ``show_loading``, a
        streaming chat for a model that is not resident is answered at once with its
        progress; ``told``: shown in flight (``Flights.start``). Cancelled as llama-swap
        cancels."""
        sent = body if isinstance(body, bytes | bytearray) else None  # a Stream is not held
        peer = None if request.transport is None else request.transport.get_extra_info("peername")
        flights = self.exchange.flights
        flight = flights.start(w.model.name, request.method, _bare(path, w.model.prefix),
                               request.headers.items(), peer, sent, told)  # fmt: skip
        flight.task = asyncio.current_task()
        flight.selector = request.get(SELECTOR)
        loading = None
        if (
            show_loading
            and w.admitted < w.model.concurrency
            and not (w.alive() and w.member_state() == State.RESIDENT.value)
        ):
            loading = Loading(w.model.name, lambda: w.member_state() if w.alive() else None)
            await loading.start(request)
            flight.head(200, loading.out.headers.items())
            flights.started(flight)

        async def send() -> web.StreamResponse:
            return await self._pass(request, w, path, body, flight, loading)

        async def cancelled() -> web.StreamResponse:
            status, why = flight.refusal()
            if loading is not None and loading.out.prepared:
                return await loading.fail(why)
            return _error(status, why)

        def settle(out: web.StreamResponse) -> None:
            answer = out.body if isinstance(out, web.Response) else None
            if flight.resp_headers is None and isinstance(answer, bytes):  # serve's own
                flight.answered(out.status, out.headers.items(), answer)

        shown = f"{request.method} {request.path}"
        try:
            return await self.exchange.take(w, flight, shown, send, _status, busy_response,
                                            cancelled, settle)  # fmt: skip
        finally:
            if loading is not None:
                await loading.cancel()

    async def _pass(
        self,
        request: web.Request,
        w: Wrapper,
        path: str,
        body: Body | None,
        flight: Flight,
        loading: Loading | None = None,
    ) -> web.StreamResponse:
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in HOP]
        if body is None:  # /upstream: passed on as it comes
            if (request.content_length or 0) > MAX_BODY:
                return too_large()
            chunked = "chunked" in request.headers.get("Transfer-Encoding", "").lower()
            length = None if chunked else request.content_length
            body = Stream(counted(request), length) if chunked or length else b""
        try:
            up = await self.exchange.pool(w).request(request.method, path, headers, body, w.exited)
        except UpstreamTimeout as err:
            message = f"model {w.model.name}: {err}"
            return _error(504, message) if loading is None else await loading.fail(message)
        except TooLarge:
            return too_large()
        except OSError as err:
            cause = await w.cause(err)
            message = f"model {w.model.name}: its server did not answer: {cause}"
            return _error(502, message) if loading is None else await loading.fail(message)
        if loading is not None:
            try:
                return await loading.relay(request, up, flight.took)
            finally:
                await up.body.aclose()
        try:
            return await answer(request, up, f"model {w.model.name}", flight,
                                self.exchange.flights, w.info)  # fmt: skip
        finally:
            # Also when the client went away (cancelled): the connection to the wrapper
            # is closed at once, not left looking like a request awaiting its answer.
            await up.body.aclose()

    async def websocket(self, request: web.Request, w: Wrapper, path: str) -> web.StreamResponse:
        """A websocket through /upstream: taken here, and its messages relayed both ways
        over one opened to the model's server (through its wrapper, which holds it as
        it holds any connection while the model is released)."""
        await self.exchange.evict_for(w)
        await w.unloaded()
        w.ensure_running()
        # The handshake's own headers are aiohttp's client's to make.
        headers = {
            k: v
            for k, v in request.headers.items()
            if k.lower() not in HOP and not k.lower().startswith("sec-websocket")
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
                    asyncio.ensure_future(_ws_relay(out, up)),
                    asyncio.ensure_future(_ws_relay(up, out)),
                ]
                await asyncio.wait(relays, return_when=asyncio.FIRST_COMPLETED)
                for relay in relays:
                    relay.cancel()
                await out.close()
        return out


async def answer(
    request: web.Request,
    up: Response,
    who: str,
    flight: Flight | None = None,
    flights: Flights | None = None,
    info: Callable[[str], None] | None = None,
) -> web.StreamResponse:
    """``up`` (from ``who``: a model, a peer) passed on to ``request``'s client: whole
    (in one write) up to ``WHOLE`` bytes of known length, else as it comes; kept in
    ``flight`` (its start told to ``flights``) where there is one. A cancelled flight's
    answer ends where it stands (``info`` says so)."""
    headers = [(k, v) for k, v in up.headers if k.lower() not in HOP]
    if up.length is not None and up.length <= WHOLE:
        try:
            whole = b"".join([chunk async for chunk in up.body])
        except OSError as err:
            return _error(502, f"{who}: its server did not answer: {err}")
        if flight is not None:
            flight.answered(up.status, headers, whole)
        return web.Response(status=up.status, reason=up.reason, headers=headers, body=whole)
    out = web.StreamResponse(status=up.status, reason=up.reason, headers=headers)
    if up.length is not None:
        out.content_length = up.length
    try:
        await out.prepare(request)
        if flight is not None and flights is not None:
            flight.head(up.status, headers)
            flights.started(flight)
        async for chunk in up.body:
            await out.write(chunk)
            if flight is not None:
                flight.took(chunk)
        await out.write_eof()
    except OSError:
        # Cut in the middle: cut the client's connection too, so that it sees the
        # answer end early rather than wait for the rest.
        if request.transport is not None:
            request.transport.abort()
    except asyncio.CancelledError:
        if flight is None or not (flight.cancelled and out.prepared):
            raise
        # Cancelled (POST /api/inflight/ID/cancel): the answer ends where it stands,
        # as llama-swap's; one of announced length cannot, and is cut.
        uncancel()
        _ended_early(request, out, up.length is None)
        if info is not None:
            info(f"{request.method} {request.path} cancelled")
    return out


def _ended_early(request: web.Request, out: web.StreamResponse, chunked: bool) -> None:
    """A cancelled answer's end: its last chunk where it is chunked, else the client's
    connection cut."""
    if chunked and "chunked" in out.headers.get("Transfer-Encoding", ""):
        return  # aiohttp writes the last chunk once the handler returns it
    if request.transport is not None:
        request.transport.abort()
