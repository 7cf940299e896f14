"""The arena's journal: what happened, one JSON line per event, for ``vramlock stats``.

Each user appends to a file of their own, ``journal/UID.jsonl`` in the arena, so a line
is believed only when the file's owner is the uid the line claims (and nobody else may
write the file): anybody could otherwise speak for somebody else. A file over
``MAX_BYTES`` becomes ``UID.jsonl.1`` (the older one goes), renamed by whichever writer
finds it over the cap, under an flock of that file so that two writers never rotate
twice.

Writing is off the handoff path: a member's state change only queues the event, and a
daemon thread writes it a little later, one ``O_APPEND`` write per line (shorter than
``PIPE_BUF``, so lines of concurrent writers never interleave). Like the records, the
journal is for display: nothing here raises into a member, nothing decides from it.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import math
import os
import queue
import stat
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from . import lockfd
from .directory import Arena
from .records import Record

JOURNAL = "journal"
SUFFIX = ".jsonl"
OLDER = SUFFIX + ".1"
# One file's cap; with the older one, a user's journal takes at most twice this.
MAX_BYTES = 8 << 20
# A line longer than this is cut (its name first): POSIX makes O_APPEND writes up to
# PIPE_BUF (4096 on Linux) atomic with respect to other writers.
MAX_LINE = 4000
# The writer waits this long after an event before writing, so that it never competes
# with a handoff for the CPU, and writes everything queued by then.
SETTLE = 0.05
# How long leaving the arena waits for the journal to be written.
FLUSH_TIMEOUT = 2.0

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


class Joined(Protocol):
    """What the scheduler's member is (one arena's member, or several arenas' together)."""

    @property
    def arenas(self) -> list[Arena]: ...

    records: Any


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
        self.shown = arena.shown(JOURNAL)
        self.dirfd = os.dup(arena.dirfd)  # the arena may be closed before we write
        self.name = f"{os.geteuid()}{SUFFIX}"
        self.jdir: int | None = None
        self.fd: int | None = None

    def _open_dir(self) -> int | None:
        with contextlib.suppress(OSError):
            os.mkdir(JOURNAL, 0o755, dir_fd=self.dirfd)
        try:
            fd = os.open(JOURNAL, _DIR_FLAGS, dir_fd=self.dirfd)
        except OSError:
            return None
        st = os.fstat(fd)
        # Anyone may write there: only with the sticky bit may nobody remove our file.
        if st.st_mode & stat.S_IWOTH and not st.st_mode & stat.S_ISVTX:
            os.close(fd)
            return None
        return fd

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
            self.jdir = self._open_dir()
            if self.jdir is None:
                return None
        if self.fd is not None and not lockfd.still_linked(self.jdir, self.name, self.fd):
            os.close(self.fd)  # rotated by another writer: append to the new file
            self.fd = None
        if self.fd is None:
            self.fd = self._open_file(self.jdir)
        return None if self.fd is None else (self.jdir, self.fd)

    def write(self, lines: list[bytes]) -> None:
        for line in lines:
            now = self._current()
            if now is None:
                return
            try:
                os.write(now[1], line)
                if os.fstat(now[1]).st_size >= MAX_BYTES:
                    self._rotate(*now)
            except OSError:
                return  # full or gone: the journal is for display

    def _rotate(self, jdir: int, fd: int) -> None:
        # Under the file's own flock, and only if the path still names it: two writers
        # finding it over the cap at once rotate it once, not the new file as well.
        lockfd.lock(fd, exclusive=True)
        try:
            if lockfd.still_linked(jdir, self.name, fd) and os.fstat(fd).st_size >= MAX_BYTES:
                os.rename(self.name, self.name + ".1", src_dir_fd=jdir, dst_dir_fd=jdir)
        finally:
            lockfd.unlock(fd)

    def close(self) -> None:
        for fd in (self.fd, self.jdir, self.dirfd):
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)


def _line(fields: dict[str, Any]) -> bytes:
    data = json.dumps(fields, allow_nan=False, separators=(",", ":")) + "\n"
    if len(data.encode()) > MAX_LINE:
        fields = {**fields, "name": fields["name"][:64], "strategy": fields["strategy"][:64]}
        data = json.dumps(fields, allow_nan=False, separators=(",", ":")) + "\n"
    return data.encode()


class _Writer:
    """The process's journal writer: a queue, and a daemon thread that empties it."""

    def __init__(self) -> None:
        self.queue: queue.SimpleQueue[tuple[_Sink, dict[str, Any]] | threading.Event] = (
            queue.SimpleQueue()
        )
        self.sinks: dict[int, tuple[Arena, _Sink]] = {}  # by id(arena); the arena kept alive
        self.hurry = threading.Event()
        self.guard = threading.Lock()
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

    def put(self, arena: Arena, fields: dict[str, Any]) -> None:
        sink = self.sink(arena)
        if sink is not None:
            self.queue.put((sink, fields))

    def flush(self) -> None:
        """Write everything queued so far, waiting (a little) for it."""
        if self.thread is None:
            return
        done = threading.Event()
        self.queue.put(done)
        self.hurry.set()
        done.wait(FLUSH_TIMEOUT)

    def _run(self) -> None:
        while True:
            batch = [self.queue.get()]
            self.hurry.wait(SETTLE)
            self.hurry.clear()
            with contextlib.suppress(queue.Empty):
                while True:
                    batch.append(self.queue.get_nowait())
            self._write(batch)

    @staticmethod
    def _write(batch: list[tuple[_Sink, dict[str, Any]] | threading.Event]) -> None:
        lines: dict[_Sink, list[bytes]] = {}
        for item in batch:
            if isinstance(item, threading.Event):
                for sink, some in lines.items():
                    sink.write(some)
                lines.clear()
                item.set()
            else:
                lines.setdefault(item[0], []).append(_line(item[1]))
        for sink, some in lines.items():
            sink.write(some)


_writer = _Writer()


def _forked() -> None:
    # The writer thread is not in the child; whatever was queued is the parent's to write.
    global _writer
    for _, sink in _writer.sinks.values():
        sink.close()
    _writer = _Writer()


os.register_at_fork(after_in_child=_forked)
atexit.register(lambda: _writer.flush())


def note(arena: Arena, record: Record, event: str, **fields: Any) -> None:
    """Queue ``event`` of the member ``record`` describes for ``arena``'s journal."""
    _writer.put(
        arena,
        {
            "time": time.time(),
            "mono": time.monotonic(),
            "pid": record.pid,
            "uid": record.uid,
            "name": record.name,
            "event": event,
            "strategy": record.strategy,
            **fields,
        },
    )


def state(arena: Arena, record: Record, new: str) -> None:
    """A member changes state: ``record`` still says the old one."""
    note(arena, record, event_of(record.state, new), state=new)


def left(arena: Arena, record: Record) -> None:
    """A member leaves the arena: the last line, written before this returns."""
    note(arena, record, "exit")
    _writer.flush()


def moved(member: Joined, strategy: str, size: int | None) -> None:
    """A release moved ``size`` bytes off the GPU (nothing is written when it is unknown)."""
    if size:
        for arena in member.arenas:
            note(arena, member.records.record, "moved", strategy=strategy, bytes=size)


def flush() -> None:
    """Write every event queued so far (tests, and a program about to end)."""
    _writer.flush()


# -- reading -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Event:
    """One journal line. ``trusted``: its file is its claimed uid's, writable by nobody
    else; an untrusted line may speak for somebody it is not."""

    time: float  # Unix time
    mono: float  # CLOCK_MONOTONIC seconds, comparable between processes of one boot
    pid: int
    uid: int
    name: str
    event: str
    strategy: str
    state: str | None
    bytes: int | None
    trusted: bool


def _number(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(value)
    return float(value)


def _count(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 1 << 63:
        raise ValueError(value)
    return value


def _text(value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError(value)
    return value


def parse(raw: bytes, file_uid: int, file_trusted: bool) -> Event | None:
    """The event in one line, or None for anything that is not one."""
    try:
        data = json.loads(raw)
        if not isinstance(data, dict):
            return None
        uid = _count(data["uid"])
        got_state, size = data.get("state"), data.get("bytes")
        return Event(
            time=_number(data["time"]),
            mono=_number(data["mono"]),
            pid=_count(data["pid"]),
            uid=uid,
            name=_text(data["name"]),
            event=_text(data["event"]),
            strategy=_text(data.get("strategy", "")),
            state=None if got_state is None else _text(got_state),
            bytes=None if size is None else _count(size),
            trusted=file_trusted and uid == file_uid,
        )
    except (ValueError, TypeError, KeyError, RecursionError):
        return None


def _journal_files(jdir: int) -> list[str]:
    try:
        names = os.listdir(jdir)
    except OSError:
        return []
    found = []
    for name in names:
        stem = name[: -len(OLDER)] if name.endswith(OLDER) else name[: -len(SUFFIX)]
        if name.endswith((SUFFIX, OLDER)) and stem.isascii() and stem.isdigit():
            found.append(name)
    return sorted(found, key=lambda n: n.endswith(SUFFIX))  # older files first


def _lines(jdir: int, name: str) -> Iterator[Event]:
    try:
        fd = os.open(name, _READ_FLAGS, dir_fd=jdir)
    except OSError:
        return
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return
        with os.fdopen(os.dup(fd), "rb") as f:
            data = f.read(2 * MAX_BYTES)  # a file somebody grew past any cap is cut
    except OSError:
        return
    finally:
        os.close(fd)
    trusted = not _writable_by_others(st)
    for raw in data.splitlines():
        found = parse(raw, st.st_uid, trusted)
        if found is not None:
            yield found


def read(arena: Arena, since: float | None = None) -> list[Event]:
    """Every event of the arena's journal (from Unix time ``since``), oldest first."""
    try:
        jdir = os.open(JOURNAL, _DIR_FLAGS, dir_fd=arena.dirfd)
    except OSError:
        return []  # none yet, or none we may read
    try:
        events: Iterable[Event] = [e for n in _journal_files(jdir) for e in _lines(jdir, n)]
    finally:
        os.close(jdir)
    if since is not None:
        events = [e for e in events if e.time >= since]
    return sorted(events, key=lambda e: (e.time, e.mono))
