"""Release strategies, by the names ``vramlock run --release`` takes.

This is the one place that checks strategy names and option mixes.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from contextlib import ExitStack

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
from .presets import PRESETS
from .swap import SwapStrategy
from .webapi import HttpStrategy

STRATEGIES: dict[str, type[Strategy]] = {
    cls.name: cls
    for cls in (
        SignalStrategy,
        CheckpointStrategy,
        SwapStrategy,
        HttpStrategy,
        NoneStrategy,
        RestartStrategy,
        StopStrategy,
        ExecStrategy,
    )
}
NAMES = ("auto", *STRATEGIES)
# What ``auto`` may recognise from the command alone, in this order.
RECOGNISED: tuple[type[Strategy], ...] = (*STRATEGIES.values(), *PRESETS.values())


def check(
    name: str, settings: Settings, command: list[str], env: Mapping[str, str] = os.environ
) -> str:
    """Validate ``--release NAME`` with its settings and the command; the name to use
    (hooks imply exec; a preset or a URL implies http)."""
    hooks = settings.on_release is not None or settings.on_restore is not None
    urls = settings.on_release_url is not None or settings.on_restore_url is not None
    web = urls or settings.preset is not None
    if hooks and web:
        raise UsageError(
            "--on-release/--on-restore (exec) and --preset/--on-release-url/--on-restore-url"
            " (http) do not mix"
        )
    if hooks and name == "auto":
        name = "exec"
    if web and name == "auto":
        name = "http"
    if name not in NAMES:
        raise StrategyError(f"unknown release strategy {name!r} (choose from {', '.join(NAMES)})")
    if hooks and name != "exec":
        raise UsageError("--on-release/--on-restore need --release exec")
    if web and name != "http":
        raise UsageError("--preset, --on-release-url and --on-restore-url need --release http")
    if name == "exec" and settings.on_release is None:
        raise UsageError("--release exec needs --on-release COMMAND")
    if name == "http":
        if settings.preset is not None and urls:
            raise UsageError("--preset and --on-release-url/--on-restore-url do not mix")
        if settings.preset is None and settings.on_release_url is None:
            raise UsageError("--release http needs --preset NAME or --on-release-url URL")
        if settings.preset is not None and settings.preset not in PRESETS:
            raise StrategyError(
                f"unknown preset {settings.preset!r} (choose from {', '.join(PRESETS)})"
            )
    if name == "checkpoint":
        why = usable()
        if why is not None:
            raise StrategyError(f"--release checkpoint cannot be used here: {why}")
    chosen(name, settings, command).fit(command, env, settings)
    return name


def chosen(name: str, settings: Settings, command: list[str]) -> type[Strategy]:
    """The strategy ``pick`` starts with for ``--release NAME`` (already checked).

    ``auto`` picks a strategy that recognises the command (an engine's preset), else
    starts as ``none`` and becomes ``signal`` when the child says hello (see
    ``upgrade``): it never picks a strategy that throws away a job's work.
    """
    if name == "auto":
        found = (cls for cls in RECOGNISED if cls.keeps_state and cls.recognises(command))
        return next(found, NoneStrategy)
    if name == "http" and settings.preset is not None:
        return PRESETS[settings.preset]
    return STRATEGIES[name]


def pick(name: str, ctx: Context, settings: Settings, command: list[str]) -> Strategy:
    """The strategy for ``--release NAME`` (already checked)."""
    return chosen(name, settings, command)(ctx, settings)


def prepare(
    name: str, settings: Settings, command: list[str], env: dict[str, str], scratch: ExitStack
) -> list[str]:
    """The command as it is to be started (``Strategy.prepare``; ``env`` may change)."""
    return chosen(name, settings, command).prepare(command, env, scratch)


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
    "PRESETS",
    "STRATEGIES",
    "CheckpointStrategy",
    "ChildExited",
    "Context",
    "ExecStrategy",
    "HttpStrategy",
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
    "chosen",
    "for_waiter",
    "pick",
    "prepare",
    "upgrade",
]
