"""The keeper of a stopped command (``--release stop``).

While the command is stopped and the token is somebody else's, the command must
never run. But if the wrapper dies, the kernel resumes an orphaned process group
that has stopped members (SIGHUP, then SIGCONT), and a command that ignores
SIGHUP would compute without the token. So while stopped, two small processes
keep the group from being orphaned:

- the keeper: a child of the wrapper, in a process group of its own, same session;
- the sentinel: the keeper's child, moved into the command's process group.

The group is not orphaned while one of its members (the sentinel) has a parent
in another group of the same session (the keeper). The keeper reads a pipe from
the wrapper: ``d`` (the token is ours again) ends both; end-of-file (the wrapper
died while the command was stopped) makes it SIGKILL the command's group first.

Run as a script (``python -S -E keeper.py PGID CONTROL_FD READY_FD``): stdlib only.
"""

from __future__ import annotations

import os
import signal
import sys
import time

# Signals the keeper and the sentinel must survive: they are sent to the command's
# group (forwarded by the wrapper) or from the keyboard, and the group must stay held.
_IGNORED = (
    signal.SIGINT,
    signal.SIGTERM,
    signal.SIGHUP,
    signal.SIGQUIT,
    signal.SIGUSR1,
    signal.SIGUSR2,
    signal.SIGTSTP,
    signal.SIGTTIN,
    signal.SIGTTOU,
    signal.SIGPIPE,
)
START_TIMEOUT = 10.0


def _sentinel(pgid: int, ready_fd: int) -> None:
    try:
        os.setpgid(0, pgid)
    except OSError:
        os.write(ready_fd, b"e")
        os._exit(1)
    os.write(ready_fd, b"r")
    os.close(ready_fd)
    while True:
        signal.pause()


def main() -> None:
    pgid, control_fd, ready_fd = (int(a) for a in sys.argv[1:4])
    for sig in _IGNORED:
        signal.signal(sig, signal.SIG_IGN)
    sentinel = os.fork()  # single-threaded here: a plain fork is safe
    if sentinel == 0:
        os.close(control_fd)
        _sentinel(pgid, ready_fd)
    os.close(ready_fd)
    try:
        word = os.read(control_fd, 1)
    except OSError:
        word = b""
    if word != b"d":
        # The wrapper is gone while the command is stopped without the token.
        try:
            os.killpg(pgid, signal.SIGKILL)
        except OSError:
            pass
    try:
        os.kill(sentinel, signal.SIGKILL)
    except OSError:
        pass
    os.waitpid(sentinel, 0)


class Keeper:
    """The wrapper's side: start it, then ``disarm`` once the token is ours again."""

    def __init__(self, pid: int, sentinel: int, control_w: int) -> None:
        self.pid = pid
        self.sentinel = sentinel
        self.pids = {pid, sentinel}
        self._control_w = control_w

    @classmethod
    def start(cls, pgid: int) -> Keeper:
        """Start the keeper for the stopped group ``pgid``; returns once the group is held."""
        from ..errors import StrategyError

        control_r, control_w = os.pipe2(os.O_CLOEXEC)
        ready_r, ready_w = os.pipe2(os.O_CLOEXEC)
        argv = [sys.executable, "-S", "-E", __file__, str(pgid), str(control_r), str(ready_w)]
        for fd in (control_r, ready_w):
            os.set_inheritable(fd, True)
        try:
            pid = os.posix_spawn(sys.executable, argv, dict(os.environ), setpgroup=0)
        except OSError as err:
            for fd in (control_r, control_w, ready_r, ready_w):
                os.close(fd)
            raise StrategyError(f"cannot start the keeper of the stopped command: {err}") from None
        os.close(control_r)
        os.close(ready_w)
        try:
            word = _read_within(ready_r, START_TIMEOUT)
        finally:
            os.close(ready_r)
        sentinel = _only_child(pid)
        keeper = cls(pid, sentinel or pid, control_w)
        if word != b"r" or sentinel is None:
            keeper.disarm()
            raise StrategyError("the keeper of the stopped command could not hold its group")
        return keeper

    def disarm(self) -> None:
        """The token is ours again (or the run is over): end the keeper, not the command."""
        try:
            os.write(self._control_w, b"d")
        except OSError:
            pass
        os.close(self._control_w)
        end = time.monotonic() + START_TIMEOUT
        while time.monotonic() < end:
            try:
                pid, _ = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                return
            if pid:
                return
            time.sleep(0.001)
        os.kill(self.pid, signal.SIGKILL)
        os.waitpid(self.pid, 0)


def _read_within(fd: int, timeout: float) -> bytes:
    import select

    ready, _, _ = select.select([fd], [], [], timeout)
    return os.read(fd, 1) if ready else b""


def _only_child(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/task/{pid}/children", "rb") as f:
            kids = f.read().split()
    except OSError:
        return None
    return int(kids[0]) if kids else None


if __name__ == "__main__":
    main()
