"""``restart``: end every process of the command; start it again on its turn.

With ``--on-release CMD``, CMD is what ends it (``docker stop NAME``: the GPU process
of a container is no child of ours, and signals to ``docker run`` would not stop it):
the token is given up once CMD has exited 0 and the command has exited, within
``--yield-within`` (10 s by default). Otherwise the command stays resident, since its
GPU process may live on: the release fails, and is tried again later.
"""

from __future__ import annotations

import signal
import time

from ..errors import StrategyError
from .base import ReleaseTimeout, Strategy
from .exec import run_hook


class RestartStrategy(Strategy):
    """End every process of the command; start it again when the token is back."""

    name = "restart"
    keeps_state = False

    @property
    def ended_by_command(self) -> bool:
        return self.settings.on_release is not None

    def release(self, deadline: float | None) -> None:
        if self.settings.on_release is not None:
            self._stop_with(self.settings.on_release, deadline)
            return
        child = self.ctx.child
        child.signal_group(signal.SIGTERM)
        child.signal_group(signal.SIGCONT)  # a stopped group cannot act on SIGTERM
        grace = self.settings.restart_grace
        if deadline is not None:
            grace = max(0.0, deadline - time.monotonic())
        if child.wait(grace) is None and deadline is not None:
            raise ReleaseTimeout
        # The token is dropped only once every process of the command is gone,
        # workers that ignore SIGTERM or left the group included.
        self.end_command(0.0)

    def _stop_with(self, command: str, deadline: float | None) -> None:
        """Run ``command`` to end the command; StrategyError, the token kept, unless
        it exits 0 and the command exits by ``deadline``."""
        within = self.settings.restart_grace
        if deadline is not None:
            within = max(0.0, deadline - time.monotonic())
        end = time.monotonic() + within
        try:
            run_hook(self.ctx, command, "on-release", end)
        except ReleaseTimeout:
            raise StrategyError(
                f"--on-release command did not finish within {within:g} s"
            ) from None
        if self.ctx.child.wait(max(0.0, end - time.monotonic())) is None:
            raise StrategyError(
                f"the command did not exit within {within:g} s of its --on-release command"
            )
        self.end_command(0.0)  # what it left behind, before the token goes
