"""``stop``: SIGSTOP the command, SIGCONT it on its turn (frees compute, not memory)."""

from __future__ import annotations

import os
import signal
import time

from ..command.keeper import Keeper
from ..procfs import pgrp, session
from ..procfs import stopped as is_stopped
from .base import ChildExited, Context, ReleaseTimeout, Settings, Strategy


class StopStrategy(Strategy):
    """SIGSTOP every process of the command: frees compute, not memory.

    A stopped command must never run without the token: not a worker that left the
    process group (setsid), and not the command should the wrapper die, when the
    kernel would resume an orphaned stopped group (SIGHUP + SIGCONT) and a command
    that ignores SIGHUP would compute. A keeper process holds the groups un-orphaned
    meanwhile and kills every stopped process should the wrapper die.
    """

    name = "stop"
    stops = True

    def __init__(self, ctx: Context, settings: Settings) -> None:
        super().__init__(ctx, settings)
        self.keeper: Keeper | None = None

    def release(self, deadline: float | None) -> None:
        child = self.ctx.child
        child.signal_group(signal.SIGSTOP)
        # Workers outside the group are stopped one by one; one may start another
        # meanwhile, so look again until a look finds nobody new.
        stopped: list[int] = []
        while new := [p for p in child.processes() if p not in stopped]:
            child.signal_all(signal.SIGSTOP, new)
            stopped += new
        # Wait until each is really stopped (it may be inside a kernel call).
        while not all(map(is_stopped, stopped)):
            if not child.alive:
                raise ChildExited
            if deadline is not None and time.monotonic() >= deadline:
                raise ReleaseTimeout
            time.sleep(0.001)
        if not child.alive:
            raise ChildExited
        ours = session(os.getpid())
        groups = {g for p in stopped if session(p) == ours and (g := pgrp(p)) is not None}
        self.keeper = Keeper.start(sorted(groups), stopped[::-1])
        child.ignored.update(self.keeper.pids)

    def verify(self, deadline: float | None) -> None:
        pass  # a stopped command keeps its memory: that is what this strategy is

    def _restore(self) -> None:
        self._disarm()
        child = self.ctx.child
        child.signal_all(signal.SIGCONT, child.processes())

    def _disarm(self) -> None:
        if self.keeper is not None:
            self.ctx.child.ignored.difference_update(self.keeper.pids)
            self.keeper.disarm()
            self.keeper = None

    def force(self) -> None:
        self._disarm()
        super().force()
