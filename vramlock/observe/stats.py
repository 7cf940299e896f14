"""What the journal says about an arena: who held the GPU and for how long, who waited,
what each switch cost, and whether anybody thrashes.

One pass over the events, oldest first. A member is one process of one user (uid, pid
and start time): a line counts only for a member of its file's owner (``Event.uid``), so
one user's lines, whatever pid they name, never add to another user's member. A member
whose pid and start time name a living process of another user is not that process: its
lines are unverified, and its turns end at its last line.
It holds the GPU from ``acquire`` (or ``restore-start``, which takes the token and
restores at once) to ``release-end``, ``gave-up`` or ``exit``; it waits from ``want``
to the next of those. A process that ended without saying so (SIGKILL) held the GPU
until its last line.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from .. import procfs
from ..arena.journal import Event

# Released and resident again within this many seconds: the member thrashes (its
# releases cost more than the turns between them are worth).
THRASH_WINDOW = 5.0

_HOLDS = frozenset({"acquire", "restore-start"})
_ENDS = frozenset({"release-end", "gave-up", "exit"})


def percentile(values: Sequence[float], q: float) -> float | None:
    """The nearest-rank ``q`` percentile (0-100) of ``values``; None when there are none."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def summary(values: Sequence[float]) -> dict[str, Any]:
    """count, p50, p95 and max, in seconds (None where there are no values)."""
    return {
        "count": len(values),
        "p50": percentile(values, 50),
        "p95": percentile(values, 95),
        "max": max(values) if values else None,
    }


@dataclass
class MemberStats:
    """One member (one process) over the window."""

    pid: int
    start: int
    name: str
    uid: int
    strategy: str = ""
    trusted: bool = True  # every line of it was
    state: str = "released"  # the last one journalled
    resident: float = 0.0  # seconds holding the GPU (restoring and releasing included)
    releases: int = 0
    refusals: int = 0
    thrash: int = 0
    waits: list[float] = field(default_factory=list)
    release_times: list[float] = field(default_factory=list)
    restore_times: list[float] = field(default_factory=list)
    bytes_out: int = 0
    bytes_in: int = 0
    # Open intervals: when the member began to hold / wait / release / restore.
    held_since: Event | None = None
    waiting_since: Event | None = None
    releasing_since: Event | None = None
    restoring_since: Event | None = None
    released_at: Event | None = None
    last_moved: int = 0  # the bytes the last release moved out, to come back in
    last: Event | None = None
    gone: bool = False  # it said exit
    counted: bool = False  # it has events in the window


class Segment(NamedTuple):
    """A stretch of time a member held the GPU (``resident``) or waited for it. (A
    tuple: made for every turn, a dataclass took an eighth of ``compute``.)"""

    member: int  # index into Report.members
    kind: str  # "resident" or "waiting"
    start: float  # Unix time
    end: float


class Switch(NamedTuple):
    """One release: when it ended (Unix time), whose, by which strategy, how long it took."""

    time: float
    name: str
    strategy: str
    seconds: float


@dataclass
class Report:
    """Statistics of one arena's journal over [start, end] (Unix time)."""

    start: float
    end: float
    members: list[MemberStats]
    segments: list[Segment]
    events: int
    untrusted: int
    release_by_strategy: dict[str, list[float]]
    switches: list[Switch]

    @property
    def handoffs(self) -> int:
        return sum(m.releases for m in self.members)

    def as_json(self) -> dict[str, Any]:
        """The report as plain data (``vramlock stats --json``)."""
        span = max(self.end - self.start, 0.0)
        return {
            "start": self.start,
            "end": self.end,
            "seconds": span,
            "events": self.events,
            "untrusted_events": self.untrusted,
            "handoffs": self.handoffs,
            "thrash": sum(m.thrash for m in self.members),
            "release_by_strategy": {
                s: summary(v) for s, v in sorted(self.release_by_strategy.items())
            },
            "members": [_member_json(m, span) for m in self.members],
        }


def _member_json(m: MemberStats, span: float) -> dict[str, Any]:
    return {
        "pid": m.pid,
        "name": m.name,
        "uid": m.uid,
        "trusted": m.trusted,
        "strategy": m.strategy,
        "state": m.state,
        "resident_seconds": m.resident,
        "share": m.resident / span if span > 0 else 0.0,
        "handoffs": m.releases,
        "refusals": m.refusals,
        "thrash": m.thrash,
        "wait": summary(m.waits),
        "release": summary(m.release_times),
        "restore": summary(m.restore_times),
        "bytes_out": m.bytes_out,
        "bytes_in": m.bytes_in,
    }


def _seconds(a: Event, b: Event) -> float:
    """From ``a`` to ``b``: by the monotonic clock within one boot, else by the wall clock."""
    d = b.mono - a.mono
    return d if d >= 0 else max(0.0, b.time - a.time)


class _Pass:
    """The one pass over the events."""

    def __init__(self, start: float) -> None:
        self.start = start
        self.members: dict[tuple[int, int, int], MemberStats] = {}
        self.order: list[tuple[int, int, int]] = []
        self.index: dict[tuple[int, int, int], int] = {}  # a member's place in ``order``
        self.segments: list[Segment] = []
        self.by_strategy: dict[str, list[float]] = {}
        self.switches: list[Switch] = []
        self.untrusted = 0

    def member(self, e: Event) -> MemberStats:
        key = (e.uid, e.pid, e.start)
        m = self.members.get(key)
        if m is None:
            m = self.members[key] = MemberStats(e.pid, e.start, e.name, e.uid)
            self.index[key] = len(self.order)
            self.order.append(key)
        return m

    def segment(self, m: MemberStats, kind: str, since: Event, until: float) -> float:
        """Record a stretch, clipped to the window; its length in seconds."""
        begin = max(since.time, self.start)
        if until > begin:
            self.segments.append(Segment(self.index[(m.uid, m.pid, m.start)], kind, begin, until))
        return max(0.0, until - begin)

    def end_hold(self, m: MemberStats, at: float) -> None:
        if m.held_since is not None:
            m.resident += self.segment(m, "resident", m.held_since, at)
            m.held_since = None
        m.releasing_since = m.restoring_since = None

    def end_wait(self, m: MemberStats, e: Event | None, at: float) -> None:
        if m.waiting_since is not None:
            self.segment(m, "waiting", m.waiting_since, at)
            if e is not None and e.event in _HOLDS:
                m.waits.append(_seconds(m.waiting_since, e))
            m.waiting_since = None

    def step(self, e: Event) -> None:
        m = self.member(e)
        m.last, m.name, m.strategy = e, e.name, e.strategy or m.strategy
        m.counted = True
        m.trusted = m.trusted and e.trusted
        self.untrusted += not e.trusted
        if e.state is not None:
            m.state = e.state
        kind = e.event
        if kind == "want":
            m.waiting_since = m.waiting_since or e
        elif kind in _HOLDS:
            self._hold(m, e)
        elif kind == "release-start":
            m.releasing_since = e
        elif kind == "refusal":
            m.refusals += 1
            m.releasing_since = None
        elif kind == "restore-end" and m.restoring_since is not None:
            m.restore_times.append(_seconds(m.restoring_since, e))
            m.restoring_since = None
        elif kind == "moved" and e.bytes is not None:
            m.bytes_out += e.bytes
            m.last_moved = e.bytes
        elif kind in _ENDS:
            self._end(m, e)

    def _hold(self, m: MemberStats, e: Event) -> None:
        self.end_wait(m, e, e.time)
        if m.released_at is not None and _seconds(m.released_at, e) <= THRASH_WINDOW:
            m.thrash += 1
        m.released_at = None
        m.held_since = m.held_since or e
        if e.event == "restore-start":
            m.restoring_since = e
            m.bytes_in += m.last_moved

    def _end(self, m: MemberStats, e: Event) -> None:
        if e.event == "release-end" and m.releasing_since is not None:
            took = _seconds(m.releasing_since, e)
            m.release_times.append(took)
            self.by_strategy.setdefault(e.strategy or "?", []).append(took)
            self.switches.append(Switch(e.time, m.name, e.strategy, took))
        if e.event == "release-end" and m.held_since is not None:
            m.releases += 1
            m.released_at = e
        self.end_hold(m, e.time)
        self.end_wait(m, None, e.time)
        if e.event == "exit":
            m.gone = True
            m.state = "gone"

    def close(self, end: float) -> list[MemberStats]:
        """Intervals still open: to ``end`` for a living process, else to its last line.
        The members shown: those with events in the window, or busy as it began."""
        keep = [
            k
            for k in self.order
            if self.members[k].counted
            or self.members[k].held_since
            or self.members[k].waiting_since
        ]
        for key in self.order:
            m = self.members[key]
            alive = bool(m.start) and not m.gone and _alive(m)
            at = end if alive else (m.last.time if m.last is not None else end)
            if not alive and not m.gone:
                m.state = "gone"
            self.end_hold(m, at)
            if not alive:
                self.end_wait(m, None, at)
            elif m.waiting_since is not None:
                self.segment(m, "waiting", m.waiting_since, at)
        places = {self.index[k]: i for i, k in enumerate(keep)}
        self.segments = [Segment(places[s.member], s.kind, s.start, s.end) for s in self.segments]
        return [self.members[k] for k in keep]


def _effective_uid(pid: int) -> int | None:
    """The process's effective uid, as its journal file's name and owner are (its /proc
    directory is root's when it is not dumpable)."""
    for line in procfs.text(pid, "status", 16384).splitlines():
        if line.startswith("Uid:") and len(line.split()) > 2:
            return int(line.split()[2])
    return None


def _alive(m: MemberStats) -> bool:
    """Whether the member's process lives: its pid and start time name a living process
    of its uid (one of another uid's is not it, and marks the member unverified)."""
    if not procfs.alive(m.pid, m.start):
        return False
    if _effective_uid(m.pid) in (m.uid, None):  # None: it ended since
        return procfs.alive(m.pid, m.start)
    m.trusted = False
    return False


def _shown(m: MemberStats) -> bool:
    return m.counted or m.held_since is not None or m.waiting_since is not None


def compute(
    events: Iterable[Event], since: float | None = None, now: float | None = None
) -> Report:
    """The report of ``events`` (oldest first) from ``since`` (None: the first) to ``now``.

    Events before ``since`` still count for what was going on at ``since`` (who held the
    GPU then), but not for the counts."""
    end = time.time() if now is None else now
    listed = list(events)
    start = since if since is not None else (listed[0].time if listed else end)
    run = _Pass(start)
    counted = 0
    for e in listed:
        if e.time >= start:
            counted += 1
            run.step(e)
        else:
            _before(run, e)
    members = run.close(end)
    return Report(
        start, end, members, run.segments, counted, run.untrusted, run.by_strategy, run.switches
    )


def _before(run: _Pass, e: Event) -> None:
    """An event before the window: only the state it leaves counts."""
    m = run.member(e)
    m.last, m.name, m.strategy = e, e.name, e.strategy or m.strategy
    if e.event == "want":
        m.waiting_since = m.waiting_since or e
    elif e.event in _HOLDS:
        m.waiting_since, m.held_since = None, m.held_since or e
    elif e.event in _ENDS:
        m.waiting_since = m.held_since = None
        m.gone = e.event == "exit"


def timeline(report: Report, width: int) -> list[tuple[str, str]]:
    """Each member's row of ``width`` cells across the window: ``#`` resident, ``.``
    waiting, space neither (a cell shows the longest of them in it)."""
    span = report.end - report.start
    cells = [[[0.0, 0.0] for _ in range(width)] for _ in report.members]
    step = span / width if span > 0 else 1.0
    for s in report.segments:
        kind = 0 if s.kind == "resident" else 1
        first = int((s.start - report.start) / step)
        last = min(width - 1, int((s.end - report.start) / step))
        for i in range(max(first, 0), last + 1):
            lo, hi = report.start + i * step, report.start + (i + 1) * step
            cells[s.member][i][kind] += max(0.0, min(hi, s.end) - max(lo, s.start))
    rows = []
    for m, row in zip(report.members, cells, strict=True):
        text = "".join("#" if r > 0 and r >= w else "." if w > 0 else " " for r, w in row)
        rows.append((m.name, text))
    return rows
