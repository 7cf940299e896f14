"""``exec``: user commands run through ``sh -c`` to release and restore."""

from __future__ import annotations

import os
import signal
import time

from ..errors import StrategyError
from . import deadline as deadlines
from .base import Context, Interrupted, ReleaseTimeout, Strategy


def run_hook(ctx: Context, command: str, what: str, deadline: float | None) -> None:
    """Run ``command`` through ``sh -c`` (VRAMLOCK_CHILD_PID and _PGID set) until it
    exits: StrategyError unless it exits 0, ReleaseTimeout at ``deadline`` and
    Interrupted when vramlock is told to end (then it is killed)."""
    import subprocess  # only the strategies with hooks run programs of their own

    env = dict(os.environ)
    env["VRAMLOCK_CHILD_PID"] = str(ctx.child.pid)
    env["VRAMLOCK_CHILD_PGID"] = str(ctx.child.pid)
    hook = subprocess.Popen(["/bin/sh", "-c", command], env=env, start_new_session=True)
    ctx.child.ignored.add(hook.pid)
    endings = ctx.endings
    try:
        while True:
            step = 0.05 if deadline is None else min(0.05, deadline - time.monotonic())
            try:
                code = hook.wait(max(step, 0.0))
                break
            except subprocess.TimeoutExpired:
                pass
            interrupted = ctx.endings != endings
            if interrupted or (deadline is not None and time.monotonic() >= deadline):
                os.killpg(hook.pid, signal.SIGKILL)
                hook.wait()
                raise Interrupted if interrupted else ReleaseTimeout
    finally:
        ctx.child.ignored.discard(hook.pid)
    if code != 0:
        raise StrategyError(f"--{what} command exited with status {code}")


class ExecStrategy(Strategy):
    """``--on-release CMD`` must free the memory before it exits 0; ``--on-restore CMD``.

    An ``--on-release`` command still running at ``--release-within`` is killed and the
    release refused; ``--on-restore`` is run then (bound by it too), so that the command
    is as resident as before."""

    name = "exec"

    def release(self, deadline: float | None) -> None:
        hook = self.settings.on_release
        if hook:
            with deadlines.bounded(deadline, self.settings.release_within, self._late) as end:
                run_hook(self.ctx, hook, "on-release", end)

    def _late(self, within: float) -> deadlines.NoAnswer:
        refusal = deadlines.late("the --on-release command", "--on-release", within)
        if self.settings.on_restore:
            try:
                run_hook(self.ctx, self.settings.on_restore, "on-restore",
                         time.monotonic() + within)  # fmt: skip
            except (StrategyError, ReleaseTimeout) as err:
                raise StrategyError(
                    f"{refusal}, and --on-restore failed ({err or 'it did not end in time'})"
                ) from None
        return refusal

    def _restore(self) -> None:
        if self.settings.on_restore:
            run_hook(self.ctx, self.settings.on_restore, "on-restore", None)
