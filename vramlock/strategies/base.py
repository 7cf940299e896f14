"""What every release strategy gets, and what it must do."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import ClassVar

from ..control import ParentEnd
from ..errors import ControlError, StrategyError
from ..process import Child

# How long a forceful release lets the process group act on SIGTERM before SIGKILL.
KILL_GRACE = 2.0
# A command whose control socket closed is given this long to be seen exiting.
CLOSE_TO_EXIT = 1.0


class ChildExited(Exception):
    """The command exited by itself while a strategy was waiting on it."""


class ReleaseTimeout(Exception):
    """The graceful release did not finish before --yield-within ran out."""


@dataclass
class Context:
    """The wrapped command and its control channel, as the strategies see them."""

    child: Child
    control: ParentEnd
    on_release: str | None = None
    on_restore: str | None = None
    hello: bool = False  # the child said it speaks the control protocol
    wants: bool = False  # the child said `want` since the last restore
    _words: list[str] = field(default_factory=list)

    def start_again(self) -> None:
        """Start the command anew, with a fresh control channel."""
        self.control.renew()
        self.hello = self.wants = False
        self._words.clear()
        self.child.spawn()
        self.control.started()

    def take_lines(self, lines: list[str]) -> None:
        for line in lines:
            if line == "hello":
                self.hello = True
            elif line == "want":
                self.wants = True
            else:
                self._words.append(line)

    def expect(self, word: str, deadline: float | None) -> None:
        """Wait for ``word`` from the child; ReleaseTimeout at ``deadline``, ChildExited."""
        while True:
            if word in self._words:
                self._words.remove(word)
                return
            if not self.child.alive:
                raise ChildExited
            if self.control.closed:
                # Usually the command is exiting: its socket closes just before it dies.
                if self.child.wait(CLOSE_TO_EXIT) is not None:
                    raise ChildExited
                raise ControlError("the command closed its control channel and cannot answer")
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise ReleaseTimeout
            self.take_lines(self.control.wait_lines(0.05 if left is None else min(0.05, left)))


class Strategy:
    """Releases and restores the command's GPU memory.

    ``release`` returns once the memory is free (the token is dropped after it);
    ``restore`` runs after the token is ours again.
    """

    name: ClassVar[str]
    releases: ClassVar[bool] = True
    keeps_state: ClassVar[bool] = True

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.killed = False  # force() ended the command: restore starts it again

    def release(self, deadline: float | None) -> None:
        raise StrategyError(f"the {self.name} strategy never releases")

    def force(self) -> None:
        """The forceful path after --yield-within: end the process group; restore relaunches."""
        self.ctx.child.terminate(KILL_GRACE)
        self.ctx.child.reap_group()
        self.killed = True

    def restore(self) -> None:
        if self.killed:
            self.killed = False
            self.ctx.start_again()
            return
        self._restore()

    def _restore(self) -> None:
        pass
