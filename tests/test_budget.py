"""A VRAM budget in kernel locks: the byte-lock primitives, the budget file, and budget
residency with real processes.

The witness is the test's own file: each member, once resident, takes as many free
bytes of it (OFD write locks) as it has units, and an exclusive member takes all of
them. Two members over budget at once cannot both get their bytes, and say "OVER".
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from helpers.budget import DEADLINE, RUN_CHILD, Budgeted, Member, set_budget
from helpers.commands import vramlock, who_json, who_plain
from helpers.errors import FOREIGN_UID, OWN_FAILURE, USAGE, ErrCli, expect_error, needs_root
from helpers.processes import Spawn, wait_until, waiting_holder
from helpers.worker import events

from vramlock.arena import lockfd
from vramlock.arena.budget import Budget, read_budget
from vramlock.arena.directory import Arena
from vramlock.arena.units import Candidate, choose
from vramlock.errors import ArenaError

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
        with open("/proc/locks") as f:
            mine = [ln.split() for ln in f if any(p.endswith(":" + ino) for p in ln.split())]
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


# -- budget residency with real processes ------------------------------------------------


@pytest.fixture
def room(spawn: Spawn, arena: Path, tmp_path: Path) -> Budgeted:
    return Budgeted(spawn, arena, tmp_path, "3G")  # 12 units


def _token_readers(arena: Path) -> int:
    st = os.stat(arena / "token.lock")
    inode = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    with open("/proc/locks") as f:
        return sum(
            1
            for ln in f
            if "->" not in ln.split() and inode in ln.split() and " READ " in f" {ln} "
        )


def _queue_head(arena: Path) -> int | None:
    """The pid holding queue.lock, by /proc/locks."""
    st = os.stat(arena / "queue.lock")
    inode = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    with open("/proc/locks") as f:
        for ln in f:
            fields = ln.split()
            if "->" not in fields and inode in fields:
                return int(fields[4])
    return None


def test_members_that_fit_are_resident_together(room: Budgeted) -> None:
    members = [room.member(n, 4) for n in ("a", "b", "c")]
    for m in members:
        m.wait_for("resident")
    assert room.resident() == {"a", "b", "c"}
    assert _token_readers(room.arena) == 3  # the kernel's view: three shared holders
    assert room.capacity_bytes_held() == 12
    time.sleep(1.0)  # nobody asks: not a member that fit, nor another resident's probe
    assert all(room.count(n, "release") == 0 for n in ("a", "b", "c"))
    assert room.over() == []


def test_waiter_asks_the_least_recently_used_idle_resident(room: Budgeted) -> None:
    busy = room.member("busy", 4, "busy")
    busy.wait_for("resident")
    old = room.member("old", 4)
    old.wait_for("resident")
    new = room.member("new", 4)
    new.wait_for("resident")
    late = room.member("late", 4)
    late.wait_for("resident")
    old.wait_for("release")
    time.sleep(0.3)
    assert room.count("new", "release") == 0 and room.count("busy", "release") == 0
    assert room.resident() >= {"busy", "new", "late"}
    assert room.over() == []


def _asks(arena: Path) -> int:
    """Budget waiters' asks, by /proc/locks: OFD read locks on want.lock."""
    st = os.stat(arena / "want.lock")
    inode = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    with open("/proc/locks") as f:
        return sum(
            1 for ln in f if "->" not in ln.split() and {"OFDLCK", "READ", inode} <= set(ln.split())
        )


def test_a_resident_inside_its_min_hold_is_passed_over(room: Budgeted) -> None:
    held = room.member("held", 4, min_hold=60)  # the least recently used, but it would refuse
    held.wait_for("resident")
    past = room.member("past", 4)
    past.wait_for("resident")
    waiter = room.member("waiter", 5)  # 4 units free: one more is needed
    waiter.wait_for("resident", timeout=10)
    assert room.count("past", "release") == 1 and room.count("held", "release") == 0
    assert room.witness_bytes_held() == 4 + 5  # held's are still locked, past's are free
    assert room.over() == []


def test_a_waiter_that_needs_a_resident_inside_its_min_hold_asks_when_it_ends(
    room: Budgeted,
) -> None:
    held = room.member("held", 8, min_hold=1.5)
    held.wait_for("resident")
    came = next(t for t, n, w in events(room.log) if n == "held" and w == "resident")
    waiter = room.member("waiter", 5)  # 4 units free: held must go
    wait_until(lambda: _queue_head(room.arena) == waiter.proc.pid)
    while time.monotonic() < came + 1.3:  # nobody is asked inside the hold: it would refuse
        assert _asks(room.arena) == 0
        time.sleep(0.01)
    waiter.wait_for("resident", timeout=10)
    admitted = next(t for t, n, w in events(room.log) if n == "waiter" and w == "resident")
    assert came + 1.5 <= admitted < came + 1.5 + 1.0  # just after the hold, not before
    assert room.over() == []


def test_big_member_is_not_starved_by_a_stream_of_small_ones(room: Budgeted) -> None:
    smalls = [room.member(f"s{i}", 3, "cycle", hold=0.03) for i in range(5)]
    for s in smalls:
        s.wait_for("resident", 3)
    big = room.member("big", 12)
    wait_until(lambda: _queue_head(room.arena) == big.proc.pid)  # the big one is gathering
    arrived = time.monotonic()
    big.wait_for("resident", timeout=DEADLINE)
    came = [t for t, n, w in events(room.log) if w == "resident" and n != "big"]
    gathered = next(t for t, n, w in events(room.log) if n == "big" and w == "resident")
    # Nobody comes in while the big one gathers: the others queue behind it.
    assert [t for t in came if arrived < t < gathered] == []
    assert room.over() == []


def test_two_waiters_that_do_not_fit_together_take_turns(room: Budgeted) -> None:
    smalls = [room.member(f"s{i}", 3, "cycle", hold=0.03) for i in range(4)]
    for s in smalls:
        s.wait_for("resident", 2)
    one, two = room.member("one", 8, "cycle", hold=0.1), room.member("two", 8, "cycle", hold=0.1)
    one.wait_for("resident", 2)
    two.wait_for("resident", 2)
    assert room.over() == []


def test_exclusive_waiter_is_not_starved_by_budget_members(room: Budgeted) -> None:
    smalls = [room.member(f"s{i}", 4, "cycle", hold=0.05) for i in range(4)]
    for s in smalls:
        s.wait_for("resident", 3)
    whole = room.exclusive("whole")
    whole.wait_for("resident", 2, timeout=DEADLINE)
    assert room.over() == []


def test_exclusive_holder_steps_aside_for_a_budget_waiter(room: Budgeted) -> None:
    whole = room.exclusive("whole")
    whole.wait_for("resident")
    small = room.member("small", 2)
    small.wait_for("resident")
    whole.wait_for("release")
    assert room.over() == []


def test_killed_resident_frees_its_units(room: Budgeted) -> None:
    deaf = room.member("deaf", 12, "deaf")
    deaf.wait_for("resident")
    waiter = room.member("waiter", 4)
    waiter.wait_for("waiting")
    wait_until(lambda: room.capacity_bytes_held() == 12)
    time.sleep(0.2)
    assert room.count("waiter", "resident") == 0
    deaf.kill()
    waiter.wait_for("resident")
    assert room.capacity_bytes_held() == 4
    assert room.over() == []


def test_killed_head_waiter_frees_the_units_it_gathered(room: Budgeted) -> None:
    deaf = room.member("deaf", 8, "deaf")
    deaf.wait_for("resident")
    head = room.member("head", 12)
    wait_until(lambda: room.capacity_bytes_held() == 12)  # the head holds the 4 free units
    behind = room.member("behind", 4)
    behind.wait_for("waiting")
    time.sleep(0.2)
    assert room.count("behind", "resident") == 0  # queued behind the head, no barging
    # The head holds the token shared while it gathers: who still says it waits.
    assert {r["name"]: r["state"] for r in who_json(room.arena)}["head"] == "waiting"
    head.kill()
    behind.wait_for("resident")
    assert room.count("head", "resident") == 0
    assert room.over() == []


def test_a_lying_record_never_puts_two_members_on_one_unit(room: Budgeted) -> None:
    liar = room.member("liar", 4, "liar")
    liar.wait_for("resident")
    honest = room.member("honest", 8)
    honest.wait_for("resident")
    for i in range(3):
        room.member(f"w{i}", 6).wait_for("resident")
    assert room.over() == []


@pytest.mark.parametrize("writer", ["other user", "same user"])
def test_a_forged_record_claiming_held_units_does_not_decide_whom_a_waiter_asks(
    room: Budgeted, spawn: Spawn, writer: str
) -> None:
    """A record claims the resident's units for a living process that holds none of
    them, inside a minimum hold that never ends: written by another user (in a sticky
    members/), or by the same user, whose records are trusted. The waiter must ask the
    units' real holder anyway (as one without a record): a record's claim to a unit is
    probed, and this one's fails (the same user's made the waiter wait for ever)."""
    from vramlock import procfs
    from vramlock.arena.records import Record, record_name

    resident = room.member("r", 12, "silent")
    resident.wait_for("resident")
    decoy = spawn(["sleep", "60"])
    forged = Record(pid=decoy.pid, name="forged", command=["sleep"], strategy="test",
                    state="resident", since=1.0, starttime=procfs.starttime(decoy.pid) or 0,
                    uid=os.geteuid() + (writer == "other user"), units=list(range(12)),
                    hold_until=1e10)  # fmt: skip
    (room.arena / "members" / record_name(forged.pid, forged.starttime)).write_bytes(forged.dump())
    waiter = room.member("w", 4)
    resident.wait_for("release")
    waiter.wait_for("resident")
    assert room.over() == []


def test_a_shell_waiter_takes_the_whole_gpu_from_budget_residents(
    room: Budgeted, spawn: Spawn
) -> None:
    members = [room.member(n, 4) for n in ("a", "b")]
    for m in members:
        m.wait_for("resident")
    shell = waiting_holder(spawn, room.arena)  # flock -s want.lock flock -x token.lock
    for m in members:
        m.wait_for("release")
    assert room.capacity_bytes_held() == 0 and _token_readers(room.arena) == 0
    late = room.member("late", 2)
    late.wait_for("waiting")
    time.sleep(0.2)
    assert room.count("late", "resident") == 0  # the shell is resident: the whole GPU
    assert shell.stdin is not None
    shell.stdin.close()
    late.wait_for("resident")
    assert room.over() == []


# -- vramlock run --vram -----------------------------------------------------------------


def _run(room: Budgeted, name: str, vram: str, units: int, *options: str) -> Member:
    proc = room.spawn(
        vramlock("run", "--arena", str(room.arena), "--vram", vram, "--release", "signal",
                 "--name", name, *options, "--", sys.executable, "-c", RUN_CHILD, str(room.witness),
                 str(room.log), name, str(units), str(room.units)),
        graceful=True,
    )  # fmt: skip
    return Member(room, name, proc)


def test_a_run_publishes_its_min_hold_its_yield_within_and_that_a_job_works(
    room: Budgeted,
) -> None:
    """What budget waiters choose by, in the record (the protocol's interface)."""
    before = time.time()
    job = _run(room, "job", "1G", 4, "--demand", "always", "--min-hold", "30",
               "--yield-within", "2")  # fmt: skip
    job.wait_for("resident")
    members = room.arena / "members"

    def record() -> dict[str, object]:
        [path] = list(members.glob("*.json"))
        data: dict[str, object] = json.loads(path.read_bytes())
        return data

    wait_until(lambda: record()["busy"] is True)  # a job taking turns works while resident
    rec = record()
    assert rec["yield_within"] == 2.0
    hold_until = rec["hold_until"]
    assert isinstance(hold_until, float) and before + 30 <= hold_until <= time.time() + 30


def test_runs_that_fit_are_resident_together_and_who_shows_footprints(room: Budgeted) -> None:
    runs = [_run(room, n, "1G", 4) for n in ("a", "b", "c")]
    for r in runs:
        r.wait_for("resident")
    assert room.resident() == {"a", "b", "c"} and _token_readers(room.arena) == 3
    rows = {r["name"]: r for r in who_json(room.arena)}
    assert {n: (rows[n]["state"], rows[n]["footprint"], len(rows[n]["units"])) for n in "abc"} == {
        n: ("resident", 1 << 30, 4) for n in "abc"
    }
    d = _run(room, "d", "1G", 4)
    d.wait_for("resident")
    runs[0].wait_for("release")  # the least recently used
    assert room.over() == []


def _blocked_on(path: Path, pid: int) -> bool:
    """Is ``pid`` blocked waiting for a lock on ``path``, by /proc/locks?"""
    st = os.stat(path)
    inode = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    with open("/proc/locks") as f:
        return any(
            "->" in (fields := ln.split()) and inode in fields and fields[5] == str(pid) for ln in f
        )


def test_a_run_queueing_when_the_budget_is_removed_carries_on_with_the_whole_gpu(
    room: Budgeted,
) -> None:
    """Removing the budget file is safe: a run that was queueing under the budget at that
    moment queues on as a whole-GPU member."""
    from vramlock.procfs import descendants

    a = _run(room, "a", "3G", 12)
    a.wait_for("resident")
    head = os.open(room.arena / "queue.lock", os.O_RDONLY)  # we are the head of the line
    try:
        fcntl.flock(head, fcntl.LOCK_EX)
        whole = room.exclusive("whole")
        a.wait_for("release")
        whole.wait_for("resident")
        wait_until(lambda: _blocked_on(room.arena / "queue.lock", a.proc.pid))
        (room.arena / "budget").unlink()
    finally:
        os.close(head)
    a.wait_for("resident", 2)  # the exclusive member stepped aside for it
    assert a.proc.poll() is None and descendants(a.proc.pid)

    def shown() -> tuple[object, object]:
        [row] = [r for r in who_json(room.arena) if r["name"] == "a"]
        return row["state"], row["footprint"]

    wait_until(lambda: shown() == ("resident", None))  # the record lags a little
    assert _token_readers(room.arena) == 0  # token.lock exclusive: the whole GPU
    assert room.over() == []


def test_run_larger_than_the_budget_is_a_usage_error(errcli: ErrCli, room: Budgeted) -> None:
    out = errcli("run", "--arena", str(room.arena), "--vram", "4G", "--", "true")
    expect_error(out, USAGE, "--vram 4G is more than the arena's budget (3G)")


def test_run_without_vram_or_nvml_in_a_budget_arena_takes_the_whole_gpu(room: Budgeted) -> None:
    a = _run(room, "a", "1G", 4)
    a.wait_for("resident")
    no_nvml = str(Path(__file__).parent / "fake_nvml")  # a machine without the driver
    whole = room.spawn(
        vramlock("run", "--arena", str(room.arena), "--release", "signal", "--name", "whole",
                 "--", sys.executable, "-c", RUN_CHILD, str(room.witness), str(room.log),
                 "whole", str(room.units), str(room.units)),
        graceful=True,
        env={**os.environ, "PYTHONPATH": no_nvml, "FAKE_NVML_DIR": "none"},
    )  # fmt: skip
    Member(room, "whole", whole).wait_for("resident")
    a.wait_for("release")
    assert room.over() == []
    assert whole.stderr is not None
    os.kill(whole.pid, signal.SIGTERM)
    whole.wait(30)
    assert (
        "has a budget (3G (12 units of 256M)); without --vram this command takes the whole GPU"
        in whole.stderr.read()
    )


def test_killed_run_leaves_its_share_to_the_command_until_it_exits(room: Budgeted) -> None:
    from vramlock.procfs import descendants

    a = _run(room, "a", "3G", 12)
    a.wait_for("resident")
    command = descendants(a.proc.pid)
    assert command
    try:
        a.kill()  # SIGKILL the wrapper: the command still uses the GPU
        assert room.capacity_bytes_held() == 12 and _token_readers(room.arena) == 1
        b = _run(room, "b", "1G", 4)
        time.sleep(0.5)  # b must not come in: nothing to wait for
        assert room.count("b", "resident") == 0
    finally:
        for pid in command:
            os.kill(pid, signal.SIGKILL)
    b.wait_for("resident")
    assert room.over() == []


def test_who_shows_the_budget_and_what_is_held(room: Budgeted) -> None:
    a = _run(room, "a", "1G", 4)
    a.wait_for("resident")
    out = who_plain(room.arena)
    assert "budget 3G (12 units of 256M): 4 held, 8 free" in out.splitlines()
    assert "footprint 1G, 4 unit(s)" in out


def test_run_that_does_not_get_its_share_in_time_exits_1(errcli: ErrCli, room: Budgeted) -> None:
    deaf = room.member("deaf", 10, "deaf")
    deaf.wait_for("resident")
    out = errcli("run", "--arena", str(room.arena), "--vram", "1G", "-w", "0.3", "--", "true")
    expect_error(out, 1, "not obtained")
    assert room.capacity_bytes_held() == 10  # what it gathered meanwhile is dropped
    assert _queue_head(room.arena) is None


def test_mixed_members_never_go_over_budget_and_all_get_turns(room: Budgeted) -> None:
    sizes = [2, 3, 4, 5, 6, 12]
    members = [room.member(f"m{n}", n, "cycle", hold=0.02) for n in sizes]
    whole = room.exclusive("whole")
    end = time.monotonic() + 4
    while time.monotonic() < end:
        assert room.over() == []
        time.sleep(0.05)
    for m in [*members, whole]:
        m.wait_for("resident", 2, timeout=DEADLINE)
    assert room.over() == []


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
                    asks_at_scan.append(_asks(arena))  # the kernel's view, as a scan begins
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
            asks_at_scan.append(_asks(arena))
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
