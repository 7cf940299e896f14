"""A VRAM budget in kernel locks: the byte-lock primitives, the choice of whom a waiter
asks, and the budget file. Budget residency with real processes is in
test_budget_residency.py, a waiter's looks at the locks and records in
test_budget_waiters.py.
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from helpers.budget import set_budget
from helpers.commands import vramlock
from helpers.errors import FOREIGN_UID, OWN_FAILURE, USAGE, ErrCli, expect_error, needs_root
from helpers.processes import wait_until

from vramlock.arena import lockfd
from vramlock.arena.budget import Budget, read_budget
from vramlock.arena.directory import Arena
from vramlock.arena.units import Candidate, choose
from vramlock.errors import ArenaError
from vramlock.procfs import read_proc_locks

# -- primitives --------------------------------------------------------------------------


def _ofd_child(path: Path) -> subprocess.Popen[str]:
    code = (
        "import os, sys\n"
        "from vramlock.arena import lockfd\n"
        "fd = os.open(sys.argv[1], os.O_RDWR)\n"
        "assert lockfd.try_lock_bytes(fd, 3, write=True)\n"
        "print('held', flush=True)\n"
        "sys.stdin.read()\n"
    )
    return subprocess.Popen(
        [sys.executable, "-c", code, str(path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


def test_byte_locks_belong_to_the_open_file_description(tmp_path: Path) -> None:
    path = tmp_path / "units.lock"
    path.write_bytes(b"")
    a, b = os.open(path, os.O_RDWR), os.open(path, os.O_RDWR)
    try:
        assert lockfd.try_lock_bytes(a, 3, write=True)
        assert not lockfd.try_lock_bytes(b, 3, write=True)  # another OFD of one process
        assert lockfd.try_lock_bytes(b, 4, write=True)  # a byte is a unit
        assert lockfd.bytes_locked_elsewhere(b, 0, 4, write=True)
        assert not lockfd.bytes_locked_elsewhere(a, 3, 1, write=True)  # our own lock
        # flock and byte locks on one file never interact (Linux).
        fcntl.flock(b, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.close(os.open(path, os.O_RDONLY))  # closing another descriptor keeps OFD locks
        assert lockfd.bytes_locked_elsewhere(b, 3, 1, write=True)
        lockfd.unlock_bytes(a, 0, 0)
        assert not lockfd.bytes_locked_elsewhere(b, 3, 1, write=True)
        assert lockfd.try_lock_bytes(a, 3, write=False) and lockfd.try_lock_bytes(b, 3, write=False)
        assert lockfd.bytes_locked_elsewhere(b, 3, 1, write=True)  # a reader asks a writer
        assert not lockfd.bytes_locked_elsewhere(b, 3, 1, write=False)
    finally:
        os.close(a)
        os.close(b)


def test_byte_lock_of_a_killed_process_is_freed_and_shown_in_proc_locks(tmp_path: Path) -> None:
    path = tmp_path / "units.lock"
    path.write_bytes(b"")
    child = _ofd_child(path)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "held"
        ino = str(os.stat(path).st_ino)
        listing = read_proc_locks().splitlines()
        mine = [ln.split() for ln in listing if any(p.endswith(":" + ino) for p in ln.split())]
        assert [(m[1], m[3], m[-2], m[-1]) for m in mine] == [("OFDLCK", "WRITE", "3", "3")]
        fd = os.open(path, os.O_RDWR)
        try:
            assert not lockfd.try_lock_bytes(fd, 3, write=True)
            child.kill()
            child.wait(10)
            wait_until(lambda: lockfd.try_lock_bytes(fd, 3, write=True))
        finally:
            os.close(fd)
    finally:
        child.kill()
        child.communicate(timeout=10)


def test_a_change_waiters_choose_by_is_written_without_settling(
    arena: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from vramlock.arena import records

    monkeypatch.setattr(records, "_SETTLE", 30.0)  # a plain update waits that long
    opened = Arena.open(str(arena))
    record = records.Record(
        pid=os.getpid(), name="m", command=["m"], strategy="test", state="resident", since=1.0
    )
    writer = records.RecordWriter(opened, record)
    try:
        path = arena / "members" / writer.name

        def on_disk() -> dict[str, object]:
            data: dict[str, object] = json.loads(path.read_bytes())
            return data

        writer.update(used=5.0)
        writer.update_at_once(busy=True)
        wait_until(lambda: on_disk()["busy"] is True, timeout=10)
        assert on_disk()["used"] == 5.0  # the latest version, earlier changes with it
        writer.update(busy=False)
        time.sleep(0.3)
        assert on_disk()["busy"] is True  # plain updates still settle
    finally:
        writer.close()
        opened.close()


def test_choose_asks_idle_then_least_recently_used_then_unknown() -> None:
    busy_old = Candidate(units=[0, 1], busy=True, used=1.0)
    idle_new = Candidate(units=[2, 3], busy=False, used=30.0)
    idle_old = Candidate(units=[4], busy=False, used=20.0)
    unknown = Candidate(units=[5], busy=True, used=0.0, known=False)

    def choose_now(cands: list[Candidate], missing: int) -> set[int]:
        asked, later = choose(cands, missing, 100.0)
        assert later == math.inf
        return asked

    cands = [busy_old, unknown, idle_new, idle_old]
    assert choose_now(cands, 1) == {4}
    assert choose_now(cands, 2) == {2, 3}  # idle_old, taken first, is not needed then
    assert choose_now(cands, 3) == {2, 3, 4}
    assert choose_now(cands, 5) == {0, 1, 2, 3, 4}
    assert choose_now(cands, 6) == {0, 1, 2, 3, 4, 5}
    assert choose_now([], 3) == set()


def test_choose_passes_over_min_hold_and_orders_busy_by_yield_within() -> None:
    now = 100.0
    held_old = Candidate(units=[0, 1, 2, 3], busy=False, used=1.0, hold_until=130.0)
    past_new = Candidate(units=[4, 5, 6, 7], busy=False, used=90.0, hold_until=95.0)
    # Inside its minimum hold it would refuse: another that would do is asked.
    assert choose([held_old, past_new], 1, now) == ({4, 5, 6, 7}, math.inf)
    # Only it would do: nobody is asked before its hold ends, then it is.
    assert choose([held_old], 1, now) == (set(), 130.0)
    assert choose([held_old], 1, 130.0) == ({0, 1, 2, 3}, math.inf)
    # Both are needed: the other goes on working until then.
    assert choose([held_old, past_new], 5, now) == (set(), 130.0)
    # Busy after idle; among busy, the one whose --yield-within bounds the wait first.
    unbounded = Candidate(units=[8], busy=True, used=1.0)
    bounded = Candidate(units=[9], busy=True, used=50.0, yield_within=2.0)
    idle = Candidate(units=[10], busy=False, used=99.0)
    assert choose([unbounded, bounded, idle], 1, now) == ({10}, math.inf)
    assert choose([unbounded, bounded, idle], 2, now) == ({9, 10}, math.inf)
    assert choose([unbounded, bounded, idle], 3, now) == ({8, 9, 10}, math.inf)


# -- the budget file ---------------------------------------------------------------------


def test_arena_budget_is_stored_in_whole_units(arena: Path) -> None:
    out = subprocess.run(
        vramlock("arena", "--arena", str(arena), "--budget", "3.1G"),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(arena)
    assert "budget 3G (12 units of 256M)" in out.stderr
    assert (arena / "budget").read_text() == f"unit {256 << 20}\nunits 12\n"
    assert (arena / "budget").stat().st_mode & 0o777 == 0o644
    assert (arena / "capacity.lock").exists() and (arena / "queue.lock").exists()
    set_budget(arena, "40G")
    opened = Arena.open(str(arena))
    try:
        assert read_budget(opened) == Budget(unit=256 << 20, units=160)
    finally:
        opened.close()


def test_arena_without_budget_has_none(arena: Path) -> None:
    subprocess.run(vramlock("arena", "--arena", str(arena)), check=True, timeout=30)
    opened = Arena.open(str(arena))
    try:
        assert read_budget(opened) is None
    finally:
        opened.close()
    assert sorted(p.name for p in arena.iterdir()) == ["token.lock", "want.lock"]


@pytest.mark.parametrize(
    ("size", "fragment"),
    [
        ("3X", "bad size '3X'"),
        ("-1G", "bad size '-1G'"),
        ("0G", "'0G' is out of range"),
        ("100M", "100M is less than one unit (256M)"),
        ("2000T", "'2000T' is out of range"),
    ],
)
def test_arena_bad_budget_is_a_usage_error(
    errcli: ErrCli, arena: Path, size: str, fragment: str
) -> None:
    out = errcli("arena", "--arena", str(arena), "--budget", size)
    expect_error(out, USAGE, "--budget", fragment)
    assert not (arena / "budget").exists()


def test_arena_budget_auto_without_nvml_says_so(errcli: ErrCli, arena: Path) -> None:
    pytest.importorskip("vramlock.gpu.nvml")
    from vramlock.gpu import nvml

    if nvml.available():
        pytest.skip("NVML is available here")
    out = errcli("arena", "--arena", str(arena), "--budget", "auto")
    expect_error(out, OWN_FAILURE, "NVML")
    assert not (arena / "budget").exists()


def test_only_the_owner_may_set_the_budget() -> None:
    needs_root("another uid")
    # Somewhere the other user can reach (a test's own directory is private).
    arena = Path(tempfile.mkdtemp(prefix="vramlock-budget-"))
    try:
        arena.chmod(0o755)
        set_budget(arena, "2G")
        before = (arena / "budget").read_text()

        other = [f"--reuid={FOREIGN_UID}", f"--regid={FOREIGN_UID}", "--clear-groups"]
        out = subprocess.run(
            ["setpriv", *other, *vramlock("arena", "--arena", str(arena), "--budget", "4G")],
            capture_output=True,
            text=True,
            timeout=30,
            cwd=arena,
        )
        assert out.returncode == OWN_FAILURE, out.stderr
        assert out.stderr == (
            f"vramlock: arena {arena / 'budget'}: only the arena's owner (uid 0)"
            " may set the budget\n"
        )
        assert (arena / "budget").read_text() == before
    finally:
        shutil.rmtree(arena)


@pytest.mark.parametrize("how", ["foreign", "group-writable", "garbage"])
def test_budget_file_not_from_the_owner_is_refused(arena: Path, how: str) -> None:
    set_budget(arena, "2G")
    budget = arena / "budget"
    if how == "foreign":
        needs_root("a foreign-owned budget")
        os.chown(budget, FOREIGN_UID, FOREIGN_UID)
        fragment = f"owned by uid {FOREIGN_UID}"
    elif how == "group-writable":
        budget.chmod(0o664)
        fragment = "writable by others"
    else:
        budget.write_text("units many\n")
        fragment = "is not a budget"
    opened = Arena.open(str(arena))
    try:
        with pytest.raises(ArenaError, match=fragment):
            read_budget(opened)
    finally:
        opened.close()


def test_budget_is_not_lowered_below_held_units(errcli: ErrCli, arena: Path) -> None:
    set_budget(arena, "3G")
    fd = os.open(arena / "capacity.lock", os.O_RDWR)
    try:
        assert lockfd.try_lock_bytes(fd, 9, write=True)  # a resident on unit 9
        out = errcli("arena", "--arena", str(arena), "--budget", "2G")
        expect_error(out, OWN_FAILURE, "units above 8 are held")
        assert "units 12\n" in (arena / "budget").read_text()
        set_budget(arena, "4G")  # raising is always safe
        lockfd.unlock_bytes(fd, 0, 0)
        set_budget(arena, "2G")
        assert "units 8\n" in (arena / "budget").read_text()
    finally:
        os.close(fd)


def test_run_bad_vram_is_a_usage_error(errcli: ErrCli, arena: Path) -> None:
    out = errcli("run", "--arena", str(arena), "--vram", "6X", "--", "true")
    expect_error(out, USAGE, "--vram: bad size '6X'")


@pytest.mark.parametrize("command", ["who", "run"])
def test_an_unusable_budget_file_is_refused_by_every_command(
    errcli: ErrCli, arena: Path, command: str
) -> None:
    set_budget(arena, "2G")
    (arena / "budget").chmod(0o666)
    args = ["--vram", "1G", "--", "true"] if command == "run" else []
    out = errcli(command, "--arena", str(arena), *args)
    expect_error(out, OWN_FAILURE, str(arena / "budget"), "writable by others")
