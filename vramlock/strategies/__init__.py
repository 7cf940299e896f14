"""Release strategies, by the names ``vramlock run --release`` takes.

This is the one place that checks strategy names and option mixes.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from contextlib import ExitStack

from ..errors import StrategyError, UsageError
from ..gpu.cuda import NotCheckpointable
from .auto import AutoStrategy
from .base import (
    ChildExited,
    Context,
    Interrupted,
    ReleaseTimeout,
    Settings,
    Strategy,
    StrategyOptions,
    Unverified,
)
from .checkpoint import CheckpointStrategy, VramTaken, usable
from .exec import ExecStrategy
from .http import HttpStrategy
from .none import NoneStrategy
from .presets import PRESETS
from .restart import RestartStrategy
from .signal import SignalStrategy
from .stop import StopStrategy
from .swap import SwapStrategy
from .vkswap import VulkanSwapStrategy

# By the names --release takes, in the order they are listed; a new strategy is one
# more line here (and, for auto to choose it, a place in auto's lists).
STRATEGIES: dict[str, type[Strategy]] = {
    cls.name: cls
    for cls in (
        AutoStrategy,
        SignalStrategy,
        CheckpointStrategy,
        SwapStrategy,
        VulkanSwapStrategy,
        HttpStrategy,
        NoneStrategy,
        RestartStrategy,
        StopStrategy,
        ExecStrategy,
    )
}
NAMES = tuple(STRATEGIES)


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
        raise UsageError(f"unknown release strategy {name!r} (choose from {', '.join(NAMES)})")
    if hooks and name != "exec" and (name != "restart" or settings.on_restore is not None):
        raise UsageError("--on-release/--on-restore need --release exec (--on-release alone:"
                         " or restart)")  # fmt: skip
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
            known = ", ".join(PRESETS)
            raise UsageError(f"unknown preset {settings.preset!r} (choose from {known})")
    if name == "checkpoint":
        why = usable()
        if why is not None:
            raise StrategyError(f"--release checkpoint cannot be used here: {why}")
    chosen(name, settings).fit(command, env, settings)
    return name


def chosen(name: str, settings: Settings) -> type[Strategy]:
    """The strategy class for ``--release NAME`` (already checked)."""
    if name == "http" and settings.preset is not None:
        return PRESETS[settings.preset]
    return STRATEGIES[name]


def pick(name: str, ctx: Context, settings: Settings) -> Strategy:
    """The strategy for ``--release NAME`` (already checked), for the command in ``ctx``."""
    return chosen(name, settings)(ctx, settings)


def prepare(
    name: str, settings: Settings, command: list[str], env: dict[str, str], scratch: ExitStack
) -> list[str]:
    """The command as it is to be started (``Strategy.prepare``; ``env`` may change)."""
    return chosen(name, settings).prepare(command, env, scratch)


__all__ = [
    "NAMES",
    "PRESETS",
    "STRATEGIES",
    "AutoStrategy",
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
    "StrategyOptions",
    "Unverified",
    "VramTaken",
    "check",
    "chosen",
    "pick",
    "prepare",
]
