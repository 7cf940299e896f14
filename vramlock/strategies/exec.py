"""``exec``: user commands run through ``sh -c`` to release and restore."""

from __future__ import annotations

import os
import signal
import time

from ..errors import StrategyError
from .base import Interrupted, ReleaseTimeout, Strategy


class ExecStrategy(Strategy):
    """``--on-release CMD`` must free the memory before it exits 0; ``--on-restore CMD``."""

    name = "exec"

    def _hook(self, command: str | None, what: str, deadline: float | None) -> None:
        if not command:
            return
        import subprocess  # only this strategy runs programs of its own

        env = dict(os.environ)
        env["VRAMLOCK_CHILD_PID"] = str(self.ctx.child.pid)
        env["VRAMLOCK_CHILD_PGID"] = str(self.ctx.child.pid)
        hook = subprocess.Popen(["/bin/sh", "-c", command], env=env, start_new_session=True)
        self.ctx.child.ignored.add(hook.pid)
        endings = self.ctx.endings
        try:
            while True:
                step = 0.05 if deadline is None else min(0.05, deadline - time.monotonic())
                try:
                    code = hook.wait(max(step, 0.0))
                    break
                except subprocess.TimeoutExpired:
                    pass
                interrupted = self.ctx.endings != endings
                if interrupted or (deadline is not None and time.monotonic() >= deadline):
                    os.killpg(hook.pid, signal.SIGKILL)
                    hook.wait()
                    raise Interrupted if interrupted else ReleaseTimeout
        finally:
            self.ctx.child.ignored.discard(hook.pid)
        if code != 0:
            raise StrategyError(f"--{what} command exited with status {code}")

    def release(self, deadline: float | None) -> None:
        self._hook(self.settings.on_release, "on-release", deadline)

    def _restore(self) -> None:
        self._hook(self.settings.on_restore, "on-restore", None)
