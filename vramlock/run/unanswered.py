"""Releases nobody answered: somebody holds want.lock but never takes the token.

A waiter holds want.lock shared and then blocks for the token, so the kernel hands
it the token the instant a resident lets go. A process that holds want.lock and never
queues for the token (a hung waiter, a shell recipe stopped half-way) keeps the probe
failing for ever: the resident releases, nobody takes the token, it comes back, and
the probe fails again. Each turn costs it a release and a restore.

The token is the truth: after a release, a resident that comes back to a free token
while want.lock is still held knows its release was not answered - that want is not
for the token. Its next release for a want waits until it has worked ``SHARE_FACTOR``
times as long as the unanswered release cost it (and at least twice as long as it
waited before the last), so unanswered releases cost it about 1 / ``SHARE_FACTOR``
of its time (2.5 % measured). The wait is bounded by ``MAX_HOLD_OFF``: a real
waiter that comes meanwhile waits that long at most. A release that somebody
answers (the token held elsewhere when we come back) or a want that went away ends
the wait.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..arena.member import Member

# An unanswered release is followed by at least this many times its cost resident:
# the release costs 1 part in SHARE_FACTOR + 1 of the resident's time, under 3 %.
SHARE_FACTOR = 40.0
MAX_HOLD_OFF = 30.0  # the longest a real waiter arriving during a hold-off waits for it


class Unanswered:
    """Whether the last release was answered, and how long releases are held off."""

    def __init__(self, warn: Callable[..., None]) -> None:
        self._warn = warn  # the run's diagnostics (``message, once=``)
        self.hold_off = 0.0  # the current hold-off (seconds); 0 when releases were answered
        self.until = 0.0  # monotonic time until which a want does not make us release
        self._judged: bool | None = None  # the last release: answered (True) or not
        self._release_started = 0.0

    def releasing(self) -> None:
        """A release begins (its cost is counted from here)."""
        self._release_started = time.monotonic()
        self._judged = None

    def judge(self, *, taken: bool, wanted: bool) -> None:
        """Coming back after a release, before queueing: is the token held by somebody
        else (``taken``), does somebody still hold want.lock (``wanted``)?"""
        self._judged = taken or not wanted

    def restored(self) -> None:
        """Resident again after that release: where it was unanswered, releases are held
        off from now on (``until``)."""
        judged, self._judged = self._judged, None
        if judged is None:
            return
        if judged:
            self.clear()
            return
        now = time.monotonic()
        cost = now - self._release_started
        self.hold_off = min(MAX_HOLD_OFF, max(2 * self.hold_off, SHARE_FACTOR * cost))
        self.until = now + self.hold_off
        self._warn(
            "somebody holds want.lock but does not take the token when it is free;"
            " releases for it are held off, longer each time nobody takes it",
            once=True,
        )

    def wanted(self, member: Member) -> bool:
        """Past min_hold and somebody waits, unless releases nobody answered hold us off."""
        if time.monotonic() >= self.until:
            return member.should_release()
        if not member.wanted():
            self.clear()  # that want went away: the next one may be real
        return False

    def clear(self) -> None:
        """Nobody waits any more: the next want is taken at its word."""
        self.hold_off, self.until = 0.0, 0.0
