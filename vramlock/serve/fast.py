"""serve's common request, parsed by front.py from the bytes: taken the exchange's way
(choose, turn, flight, forward, count: .exchange) and forwarded by front.py's relay
over a kept-alive connection to the model's wrapper.

Where nothing need wait, the request is sent from front.py's data callback, with no
task (``Express``), and its answer passed on from the wrapper connection's (``Peek``);
what does not come whole at once goes on in a task, as ``fast`` would.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from .exchange import Chosen, Exchange, Refusal
from .front import Front, Head
from .inflight import Flight, uncancel
from .members import Wrapper
from .metrics import GONE
from .turns import Turns
from .upstream import Body, Peek, Pool, Response, Stream, UpstreamTimeout

# A response of known length up to this size is read whole and sent in one write;
# others (streams, chunked, large) are passed on chunk by chunk as they come.
WHOLE = 1 << 20
# A request body up to this size may be sent from front.py's data callback (in one
# write, which the transport takes whole).
EXPRESS_BODY = 64 * 1024
# Hop-by-hop headers (RFC 9110 7.6.1) and those the two HTTP stacks set themselves.
HOP = frozenset(
    {"connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding",
     "upgrade", "host", "content-length"}
)  # fmt: skip


class Express:
    """A request that ``FastPath.express`` sent from front.py's data callback: its answer
    passed on from the wrapper connection's (``Peek``), or the rest in a task."""

    def __init__(
        self,
        path: FastPath,
        front: Front,
        w: Wrapper,
        turns: Turns,
        head: Head,
        pool: Pool,
        pair: tuple[asyncio.StreamReader, asyncio.StreamWriter],
        data: tuple[bytes, Body],
    ) -> None:
        self.path, self.front, self.w, self.turns = path, front, w, turns
        self.head, self.pool, self.pair, self.data = head, pool, pair, data
        self.began = time.monotonic()
        self._ended: asyncio.Future[None] | None = None
        flight = front.flight
        assert flight is not None
        self.flight: Flight = flight
        flight.on_cancel = self._cancel_asked
        self.peek = Peek(pool, pair, WHOLE, self._answered, self._missed)

    @property
    def shown(self) -> str:
        return f"POST {self.head.target.partition('?')[0]}"

    def waiter(self) -> asyncio.Future[None]:
        """Done once the request has ended (here or in its task)."""
        if self._ended is None:
            self._ended = asyncio.get_running_loop().create_future()
        return self._ended

    def _end(self, status: str) -> None:
        self.front.express = None
        self.front.flight = None
        self.path.exchange.leave(self.w, self.turns)
        self.path.exchange.ended(self.w, self.flight, status, self.began)
        if self._ended is not None and not self._ended.done():
            self._ended.set_result(None)

    def _answered(
        self, status: int, reason: str, headers: list[tuple[str, str]], body: bytes
    ) -> None:
        try:
            self.front.answer(status, reason, headers, body)
        except OSError:
            self._end(GONE)
            self.front.lost()
            return
        self.w.info(self.flight.line(self.shown, str(status)))
        self._end(str(status))
        self.front.ended()

    def _missed(self) -> None:
        self.front.express = None
        self.flight.on_cancel = None  # the task has it (resume)
        task = self.front.run(self.path.resume(self))
        if self._ended is not None:
            ended = self._ended

            def end(_: asyncio.Task[None]) -> None:
                if not ended.done():
                    ended.set_result(None)

            task.add_done_callback(end)

    def cancel(self) -> None:
        """The client went away: so does its request."""
        self.peek.cancel()
        self._end(GONE)

    def _cancel_asked(self) -> None:
        """POST /api/inflight/ID/cancel: ended soon (not in the middle of that request)."""
        asyncio.get_running_loop().call_soon(self._cancelled)

    def _cancelled(self) -> None:
        if self.front.express is not self:
            return  # answered meanwhile, or gone on in a task (which sees it cancelled)
        self.peek.cancel()  # the wrapper's connection closed: its server's request ends
        self.w.info(f"{self.shown} cancelled")
        try:
            status = self.front.refuse(*self.flight.refusal())
        except OSError:
            self._end(GONE)
            self.front.lost()
            return
        self._end(str(status))
        self.front.ended()


class FastPath:
    """front.py's requests, the exchange's way."""

    def __init__(self, exchange: Exchange) -> None:
        self.exchange = exchange

    def express(self, front: Front, head: Head, body: bytes) -> Chosen | None:
        """Start ``fast``'s request from front.py's data callback, with no task, where
        nothing need wait: the model is the one its arena serves now and its turn lets
        the request in at once (the routing rules look at nothing), its wrapper runs, a
        kept-alive connection to it is idle, and no responseHeader bound runs. Its
        answer is passed on from the connection's data callback (``Peek``); what does
        not come whole at once goes on in a task, as ``fast`` would. None: started;
        else what the body chose, for ``fast``, nothing done."""
        chosen = self.exchange.choose(body)
        if isinstance(chosen, Refusal):
            return chosen
        w, sent = chosen
        model = w.model
        pool = self.exchange.pools.get(model.name)
        if (
            pool is None
            or isinstance(sent, Stream)
            or pool.header is not None
            or len(sent) > EXPRESS_BODY
            or not self.exchange.may_enter_now(w)
            or (w.exited is not None and w.exited.done())
            or not w.alive()
            or w.unloading
        ):
            return chosen
        pair = pool.take()
        if pair is None:
            return chosen
        turns = self.exchange.enter_now(w)
        if turns is None:
            pool.keep(*pair)
            return chosen
        headers = [(k, v) for k, v in head.headers if k.lower() not in HOP]
        data = pool.encode("POST", model.prefix + head.target, headers, sent)
        held = sent if isinstance(sent, bytes | bytearray) else None
        flights = self.exchange.flights
        front.flight = flights.start(model.name, "POST", head.target.partition("?")[0],
                                     head.headers, front.peer, held)  # fmt: skip
        front.express = Express(self, front, w, turns, head, pool, pair, data)
        pair[1].write(data[0] + sent)  # one segment: the wrapper wakes once
        return None

    async def fast(
        self, front: Front, head: Head, body: bytes, chosen: Chosen | None = None
    ) -> None:
        """``by_model`` for the request that ``front`` parsed (``chosen``: what its body
        chose, if that is known already)."""
        if chosen is None:
            chosen = self.exchange.choose(body)
        if isinstance(chosen, Refusal):
            front.refuse(chosen.status, chosen.message, chosen.extra)
            return
        w, sent = chosen
        headers = [(k, v) for k, v in head.headers if k.lower() not in HOP]
        path = w.model.prefix + head.target
        bare = head.target.partition("?")[0]
        held = sent if isinstance(sent, bytes | bytearray) else None
        flights = self.exchange.flights
        flight = front.flight = flights.start(w.model.name, "POST", bare, head.headers,
                                              front.peer, held)  # fmt: skip
        flight.task = asyncio.current_task()

        async def send() -> int:
            pool = self.exchange.pool(w)
            return await self._relay(front, w, lambda: pool.request("POST", path, headers,
                                                                  sent, w.exited))  # fmt: skip

        async def cancelled() -> int:
            return front.refuse(*flight.refusal())

        try:
            await self.exchange.take(w, flight, f"POST {bare}", send, int, front.busy, cancelled)
        finally:
            front.flight = None

    async def _relay(
        self, front: Front, w: Wrapper, response: Callable[[], Awaitable[Response]]
    ) -> int:
        """The wrapper's ``response()`` passed on to ``front``'s client, or the error
        that says why there is none; the status answered."""
        try:
            up = await response()
        except UpstreamTimeout as err:
            return front.refuse(504, f"model {w.model.name}: {err}")
        except OSError as err:
            cause = await w.cause(err)
            return front.refuse(502, f"model {w.model.name}: its server did not answer: {cause}")
        try:
            return await front.relay(w, up, WHOLE)
        finally:
            await up.body.aclose()

    async def resume(self, x: Express) -> None:
        """An express request whose answer did not come whole at once: the rest as
        ``fast`` does it, from its request sent."""
        w, flight = x.w, x.flight
        flight.task = asyncio.current_task()
        status = GONE
        try:
            pool, pair, data = x.pool, x.pair, x.data
            try:
                if flight.cancelled:  # asked between the data callback and this task
                    raise asyncio.CancelledError
                answered = await self._relay(
                    x.front, w, lambda: pool.resume(pair[0], pair[1], data, w.exited)
                )
                w.info(flight.line(x.shown, str(answered)))
            except asyncio.CancelledError:
                if not flight.cancelled:
                    raise
                uncancel()
                pair[1].close()  # the wrapper's connection: its server's request ends
                w.info(f"{x.shown} cancelled")
                answered = x.front.refuse(*flight.refusal())
            status = str(answered)
        finally:
            x.front.flight = None
            self.exchange.leave(w, x.turns)
            self.exchange.ended(w, flight, status, x.began)
