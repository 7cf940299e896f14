"""A release's deadline: a process of the command that does not answer a release in
time (``--release-within``), or that is stopped, makes it refused; the command stays
resident and the release is tried again later."""

from __future__ import annotations

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
    return NoAnswer(
        f"process {pid} of the command did not answer the release within {within:g} s"
        " (--release-within)",
        f"process {pid} did not answer in {within:g} s",
    )
