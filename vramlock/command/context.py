"""The wrapped command as strategies and demands see it: the process, its control
channel, what it said on it, and the orders to end the wrapper has had.

Below strategies and demand: both use it, neither is needed to make it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from ..errors import ControlError
from .control import ParentEnd
from .process import Child

# A command whose control socket closed is given this long to be seen exiting.
CLOSE_TO_EXIT = 1.0


class ChildExited(Exception):
    """The command exited by itself while a strategy was waiting on it."""


class ReleaseTimeout(Exception):
    """The graceful release did not finish before --yield-within ran out."""


class Interrupted(Exception):
    """The wrapper was told to end (SIGTERM, Ctrl-C) while a strategy was waiting on
    the command: the wait is abandoned so the wrapper stays responsive."""


@dataclass
class Context:
    """The wrapped command and its control channel, as strategies and demands see them.

    Words from the child count only as the answer to the request just sent
    (``ask``): an unsolicited ``released`` must not satisfy the next release.
    """

    child: Child
    control: ParentEnd
    started: Callable[[int], None] = lambda pid: None  # told each new pid of the command
    hello: bool = False  # the child said it speaks the control protocol
    wants: bool = False  # the child said `want` since the last restore
    endings: int = 0  # ending signals (TERM, INT, HUP, QUIT) the wrapper has had
    _cut_short: int = 0  # how many ``interruptible`` blocks we are in
    _awaiting: str | None = None
    _answered: bool = False
    _log: list[str] = field(default_factory=list)

    def ending(self) -> None:
        """The wrapper was told to end (called from its signal handler): count it, and
        raise Interrupted inside an ``interruptible`` block."""
        self.endings += 1
        if self._cut_short:
            raise Interrupted

    @contextmanager
    def interruptible(self) -> Iterator[None]:
        """Around a call that blocks for long (an HTTP request, a hook): an ending signal
        raises Interrupted out of it at once, from the signal handler. One that came
        before the block began is seen by the caller's own check of ``endings``."""
        self._cut_short += 1
        try:
            yield
        finally:
            self._cut_short -= 1

    def start_again(self) -> None:
        """Start the command anew, with a fresh control channel."""
        self.control.renew()
        self.hello = self.wants = False
        self._awaiting, self._answered = None, False
        self.child.spawn()
        self.control.started()
        self.started(self.child.pid)

    def take_lines(self, lines: list[str]) -> None:
        for line in lines:
            if line == "hello":
                self.hello = True
            elif line == "want":
                self.wants = True
            elif line == self._awaiting:
                self._answered = True

    def ask(self, request: str, answer: str, deadline: float | None) -> None:
        """Send ``request`` and wait for ``answer``; ReleaseTimeout at ``deadline``,
        ChildExited, Interrupted, or ControlError when the channel closed under a live child."""
        self.take_lines(self.control.read_lines())  # words sent before the request don't count
        self._awaiting, self._answered = answer, False
        endings = self.endings
        try:
            self.control.send(request)
            while not self._answered:
                if not self.child.alive:
                    raise ChildExited
                if self.control.closed:
                    # Usually the command is exiting: its socket closes just before it dies.
                    if self.child.wait(CLOSE_TO_EXIT) is not None:
                        raise ChildExited
                    raise ControlError("the command closed its control channel and cannot answer")
                if self.endings != endings:
                    raise Interrupted
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise ReleaseTimeout
                step = 0.05 if left is None else min(0.05, left)
                self.take_lines(self.control.wait_lines(step))
        finally:
            self._awaiting = None
