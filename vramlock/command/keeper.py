"""The keeper of a stopped command (``--release stop``).

While the command is stopped and the token is somebody else's, the command must
never run. But if the wrapper dies, the kernel resumes an orphaned process group
that has stopped members (SIGHUP, then SIGCONT), and a command that ignores
SIGHUP would compute without the token. So while stopped, small processes keep
the command's groups from being orphaned:

- the keeper: a child of the wrapper, in a process group of its own, same session;
- a sentinel per process group of the command in that session: the keeper's
  child, moved into that group.

A group is not orphaned while one of its members (a sentinel) has a parent in
another group of the same session (the keeper). Groups in other sessions (a
worker that called setsid) cannot be orphaned by the wrapper's death, but they
must not outlive it stopped either. The keeper reads a pipe from the wrapper:
``d`` (the token is ours again) ends it and its sentinels; end-of-file (the
wrapper died while the command was stopped) makes it SIGKILL every stopped
process first, children before their parents (a parent that exits first could
orphan its child's group, which the kernel would resume), then the groups.

Run as a script (``python -S -E keeper.py CONTROL_FD READY_FD PGIDS PIDS``, the
lists comma-separated, PIDS children first): stdlib only.
"""

from __future__ import annotations

import errno
import os
import signal
import sys
import time
from collections.abc import Callable

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


def _ints(arg: str) -> list[int]:
    return [int(n) for n in arg.split(",") if n]


def _pin(pid: int) -> Callable[[], None]:
    """SIGKILL for ``pid`` later, through a pidfd where the kernel has them: the number
    of a process that somebody else ends meanwhile may be reused by then."""
    try:
        fd = os.pidfd_open(pid)
    except OSError as err:
        if err.errno != errno.ENOSYS:
            return lambda: None  # gone already
        return lambda: _quietly(os.kill, pid, signal.SIGKILL)
    return lambda: _quietly(signal.pidfd_send_signal, fd, signal.SIGKILL)


def _quietly(call: Callable[[int, int], None], target: int, sig: int) -> None:
    try:
        call(target, sig)
    except OSError:
        pass


def main() -> None:
    control_fd, ready_fd = int(sys.argv[1]), int(sys.argv[2])
    groups, pids = _ints(sys.argv[3]), _ints(sys.argv[4])
    for sig in _IGNORED:
        signal.signal(sig, signal.SIG_IGN)
    kills = [_pin(pid) for pid in pids]
    sentinels = []
    for pgid in groups:
        sentinel = os.fork()  # single-threaded here: a plain fork is safe
        if sentinel == 0:
            os.close(control_fd)
            _sentinel(pgid, ready_fd)
        sentinels.append(sentinel)
    os.close(ready_fd)
    try:
        word = os.read(control_fd, 1)
    except OSError:
        word = b""
    if word != b"d":
        # The wrapper is gone while the command is stopped without the token.
        for kill in kills:
            kill()
        for pgid in groups:
            _quietly(os.killpg, pgid, signal.SIGKILL)
    for sentinel in sentinels:
        _quietly(os.kill, sentinel, signal.SIGKILL)
        os.waitpid(sentinel, 0)


class Keeper:
    """The wrapper's side: start it, then ``disarm`` once the token is ours again."""

    def __init__(self, pid: int, sentinels: list[int], control_w: int) -> None:
        self.pid = pid
        self.pids = {pid, *sentinels}
        self._control_w = control_w

    @classmethod
    def start(cls, groups: list[int], pids: list[int]) -> Keeper:
        """Start the keeper of the stopped processes ``pids`` (children first), holding
        each of ``groups`` (our session's); returns once every group is held."""
        from ..errors import StrategyError

        control_r, control_w = os.pipe2(os.O_CLOEXEC)
        ready_r, ready_w = os.pipe2(os.O_CLOEXEC)
        argv = [sys.executable, "-S", "-E", __file__, str(control_r), str(ready_w),
                ",".join(map(str, groups)), ",".join(map(str, pids))]  # fmt: skip
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
            words = _read_within(ready_r, len(groups), START_TIMEOUT)
        finally:
            os.close(ready_r)
        sentinels = _children(pid)
        keeper = cls(pid, sentinels, control_w)
        if words != b"r" * len(groups) or len(sentinels) != len(groups):
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


def _read_within(fd: int, count: int, timeout: float) -> bytes:
    import select

    got, end = b"", time.monotonic() + timeout
    while len(got) < count:
        ready, _, _ = select.select([fd], [], [], max(0.0, end - time.monotonic()))
        word = os.read(fd, count - len(got)) if ready else b""
        if not word:
            break
        got += word
    return got


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children", "rb") as f:
            return [int(k) for k in f.read().split()]
    except OSError:
        return []


if __name__ == "__main__":
    main()
