"""The one way a request to a local model goes: chosen (its model and the body to send
it), let in by its arena's turn (``Turns``) and its model's concurrencyLimit, in flight
(``inflight``), forwarded, counted (``Requests``), and its ttl armed once it ends. A
peer's request goes the same way but for the turn (``carry``): a peer has no arena.

Both of serve's doors take it: front.py's common request (``fast``) and aiohttp's
handlers (``forward``); each forwards in its own way, from a bytes-level connection or
an aiohttp response, the rest is here.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from ..arena.records import HOLDING
from .config import Config
from .inflight import Flight, Flights, uncancel
from .members import Unloaded, Wrapper
from .metrics import GONE, Requests
from .reading import named
from .turns import Turns
from .upstream import Body, Pool

T = TypeVar("T")


@dataclass
class Refusal:
    """An error to answer instead of passing a request on."""

    status: int
    message: str
    extra: dict[str, Any] = field(default_factory=dict)


# Whose turns a request takes (``Exchange.lane``).
Lane = tuple[str | None, str | None, str | None]
NO_MODEL = Refusal(400, 'the request body must be JSON with a "model" field')
# What a request body chose: the model's wrapper and the body to send it, or a refusal.
Chosen = tuple[Wrapper, Body] | Refusal


class Exchange:
    """The requests' way to the local models: turns per arena, connections per model."""

    def __init__(
        self,
        config: Callable[[], Config],
        wrappers: dict[str, Wrapper],
        flights: Flights,
        requests: Requests,
    ) -> None:
        self.config = config  # the router's, which --watch-config replaces
        self.wrappers, self.flights, self.requests = wrappers, flights, requests
        # Per lane (an arena, its GPU, a non-exclusive group or None: ``lane``).
        self.turns: dict[Lane, Turns] = {}
        self.served: dict[Lane, str] = {}  # per lane: its last model
        self.pools: dict[str, Pool] = {}
        self.seen_resident: str | None = None  # the routing rules' last model found resident

    def may_enter_now(self, w: Wrapper) -> bool:
        """Could a request for ``w`` be let in without waiting: its model is the one its
        arena serves now, under its concurrencyLimit, and the routing rules need not
        look (it was found resident)?"""
        model = w.model
        return not (
            w.admitted >= model.concurrency
            or (self.config().routing.engine is not None and self.seen_resident != model.name)
            or self.served.get(self.lane(w)) != model.name
        )

    def enter_now(self, w: Wrapper) -> Turns | None:
        """Let a request for ``w`` in now if its turn allows (``may_enter_now`` held):
        its turns, to leave; None when it would have to wait."""
        turns = self.turns_of(w)
        if not turns.enter_now(w.model.name):
            return None
        w.admit()
        w.enter()
        return turns

    async def take(
        self,
        w: Wrapper,
        flight: Flight,
        shown: str,
        send: Callable[[], Awaitable[T]],
        status: Callable[[T], int],
        busy: Callable[[str], T],
        cancelled: Callable[[], Awaitable[T]],
        settle: Callable[[T], None] | None = None,
    ) -> T:
        """A request for ``w`` (in flight as ``flight``, logged as ``shown``) from its
        turn to its count:
        ``send()``'s answer, ``busy(why)`` over the concurrencyLimit, ``cancelled()``
        once cancelled (POST /api/inflight/ID/cancel); ``settle(answer)`` before it is
        counted."""

        def turn() -> Awaitable[T]:
            return self.in_turn(w, send, busy)

        return await self.carry(w.model.name, flight, shown, turn, status, cancelled, settle,
                                w.info)  # fmt: skip

    async def carry(
        self,
        name: str,
        flight: Flight,
        shown: str,
        send: Callable[[], Awaitable[T]],
        status: Callable[[T], int],
        cancelled: Callable[[], Awaitable[T]],
        settle: Callable[[T], None] | None = None,
        info: Callable[[str], None] | None = None,
    ) -> T:
        """A request (in flight as ``flight``, counted as model ``name``'s) from its
        sending to its count, with no turn: a local model's once ``take`` let it in, a
        peer's (which has no arena) at once. ``send()``'s answer, ``cancelled()`` once
        cancelled (``info`` says so); ``settle(answer)`` before it is counted."""
        began, said = time.monotonic(), GONE
        try:
            try:
                out = await send()
            except asyncio.CancelledError:
                if not flight.cancelled:
                    raise
                uncancel()
                if info is not None:
                    info(f"{shown} cancelled")
                out, shown = await cancelled(), ""
            if settle is not None:
                settle(out)
            said = str(status(out))
            if shown and info is not None:
                info(flight.line(shown, said))
            return out
        finally:
            self.counted(name, flight, said, began)

    def ended(self, w: Wrapper, flight: Flight, status: str, began: float) -> None:
        """A request was answered (``status``: its HTTP status, or gone): counted."""
        self.counted(w.model.name, flight, status, began)

    def counted(self, name: str, flight: Flight, status: str, began: float) -> None:
        """A request for model ``name`` (a local one's, or a peer's as it was asked
        for) was answered (``status``: its HTTP status, or gone): counted."""
        self.requests.add(name, status, time.monotonic() - began)
        self.flights.end(flight, status)

    def choose(
        self, body: bytes | bytearray, name: str | None = None
    ) -> tuple[Wrapper, Body] | Refusal:
        """The model a JSON body names (or ``name``), and the body to send it (its
        filters applied)."""
        if name is None:
            name = named(body)
        if name is None:
            return NO_MODEL
        config = self.config()
        model = config.find(name)
        if model is None:
            return Refusal(404, f"model {name!r} not found", {"models": config.known()})
        found = self.wrappers[model.name]
        if not model.filters:
            return found, body
        try:
            doc = json.loads(body)
        except (ValueError, RecursionError):
            return NO_MODEL
        return found, json.dumps(model.filters.apply(doc, name)).encode()

    async def in_turn(
        self,
        w: Wrapper,
        send: Callable[[], Awaitable[T]],
        busy: Callable[[str], T],
    ) -> T:
        """``send()``'s answer, in the model's turn (``busy(why)``, a 429, over its
        concurrencyLimit)."""
        limit = w.model.concurrency
        if w.admitted >= limit:
            return busy(f"model {w.model.name}: {limit} requests at once already"
                        " (concurrencyLimit)")  # fmt: skip
        w.admit()
        try:
            turns = self.turns_of(w)
            await turns.enter(w.model.name)
        except BaseException:
            w.unadmit()
            raise
        w.enter()
        try:
            await self.evict_for(w)
            await self._make_room(w)
            await w.unloaded()  # a request during its unload goes to the model afresh
            w.ensure_running()
            return await send()
        finally:
            self.leave(w, turns)

    async def evict_for(self, w: Wrapper) -> None:
        """Release, through their release strategies, the models that the routing rules
        (groups, matrix) evict for ``w``'s, before it is let in; nothing when it is
        resident already, or without rules."""
        rules = self.config().routing
        if rules.engine is None or self.seen_resident == w.model.name:
            return
        if w.alive() and w.member_state() in HOLDING:
            # Until a request for another model comes, none can have become resident
            # beside it (models start on their requests): it need not be looked at again.
            self.seen_resident = w.model.name
            return
        self.seen_resident = None
        own = self.lane(w)
        held: dict[Lane, Turns] = {own: self.turns_of(w)}  # w's, in its turn already
        try:
            while True:
                running = [n for n, o in self.wrappers.items()
                           if o is not w and o.alive() and o.member_state() in HOLDING]  # fmt: skip
                evicted = [self.wrappers[name] for name in rules.evict(w.model.name, running)]
                # A model of another lane (an exclusive model evicting a non-exclusive
                # group's) is released in that lane's turn: none of its requests runs.
                lanes = {self.lane(o) for o in evicted} - held.keys()
                if not lanes:
                    break
                for lane in lanes:
                    turns = self._turns(lane)
                    await turns.enter(w.model.name)
                    held[lane] = turns
            for other in evicted:
                other.info(f"releasing it for model {w.model.name} (routing)")
            # Shielded: a request cancelled meanwhile leaves the releases to finish.
            await asyncio.shield(
                asyncio.gather(*(self.unload(other) for other in evicted), return_exceptions=True)
            )
        finally:
            for lane, turns in held.items():
                if lane != own:
                    turns.leave()

    async def _make_room(self, w: Wrapper) -> None:
        """A model of ``w``'s arena that holds the GPU for good (``auto`` found no way
        to release it) would make ``w`` wait forever: it is restarted, as llama-swap
        does to every model. Its turn is over (``Turns``): none of its requests runs.
        Looked for once a model of the arena takes over from another, not per request."""
        where = (w.model.arena, w.model.gpu)
        lane = self.lane(w)
        last = self.served.get(lane)
        if last == w.model.name:
            return
        self.served[lane] = w.model.name
        if last is not None and last in self.pools:
            # Its kept-alive connections would keep its wrapper busy for its --idle
            # (run's 300 ms) after their last traffic: closed, it releases at once. Its
            # turn is over, so none of them is in use.
            self.pools[last].close()
        for other in self.wrappers.values():
            same = (other.model.arena, other.model.gpu) == where
            maybe = other.model.release == "auto" and other.in_flight == 0 and other.alive()
            if other is not w and same and maybe and other.holds_for_good():
                other.info(f"restarting it (it cannot release) for model {w.model.name}")
                await other.restart()

    def unload(self, w: Wrapper) -> asyncio.Task[Unloaded]:
        return w.unload_soon()

    def leave(self, w: Wrapper, turns: Turns) -> None:
        """A request of ``w``'s that ``in_turn`` let in has ended."""
        w.leave()
        turns.leave()
        w.arm_ttl(self.unload)

    def pool(self, w: Wrapper) -> Pool:
        """The connections to ``w``'s wrapper, bounded by the model's timeouts."""
        pool = self.pools.get(w.model.name)
        if pool is None:
            bounds = w.model.timeouts
            pool = self.pools[w.model.name] = Pool(w.port, connect=bounds.connect,
                                                   header=bounds.header)  # fmt: skip
        return pool

    def lane(self, w: Wrapper) -> Lane:
        """Whose turns ``w``'s requests take: its arena's (on its GPU), or, for a model
        of a non-exclusive group, that group's within it: models of two such groups are
        resident together by the rules, and are served side by side, as llama-swap
        serves them."""
        return (w.model.arena, w.model.gpu, self.config().routing.lane(w.model.name))

    def turns_of(self, w: Wrapper) -> Turns:
        return self._turns(self.lane(w))

    def _turns(self, lane: Lane) -> Turns:
        if lane not in self.turns:
            self.turns[lane] = Turns(self.config().routing.priority)
        return self.turns[lane]
