"""``none``: hold the token until the command exits, as flock(1) does."""

from __future__ import annotations

from .base import Strategy


class NoneStrategy(Strategy):
    """Hold the token until the command exits, as flock(1) does; waiters wait."""

    name = "none"
    releases = False
