"""A budget waiter's looks, in the test's own process: what it finds between its scan of
the units' locks and its choice (units freed, a resident stepping aside, the budget
changed), with the byte-lock calls wrapped to move the world at the right moment. The
witness of whom it asks is the kernel's: the read locks on want.lock in /proc/locks.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from helpers.budget import asks, set_budget
from helpers.processes import Spawn

from vramlock.arena import lockfd
from vramlock.arena.budget import read_budget
from vramlock.arena.directory import Arena
from vramlock.errors import ArenaError


def test_a_waiter_asks_nobody_for_units_freed_since_it_looked(
    arena: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Units freed between the waiter's scan and its choice are taken by the next
    scan: asking a resident for them would make it step aside for nothing."""
    from vramlock.arena.units import Units

    set_budget(arena, "3G")  # 12 units
    opened = Arena.open(str(arena))
    others = os.open(arena / "capacity.lock", os.O_RDWR)
    budget = read_budget(opened)
    assert budget is not None
    share = Units(opened, budget, 4)
    try:
        assert lockfd.try_lock_bytes(others, 0, 8, write=True)  # residents on units 0-7
        real = lockfd.try_lock_bytes
        asks_at_scan: list[int] = []

        def scan(fd: int, start: int, length: int = 1, *, write: bool) -> bool:
            if fd == share.capacity:
                if start == 0:
                    asks_at_scan.append(asks(arena))  # the kernel's view, as a scan begins
                if len(asks_at_scan) == 1 and start >= 8:
                    return False  # held at the first scan, freed just after it
            return real(fd, start, length, write=write)

        monkeypatch.setattr(lockfd, "try_lock_bytes", scan)
        assert share.queue(5)
        assert asks_at_scan[:2] == [0, 0]  # nobody was asked: units 8-11 were free
        assert sorted(share.units) == [8, 9, 10, 11]
    finally:
        share.close()
        os.close(others)
        opened.close()


def test_a_resident_that_leaves_while_the_waiter_looks_is_not_taken_for_a_stranger(
    arena: Path, spawn: Spawn, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A resident steps aside between the waiter's two looks, at its units' locks and at
    the records: its units must look free, not held by somebody without a record (who
    would be asked last, after the other, idle resident)."""
    from vramlock import procfs
    from vramlock.arena import units
    from vramlock.arena.records import Record, read_live, record_name

    set_budget(arena, "2G")  # 8 units
    opened = Arena.open(str(arena))
    budget = read_budget(opened)
    assert budget is not None
    members = opened.members_dir(create=True)
    assert members is not None
    os.close(members)
    residents = {}
    for name, first, used in (("old", 0, 1.0), ("new", 4, 2.0)):
        proc = spawn(["sleep", "60"])
        fd = os.open(arena / "capacity.lock", os.O_RDWR)
        assert lockfd.try_lock_bytes(fd, first, 4, write=True)
        rec = Record(pid=proc.pid, name=name, command=["sleep"], strategy="test",
                     state="resident", since=1.0, starttime=procfs.starttime(proc.pid) or 0,
                     units=list(range(first, first + 4)), used=used)  # fmt: skip
        path = arena / "members" / record_name(rec.pid, rec.starttime)
        path.write_bytes(rec.dump())
        residents[name] = (fd, rec, path)
    waiter = units.Units(opened, budget, 4)
    real_lock = lockfd.try_lock_bytes
    asks_at_scan: list[int] = []

    def look(dirfd: int) -> list[tuple[Record, bool]]:
        fd, rec, path = residents["old"]
        if rec.units:  # "old" steps aside now: its units, then its record
            lockfd.unlock_bytes(fd, 0, 0)
            rec.units = []
            path.write_bytes(rec.dump())
        return read_live(dirfd)

    def scan(fd: int, start: int, length: int = 1, *, write: bool) -> bool:
        if fd == waiter.capacity and start == 0:
            asks_at_scan.append(asks(arena))
        return real_lock(fd, start, length, write=write)

    monkeypatch.setattr("vramlock.arena.units.read_live", look)
    monkeypatch.setattr(lockfd, "try_lock_bytes", scan)
    try:
        assert waiter.queue(5)
        assert asks_at_scan[:2] == [0, 0]  # "new" was not asked: units 0-3 were free
        assert sorted(waiter.units) == [0, 1, 2, 3]
    finally:
        waiter.close()
        for fd, _, _ in residents.values():
            os.close(fd)
        opened.close()


def test_a_waiter_takes_no_unit_above_a_budget_lowered_while_it_waited(arena: Path) -> None:
    from vramlock.arena.units import Units

    set_budget(arena, "3G")
    opened = Arena.open(str(arena))
    try:
        budget = read_budget(opened)
        assert budget is not None and budget.units == 12
        share = Units(opened, budget, 4)  # read 12 units
        try:
            set_budget(arena, "2G")
            fd = os.open(arena / "capacity.lock", os.O_RDWR)
            try:
                assert lockfd.try_lock_bytes(fd, 0, 8, write=True)  # all 8 units held
                assert not share.queue(0.3)
                assert not lockfd.bytes_locked_elsewhere(fd, 8, 0, write=True)
            finally:
                os.close(fd)
        finally:
            share.close()
    finally:
        opened.close()


@pytest.mark.parametrize("change", ["lowered", "removed"])
def test_a_waiter_that_no_longer_fits_the_budget_says_so(arena: Path, change: str) -> None:
    from vramlock.arena.units import Units

    set_budget(arena, "3G")
    opened = Arena.open(str(arena))
    try:
        budget = read_budget(opened)
        assert budget is not None
        share = Units(opened, budget, 12)
        try:
            if change == "lowered":
                set_budget(arena, "2G")
                said = "changed to 2G (8 units of 256M) while we waited"
            else:
                (arena / "budget").unlink()
                said = "was removed while we waited"
            with pytest.raises(ArenaError, match=re.escape(said)):
                share.queue(1)
            assert not share.resident
        finally:
            share.close()
    finally:
        opened.close()
