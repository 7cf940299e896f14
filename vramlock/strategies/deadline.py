"""A release's deadline: a process of the command that does not answer a release in
time (``--release-within``), or that is stopped, makes it refused; the command stays
resident and the release is tried again later. Every strategy that asks something of
the command to release (its control channel, a hook, a server, the driver) is bound by
it; ``--yield-within``, when sooner, ends the command instead."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from .. import procfs
from ..command.context import ReleaseTimeout
from ..errors import StrategyError

# How long a release waits for every process's answer before it is refused, the
# processes that released restored: the slowest release measured, a first one of 60 GiB
# (its host copies pinned as it goes), took 43 s on an H100, 0.72 s a GiB; a whole
# 141 GB H200 at that pace takes about 100 s.
RELEASE_WITHIN = 120.0
UNANSWERED = "unanswered"  # the answer of a process that gave none in time


class NoAnswer(StrategyError):
    """A process of the command did not answer a release in time, or is stopped: the
    release is refused, every process left running (those that released, restored).
    ``brief``: the reason in a few words, for who's note."""

    def __init__(self, message: str, brief: str) -> None:
        super().__init__(message)
        self.brief = brief


def stopped(pid: int) -> NoAnswer:
    return NoAnswer(
        f"process {pid} of the command is stopped and cannot release its memory",
        f"process {pid} is stopped",
    )


def unanswered(pid: int, within: float) -> NoAnswer:
    return late(f"process {pid} of the command", f"process {pid}", within)


def late(what: str, brief: str, within: float) -> NoAnswer:
    """``what`` (``brief`` for who's note) did not answer the release in ``within`` s."""
    return NoAnswer(
        f"{what} did not answer the release within {within:g} s (--release-within)",
        f"{brief} did not answer in {within:g} s",
    )


def is_stopped(pid: int) -> bool:
    """Stopped (SIGSTOP, a debugger), so that it cannot answer until it is continued."""
    return procfs.state(pid) in ("T", "t")


@contextmanager
def bounded(
    deadline: float | None, within: float | None, refusal: Callable[[float], NoAnswer]
) -> Iterator[float]:
    """The end of a release's wait: ``deadline`` (--yield-within: ReleaseTimeout, the
    command ended) or, when sooner, ``within`` seconds from now (None: RELEASE_WITHIN),
    where a ReleaseTimeout becomes ``refusal(within)``: the release is refused."""
    within = within or RELEASE_WITHIN
    end = time.monotonic() + within
    if deadline is not None and deadline <= end:
        yield deadline
        return
    try:
        yield end
    except ReleaseTimeout:
        raise refusal(within) from None
