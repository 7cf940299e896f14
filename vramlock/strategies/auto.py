"""``auto``, the default: the policy that picks how to release a command, and changes
its mind as it learns more. It never picks a strategy that throws away a job's work.

- Before the command starts: the first of ``AT_START`` that recognises it from its
  command line (an engine's preset), else ``none``: the command holds the GPU until it
  exits, as under ``flock(1)``, until one of these:
- it says hello on the control channel: ``signal``;
- somebody waits, and it has not said hello within ``HELLO_GRACE`` of its start: the
  first of ``FOR_A_WAITER`` that finds work in it (``checkpoint`` for a CUDA program the
  driver can checkpoint); when none does, the user is told once that the waiter waits;
- a release fails for good (the channel broke, the driver refused the checkpoint):
  ``none`` again; a strategy refused is not tried again.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from contextlib import ExitStack

from ..context import Context
from ..errors import ControlError, Immovable
from .base import Settings, Strategy
from .basic import NoneStrategy
from .checkpoint import CheckpointStrategy
from .cooperative import SignalStrategy
from .presets import PRESETS

# In order of preference, each list: the first that fits is taken.
AT_START: tuple[type[Strategy], ...] = (*PRESETS.values(),)
FOR_A_WAITER: tuple[type[Strategy], ...] = (CheckpointStrategy,)
# A command that has not said hello this long after it started is taken not to speak
# the control protocol.
HELLO_GRACE = 1.0

CANNOT_RELEASE = (
    "somebody is waiting for the GPU, but this command keeps it until it exits:"
    " --release auto found no way to release it (it does not speak the control"
    " protocol, and is no CUDA program the driver can checkpoint); see --release"
    " restart, stop or exec"
)


class AutoStrategy(Strategy):
    """Releases through ``current``, the strategy chosen so far."""

    name = "auto"

    def __init__(self, ctx: Context, settings: Settings) -> None:
        self.current: Strategy = self.first(ctx.child.argv)(ctx, settings)
        super().__init__(ctx, settings)
        self._started = time.monotonic()  # the command's (last) start: the hello grace
        self._told = False  # the user was told that the waiter will wait
        self._refused: set[type[Strategy]] = set()

    @classmethod
    def first(cls, command: list[str]) -> type[Strategy]:
        found = (c for c in AT_START if c.keeps_state and c.recognises(command))
        return next(found, NoneStrategy)

    @classmethod
    def fit(cls, command: list[str], env: Mapping[str, str], settings: Settings) -> None:
        cls.first(command).fit(command, env, settings)

    @classmethod
    def prepare(cls, command: list[str], env: dict[str, str], scratch: ExitStack) -> list[str]:
        return cls.first(command).prepare(command, env, scratch)

    # -- what the runner sees: the chosen strategy's facts -------------------------------

    @property
    def releases(self) -> bool:
        return self.current.releases

    @property
    def stops(self) -> bool:
        return self.current.stops

    @property
    def defers_signals(self) -> bool:
        return self.current.defers_signals

    @property
    def killed(self) -> bool:
        return self.current.killed

    @killed.setter
    def killed(self, value: bool) -> None:
        self.current.killed = value

    @property
    def label(self) -> str:
        return f"auto:{self.current.label}"

    @property
    def undecided(self) -> bool:
        return not self.current.releases and not self._told

    # -- changing its mind ---------------------------------------------------------------

    def settle(self, wanted: Callable[[], bool]) -> str | None:
        if not isinstance(self.current, NoneStrategy):
            return None
        if self.ctx.hello and not self.ctx.control.closed:
            self.current = SignalStrategy(self.ctx, self.settings)
            return None
        if self._told or time.monotonic() - self._started < HELLO_GRACE or not wanted():
            return None
        for cls in FOR_A_WAITER:
            if cls not in self._refused and cls.finds_work(self.ctx):
                self.current = cls(self.ctx, self.settings)
                return None
        self._told = True
        return CANNOT_RELEASE

    def fall_back(self, err: Exception) -> bool:
        if isinstance(err, Immovable):
            self._refused.add(type(self.current))
        if isinstance(err, ControlError):
            self.ctx.hello = False  # a new hello upgrades it again
        self.current = NoneStrategy(self.ctx, self.settings)
        return True

    # -- releasing: the chosen strategy's own ---------------------------------------------

    def release(self, deadline: float | None) -> None:
        self.current.release(deadline)

    def verify(self, deadline: float | None) -> None:
        self.current.verify(deadline)

    def force(self) -> None:
        self.current.force()

    def restore(self) -> None:
        if self.current.killed:
            self._started = time.monotonic()  # started again: a new grace for its hello
        self.current.restore()
