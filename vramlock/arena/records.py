"""Members' self-description records: ``<arena>/members/<pid>-<starttime>.json``.

A record says who a member is (name, command, strategy, child) and which state it
believes it is in. Records are for display, like /proc/locks: nothing in
vramlock's safety decides from them, and no state change waits for one. The one
use beyond display: a budget waiter picks whom to ask to step aside from them,
where a false record makes a worse choice and nothing else. A member changes
state in memory; a daemon thread writes the latest state a few milliseconds later,
so a burst of changes (a handoff) costs one write, after the token has moved.

The file name, not the content, says whose record a file is: ``<pid>-<starttime>``
names one process for ever. Sweeping judges by the name alone, so a record that
cannot be read (oversized, garbage) is never taken for a dead member's.

This module must stay cheap to import: ``who`` uses it without the lock layer.
"""

from __future__ import annotations

import contextlib
import enum
import json
import math
import os
import stat
import threading
import time

from .. import procfs
from .directory import Arena

TYPE_CHECKING = False  # typing's, without importing typing (~3 ms); mypy takes it as True
if TYPE_CHECKING:
    from typing import Any

RECORD_VERSION = 1
MAX_RECORD = 64 * 1024  # readers ignore larger files; writers clip to stay well below
_CLIP_NAME = 256
_CLIP_COMMAND = 4096  # characters, as much as who reads of a /proc/PID/cmdline
_LATEST_SINCE = 1e11  # Unix time in the year 5138: anything later is garbage
_MAX_PID = 1 << 22  # the kernel's PID_MAX_LIMIT
_MAX_LEFTOVERS = 64
_MAX_GPU = 1 << 16  # shown at most; a record stays well under MAX_RECORD
_MAX_UNIT = 4096  # a budget's units at most: its record stays well under MAX_RECORD

# How long the writer lets a burst of changes settle before it writes: the next holder
# gets the CPU first, a handoff is one write, and a member that changes state thousands
# of times a second writes at most 50 times a second. A 20 ms lag is invisible in `who`.
# A change budget waiters choose by is written without settling: a budget resident that
# starts or stops working (twice a request at most) or gives up its units.
_SETTLE = 0.02

# O_EXCL and a random name: never open, truncate or follow what somebody planted
# (a FIFO there would block the open; O_NONBLOCK makes sure nothing ever does).
_TMP_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY


class State(enum.Enum):
    """A member's state: WAITING -> RESIDENT -> RELEASING -> RELEASED -> WAITING, and
    RESTORING between owning the token again and being usable."""

    WAITING = "waiting"
    RESIDENT = "resident"
    RELEASING = "releasing"
    RELEASED = "released"
    RESTORING = "restoring"


# The states in which a member holds the token.
HOLDING = frozenset({State.RESIDENT.value, State.RELEASING.value, State.RESTORING.value})


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not a number")


def _typed(value: Any, kind: type[Any] | tuple[type[Any], ...]) -> Any:
    # bool is an int to isinstance, and never what a record means.
    if not isinstance(value, kind) or isinstance(value, bool):
        raise TypeError("wrong type")
    return value


def _flag(value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError("wrong type")
    return value


def _bounded(value: Any, low: int, high: int) -> int:
    number: int = _typed(value, int)
    if not low <= number <= high:
        raise ValueError("out of range")
    return number


def _time(value: Any) -> float | None:
    """A time or a duration in seconds: finite, not negative, and not absurd."""
    if value is None:
        return None
    number = float(_typed(value, (int, float)))
    if not (math.isfinite(number) and 0 <= number < _LATEST_SINCE):
        raise ValueError("out of range")
    return number


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _clip_command(command: list[str], limit: int) -> list[str]:
    out: list[str] = []
    for arg in command:
        if len(arg) > limit:
            out.append(_clip(arg, max(limit, 1)))
            break
        out.append(arg)
        limit -= len(arg)
    return out


class Record:
    """What a member says about itself.

    Its fields are ``FIELDS``, in the order a record's JSON has them; a record file holds
    every one (``dump``), and ``parse`` needs only the first six.
    """

    # units, vram, vram_from, busy, used, hold_until, yield_within: a budget arena's. The
    # capacity units it holds while resident, its footprint in bytes and where that comes
    # from, whether it is working now (a request in flight, a job running), when it last
    # worked (Unix time), until when its minimum hold keeps it resident (Unix time), and
    # how long it may put a release off while busy (seconds; None: until its work is
    # done). Budget waiters choose whom to ask to step aside from these; a false value can
    # only make that choice worse, never put two members on one unit.
    # released_in, restored_in: how long its last release took (releasing to released)
    # and its last restore (restoring to resident), in seconds: ``who``'s SWITCH.
    FIELDS = (
        "pid", "name", "command", "strategy", "state", "since", "starttime", "child_pid",
        "uid", "version", "leftovers", "listen", "connections", "gpus", "units", "vram",
        "vram_from", "busy", "used", "hold_until", "yield_within", "token_ino", "note",
        "released_in", "restored_in",
    )  # fmt: skip
    __slots__ = FIELDS

    def __init__(
        self,
        pid: int,
        name: str,
        command: list[str],
        strategy: str,
        state: str,
        since: float,  # wall-clock seconds (time.time()) when the state began
        *,
        starttime: int = 0,
        child_pid: int | None = None,
        uid: int | None = None,  # None: our effective uid
        version: int = RECORD_VERSION,
        leftovers: list[int] | None = None,
        listen: str | None = None,
        connections: int | None = None,
        gpus: list[int] | None = None,
        units: list[int] | None = None,
        vram: int | None = None,
        vram_from: str | None = None,
        busy: bool = False,
        used: float | None = None,
        hold_until: float | None = None,
        yield_within: float | None = None,
        token_ino: int | None = None,
        note: str | None = None,
        released_in: float | None = None,
        restored_in: float | None = None,
    ) -> None:
        self.pid = pid
        self.name = name
        self.command = command
        self.strategy = strategy
        self.state = state
        self.since = since
        self.starttime = starttime
        self.child_pid = child_pid
        self.uid = os.geteuid() if uid is None else uid
        self.version = version
        # Processes the command left running when it exited, being ended before the token goes.
        self.leftovers = [] if leftovers is None else leftovers
        # --demand listen: the address clients connect to, and how many connections are open.
        self.listen = listen
        self.connections = connections
        # --gpu with several GPUs: all of them, in the order given (the member is in each arena).
        self.gpus = [] if gpus is None else gpus
        self.units = [] if units is None else units
        self.vram = vram
        self.vram_from = vram_from  # "declared", "measured", or "whole budget" (not yet measured)
        self.busy = busy
        self.used = used
        self.hold_until = hold_until
        self.yield_within = yield_within
        # The inode of the token.lock the member locks: who tells when it is not the arena's.
        self.token_ino = token_ino
        # What ``who`` should add about the member (the swap library writes one for a
        # released process whose ``vramlock run`` is gone).
        self.note = note
        self.released_in = released_in
        self.restored_in = restored_in

    @classmethod
    def parse(cls, raw: bytes) -> Record | None:
        """A record from JSON, or None for anything else (wrong types, NaN, absurd numbers)."""
        try:
            data = json.loads(raw, parse_constant=_reject_constant)
            _typed(data, dict)
            since = float(_typed(data["since"], (int, float)))
            if not (math.isfinite(since) and 0 <= since < _LATEST_SINCE):
                return None
            child = data.get("child_pid")
            listen, connections = data.get("listen"), data.get("connections")
            vram, vram_from = data.get("vram"), data.get("vram_from")
            used, hold_until = _time(data.get("used")), _time(data.get("hold_until"))
            yield_within = _time(data.get("yield_within"))
            token_ino = data.get("token_ino")
            note = data.get("note")
            return cls(
                pid=_bounded(data["pid"], 1, _MAX_PID),
                name=_typed(data["name"], str),
                command=[_typed(c, str) for c in _typed(data["command"], list)],
                strategy=_typed(data["strategy"], str),
                state=_typed(data["state"], str),
                since=since,
                starttime=_bounded(data.get("starttime", 0), 0, 1 << 63),
                child_pid=None if child is None else _bounded(child, 1, _MAX_PID),
                uid=_bounded(data.get("uid", -1), -1, (1 << 32) - 1),
                leftovers=[
                    _bounded(p, 1, _MAX_PID)
                    for p in _typed(data.get("leftovers", []), list)[:_MAX_LEFTOVERS]
                ],
                listen=None if listen is None else _typed(listen, str),
                connections=None if connections is None else _bounded(connections, 0, 1 << 31),
                gpus=[_bounded(g, 0, _MAX_GPU) for g in _typed(data.get("gpus", []), list)[:64]],
                units=[
                    _bounded(u, 0, _MAX_UNIT)
                    for u in _typed(data.get("units", []), list)[:_MAX_UNIT]
                ],
                vram=None if vram is None else _bounded(vram, 0, 1 << 62),
                vram_from=None if vram_from is None else _typed(vram_from, str),
                busy=_flag(data.get("busy", False)),
                used=used,
                hold_until=hold_until,
                yield_within=yield_within,
                token_ino=None if token_ino is None else _bounded(token_ino, 0, 1 << 64),
                note=None if note is None else _typed(note, str),
                released_in=_time(data.get("released_in")),
                restored_in=_time(data.get("restored_in")),
            )
        except (ValueError, TypeError, KeyError, RecursionError):
            return None

    def dump(self) -> bytes:
        """JSON, with the free text clipped so that the file always fits ``MAX_RECORD``."""
        data = {name: getattr(self, name) for name in self.FIELDS}
        data["name"] = _clip(self.name, _CLIP_NAME)
        data["strategy"] = _clip(self.strategy, _CLIP_NAME)
        data["listen"] = None if self.listen is None else _clip(self.listen, _CLIP_NAME)
        data["command"] = _clip_command(self.command, _CLIP_COMMAND)
        data["leftovers"] = self.leftovers[:_MAX_LEFTOVERS]
        data["gpus"] = self.gpus[:64]
        data["units"] = self.units[:_MAX_UNIT]
        data["note"] = None if self.note is None else _clip(self.note, _CLIP_NAME)
        data["vram_from"] = None if self.vram_from is None else _clip(self.vram_from, _CLIP_NAME)
        return json.dumps(data, allow_nan=False).encode()


def record_name(pid: int, start: int) -> str:
    return f"{pid}-{start}.json"


def _owner_of(name: str) -> tuple[int, int] | None:
    """(pid, starttime) named by a record (``P-S.json``) or a temporary file (``.P-S.*.tmp``)."""
    if name.startswith(".") and name.endswith(".tmp"):
        stem = name[1:].split(".", 1)[0]
    elif name.endswith(".json"):
        stem = name[: -len(".json")]
    else:
        return None
    pid, _, start = stem.partition("-")
    if not (pid.isascii() and pid.isdigit() and start.isascii() and start.isdigit()):
        return None
    key = (int(pid), int(start))
    return key if stem == f"{key[0]}-{key[1]}" else None  # one spelling: no leading zeros


def _listdir(dirfd: int) -> list[str]:
    try:
        return os.listdir(dirfd)
    except OSError:
        return []


def sweep(dirfd: int) -> None:
    """Remove the records and temporary files of processes that are gone, judged by name."""
    for name in _listdir(dirfd):
        owner = _owner_of(name)
        if owner is not None and not procfs.alive(*owner):
            try:
                os.unlink(name, dir_fd=dirfd)
            except OSError:
                pass  # somebody else's, or already gone


def _read(dirfd: int, name: str) -> tuple[Record, int] | None:
    """The record in ``name`` and the file's owner; None for anything but a small regular file."""
    try:
        fd = os.open(name, _READ_FLAGS, dir_fd=dirfd)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_RECORD:
            return None
        rec = Record.parse(os.read(fd, MAX_RECORD + 1))
        return None if rec is None else (rec, st.st_uid)
    except OSError:
        return None
    finally:
        os.close(fd)


def read_live(dirfd: int) -> list[tuple[Record, bool]]:
    """The records of living processes, each with whether it is trusted.

    A record is read only when its file name names a living process, and kept only
    when its content names the same one. It is trusted when the file's owner, the
    uid it states and the owner of the process all agree: anybody who may write in
    ``members/`` could otherwise speak for somebody else's process.
    """
    out: list[tuple[Record, bool]] = []
    for name in _listdir(dirfd):
        owner = _owner_of(name)
        if owner is None or name.startswith(".") or not procfs.alive(*owner):
            continue
        found = _read(dirfd, name)
        if found is None or (found[0].pid, found[0].starttime) != owner:
            continue
        rec, file_uid = found
        out.append((rec, file_uid == rec.uid == procfs.uid(rec.pid)))
    return out


class RecordWriter:
    """Keeps one member's record current from a daemon thread; never raises, never blocks.

    ``update`` changes the record in memory and wakes the writer, which writes the
    latest version once changes have settled for a few milliseconds (``update_at_once``:
    without settling). ``flush`` writes it now. Silent when the arena has no
    usable ``members/``.
    """

    def __init__(self, arena: Arena, record: Record) -> None:
        self.record = record
        self.record.starttime = procfs.starttime(record.pid) or 0
        self.name = record_name(record.pid, record.starttime)
        self.dirfd = arena.members_dir(create=True)
        self._changed = threading.Condition()
        self._version = 0  # bumped by every update
        self._written = -1  # the version on disk (or that failed to get there)
        self._stop = threading.Event()
        self._hurry = threading.Event()  # cuts the settling short: at_once, or close
        self._io = threading.Lock()  # one write at a time, so an older one never lands last
        self._thread: threading.Thread | None = None
        if self.dirfd is None:
            return
        sweep(self.dirfd)
        self.flush()  # at once: who shows a member from the start
        self._thread = threading.Thread(target=self._run, name="vramlock-record", daemon=True)
        self._thread.start()

    def update(self, **changes: Any) -> None:
        """Change the record in memory; it reaches the disk soon after."""
        self.change(changes, False)

    def update_at_once(self, **changes: Any) -> None:
        """``update``, written as soon as the writer may: a change budget waiters choose
        by, where a stale record makes them ask the wrong resident."""
        self.change(changes, True)

    def change(self, changes: dict[str, Any], at_once: bool) -> None:
        """``update`` or ``update_at_once`` with the changes as a dict."""
        with self._changed:
            if "state" in changes:
                self._timed(changes["state"])
            for key, value in changes.items():
                setattr(self.record, key, value)
            self._version += 1
            if at_once:
                self._hurry.set()
            self._changed.notify()

    def _timed(self, new: str) -> None:
        """The new state's ``since``, and how long a release or restore that ends took."""
        now, old = time.time(), self.record.state
        if old == State.RELEASING.value and new == State.RELEASED.value:
            self.record.released_in = max(0.0, now - self.record.since)
        elif old == State.RESTORING.value and new == State.RESIDENT.value:
            self.record.restored_in = max(0.0, now - self.record.since)
        self.record.since = now

    def flush(self) -> None:
        """Write the latest version now (if it is not on disk yet)."""
        with self._io:
            with self._changed:
                if self.dirfd is None or self._written == self._version:
                    return
                version, data = self._version, self.record.dump()
            self._store(self.dirfd, data)
            with self._changed:
                # Even after a failure: records are for display, the next change retries.
                self._written = version

    def _due(self) -> bool:
        return self._stop.is_set() or self._written != self._version

    def _run(self) -> None:
        while True:
            with self._changed:
                self._changed.wait_for(self._due)
            self._hurry.wait(_SETTLE)
            self._hurry.clear()  # a change made after this is in the flush below
            if self._stop.is_set():
                return
            self.flush()

    def _store(self, dirfd: int, data: bytes) -> None:
        tmp = f".{self.name[: -len('.json')]}.{os.urandom(6).hex()}.tmp"
        try:
            fd = os.open(tmp, _TMP_FLAGS, 0o644, dir_fd=dirfd)
        except OSError:
            return  # full, read-only, or a name somebody planted: skip this version
        ours = os.fstat(fd)
        try:
            complete = os.write(fd, data) == len(data)
        except OSError:
            complete = False
        finally:
            os.close(fd)
        try:
            if complete:
                os.rename(tmp, self.name, src_dir_fd=dirfd, dst_dir_fd=dirfd)
                return
        except OSError:
            pass
        with contextlib.suppress(OSError):  # remove our temporary file, if it is still ours
            now = os.stat(tmp, dir_fd=dirfd, follow_symlinks=False)
            if (now.st_dev, now.st_ino) == (ours.st_dev, ours.st_ino):
                os.unlink(tmp, dir_fd=dirfd)

    def close(self) -> None:
        """Stop the writer and remove the record."""
        self._stop.set()
        self._hurry.set()
        with self._changed:
            self._changed.notify()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        with self._io:
            if self.dirfd is None:
                return
            with contextlib.suppress(OSError):
                os.unlink(self.name, dir_fd=self.dirfd)
            os.close(self.dirfd)
            self.dirfd = None
