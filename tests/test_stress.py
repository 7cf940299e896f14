"""Stress: mutual exclusion and no stranded waiters, with real processes and random SIGKILLs.

Every member is a real ``vramlock run --release signal --min-hold 0`` wrapping a small
cooperative worker (written into ``tmp_path``). The checks do not use vramlock's own state:

(a) ``gpu.sim``, a file outside the protocol, stands for the GPU's memory: a worker takes
    ``flock(LOCK_EX|LOCK_NB)`` on it whenever it becomes resident and drops it just before its
    release callback returns. The kernel frees it when the worker dies, as the GPU would. A
    failed attempt means two residents at once: the worker logs ``OVERLAP``.
(b) an ``O_APPEND`` event log, one ``os.write`` per line with ``time.monotonic()``: the
    enter/leave intervals never overlap.
(c) a monitor thread reads ``/proc/locks`` (one ``os.read``) every ~1 ms and times every
    stretch where nobody holds the token exclusively while somebody waits for it (a stranded
    waiter). The bound depends on the mode, below. A waiter holds ``want.lock`` shared from
    before it blocks on the token until it owns it, so that is "``want.lock`` has readers (or
    blocked requests), ``token.lock`` has no exclusive holder". Blocked ``->`` lines on the
    token count too, but the kernel lists a blocked request only under the lock it waits for,
    so they cannot appear without a holder. The asserted length is from the first to the last
    sample seen in the state; the figures also give an upper bound (to the samples around it).

A killer thread SIGKILLs a random wrapper or worker and starts a new member in its place, so K
stays constant. Half of the victims are the "holder", the member that entered last (resident,
releasing or just released), the others any member (a waiter, or a member whose worker is not
started yet). A worker whose wrapper died still shares the token's open file description (the
point of passing it on) and must exit once its control channel closes; before it leaves it
takes 30 ms to "free its memory", so a wrapper that did not pass the token on would let the
next member in too early and be caught by (a) and (b). The wrapper's zombie is reaped only
after its orphan is gone (/proc/locks hides locks whose pid is freed, in a pid namespace), and
the test is a child subreaper, so orphans are reaped here. Everything is killed and reaped at
the end, with deadlines.

``test_member_api_exclusive`` runs the same checks on K processes using
``vramlock.arena.member.Member`` and ``yield_if_wanted`` directly: no wrappers, no kills,
thousands of
handoffs quickly.

Checks (a) and (b), mutual exclusion, are hard assertions in every mode. For (c) the
reliability target, no waiter stranded for more than 20 ms, is a timing figure: on a loaded 2-core
machine the waiter the kernel has just woken can wait longer than that for a CPU, with nothing
wrong in the protocol. So by default (CI) (c) asserts only what scheduling noise cannot
produce: no waiter stranded for more than 2 s while the token is free (a lost wake-up, a stuck
waiter), and stranded stretches short as a rule: their median at most 5 ms, once there are 20
(a waiter polling ``LOCK_NB`` instead of blocking in the kernel). ``VRAMLOCK_STRESS_STRICT=1``
asserts the 20 ms target instead of 2 s, for benchmark runs on a quiet machine. Either way the
figures report the longest stretch seen, the median and the limit in force.

Sizes: by default 300 handoffs and 30 kills per K (~10 s each) and 3,000 Member API handoffs
per K; about a minute in all on 2 cores. ``VRAMLOCK_STRESS_SCALE`` (float, default 1)
multiplies all counts; the reliability target (≥ 10,000 handoffs and ≥ 1,000
SIGKILLs in all) is ``VRAMLOCK_STRESS_SCALE=12`` (~10 minutes). With ``VRAMLOCK_STRESS_REPORT``
set to a path, each case appends its figures there as one JSON line (they are printed too).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import fcntl
import json
import math
import os
import random
import select
import signal
import statistics
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers.witness import Event, EventLog, LocksMonitor, count_handoffs, intervals, overlaps

SCALE = float(os.environ.get("VRAMLOCK_STRESS_SCALE", "1") or "1")
REPORT = os.environ.get("VRAMLOCK_STRESS_REPORT")

KS = (2, 4, 8)
RUN_HANDOFFS = math.ceil(300 * SCALE)  # per K, `vramlock run` members
RUN_KILLS = math.ceil(30 * SCALE)  # per K
API_HANDOFFS = math.ceil(3000 * SCALE)  # per K, Member API members
STRICT = os.environ.get("VRAMLOCK_STRESS_STRICT", "") == "1"
STRANDED_TARGET = 0.020  # the target: no waiter blocked on a free token for longer
STRANDED_WEDGED = 2.0  # longer than any scheduling delay: a waiter that will not be woken
STRANDED_MAX = STRANDED_TARGET if STRICT else STRANDED_WEDGED
# Most stranded stretches are a woken waiter being scheduled: well under 1 ms. A waiter that
# polls instead of blocking in the kernel makes most of them last about half its period.
STRANDED_MEDIAN_MAX = 0.005
KILL_PACE = (0.05, 0.5)  # seconds between two kills, uniformly at random
ORPHAN_EXIT_MAX = 2.0  # a worker whose wrapper died must notice and exit within this


def _run_deadline() -> float:
    return 90.0 + 3.0 * RUN_KILLS + 0.05 * RUN_HANDOFFS


def _api_deadline() -> float:
    return 60.0 + 0.02 * API_HANDOFFS


pytestmark = pytest.mark.timeout(int(max(_run_deadline(), _api_deadline()) + 120))

PR_SET_CHILD_SUBREAPER = 36

# -- the workers -------------------------------------------------------------------------------

_COMMON = """
import fcntl, os, random, sys, time

NAME, LOG, SIM = sys.argv[1], sys.argv[2], sys.argv[3]
PID = os.getpid()
log = os.open(LOG, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)
sim = os.open(SIM, os.O_RDWR | os.O_CLOEXEC)  # our own open file description of gpu.sim
resident = False


def note(what):
    # One write per line on an O_APPEND descriptor: lines never interleave.
    os.write(log, f"{time.monotonic():.9f} {NAME} {what} {PID}\\n".encode())


def enter():
    global resident
    try:
        fcntl.flock(sim, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        note("OVERLAP")
    resident = True
    note("enter")


def leave():
    global resident
    note("leave")
    resident = False
    fcntl.flock(sim, fcntl.LOCK_UN)
"""

RUN_WORKER = _COMMON + textwrap.dedent(
    """
    from vramlock.child import ControlLost, connect

    note("start")
    ctl = connect()
    if ctl is None:
        note("no-control")
        sys.exit(3)
    enter()  # `vramlock run` owns the token before it starts us
    try:
        while not ctl.channel.closed:
            time.sleep(random.random() * 0.005)  # one GPU step
            ctl.yield_if_asked(release=leave, restore=enter)
    except ControlLost:
        pass  # our wrapper died while we were released: nothing is ours
    # The wrapper died: we still share the token's open file description, so we are still
    # resident. Finish the step and free the "GPU memory" (taking a while, as a real program
    # would: nobody else may become resident meanwhile), then exit, dropping our copy.
    if resident:
        time.sleep(0.03)
        leave()
    note("exit")
    """
)

API_WORKER = _COMMON + textwrap.dedent(
    """
    import select

    from vramlock.arena.directory import Arena
    from vramlock.arena.member import Member

    arena = Arena.open(sys.argv[4])
    member = Member(arena, name=NAME, min_hold=0.0, command=["stress", NAME])
    stop = select.poll()
    stop.register(0, select.POLLIN)  # the test closes our stdin to stop us
    note("start")
    member.acquire()
    enter()
    while not stop.poll(0):
        time.sleep(random.random() * 0.0005)  # one GPU step
        member.yield_if_wanted(release=leave, restore=enter)
    leave()
    member.close()
    arena.close()
    note("exit")
    """
)

# -- processes ---------------------------------------------------------------------------------


def _set_subreaper(on: bool) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, int(on), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")


@contextlib.contextmanager
def subreaper() -> Iterator[None]:
    """Orphans of our descendants (workers whose wrapper died) become our children."""
    _set_subreaper(True)
    try:
        yield
    finally:
        _set_subreaper(False)


def children_of(pid: int) -> list[int]:
    """Processes whose parent is ``pid`` (this kernel has no /proc/PID/task/TID/children)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rfind(b")") + 2 :].split()
        if len(fields) > 1 and int(fields[1]) == pid:
            out.append(int(entry))
    return out


def exists(pid: int) -> bool:
    """Alive or a zombie not yet reaped."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def reap(pid: int) -> bool:
    """Reap ``pid`` if it is a child of ours that has exited; True when it is gone."""
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return not exists(pid)  # not ours (yet): gone once nobody can see it
    return done == pid


def wait_gone(pids: list[int], timeout: float) -> list[int]:
    """Reap/await ``pids`` until ``timeout``; the ones still there."""
    end = time.monotonic() + timeout
    left = list(pids)
    while left:
        left = [p for p in left if not reap(p)]
        if not left or time.monotonic() > end:
            break
        time.sleep(0.01)  # a deadline loop, not synchronisation
    return left


def kill_quietly(pid: int) -> None:
    if pid <= 0:
        raise ValueError(f"refusing to kill pid {pid}")  # 0 or -1 would be a whole group
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, signal.SIGKILL)


def runs(pid: int, script: Path) -> bool:
    """Is ``pid`` still one of our workers (not a recycled pid)?"""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return str(script).encode() in f.read().split(b"\0")
    except OSError:
        return False


@dataclasses.dataclass
class RunMember:
    name: str
    proc: subprocess.Popen[bytes]
    worker: int | None = None  # the worker's pid, once known
    killed: str = ""  # "wrapper" or "worker" once we SIGKILLed it
    killed_at: float = 0.0
    pidfd: int | None = None  # of the orphaned worker, after a wrapper kill


@dataclasses.dataclass
class Tally:
    kills: dict[str, int] = dataclasses.field(default_factory=dict)
    spawned: int = 0
    failures: list[str] = dataclasses.field(default_factory=list)

    @property
    def total_kills(self) -> int:
        return sum(self.kills.values())


class RunCluster:
    """K `vramlock run` members, a killer thread, and the bookkeeping to reap everything."""

    def __init__(self, tmp: Path, k: int, seed: int) -> None:
        self.tmp = tmp
        self.k = k
        self.rng = random.Random(seed)
        self.arena = _make_arena(tmp)
        self.log = tmp / "events.log"
        self.log.touch()
        self.sim = tmp / "gpu.sim"  # A/../gpu.sim
        self.sim.touch()
        self.worker = tmp / "worker.py"
        self.worker.write_text(RUN_WORKER)
        self.members: list[RunMember] = []
        self.corpses: list[RunMember] = []  # killed, not reaped yet
        self.every: list[RunMember] = []
        self.elog = EventLog(self.log)
        self.tally = Tally()
        self.serial = 0
        self.halt = threading.Event()
        self.done = threading.Event()
        self.error: BaseException | None = None

    # -- members -------------------------------------------------------------------------------

    def spawn(self) -> RunMember:
        self.serial += 1
        name = f"m{self.k}-{self.serial}"
        err = open(self.tmp / f"{name}.err", "wb")  # noqa: SIM115 - closed right after Popen
        cmd = [
            sys.executable, "-m", "vramlock", "run", "--arena", str(self.arena),
            "--release", "signal", "--min-hold", "0", "--name", name, "--",
            sys.executable, str(self.worker), name, str(self.log), str(self.sim),
        ]  # fmt: skip
        try:
            proc = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err,
                start_new_session=True,
            )  # fmt: skip
        finally:
            err.close()
        member = RunMember(name, proc)
        self.members.append(member)
        self.every.append(member)
        self.tally.spawned += 1
        return member

    def worker_of(self, m: RunMember) -> int | None:
        if m.worker is None:
            m.worker = self.elog.workers.get(m.name)
        if m.worker is None:
            kids = children_of(m.proc.pid)
            m.worker = kids[0] if kids else None
        return m.worker

    def kill(self, m: RunMember, what: str) -> None:
        worker = self.worker_of(m)
        if what == "worker" and worker is None:
            what = "wrapper"  # not started yet: its wrapper is still a waiter
        # "holder": the member that entered last (resident, releasing or just released).
        resident = self.elog.last_entered == m.name
        label = f"{what}-{'holder' if resident else 'other'}"
        m.killed, m.killed_at = what, time.monotonic()
        if what == "wrapper":
            # Keep the wrapper's zombie unreaped while its orphan lives: the token's lock
            # still names the wrapper's pid, and /proc/locks hides locks of freed pids.
            if worker is not None:
                with contextlib.suppress(ProcessLookupError):
                    m.pidfd = os.pidfd_open(worker)
            os.kill(m.proc.pid, signal.SIGKILL)
        else:
            assert worker is not None
            kill_quietly(worker)
        self.tally.kills[label] = self.tally.kills.get(label, 0) + 1
        self.members.remove(m)
        self.corpses.append(m)

    def bury(self) -> None:
        """Reap killed members whose processes are gone; replace members that exited."""
        now = time.monotonic()
        for m in list(self.corpses):
            if m.killed == "wrapper":
                worker = self.worker_of(m)
                if worker is not None and m.pidfd is None:
                    with contextlib.suppress(ProcessLookupError):
                        m.pidfd = os.pidfd_open(worker)
                if m.pidfd is not None:
                    if not select.select([m.pidfd], [], [], 0)[0]:
                        if now - m.killed_at > ORPHAN_EXIT_MAX * 5 and worker is not None:
                            self.tally.failures.append(f"{m.name}: orphan worker never exited")
                            kill_quietly(worker)
                        continue
                    os.close(m.pidfd)
                    m.pidfd = None
                elif now - m.killed_at < 2.0:
                    continue  # a worker being started as we killed may still log its start
            if m.proc.poll() is None and now - m.killed_at < 10.0:
                continue
            m.proc.wait(10)
            if m.worker is not None:
                reap(m.worker)  # an orphan is our child (subreaper)
            self.corpses.remove(m)
        for m in list(self.members):
            if m.proc.poll() is not None:
                err = (self.tmp / f"{m.name}.err").read_text(errors="replace")[-500:]
                self.tally.failures.append(
                    f"{m.name} exited by itself with {m.proc.returncode}: {err!r}"
                )
                self.members.remove(m)
                self.spawn()

    # -- the killer ----------------------------------------------------------------------------

    def killer(self) -> None:
        try:
            while not self.halt.is_set():
                self.bury()
                self.elog.follow()
                kills = self.tally.total_kills
                if kills >= RUN_KILLS and self.elog.handoffs >= RUN_HANDOFFS:
                    break
                if kills >= RUN_KILLS:
                    self.halt.wait(0.05)
                    continue
                if self.halt.wait(self.rng.uniform(*KILL_PACE)):
                    break
                self.elog.follow()
                holder = self.elog.holder or self.elog.last_entered
                holders = [m for m in self.members if m.name == holder]
                pool = holders if holders and self.rng.random() < 0.5 else self.members
                victim = self.rng.choice(pool)
                self.kill(victim, self.rng.choice(("wrapper", "worker")))
                self.spawn()
        except BaseException as err:  # surfaced by the test
            self.error = err
        finally:
            self.done.set()

    # -- the end -------------------------------------------------------------------------------

    def orphan_exits(self) -> tuple[list[float], list[str]]:
        """Seconds from each wrapper's SIGKILL to its worker's exit; workers that never left."""
        exits = {e.name: e.t for e in self.elog.events if e.what == "exit"}
        started = {e.name for e in self.elog.events if e.what == "start"}
        took, never = [], []
        for m in self.every:
            if m.killed in ("wrapper", "teardown") and m.name in started:
                if m.name in exits:
                    took.append(exits[m.name] - m.killed_at)
                else:
                    never.append(m.name)
        return took, never

    def teardown(self) -> None:
        """Kill every wrapper; orphaned workers must leave by themselves; reap all."""
        live = [m for m in self.every if m.proc.poll() is None and not m.killed]
        for m in live:
            self.worker_of(m)
            m.killed, m.killed_at = "teardown", time.monotonic()
            kill_quietly(m.proc.pid)
        self.elog.follow()
        workers = {m.worker for m in self.every if m.worker} | set(self.elog.workers.values())
        stuck = [
            p for p in wait_gone([p for p in workers if exists(p)], 10.0) if runs(p, self.worker)
        ]
        for pid in stuck:
            kill_quietly(pid)
        for m in self.every:
            try:
                m.proc.wait(10)
            except subprocess.TimeoutExpired:
                kill_quietly(m.proc.pid)
                m.proc.wait(10)
            if m.pidfd is not None:
                os.close(m.pidfd)
                m.pidfd = None
        for pid in wait_gone([p for p in workers if exists(p)], 10.0):
            if runs(pid, self.worker):
                kill_quietly(pid)
        if stuck:
            self.tally.failures.append(f"workers still alive 10 s after teardown: {stuck}")


def _report(case: str, figures: dict[str, object]) -> None:
    line = json.dumps({"case": case, "scale": SCALE, **figures})
    print(line)
    if REPORT:
        with open(REPORT, "a") as f:
            f.write(line + "\n")


def _check_log(events: list[Event]) -> dict[str, object]:
    overlap_lines = [e for e in events if e.what == "OVERLAP"]
    closed, open_ = intervals(events)
    bad = overlaps(closed)
    assert not overlap_lines and not bad, (
        f"{len(overlap_lines)} gpu.sim overlaps {overlap_lines[:3]},"
        f" {len(bad)} overlapping residency intervals {bad[:3]}"
    )
    return {
        "handoffs": count_handoffs(events),
        "intervals": len(closed),
        "open_intervals": len(open_),
        "overlap_lines": len(overlap_lines),
        "interval_overlaps": len(bad),
    }


def _check_stranded(monitor: LocksMonitor, figures: dict[str, object]) -> None:
    """(c): the 20 ms target under VRAMLOCK_STRESS_STRICT=1, else a waiter that is not woken;
    and in both modes, stranded stretches that are short as a rule."""
    mode = "VRAMLOCK_STRESS_STRICT=1" if STRICT else "default mode"
    assert monitor.longest <= STRANDED_MAX, (
        f"a waiter was stranded for {monitor.longest * 1000:.1f} ms"
        f" (limit {STRANDED_MAX * 1000:g} ms, {mode}): {figures}"
    )
    if len(monitor.durations) >= 20:  # enough for a median that one bad stretch cannot move
        assert statistics.median(monitor.durations) <= STRANDED_MEDIAN_MAX, (
            f"most stranded stretches last over {STRANDED_MEDIAN_MAX * 1000:g} ms: {figures}"
        )


# -- the tests ---------------------------------------------------------------------------------


def _make_arena(tmp: Path) -> Path:
    arena = tmp / "arena"
    arena.mkdir(mode=0o700)
    for name in ("token.lock", "want.lock"):  # now, so the monitor can find their inodes
        (arena / name).touch(mode=0o644)
    return arena


def test_monitor_sees_a_stranded_waiter(tmp_path: Path) -> None:
    """The /proc/locks monitor itself: a waiter on a free token is seen, a queue is not."""
    arena = _make_arena(tmp_path)
    monitor = LocksMonitor(arena)
    token = os.open(arena / "token.lock", os.O_RDONLY | os.O_CLOEXEC)
    want = os.open(arena / "want.lock", os.O_RDONLY | os.O_CLOEXEC)

    def samples(n: int) -> None:
        end, target = time.monotonic() + 10, monitor.samples + n
        while monitor.samples < target and time.monotonic() < end:
            time.sleep(0.001)  # waiting for the monitor's samples, with a deadline

    try:
        monitor.start()
        fcntl.flock(token, fcntl.LOCK_EX)
        fcntl.flock(want, fcntl.LOCK_SH)
        samples(30)  # a resident and a waiter: not stranded
        fcntl.flock(token, fcntl.LOCK_UN)
        samples(60)  # the token is free and somebody wants it: stranded
        fcntl.flock(want, fcntl.LOCK_UN)
        samples(30)
    finally:
        monitor.stop()
        os.close(token)
        os.close(want)
    assert monitor.error is None
    assert monitor.stretches == 1, monitor.figures()
    assert monitor.longest >= 0.04, monitor.figures()


@pytest.mark.parametrize("k", KS)
def test_run_members_exclusive_under_sigkill(tmp_path: Path, k: int) -> None:
    cluster = RunCluster(tmp_path, k, seed=1000 + k)
    monitor = LocksMonitor(cluster.arena)
    killer = threading.Thread(target=cluster.killer, name="killer", daemon=True)
    started = time.monotonic()
    with subreaper():
        try:
            monitor.start()
            for _ in range(k):
                cluster.spawn()
            killer.start()
            finished = cluster.done.wait(_run_deadline())
            cluster.halt.set()
            killer.join(30)
            monitor.stop()
        finally:
            cluster.halt.set()
            monitor.halt.set()
            if killer.is_alive():
                killer.join(30)
            cluster.teardown()
    elapsed = time.monotonic() - started
    if cluster.error is not None:
        raise cluster.error
    if monitor.error is not None:
        raise monitor.error
    cluster.elog.follow()
    events = cluster.elog.events
    tally = cluster.tally
    orphan_exits, never_left = cluster.orphan_exits()
    figures = {
        "k": k,
        "seconds": round(elapsed, 1),
        "kills": tally.total_kills,
        "kills_by_kind": tally.kills,
        "spawned": tally.spawned,
        "orphans": len(orphan_exits),
        "orphan_exit_max_ms": round(max(orphan_exits, default=0.0) * 1000, 1),
        **monitor.figures(),
        "stranded_limit_ms": round(STRANDED_MAX * 1000),
    }
    figures.update(_check_log(events))  # asserts (a) and (b)
    _report("run", figures)
    assert not tally.failures, tally.failures
    assert finished, f"deadline passed before the targets were met: {figures}"
    assert tally.total_kills >= RUN_KILLS
    handoffs = figures["handoffs"]
    assert isinstance(handoffs, int) and handoffs >= RUN_HANDOFFS, figures
    assert not never_left, f"workers that outlived their wrapper without leaving: {never_left}"
    assert max(orphan_exits, default=0.0) <= ORPHAN_EXIT_MAX, figures
    assert monitor.samples > 100, figures
    _check_stranded(monitor, figures)


def _api_stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        if p.stdin is not None and not p.stdin.closed:
            with contextlib.suppress(OSError):
                p.stdin.close()


@pytest.mark.parametrize("k", KS)
def test_member_api_exclusive(tmp_path: Path, k: int) -> None:
    arena = _make_arena(tmp_path)
    log, sim, worker = tmp_path / "events.log", tmp_path / "gpu.sim", tmp_path / "worker.py"
    log.touch()
    sim.touch()
    worker.write_text(API_WORKER)
    monitor = LocksMonitor(arena)
    elog = EventLog(log)
    procs: list[subprocess.Popen[bytes]] = []
    started = time.monotonic()
    deadline = started + _api_deadline()
    try:
        monitor.start()
        for i in range(k):
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(worker), f"a{k}-{i}", str(log), str(sim), str(arena)],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.DEVNULL,
                    start_new_session=True,
                )
            )
        while time.monotonic() < deadline:
            elog.follow()
            if elog.handoffs >= API_HANDOFFS or any(p.poll() is not None for p in procs):
                break
            time.sleep(0.1)  # progress monitor pacing
        _api_stop(procs)
        codes: list[int | None] = []
        for p in procs:
            try:
                codes.append(p.wait(max(1.0, deadline + 30 - time.monotonic())))
            except subprocess.TimeoutExpired:
                codes.append(None)
        monitor.stop()
    finally:
        _api_stop(procs)
        monitor.halt.set()
        for p in procs:
            if p.poll() is None:
                kill_quietly(p.pid)
            p.wait(10)
    elapsed = time.monotonic() - started
    if monitor.error is not None:
        raise monitor.error
    elog.follow()
    figures: dict[str, object] = {"k": k, "seconds": round(elapsed, 1), **monitor.figures(),
                                 "stranded_limit_ms": round(STRANDED_MAX * 1000)}  # fmt: skip
    figures.update(_check_log(elog.events))
    _report("api", figures)
    assert codes == [0] * k, f"members exited with {codes}"
    handoffs = figures["handoffs"]
    assert isinstance(handoffs, int) and handoffs >= API_HANDOFFS, figures
    _check_stranded(monitor, figures)
