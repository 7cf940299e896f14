"""What every release strategy gets, and what it must do."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import ExitStack
from dataclasses import dataclass
from typing import ClassVar

from ..command.context import CLOSE_TO_EXIT as CLOSE_TO_EXIT
from ..command.context import ChildExited as ChildExited
from ..command.context import Context as Context
from ..command.context import Interrupted as Interrupted
from ..command.context import ReleaseTimeout as ReleaseTimeout
from ..errors import StrategyError

# How long a forceful release lets the process group act on SIGTERM before SIGKILL.
KILL_GRACE = 2.0
# After SIGKILL, how long the command's processes get to be gone before that is an error.
KILL_WAIT = 5.0


# What a process that freed its own memory keeps on the GPU: its CUDA context.
CONTEXT_ALLOWANCE = 768 << 20


class Unverified(StrategyError):
    """The strategy says the memory is free, NVML says it is not (yet)."""


@dataclass(kw_only=True)
class StrategyOptions:
    """What the user says about the strategy on the command line (``vramlock run``'s
    options, the runner's RunOptions, are these and more)."""

    on_release: str | None = None  # exec
    on_restore: str | None = None  # exec
    preset: str | None = None  # http: the engine (presets.PRESETS); None: the URLs below
    on_release_url: str | None = None  # http without a preset: POSTed to release
    on_restore_url: str | None = None  # http without a preset: POSTed to restore
    upstream: str | None = None  # the server's address, when given (--upstream)
    release_within: float | None = None  # a release not answered by then is refused


@dataclass(kw_only=True)
class Settings(StrategyOptions):
    """A strategy's settings: the user's options, and what the runner knows besides."""

    restart_grace: float = 10.0  # restart: SIGTERM to SIGKILL when --yield-within is not given
    # The GPUs' NVML indices, for verified releases and free-VRAM checks (None: every GPU).
    gpus: tuple[int, ...] | None = None
    verify_timeout: float = 10.0  # how long a release waits for NVML to show the memory gone


class Strategy:
    """Releases and restores the command's GPU memory.

    Before anything is locked, ``fit`` may refuse the command; just before its first
    start, ``prepare`` may adjust it. ``release`` returns once the memory is free; then
    ``verify`` confirms it (NVML, where available) and the token is dropped; ``restore``
    runs once the token is ours again. Facts the runner uses (a subclass states them
    as class attributes; ``auto`` passes on those of the strategy it chose):

    - ``releases``: False for ``none``, which holds the token until the command exits;
    - ``stops``: the process is kept but stopped (it must never run without the token);
    - ``defers_signals``: signals for the command wait until it is restored (a
      checkpointed process that runs its exit path fails its CUDA calls, and then
      cannot be restored);
    - ``killed``: the last release ended the command; restore starts it again.

    ``keeps_state`` (False for ``restart``) is a class fact ``auto`` chooses by.
    """

    name: ClassVar[str]
    keeps_state: ClassVar[bool] = True

    def __init__(self, ctx: Context, settings: Settings) -> None:
        self.ctx = ctx
        self.settings = settings
        self.killed = False

    @property
    def releases(self) -> bool:
        return True

    @property
    def stops(self) -> bool:
        return False

    @property
    def ended_by_command(self) -> bool:
        """Its release ends the command by a command of the user's (``restart``'s
        ``--on-release``): an order to end is carried out by releasing, not passed on
        (a signal would not reach a container's process)."""
        return False

    @property
    def defers_signals(self) -> bool:
        return False

    @property
    def label(self) -> str:
        """How ``who`` shows the strategy."""
        return self.name

    @property
    def note(self) -> str | None:
        """What ``who`` should add about how it releases (``auto``: why swap could not
        be used), or None."""
        return None

    @property
    def undecided(self) -> bool:
        """Does not release, but may change its mind once somebody waits (``auto``):
        the runner keeps probing for waiters meanwhile."""
        return False

    def settle(self, wanted: Callable[[], bool]) -> str | None:
        """Resident: a policy may change how it releases (``auto``). ``wanted`` probes
        for waiters. Returns what to tell the user, once, or None."""
        return None

    def fall_back(self, err: Exception) -> bool:
        """The command cannot be released this way any more (its control channel broke,
        the driver refused a checkpoint). True when the strategy found another way
        (``auto``); False: the command holds the GPU until it exits."""
        return False

    @classmethod
    def finds_work(cls, ctx: Context) -> bool:
        """Once somebody waits: is the running command one this strategy can release?
        (For ``auto``, which turns to the first that can.)"""
        return False

    @classmethod
    def recognises(cls, command: list[str]) -> bool:
        """Would ``auto`` pick this strategy for ``command`` before it says anything?"""
        return False

    @classmethod
    def fit(cls, command: list[str], env: Mapping[str, str], settings: Settings) -> None:
        """StrategyError when this strategy cannot work with ``command`` (run in ``env``):
        checked before anything is locked or started."""

    @classmethod
    def prepare(cls, command: list[str], env: dict[str, str], scratch: ExitStack) -> list[str]:
        """The command to start, just before its first start: a strategy may add arguments
        and set variables in ``env``; what it makes for the run goes on ``scratch``, which
        the runner closes once the command is gone."""
        return command

    def release(self, deadline: float | None) -> None:
        raise StrategyError(f"the {self.name} strategy never releases")

    def verify(self, deadline: float | None) -> None:
        """Confirm the memory is really free before the token is dropped (NVML, if any).

        A process that freed its tensors itself keeps its CUDA context (about half a
        GiB): that much per process is allowed.
        """
        self.verify_gone(self.ctx.child.owns, keep_bytes=CONTEXT_ALLOWANCE)

    def verify_gone(self, ours: Callable[[int], bool], *, keep_bytes: int) -> None:
        """Wait until NVML shows the command's processes (the pids ``ours`` accepts)
        holding at most ``keep_bytes`` each; Unverified after ``verify_timeout``.

        This is on the handoff path: memory that is free already (the usual case) costs
        one NVML query, and only the few pids NVML lists are looked at, never every
        process on the machine. Nothing to check without NVML."""
        from ..gpu import nvml

        try:
            if not nvml.available():
                return
            gpus = self.settings.gpus
            per_pid = nvml.processes(gpus)
            on_gpu = [p for p in per_pid if ours(p)]
            # Per process and GPU: a context on each GPU the process uses.
            allowed = keep_bytes * len(on_gpu) * (1 if gpus is None else len(gpus))
            if sum(per_pid[p] for p in on_gpu) <= allowed:
                return
            if nvml.wait_released(on_gpu, gpus, self.settings.verify_timeout,
                                  keep_bytes=allowed):  # fmt: skip
                return
            held = nvml.used_by(on_gpu, gpus)
        except nvml.NvmlError:
            return  # NVML cannot say: the release stands as the strategy reported it
        raise Unverified(
            f"NVML still shows {held / 2**20:.0f} MiB held by the command"
            f" {self.settings.verify_timeout:g} s after its release"
        )

    def park_in(self) -> float | None:
        """Released: how soon what the release left on the GPU (``swap``: each process's
        CUDA context) should leave it too, in seconds (0: now); None: never."""
        return None

    def park(self) -> None:
        """Released: take what the release left on the GPU off it too (``park_in``)."""

    def come_back_early(self) -> None:
        """Queued for the token, which another member holds: bring back now what may come
        back without the command running on the GPU (``swap``: parked contexts, while its
        processes stay held), so that less of the restore waits for the token."""

    @property
    def holds_processes(self) -> bool:
        """Released, are the command's processes kept off the GPU one by one (``swap``,
        ``checkpoint``), so that one that starts CUDA afterwards beyond the strategy's
        reach must be watched for (``loose``)? False where the release leaves nothing of
        the command that could (``restart``, ``stop``) or the program keeps it (``none``,
        a preset's engine)."""
        return False

    def loose(self, pids: list[int]) -> tuple[list[int], list[int]]:
        """Released: among ``pids`` (processes of the command), those that may run on the
        GPU now without this strategy holding them, and those that do not use CUDA yet
        but would not be held if they began to (to be looked at more often)."""
        return [], []

    def end_command(self, grace: float) -> None:
        """End every process of the command (the leader, its group, adopted orphans);
        StrategyError, and the token kept, while any of them lives."""
        survivors = self.ctx.child.end_all(grace, KILL_WAIT)
        self.ctx.child.poll()
        if survivors:
            raise StrategyError(
                "processes of the command are still alive after SIGKILL"
                f" ({', '.join(map(str, survivors))}); keeping the GPU until they are gone"
            )
        self.killed = True

    def force(self) -> None:
        """The forceful path after --yield-within: end the command; restore relaunches."""
        self.end_command(KILL_GRACE)

    def restore(self) -> None:
        if self.killed:
            self.killed = False
            self.ctx.start_again()
            return
        self._restore()

    def _restore(self) -> None:
        pass
