"""Demand: when a released command wants the GPU back, and when it must not be released.

Each demand gives the supervisor's loop the descriptors it needs watched, says
whether the command wants the GPU (while released) and may veto a release while
the command is busy. The loop stays the same whatever the demand:

- ``fds()``: descriptors that become readable when ``wants()`` may have changed; the
  loop sleeps on them and drains them after each wake-up (a hint: ``wants()`` decides);
- ``wants()``: while released, queue for the token now?
- ``busy_for()``: while resident and wanted, seconds the release should wait for work
  in flight (0.0: release now); the loop asks again then, and releases anyway once
  ``--yield-within`` has passed since it saw the waiter;
- ``releasing()`` before a release; ``restored()`` whenever the command is resident
  again: after a restore, and after a release that did not happen.

A demand is made once the command has started, resident.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, ClassVar

from ..command.context import Context
from ..errors import UsageError

if TYPE_CHECKING:
    from .proxy import Proxy


class Demand(ABC):
    name: ClassVar[str]
    # wants() is the command's own word: a command that a release ended cannot say it,
    # so it comes back on its turn instead.
    needs_command: ClassVar[bool] = False
    # Comes back at once after every release: the command is a job taking turns, so a
    # run that a release ended was lost work (see the runner's LOST_RUN_FACTOR).
    takes_turns: ClassVar[bool] = False

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx

    def fds(self) -> list[int]:
        """Descriptors whose readiness means ``wants()`` may have changed."""
        return []

    @abstractmethod
    def wants(self) -> bool:
        """While released: should we queue for the token now?"""

    def busy_for(self) -> float:
        """While resident: how long to put a release off for work in flight (0.0: not busy)."""
        return 0.0

    def releasing(self) -> None:  # noqa: B027 - most demands have nothing to stop
        """The command is about to be released."""

    def restored(self) -> None:  # noqa: B027 - most demands keep nothing to reset
        """The command is resident again."""


class Always(Demand):
    """Re-queue at once after a release: time-slicing for batch jobs."""

    name = "always"
    takes_turns = True

    def wants(self) -> bool:
        return True


class ChildSays(Demand):
    """The cooperative child says ``want`` on its control channel."""

    name = "child"
    needs_command = True

    def wants(self) -> bool:
        return self.ctx.wants

    def restored(self) -> None:
        self.ctx.wants = False


class Listen(Demand):
    """A TCP proxy in front of the command's server (``proxy.Proxy``): a client while
    released is demand, traffic in flight is busy, clients wait while it is away."""

    name = "listen"

    def __init__(self, ctx: Context, proxy: Proxy) -> None:
        super().__init__(ctx)
        self.proxy = proxy
        proxy.open_gate()

    def fds(self) -> list[int]:
        return [self.proxy.wake_fd]

    def wants(self) -> bool:
        return self.proxy.waiting()

    def busy_for(self) -> float:
        return self.proxy.busy_for()

    def releasing(self) -> None:
        self.proxy.close_gate()

    def restored(self) -> None:
        self.proxy.open_gate()


DEMANDS: dict[str, type[Demand]] = {cls.name: cls for cls in (Always, ChildSays, Listen)}


def check(name: str) -> None:
    if name not in DEMANDS:
        raise UsageError(f"unknown demand {name!r} (choose from {', '.join(DEMANDS)})")


def make(name: str, ctx: Context, proxy: Proxy | None = None) -> Demand:
    """The demand ``name``; ``listen`` needs the proxy (bound before the command started)."""
    check(name)
    if name == Listen.name:
        if proxy is None:
            raise UsageError("--demand listen needs --listen ADDR and --upstream ADDR")
        return Listen(ctx, proxy)
    return DEMANDS[name](ctx)
