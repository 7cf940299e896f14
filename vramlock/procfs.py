"""Process facts from /proc: state, start time, owner, process group, the tree, /proc/locks.

Display and supervision helpers only: no lock decision is ever taken from /proc
(pids in /proc/locks are the locker's, and listings are not snapshots).
This module must stay cheap to import: ``who`` uses it without the lock layer.
"""

from __future__ import annotations

import os
import signal

_MAX_PROC_LOCKS = 4 * 1024 * 1024
_READ_ATTEMPTS = 4

# Field indexes in proc_stat()'s list (fields after the command name, state first).
_STATE, _PPID, _PGRP, _SESSION = 0, 1, 2, 3
_STARTTIME, _VSIZE = 19, 20
_STARTCODE, _ENDCODE, _STARTSTACK = 23, 24, 25
_LAYOUT = (_VSIZE, _STARTCODE, _ENDCODE, _STARTSTACK)


def proc_stat(pid: int) -> list[str] | None:
    """/proc/PID/stat's fields after the command name (state first), or None if gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    # comm may contain spaces and parentheses: split after the last ')'.
    return data[data.rfind(b")") + 2 :].decode(errors="replace").split()


def _field(pid: int, index: int) -> str | None:
    fields = proc_stat(pid)
    if fields is None or len(fields) <= index:
        return None
    return fields[index]


def _int_field(pid: int, index: int) -> int | None:
    raw = _field(pid, index)
    try:
        return None if raw is None else int(raw)
    except ValueError:
        return None


def state(pid: int) -> str | None:
    """The one-letter state (R, S, D, T, t, Z, X...), or None when the pid is gone."""
    return _field(pid, _STATE)


def starttime(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (field 22 of /proc/PID/stat)."""
    return _int_field(pid, _STARTTIME)


def layout(pid: int) -> tuple[int, ...] | None:
    """The size of the process's address space, and where its program's code and its
    stack are (fields 23 and 26-28), or None if gone: the size changes with every
    mapping made or dropped, the rest with every exec (the kernel lays each program out
    anew, at random places). Zero where its memory is not ours to read."""
    fields = proc_stat(pid)
    try:
        return None if fields is None else tuple(int(fields[i]) for i in _LAYOUT)
    except (IndexError, ValueError):
        return None


def pgrp(pid: int) -> int | None:
    return _int_field(pid, _PGRP)


def ppid(pid: int) -> int | None:
    return _int_field(pid, _PPID)


def session(pid: int) -> int | None:
    return _int_field(pid, _SESSION)


def stopped(pid: int) -> bool:
    """Stopped, gone, or sure to stop before it runs another instruction of its own: a
    SIGSTOP is pending (a parent blocked in vfork() until its stopped child execs
    stays in D with the stop pending until then)."""
    if state(pid) in ("T", "t", "Z", "X", None):
        return True
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            lines = f.read().splitlines()
    except OSError:
        return True
    stop = 1 << (signal.SIGSTOP - 1)  # its bit in the pending masks
    for line in lines:
        if line.startswith((b"SigPnd:", b"ShdPnd:")) and int(line.split()[1], 16) & stop:
            return True
    return False


def uid(pid: int) -> int | None:
    """The real uid of ``pid`` (the owner of its /proc directory), or None if gone."""
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return None


def living(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie (a zombie holds no locks and runs nothing)."""
    return state(pid) not in (None, "Z", "X")


def alive(pid: int, start: int) -> bool:
    """True while the process ``pid`` that started at ``start`` (see ``starttime``) lives.

    A pid and a start time name one process for ever; a zombie counts as gone.
    """
    fields = proc_stat(pid)
    return (
        fields is not None
        and len(fields) > _STARTTIME
        and fields[_STATE] not in ("Z", "X")
        and fields[_STARTTIME] == str(start)
    )


def ended(pid: int, start: int) -> bool:
    """Has the process ``pid`` that started at ``start`` ended, every thread of it? A
    leader that exits before its other threads shows as a zombie while they still run,
    holding the process's descriptors (its locks too): that is no end yet."""
    if alive(pid, start):
        return False
    if starttime(pid) != start:
        return True  # gone (reaped), or its pid names another process now
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return True
    return all(_task_state(pid, t) in (None, "Z", "X") for t in tasks)


def _task_state(pid: int, task: str) -> str | None:
    try:
        with open(f"/proc/{pid}/task/{task}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    rest = data[data.rfind(b")") + 2 :].split()
    return rest[0].decode() if rest else None


def all_pids() -> list[int]:
    try:
        return [int(n) for n in os.listdir("/proc") if n.isdigit()]
    except OSError:
        return []


def descriptors(pid: int) -> list[str]:
    """The paths (/proc/PID/fd/N) of the open descriptors of ``pid``: none where its
    descriptors are not ours to list (another user's, or it has gone)."""
    try:
        return [f"/proc/{pid}/fd/{fd}" for fd in os.listdir(f"/proc/{pid}/fd")]
    except OSError:
        return []


def group_pids(pgid: int) -> list[int]:
    """Every living process whose process group is ``pgid`` (zombies left out)."""
    out = []
    for pid in all_pids():
        fields = proc_stat(pid)
        if fields is None or len(fields) <= _PGRP or fields[_STATE] in ("Z", "X"):
            continue
        if fields[_PGRP] == str(pgid):
            out.append(pid)
    return out


def children(pid: int) -> list[int]:
    """Direct children of ``pid`` (every thread's), from /proc/PID/task/*/children."""
    found: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/children", "rb") as f:
                found += [int(k) for k in f.read().split()]
        except (OSError, ValueError):
            continue
    return found


def descendants(pid: int) -> list[int]:
    """Children, grandchildren, ... of ``pid``, parents before their children."""
    out: list[int] = []
    todo = children(pid)
    while todo:
        kid = todo.pop(0)
        if kid in out:
            continue
        out.append(kid)
        todo += children(kid)
    return out


def mapped(pid: int) -> set[str] | None:
    """The paths of the files ``pid`` has mapped (its libraries); None when it is gone or
    not ours to read (a setuid or non-dumpable program's)."""
    try:
        with open(f"/proc/{pid}/maps", "rb") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    # ADDRESS PERMS OFFSET DEV INODE PATH, the path possibly with spaces
    fields = (line.split(maxsplit=5) for line in lines)
    return {f[5].decode(errors="replace") for f in fields if len(f) == 6 and f[5][:1] == b"/"}


def environ(pid: int) -> dict[str, str]:
    """The environment ``pid`` was started with; empty when it is gone or not ours. A name
    given twice has its first value, the one the C library's getenv reads."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            raw = f.read()
    except OSError:
        return {}
    found: dict[str, str] = {}
    for entry in raw.split(b"\0"):
        name, eq, value = entry.decode(errors="replace").partition("=")
        if eq:
            found.setdefault(name, value)
    return found


def text(pid: int, what: str, limit: int = 4096) -> str:
    """``comm`` or ``cmdline`` (arguments joined by spaces), at most ``limit`` bytes read."""
    try:
        with open(f"/proc/{pid}/{what}", "rb") as f:
            raw = f.read(limit)
    except OSError:
        return ""
    if what == "cmdline":
        return " ".join(part.decode(errors="replace") for part in raw.split(b"\0") if part)
    return raw.decode(errors="replace").strip()


class LockEntry:
    """One FLOCK entry of /proc/locks: the locker, exclusive or shared, granted or waiting."""

    __slots__ = ("blocked", "pid", "write")

    def __init__(self, pid: int, write: bool, blocked: bool) -> None:
        self.pid = pid
        self.write = write
        self.blocked = blocked

    def __repr__(self) -> str:
        return f"LockEntry(pid={self.pid}, write={self.write}, blocked={self.blocked})"


def parse_proc_locks(listing: str, dev: int, ino: int) -> list[LockEntry]:
    """The FLOCK entries on one inode, holders and blocked waiters in kernel order."""
    want = (os.major(dev), os.minor(dev), ino)
    out: list[LockEntry] = []
    for line in listing.splitlines():
        fields = line.split()
        if len(fields) < 6:
            continue
        blocked = fields[1] == "->"
        f = fields[2:] if blocked else fields[1:]
        if len(f) < 5 or f[0] != "FLOCK":
            continue
        try:
            major, minor, inode = f[4].split(":")
            key = (int(major, 16), int(minor, 16), int(inode))
            pid = int(f[3])
        except ValueError:
            continue
        if key == want:
            out.append(LockEntry(pid=pid, write=f[2] == "WRITE", blocked=blocked))
    return out


def byte_locks_held(listing: str, dev: int, ino: int, below: int) -> int:
    """How many bytes under ``below`` of one inode granted OFD byte-range locks cover (a
    budget's units taken: each resident holds its own bytes, so none is counted twice;
    its claim bytes lie far above)."""
    want = (os.major(dev), os.minor(dev), ino)
    total = 0
    for line in listing.splitlines():
        f = line.split()[1:]
        if len(f) < 7 or f[0] != "OFDLCK":
            continue  # blocked ("->") entries and other kinds of lock
        try:
            major, minor, inode = f[4].split(":")
            key = (int(major, 16), int(minor, 16), int(inode))
            start, end = int(f[5]), int(f[6])
        except ValueError:
            continue
        if key == want and start < below:
            total += min(end, below - 1) - start + 1
    return total


def _read_proc_locks_once() -> tuple[bytes, bool]:
    """The listing, and whether it came in one read (one read is one snapshot)."""
    try:
        fd = os.open("/proc/locks", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return b"", True
    try:
        chunks = [os.read(fd, _MAX_PROC_LOCKS)]
        size = len(chunks[0])
        while chunks[-1] and size < _MAX_PROC_LOCKS:
            chunks.append(os.read(fd, _MAX_PROC_LOCKS))
            size += len(chunks[-1])
        return b"".join(chunks), len(chunks) <= 2
    except OSError:
        return b"", True
    finally:
        os.close(fd)


def read_proc_locks() -> str:
    """/proc/locks, as near to one snapshot as the kernel allows.

    One read returns at most about a page (a few dozen locks), and the listing is
    regenerated between reads: read across pages under churn, it shows phantom
    double holders or misses some. A listing that takes more than one read is
    therefore read again, until two readings agree (at most a few times).
    """
    previous = None
    for _ in range(_READ_ATTEMPTS):
        listing, whole = _read_proc_locks_once()
        if whole or listing == previous:
            break
        previous = listing
    return listing.decode(errors="replace")


def lock_holders(dev: int, ino: int) -> list[int]:
    """Living processes with a descriptor whose open file description holds a flock on the file.

    /proc/locks names only the process that called flock; this finds everyone who
    shares the lock, from the ``lock:`` lines of /proc/PID/fdinfo. Only processes
    whose descriptors we may inspect (our own, or all as root) are found. Slow: a
    stat of every open descriptor on the machine.
    """
    found: list[int] = []
    for pid in all_pids():
        for path in descriptors(pid):
            try:
                st = os.stat(path)
                if (st.st_dev, st.st_ino) != (dev, ino):
                    continue
                with open(path.replace("/fd/", "/fdinfo/", 1), "rb") as f:
                    info = f.read().decode(errors="replace")
            except OSError:
                continue
            locks = "\n".join(
                line[len("lock:") :] for line in info.splitlines() if line.startswith("lock:")
            )
            if any(not e.blocked for e in parse_proc_locks(locks, dev, ino)) and living(pid):
                found.append(pid)
                break
    return found


def marked(name: str, value: str) -> list[int]:
    """Every living process started with ``name=value`` in its environment (those whose
    environment is ours to read: our own user's, not a setuid program's). Slow: a read
    of every process's environment."""
    want = f"{name}={value}".encode()
    found = []
    for pid in all_pids():
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                raw = f.read()
        except OSError:
            continue
        if want in raw.split(b"\0") and living(pid):
            found.append(pid)
    return found
