"""``restart``: end every process of the command; start it again on its turn."""

from __future__ import annotations

import signal
import time

from .base import ReleaseTimeout, Strategy


class RestartStrategy(Strategy):
    """End every process of the command; start it again when the token is back."""

    name = "restart"
    keeps_state = False

    def release(self, deadline: float | None) -> None:
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
