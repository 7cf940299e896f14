"""Release strategies, by the names ``vramlock run --release`` takes."""

from __future__ import annotations

from ..errors import StrategyError
from .base import ChildExited, Context, ReleaseTimeout, Strategy
from .basic import NoneStrategy, RestartStrategy, StopStrategy
from .cooperative import SignalStrategy
from .hooks import ExecStrategy

STRATEGIES: dict[str, type[Strategy]] = {
    cls.name: cls
    for cls in (SignalStrategy, NoneStrategy, RestartStrategy, StopStrategy, ExecStrategy)
}
NAMES = ("auto", *STRATEGIES)


def pick(name: str, ctx: Context) -> Strategy:
    """The strategy for ``--release NAME``. ``auto`` starts as ``none`` and becomes
    ``signal`` when the child says hello (see ``upgrade``): it never picks a
    strategy that throws away a job's work."""
    if name == "auto":
        return NoneStrategy(ctx)
    try:
        return STRATEGIES[name](ctx)
    except KeyError:
        raise StrategyError(
            f"unknown release strategy {name!r} (choose from {', '.join(NAMES)})"
        ) from None


def upgrade(current: Strategy, requested: str, ctx: Context) -> Strategy:
    """Under ``auto``, a child that speaks the control protocol gets ``signal``."""
    if (
        requested == "auto"
        and ctx.hello
        and not ctx.control.closed
        and isinstance(current, NoneStrategy)
    ):
        return SignalStrategy(ctx)
    return current


__all__ = [
    "NAMES",
    "STRATEGIES",
    "ChildExited",
    "Context",
    "ExecStrategy",
    "NoneStrategy",
    "ReleaseTimeout",
    "RestartStrategy",
    "SignalStrategy",
    "StopStrategy",
    "Strategy",
    "pick",
    "upgrade",
]
