"""Errors raised by vramlock's library layers.

The command line turns each into one line on stderr and an exit status; the
library never prints and never exits.

    VramlockError                 exit 125: vramlock itself could not do its job
    ├── ArenaError                the arena or a lock file is unusable (path, reason)
    │   ├── UnsupportedFilesystem flock is emulated or mandatory there (fstype)
    │   └── LockFileReplaced      a lock file was removed or replaced under us
    ├── LockError                 flock(2) failed, not because the lock is held (path, errno)
    ├── StrategyError             a release strategy cannot be used or failed
    │   └── Immovable             the command's memory cannot be moved: it keeps the GPU
    ├── ControlError              the cooperative control channel broke its protocol
    ├── InvalidTransition         a member was told to change state in a way it may not
    ├── AddressError              --listen or --upstream cannot be used (option, address)
    ├── UsageError                exit 2: a bad value (duration, descriptor, option mix)
    ├── NotObtained               exit 1 (or -E): the token was not obtained in time
    └── CommandError              the command could not be started
        ├── CommandNotFound       exit 127
        └── CommandNotExecutable  exit 126
"""

from __future__ import annotations

import os
from errno import errorcode


class VramlockError(Exception):
    """Base of every error vramlock raises on purpose."""

    exit_status = 125


class ArenaError(VramlockError):
    """The arena directory or one of its files cannot be used safely."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"arena {path}: {reason}")
        self.path = path
        self.reason = reason


class UnsupportedFilesystem(ArenaError):
    """flock(2) is emulated (NFS) or mandatory (CIFS) or unreliable (FUSE) here."""

    def __init__(self, path: str, fstype: str) -> None:
        super().__init__(
            path, f"is on {fstype}, where flock is not a local advisory lock; use a local directory"
        )
        self.fstype = fstype


class LockFileReplaced(ArenaError):
    """The path no longer names the lock file we hold a descriptor of (removed, or
    replaced by another file): a lock on ours excludes nobody."""

    def __init__(self, path: str) -> None:
        super().__init__(
            path, "was removed or replaced while we locked it; never delete lock files"
        )


class LockError(VramlockError):
    """flock(2) failed for another reason than "somebody holds it" (ENOLCK, EIO, ...)."""

    def __init__(self, path: str, errno: int) -> None:
        name = errorcode.get(errno, str(errno))
        super().__init__(f"cannot lock {path}: {os.strerror(errno)} ({name})")
        self.path = path
        self.errno = errno


class StrategyError(VramlockError):
    """A release strategy is unknown, does not fit, or failed."""


class Immovable(StrategyError):
    """The command uses memory the strategy cannot move (managed memory, CUDA IPC, MPS,
    MIG): it was left running, and keeps the GPU until it exits."""


class ControlError(VramlockError):
    """The child broke the control-channel protocol."""


class InvalidTransition(VramlockError):
    """A member was told to go from one state to another that may not follow it (a bug
    in the caller): refused before ``who`` can show it."""

    def __init__(self, old: str, new: str) -> None:
        super().__init__(f"a member cannot go from {old} to {new}")
        self.old = old
        self.new = new


class AddressError(VramlockError):
    """An address given to ``--listen`` or ``--upstream`` cannot be resolved or listened on."""

    def __init__(self, option: str, address: str, reason: str) -> None:
        super().__init__(f"{option} {address}: {reason}")
        self.option = option
        self.address = address
        self.reason = reason


class UsageError(VramlockError):
    """A value given by the user is malformed."""

    exit_status = 2


class NotObtained(VramlockError):
    """The token was not obtained: ``-n`` found it held, or ``-w`` ran out."""

    exit_status = 1

    def __init__(self, timeout: float) -> None:
        what = "token is held" if timeout == 0 else f"token not obtained within {timeout:g} s"
        super().__init__(what)
        self.timeout = timeout


class CommandError(VramlockError):
    """The wrapped command could not be started."""

    def __init__(self, command: str, reason: str) -> None:
        super().__init__(f"{command}: {reason}")
        self.command = command


class CommandNotFound(CommandError):
    exit_status = 127


class CommandNotExecutable(CommandError):
    exit_status = 126
