"""One participant of an arena: WAITING -> RESIDENT -> RELEASING -> RELEASED -> WAITING.

This is also the Python API for programs that join an arena themselves::

    with vramlock.resident(name="trainer") as me:
        for batch in data:
            step(batch)
            me.yield_if_wanted(release=offload, restore=reload)
"""

from __future__ import annotations

import math
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from types import FrameType

from ..errors import InvalidTransition, LockFileReplaced, NotObtained
from ..gpu import nvml
from . import journal, lockfd
from .budget import Budget, read_budget
from .directory import Arena, one_arena_or_gpus
from .footprint import DECLARED, WHOLE, Footprint, after_residency
from .locks import Token, Want, wait_turn
from .records import Record, RecordWriter
from .records import State as State  # re-exported: vramlock.State, vramlock.arena.member.State
from .units import Share

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


# No barging: after a release we re-queue once the token has changed hands,
# nobody waits any more, or this long has passed (a queued waiter that has not
# been scheduled yet must not lose the token to us).
REQUEUE_DELAY_MAX = 0.05


class Member:
    """A member of an arena; holds the token while RESIDENT (and while releasing/restoring)."""

    def __init__(
        self,
        arena: Arena,
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
        resident beside others while they fit (a budget share), else it takes the
        whole GPU (the token). ``measure``: without ``vram``, where NVML works, be a
        budget share of the whole budget until the caller measures a footprint
        (``resize``)."""
        self.arena = arena
        self.budget: Budget | None = read_budget(arena)
        self.declared = vram
        footprint: Footprint | None = None  # None: not a budget share
        if self.budget is not None:
            if vram is not None:
                footprint = Footprint(vram, DECLARED)
            elif measure and nvml.available():
                footprint = Footprint(self.budget.total, WHOLE)
        self.min_hold = min_hold
        self.token = Token(arena, fd=token_fd)
        self.want = Want(arena)
        self.state = State.RELEASED
        self.resident_since = 0.0
        cmd = command if command is not None else list(sys.argv)
        self.records = RecordWriter(
            arena,
            Record(
                pid=os.getpid(),
                name=name or os.path.basename(cmd[0] if cmd else "python"),
                command=cmd,
                strategy=strategy,
                state=self.state.value,
                since=time.time(),
                token_ino=self.token.inode,
            ),
        )
        self.share: Share | None = None
        if self.budget is not None and footprint is not None:
            try:
                need = self.budget.units_for(footprint.size)
                self.share = Share(arena, self.budget, need, records=self.records)
            except BaseException:
                self.close()
                raise
            # The size as given, where the share's record says what its units cover.
            self.records.update(vram=footprint.size, vram_from=footprint.source)
        self.footprint = footprint

    def _set(self, state: State) -> None:
        # In memory only: the record reaches the disk later, from the writer's thread.
        self.state = _checked(self.state, state)
        journal.state(self.arena, self.records.record, state.value)
        self.records.update(state=state.value)

    def describe(self, **changes: object) -> None:
        """Update this member's record (strategy, child pid) as shown by ``who``."""
        self.records.update(**changes)

    def working(self, busy: bool) -> None:
        """Say whether the command works now (a request in flight, a job running):
        budget waiters ask idle residents first. Safe from any thread."""
        if self.share is not None:
            self.share.touch(busy)

    def set_min_hold(self, seconds: float) -> None:
        """Change the minimum hold, of this residency too."""
        self.min_hold = seconds
        self._say_hold()

    def _say_hold(self) -> None:
        # Budget waiters do not ask a resident inside its minimum hold: it would refuse.
        if self.share is not None:
            left = self.resident_since + self.min_hold - time.monotonic()
            self.records.update(hold_until=time.time() + max(0.0, left))

    def acquire(self, timeout: float | None = None, *, wanting: bool = True) -> bool:
        """Queue for the token; True once resident, False if ``timeout`` ran out."""
        if not self._queue(timeout, wanting=wanting):
            return False
        self.resident()
        return True

    def _queue(self, timeout: float | None, *, wanting: bool = True) -> bool:
        """WAITING until the token is ours (True), or RELEASED again when it is not."""
        self.waiting()
        try:
            got = self.take_token(timeout, wanting=wanting)
        except BaseException:
            self._set(State.RELEASED)
            raise
        if not got:
            self._set(State.RELEASED)
        return got

    def released(self) -> None:
        """RELEASED without touching the token: a wait for it was given up."""
        self._set(State.RELEASED)

    def waiting(self) -> None:
        self._set(State.WAITING)

    def take_token(self, timeout: float | None, *, wanting: bool = True) -> bool:
        """Only the locking part of ``acquire``: safe from a helper thread (no state change).

        Queues on the lock files the arena has now: one that was deleted (or replaced)
        since we opened it excludes nobody any more."""
        if self.share is not None:
            return self.share.acquire(timeout)
        end = None if timeout is None else time.monotonic() + timeout
        while True:
            if self.moved():
                self.rejoin()
            left = None if end is None else max(0.0, end - time.monotonic())
            try:
                return wait_turn(self.want, self.token, left, wanting=wanting)
            except LockFileReplaced:
                if self.token.adopted:
                    raise  # the caller's descriptor (wait --fd): we cannot reopen it

    def moved(self) -> bool:
        """Was token.lock or want.lock deleted or replaced since we opened it? Then
        our locks exclude nobody: step aside and queue again on the new files."""
        return not (self.token.linked() and self.want.linked())

    def rejoin(self) -> None:
        """Lock the files the arena has now (never while holding the token)."""
        if not self.token.adopted:
            self.token.reopen()
        self.want.reopen()
        self.records.update(token_ino=self.token.inode)

    def restoring(self) -> None:
        """Mark the time between owning the token and being usable again."""
        self._set(State.RESTORING)

    def resident(self) -> None:
        self.resident_since = time.monotonic()
        self._set(State.RESIDENT)
        self._say_hold()

    def wanted(self) -> bool:
        """Does anybody wait for the token (or, for a budget share, for our units)?
        A few microseconds: call it in the work loop."""
        return self.share.wanted() if self.share is not None else self.want.probe()

    def held_long_enough(self) -> bool:
        return time.monotonic() - self.resident_since >= self.min_hold

    def should_release(self) -> bool:
        """Resident for at least ``min_hold``, and somebody waits (or the token we hold
        is no longer the arena's)."""
        return (
            self.state is State.RESIDENT
            and self.held_long_enough()
            and (self.wanted() or self.moved())
        )

    def releasing(self) -> None:
        self._set(State.RELEASING)

    # -- a budget share's footprint ----------------------------------------------------

    def _sized(self) -> tuple[Share, Budget]:
        if self.share is None or self.budget is None:
            raise ValueError("not a budget share: it has no footprint")
        return self.share, self.budget

    def footprint_after(self, peak: int) -> Footprint:
        """The footprint to ask for after a residency that used at most ``peak`` bytes."""
        _, budget = self._sized()
        return after_residency(self.declared, peak, budget.unit, budget.total)

    def resize(self, footprint: Footprint) -> None:
        """Ask for ``footprint`` at the next admission (between residencies)."""
        share, budget = self._sized()
        share.resize(budget.units_for(footprint.size))
        self.footprint = footprint
        self.records.update(vram=footprint.size, vram_from=footprint.source)

    def grow(self, used: int) -> bool:
        """Resident and using ``used`` bytes: take free units until ours cover them.
        False when too few are free, or ``used`` is more than the budget."""
        share, budget = self._sized()
        need = math.ceil(used / budget.unit)
        return share.grow(min(need, budget.units)) and need <= budget.units

    @property
    def share_bytes(self) -> int:
        """What the units we hold cover."""
        share, budget = self._sized()
        return len(share.units) * budget.unit

    def release(self) -> None:
        """Drop the token (the GPU memory must already be free)."""
        # First: nothing, not even our record, delays the next holder.
        if self.share is not None:
            self.share.release()
        else:
            self.token.release()
        # Let the waiter the kernel just woke run before we go on (wait_polite probes the
        # token): on a 2-CPU machine the kernel handoff p50 was 100 us without, 18 with.
        os.sched_yield()
        self._set(State.RELEASED)

    def wait_polite(self, max_delay: float = REQUEUE_DELAY_MAX) -> None:
        """After a release, wait until re-queueing cannot barge past a queued waiter.

        A process calling flock at the instant the token is free jumps the kernel's
        queue; once somebody else holds the token, queueing is fair again.
        """
        if self.share is not None:
            self.share.wait_polite(max_delay)
            return
        end = time.monotonic() + max_delay
        pause = 0.0002
        while time.monotonic() < end:
            if not self.want.probe() or self.token.held_elsewhere():
                return
            time.sleep(pause)
            pause = min(pause * 2, 0.005)

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
        self.release()
        self.wait_polite()
        self._queue(None)
        self.restoring()
        try:
            restore()
        except BaseException:
            self.release()
            raise
        self.resident()
        return True

    # -- the token as the wrapper of a command handles it ------------------------------

    @property
    def token_fds(self) -> list[int]:
        """The descriptors a wrapped command inherits, so that it keeps the token (the
        token first: its number is the one the command is told)."""
        return self.share.fds if self.share is not None else [self.token.fd]

    @property
    def arenas(self) -> list[Arena]:
        return [self.arena]

    @property
    def holds_token(self) -> bool:
        return self.share.resident if self.share is not None else self.token.held

    def token_came(self) -> bool:
        """A blocking wait for the token was broken off by a signal: did the kernel
        grant it just before? (A non-blocking try on our own description settles it;
        a budget share broken off has dropped what it had gathered.)"""
        if self.share is not None:
            return self.share.resident
        if lockfd.try_lock(self.token.fd, exclusive=True):
            self.token.held = True
        return self.token.held

    def drop_token(self, *, unlock: bool = True) -> None:
        """Stop holding the token. ``unlock=False`` only forgets it: whoever shares our
        open file description (the command) keeps the lock until it closes it."""
        if self.share is not None:
            if unlock:
                self.share.release()
            else:
                self.share.forget()
        if self.token.held:
            if unlock:
                self.token.release()
            else:
                self.token.held = False

    def close(self) -> None:
        """Leave the arena: drop any lock, stop the record's writer, remove the record."""
        if self.share is not None:
            self.share.close()
        if self.token.held:
            self.token.release()
        self.want.close()
        self.token.close()
        self.records.close()
        journal.left(self.arena, self.records.record)  # after the token: nobody waits on it


class Members:
    """One participant of several arenas (``--gpu 0,1``): it holds every token or none.

    It has Member's interface, as the wrapper of a command uses it. Tokens are taken
    one at a time in the order of ``members`` - ascending GPU numbers, the same for
    everybody - so that two jobs wanting overlapping GPUs can never each hold a token
    the other one waits for. A wait that fails half-way (timeout, signal) drops what
    it got: a member that is not resident holds no token for long.
    """

    def __init__(self, members: list[Member]) -> None:
        if not members:
            raise ValueError("Members needs at least one member")
        self.members = members
        self.state = State.RELEASED
        self.resident_since = 0.0
        self.min_hold = members[0].min_hold
        self.records = members[0].records  # the child pid shown; every record has it

    def _set(self, state: State) -> None:
        self.state = _checked(self.state, state)

    def _each(self, call: Callable[[Member], object]) -> None:
        for m in self.members:
            call(m)

    def describe(self, **changes: object) -> None:
        self._each(lambda m: m.describe(**changes))

    def working(self, busy: bool) -> None:
        self._each(lambda m: m.working(busy))

    def set_min_hold(self, seconds: float) -> None:
        self.min_hold = seconds
        self._each(lambda m: m.set_min_hold(seconds))

    def waiting(self) -> None:
        self._set(State.WAITING)
        self._each(Member.waiting)

    def released(self) -> None:
        self._set(State.RELEASED)
        self._each(Member.released)

    def restoring(self) -> None:
        self._set(State.RESTORING)
        self._each(Member.restoring)

    def resident(self) -> None:
        self._set(State.RESIDENT)
        self.resident_since = time.monotonic()
        self._each(Member.resident)

    def releasing(self) -> None:
        self._set(State.RELEASING)
        self._each(Member.releasing)

    def acquire(self, timeout: float | None = None, *, wanting: bool = True) -> bool:
        """Queue for every token in order; True once all are ours, False if ``timeout`` ran out."""
        self.waiting()
        try:
            got = self.take_token(timeout, wanting=wanting)
        except BaseException:
            self.drop_token()
            self.released()
            raise
        if not got:
            self.released()
            return False
        self.resident()
        return True

    def take_token(self, timeout: float | None, *, wanting: bool = True) -> bool:
        """Take the tokens not held yet, in order; on a timeout drop those taken.

        An exception (a signal breaking the wait) leaves what was taken held:
        ``token_came`` settles it."""
        end = None if timeout is None else time.monotonic() + timeout
        for m in self.members:
            if m.token.held:
                continue
            left = None if end is None else max(0.0, end - time.monotonic())
            if not m.take_token(left, wanting=wanting):
                self.drop_token()
                return False
        return True

    def token_came(self) -> bool:
        """After a broken-off wait: True when every token is ours (the rest are tried
        without blocking); else those held are dropped."""
        for m in self.members:
            if not m.token_came():
                self.drop_token()
                return False
        return True

    def wanted(self) -> bool:
        return any(m.wanted() for m in self.members)

    def held_long_enough(self) -> bool:
        return time.monotonic() - self.resident_since >= self.min_hold

    def should_release(self) -> bool:
        """Resident for ``min_hold``, and somebody waits for any of the GPUs (or one
        of our tokens is no longer its arena's)."""
        return (
            self.state is State.RESIDENT
            and self.held_long_enough()
            and (self.wanted() or any(m.moved() for m in self.members))
        )

    def release(self) -> None:
        """Drop every token (the memory must be free on every GPU)."""
        self._set(State.RELEASED)
        self._each(Member.release)

    def wait_polite(self, max_delay: float = REQUEUE_DELAY_MAX) -> None:
        end = time.monotonic() + max_delay
        for m in self.members:
            m.wait_polite(max(0.0, end - time.monotonic()))

    @property
    def token_fds(self) -> list[int]:
        return [m.token.fd for m in self.members]

    @property
    def arenas(self) -> list[Arena]:
        return [m.arena for m in self.members]

    @property
    def holds_token(self) -> bool:
        return any(m.token.held for m in self.members)

    def drop_token(self, *, unlock: bool = True) -> None:
        for m in reversed(self.members):
            m.drop_token(unlock=unlock)

    def close(self) -> None:
        for m in reversed(self.members):
            m.close()


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
) -> Member | Members:
    """Become a member of ``arena`` (None: the default one), or of each GPU's default
    arena for several ``gpus`` (as given: ``who`` shows them so), opened in ascending
    order of GPU number, the order their tokens are taken in. What is opened goes on
    ``stack``, which leaves the arenas again (a join that fails half-way included).

    ``token_fd``: lock through a caller's descriptor of token.lock (one arena only).
    ``vram``: the footprint in bytes, for arenas with a budget; ``measure``: without
    it, one arena's footprint is measured (Member)."""
    order: list[int | None] = [*sorted(gpus)] or [None]
    one_arena_or_gpus(arena, order)
    joined: list[Member] = []
    for gpu in order:
        opened = Arena.open(arena, gpu)
        stack.callback(opened.close)
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
        joined.append(member)
    return joined[0] if len(joined) == 1 else Members(joined)


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
        assert isinstance(member, Member)  # one arena
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
