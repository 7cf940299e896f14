"""The wrapped command: spawn it in a process group of its own, signal it, reap it."""

from __future__ import annotations

import contextlib
import errno
import os
import select
import signal
import time

from .errors import CommandNotExecutable, CommandNotFound

# Python ignores these; an exec'd program must start with the defaults, as under a shell.
_RESET_SIGNALS = (signal.SIGPIPE, signal.SIGXFSZ)


def exit_code(status: int) -> int:
    """A wait status as a shell reports it: the exit code, or 128+N for signal N."""
    code = os.waitstatus_to_exitcode(status)
    return 128 - code if code < 0 else code


class Child:
    """One run of the command. ``respawn()`` starts it again with the same arguments."""

    def __init__(self, argv: list[str], env: dict[str, str], pass_fds: tuple[int, ...]) -> None:
        self.argv = argv
        self.env = env
        self.pass_fds = pass_fds
        self.pid = 0
        self.pidfd: int | None = None
        self.status: int | None = None
        self.spawn()

    def spawn(self) -> None:
        # posix_spawn rather than fork: no at-fork handlers run, so the
        # descriptors we pass on purpose (the token, the control socket) survive.
        for fd in self.pass_fds:
            os.set_inheritable(fd, True)
        try:
            self.pid = os.posix_spawnp(
                self.argv[0], self.argv, self.env, setpgroup=0, setsigdef=_RESET_SIGNALS
            )
        except OSError as err:
            raise self._spawn_error(err) from None
        except ValueError:  # posix_spawnp refuses an empty program name (execvp: ENOENT)
            raise CommandNotFound(repr(self.argv[0]), "command not found") from None
        finally:
            for fd in self.pass_fds:
                os.set_inheritable(fd, False)
        self.status = None
        try:
            self.pidfd = os.pidfd_open(self.pid)
        except OSError:
            self.pidfd = None  # kernel < 5.3: poll with a timeout instead

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
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                pid, status = self.pid, 0
            if pid:
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
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, sig)

    def terminate(self, grace: float) -> int | None:
        """SIGTERM the process group, SIGKILL it after ``grace`` seconds, reap the leader."""
        if self.poll() is None:
            self.signal_group(signal.SIGTERM)
            self.signal_group(signal.SIGCONT)  # a stopped group cannot act on SIGTERM
            if self.wait(grace) is None:
                self.kill()
        return self.status

    def kill(self) -> int | None:
        self.signal_group(signal.SIGKILL)
        status = self.wait(None)
        return status

    def reap_group(self) -> None:
        """Kill what is left of the group after the leader is gone (GPU-holding grandchildren)."""
        self.signal_group(signal.SIGKILL)

    def close(self) -> None:
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None
