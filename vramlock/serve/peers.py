"""llama-swap's ``peers``: remote OpenAI-compatible servers behind serve's address.

A peer has no process and no arena: its requests are passed on at once, to its
``proxy`` URL with the request's path appended, the body's ``model`` replaced by the
peer's own name for it and its filters applied, with ``apiKey`` (when given) as
``Authorization: Bearer`` and ``x-api-key``. A peer model is named ``PEER/MODEL``, or
``MODEL`` alone when exactly one peer has it and no local model or alias is named so.
Its requests go the exchange's way but for the turn: in flight (listed, cancellable)
and counted under the name the client asked for, as llama-swap's.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator
from typing import Any

import aiohttp
from aiohttp import web

from .config import Config, Peer
from .errors import error_response as _error
from .exchange import Exchange
from .forward import answer
from .inflight import Flight
from .upstream import Response

# Hop-by-hop headers (RFC 9110 7.6.1), and those the client library sets itself.
_HOP = frozenset(
    {"connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding",
     "upgrade", "host", "content-length"}
)  # fmt: skip


def resolve(config: Config, name: str) -> tuple[Peer, str] | None:
    """The peer and its model that ``name`` names, as llama-swap resolves it: a
    ``PEER/MODEL`` first, then a ``MODEL`` that exactly one peer has; None if neither
    (or if a local model or alias is ``name``: locals come first)."""
    if config.find(name) is not None:
        return None
    full = [(p, m) for p in config.peers.values() for m in p.models if f"{p.name}/{m}" == name]
    if len(full) == 1:
        return full[0]
    if full:
        return None
    bare = [(p, m) for p in config.peers.values() for m in p.models if m == name]
    return bare[0] if len(bare) == 1 else None


def upstream_peer(config: Config, rest: str) -> tuple[Peer, str, str] | None:
    """For /upstream/REST: the peer, its model and the path (from "/") that REST starts
    with a peer model's name (the longest that ``resolve`` takes), or None."""
    names = [f"{p.name}/{m}" for p in config.peers.values() for m in p.models]
    names += [m for p in config.peers.values() for m in p.models]
    name = max((n for n in names if rest.startswith(f"{n}/")), key=len, default=None)
    found = None if name is None else resolve(config, name)
    if name is None or found is None:
        return None
    return found[0], found[1], rest[len(name) :]


def entries(config: Config) -> list[dict[str, Any]]:
    """Each peer model's /v1/models entry, as llama-swap lists them."""
    return [
        {"id": f"{p.name}/{m}", "object": "model", "owned_by": "vramlock",
         "name": f"{p.name}: {m}", "meta": {"llamaswap": {"type": "peer", "peerID": p.name}}}
        for p in config.peers.values()
        for m in p.models
    ]  # fmt: skip


class Peers:
    """One HTTP client for every peer, kept while serve runs; each request taken the
    exchange's way (in flight, counted), with no turn."""

    def __init__(self, exchange: Exchange) -> None:
        self.exchange = exchange
        self._client: aiohttp.ClientSession | None = None

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()

    async def forward(
        self,
        request: web.Request,
        peer: Peer,
        model: str,
        asked: str,
        doc: Any,
        path: str | None = None,
    ) -> web.StreamResponse:
        """``request`` to ``peer`` as ``model`` (listed and counted as ``asked``, the name
        the client used, as llama-swap's): its JSON body already read (``doc``), or
        (None) passed through unread to ``path`` (/upstream's)."""
        if isinstance(doc, dict):
            body = json.dumps({**peer.filters.apply(doc, asked), "model": model}).encode()
        else:
            body = await request.read()
        target = request.path_qs if path is None else path
        where = None if request.transport is None else request.transport.get_extra_info("peername")
        flights = self.exchange.flights
        flight = flights.start(asked, request.method, target.partition("?")[0],
                               request.headers.items(), where, body)  # fmt: skip
        flight.task = asyncio.current_task()

        async def send() -> web.StreamResponse:
            return await self._send(request, peer, peer.base + target, body, flight)

        async def cancelled() -> web.StreamResponse:
            return _error(*flight.refusal())

        def settle(out: web.StreamResponse) -> None:
            answer = out.body if isinstance(out, web.Response) else None
            if flight.resp_headers is None and isinstance(answer, bytes):  # serve's own
                flight.answered(out.status, out.headers.items(), answer)

        shown = f"{request.method} {request.path}"
        return await self.exchange.carry(asked, flight, shown, send, _status, cancelled, settle)

    async def _send(
        self, request: web.Request, peer: Peer, url: str, body: bytes, flight: Flight
    ) -> web.StreamResponse:
        """``body`` sent to ``url``, and the peer's answer passed on (kept in ``flight``)."""
        if self._client is None:
            self._client = aiohttp.ClientSession(auto_decompress=False)
        bounds = peer.timeouts
        # The connection and its TLS handshake are one step to the client: bounded by
        # the sum of theirs (a plain TCP connection by its own alone, within that).
        both = None if bounds.connect is None else bounds.connect + (bounds.tls or 0.0)
        timeout = aiohttp.ClientTimeout(total=None, connect=both, sock_connect=bounds.connect)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        if peer.api_key:
            headers["Authorization"] = f"Bearer {peer.api_key}"
            headers["x-api-key"] = peer.api_key
        asking = self._client.request(
            request.method, url, headers=headers, data=body, timeout=timeout
        )
        try:
            up = await asyncio.wait_for(asking, bounds.header)
        except aiohttp.ServerTimeoutError as err:  # the connection (and its TLS handshake)
            if both is None:
                return _error(502, f"peer {peer.name}: proxy error: {err}")
            key = "timeouts.connect" + ("+tlsHandshake" if bounds.tls else "")
            return _error(504, f"peer {peer.name}: no connection within {key}, {both:g} s")
        except asyncio.TimeoutError:  # (TimeoutError itself only from Python 3.11)
            return _error(504, f"peer {peer.name}: no response head within"
                               f" timeouts.responseHeader, {bounds.header:g} s")  # fmt: skip
        except (aiohttp.ClientError, OSError) as err:
            return _error(502, f"peer {peer.name}: proxy error: {err}")
        async with up:
            kept = list(up.headers.items())
            if up.content_type == "text/event-stream":
                kept.append(("X-Accel-Buffering", "no"))
            chunks = _chunks(up)
            passed = Response(up.status, up.reason or "", kept, up.content_length, chunks)
            try:
                return await answer(request, passed, f"peer {peer.name}", flight,
                                    self.exchange.flights)  # fmt: skip
            finally:
                await chunks.aclose()
                if not up.content.is_eof():
                    up.close()  # cut short (a cancel, its client gone): the peer sees it end


def _status(out: web.StreamResponse) -> int:
    return out.status


async def _chunks(up: aiohttp.ClientResponse) -> AsyncGenerator[bytes, None]:
    """A peer's answer as it comes; its connection's failure an OSError, as a local
    model's (``forward.answer`` cuts the client's connection then)."""
    try:
        async for chunk in up.content.iter_any():
            yield chunk
    except aiohttp.ClientError as err:
        raise ConnectionResetError(str(err)) from err
