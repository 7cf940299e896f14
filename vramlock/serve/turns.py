"""Admission for one arena's models, a model at a time, so that a burst for several
models is served grouped by model instead of swapping on every request."""

from __future__ import annotations

import asyncio
import time

# Once a request for another model has waited this long, new requests for the model
# being served queue behind it: grouping never starves a model for longer.
GROUP_WAIT = 2.0
# When the model being served has no request left and others are waiting, its turn
# lasts this much longer, for its client's next request. A request that finds nothing in
# progress goes at once: a client alternating models waits for nothing but the switch
# (it once waited this much more each time: 0.23 s through serve against 0.13 s through
# run's proxy, two 5 GiB llama-servers on an H100).
LINGER = 0.1


class Turns:
    """Admission for one arena's models: one model's requests at a time.

    Requests for the model being served are admitted at once, unless a request for
    another model has waited ``GROUP_WAIT``; others queue. When no admitted request is
    left (and none came within ``LINGER``, or somebody waited too long), every queued
    request of the model waiting longest is admitted. A request that finds nothing in
    progress and nobody waiting is admitted at once, whatever its model. A B A B
    arriving together are served A A B B; clients that never pause take turns of about
    ``GROUP_WAIT``, so a request waits at most that long for each other model's turn
    (and its swap).

    ``priority`` (llama-swap's fifo priorities, model -> priority, 0 by default): of
    the models waiting when a turn ends, one of the highest priority goes next, the
    one waiting longest among them.
    """

    def __init__(self, priority: dict[str, int] | None = None) -> None:
        self.priority = priority or {}
        self.current: str | None = None
        self.active = 0
        self._queued: dict[str, list[tuple[float, asyncio.Future[None]]]] = {}
        self._switch: asyncio.TimerHandle | None = None
        self._turn_began = 0.0

    def _overdue(self) -> bool:
        """Has the current turn lasted GROUP_WAIT since it began and since somebody
        else started waiting?"""
        oldest = min((q[0][0] for q in self._queued.values() if q), default=None)
        if oldest is None:
            return False
        return time.monotonic() - max(oldest, self._turn_began) > GROUP_WAIT

    def enter_now(self, model: str) -> bool:
        """Let a request for ``model`` in if it need not wait; whether it was."""
        if self.current is None or (self.current == model and not self._overdue()):
            if self._switch is not None:
                self._switch.cancel()
                self._switch = None
            if self.current is None:
                self._begin(model)
            self.active += 1
            return True
        return False

    async def enter(self, model: str) -> None:
        if self.enter_now(model):
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        queue = self._queued.setdefault(model, [])
        queue.append((time.monotonic(), fut))
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.leave()  # admitted in the same instant it was cancelled
            else:
                queue[:] = [q for q in queue if q[1] is not fut]
                if not queue:
                    self._queued.pop(model, None)
                    if self.active == 0 and not any(self._queued.values()):
                        self.current = None
            raise

    def _begin(self, model: str) -> None:
        self.current = model
        self._turn_began = time.monotonic()

    def leave(self) -> None:
        self.active -= 1
        if self.active > 0:
            return
        if not any(self._queued.values()):
            self.current = None
        elif self._overdue():
            self._next()
        elif self._switch is None:
            self._switch = asyncio.get_running_loop().call_later(LINGER, self._next)

    def _next(self) -> None:
        self._switch = None
        if self.active > 0:
            return  # the model's next request came in time
        waiting = {m: q for m, q in self._queued.items() if q}
        if not waiting:
            self.current = None
            return
        model = min(waiting, key=lambda m: (-self.priority.get(m, 0), waiting[m][0][0]))
        self._begin(model)
        for _, fut in self._queued.pop(model):
            self.active += 1
            fut.set_result(None)
