"""Demand: when a released command wants the GPU back, and when it must not be released.

Each demand gives the supervisor's loop the descriptors it needs watched, says
whether the command wants the GPU (while released) and may veto a release while
the command is busy. The loop stays the same whatever the demand.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

from .errors import StrategyError
from .strategies import Context


class Demand(ABC):
    name: ClassVar[str]

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx

    def fds(self) -> list[int]:
        """Descriptors whose readiness means something for this demand."""
        return []

    @abstractmethod
    def wants(self) -> bool:
        """While released: should we queue for the token now?"""

    def busy(self) -> bool:
        """While resident: is this a bad moment to release (work in flight)?"""
        return False

    def restored(self) -> None:  # noqa: B027 - most demands keep nothing to reset
        """The command is resident again."""


class Always(Demand):
    """Re-queue at once after a release: time-slicing for batch jobs."""

    name = "always"

    def wants(self) -> bool:
        return True


class ChildSays(Demand):
    """The cooperative child says ``want`` on its control channel."""

    name = "child"

    def wants(self) -> bool:
        return self.ctx.wants

    def restored(self) -> None:
        self.ctx.wants = False


DEMANDS: dict[str, type[Demand]] = {cls.name: cls for cls in (Always, ChildSays)}


def check(name: str) -> None:
    if name not in DEMANDS:
        raise StrategyError(f"unknown demand {name!r} (choose from {', '.join(DEMANDS)})")


def make(name: str, ctx: Context) -> Demand:
    check(name)
    return DEMANDS[name](ctx)
