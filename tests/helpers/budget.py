"""Budget arenas for the budget and footprint tests: members that take units of a
witness file while resident, and the log that says when."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from helpers.commands import vramlock
from helpers.processes import Spawn, wait_until
from helpers.worker import events
from vramlock.arena.budget import CLAIMS, UNIT, read_budget
from vramlock.arena.directory import Arena
from vramlock.procfs import read_proc_locks

DEADLINE = 20.0


# A budget member: ``ARENA NAME UNITS WITNESS LOG MODE``. MODE idle: steps aside when
# asked, and leaves; busy: the same, saying it works; cycle: resident $HOLD s whether
# asked or not (a holder between safe points), then steps aside and queues again;
# deaf: never steps aside; liar: like idle, but its record claims units it does not
# hold and that it has been idle the longest; silent: like idle, but its record never
# says which units it holds. $MIN_HOLD: it refuses to step aside for
# that long after it became resident, and says so in its record. It logs "gathered" when
# it has its units, while it still holds queue.lock (all but silent ones).
MEMBER = textwrap.dedent(
    """
    import fcntl, os, struct, sys, time
    from vramlock.arena.directory import Arena
    from vramlock.arena.budget import CLAIMS, UNIT, read_budget
    from vramlock.arena.units import Units
    from vramlock.arena.records import Record, RecordWriter
    path, name, need, witness, log, mode = sys.argv[1:7]
    need = int(need)
    logfd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    def note(what):
        os.write(logfd, f"{time.monotonic():.6f} {name} {what}\\n".encode())
    arena = Arena.open(path)
    budget = read_budget(arena)
    record = RecordWriter(arena, Record(pid=os.getpid(), name=name, command=sys.argv,
                                        strategy="test", state="released", since=time.time()))
    def publish(fields, at_once):
        if fields.get("units"):
            note("gathered")  # said inside queue(), while it holds queue.lock
        record.change(fields, at_once)
    share = Units(arena, budget, need, publish=None if mode == "silent" else publish)
    wfd = os.open(witness, os.O_RDWR)
    def witness(kind, start, length):
        fcntl.fcntl(wfd, fcntl.F_OFD_SETLK, struct.pack("hhqqi4x", kind, 0, start, length, 0))
    hold = float(os.environ.get("HOLD", "0"))
    min_hold = float(os.environ.get("MIN_HOLD", "0"))
    note("waiting")
    while True:
        share.queue()
        got = 0
        for unit in range(budget.units):
            if got < need:
                try:
                    witness(fcntl.F_WRLCK, unit, 1)
                    got += 1
                except OSError:
                    pass
        note("resident" if got == need else "OVER")
        record.update(hold_until=time.time() + min_hold)
        if mode == "liar":
            others = [u for u in range(budget.units) if u not in share.units]
            record.update(units=others[:need], used=1.0, busy=False)
        else:
            share.working(mode == "busy")
        start = time.monotonic()
        while True:
            time.sleep(0.002)
            if mode == "busy":
                share.working(True)
            if mode == "cycle":
                if time.monotonic() - start > hold:
                    break
            elif mode != "deaf" and time.monotonic() - start >= min_hold and share.wanted():
                break
        witness(fcntl.F_UNLCK, 0, 0)
        note("release")
        share.drop()
        if mode != "cycle":
            break
        share.wait_polite()
    """
)


# An exclusive member (knows nothing of budgets): ``ARENA NAME UNITS WITNESS LOG``; takes
# every byte of the witness while resident, steps aside when somebody waits.
EXCLUSIVE = textwrap.dedent(
    """
    import fcntl, os, struct, sys, time
    from vramlock.arena.directory import Arena
    from vramlock.arena.member import Member
    path, name, units, witness, log = sys.argv[1:6]
    logfd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    def note(what):
        os.write(logfd, f"{time.monotonic():.6f} {name} {what}\\n".encode())
    member = Member(Arena.open(path), name=name)
    wfd = os.open(witness, os.O_RDWR)
    def witness(kind):
        fcntl.fcntl(wfd, fcntl.F_OFD_SETLK, struct.pack("hhqqi4x", kind, 0, 0, int(units), 0))
    note("waiting")
    while True:
        member.acquire()
        try:
            witness(fcntl.F_WRLCK)
            note("resident")
        except OSError:
            note("OVER")
        while not member.should_release():
            time.sleep(0.002)
        witness(fcntl.F_UNLCK)
        note("release")
        member.release()
        member.wait_polite()
    """
)


def set_budget(arena: Path, size: str) -> None:
    """``vramlock arena --budget SIZE`` on ``arena``."""
    subprocess.run(
        vramlock("arena", "--arena", str(arena), "--budget", size),
        check=True,
        capture_output=True,
        timeout=30,
    )


class Budgeted:
    """A budget arena with its witness file and event log; starts members."""

    def __init__(self, spawn: Spawn, arena: Path, tmp_path: Path, size: str) -> None:
        set_budget(arena, size)
        self.spawn, self.arena = spawn, arena
        opened = Arena.open(str(arena))
        found = read_budget(opened)
        opened.close()
        assert found is not None
        self.units = found.units
        self.witness = tmp_path / "witness"
        self.witness.write_bytes(b"")
        self.log = tmp_path / "events.log"

    def member(
        self, name: str, units: int, mode: str = "idle", hold: float = 0.0, min_hold: float = 0.0
    ) -> Member:
        """Start a budget member (MEMBER) of ``units`` units behaving as ``mode``."""
        proc = self.spawn(
            [sys.executable, "-c", MEMBER, str(self.arena), name, str(units),
             str(self.witness), str(self.log), mode],
            env={**os.environ, "HOLD": str(hold), "MIN_HOLD": str(min_hold)},
        )  # fmt: skip
        return Member(self, name, proc)

    def exclusive(self, name: str) -> Member:
        """Start an exclusive member (EXCLUSIVE), which takes every unit while resident."""
        proc = self.spawn(
            [sys.executable, "-c", EXCLUSIVE, str(self.arena), name, str(self.units),
             str(self.witness), str(self.log)]
        )  # fmt: skip
        return Member(self, name, proc)

    def count(self, name: str, what: str) -> int:
        """How many times ``name`` logged ``what``."""
        return sum(1 for _, n, w in events(self.log) if n == name and w == what)

    def over(self) -> list[str]:
        """The members that logged OVER: resident without all of their units."""
        return [n for _, n, w in events(self.log) if w == "OVER"]

    def resident(self) -> set[str]:
        """Who is resident now, by the log: resident and not released since."""
        now: set[str] = set()
        for _, n, w in events(self.log):
            if w == "resident":
                now.add(n)
            elif w == "release":
                now.discard(n)
        return now

    def witness_bytes_held(self) -> int:
        """Bytes of the witness locked by members, by /proc/locks."""
        return _bytes_locked(self.witness)

    def capacity_bytes_held(self) -> int:
        """Units held, by /proc/locks (OFD locks on capacity.lock)."""
        return _bytes_locked(self.arena / "capacity.lock")


def _bytes_locked(path: Path) -> int:
    """Bytes of ``path`` under OFD locks below the claim bytes (units, on capacity.lock),
    by /proc/locks."""
    st = os.stat(path)
    inode = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    total = 0
    for line in read_proc_locks().splitlines():
        fields = line.split()
        if "->" not in fields and "OFDLCK" in fields and inode in fields:
            start, end = fields[-2:]
            if int(start) < CLAIMS:
                total += min(int(end), CLAIMS - 1) - int(start) + 1
    return total


class Member:
    """One member process of a Budgeted arena, known by its name in the log."""

    def __init__(self, room: Budgeted, name: str, proc: subprocess.Popen[str]) -> None:
        self.room, self.name, self.proc = room, name, proc

    def wait_for(self, what: str, times: int = 1, timeout: float = DEADLINE) -> None:
        """Wait until the member has logged ``what`` ``times`` times."""
        wait_until(lambda: self.room.count(self.name, what) >= times, timeout=timeout)

    def kill(self) -> None:
        """SIGKILL the member and reap it."""
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)


# The command of a run: ``WITNESS LOG NAME UNITS BUDGET_UNITS [USE]``; holds UNITS free
# bytes of the witness, among its first BUDGET_UNITS, while it may use the GPU (from its
# start and each restore to each release), and says OVER when it cannot get them all. With
# USE, it also "uses" USE bytes meanwhile for the stand-in NVML (tests/fake_nvml), in a file
# named after its pid in FAKE_NVML_DIR, and 0 once it released.
RUN_CHILD = textwrap.dedent(
    """
    import fcntl, os, struct, sys, time
    from vramlock import child
    witness, log, name = sys.argv[1:4]
    units, budget_units = int(sys.argv[4]), int(sys.argv[5])
    use = int(sys.argv[6]) if len(sys.argv) > 6 else None
    logfd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    wfd = os.open(witness, os.O_RDWR)
    def note(what):
        os.write(logfd, f"{time.monotonic():.6f} {name} {what}\\n".encode())
    def lock(kind, start, length):
        fcntl.fcntl(wfd, fcntl.F_OFD_SETLK, struct.pack("hhqqi4x", kind, 0, start, length, 0))
    def say(size):
        if use is None:
            return
        usage = os.path.join(os.environ["FAKE_NVML_DIR"], str(os.getpid()))
        with open(usage + ".tmp", "w") as f:
            f.write(str(size))
        os.rename(usage + ".tmp", usage)
    def take():
        say(use)
        got = 0
        for unit in range(budget_units):
            if got < units:
                try:
                    lock(fcntl.F_WRLCK, unit, 1)
                    got += 1
                except OSError:
                    pass
        note("resident" if got == units else "OVER")
    def drop():
        say(0)
        lock(fcntl.F_UNLCK, 0, 0)
        note("release")
    ctl = child.connect()
    take()
    while True:
        time.sleep(0.005)
        ctl.yield_if_asked(drop, take)
    """
)


FAKE_NVML = str(Path(__file__).resolve().parent.parent / "fake_nvml")


def run_measured(
    room: Budgeted, name: str, use: int, vram: str | None = None, **env: str
) -> Member:
    """``vramlock run`` of RUN_CHILD "using" ``use`` bytes, with ``--vram``
    when given."""
    nvml_dir = room.log.parent / "nvml"
    nvml_dir.mkdir(exist_ok=True)
    declared = [] if vram is None else ["--vram", vram]
    proc = room.spawn(
        vramlock("run", "--arena", str(room.arena), *declared, "--release", "signal",
                 "--name", name, "--", sys.executable, "-c", RUN_CHILD, str(room.witness),
                 str(room.log), name, str(-(-use // UNIT)), str(room.units), str(use)),
        graceful=True,
        env={**os.environ, "PYTHONPATH": FAKE_NVML, "FAKE_NVML_DIR": str(nvml_dir), **env},
    )  # fmt: skip
    return Member(room, name, proc)


def asks(arena: Path) -> int:
    """Budget waiters' asks, by /proc/locks: OFD read locks on want.lock."""
    st = os.stat(arena / "want.lock")
    inode = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    return sum(
        1
        for ln in read_proc_locks().splitlines()
        if "->" not in ln.split() and {"OFDLCK", "READ", inode} <= set(ln.split())
    )
