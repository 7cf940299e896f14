"""``exec``: user commands run through ``sh -c`` to release and restore."""

from __future__ import annotations

import os
import subprocess
import time

from ..errors import StrategyError
from .base import ReleaseTimeout, Strategy


class ExecStrategy(Strategy):
    """``--on-release CMD`` must free the memory before it exits 0; ``--on-restore CMD``."""

    name = "exec"

    def _hook(self, command: str | None, what: str, deadline: float | None) -> None:
        if not command:
            return
        env = dict(os.environ)
        env["VRAMLOCK_CHILD_PID"] = str(self.ctx.child.pid)
        env["VRAMLOCK_CHILD_PGID"] = str(self.ctx.child.pid)
        hook = subprocess.Popen(["/bin/sh", "-c", command], env=env, start_new_session=True)
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            code = hook.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(hook.pid, 9)
            hook.wait()
            raise ReleaseTimeout from None
        if code != 0:
            raise StrategyError(f"--{what} command exited with status {code}")

    def release(self, deadline: float | None) -> None:
        self._hook(self.ctx.on_release, "on-release", deadline)

    def _restore(self) -> None:
        self._hook(self.ctx.on_restore, "on-restore", None)
