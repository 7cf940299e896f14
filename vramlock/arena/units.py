"""Budget residency: ``token.lock`` shared plus units of ``capacity.lock`` (budget.py
says what the files are; docs/protocol.md, "The budget", is the contract).

Also setting the budget, which takes ``queue.lock`` so that nobody is admitted under
the old one meanwhile.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from ..errors import ArenaError, UsageError
from . import lockfd
from .budget import (
    BUDGET,
    CAPACITY,
    QUEUE,
    UNIT,
    Budget,
    claim_byte,
    read_budget,
    show_size,
)
from .directory import TOKEN, WANT, Arena
from .footprint import DECLARED, Footprint, after_residency
from .records import Record, read_live
from .residency import (
    REQUEUE_DELAY_MAX,
    BudgetRemoved,
    Publish,
    Residency,
    Sized,
    unpublished,
)

# ``--budget auto``: what NVML calls total, less this much for the driver and for
# processes outside the arena.
AUTO_MARGIN_FRACTION = 0.05
AUTO_MARGIN_MIN = 1 << 30

# A failed flock probe of want.lock is probed again after each of these pauses, and
# means a waiter only if every probe fails: with several residents probing, one may
# see another's probe, an exclusive lock held for microseconds - or for milliseconds
# when its holder is preempted on a loaded machine - while a waiter holds want.lock
# for as long as it waits.
CONFIRM = (0.001, 0.004, 0.016)
POLL_MAX = 0.01  # a budget waiter looks at the units at least this often


def _open(arena: Arena, name: str) -> int:
    return lockfd.open_lock_file(
        arena.dirfd, name, arena.shown(name), allowed_owners=arena.allowed_owners
    )


def _open_capacity(arena: Arena) -> int:
    fd = _open(arena, CAPACITY)
    # Units are write locks, which need a descriptor open for writing.
    if lockfd.is_read_only(fd):
        lockfd.close(fd)
        raise ArenaError(
            arena.shown(CAPACITY),
            "is not writable by you; a team arena makes it mode 0660, group of its members",
        )
    return fd


def claimed(capacity: int, pid: int, unit: int) -> bool:
    """Does ``pid`` hold its claim byte for ``unit`` (``capacity``: capacity.lock)? A
    record's word is not enough: anybody who may write in members/ could claim units
    for a living process."""
    try:
        return lockfd.bytes_locked_elsewhere(capacity, claim_byte(pid, unit), write=True)
    except ValueError:
        return False


def claimed_units(arena: Arena, pid: int, units: Iterable[int]) -> list[int]:
    """Those of ``units`` (a record's word) that ``pid`` holds its claim bytes for:
    what asking it to step aside may ask for, and nothing that others hold."""
    wanted = sorted(set(units))
    if not wanted:
        return []
    fd = _open(arena, CAPACITY)
    try:
        return [u for u in wanted if claimed(fd, pid, u)]
    finally:
        lockfd.close(fd)


def _held_from(capacity: int, first: int) -> bool:
    """Is any unit from ``first`` on held by somebody?"""
    return lockfd.bytes_locked_elsewhere(capacity, first, 0, write=True)


def store_budget(arena: Arena, size: int) -> Budget:
    """Set the arena's budget to ``size`` bytes (rounded down to whole units).

    Only the arena's owner may. It is done while holding ``queue.lock``, so that no
    budget waiter is admitted under the old budget meanwhile; a budget that would
    leave units held above its end is refused.
    """
    shown = arena.shown(BUDGET)
    if os.geteuid() not in (arena.owner, 0):
        raise ArenaError(shown, f"only the arena's owner (uid {arena.owner}) may set the budget")
    budget = Budget(unit=UNIT, units=size // UNIT)
    if budget.units < 1:
        raise UsageError(f"--budget: {show_size(size)} is less than one unit ({show_size(UNIT)})")
    queue, capacity = _open(arena, QUEUE), _open_capacity(arena)
    try:
        lockfd.lock(queue, exclusive=True)
        if _held_from(capacity, budget.units):
            raise ArenaError(
                shown,
                f"units above {budget.units} are held by residents; "
                "lower the budget when they have stepped aside",
            )
        tmp = f".{BUDGET}.{os.urandom(6).hex()}.tmp"
        fd = os.open(
            tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644, dir_fd=arena.dirfd
        )
        try:
            os.write(fd, budget.dump())
        finally:
            os.close(fd)
        # A rename replaces the file in one step: a reader sees the old budget or the new.
        os.rename(tmp, BUDGET, src_dir_fd=arena.dirfd, dst_dir_fd=arena.dirfd)
    except OSError as err:
        with contextlib.suppress(OSError, UnboundLocalError):
            os.unlink(tmp, dir_fd=arena.dirfd)
        raise ArenaError(shown, f"cannot be written: {err.strerror or err}") from None
    finally:
        lockfd.unlock(queue)
        lockfd.close(queue)
        lockfd.close(capacity)
    return budget


def auto_size(gpu: int) -> int:
    """``--budget auto``: the GPU's total memory as NVML reports it, less a margin."""
    from ..gpu import nvml

    total = nvml.gpu(gpu).total
    return total - max(AUTO_MARGIN_MIN, int(total * AUTO_MARGIN_FRACTION))


@dataclass
class Candidate:
    """A resident a budget waiter may ask to step aside, as its record describes it."""

    units: list[int]
    busy: bool
    used: float  # Unix time it last worked; 0 when unknown
    known: bool = True  # False: units held by somebody without a record
    hold_until: float = 0.0  # Unix time its minimum hold ends: it refuses to go before
    yield_within: float | None = None  # how long it may stay while busy; None: no bound


def _preference(c: Candidate, now: float) -> tuple[float, ...]:
    """Whom to ask first: those past their minimum hold, idle before busy (a busy one
    by the bound its --yield-within puts on the wait), least recently used first; then
    those inside their minimum hold, by when it ends; units without a record last."""
    if not c.known:
        return (2.0,)
    if c.hold_until > now:
        return (1.0, c.hold_until, c.busy, c.used)
    bound = 0.0 if not c.busy else math.inf if c.yield_within is None else c.yield_within
    return (0.0, 0.0, c.busy, bound, c.used)


def choose(candidates: Iterable[Candidate], missing: int, now: float) -> tuple[set[int], float]:
    """Whom to ask so that ``missing`` units would be freed: the units to ask for now,
    and when to ask (inf: now, or nobody to ask).

    Candidates are taken in ``_preference`` order until they would do; one taken early
    that those after it make unnecessary is left resident. A resident inside its
    minimum hold would refuse: when one is needed, nobody is asked until its hold ends,
    and the others chosen with it go on working meanwhile.
    """
    chosen: list[Candidate] = []
    for c in sorted(candidates, key=lambda c: _preference(c, now)):
        if sum(len(k.units) for k in chosen) >= missing:
            break
        chosen.append(c)
    for c in list(chosen):
        if sum(len(k.units) for k in chosen) - len(c.units) >= missing:
            chosen.remove(c)
    ready = max((c.hold_until for c in chosen if c.known), default=0.0)
    if ready > now:
        return set(), ready
    return {u for c in chosen for u in c.units}, math.inf


def _runs(units: Iterable[int]) -> list[tuple[int, int]]:
    """Sorted units as (start, length) runs: one fcntl call per run."""
    out: list[tuple[int, int]] = []
    for u in sorted(units):
        if out and out[-1][0] + out[-1][1] == u:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((u, 1))
    return out


class Units(Residency, Sized):
    """Budget residency: ``token.lock`` shared plus ``need`` units of ``capacity.lock``.

    ``publish``: where its units and activity go for waiters choosing whom to ask
    (its member's record); ``footprint``: what ``need`` was counted from (default:
    the units' bytes), and ``declared`` the size given by the user, if any.
    """

    def __init__(
        self,
        arena: Arena,
        budget: Budget,
        need: int,
        *,
        publish: Publish | None = None,
        footprint: Footprint | None = None,
        declared: int | None = None,
    ) -> None:
        self.arenas = [arena]
        self.arena = arena
        self.budget = budget
        self.need = need
        self.footprint = footprint or Footprint(need * budget.unit, DECLARED)
        self.declared = declared
        self._publish = publish or unpublished
        self.units: list[int] = []
        self.resident = False
        self.busy = False
        self._asked: set[int] = set()
        self.pid = os.getpid()  # whose claims our units' claim bytes are: our record's pid
        fds: list[int] = []
        try:
            for name in (TOKEN, WANT, WANT, WANT, QUEUE):
                fds.append(_open(arena, name))
            fds.append(_open_capacity(arena))
        except BaseException:
            for fd in fds:
                lockfd.close(fd)
            raise
        # want: our flock while we wait for an exclusive holder; probe: its own open
        # file description, to see others'; asks: the byte locks we ask with, and
        # through which residents look for asks (an OFD sees only others' locks).
        self.token, self.want, self.probe, self.asks, self.queue_fd, self.capacity = fds
        footprint_said = {"vram": self.footprint.size, "vram_from": self.footprint.source}
        self._publish({**footprint_said, "token_ino": os.fstat(self.token).st_ino}, False)

    # -- waiting ------------------------------------------------------------------------

    def queue(self, timeout: float | None = None, *, wanting: bool = True) -> bool:
        """Queue for our units; True once resident, False when ``timeout`` ran out. (A
        budget waiter always asks: ``wanting`` is for whole-GPU waiters.)"""
        end = None if timeout is None else time.monotonic() + timeout

        def left() -> float | None:
            return None if end is None else max(0.0, end - time.monotonic())

        if not lockfd.lock_within(self.queue_fd, exclusive=True, timeout=left()):
            return False
        try:
            self._reread()
            while True:
                if not self._token_shared(left):
                    return False
                got = self._gather(left)
                if got:
                    self.resident = True
                    self._say_units()
                    return True
                self._drop()
                if got is False:
                    return False
        except BaseException:
            self._drop()
            raise
        finally:
            self._ask(set())
            lockfd.unlock(self.queue_fd)

    def came(self) -> bool:
        return self.resident

    def _reread(self) -> None:
        """The budget as it is now: its owner changes it only while holding queue.lock,
        so a budget read before we held it may have units that no longer exist."""
        now = read_budget(self.arena)
        shown = self.arena.shown(BUDGET)
        if now is None:
            raise BudgetRemoved(
                shown, "was removed while we waited; start again", self.token, self._publish
            )
        if now.unit != self.budget.unit or self.need > now.units:
            raise ArenaError(shown, f"changed to {now} while we waited; start again")
        self.budget = now

    def exclusive_waiting(self) -> bool:
        """Does a waiter hold want.lock (which only exclusive waiters hold while residents
        are on the GPU)? A failed probe is confirmed over the ``CONFIRM`` pauses."""
        if not lockfd.conflicts(self.probe, exclusive=True):
            return False
        for pause in CONFIRM:
            time.sleep(pause)
            if not lockfd.conflicts(self.probe, exclusive=True):
                return False
        return True

    def _pause(self, pause: float, left: Callable[[], float | None]) -> float | None:
        """Sleep ``pause`` (less near the deadline); the next pause, or None at the deadline."""
        remaining = left()
        if remaining is not None and remaining <= 0:
            return None
        time.sleep(pause if remaining is None else min(pause, remaining))
        return min(pause * 2, POLL_MAX)

    def _token_shared(self, left: Callable[[], float | None]) -> bool:
        """token.lock shared, queued behind any exclusive waiter; False at the deadline."""
        pause: float | None = 0.0005
        while True:
            if lockfd.try_lock(self.token, exclusive=False):
                if not self.exclusive_waiting():
                    break
                # The kernel grants shared locks past a queued exclusive one: a stream
                # of budget members would starve it. Let it in first.
                lockfd.unlock(self.token)
                pause = self._pause(pause or POLL_MAX, left)
                if pause is None:
                    return False
                continue
            # An exclusive holder: wait as any waiter does, so that it steps aside.
            if not lockfd.lock_within(self.want, exclusive=False, timeout=left()):
                return False
            try:
                lockfd.ring(self.arena.dirfd, TOKEN)
                if not lockfd.lock_within(self.token, exclusive=False, timeout=left()):
                    return False
            finally:
                lockfd.unlock(self.want)
            break
        try:
            lockfd.check_still_linked(self.arena.dirfd, TOKEN, self.token, self.arena.shown(TOKEN))
        except BaseException:
            lockfd.unlock(self.token)
            raise
        return True

    def _gather(self, left: Callable[[], float | None]) -> bool | None:
        """Take free units until we have ``need``, asking residents to step aside for the
        rest. True: we have them; None: an exclusive waiter came (everything is to be
        dropped, and the token taken again behind it); False: the deadline."""
        pause: float | None = 0.0005
        while True:
            if self._take_free(self.need):
                return True
            if self.exclusive_waiting():
                return None
            now = time.time()
            candidates, free = self._candidates()
            # Units freed since the scan above are taken by the next one: ask only for
            # the rest, or a resident would step aside for units nobody needs.
            missing = self.need - len(self.units) - free
            asked, later = choose(candidates, missing, now)
            self._ask(asked)
            # Awake when the minimum hold of those to ask ends, to ask them then.
            wait = 0.0 if free else min(pause or POLL_MAX, max(0.0, later - now))
            pause = self._pause(wait, left)
            if pause is None:
                return False

    def _take_free(self, need: int) -> bool:
        """Take free units (never waiting) until we hold ``need``; True once we do."""
        for unit in range(self.budget.units):
            if len(self.units) >= need:
                break
            if unit not in self.units and lockfd.try_lock_bytes(self.capacity, unit, write=True):
                self.units.append(unit)
                # The claim: what makes our record's word on this unit believed.
                lockfd.try_lock_bytes(self.capacity, claim_byte(self.pid, unit), write=True)
        return len(self.units) >= need

    def _candidates(self) -> tuple[list[Candidate], int]:
        """Residents by their records (advisory), then units nobody's record claims;
        and how many units nobody holds.

        The records are read before the units' locks: while we gather, units only go
        free, and one given up between the two looks then looks free, not held by
        somebody without a record (asked last: after a resident that would do).
        """
        records: list[Record] = []
        dirfd = self.arena.members_dir(create=False)
        if dirfd is not None:
            try:
                # Only a trusted record may decide whom we ask: anybody who may write in
                # members/ could claim units for a living process, held for ever.
                records = [r for r, trusted in read_live(dirfd) if trusted and r.pid != os.getpid()]
            finally:
                os.close(dirfd)
        held = {
            u
            for u in range(self.budget.units)
            if u not in self.units and lockfd.bytes_locked_elsewhere(self.capacity, u, write=True)
        }
        free = self.budget.units - len(self.units) - len(held)
        out: list[Candidate] = []
        for rec in records:
            units = [u for u in rec.units if u in held and claimed(self.capacity, rec.pid, u)]
            if units:
                out.append(
                    Candidate(
                        units=units,
                        busy=rec.busy,
                        used=rec.used or 0.0,
                        hold_until=rec.hold_until or 0.0,
                        yield_within=rec.yield_within,
                    )
                )
                held -= set(units)
        out += [Candidate(units=[u], busy=True, used=0.0, known=False) for u in sorted(held)]
        return out, free

    def _ask(self, units: set[int]) -> None:
        """Hold read locks on want.lock at exactly ``units`` (the kernel never refuses a
        read lock there: nobody write-locks want.lock's bytes)."""
        for start, length in _runs(self._asked - units):
            lockfd.unlock_bytes(self.asks, start, length)
        new = units - self._asked
        for start, length in _runs(new):
            lockfd.try_lock_bytes(self.asks, start, length, write=False)
        self._asked = set(units)
        if new:
            lockfd.ring(self.arena.dirfd, TOKEN)

    def _drop(self) -> None:
        self.resident = False
        lockfd.unlock_bytes(self.capacity, 0, 0)  # length 0: every unit we hold
        self.units = []
        lockfd.unlock(self.token)

    def _say_units(self) -> None:
        self._publish({"units": sorted(self.units), "busy": self.busy, "used": time.time()}, False)

    # -- resident -----------------------------------------------------------------------

    def wanted(self) -> bool:
        """Asked to step aside: a budget waiter asks for one of our units, or an
        exclusive waiter waits."""
        for start, length in _runs(self.units):
            if lockfd.bytes_locked_elsewhere(self.asks, start, length, write=True):
                return True
        return self.exclusive_waiting()

    def working(self, busy: bool) -> None:
        """Say whether we are working now (waiters ask idle residents first); it holds
        for our next residencies too, until said otherwise."""
        changed, self.busy = busy != self.busy, busy
        # A change is written at once: a waiter that takes an idle resident for busy,
        # or a busy one for idle, asks the wrong one.
        self._publish({"busy": busy, "used": time.time()}, changed)

    def footprint_after(self, peak: int) -> Footprint:
        return after_residency(self.declared, peak, self.budget.unit, self.budget.total)

    def resize(self, footprint: Footprint) -> None:
        if self.resident:
            raise ValueError("resident units keep their size until it steps aside")
        self.need = self.budget.units_for(footprint.size)
        self.footprint = footprint
        self._publish({"vram": footprint.size, "vram_from": footprint.source}, False)

    def grow(self, used: int) -> bool:
        # Units taken are kept until we step aside, even when too few were free: they
        # are memory in use, which nobody else may count on.
        need = math.ceil(used / self.budget.unit)
        got = self._take_free(min(need, self.budget.units))
        self._say_units()
        return got and need <= self.budget.units

    @property
    def held_bytes(self) -> int:
        return len(self.units) * self.budget.unit

    def sized(self) -> Sized:
        return self

    def drop(self, *, unlock: bool = True) -> None:
        if not unlock:
            self.resident = False
            self.units = []
            return
        self._drop()
        # At once: until it is written, our record names units somebody else may hold
        # by now, and a waiter would ask that one as if it were us.
        self._publish({"units": [], "busy": False}, True)

    def wait_polite(self, max_delay: float = REQUEUE_DELAY_MAX) -> None:
        """After stepping aside, wait until queueing again cannot barge past the waiter that
        asked: until somebody holds queue.lock, or nobody has for a millisecond."""
        end = time.monotonic() + max_delay
        free_since: float | None = None
        while time.monotonic() < end:
            if lockfd.conflicts(self.queue_fd, exclusive=True):
                return
            now = time.monotonic()
            if free_since is None:
                free_since = now
            elif now - free_since >= 0.001:
                return
            time.sleep(0.0002)

    @property
    def held(self) -> bool:
        return self.resident

    @property
    def fds(self) -> list[int]:
        return [self.token, self.capacity]

    def moved(self) -> bool:
        dirfd = self.arena.dirfd
        return not (
            lockfd.still_linked(dirfd, TOKEN, self.token)
            and lockfd.still_linked(dirfd, WANT, self.want)
        )

    def close(self) -> None:
        if self.resident or self.units:
            self._drop()
        for fd in (self.token, self.want, self.probe, self.asks, self.queue_fd, self.capacity):
            lockfd.close(fd)
