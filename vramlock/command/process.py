"""The wrapped command: spawn it in a process group of its own, signal it, reap it."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import select
import shutil
import signal
import time
from collections.abc import Collection

from .. import procfs
from ..errors import CommandNotExecutable, CommandNotFound, StrategyError

# Python ignores these; an exec'd program must start with the defaults, as under a shell.
_RESET_SIGNALS = (signal.SIGPIPE, signal.SIGXFSZ)
# How often a wait for processes to be gone re-scans /proc.
_GONE_POLL = 0.005
_PR_SET_CHILD_SUBREAPER = 36
# A process tree deeper than this is taken to be no descendant of ours.
_MAX_DEPTH = 256


def become_subreaper() -> bool:
    """Adopt our orphaned descendants, so a worker whose parent exited (or that left the
    command's process group with setsid) is still ours to find, wait for and end."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        prctl = libc.prctl
    except (OSError, AttributeError):
        return False
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    prctl.restype = ctypes.c_int
    return bool(prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0)


def exit_code(status: int) -> int:
    """A wait status as a shell reports it: the exit code, or 128+N for signal N."""
    code = os.waitstatus_to_exitcode(status)
    return 128 - code if code < 0 else code


def _looks_like_text(command: str) -> bool:
    """A shell runs a file without #! as a script unless it looks binary (a NUL early on)."""
    path = command if "/" in command else shutil.which(command)
    try:
        with open(path or command, "rb") as f:
            return b"\0" not in f.read(512)
    except OSError:
        return False


def _tcsetpgrp(fd: int, pgid: int) -> None:
    # Changing the foreground group from outside it raises SIGTTOU: ignore it meanwhile.
    old = signal.signal(signal.SIGTTOU, signal.SIG_IGN)
    try:
        os.tcsetpgrp(fd, pgid)
    except OSError:
        pass
    finally:
        signal.signal(signal.SIGTTOU, old)


class Terminal:
    """The controlling terminal, when vramlock runs in its foreground.

    The command runs in a process group of its own (so strategies can signal its
    whole tree); like a shell, we make that group the terminal's foreground so the
    command can read the terminal and gets Ctrl-C and Ctrl-Z itself.
    """

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.pgid = 0

    @classmethod
    def if_foreground(cls) -> Terminal | None:
        try:
            if os.isatty(0) and os.tcgetpgrp(0) == os.getpgrp():
                return cls(0)
        except OSError:
            pass
        return None

    def _owner(self) -> int:
        try:
            return os.tcgetpgrp(self.fd)
        except OSError:
            return -1

    def give(self, pgid: int) -> None:
        """Hand the terminal to ``pgid`` if it is ours or our command's (never the shell's)."""
        if self._owner() in (os.getpgrp(), self.pgid):
            _tcsetpgrp(self.fd, pgid)
        self.pgid = pgid

    def take_back(self) -> None:
        if self.pgid and self._owner() == self.pgid:
            _tcsetpgrp(self.fd, os.getpgrp())

    def suspend_like_child(self) -> None:
        """The command was stopped from the keyboard: stop ourselves too, so the shell
        sees the job stopped; once continued (fg), give the terminal back."""
        self.take_back()
        os.kill(os.getpid(), signal.SIGSTOP)
        self.give(self.pgid)


class Child:
    """One run of the command. ``respawn()`` starts it again with the same arguments."""

    def __init__(
        self,
        argv: list[str],
        env: dict[str, str],
        pass_fds: tuple[int, ...],
        terminal: Terminal | None = None,
    ) -> None:
        self.argv = argv
        self.env = env
        self.pass_fds = pass_fds
        self.terminal = terminal
        self.pid = 0
        self.pidfd: int | None = None
        self.status: int | None = None
        self.stops: list[int] = []  # stop signals seen by waitpid(WUNTRACED), oldest first
        self.ignored: set[int] = set()  # our own helper processes, not the command's
        self.spawn()

    def spawn(self) -> None:
        # posix_spawn rather than fork: no at-fork handlers run, so the
        # descriptors we pass on purpose (the token, the control socket) survive.
        for fd in self.pass_fds:
            os.set_inheritable(fd, True)
        try:
            self.pid = self._spawn(self.argv)
        except OSError as err:
            if err.errno != errno.ENOEXEC or not _looks_like_text(self.argv[0]):
                raise self._spawn_error(err) from None
            # A script without #!: run it with sh, as execvp and shells do.
            try:
                self.pid = self._spawn(["/bin/sh", *self.argv])
            except OSError as err2:
                raise self._spawn_error(err2) from None
        except ValueError:  # posix_spawnp refuses an empty program name (execvp: ENOENT)
            raise CommandNotFound(repr(self.argv[0]), "command not found") from None
        finally:
            for fd in self.pass_fds:
                os.set_inheritable(fd, False)
        self.status = None
        self.stops.clear()
        if self.terminal is not None:
            self.terminal.give(self.pid)
        try:
            self.pidfd = os.pidfd_open(self.pid)
        except OSError:
            self.pidfd = None  # kernel < 5.3: poll with a timeout instead

    def _spawn(self, argv: list[str]) -> int:
        return os.posix_spawnp(argv[0], argv, self.env, setpgroup=0, setsigdef=_RESET_SIGNALS)

    def _spawn_error(self, err: OSError) -> Exception:
        cmd = self.argv[0]
        if err.errno == errno.ENOENT:
            return CommandNotFound(cmd, "command not found")
        if "/" in cmd and os.path.isdir(cmd):
            return CommandNotExecutable(cmd, "is a directory")
        if err.errno == errno.ENOEXEC:
            return CommandNotExecutable(cmd, "exec format error")
        return CommandNotExecutable(cmd, err.strerror or "cannot execute")

    @property
    def alive(self) -> bool:
        return self.poll() is None

    def poll(self) -> int | None:
        """The wait status once the command has exited (reaping it), else None."""
        if self.status is None and self.pid:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG | os.WUNTRACED)
            except ChildProcessError:
                pid, status = self.pid, 0
            if pid and os.WIFSTOPPED(status):
                self.stops.append(os.WSTOPSIG(status))
            elif pid:
                self.status = status
                if self.pidfd is not None:
                    os.close(self.pidfd)
                    self.pidfd = None
        return self.status

    def wait(self, timeout: float | None) -> int | None:
        """Wait up to ``timeout`` seconds (None: forever) for the exit; the status or None."""
        end = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            left = None if end is None else end - time.monotonic()
            if left is not None and left <= 0:
                return None
            step = 0.05 if left is None else min(0.05, left)
            if self.pidfd is not None:
                select.select([self.pidfd], [], [], step)
            else:
                time.sleep(min(step, 0.01))
        return self.status

    def signal_group(self, sig: int) -> None:
        """Signal the command's process group. StrategyError when we may not (EPERM: a
        setuid program): a strategy must not believe a command it cannot reach is ending."""
        try:
            os.killpg(self.pid, sig)
        except ProcessLookupError:
            pass  # nobody left in the group
        except PermissionError:
            raise StrategyError(
                f"cannot signal the command's process group {self.pid}: operation not"
                " permitted (a setuid program?)"
            ) from None

    def processes(self) -> list[int]:
        """Every living process of the command, parents before their children: whatever
        descends from us (we are a subreaper, so orphans that left the group are ours) and
        its process group, less our own helpers in ``ignored``. Zombies run nothing and
        are left out."""
        me = os.getpid()
        found = [p for p in procfs.descendants(me) if procfs.living(p)]
        if self.pid:
            found += [p for p in procfs.group_pids(self.pid) if p not in found]
        return [p for p in found if p != me and p not in self.ignored]

    def owns(self, pid: int) -> bool:
        """Is ``pid`` a living process of the command (as ``processes`` counts them)? A
        few reads of /proc for one pid, where ``processes`` reads every process's."""
        if pid in self.ignored or not procfs.living(pid):
            return False
        if self.pid and procfs.pgrp(pid) == self.pid:
            return True
        me, seen = os.getpid(), 0
        while pid > 1 and seen < _MAX_DEPTH:
            pid, seen = procfs.ppid(pid) or 0, seen + 1
            if pid == me:
                return True
        return False

    def reap_orphans(self) -> None:
        """Reap adopted descendants that have exited (never the command itself: poll() does)."""
        for pid in procfs.children(os.getpid()):
            if pid != self.pid and pid not in self.ignored and procfs.state(pid) == "Z":
                try:
                    os.waitpid(pid, os.WNOHANG)
                except ChildProcessError:
                    pass

    def signal_all(self, sig: int, pids: list[int]) -> None:
        """Signal the command's process group and each of ``pids`` (StrategyError: EPERM)."""
        self.signal_group(sig)
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
            except PermissionError:
                raise StrategyError(
                    f"cannot signal process {pid} of the command: operation not permitted"
                ) from None

    def wait_gone(self, timeout: float) -> list[int]:
        """Wait up to ``timeout`` seconds until no process of the command lives; the survivors."""
        end = time.monotonic() + timeout
        while True:
            self.poll()
            self.reap_orphans()
            left = self.processes()
            if not left or time.monotonic() >= end:
                return left
            time.sleep(_GONE_POLL)

    def end_all(
        self, grace: float, kill_wait: float = 5.0, stopped: Collection[int] = ()
    ) -> list[int]:
        """End every process of the command: SIGTERM (and SIGCONT, so a stopped one can act
        on it, unless it is to stay ``stopped``), SIGKILL after ``grace`` seconds, then wait
        up to ``kill_wait`` seconds. The survivors (a process in uninterruptible sleep);
        StrategyError when we may not signal.
        """
        left = self.processes()
        if not left:
            self.poll()
            return []
        self.signal_all(signal.SIGTERM, left)
        if stopped:  # one by one: the group's SIGCONT would reach them too
            for pid in left:
                if pid not in stopped:
                    with contextlib.suppress(OSError):
                        os.kill(pid, signal.SIGCONT)
        else:
            self.signal_all(signal.SIGCONT, left)
        left = self.wait_gone(grace)
        if left:
            self.signal_all(signal.SIGKILL, left)
            left = self.wait_gone(kill_wait)
        return left

    def close(self) -> None:
        if self.terminal is not None:
            self.terminal.take_back()
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None
