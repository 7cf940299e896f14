"""Budget residency with real processes, and ``vramlock run --vram`` in a budget arena.

The witness is the test's own file: each member, once resident, takes as many free
bytes of it (OFD write locks) as it has units, and an exclusive member takes all of
them. Two members over budget at once cannot both get their bytes, and say "OVER".
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest
from helpers.budget import DEADLINE, RUN_CHILD, Budgeted, Member, asks
from helpers.commands import vramlock, who_json, who_plain
from helpers.errors import USAGE, ErrCli, expect_error
from helpers.processes import Spawn, wait_until, waiting_holder
from helpers.worker import events

from vramlock.procfs import read_proc_locks


@pytest.fixture
def room(spawn: Spawn, arena: Path, tmp_path: Path) -> Budgeted:
    return Budgeted(spawn, arena, tmp_path, "3G")  # 12 units


def _token_readers(arena: Path) -> int:
    st = os.stat(arena / "token.lock")
    inode = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    return sum(
        1
        for ln in read_proc_locks().splitlines()
        if "->" not in ln.split() and inode in ln.split() and " READ " in f" {ln} "
    )


def _queue_head(arena: Path) -> int | None:
    """The pid holding queue.lock, by /proc/locks."""
    st = os.stat(arena / "queue.lock")
    inode = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    for ln in read_proc_locks().splitlines():
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
        assert asks(room.arena) == 0
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
    # Each logs "gathered" while it holds queue.lock: a small one that got its units before
    # the big one queued may log "resident" after `arrived`, but not "gathered".
    came = [t for t, n, w in events(room.log) if w == "gathered" and n != "big"]
    gathered = next(t for t, n, w in events(room.log) if n == "big" and w == "gathered")
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
    return any(
        "->" in (fields := ln.split()) and inode in fields and fields[5] == str(pid)
        for ln in read_proc_locks().splitlines()
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


def test_a_records_units_are_believed_only_where_its_process_holds_their_claims(
    room: Budgeted, spawn: Spawn
) -> None:
    """What serve asks of a model it unloads: the units its wrapper's record names,
    each probed. A record naming a resident's units for another living process gets
    none of them (asking for those would make the innocent resident step aside); the
    resident's own are all found."""
    from vramlock import procfs
    from vramlock.arena.directory import Arena
    from vramlock.arena.records import Record, record_name
    from vramlock.arena.units import claimed_units

    resident = room.member("r", 6)
    resident.wait_for("resident")

    def units() -> list[int]:
        (row,) = [r for r in who_json(room.arena) if r["name"] == "r"]
        return sorted(row["units"] or [])

    wait_until(lambda: len(units()) == 6)  # its record says so a moment after
    held = units()
    decoy = spawn(["sleep", "60"])
    forged = Record(pid=decoy.pid, name="forged", command=["sleep"], strategy="test",
                    state="resident", since=1.0, starttime=procfs.starttime(decoy.pid) or 0,
                    uid=os.geteuid(), units=held, hold_until=1e10)  # fmt: skip
    (room.arena / "members" / record_name(forged.pid, forged.starttime)).write_bytes(forged.dump())
    opened = Arena.open(str(room.arena))
    try:
        assert claimed_units(opened, decoy.pid, held) == []
        assert claimed_units(opened, resident.proc.pid, [*held, 99]) == held
    finally:
        opened.close()
