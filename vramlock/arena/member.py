"""One participant of an arena: WAITING -> RESIDENT -> RELEASING -> RELEASED -> WAITING.

This is also the Python API for programs that join an arena themselves::

    with vramlock.resident(name="trainer") as me:
        for batch in data:
            step(batch)
            me.yield_if_wanted(release=offload, restore=reload)
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from types import FrameType
from typing import Any

from ..errors import InvalidTransition, NotObtained
from ..gpu import nvml
from . import journal
from .budget import read_budget
from .directory import Arena, one_arena_or_gpus
from .footprint import DECLARED, WHOLE, Footprint
from .records import Record, RecordWriter
from .records import State as State  # re-exported: vramlock.State, vramlock.arena.member.State
from .residency import (
    REQUEUE_DELAY_MAX,
    BudgetRemoved,
    EveryGpu,
    Publish,
    Residency,
    WholeGpu,
    whole_gpu_instead,
)
from .units import Units

DEFAULT_MIN_HOLD = 0.1
# The state changes a member may make; any other is a bug, refused (llama-swap checks
# its processes' states the same way). RESIDENT -> RELEASED: the API's release() of a
# program that freed its memory itself; WAITING -> RESTORING: the wrapper of a command
# restores it once the token is ours.
TRANSITIONS: dict[State, frozenset[State]] = {
    State.RELEASED: frozenset({State.WAITING}),
    State.WAITING: frozenset({State.RESIDENT, State.RESTORING, State.RELEASED}),
    State.RESIDENT: frozenset({State.RELEASING, State.RELEASED}),
    State.RELEASING: frozenset({State.RELEASED, State.RESIDENT}),
    State.RESTORING: frozenset({State.RESIDENT, State.RELEASED}),
}


def _checked(old: State, new: State) -> State:
    if new not in TRANSITIONS[old]:
        raise InvalidTransition(old.value, new.value)
    return new


def _residency(
    arena: Arena, token_fd: int | None, vram: int | None, measure: bool, publish: Publish
) -> Residency:
    """Budget units where the arena has a budget and the footprint is known (or
    measured, where NVML works); else the whole GPU."""
    budget = read_budget(arena)
    footprint: Footprint | None = None
    if budget is not None:
        if vram is not None:
            footprint = Footprint(vram, DECLARED)
        elif measure and nvml.available():
            footprint = Footprint(budget.total, WHOLE)
    if budget is None or footprint is None:
        return WholeGpu(arena, token_fd, publish=publish)
    need = budget.units_for(footprint.size)
    return Units(arena, budget, need, publish=publish, footprint=footprint, declared=vram)


class Member:
    """A member of one arena, or of several (``--gpu 0,1``: every GPU or none); holds
    the token (or its budget units) while RESIDENT, RELEASING and RESTORING."""

    def __init__(
        self,
        arena: Arena | Sequence[Arena],
        *,
        name: str | None = None,
        min_hold: float = DEFAULT_MIN_HOLD,
        command: list[str] | None = None,
        strategy: str = "api",
        token_fd: int | None = None,
        vram: int | None = None,
        measure: bool = False,
    ) -> None:
        """``token_fd``: lock through a caller's descriptor of token.lock (``wait --fd``).
        ``vram``: the footprint in bytes; in an arena with a budget the member is then
        resident beside others while they fit (budget units), else it takes the
        whole GPU (the token). ``measure``: without ``vram``, where NVML works, be a
        member of the whole budget until the caller measures a footprint
        (``resize``). Several arenas: their tokens are taken in the order given."""
        arenas = [arena] if isinstance(arena, Arena) else list(arena)
        self.arena = arenas[0]
        self.min_hold = min_hold
        self.state = State.RELEASED
        self.resident_since = 0.0
        cmd = command if command is not None else list(sys.argv)
        shown = name or os.path.basename(cmd[0] if cmd else "python")
        # The records first, each written at once: who shows the member from its
        # join on, before anything slow (NVML's first call) and before it queues.
        self._writers: list[RecordWriter] = []
        self._journals = list(arenas)  # the arenas the records (and journal lines) go to
        for a in arenas:
            rec = Record(pid=os.getpid(), name=shown, command=cmd, strategy=strategy,
                         state=self.state.value, since=time.time())  # fmt: skip
            self._writers.append(RecordWriter(a, rec))
        self.records = self._writers[0]
        parts: list[Residency] = []
        try:
            for a, writer in zip(arenas, self._writers, strict=True):
                parts.append(_residency(a, token_fd, vram, measure, self._publisher(writer)))
        except BaseException:
            for part in parts:
                part.close()
            self._close_records()
            raise
        self.residency: Residency = parts[0] if len(parts) == 1 else EveryGpu(parts)

    @staticmethod
    def _publisher(writer: RecordWriter) -> Publish:
        """Where a residency in ``writer``'s arena says what it holds: that record."""

        def publish(changes: dict[str, Any], at_once: bool) -> None:
            writer.change(changes, at_once)

        return publish

    def _set(self, state: State, **changes: object) -> None:
        # In memory only: the record reaches the disk later, from the writer's thread.
        self.state = _checked(self.state, state)
        changes["state"] = state.value
        for arena, writer in zip(self._journals, self._writers, strict=True):
            journal.state(arena, writer.record, state.value)  # queued: written off this path
            writer.change(changes, False)  # not through describe: this is the handoff path

    def describe(self, **changes: object) -> None:
        """Update this member's record (strategy, child pid) as shown by ``who``."""
        for writer in self._writers:
            writer.update(**changes)

    def working(self, busy: bool) -> None:
        """Say whether the command works now (a request in flight, a job running):
        budget waiters ask idle residents first. Safe from any thread."""
        self.residency.working(busy)

    def set_min_hold(self, seconds: float) -> None:
        """Change the minimum hold, of this residency too."""
        self.min_hold = seconds
        self._say_hold()

    def _say_hold(self) -> None:
        self.describe(hold_until=self._hold_until())

    def _hold_until(self) -> float:
        # Budget waiters do not ask a resident inside its minimum hold: it would refuse.
        left = self.resident_since + self.min_hold - time.monotonic()
        return time.time() + max(0.0, left)

    # -- the states ----------------------------------------------------------------------

    def waiting(self) -> None:
        """Queueing for the token from now on."""
        self._set(State.WAITING)

    def released(self) -> None:
        """RELEASED without touching the token: a wait for it was given up."""
        self._set(State.RELEASED)

    def restoring(self) -> None:
        """Mark the time between owning the token and being usable again."""
        self._set(State.RESTORING)

    def resident(self) -> None:
        """Usable on the GPU: the minimum hold starts now."""
        self.resident_since = time.monotonic()
        self._set(State.RESIDENT, hold_until=self._hold_until())

    def releasing(self) -> None:
        """Freeing the GPU memory before stepping aside."""
        self._set(State.RELEASING)

    # -- queueing --------------------------------------------------------------------------

    def acquire(self, timeout: float | None = None, *, wanting: bool = True) -> bool:
        """Queue for the token; True once resident, False if ``timeout`` ran out."""
        self.waiting()
        try:
            got = self.queue(timeout, wanting=wanting)
        except BaseException:
            self.residency.drop()
            self.released()
            raise
        if not got:
            self.released()
            return False
        self.resident()
        return True

    def queue(self, timeout: float | None, *, wanting: bool = True) -> bool:
        """Only the locking part of ``acquire`` (no state change): True once resident.

        The arena as it is now: lock files deleted or replaced since we opened them
        are opened again, and a budget removed meanwhile makes us a whole-GPU member."""
        while True:
            try:
                return self.residency.queue(timeout, wanting=wanting)
            except BudgetRemoved as err:
                # Documented as safe: we carry on as a whole-GPU member.
                self.residency = whole_gpu_instead(self.residency, err)

    def came(self) -> bool:
        """A ``queue`` broken off by a signal: did the token come just before?"""
        return self.residency.came()

    def wait_polite(self, max_delay: float = REQUEUE_DELAY_MAX) -> None:
        """After stepping aside, wait until queueing again cannot barge past a queued
        waiter (no barging)."""
        self.residency.wait_polite(max_delay)

    def taken_elsewhere(self) -> bool:
        """Released: does somebody else hold the token now (did a waiter take it)?"""
        return self.residency.taken_elsewhere()

    # -- resident --------------------------------------------------------------------------

    def wanted(self) -> bool:
        """Does anybody wait for the token (or, for budget units, for ours)?
        A few microseconds: call it in the work loop."""
        return self.residency.wanted()

    def held_long_enough(self) -> bool:
        """Resident for at least ``min_hold``."""
        return time.monotonic() - self.resident_since >= self.min_hold

    def should_release(self) -> bool:
        """Resident for at least ``min_hold``, and somebody waits (or the token we hold
        is no longer the arena's)."""
        return (
            self.state is State.RESIDENT
            and self.held_long_enough()
            and (self.wanted() or self.residency.moved())
        )

    def step_aside(self) -> None:
        """Drop the token (the GPU memory must already be free): RELEASED."""
        # First: nothing, not even our record, delays the next holder.
        self.residency.drop()
        # Let the waiter the kernel just woke run before we go on (wait_polite probes the
        # token): on a 2-CPU machine the kernel handoff p50 was 100 us without, 18 with.
        os.sched_yield()
        self._set(State.RELEASED)

    def release(self) -> None:
        """Drop the token (the GPU memory must already be free): the API's word for
        ``step_aside``."""
        self.step_aside()

    def yield_if_wanted(self, release: Callable[[], object], restore: Callable[[], object]) -> bool:
        """If somebody waits (and ``min_hold`` has passed): release, step aside, come back.

        ``release`` must free this program's GPU memory; ``restore`` brings it back.
        Returns True when it yielded.

        Exceptions from either callback propagate. If ``release`` raises, the member
        is RESIDENT again and still holds the token (its memory is presumably still in
        use). If ``restore`` raises, the token is dropped, so that waiters are not
        starved by a member that cannot use the GPU: the member is RELEASED and must
        ``acquire()`` again before it touches the GPU.
        """
        if not self.should_release():
            return False
        self.releasing()
        try:
            release()
        except BaseException:
            self._set(State.RESIDENT)
            raise
        self.step_aside()
        self.wait_polite()
        self.waiting()
        try:
            self.queue(None)
        except BaseException:
            self.released()
            raise
        self.restoring()
        try:
            restore()
        except BaseException:
            self.step_aside()
            raise
        self.resident()
        return True

    @property
    def arenas(self) -> list[Arena]:
        """The arenas we are a member of (several GPUs: in ascending order)."""
        return self.residency.arenas

    @property
    def name(self) -> str:
        """The name ``who`` shows."""
        return self.records.record.name

    def close(self) -> None:
        """Leave the arena: drop any lock, stop the records' writers, remove the records."""
        self.residency.close()
        self._close_records()

    def _close_records(self) -> None:
        for writer in self._writers:
            writer.close()
        for arena, writer in zip(self._journals, self._writers, strict=True):
            journal.left(arena, writer.record)  # after the token: nobody waits on it


def join(
    stack: ExitStack,
    arena: str | None = None,
    gpus: Sequence[int] = (),
    *,
    name: str | None = None,
    command: list[str] | None = None,
    strategy: str = "api",
    min_hold: float = DEFAULT_MIN_HOLD,
    token_fd: int | None = None,
    vram: int | None = None,
    measure: bool = False,
) -> Member:
    """Become a member of ``arena`` (None: the default one), or of each GPU's default
    arena for several ``gpus`` (as given: ``who`` shows them so), opened in ascending
    order of GPU number, the order their tokens are taken in. What is opened goes on
    ``stack``, which leaves the arenas again (a join that fails half-way included).

    ``token_fd``: lock through a caller's descriptor of token.lock (one arena only).
    ``vram``: the footprint in bytes, for arenas with a budget; ``measure``: without
    it, one arena's footprint is measured (Member)."""
    order: list[int | None] = [*sorted(gpus)] or [None]
    one_arena_or_gpus(arena, order)
    opened: list[Arena] = []
    for gpu in order:
        opened.append(Arena.open(arena, gpu))
        stack.callback(opened[-1].close)
    member = Member(
        opened,
        name=name,
        min_hold=min_hold,
        command=command,
        strategy=strategy,
        token_fd=token_fd,
        vram=vram,
        measure=measure and len(order) == 1,
    )
    stack.callback(member.close)
    if len(order) > 1:
        member.describe(gpus=list(gpus))
    return member


@contextmanager
def resident(
    arena: str | None = None,
    *,
    gpu: int | None = None,
    name: str | None = None,
    timeout: float | None = None,
    min_hold: float = DEFAULT_MIN_HOLD,
) -> Iterator[Member]:
    """Wait for the token, yield the resident Member, leave the arena afterwards.

    Raises NotObtained when ``timeout`` (seconds; 0 = one attempt) runs out.
    """
    with ExitStack() as stack:
        member = join(stack, arena, () if gpu is None else (gpu,), name=name, min_hold=min_hold)
        if not member.acquire(timeout):
            raise NotObtained(timeout or 0.0)
        yield member


@contextmanager
def harmless_signals() -> Iterator[None]:
    """Ignore SIGUSR1, SIGUSR2 and SIGWINCH while queueing for the token.

    ``vramlock run`` forwards them to its command's process group, where a script's
    ``vramlock wait`` is: they must not end a wait. Caught (not SIG_IGN), so a blocked
    flock is interrupted (EINTR) and resumed, keeping its place in the kernel's queue.
    """
    old = {s: signal.signal(s, _ignore) for s in (signal.SIGUSR1, signal.SIGUSR2, signal.SIGWINCH)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def _ignore(signum: int, frame: FrameType | None) -> None:
    pass
