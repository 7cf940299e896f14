"""``vramlock run``'s options, checked before anything is locked or started."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field, fields

from .. import strategies
from ..arena.directory import default_gpu, one_arena_or_gpus
from ..arena.member import DEFAULT_MIN_HOLD
from ..errors import UsageError
from . import demand as demands

# --demand listen: a connection is busy until this long without traffic, and clients wait
# this long for a restored server to accept connections before they are closed.
DEFAULT_IDLE = 0.3
DEFAULT_READY_WITHIN = 120.0

DEMANDS = tuple(demands.DEMANDS)


def _quiet(message: str) -> None:
    """The library never prints: the command line passes a ``warn`` that does."""


@dataclass(kw_only=True)
class RunOptions(strategies.StrategyOptions):
    """``vramlock run``'s options (those about the strategy are StrategyOptions')."""

    command: list[str]
    arena: str | None = None
    gpus: tuple[int, ...] = ()  # --gpu: in the order given; () for --arena or the default
    name: str | None = None
    release: str = "auto"
    demand: str = "always"
    timeout: float | None = None  # None: wait forever; 0: -n
    min_hold: float = DEFAULT_MIN_HOLD
    yield_within: float | None = None
    listen: str | None = None  # --demand listen: where clients connect (and --upstream)
    idle: float | None = None  # --demand listen; None: DEFAULT_IDLE
    ready_within: float | None = None  # --demand listen; None: DEFAULT_READY_WITHIN
    ready_url: str | None = None  # --demand listen; None: the engine's (presets.ready_url)
    vram: int | None = None  # --vram: the footprint in bytes, for an arena with a budget
    warn: Callable[[str], None] = field(default=_quiet)

    @functools.cached_property
    def settings(self) -> strategies.Settings:
        """The strategy's settings: made once, from the options."""
        given = {f.name: getattr(self, f.name) for f in fields(strategies.StrategyOptions)}
        gpus = self.gpus or (None if self.arena else (default_gpu(),))
        return strategies.Settings(**given, gpus=gpus)

    def check(self) -> None:
        """Reject option mixes that cannot work, before anything is locked or started."""
        if not self.command:
            raise UsageError("no command given (usage: vramlock run [OPTIONS] -- COMMAND...)")
        one_arena_or_gpus(self.arena, self.gpus)
        self.release = strategies.check(self.release, self.settings, self.command)
        demands.check(self.demand)
        self._check_listen()

    def _check_listen(self) -> None:
        # --upstream alone is the http strategy's business.
        if self.demand != "listen":
            if (self.listen, self.idle, self.ready_within, self.ready_url) != (None,) * 4:
                raise UsageError(
                    "--listen, --idle, --ready-within and --ready-url need --demand listen"
                )
            return
        from ..net.address import same_socket

        if self.ready_url is not None and not self.ready_url.startswith("/"):
            raise UsageError(f"--ready-url: a path is wanted (/health), not {self.ready_url!r}")
        if self.listen is None or self.upstream is None:
            raise UsageError("--demand listen needs --listen ADDR and --upstream ADDR")
        if same_socket(self.listen, self.upstream):
            raise UsageError(
                f"--listen {self.listen} and --upstream {self.upstream} are the same socket:"
                " the proxy would forward to itself"
            )
