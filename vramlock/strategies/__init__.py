"""Release strategies, by the names ``vramlock run --release`` takes.

This is the one place that checks strategy names and option mixes.
"""

from __future__ import annotations

from ..errors import StrategyError, UsageError
from .base import (
    ChildExited,
    Context,
    Interrupted,
    ReleaseTimeout,
    Settings,
    Strategy,
    Unverified,
)
from .basic import NoneStrategy, RestartStrategy, StopStrategy
from .checkpoint import CheckpointStrategy, NotCheckpointable, VramTaken, usable
from .cooperative import SignalStrategy
from .hooks import ExecStrategy

STRATEGIES: dict[str, type[Strategy]] = {
    cls.name: cls
    for cls in (
        SignalStrategy,
        CheckpointStrategy,
        NoneStrategy,
        RestartStrategy,
        StopStrategy,
        ExecStrategy,
    )
}
NAMES = ("auto", *STRATEGIES)


def check(name: str, settings: Settings) -> str:
    """Validate ``--release NAME`` with its settings; the name to use (hooks imply exec)."""
    hooks = settings.on_release is not None or settings.on_restore is not None
    if hooks and name == "auto":
        name = "exec"
    if name not in NAMES:
        raise StrategyError(f"unknown release strategy {name!r} (choose from {', '.join(NAMES)})")
    if hooks and name != "exec":
        raise UsageError("--on-release/--on-restore need --release exec")
    if name == "exec" and settings.on_release is None:
        raise UsageError("--release exec needs --on-release COMMAND")
    if name == "checkpoint":
        why = usable()
        if why is not None:
            raise StrategyError(f"--release checkpoint cannot be used here: {why}")
    return name


def pick(name: str, ctx: Context, settings: Settings, command: list[str]) -> Strategy:
    """The strategy for ``--release NAME`` (already checked).

    ``auto`` picks a strategy that recognises the command, else starts as ``none``
    and becomes ``signal`` when the child says hello (see ``upgrade``): it never
    picks a strategy that throws away a job's work.
    """
    if name == "auto":
        for cls in STRATEGIES.values():
            if cls.keeps_state and cls.recognises(command):
                return cls(ctx, settings)
        return NoneStrategy(ctx, settings)
    return STRATEGIES[name](ctx, settings)


def for_waiter(current: Strategy, requested: str, ctx: Context) -> Strategy:
    """Under ``auto``, somebody waits and the command cannot release: a CUDA program
    gets ``checkpoint`` where the driver can do it, else it keeps ``none``."""
    if (
        requested == "auto"
        and isinstance(current, NoneStrategy)
        and CheckpointStrategy.finds_work(ctx)
    ):
        return CheckpointStrategy(ctx, current.settings)
    return current


def upgrade(current: Strategy, requested: str, ctx: Context) -> Strategy:
    """Under ``auto``, a child that speaks the control protocol gets ``signal``."""
    if (
        requested == "auto"
        and ctx.hello
        and not ctx.control.closed
        and isinstance(current, NoneStrategy)
    ):
        return SignalStrategy(ctx, current.settings)
    return current


__all__ = [
    "NAMES",
    "STRATEGIES",
    "CheckpointStrategy",
    "ChildExited",
    "Context",
    "ExecStrategy",
    "Interrupted",
    "NoneStrategy",
    "NotCheckpointable",
    "ReleaseTimeout",
    "RestartStrategy",
    "Settings",
    "SignalStrategy",
    "StopStrategy",
    "Strategy",
    "Unverified",
    "VramTaken",
    "check",
    "for_waiter",
    "pick",
    "upgrade",
]
