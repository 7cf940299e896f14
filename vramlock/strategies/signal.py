"""``signal``: the command frees its own memory when asked over the control channel."""

from __future__ import annotations

from .base import Strategy


class SignalStrategy(Strategy):
    """Ask with ``release``, wait for ``released``; ``restore`` / ``restored`` to come back."""

    name = "signal"

    def release(self, deadline: float | None) -> None:
        self.ctx.wants = False
        self.ctx.ask("release", "released", deadline)

    def _restore(self) -> None:
        self.ctx.ask("restore", "restored", None)
