"""The stress tests' witnesses, owned by the test and not by vramlock: the workers'
append-only event log (who entered and left the GPU, when) and a monitor of
/proc/locks that finds a waiter left blocked while the token was free."""

from __future__ import annotations

import dataclasses
import fcntl
import itertools
import os
import statistics
import threading
import time
from pathlib import Path

from vramlock.procfs import read_proc_locks

# -- the event log -----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Event:
    t: float
    name: str
    what: str
    pid: int


class LogReader:
    """Reads the append-only event log incrementally (complete lines only)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.partial = b""

    def read(self) -> list[Event]:
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read()
        self.offset += len(data)
        *lines, self.partial = (self.partial + data).split(b"\n")
        out = []
        for line in lines:
            t, name, what, pid = line.decode().split()
            out.append(Event(float(t), name, what, int(pid)))
        return out


class EventLog:
    """The events so far, and running figures (in file order: close enough for pacing)."""

    def __init__(self, path: Path) -> None:
        self.reader = LogReader(path)
        self.events: list[Event] = []
        self.handoffs = 0  # progress only; the verdict re-counts in time order
        self.holder: str | None = None  # entered and not left yet
        self.last_entered: str | None = None  # resident, releasing, or just released
        self.workers: dict[str, int] = {}  # name -> worker pid, from the start lines
        self._last: Event | None = None

    def follow(self) -> None:
        for e in self.reader.read():
            self.events.append(e)
            if e.what == "start":
                self.workers[e.name] = e.pid
            elif e.what == "enter":
                if self._last is not None and self._last.what == "leave":
                    self.handoffs += self._last.name != e.name
                self.holder = self.last_entered = e.name
                self._last = e
            elif e.what == "leave":
                if self.holder == e.name:
                    self.holder = None
                self._last = e


def count_handoffs(events: list[Event]) -> int:
    """Enter events that follow (in time) a leave of a different member."""
    handoffs = 0
    last: Event | None = None
    for e in sorted(events, key=lambda e: e.t):
        if e.what not in ("enter", "leave"):
            continue
        if e.what == "enter" and last is not None and last.what == "leave" and last.name != e.name:
            handoffs += 1
        last = e
    return handoffs


def intervals(events: list[Event]) -> tuple[list[tuple[float, float, str]], list[str]]:
    """Closed enter..leave intervals per member, and members left inside an open one."""
    opened: dict[str, float] = {}
    closed: list[tuple[float, float, str]] = []
    for e in sorted(events, key=lambda e: e.t):
        if e.what == "enter":
            assert e.name not in opened, f"{e.name} entered twice without leaving"
            opened[e.name] = e.t
        elif e.what == "leave":
            closed.append((opened.pop(e.name), e.t, e.name))
    return closed, sorted(opened)


def overlaps(spans: list[tuple[float, float, str]]) -> list[tuple[str, str, float]]:
    out = []
    spans = sorted(spans)
    for (_, end_a, a), (start_b, _, b) in itertools.pairwise(spans):
        if start_b < end_a:
            out.append((a, b, end_a - start_b))
    return out


# -- /proc/locks -------------------------------------------------------------------------------


def _proc_locks() -> bytes:
    return read_proc_locks().encode()


def lock_key(path: Path) -> bytes:
    """The ``maj:min:inode`` field /proc/locks shows for ``path``, as the kernel prints it.

    Found by locking the file ourselves for an instant rather than by formatting ``st_dev``
    (on overlayfs the two may differ)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        ino = os.fstat(fd).st_ino
        mine = str(os.getpid()).encode()
        for line in _proc_locks().splitlines():
            f = line.split()
            if len(f) >= 6 and f[1] == b"FLOCK" and f[4] == mine and f[5].endswith(b":%d" % ino):
                return f[5]
    finally:
        os.close(fd)
    st = os.stat(path)
    return b"%02x:%02x:%d" % (os.major(st.st_dev), os.minor(st.st_dev), st.st_ino)


class LocksMonitor(threading.Thread):
    """Times stretches of "somebody waits, nobody holds the token" in /proc/locks.

    ``longest`` is what was seen: from the first sample in the state to the last one.
    ``longest_bound`` adds the gaps to the samples on either side (an upper bound).
    """

    def __init__(self, arena: Path, interval: float = 0.001) -> None:
        super().__init__(name="locks-monitor", daemon=True)
        self.token = lock_key(arena / "token.lock")
        self.want = lock_key(arena / "want.lock")
        self.interval = interval
        self.halt = threading.Event()
        self.samples = 0
        self.stretches = 0
        self.longest = 0.0
        self.longest_bound = 0.0
        self.longest_at = 0.0
        self.durations: list[float] = []  # every stretch, as seen
        self.max_gap = 0.0
        self.error: BaseException | None = None

    def stranded(self, data: bytes) -> bool:
        holders = waiting = 0
        for line in data.splitlines():
            f = line.split()
            if len(f) < 7:
                continue
            blocked = f[1] == b"->"
            kind, mode, key = (f[2], f[4], f[6]) if blocked else (f[1], f[3], f[5])
            if kind != b"FLOCK":
                continue
            if key == self.token:
                if blocked:
                    waiting += 1
                elif mode == b"WRITE":
                    holders += 1
            elif key == self.want and (blocked or mode == b"READ"):
                waiting += 1
        return waiting > 0 and holders == 0

    def run(self) -> None:
        try:
            self._loop()
        except BaseException as err:  # surfaced by the test
            self.error = err

    def _loop(self) -> None:
        first = last = None  # first and last sample of the current stretch
        before = prev = time.monotonic()  # the last sample outside it / the previous sample
        while not self.halt.is_set():
            data = _proc_locks()
            now = time.monotonic()
            self.samples += 1
            self.max_gap = max(self.max_gap, now - prev)
            prev = now
            if self.stranded(data):
                if first is None:
                    first = now
                    self.stretches += 1
                last = now
            else:
                if first is not None and last is not None:
                    self.durations.append(last - first)
                    if last - first > self.longest:
                        self.longest, self.longest_at = last - first, first
                    self.longest_bound = max(self.longest_bound, now - before)
                    first = last = None
                before = now
            time.sleep(self.interval)
        if first is not None and last is not None:
            self.durations.append(last - first)
            self.longest = max(self.longest, last - first)

    def stop(self) -> None:
        self.halt.set()
        self.join(10)

    def figures(self) -> dict[str, object]:
        top = sorted(self.durations, reverse=True)
        return {
            "samples": self.samples,
            "stranded_stretches": self.stretches,
            "stranded_over_5ms": sum(d > 0.005 for d in top),
            "stranded_top_ms": [round(d * 1000, 2) for d in top[:5]],
            "stranded_median_ms": round(statistics.median(top) * 1000, 3) if top else 0.0,
            "longest_stranded_ms": round(self.longest * 1000, 3),
            "longest_stranded_bound_ms": round(self.longest_bound * 1000, 3),
            "monitor_max_gap_ms": round(self.max_gap * 1000, 3),
        }
