"""Who is in an arena: kernel lock state merged with members' self-description records.

Records live in ``<arena>/members/<pid>-<starttime>.json``; each member rewrites
its own (write a temporary file, rename it into place) on every change of state.
They are for display only, as is /proc/locks: nothing in vramlock decides from
either. Garbage, foreign or stale records are skipped, never fatal.

This module must stay cheap to import: ``who`` uses it without the lock layer.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from .arena import TOKEN, WANT, Arena
from .procfs import LockEntry, parse_proc_locks, read_proc_locks, starttime, text

RECORD_VERSION = 1
_MAX_RECORD = 64 * 1024

STATES = ("resident", "releasing", "waiting", "released", "restoring")


@dataclass
class Record:
    """What a member says about itself."""

    pid: int
    name: str
    command: list[str]
    strategy: str
    state: str
    since: float  # wall-clock seconds (time.time()) when the state began
    starttime: int = 0
    child_pid: int | None = None
    uid: int = field(default_factory=os.geteuid)
    version: int = RECORD_VERSION

    @classmethod
    def parse(cls, raw: bytes) -> Record | None:
        try:
            data = json.loads(raw)
            rec = cls(
                pid=int(data["pid"]),
                name=str(data["name"]),
                command=[str(c) for c in data["command"]],
                strategy=str(data["strategy"]),
                state=str(data["state"]),
                since=float(data["since"]),
                starttime=int(data.get("starttime", 0)),
                child_pid=None if data.get("child_pid") is None else int(data["child_pid"]),
                uid=int(data.get("uid", -1)),
            )
        except (ValueError, TypeError, KeyError, AttributeError, RecursionError):
            return None
        return rec if rec.pid > 0 else None


class RecordWriter:
    """Keeps one member's record current; silent when the arena has no usable members/."""

    def __init__(self, arena: Arena, record: Record) -> None:
        self.record = record
        self.record.starttime = starttime(record.pid) or 0
        self.dirfd = arena.members_dir(create=True)
        self.name = f"{record.pid}-{self.record.starttime}.json"
        if self.dirfd is not None:
            _sweep_stale(self.dirfd)
        self.write()

    def update(self, **changes: Any) -> None:
        for key, value in changes.items():
            setattr(self.record, key, value)
        if "state" in changes and "since" not in changes:
            self.record.since = time.time()
        self.write()

    def write(self) -> None:
        if self.dirfd is None:
            return
        tmp = f".{self.name}.tmp"
        data = json.dumps(asdict(self.record)).encode()
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            fd = os.open(tmp, flags, 0o644, dir_fd=self.dirfd)
            try:
                os.write(fd, data)
            finally:
                os.close(fd)
            os.rename(tmp, self.name, src_dir_fd=self.dirfd, dst_dir_fd=self.dirfd)
        except OSError:
            pass  # records are for display; a full disk must not stop the GPU work

    def close(self) -> None:
        if self.dirfd is None:
            return
        with contextlib.suppress(OSError):
            os.unlink(self.name, dir_fd=self.dirfd)
        os.close(self.dirfd)
        self.dirfd = None


def _record_files(dirfd: int) -> list[str]:
    try:
        return [n for n in os.listdir(dirfd) if n.endswith(".json") and not n.startswith(".")]
    except OSError:
        return []


def _read_record(dirfd: int, name: str) -> Record | None:
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dirfd)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        return Record.parse(os.read(fd, _MAX_RECORD))
    except OSError:
        return None
    finally:
        os.close(fd)


def _alive(rec: Record) -> bool:
    return starttime(rec.pid) == rec.starttime


def _sweep_stale(dirfd: int) -> None:
    for name in _record_files(dirfd):
        rec = _read_record(dirfd, name)
        if rec is None or not _alive(rec):
            try:
                os.unlink(name, dir_fd=dirfd)
            except OSError:
                pass  # somebody else's, or already gone


@dataclass
class Row:
    """One line of ``who``."""

    pid: int
    state: str
    name: str
    command: str
    strategy: str
    since: float | None
    child_pid: int | None
    member: bool  # False: joined without vramlock (flock(1), a C program) or exited

    def as_json(self, now: float) -> dict[str, Any]:
        data = asdict(self)
        data["seconds_in_state"] = None if self.since is None else round(now - self.since, 3)
        return data


def _foreign_row(pid: int, state: str) -> Row:
    comm = text(pid, "comm")
    return Row(
        pid=pid,
        state=state,
        name=comm or "(exited)",
        command=text(pid, "cmdline"),
        strategy="-",
        since=None,
        child_pid=None,
        member=False,
    )


def snapshot(arena: Arena) -> list[Row]:
    """Residents first, then waiters in queue order, then the rest."""
    text = read_proc_locks()

    def entries(name: str) -> list[LockEntry]:
        try:
            st = os.stat(name, dir_fd=arena.dirfd, follow_symlinks=False)
        except OSError:
            return []
        return parse_proc_locks(text, st.st_dev, st.st_ino)

    token, want = entries(TOKEN), entries(WANT)
    holders = [e.pid for e in token if not e.blocked]
    queued = [e.pid for e in token if e.blocked]
    wanting = [e.pid for e in want if not e.write]

    records: dict[int, Record] = {}
    dirfd = arena.members_dir(create=False)
    if dirfd is not None:
        try:
            for name in _record_files(dirfd):
                rec = _read_record(dirfd, name)
                if rec is not None and _alive(rec):
                    records[rec.pid] = rec
        finally:
            os.close(dirfd)

    def row(pid: int, kernel_state: str | None) -> Row:
        rec = records.pop(pid, None)
        if rec is None:
            return _foreign_row(pid, kernel_state or "?")
        state = rec.state
        if kernel_state == "resident" and state not in ("resident", "releasing", "restoring"):
            state = "resident"
        elif kernel_state == "waiting" and state != "waiting":
            state = "waiting"
        return Row(
            pid=rec.pid,
            state=state,
            name=rec.name,
            command=" ".join(rec.command),
            strategy=rec.strategy,
            since=rec.since,
            child_pid=rec.child_pid,
            member=True,
        )

    rows: list[Row] = []
    seen: set[int] = set()
    for pid, kstate in [(p, "resident") for p in holders] + [
        (p, "waiting") for p in queued + wanting
    ]:
        if pid not in seen:
            seen.add(pid)
            rows.append(row(pid, kstate))
    rest = sorted(records.values(), key=lambda r: STATES.index(r.state) if r.state in STATES else 9)
    rows.extend(row(rec.pid, None) for rec in rest)
    return rows
