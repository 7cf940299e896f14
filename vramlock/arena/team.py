"""Team arenas: one arena that the members of a Unix group share, and nobody else enters.

Made by root (``vramlock arena --arena PATH --group GROUP``), and owned by root so that
no member can unlink or replace what the protocol relies on:

- the directory, ``root:GROUP 0750``: the group may enter and read, nobody else may,
  and nobody but root may add, remove or rename the lock files in it;
- ``token.lock`` and ``want.lock``, ``root:GROUP 0640``: members lock them through
  read-only descriptors (flock needs no write access); a budget's ``capacity.lock``
  ``0660`` (its units are write byte locks);
- ``members/`` and ``journal/``, ``root:GROUP 1770``: each member writes files of its
  own there, and the sticky bit keeps everybody else from removing or replacing them.

Nobody can pass off a record or a journal line as another user's: each is believed
only when its file belongs to the uid it names, and a member's files are writable by
it alone (0644). A member can still fill its own files with nonsense, or plant a file
under another user's name before that user first writes (whose journal lines then go
unwritten): what it writes is marked unverified, never believed.
"""

from __future__ import annotations

import contextlib
import errno
import grp
import os
import stat

from ..errors import ArenaError, UsageError
from .budget import CAPACITY
from .directory import MEMBERS, TOKEN, WANT
from .journal import JOURNAL

DIR_MODE = 0o750
LOCK_MODE = 0o640
CAPACITY_MODE = 0o660
SHARED_MODE = 0o1770

_OPEN = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def group_id(group: str) -> int:
    """The gid of ``group`` (a name or a number); UsageError when there is none."""
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        if group.isascii() and group.isdigit():
            return int(group)
        raise UsageError(f"--group: no group {group!r}") from None


def _own(fd: int, gid: int, mode: int) -> None:
    os.fchown(fd, 0, gid)
    os.fchmod(fd, mode)


def _file(dirfd: int, name: str, shown: str, gid: int, mode: int, *, create: bool) -> None:
    try:
        fd = os.open(name, _OPEN | os.O_RDONLY | (os.O_CREAT if create else 0), mode, dir_fd=dirfd)
    except FileNotFoundError:
        return  # an optional file (the budget's) that is not there
    except OSError as err:
        raise ArenaError(shown, f"cannot be made a team file: {err.strerror}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ArenaError(shown, "is not a regular file")
        _own(fd, gid, mode)
    finally:
        os.close(fd)


def _shared_dir(dirfd: int, name: str, shown: str, gid: int) -> None:
    with contextlib.suppress(FileExistsError):
        os.mkdir(name, SHARED_MODE, dir_fd=dirfd)
    try:
        fd = os.open(name, _DIR, dir_fd=dirfd)
    except OSError as err:
        raise ArenaError(shown, f"cannot be made a team directory: {err.strerror}") from None
    try:
        _own(fd, gid, SHARED_MODE)
    finally:
        os.close(fd)


def make(path: str | None, group: str) -> None:
    """Make ``path`` (created if need be, its parent must exist) a team arena of ``group``.

    UsageError without a path, unless run as root, or for an unknown group; ArenaError
    for a path that is not a directory (a symbolic link included) or cannot be changed."""
    if not path:
        raise UsageError("--group: name the team arena's directory with --arena PATH")
    if os.geteuid() != 0:
        raise UsageError(
            "--group: only root can make a team arena (root owns it, so that no member"
            " can replace its files)"
        )
    gid = group_id(group)
    try:
        os.mkdir(path, DIR_MODE)
    except FileExistsError:
        pass
    except OSError as err:
        raise ArenaError(path, f"cannot be created: {err.strerror}") from None
    try:
        dirfd = os.open(path, _DIR)
    except OSError as err:
        why = "is not a directory" if err.errno in (errno.ENOTDIR, errno.ELOOP) else err.strerror
        raise ArenaError(path, f"{why} (a symbolic link is not followed)") from None
    try:
        _own(dirfd, gid, DIR_MODE)
        for name in (TOKEN, WANT):
            _file(dirfd, name, os.path.join(path, name), gid, LOCK_MODE, create=True)
        _file(dirfd, CAPACITY, os.path.join(path, CAPACITY), gid, CAPACITY_MODE, create=False)
        for name in (MEMBERS, JOURNAL):
            _shared_dir(dirfd, name, os.path.join(path, name), gid)
    finally:
        os.close(dirfd)
