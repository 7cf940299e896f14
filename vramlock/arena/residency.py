"""How a member holds the GPU: one interface, three ways.

- ``WholeGpu``: ``token.lock`` exclusive, queued behind ``want.lock`` (locks.py);
- ``units.Units``: ``token.lock`` shared plus budget units of ``capacity.lock``;
- ``EveryGpu``: a whole-GPU residency of each of several arenas, all or none.

A residency only locks; the member around it keeps the state machine and the record.
"""

from __future__ import annotations

import os
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

from ..errors import ArenaError, LockFileReplaced
from . import lockfd
from .directory import Arena
from .footprint import Footprint
from .locks import Token, Want, wait_turn

# No barging: after stepping aside we queue again once the token has changed hands,
# nobody waits any more, or this long has passed (a queued waiter that has not been
# scheduled yet must not lose the token to us).
REQUEUE_DELAY_MAX = 0.05

# How a residency publishes what budget waiters choose by (its units, whether it
# works) in its member's record: the changes, and whether to write them at once.
Publish = Callable[[dict[str, Any], bool], None]


def unpublished(changes: dict[str, Any], at_once: bool) -> None:
    """The ``Publish`` of a residency without a record."""


class BudgetRemoved(ArenaError):
    """The budget file went while we queued for budget units: the arena has whole-GPU
    members only. ``token``: the units' descriptor of token.lock, which their command
    may share; ``publish``: where they said what they held."""

    def __init__(self, path: str, reason: str, token: int, publish: Publish) -> None:
        super().__init__(path, reason)
        self.token = token
        self.publish = publish


class Sized(ABC):
    """The part of a budget residency that has a footprint (whole-GPU ones have none)."""

    footprint: Footprint

    @abstractmethod
    def footprint_after(self, peak: int) -> Footprint:
        """The footprint to ask for after a residency that used at most ``peak`` bytes."""

    @abstractmethod
    def resize(self, footprint: Footprint) -> None:
        """Ask for ``footprint`` at the next admission (between residencies)."""

    @abstractmethod
    def grow(self, used: int) -> bool:
        """Resident and using ``used`` bytes: take free units until ours cover them.
        False when too few are free, or ``used`` is more than the budget."""

    @property
    @abstractmethod
    def held_bytes(self) -> int:
        """What the units we hold cover."""


class Residency(ABC):
    """The locks that make a member resident. ``queue`` blocks (in the kernel where it
    can), so it must be safe to break off with a signal: ``came`` then settles it."""

    arenas: list[Arena]

    @abstractmethod
    def queue(self, timeout: float | None, *, wanting: bool = True) -> bool:
        """Queue until resident (True), or until ``timeout`` runs out (False).
        ``wanting=False`` waits passively: residents are not asked to step aside."""

    @abstractmethod
    def came(self) -> bool:
        """A ``queue`` broken off by a signal: did residency come just before? (Anything
        half-gathered is dropped.)"""

    @abstractmethod
    def drop(self, *, unlock: bool = True) -> None:
        """Stop being resident. ``unlock=False`` only forgets it: whoever shares our open
        file descriptions (the command) keeps the locks until it closes them."""

    @abstractmethod
    def wanted(self) -> bool:
        """Does anybody wait for what we hold? A few microseconds: the work loop's probe."""

    @abstractmethod
    def wait_polite(self, max_delay: float = REQUEUE_DELAY_MAX) -> None:
        """After stepping aside, wait until queueing again cannot barge past a waiter."""

    def taken_elsewhere(self) -> bool:
        """Released: does somebody else hold what we released now? (Where it cannot be
        told, as for budget units, True: a release is never taken for unanswered.)"""
        return True

    @property
    @abstractmethod
    def held(self) -> bool:
        """Do we hold anything (the token, or units)?"""

    @property
    @abstractmethod
    def fds(self) -> list[int]:
        """The descriptors a wrapped command inherits, so that it keeps the residency
        (the token first: its number is the one the command is told)."""

    @abstractmethod
    def moved(self) -> bool:
        """Was a lock file we queue on deleted or replaced since we opened it? Then our
        locks exclude nobody: step aside; ``queue`` opens the new files (a budget
        residency cannot: it fails there)."""

    def working(self, busy: bool) -> None:  # noqa: B027 - only budget waiters ask
        """Say whether the command works now: budget waiters ask idle residents first."""

    def sized(self) -> Sized | None:
        """The footprint part, for a budget residency."""
        return None

    def parts(self) -> list[Residency]:
        """One residency per arena."""
        return [self]

    @abstractmethod
    def close(self) -> None:
        """Drop whatever is held and close the lock files."""


class WholeGpu(Residency):
    """``token.lock`` exclusive: the whole GPU, queued as the protocol's waiter."""

    def __init__(
        self, arena: Arena, token_fd: int | None = None, *, publish: Publish | None = None
    ) -> None:
        """``token_fd``: lock through a caller's descriptor of token.lock (``wait --fd``).
        ``publish``: where the token.lock we lock is said (the member's record)."""
        self.arenas = [arena]
        self.token = Token(arena, fd=token_fd)
        try:
            self.want = Want(arena)
        except BaseException:
            self.token.close()
            raise
        self._publish = publish or unpublished
        self._say_token()

    def _say_token(self) -> None:
        self._publish({"token_ino": self.token.inode}, False)

    def queue(self, timeout: float | None, *, wanting: bool = True) -> bool:
        # On the lock files the arena has now: one deleted (or replaced) since we
        # opened it excludes nobody any more.
        end = None if timeout is None else time.monotonic() + timeout

        def left() -> float | None:
            return None if end is None else max(0.0, end - time.monotonic())

        while True:
            if self.moved():
                self.rejoin()
            try:
                return wait_turn(self.want, self.token, left(), wanting=wanting)
            except LockFileReplaced:
                if self.token.adopted:
                    raise  # the caller's descriptor (wait --fd): we cannot reopen it

    def came(self) -> bool:
        # A non-blocking try on our own description settles it.
        if lockfd.try_lock(self.token.fd, exclusive=True):
            self.token.held = True
        return self.token.held

    def drop(self, *, unlock: bool = True) -> None:
        if not self.token.held:
            return
        if unlock:
            self.token.drop()
        else:
            self.token.held = False

    def wanted(self) -> bool:
        return self.want.probe()

    def wait_polite(self, max_delay: float = REQUEUE_DELAY_MAX) -> None:
        # A process calling flock at the instant the token is free jumps the kernel's
        # queue; once somebody else holds the token, queueing is fair again.
        end = time.monotonic() + max_delay
        pause = 0.0002
        while time.monotonic() < end:
            if not self.want.probe() or self.token.held_elsewhere():
                return
            time.sleep(pause)
            pause = min(pause * 2, 0.005)

    def taken_elsewhere(self) -> bool:
        return self.token.held_elsewhere()

    @property
    def held(self) -> bool:
        return self.token.held

    @property
    def fds(self) -> list[int]:
        return [self.token.fd]

    def moved(self) -> bool:
        return not (self.token.linked() and self.want.linked())

    def rejoin(self) -> None:
        """Lock the files the arena has now (never while resident)."""
        if not self.token.adopted:
            self.token.reopen()
        self.want.reopen()
        self._say_token()

    def close(self) -> None:
        self.drop()
        self.want.close()
        self.token.close()


class EveryGpu(Residency):
    """Every GPU of a multi-GPU job (``--gpu 0,1``): each part's residency, or none.

    Parts are taken one at a time in ascending GPU order - the same for everybody - so
    that two jobs wanting overlapping GPUs never each hold a token the other waits for.
    A wait that runs out half-way drops what it got: a member that is not resident
    holds no token for long. A signal breaking the wait leaves it held: ``came`` settles.
    """

    def __init__(self, parts: list[Residency]) -> None:
        self._parts = parts
        self.arenas = [a for p in parts for a in p.arenas]

    def queue(self, timeout: float | None, *, wanting: bool = True) -> bool:
        end = None if timeout is None else time.monotonic() + timeout
        for i, part in enumerate(self._parts):
            if part.held:
                continue
            if not self._queue_part(i, end, wanting):
                self.drop()
                return False
        return True

    def _queue_part(self, i: int, end: float | None, wanting: bool) -> bool:
        while True:
            left = None if end is None else max(0.0, end - time.monotonic())
            try:
                return self._parts[i].queue(left, wanting=wanting)
            except BudgetRemoved as err:
                self._parts[i] = whole_gpu_instead(self._parts[i], err)

    def came(self) -> bool:
        for part in self._parts:
            if not part.came():
                self.drop()
                return False
        return True

    def drop(self, *, unlock: bool = True) -> None:
        for part in reversed(self._parts):
            part.drop(unlock=unlock)

    def wanted(self) -> bool:
        return any(p.wanted() for p in self._parts)

    def wait_polite(self, max_delay: float = REQUEUE_DELAY_MAX) -> None:
        end = time.monotonic() + max_delay
        for part in self._parts:
            part.wait_polite(max(0.0, end - time.monotonic()))

    def taken_elsewhere(self) -> bool:
        return any(p.taken_elsewhere() for p in self._parts)

    @property
    def held(self) -> bool:
        return any(p.held for p in self._parts)

    @property
    def fds(self) -> list[int]:
        return [fd for p in self._parts for fd in p.fds]

    def moved(self) -> bool:
        return any(p.moved() for p in self._parts)

    def working(self, busy: bool) -> None:
        for part in self._parts:
            part.working(busy)

    def parts(self) -> list[Residency]:
        return list(self._parts)

    def close(self) -> None:
        for part in reversed(self._parts):
            part.close()


def whole_gpu_instead(units: Residency, err: BudgetRemoved) -> WholeGpu:
    """A whole-GPU residency for budget units whose budget was removed, locking through a
    copy of their open file description of token.lock: a command that inherited
    it keeps holding whatever we lock."""
    whole = WholeGpu(units.arenas[0], token_fd=os.dup(err.token), publish=err.publish)
    units.close()
    err.publish({"vram": None, "vram_from": None, "units": [], "busy": False}, False)
    return whole
