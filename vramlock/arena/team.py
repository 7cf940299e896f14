"""Team arenas: one arena that the members of a Unix group share, and nobody else enters.

Made by root (``vramlock arena --arena PATH --group GROUP``), and owned by root so that
no member can unlink or replace what the protocol relies on. Made, never adopted: a lock
file works through any descriptor of it (flock needs no write access, and the
descriptor outlives a chown), so only a new directory, or an empty one of root's, gets
lock files, new ones; a directory that is already the group's team arena is left as it
is, and any other is refused. Inside:

- the directory, ``root:GROUP 0750``: the group may enter and read, nobody else may,
  and nobody but root may add, remove or rename the lock files in it;
- ``token.lock`` and ``want.lock``, ``root:GROUP 0640``: members lock them through
  read-only descriptors (flock needs no write access); a budget's ``capacity.lock``
  ``0660`` (its units are write byte locks);
- ``members/`` and ``journal/``, ``root:GROUP 1770``: each member writes files of its
  own there, and the sticky bit keeps everybody else from removing or replacing them.

Nobody can pass off a record or a journal line as another user's: each is believed
only when its file belongs to the uid it names, and a member's files are writable by
it alone (0644), and a journal line counts only for a member of its file's owner. A
member can still fill its own files with nonsense (marked unverified where it claims
another uid), or plant a file under another user's name before that user first writes:
it is never read as that user's (its owner is not the uid it names), and that user's
journal lines then go unwritten. A planted older file (``UID.jsonl.1``) only makes that
user's journal start again at its cap instead of rotating.
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


def _new_file(dirfd: int, name: str, shown: str, gid: int, mode: int) -> None:
    """A new lock file (O_EXCL: a new inode, nobody else's descriptor), the group's."""
    try:
        fd = os.open(name, _OPEN | os.O_RDONLY | os.O_CREAT | os.O_EXCL, 0o600, dir_fd=dirfd)
    except OSError as err:
        raise ArenaError(shown, f"cannot be made a team file: {err.strerror}") from None
    try:
        _own(fd, gid, mode)
    finally:
        os.close(fd)


def _capacity(dirfd: int, gid: int) -> None:
    """A budget's ``capacity.lock`` (root's already: see ``_state``) opened to the group:
    its units are write byte locks."""
    try:
        fd = os.open(CAPACITY, _OPEN | os.O_RDONLY, dir_fd=dirfd)
    except OSError:
        return  # none: no budget
    try:
        if stat.S_ISREG(os.fstat(fd).st_mode):
            _own(fd, gid, CAPACITY_MODE)
    finally:
        os.close(fd)


def _shared_dir(dirfd: int, name: str, shown: str, gid: int) -> None:
    with contextlib.suppress(FileExistsError):
        os.mkdir(name, 0o700, dir_fd=dirfd)
    try:
        fd = os.open(name, _DIR, dir_fd=dirfd)
    except OSError as err:
        raise ArenaError(shown, f"cannot be made a team directory: {err.strerror}") from None
    try:
        _own(fd, gid, SHARED_MODE)
    finally:
        os.close(fd)


# What an earlier ``arena --group`` of the group made: each name's kind and mode.
_MADE = {TOKEN: (stat.S_IFREG, LOCK_MODE), WANT: (stat.S_IFREG, LOCK_MODE),
         MEMBERS: (stat.S_IFDIR, SHARED_MODE), JOURNAL: (stat.S_IFDIR, SHARED_MODE)}  # fmt: skip


def _state(dirfd: int, gid: int) -> str | None:
    """``"empty"``: a directory of root's that nobody else may write, with nothing in it;
    ``"made"``: a team arena of ``gid`` as an earlier ``make`` left it (root's
    throughout, only the group may enter); None: anything else, whose files other users
    may hold open (a descriptor outlives a chown, and flock needs no more)."""
    st = os.fstat(dirfd)
    if st.st_uid != 0 or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return None
    names = os.listdir(dirfd)
    if not names:
        return "empty"
    if (st.st_gid, stat.S_IMODE(st.st_mode)) != (gid, DIR_MODE) or not set(_MADE) <= set(names):
        return None
    for name in names:
        entry = os.stat(name, dir_fd=dirfd, follow_symlinks=False)
        kind, mode = _MADE.get(name, (stat.S_IFREG, None))
        if entry.st_uid != 0 or stat.S_IFMT(entry.st_mode) != kind:
            return None
        if mode is not None and (entry.st_gid, stat.S_IMODE(entry.st_mode)) != (gid, mode):
            return None
    return "made"


def _open(path: str) -> int:
    try:
        os.mkdir(path, 0o700)  # root's alone until it is made
    except FileExistsError:
        pass
    except OSError as err:
        raise ArenaError(path, f"cannot be created: {err.strerror}") from None
    try:
        return os.open(path, _DIR)
    except OSError as err:
        why = "is not a directory" if err.errno in (errno.ENOTDIR, errno.ELOOP) else err.strerror
        raise ArenaError(path, f"{why} (a symbolic link is not followed)") from None


def make(path: str | None, group: str) -> None:
    """Make ``path`` a team arena of ``group``: a new directory (its parent must exist),
    or an empty one of root's, gets new lock files; one that is already the group's
    team arena is left as it is; any other is refused, since other users may hold its
    files open.

    UsageError without a path, unless run as root, or for an unknown group; ArenaError
    for a path that is not a directory (a symbolic link included), is refused or cannot
    be changed."""
    if not path:
        raise UsageError("--group: name the team arena's directory with --arena PATH")
    if os.geteuid() != 0:
        raise UsageError(
            "--group: only root can make a team arena (root owns it, so that no member"
            " can replace its files)"
        )
    gid = group_id(group)
    dirfd = _open(path)
    try:
        found = _state(dirfd, gid)
        if found is None:
            raise ArenaError(
                path,
                f"already exists and is neither an empty directory of root's nor a team arena"
                f" of {group}: other users may hold its files open (a descriptor outlives a"
                " chown); remove it, or name a new directory",
            )
        if found == "empty":
            os.fchmod(dirfd, 0o700)  # nobody else in while it is made
            for name in (TOKEN, WANT):
                _new_file(dirfd, name, os.path.join(path, name), gid, LOCK_MODE)
            for name in (MEMBERS, JOURNAL):
                _shared_dir(dirfd, name, os.path.join(path, name), gid)
        _capacity(dirfd, gid)
        _own(dirfd, gid, DIR_MODE)
    finally:
        os.close(dirfd)
