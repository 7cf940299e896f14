"""Where an arena lives, and opening it safely.

An arena is a directory shared by everyone contending for one GPU. It holds the
two lock files of the protocol (``token.lock``, ``want.lock``), created once and
never deleted, and a ``members/`` directory of self-description records that
``who`` merges with the kernel's lock state.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Sequence

from ..errors import ArenaError, UnsupportedFilesystem, UsageError

TOKEN = "token.lock"
WANT = "want.lock"
MEMBERS = "members"
JOURNAL = "journal"

ENV_ARENA = "VRAMLOCK_ARENA"
ENV_ARENAS_DIR = "VRAMLOCK_ARENAS_DIR"

# statfs f_type values where flock(2) is not a local advisory lock: NFS turns it
# into whole-file POSIX locks, CIFS/SMB make it mandatory, FUSE is up to the daemon.
_REMOTE_FS = {
    0x6969: "NFS",
    0xFF534D42: "CIFS",
    0xFE534D42: "SMB2",
    0x517B: "SMB",
    0x65735546: "FUSE",
}


def default_gpu() -> int:
    """The GPU index of the default arena: CUDA_VISIBLE_DEVICES when it names one index
    (checked as ``--gpu`` is), else 0."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    if not (visible.isascii() and visible.isdigit()):
        return 0
    return parse_gpus(visible, "CUDA_VISIBLE_DEVICES")[0]


# More GPUs than any host has: a longer list is a typo, not a machine.
MAX_GPUS = 64


def parse_gpus(text: str, option: str = "--gpu") -> tuple[int, ...]:
    """GPU numbers from ``N`` or ``N,M,...``, in the order given, duplicates dropped."""
    out: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not (part.isascii() and part.isdigit()) or len(part) > 6:
            raise UsageError(
                f"{option}: expected a GPU number or a comma-separated list of them"
                f" (0 or 0,1), got {text!r}"
            )
        if int(part) not in out:
            out.append(int(part))
    if len(out) > MAX_GPUS:
        raise UsageError(f"{option}: {len(out)} GPUs named; at most {MAX_GPUS}")
    return tuple(out)


def one_arena_or_gpus(arena: str | None, gpus: Sequence[int | None]) -> None:
    """``--arena`` names one arena: it cannot stand for several GPUs."""
    if arena and len(gpus) > 1:
        raise UsageError(
            "--arena names one arena; --gpu with several GPUs uses each one's default arena"
        )


def default_base() -> str:
    """Where the default arenas (``gpu<N>``) are: VRAMLOCK_ARENAS_DIR, else
    ``$XDG_RUNTIME_DIR/vramlock``, else ``/tmp/vramlock-$UID``."""
    given = os.environ.get(ENV_ARENAS_DIR)
    if given:
        return os.path.abspath(given)
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime:
        return os.path.join(runtime, "vramlock")
    return f"/tmp/vramlock-{os.geteuid()}"


def locate(arena: str | None = None, gpu: int | None = None) -> tuple[str, bool]:
    """Return (path, is_default): ``arena``, else ``gpu``'s default arena, else VRAMLOCK_ARENA."""
    if arena:
        return os.path.abspath(arena), False
    env = os.environ.get(ENV_ARENA)
    if gpu is None and env:
        return os.path.abspath(env), False
    index = default_gpu() if gpu is None else gpu
    return os.path.join(default_base(), f"gpu{index}"), True


def _fs_type(fd: int) -> int:
    import ctypes  # here: the short commands pay for it only when they open an arena

    libc = ctypes.CDLL(None, use_errno=True)
    fstatfs = libc.fstatfs
    fstatfs.argtypes = [ctypes.c_int, ctypes.c_void_p]
    fstatfs.restype = ctypes.c_int
    buf = ctypes.create_string_buffer(256)  # struct statfs is 120 bytes on 64-bit Linux
    if fstatfs(fd, buf) != 0:
        return 0
    # f_type is the first member, a machine word; the magic numbers fit in 32 bits.
    return ctypes.c_ulong.from_buffer(buf).value & 0xFFFFFFFF


def _open_dir(path: str) -> int:
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as err:
        if err.errno == errno.ENOENT:
            from shlex import quote

            why = f"does not exist (an arena is a directory you make: mkdir -m 700 {quote(path)})"
            raise ArenaError(path, why) from None
        if err.errno == errno.ENOTDIR:
            # O_NOFOLLOW|O_DIRECTORY on a symlink to a directory also says ENOTDIR.
            if os.path.islink(path):
                raise ArenaError(path, "is a symbolic link (refusing to follow it)") from None
            raise ArenaError(path, "is not a directory") from None
        if err.errno == errno.ELOOP:
            raise ArenaError(path, "is a symbolic link (refusing to follow it)") from None
        if err.errno in (errno.EACCES, errno.EPERM):
            raise ArenaError(path, "permission denied") from None
        raise ArenaError(path, err.strerror or str(err)) from None


def _check_dir(fd: int, path: str, *, private: bool) -> os.stat_result:
    st = os.fstat(fd)
    me = os.geteuid()
    if st.st_uid not in (me, 0):
        raise ArenaError(path, f"is owned by uid {st.st_uid}, not by you or root")
    if st.st_mode & stat.S_IWOTH:
        raise ArenaError(path, "is world-writable; anyone could replace its lock files")
    if private and st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise ArenaError(path, "is group-writable; the default arena must be private")
    kind = _REMOTE_FS.get(_fs_type(fd))
    if kind is not None:
        raise UnsupportedFilesystem(path, kind)
    return st


# What only an arena holds (budget.py's three files too): a directory with none of these
# is one only while it is empty.
_ARENA_NAMES = frozenset({TOKEN, WANT, MEMBERS, JOURNAL, "budget", "capacity.lock", "queue.lock"})


def _check_arena(fd: int, path: str) -> None:
    """An explicit path must be an arena already, or an empty directory to become one: the
    parent of an arena, or any other directory a mistyped path names, is refused."""
    names = os.listdir(fd)
    if names and _ARENA_NAMES.isdisjoint(names):
        from shlex import quote

        # Never offered as an arena itself: a directory of other files (/etc, a home) is
        # more likely a slip than a wish. The parent of an arena names its arena.
        below = _arena_below(fd, sorted(names))
        hint = (
            f"--arena {quote(os.path.join(path, below))}?"
            if below is not None
            else "an arena is a directory of its own: mkdir -m 700 a new one"
        )
        raise ArenaError(
            path,
            f"is not an arena (it holds other files, and no token.lock): a mistyped path? {hint}",
        )


def _arena_below(fd: int, names: list[str], most: int = 64) -> str | None:
    """The first of (up to ``most`` of) ``names`` that is a directory holding a token.lock."""
    for name in names[:most]:
        try:
            os.stat(os.path.join(name, TOKEN), dir_fd=fd, follow_symlinks=False)
        except OSError:
            continue
        return name
    return None


def _ensure_private_dir(path: str) -> None:
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as err:
        raise ArenaError(path, f"cannot be created: {err.strerror}") from None


_SUBDIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def open_subdir(dirfd: int, name: str, create: bool) -> int | None:
    """A descriptor of the arena's directory ``name`` (made first, when ``create``), or None
    when there is none we may use: a link is not followed, and a world-writable one counts
    only with the sticky bit (else anyone could remove or replace what we write there)."""
    if create:
        with contextlib.suppress(OSError):
            os.mkdir(name, 0o755, dir_fd=dirfd)
    try:
        fd = os.open(
            name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dirfd
        )
    except OSError:
        return None
    st = os.fstat(fd)
    if st.st_mode & stat.S_IWOTH and not st.st_mode & stat.S_ISVTX:
        os.close(fd)
        return None
    return fd


class Arena:
    """An opened arena directory. Files inside are opened relative to ``dirfd``."""

    __slots__ = ("_closed", "dirfd", "owner", "path")

    def __init__(self, path: str, dirfd: int, owner: int) -> None:
        self.path = path
        self.dirfd = dirfd
        self.owner = owner
        self._closed = False

    def __repr__(self) -> str:
        return f"Arena(path={self.path!r}, dirfd={self.dirfd}, owner={self.owner})"

    @classmethod
    def open(cls, arena: str | None = None, gpu: int | None = None, adopt: bool = False) -> Arena:
        """Open the arena; the default per-GPU arena is created, an explicit one must exist.

        An explicit arena is never created: a mistyped path would otherwise make a
        second arena, and two programs would both believe they own the GPU. Nor does an
        explicit directory that holds other files become one, unless ``adopt`` (``vramlock
        arena``, which makes arenas on purpose).
        """
        path, is_default = locate(arena, gpu)
        if is_default:
            base = os.path.dirname(path)
            _ensure_private_dir(base)
            basefd = _open_dir(base)
            try:
                _check_dir(basefd, base, private=True)
            finally:
                os.close(basefd)
            _ensure_private_dir(path)
        fd = _open_dir(path)
        try:
            st = _check_dir(fd, path, private=is_default)
            if not (is_default or adopt):
                _check_arena(fd, path)
        except BaseException:
            os.close(fd)
            raise
        return cls(path=path, dirfd=fd, owner=st.st_uid)

    def shown(self, name: str) -> str:
        return os.path.join(self.path, name)

    @property
    def allowed_owners(self) -> set[int]:
        return {os.geteuid(), self.owner, 0}

    def members_dir(self, create: bool) -> int | None:
        """A descriptor of ``members/``, or None when there is none we may use."""
        return open_subdir(self.dirfd, MEMBERS, create)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            os.close(self.dirfd)
