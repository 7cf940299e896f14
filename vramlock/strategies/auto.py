"""``auto``, the default: the policy that picks how to release a command, and changes
its mind as it learns more. It never picks a strategy that throws away a job's work.

- Before the command starts: the first of ``AT_START`` that recognises it from its
  command line (an engine's preset), else ``none``: the command holds the GPU until it
  exits, as under ``flock(1)``, until one of the events below. Where ``swap`` can work
  here (a driver with virtual memory management, its library built or buildable), the
  library goes in front of the command as well, unless a preset sees the engine spread
  over several GPU processes (they share memory in a way the library cannot serve); and
  where the Vulkan layer can (a Vulkan loader, the layer built or buildable), the layer
  too, on the same hub.
- The command says hello on the control channel: ``signal`` (in place of ``none`` or a
  preset: a program that speaks the protocol knows best what to keep).
- Somebody waits, and it has not said hello within ``HELLO_GRACE`` of its start, or its
  preset is about to release it: the first of ``FOR_A_WAITER`` that finds work in it:
  ``swap-vulkan`` once a Vulkan process joined through the layer (and none runs Vulkan
  without the layer or CUDA without the library; CUDA processes are swapped with it),
  ``swap`` once its CUDA processes joined the library (and none runs CUDA without it),
  its engine's preset, ``checkpoint`` for a CUDA program the driver can checkpoint.
  When none does, the user is told once that the waiter waits, and auto looks again
  every ``LOOK_AGAIN`` (a command still starting may join the library later).
- A release is refused for good (a process that cannot be swapped, a checkpoint the
  driver refuses): the next of ``FOR_A_WAITER`` that finds work, else ``none``; a
  strategy refused is not tried again (``swap`` and ``swap-vulkan`` speak to the same
  processes: one refused, both are), and the cause stays in ``who``. The control
  channel broke: ``none``, until a new hello or the next waiter.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from contextlib import ExitStack

from ..command.context import Context
from ..errors import ControlError, Immovable
from ..gpu.core.protocol import ENV_UNREACHED
from .base import Settings, Strategy
from .checkpoint import CheckpointStrategy
from .http import Preset
from .none import NoneStrategy
from .presets import PRESETS
from .signal import SignalStrategy
from .swap import SwapStrategy, hub_of
from .swap import usable as swap_usable
from .vkswap import VulkanSwapStrategy, either, names_layer, vulkan_loose
from .vkswap import usable as vulkan_usable

# In order of preference, each list: the first that fits is taken.
AT_START: tuple[type[Strategy], ...] = (*PRESETS.values(),)
FOR_A_WAITER: tuple[type[Strategy], ...] = (
    VulkanSwapStrategy,
    SwapStrategy,
    *PRESETS.values(),
    CheckpointStrategy,
)
# Strategies that release through the same hub: one refused, the other would be too.
SWAPS = (SwapStrategy, VulkanSwapStrategy)
# A command that has not said hello this long after it started is taken not to speak
# the control protocol.
HELLO_GRACE = 1.0
# Told that a waiter waits, auto looks for a way again this often.
LOOK_AGAIN = 0.5

KEEPS = "somebody is waiting for the GPU, but this command keeps it until it exits"
CANNOT_RELEASE = (
    f"{KEEPS}: --release auto found no way to release it (it does not speak the control"
    " protocol, and is no CUDA program that can be swapped or checkpointed); see"
    " --release restart, stop or exec"
)


def spread(command: list[str]) -> bool:
    """Does a preset see ``command``'s engine spread over several GPU processes? Neither
    the swap library nor the Vulkan layer goes in front of it then."""
    return any(engine.spreads(command) for engine in PRESETS.values())


def swaps(command: list[str]) -> bool:
    """Does ``auto`` put the swap library in front of ``command``? Where it cannot work
    nothing is said: that is for an explicit ``--release swap``."""
    return not spread(command) and swap_usable() is None


class AutoStrategy(Strategy):
    """Releases through ``current``, the strategy chosen so far."""

    name = "auto"

    def __init__(self, ctx: Context, settings: Settings) -> None:
        self.current: Strategy = self.first(ctx.child.argv)(ctx, settings)
        super().__init__(ctx, settings)
        self._started = time.monotonic()  # the command's (last) start: the hello grace
        self._told = False  # the user was told that the waiter will wait
        self._look_again = 0.0  # told: when to look for a way again
        self._refused: set[type[Strategy]] = set()
        # Why the swap library could not reach the command (a process of it), for who.
        self._unreached: str | None = None

    @classmethod
    def first(cls, command: list[str]) -> type[Strategy]:
        found = (c for c in AT_START if c.keeps_state and c.recognises(command))
        return next(found, NoneStrategy)

    @classmethod
    def fit(cls, command: list[str], env: Mapping[str, str], settings: Settings) -> None:
        cls.first(command).fit(command, env, settings)

    @classmethod
    def prepare(cls, command: list[str], env: dict[str, str], scratch: ExitStack) -> list[str]:
        prepared = cls.first(command).prepare(command, env, scratch)
        # Said by nobody where it cannot: that is for an explicit --release swap-vulkan.
        vulkan = not spread(command) and vulkan_usable() is None
        if swaps(command):
            prepared = SwapStrategy.prepare(prepared, env, scratch)
            env[ENV_UNREACHED] = "run"  # a process swap cannot reach runs as under none
        if vulkan:
            prepared = VulkanSwapStrategy.prepare(prepared, env, scratch)
            env[ENV_UNREACHED] = "run"  # nor does the layer hold one that cannot reach us
        return prepared

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
        # Told or not: a process of the command may join the swap library later.
        return not self.current.releases

    @property
    def note(self) -> str | None:
        return self._unreached

    # -- changing its mind ---------------------------------------------------------------

    def settle(self, wanted: Callable[[], bool]) -> str | None:
        if not isinstance(self.current, (NoneStrategy, Preset)):
            return None
        if self.ctx.hello and not self.ctx.control.closed:
            self.current = SignalStrategy(self.ctx, self.settings)
            return None
        if isinstance(self.current, Preset):
            return None  # swap is considered as it releases
        if time.monotonic() - self._started < HELLO_GRACE or not wanted():
            return None
        if self._told:
            return self._after_all()
        found = self._found()
        # Said once: with the cause where swap was out of reach of a process.
        cause = SwapStrategy.unreached(self.ctx)
        self._unreached = cause or self._unreached
        if found is not None:
            self.current = found(self.ctx, self.settings)
            return None if cause is None else f"{cause}: --release auto uses {found.name}"
        self._told = True
        if cause is None:
            return CANNOT_RELEASE
        return (
            f"{KEEPS}: {cause}, so it cannot be swapped, and --release auto found no other"
            " way to release it; see --release restart, stop or exec"
        )

    def _after_all(self) -> str | None:
        """Told that the waiter waits: look again, now and then. A command still starting
        when the waiter came (a framework's import before its first CUDA call) may have
        joined the swap library since."""
        now = time.monotonic()
        if now < self._look_again:
            return None
        self._look_again = now + LOOK_AGAIN
        found = self._found()
        if found is None:
            return None
        self.current = found(self.ctx, self.settings)
        self._told = False
        return f"--release auto found a way to release it after all: {found.name}"

    def _found(self) -> type[Strategy] | None:
        """The first of FOR_A_WAITER, not refused, that finds work in the command."""
        fits = (c for c in FOR_A_WAITER if c not in self._refused and c.finds_work(self.ctx))
        return next(fits, None)

    def fall_back(self, err: Exception) -> bool:
        if isinstance(err, ControlError):
            self.ctx.hello = False  # a new hello upgrades it again
            self.current = NoneStrategy(self.ctx, self.settings)
            return True
        if isinstance(err, Immovable):
            self._refused.add(type(self.current))
            if isinstance(self.current, SwapStrategy):
                self._refused.update(SWAPS)
                self._unreached = SwapStrategy.unreached(self.ctx) or self._unreached
            if isinstance(self.current, VulkanSwapStrategy):
                self._unreached = f"swap-vulkan refused: {err}"
        found = self._found()
        if found is None:
            self.current = NoneStrategy(self.ctx, self.settings)
            self._told = True  # the runner says that it holds the GPU until it exits
        else:
            self.current = found(self.ctx, self.settings)
        return True

    # -- releasing: the chosen strategy's own ---------------------------------------------

    def release(self, deadline: float | None) -> None:
        if isinstance(self.current, Preset):
            # Taken from the command line alone; swap, once the command joined it, keeps
            # more and restarts nothing.
            found = self._found()
            if found is not None and found is not type(self.current):
                self.current = found(self.ctx, self.settings)
        self.current.release(deadline)

    def verify(self, deadline: float | None) -> None:
        self.current.verify(deadline)

    def force(self) -> None:
        self.current.force()

    def park_in(self) -> float | None:
        return self.current.park_in()

    def park(self) -> None:
        self.current.park()

    def come_back_early(self) -> None:
        self.current.come_back_early()

    @property
    def holds_processes(self) -> bool:
        return self.current.holds_processes

    def loose(self, pids: list[int]) -> tuple[list[int], list[int]]:
        found = self.current.loose(pids)
        hub = hub_of(self.ctx)
        if (type(self.current) is SwapStrategy and hub is not None
                and names_layer(self.ctx.child.env)):  # fmt: skip
            # The layer is in front too: a Vulkan process without it runs unheld.
            return either(found, vulkan_loose(hub, pids))
        return found

    def restore(self) -> None:
        if self.current.killed:
            self._started = time.monotonic()  # started again: a new grace for its hello
        self.current.restore()
