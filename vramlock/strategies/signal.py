"""``signal``: the command frees its own memory when asked over the control channel."""

from __future__ import annotations

import functools

from . import deadline as deadlines
from .base import Strategy


class SignalStrategy(Strategy):
    """Ask with ``release``, wait for ``released``; ``restore`` / ``restored`` to come back.

    A command that does not answer by ``--release-within`` (or is stopped) has the
    release refused: it is told ``restore`` after the ``release``, not waited for, so
    that whenever it reads them it ends as it began, resident."""

    name = "signal"

    def release(self, deadline: float | None) -> None:
        self.ctx.wants = False
        pid = self.ctx.child.pid
        if deadlines.is_stopped(pid):
            raise deadlines.stopped(pid)
        refusal = functools.partial(self._refused, pid)
        with deadlines.bounded(deadline, self.settings.release_within, refusal) as end:
            self.ctx.ask("release", "released", end)

    def _refused(self, pid: int, within: float) -> deadlines.NoAnswer:
        self.ctx.control.send("restore")  # its answer is not awaited: it counts for nothing
        return deadlines.unanswered(pid, within)

    def _restore(self) -> None:
        self.ctx.ask("restore", "restored", None)
