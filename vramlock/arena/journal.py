"""The arena's journal: what happened, one JSON line per event, for ``vramlock stats``.

Each user appends to a file of their own, ``journal/UID.jsonl`` in the arena. A line is
about a member of the file's owner, whatever uid, pid or name it claims: the member is
(owner, pid, start time), so one user's lines never add to another user's member, and
a line that claims another uid, or comes from a file others may write, is unverified.
Only canonical names are read (``UID.jsonl`` and ``UID.jsonl.1``, the uid in decimal
without leading zeros, the file owned by that uid), each file's newest lines, at most
``READ_TOTAL`` bytes in all, shared fairly among the users: whatever anybody plants, a
read stays bounded, and nobody's files crowd out the others'.

A file over ``MAX_BYTES`` becomes ``UID.jsonl.1`` (the older one goes), renamed by
whichever writer finds it over the cap, under an flock of that file so that two writers
never rotate twice. Where that name is not ours to replace (another user's file in the
sticky ``journal/`` of a team arena, a directory), the file is emptied in place
instead: the cap holds either way.

Writing is off the handoff path: a member's state change makes its line and queues it,
and a daemon thread writes the queue a little later, in ``O_APPEND`` writes of whole
lines, so that lines of concurrent writers never interleave. Like the
records, the journal is for display: nothing here raises into a member, nothing decides from it.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import json
import operator
import os
import stat
import threading
import time
from collections.abc import Iterator
from typing import Any, NamedTuple

from ..errors import LockError
from . import lockfd
from .directory import JOURNAL as JOURNAL  # journal.JOURNAL, as tests name it
from .directory import Arena, open_subdir
from .records import Record, State

SUFFIX = ".jsonl"
OLDER = SUFFIX + ".1"
# One file's cap; with the older one, a user's journal takes at most twice this.
MAX_BYTES = 8 << 20
# What one read takes in all (two users' whole journals), shared among the users:
# planted files cannot make ``vramlock stats`` or the page read without end.
READ_TOTAL = 32 << 20
# At most this many files are read (a directory of thousands is cut, the newest kept).
READ_FILES = 256
# A line is at most this long. Lines are appended by ``writev``, up to ``_IOV_MAX`` at a
# time: with O_APPEND, POSIX allows no other change to the file between a write's finding
# the end and its writing there, so two writers' lines never interleave, and a batch costs
# a system call or two, which the member's thread need not wait for.
MAX_LINE = 4000
_IOV_MAX = 1024
# ``VRAMLOCK_JOURNAL=off`` in a member's environment: it journals nothing (for measuring
# what the journal costs; ``vramlock stats`` then has nothing of that member's).
ENABLED = os.environ.get("VRAMLOCK_JOURNAL", "on") != "off"
# The writer waits this long after an event before writing, so that it never competes
# with a handoff for the CPU, and writes everything queued by then. After a batch of more
# than ``BUSY`` lines (thousands of events a second: handoffs back to back) it waits
# ``BUSY_SETTLE``: each batch takes the GIL from the member's thread a few times, and a
# few batches a second touch fewer handoffs. (A member killed by SIGKILL loses what was
# queued: an event's line is written within ``SETTLE`` when events are a few a second.)
SETTLE = 0.05
BUSY, BUSY_SETTLE = 100, 0.5

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# As lock files are opened (lockfd): no symlink, no FIFO hang, not inherited.
_OPEN = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY
_APPEND_FLAGS = _OPEN | os.O_WRONLY | os.O_APPEND | os.O_CREAT
_READ_FLAGS = _OPEN | os.O_RDONLY

# The event each state change is, by (old state, new state).
_EVENTS = {
    ("waiting", "resident"): "acquire",
    ("waiting", "restoring"): "restore-start",
    ("restoring", "resident"): "restore-end",
    ("resident", "releasing"): "release-start",
    ("releasing", "resident"): "refusal",
    ("waiting", "released"): "gave-up",
}
EVENTS = frozenset(
    {*_EVENTS.values(), "want", "release-end", "moved", "exit"}
)  # every event a line may name


def event_of(old: str, new: str) -> str:
    """The event a state change from ``old`` to ``new`` is."""
    if new == "waiting":
        return "want"
    if new == "released" and old != "waiting":
        return "release-end"
    return _EVENTS.get((old, new), new)


def _writable_by_others(st: os.stat_result) -> bool:
    return bool(st.st_mode & (stat.S_IWGRP | stat.S_IWOTH))


class _Sink:
    """One arena's journal file of this user, written from the writer thread only."""

    def __init__(self, arena: Arena) -> None:
        self.dirfd = os.dup(arena.dirfd)  # the arena may be closed before we write
        self.name = f"{os.geteuid()}{SUFFIX}"
        self.jdir: int | None = None
        self.fd: int | None = None

    def _open_file(self, jdir: int) -> int | None:
        try:
            fd = os.open(self.name, _APPEND_FLAGS, 0o644, dir_fd=jdir)
        except OSError:
            return None
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or _writable_by_others(st):
            os.close(fd)  # planted by somebody else: our lines would not be believed
            return None
        return fd

    def _current(self) -> tuple[int, int] | None:
        """The journal directory and our file as the path names it now, opened if need be."""
        if self.jdir is None:
            self.jdir = open_subdir(self.dirfd, JOURNAL, create=True)
            if self.jdir is None:
                return None
        if self.fd is not None and not lockfd.still_linked(self.jdir, self.name, self.fd):
            os.close(self.fd)  # rotated by another writer: append to the new file
            self.fd = None
        if self.fd is None:
            self.fd = self._open_file(self.jdir)
        return None if self.fd is None else (self.jdir, self.fd)

    def write(self, lines: list[bytes]) -> None:
        # The file looked up once a batch, its size checked once a batch: a batch is
        # small (tens of KiB) beside the cap.
        now = self._current()
        if now is None:
            return
        try:
            for some in _writes(lines):
                os.writev(now[1], some)
            if os.fstat(now[1]).st_size >= MAX_BYTES:
                self._rotate(*now)
        except (OSError, LockError):
            return  # full or gone: the journal is for display

    def _rotate(self, jdir: int, fd: int) -> None:
        # Under the file's own flock, and only if the path still names it: two writers
        # finding it over the cap at once rotate it once, not the new file as well.
        lockfd.lock(fd, exclusive=True)
        try:
            if lockfd.still_linked(jdir, self.name, fd) and os.fstat(fd).st_size >= MAX_BYTES:
                with contextlib.suppress(OSError):
                    os.rename(self.name, self.name + ".1", src_dir_fd=jdir, dst_dir_fd=jdir)
                # Still ours under that name: the older name is not ours to replace
                # (EPERM in a sticky directory, a directory there, a link to this very
                # file). Emptied instead: appends (O_APPEND) go on from the new end.
                if lockfd.still_linked(jdir, self.name, fd):
                    os.ftruncate(fd, 0)
        finally:
            lockfd.unlock(fd)

    def close(self) -> None:
        for fd in (self.fd, self.jdir, self.dirfd):
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)


# Names and strategies as JSON strings: the same few, again and again.
_quoted = functools.lru_cache(maxsize=256)(json.dumps)
# Free text is cut to these lengths: a line then stays under ``MAX_LINE`` even with
# every character escaped (six bytes each).
_CLIP_NAME, _CLIP_STRATEGY = 256, 64


@functools.lru_cache(maxsize=256)
def _who(pid: int, start: int, uid: int, name: str, strategy: str) -> str:
    """The part of a line that names the member: the same for all of its events."""
    return (
        f'"pid":{pid},"start":{start},"uid":{uid},"name":{_quoted(name[:_CLIP_NAME])},'
        f'"strategy":{_quoted(strategy[:_CLIP_STRATEGY])}'
    )


def _line(
    offset: float,
    mono: float,
    record: Record,
    strategy: str,
    event: str,
    new: str | None,
    size: int | None,
) -> bytes:
    """The JSON line of an event, formatted by hand: json.dumps of the whole took five
    times as long, on the member's thread. The event and state are vramlock's own words,
    the numbers finite."""
    who = _who(record.pid, record.starttime, record.uid, record.name, strategy)
    text = f'{{"time":{mono + offset!r},"mono":{mono!r},{who},"event":"{event}"'
    if new is not None:
        text += f',"state":"{new}"'
    if size is not None:
        text += f',"bytes":{size}'
    return (text + "}\n").encode()


def _writes(lines: list[bytes]) -> Iterator[list[bytes]]:
    """Whole lines in groups of at most ``_IOV_MAX``: one ``writev`` each."""
    for start in range(0, len(lines), _IOV_MAX):
        yield lines[start : start + _IOV_MAX]


class _Writer:
    """The process's journal writer: events queued, and a daemon thread that writes them.

    Queueing an event makes its line (a few microseconds: it is formatted by hand) and
    appends it (and, for the first of a batch, wakes the thread); the thread then lets
    the batch gather for ``SETTLE`` and writes it in a few system calls, which release
    the GIL: it does almost nothing in Python that the member's thread would wait for."""

    def __init__(self) -> None:
        # Lines already made, by sink: bytes in lists, so that queueing makes no object
        # the garbage collector must follow (a tuple an event made it work on every
        # handoff at thousands a second).
        self.pending: dict[_Sink, list[bytes]] = {}
        self.queue = threading.Lock()  # pending taken whole, never while a line goes in
        self.sinks: dict[int, tuple[Arena, _Sink]] = {}  # by id(arena); the arena kept alive
        self.wake = threading.Event()
        self.guard = threading.Lock()  # making sinks and the thread
        self.io = threading.Lock()  # one batch written at a time, in order
        self.thread: threading.Thread | None = None

    def sink(self, arena: Arena) -> _Sink | None:
        found = self.sinks.get(id(arena))
        if found is not None:
            return found[1]
        with self.guard:
            if id(arena) not in self.sinks:
                try:
                    self.sinks[id(arena)] = (arena, _Sink(arena))
                except OSError:
                    return None  # the arena was closed (or no descriptor is left)
            if self.thread is None:
                self.thread = threading.Thread(
                    target=self._run, name="vramlock-journal", daemon=True
                )
                self.thread.start()
            return self.sinks[id(arena)][1]

    def put(self, arena: Arena, line: bytes) -> None:
        found = self.sinks.get(id(arena))
        sink = self.sink(arena) if found is None else found[1]
        if sink is None:
            return
        with self.queue:
            lines = self.pending.get(sink)
            if lines is None:
                self.pending[sink] = [line]
            else:
                lines.append(line)
        if not self.wake.is_set():
            self.wake.set()

    def flush(self) -> int:
        """Write everything queued so far, in this thread; how many lines."""
        with self.io:
            with self.queue:
                batch, self.pending = self.pending, {}
            for sink, lines in batch.items():
                sink.write(lines)
            return sum(map(len, batch.values()))

    def _run(self) -> None:
        settle = SETTLE
        while True:
            self.wake.wait()
            time.sleep(settle)  # let the batch gather, away from the handoff
            self.wake.clear()  # before taking the batch: a later event wakes us again
            settle = BUSY_SETTLE if self.flush() > BUSY else SETTLE


_writer = _Writer()


def _forked() -> None:
    # The writer thread is not in the child; whatever was queued is the parent's to write.
    global _writer
    for _, sink in _writer.sinks.values():
        sink.close()
    _writer = _Writer()


os.register_at_fork(after_in_child=_forked)
atexit.register(lambda: _writer.flush())


_clock = [0.0, -1e9]  # wall clock minus monotonic, and when it was read


def _offset(mono: float) -> float:
    """The wall clock's offset from the monotonic one, read again once a second."""
    if mono - _clock[1] > 1.0:
        _clock[0], _clock[1] = time.time() - time.monotonic(), mono
    return _clock[0]


def note(
    arena: Arena, record: Record, event: str, new: str | None = None, size: int | None = None
) -> None:
    """Queue ``event`` of the member ``record`` describes (its new state, the bytes moved)
    for ``arena``'s journal."""
    if ENABLED:
        mono = time.monotonic()
        _writer.put(arena, _line(_offset(mono), mono, record, record.strategy, event, new, size))


def state(arena: Arena, record: Record, new: str) -> None:
    """A member changes state: ``record`` still says the old one."""
    note(arena, record, event_of(record.state, new), new)


def left(arena: Arena, record: Record) -> None:
    """A member leaves the arena: the last line, written before this returns."""
    note(arena, record, "exit")
    _writer.flush()


def moved(arenas: list[Arena], record: Record, size: int | None) -> None:
    """A release of ``record``'s member moved ``size`` bytes off the GPU of each of
    ``arenas`` (nothing is written when it is unknown)."""
    if size:
        for arena in arenas:
            note(arena, record, "moved", size=size)


def flush() -> None:
    """Write every event queued so far (tests, and a program about to end)."""
    _writer.flush()


# -- reading -------------------------------------------------------------------------


class Event(NamedTuple):
    """One journal line. ``uid``: the owner of its file, whose member it is about, whatever
    uid the line claims. ``trusted``: the line claims that uid and its file is writable by
    nobody else. (A tuple: a journal of 100,000 lines is read in well under a second.)"""

    time: float  # Unix time
    mono: float  # CLOCK_MONOTONIC seconds, comparable between processes of one boot
    pid: int
    start: int  # the process's start time (procfs.starttime): with pid, names one process
    uid: int
    name: str
    event: str
    strategy: str
    state: str | None
    bytes: int | None
    trusted: bool


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not a number")


_DECODE = json.JSONDecoder(parse_constant=_reject_constant).decode
_NUMBERS = (int, float)
_LARGEST = 1 << 63
# Times (Unix and monotonic seconds) are finite and in [0, _LATEST] (the year 33658):
# ``1e400`` decodes as infinity, and differences of such numbers would be too.
_LATEST = 1e12
_STATES = frozenset(s.value for s in State)


def _count(v: Any) -> bool:
    return type(v) is int and 0 <= v < _LARGEST


def _when(v: Any) -> bool:
    return type(v) in _NUMBERS and 0 <= v <= _LATEST  # False for NaN


def _event(data: Any, file_uid: int, file_trusted: bool) -> Event | None:
    """The event a decoded line describes, or None when it is not one."""
    try:
        t, mono, pid, uid = data["time"], data["mono"], data["pid"], data["uid"]
        name, event, strategy = data["name"], data["event"], data.get("strategy", "")
        start, got_state, size = data.get("start", 0), data.get("state"), data.get("bytes")
    except (TypeError, KeyError, AttributeError):
        return None
    if not (
        _when(t)
        and _when(mono)
        and _count(pid)
        and _count(uid)
        and _count(start)
        and (size is None or _count(size))
        and type(name) is str
        and event in EVENTS
        and type(strategy) is str
        and (got_state is None or got_state in _STATES)
    ):
        return None
    trusted = file_trusted and uid == file_uid
    return Event(t, mono, pid, start, file_uid, name, event, strategy, got_state, size, trusted)


def parse(line: str, file_uid: int, file_trusted: bool) -> Event | None:
    """The event in one line, or None for anything that is not one."""
    try:
        return _event(_DECODE(line), file_uid, file_trusted)
    except (ValueError, RecursionError):
        return None


def _decoded(lines: list[str]) -> list[Any] | None:
    """Every line decoded at once, as one array (a line at a time took most of the
    time of ``vramlock stats``); None unless it is exactly one value per line."""
    try:
        values = _DECODE("[" + ",".join(lines) + "]")
    except (ValueError, RecursionError):
        return None
    return values if isinstance(values, list) and len(values) == len(lines) else None


_WHEN = operator.itemgetter(0, 1)  # (time, mono)


def owner_of(name: str) -> int | None:
    """The uid a journal file's name is of, or None when it is not a canonical name:
    ``UID.jsonl`` or ``UID.jsonl.1``, the uid in decimal without leading zeros."""
    stem = name[: -len(OLDER)] if name.endswith(OLDER) else name[: -len(SUFFIX)]
    if not (name.endswith((SUFFIX, OLDER)) and stem.isascii() and stem.isdigit()):
        return None
    uid = int(stem)
    return uid if str(uid) == stem and uid < 1 << 32 else None


def _journal_files(jdir: int) -> list[tuple[str, os.stat_result]]:
    """The files to read: canonical names, each a regular file of the uid it names, the
    newest ``READ_FILES`` of them, newest first."""
    try:
        names = os.listdir(jdir)
    except OSError:
        return []
    found = []
    for name in names:
        uid = owner_of(name)
        if uid is None:
            continue
        try:
            st = os.stat(name, dir_fd=jdir, follow_symlinks=False)
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode) and st.st_uid == uid:
            found.append((name, st))
    found.sort(key=lambda f: (-f[1].st_mtime_ns, f[0]))
    return found[:READ_FILES]


def _read_file(jdir: int, name: str, seen: os.stat_result, limit: int) -> tuple[bytes, bool]:
    """The last ``limit`` bytes of ``name`` (whole lines: a line cut at the start is
    dropped), if it is still the file ``seen`` was; whether nobody else may write it."""
    try:
        fd = os.open(name, _READ_FLAGS, dir_fd=jdir)
    except OSError:
        return b"", False
    try:
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino, st.st_uid) != (seen.st_dev, seen.st_ino, seen.st_uid):
            return b"", False  # replaced since it was listed
        start = max(0, st.st_size - limit)
        # From the byte before: a newline there, and the first line is whole.
        data = os.pread(fd, limit + (start > 0), start - (start > 0)) if limit > 0 else b""
    except OSError:
        return b"", False
    finally:
        os.close(fd)
    if start > 0:
        data = data[data.find(b"\n") + 1 :] if b"\n" in data else b""
    return data, not _writable_by_others(st)


def _plan(files: list[tuple[str, os.stat_result]]) -> list[tuple[str, os.stat_result, int]]:
    """How much of each file to read: ``READ_TOTAL`` shared fairly among the users (the
    smallest journals first, what one does not need left to the others), a user's
    current file before its older one, at most ``2 * MAX_BYTES`` of any. Nobody's files,
    however big or new, leave the others' unread."""
    by_uid: dict[int, list[tuple[str, os.stat_result]]] = {}
    for name, st in files:
        by_uid.setdefault(st.st_uid, []).append((name, st))

    def size(of: list[tuple[str, os.stat_result]]) -> int:
        return sum(min(st.st_size, 2 * MAX_BYTES) for _, st in of)

    users = sorted(by_uid.values(), key=size)
    left, plan = READ_TOTAL, []
    for i, of in enumerate(users):
        share = left // (len(users) - i)
        for name, st in sorted(of, key=lambda f: f[0].endswith(OLDER)):
            take = min(st.st_size, 2 * MAX_BYTES, share)
            plan.append((name, st, take))
            share, left = share - take, left - take
    return plan


def _events(data: bytes, uid: int, trusted: bool) -> list[Event]:
    # Only newlines end lines (str.splitlines would also split at U+2028 and friends).
    # What follows the last newline is a line cut by the size limit (writes are whole lines).
    whole = data[: data.rfind(b"\n") + 1]
    lines = [raw for raw in whole.decode(errors="replace").split("\n") if raw.strip()]
    values = _decoded(lines)
    if values is None:  # a bad line somewhere: each on its own
        found = [parse(raw, uid, trusted) for raw in lines]
    else:
        found = [_event(v, uid, trusted) for v in values]
    return [e for e in found if e is not None]


def signature(arena: Arena) -> tuple[tuple[str, int, int], ...]:
    """Each journal file's name, size and change time: equal signatures, equal journals
    (a reader that keeps what it read need not read it again)."""
    try:
        jdir = os.open(JOURNAL, _DIR_FLAGS, dir_fd=arena.dirfd)
    except OSError:
        return ()
    try:
        return tuple((n, st.st_size, st.st_mtime_ns) for n, st in _journal_files(jdir))
    finally:
        os.close(jdir)


def read(arena: Arena, since: float | None = None) -> list[Event]:
    """Every event of the arena's journal (from Unix time ``since``), oldest first: of
    each file, its newest lines, ``READ_TOTAL`` bytes in all (see ``_plan``)."""
    try:
        jdir = os.open(JOURNAL, _DIR_FLAGS, dir_fd=arena.dirfd)
    except OSError:
        return []  # none yet, or none we may read
    found: list[tuple[str, list[Event]]] = []
    try:
        for name, seen, take in _plan(_journal_files(jdir)):
            data, trusted = _read_file(jdir, name, seen, take)
            found.append((name, _events(data, seen.st_uid, trusted)))
    finally:
        os.close(jdir)
    found.sort(key=lambda f: f[0].endswith(SUFFIX))  # older files first: lines of one time
    events = [e for _, some in found for e in some]  # stay in the order they were written
    if since is not None:
        events = [e for e in events if e.time >= since]
    return sorted(events, key=_WHEN)
