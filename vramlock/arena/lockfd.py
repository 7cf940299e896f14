"""Lock descriptors: the one module that opens lock files and calls flock(2).

Everything here works on descriptors vramlock opened itself. portalocker is the
lock layer, used only through its ``FlockLocker`` on those descriptors: never its
module-global locker (another library may switch it to ``lockf``) and never its
path-opening ``Lock`` class (it follows symlinks and polls). portalocker 4 binds
``fcntl.flock`` in ``FlockLocker`` itself; 3.x looked the module global up.

Every flock result is triaged here, once: granted; held (``EAGAIN``/``EACCES``/
``EWOULDBLOCK``, non-blocking only); ``EINTR``, retried; anything else, a
``LockError`` naming the file.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import signal
import stat
import struct
import sys
import threading
import time
from types import FrameType
from typing import TYPE_CHECKING

from ..errors import ArenaError, LockError, LockFileReplaced

if TYPE_CHECKING:
    from portalocker.constants import LockFlags
    from portalocker.portalocker import FlockLocker

# errno values that mean "somebody else holds it"; anything else is a real error.
HELD_ERRNOS = frozenset({errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK})

# O_NOFOLLOW: a symlink planted at a lock path must not redirect us (filelock CVEs).
# O_NONBLOCK: a FIFO planted there must not hang the open; fstat rejects it after.
# O_CLOEXEC: a lock belongs to the open file description, so an exec'd program
#   must not keep it alive by accident; the runner passes the token on purpose.
# No O_TRUNC, ever: lock files are created once and never truncated or unlinked,
#   or waiters would split across inodes.
_OPEN_FLAGS = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY

# Descriptors we hold locks through, and the path each is shown as. A forked child
# closes them without unlocking: LOCK_UN from the child would release the parent's
# lock, and keeping them open would let the child keep the parent's lock alive
# after it dies.
_OWNED: dict[int, str] = {}
_OWNED_GUARD = threading.Lock()


def _close_inherited() -> None:
    for fd in list(_OWNED):
        with contextlib.suppress(OSError):
            os.close(fd)
    _OWNED.clear()


os.register_at_fork(after_in_child=_close_inherited)


def _describe_open_error(err: OSError) -> str:
    if err.errno == errno.ELOOP:
        return "is a symbolic link (refusing to follow it)"
    if err.errno == errno.EISDIR:
        return "is a directory"
    if err.errno == errno.ENXIO:
        return "is a FIFO or socket"
    if err.errno == errno.ENOENT:
        return "does not exist and cannot be created here"
    if err.errno in (errno.EACCES, errno.EPERM):
        return "permission denied"
    return err.strerror or str(err)


def open_lock_file(dirfd: int, name: str, shown: str, *, allowed_owners: set[int]) -> int:
    """Open (creating it if need be) the lock file ``name`` in the directory ``dirfd``.

    ``shown`` is the path used in messages. Falls back to a read-only descriptor
    when the file exists but is not writable: exclusive flock works on those, and
    that is how members of a root-owned team arena open it.
    """
    try:
        fd = os.open(name, _OPEN_FLAGS | os.O_RDWR | os.O_CREAT, 0o644, dir_fd=dirfd)
    except OSError as err:
        if err.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
            raise ArenaError(shown, _describe_open_error(err)) from None
        try:
            fd = os.open(name, _OPEN_FLAGS | os.O_RDONLY, dir_fd=dirfd)
        except OSError as err2:
            if err2.errno == errno.ENOENT:
                why = _describe_open_error(err)
                raise ArenaError(shown, f"does not exist and cannot be created ({why})") from None
            raise ArenaError(shown, _describe_open_error(err2)) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ArenaError(shown, "is not a regular file")
        if st.st_uid not in allowed_owners:
            raise ArenaError(shown, f"is owned by uid {st.st_uid}, not by you or the arena's owner")
        if st.st_mode & stat.S_IWOTH:
            raise ArenaError(shown, "is world-writable; anyone could replace the lock")
    except BaseException:
        os.close(fd)
        raise
    with _OWNED_GUARD:
        _OWNED[fd] = shown
    return fd


def adopt(fd: int, shown: str) -> None:
    """Treat an inherited descriptor (``wait --fd``) as one we lock through."""
    with _OWNED_GUARD:
        _OWNED[fd] = shown


def close(fd: int) -> None:
    """Close without unlocking: other copies of the open file description keep the lock."""
    with _OWNED_GUARD:
        _OWNED.pop(fd, None)
    os.close(fd)


def is_path_only(fd: int) -> bool:
    """An ``O_PATH`` descriptor names a file but cannot be locked (flock says EBADF)."""
    return bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_PATH)


def is_read_only(fd: int) -> bool:
    """Opened ``O_RDONLY`` (a team arena's files): flock works, write byte locks do not."""
    return fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDONLY


def still_linked(dirfd: int, name: str, fd: int) -> bool:
    """Does the path still name the file ``fd`` is open on? (Two system calls: cheap
    enough for every probe.)"""
    st = os.fstat(fd)
    try:
        now = os.stat(name, dir_fd=dirfd, follow_symlinks=False)
    except OSError:
        return False
    return st.st_nlink > 0 and (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino)


def check_still_linked(dirfd: int, name: str, fd: int, shown: str) -> None:
    """After locking: the path must still name our inode, or we locked a file nobody sees."""
    if not still_linked(dirfd, name, fd):
        raise LockFileReplaced(shown)


def reopen_lock_file(
    fd: int, dirfd: int, name: str, shown: str, *, allowed_owners: set[int]
) -> None:
    """Make ``fd`` a descriptor of the file the path names now (created if need be), in
    place: whoever was given the number (a command started again) gets the new file.
    Nothing must be locked through ``fd``; other copies of the old open file
    description keep it."""
    new = open_lock_file(dirfd, name, shown, allowed_owners=allowed_owners)
    try:
        os.dup2(new, fd, inheritable=False)
    finally:
        close(new)


def same_file(fd_a: int, fd_b: int) -> bool:
    """Do both descriptors name one inode? False when ``fd_a`` is not open."""
    try:
        a = os.fstat(fd_a)
    except OSError:
        return False
    b = os.fstat(fd_b)
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


_LOCKER: FlockLocker | None = None


def _locker() -> FlockLocker:
    # Imported at the first lock, not with this module: importing portalocker costs
    # about 17 ms (its __init__ reads its own version through importlib.metadata).
    global _LOCKER
    if _LOCKER is None:
        from portalocker.portalocker import FlockLocker

        _LOCKER = FlockLocker()
    return _LOCKER


def _flags(exclusive: bool, blocking: bool) -> LockFlags:
    from portalocker.constants import LockFlags

    flags = LockFlags.EXCLUSIVE if exclusive else LockFlags.SHARED
    return flags if blocking else flags | LockFlags.NON_BLOCKING


def _flock(fd: int, *, exclusive: bool, blocking: bool) -> bool:
    """The one flock call: True when granted, False when held (only when not blocking)."""
    return _flock_as(fd, _locker(), _flags(exclusive, blocking), blocking)


def _flock_as(fd: int, locker: FlockLocker, flags: LockFlags, blocking: bool) -> bool:
    from portalocker.exceptions import LockException

    while True:
        try:
            locker.lock(fd, flags)
            return True
        except LockException as exc:
            code = getattr(exc.__cause__, "errno", None) or errno.EIO
        if code == errno.EINTR:
            continue  # a signal whose handler returned: keep our place and wait on
        if code in HELD_ERRNOS and not blocking:
            return False
        raise LockError(_OWNED.get(fd, f"descriptor {fd}"), code)


def try_lock(fd: int, *, exclusive: bool) -> bool:
    """One non-blocking attempt; False when somebody else holds a conflicting lock."""
    return _flock(fd, exclusive=exclusive, blocking=False)


def conflicts(fd: int, *, exclusive: bool) -> bool:
    """Would a lock through ``fd`` conflict with somebody's? A try, undone at once."""
    if try_lock(fd, exclusive=exclusive):
        unlock(fd)
        return False
    return True


def lock(fd: int, *, exclusive: bool) -> None:
    """Block in the kernel until granted: kernel queue order, visible in /proc/locks."""
    _flock(fd, exclusive=exclusive, blocking=True)


def unlock(fd: int) -> None:
    """LOCK_UN: releases the lock for every descriptor sharing this open file description."""
    from portalocker.exceptions import LockException

    try:
        _locker().unlock(fd)
    except (LockException, OSError):  # portalocker before 4.2 raised the OSError itself
        pass  # EBADF after the descriptor went away: nothing is held through it


class _Deadline(Exception):
    pass


class _Alarm:
    """What the SIGALRM handler reads: plain attributes, each set in one step (a
    threading.Event's lock, taken when the alarm fell, was never given back: a hang)."""

    armed = False  # only between arming the timer and the flock's return
    handling: BaseException | None = None  # the exception being handled as the wait began


# After its first alarm the timer fires again every millisecond until the wait ends:
# an alarm that fell just before the flock entered the kernel, or where the handler
# must not raise, is followed by one that cuts the wait.
_REFIRE = 0.001


def _on_alarm(signum: int, frame: FrameType | None) -> None:
    # PEP 475 retries an interrupted flock unless the handler raises, so it raises -
    # but only inside the wait, and never where an exception is being handled (an
    # except or finally block, in the lock layer or the enum module, or the caller's
    # way out, such as vramlock run's SIGTERM): raised there, it would take that
    # exception's place.
    if _Alarm.armed and sys.exc_info()[1] is _Alarm.handling:
        raise _Deadline


def _timed_lock(fd: int, exclusive: bool, timeout: float) -> bool:
    # A blocking flock cut by SIGALRM is how flock(1) -w works: the waiter keeps
    # its place in the kernel's queue, which polling would lose. The lock layer is
    # imported and the flags made before the alarm is armed: an import the alarm
    # cut would stay half done.
    locker, flags = _locker(), _flags(exclusive, blocking=True)
    old_delay, old_interval = signal.getitimer(signal.ITIMER_REAL)
    old_handler = signal.signal(signal.SIGALRM, _on_alarm)
    _Alarm.handling = sys.exc_info()[1]
    try:
        try:
            _Alarm.armed = True
            signal.setitimer(signal.ITIMER_REAL, max(timeout, 1e-6), _REFIRE)
            _flock_as(fd, locker, flags, blocking=True)
            _Alarm.armed = False
            return True
        except _Deadline:
            _Alarm.armed = False
            # The alarm may have fallen just after the kernel granted the lock; a
            # non-blocking retry on the same description settles it either way.
            return try_lock(fd, exclusive=exclusive)
        finally:
            _Alarm.armed = False
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old_handler)
        _Alarm.handling = None
        if old_delay:
            signal.setitimer(signal.ITIMER_REAL, old_delay, old_interval)


# The longest interval timer every platform can set (a 32-bit time_t); longer is forever.
MAX_TIMEOUT = 2**31 - 1


def lock_within(fd: int, *, exclusive: bool, timeout: float | None) -> bool:
    """Lock, waiting at most ``timeout`` seconds (None: forever, 0: one attempt).

    In the main thread the wait blocks in the kernel and is cut by SIGALRM, so the
    waiter keeps its place in the kernel's queue. Other threads cannot take
    signals, so there a finite timeout falls back to polling. A timeout above
    ``MAX_TIMEOUT`` (68 years) is waiting forever.
    """
    if timeout is None or timeout > MAX_TIMEOUT:
        lock(fd, exclusive=exclusive)
        return True
    if timeout <= 0:
        return try_lock(fd, exclusive=exclusive)
    if threading.current_thread() is threading.main_thread():
        return _timed_lock(fd, exclusive, timeout)
    end = time.monotonic() + timeout
    pause = 0.0005
    while not try_lock(fd, exclusive=exclusive):
        left = end - time.monotonic()
        if left <= 0:
            return False
        time.sleep(min(pause, left))
        pause = min(pause * 2, 0.02)
    return True


def ring(dirfd: int, name: str) -> None:
    """Open and close ``name``: an inotify IN_OPEN that wakes holders sooner.

    Only a hint; holders decide from the want.lock probe. Opened read-only with
    the same no-follow, no-block flags, and never locked.
    """
    with contextlib.suppress(OSError):
        os.close(os.open(name, _OPEN_FLAGS | os.O_RDONLY, dir_fd=dirfd))


# -- open-file-description byte-range locks (a budget arena's units) -----------------
#
# F_OFD_SETLK locks belong to the open file description, as flock's do: closing
# another descriptor of the file does not drop them (fcntl/lockf record locks would
# be), and the kernel frees them when the last copy closes, SIGKILL included. On
# Linux they never interact with flock locks on the same file, so a byte lock on
# want.lock is invisible to every flock-only participant.

_FLOCK = struct.Struct("hhqqi4x")  # struct flock: l_type, l_whence, l_start, l_len, l_pid


def _range(kind: int, start: int, length: int) -> bytes:
    return _FLOCK.pack(kind, os.SEEK_SET, start, length, 0)  # l_pid must be 0 for OFD locks


def _fcntl_lock(fd: int, cmd: int, kind: int, start: int, length: int) -> bytes | None:
    """One fcntl lock call; the returned struct, or None when held (F_OFD_SETLK only)."""
    while True:
        try:
            result: bytes = fcntl.fcntl(fd, cmd, _range(kind, start, length))
            return result
        except OSError as err:
            if err.errno == errno.EINTR:
                continue
            if err.errno in HELD_ERRNOS and cmd == fcntl.F_OFD_SETLK:
                return None
            raise LockError(_OWNED.get(fd, f"descriptor {fd}"), err.errno or errno.EIO) from None


def try_lock_bytes(fd: int, start: int, length: int = 1, *, write: bool) -> bool:
    """Lock bytes [start, start+length) of ``fd``'s file for its open file description;
    False when another description holds a conflicting lock. Never blocks."""
    kind = fcntl.F_WRLCK if write else fcntl.F_RDLCK
    return _fcntl_lock(fd, fcntl.F_OFD_SETLK, kind, start, length) is not None


def unlock_bytes(fd: int, start: int, length: int = 1) -> None:
    _fcntl_lock(fd, fcntl.F_OFD_SETLK, fcntl.F_UNLCK, start, length)


def bytes_locked_elsewhere(fd: int, start: int, length: int = 1, *, write: bool) -> bool:
    """Would locking these bytes (a write lock: conflicts with any lock; a read lock:
    with write locks) conflict with another open file description? Locks nothing."""
    kind = fcntl.F_WRLCK if write else fcntl.F_RDLCK
    found = _fcntl_lock(fd, fcntl.F_OFD_GETLK, kind, start, length)
    return found is not None and _FLOCK.unpack(found)[0] != fcntl.F_UNLCK
