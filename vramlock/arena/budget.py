"""A VRAM budget in kernel locks: several members resident at once while they fit.

An arena with a ``budget`` file has three more files (docs/protocol.md, "The budget"):

- ``budget``: ``unit BYTES`` and ``units N``, written only by the arena's owner;
- ``capacity.lock``: byte i is unit i; a budget resident holds an open-file-description
  (OFD) write lock on each byte of its units, and on each unit's claim byte (``claim_byte``);
- ``queue.lock``: flock(LOCK_EX) held by the budget waiter at the head of the line.

A budget resident holds ``token.lock`` shared plus its units, so an exclusive holder
(every member that knows nothing of budgets) still means the whole GPU. A waiter
that does not fit asks chosen residents to step aside with OFD read locks on the
bytes of ``want.lock`` at their units: a level, like the flock of a waiter, that
the kernel drops when the asker dies, and that flock-only participants never see.

This module is the budget file and its sizes, cheap to import (``who`` reads it);
the locking is ``units.py``'s.
"""

from __future__ import annotations

import math
import os
import re
import stat

from ..errors import ArenaError, UsageError
from .directory import Arena

BUDGET = "budget"
CAPACITY = "capacity.lock"
QUEUE = "queue.lock"

UNIT = 256 << 20  # 256 MiB: 564 units on a 141 GB card, a rounding a footprint can afford
MAX_UNITS = 4096  # 1 TiB of 256 MiB units; a byte offset each in capacity.lock

# A resident's claim to a unit, a lock a record's reader can probe: with each unit, a
# budget resident write-locks one more byte of capacity.lock, at an offset that names
# both its pid (the one its record is filed under) and the unit. A record's claim to a
# unit whose claim byte nobody holds is false, whoever wrote it.
CLAIMS = 1 << 40
_MAX_PID = 1 << 22  # the kernel's PID_MAX_LIMIT


def claim_byte(pid: int, unit: int) -> int:
    """The byte of capacity.lock that says ``pid`` holds ``unit``."""
    if not (0 < pid < _MAX_PID and 0 <= unit < MAX_UNITS):
        raise ValueError(f"no claim byte for pid {pid}, unit {unit}")
    return CLAIMS + pid * MAX_UNITS + unit


_MAX_FILE = 4096

_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([MGT])(?:i?B)?\s*", re.IGNORECASE)
_SCALE = {"M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str, option: str) -> int:
    """Bytes from ``6G``, ``512M``, ``1.5T`` (binary multiples; ``GiB``/``GB`` accepted)."""
    m = _SIZE.fullmatch(text)
    if not m:
        raise UsageError(
            f"{option}: bad size {text!r} (a number followed by M, G or T: 512M, 6G, 1.5T)"
        )
    size = float(m.group(1)) * _SCALE[m.group(2).upper()]
    if not 1 <= size <= MAX_UNITS * UNIT:
        raise UsageError(f"{option}: {text!r} is out of range (at most {MAX_UNITS * UNIT >> 40}T)")
    return int(size)


def show_size(size: int) -> str:
    """``6G``, ``1.25G``, ``512M``: the way sizes are given."""
    if size >= 1 << 30:
        return f"{size / (1 << 30):.2f}".rstrip("0").rstrip(".") + "G"
    return f"{size / (1 << 20):.0f}M"


class Budget:
    """An arena's budget: ``units`` units of ``unit`` bytes; equal budgets compare equal."""

    __slots__ = ("unit", "units")

    def __init__(self, unit: int, units: int) -> None:
        self.unit = unit
        self.units = units

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Budget):
            return NotImplemented
        return (self.unit, self.units) == (other.unit, other.units)

    def __hash__(self) -> int:
        return hash((self.unit, self.units))

    def __repr__(self) -> str:
        return f"Budget(unit={self.unit}, units={self.units})"

    @property
    def total(self) -> int:
        return self.unit * self.units

    def units_for(self, footprint: int) -> int:
        """The units a footprint needs; more than the budget has is a usage error."""
        need = max(1, math.ceil(footprint / self.unit))
        if need > self.units:
            raise UsageError(
                f"--vram {show_size(footprint)} is more than the arena's budget "
                f"({show_size(self.total)})"
            )
        return need

    def dump(self) -> bytes:
        return f"unit {self.unit}\nunits {self.units}\n".encode()

    def __str__(self) -> str:
        return f"{show_size(self.total)} ({self.units} units of {show_size(self.unit)})"


def _parse(raw: bytes) -> Budget | None:
    fields: dict[str, int] = {}
    for line in raw.decode("ascii", "replace").splitlines():
        key, _, value = line.strip().partition(" ")
        if key in ("unit", "units") and value.isascii() and value.isdigit():
            fields[key] = int(value)
    unit, units = fields.get("unit", 0), fields.get("units", 0)
    if unit < 1 << 20 or not 1 <= units <= MAX_UNITS:
        return None
    return Budget(unit=unit, units=units)


def read_budget(arena: Arena) -> Budget | None:
    """The arena's budget, or None when it has none.

    Only the arena's owner (or root) may set it, so a file owned by anybody else,
    or writable by anybody else, is refused: it could admit more than fits.
    """
    shown = arena.shown(BUDGET)
    try:
        fd = os.open(BUDGET, _READ_FLAGS, dir_fd=arena.dirfd)
    except FileNotFoundError:
        return None
    except OSError as err:
        raise ArenaError(shown, err.strerror or str(err)) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ArenaError(shown, "is not a regular file")
        if st.st_uid not in (arena.owner, 0):
            raise ArenaError(shown, f"is owned by uid {st.st_uid}, not by the arena's owner")
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise ArenaError(shown, "is writable by others; only the arena's owner may set it")
        found = _parse(os.read(fd, _MAX_FILE + 1)[:_MAX_FILE])
    finally:
        os.close(fd)
    if found is None:
        raise ArenaError(shown, "is not a budget (expected lines 'unit BYTES' and 'units N')")
    return found
