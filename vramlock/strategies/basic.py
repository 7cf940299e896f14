"""Strategies that need nothing from the command: none, restart, stop."""

from __future__ import annotations

import signal
import time

from ..procfs import proc_stat
from .base import ChildExited, ReleaseTimeout, Strategy

RESTART_GRACE = 10.0  # SIGTERM to SIGKILL when --yield-within is not given


class NoneStrategy(Strategy):
    """Hold the token until the command exits, as flock(1) does; waiters wait."""

    name = "none"
    releases = False


class RestartStrategy(Strategy):
    """Terminate the process group; start the command again when the token is back."""

    name = "restart"
    keeps_state = False

    def release(self, deadline: float | None) -> None:
        child = self.ctx.child
        child.signal_group(signal.SIGTERM)
        grace = RESTART_GRACE if deadline is None else max(0.0, deadline - time.monotonic())
        if child.wait(grace) is None:
            raise ReleaseTimeout
        child.reap_group()
        # The token is dropped only after the old process has been reaped.
        self.killed = True


class StopStrategy(Strategy):
    """SIGSTOP the process group: frees compute, not memory."""

    name = "stop"

    def release(self, deadline: float | None) -> None:
        child = self.ctx.child
        child.signal_group(signal.SIGSTOP)
        # Wait until the leader is really stopped (it may be inside a kernel call).
        while True:
            if not child.alive:
                raise ChildExited
            fields = proc_stat(child.pid)
            if fields and fields[0] in ("T", "t"):
                return
            if deadline is not None and time.monotonic() >= deadline:
                raise ReleaseTimeout
            time.sleep(0.001)

    def _restore(self) -> None:
        self.ctx.child.signal_group(signal.SIGCONT)
