"""What every release strategy gets, and what it must do."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import ClassVar

from ..control import ParentEnd
from ..errors import ControlError, StrategyError
from ..process import Child

# How long a forceful release lets the process group act on SIGTERM before SIGKILL.
KILL_GRACE = 2.0
# After SIGKILL, how long the command's processes get to be gone before that is an error.
KILL_WAIT = 5.0
# A command whose control socket closed is given this long to be seen exiting.
CLOSE_TO_EXIT = 1.0


class ChildExited(Exception):
    """The command exited by itself while a strategy was waiting on it."""


class ReleaseTimeout(Exception):
    """The graceful release did not finish before --yield-within ran out."""


# What a process that freed its own memory keeps on the GPU: its CUDA context.
CONTEXT_ALLOWANCE = 768 << 20


class Unverified(StrategyError):
    """The strategy says the memory is free, NVML says it is not (yet)."""


class Interrupted(Exception):
    """The wrapper was told to end (SIGTERM, Ctrl-C) while a strategy was waiting on
    the command: the wait is abandoned so the wrapper stays responsive."""


@dataclass
class Settings:
    """What the user said about the strategy on the command line."""

    on_release: str | None = None  # exec
    on_restore: str | None = None  # exec
    restart_grace: float = 10.0  # restart: SIGTERM to SIGKILL when --yield-within is not given
    # The GPUs' NVML indices, for verified releases and free-VRAM checks (None: every GPU).
    gpus: tuple[int, ...] | None = None
    verify_timeout: float = 10.0  # how long a release waits for NVML to show the memory gone
    preset: str | None = None  # http: the engine (presets.PRESETS); None: the URLs below
    on_release_url: str | None = None  # http without a preset: POSTed to release
    on_restore_url: str | None = None  # http without a preset: POSTed to restore
    upstream: str | None = None  # the server's address, when given (--upstream)


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


class Strategy:
    """Releases and restores the command's GPU memory.

    Before anything is locked, ``fit`` may refuse the command; just before its first
    start, ``prepare`` may adjust it. ``release`` returns once the memory is free; then
    ``verify`` confirms it (NVML, where available) and the token is dropped; ``restore``
    runs once the token is ours again. Class facts the runner and ``auto`` use:

    - ``releases``: False for ``none``, which holds the token until the command exits;
    - ``relaunches``: the process is ended on release and started again on restore;
    - ``stops``: the process is kept but stopped (it must never run without the token);
    - ``defers_signals``: signals for the command wait until it is restored (a
      checkpointed process that runs its exit path fails its CUDA calls, and then
      cannot be restored).
    """

    name: ClassVar[str]
    releases: ClassVar[bool] = True
    relaunches: ClassVar[bool] = False
    stops: ClassVar[bool] = False
    defers_signals: ClassVar[bool] = False
    keeps_state: ClassVar[bool] = True

    def __init__(self, ctx: Context, settings: Settings) -> None:
        self.ctx = ctx
        self.settings = settings
        self.killed = False  # the command was ended: restore starts it again

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

    def wait_ready(self) -> None:
        """The command was just started: return once it serves (a preset knows how to
        tell; StrategyError when it does not in time). Clients held by a proxy are let
        through after this."""

    def release(self, deadline: float | None) -> None:
        raise StrategyError(f"the {self.name} strategy never releases")

    def verify(self, deadline: float | None) -> None:
        """Confirm the memory is really free before the token is dropped (NVML, if any).

        A process that freed its tensors itself keeps its CUDA context (about half a
        GiB): that much per process is allowed.
        """
        self.verify_gone(self.ctx.child.processes, keep_bytes=CONTEXT_ALLOWANCE)

    def verify_gone(self, pids_of: Callable[[], list[int]], *, keep_bytes: int) -> None:
        """Wait until NVML shows the processes ``pids_of()`` names holding at most
        ``keep_bytes`` each; Unverified after ``verify_timeout``. Nothing to check (and
        no /proc scan on the handoff path) without NVML."""
        from .. import nvml

        try:
            if not nvml.available():
                return
            pids = pids_of()
            gpus = self.settings.gpus
            per_pid = nvml.processes(gpus)
            on_gpu = [p for p in pids if p in per_pid]
            # Per process and GPU: a context on each GPU the process uses.
            allowed = keep_bytes * len(on_gpu) * (1 if gpus is None else len(gpus))
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
