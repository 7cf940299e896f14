"""The wrapped command's processes and the signals meant for them.

``vramlock run`` routes every signal it forwards here from the moment the command
starts, before anything that can block: an order to end is passed on (or held back
from a command that must not act on it yet), counted, and breaks whatever wait the
token loop (``runner.Scheduler``) is in. Here too: keyboard stops, adopted orphans,
and the command's exit with whatever it leaves running.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from ..arena.member import Member, State
from ..command.context import Context
from ..command.process import Child
from ..errors import StrategyError
from ..strategies.base import KILL_WAIT, Strategy

# SIGCHLD only wakes the loop (through the wakeup fd): exits and keyboard stops.
WATCHED = (signal.SIGCHLD,)
FORWARDED = (
    signal.SIGINT,
    signal.SIGTERM,
    signal.SIGHUP,
    signal.SIGQUIT,
    signal.SIGUSR1,
    signal.SIGUSR2,
    signal.SIGWINCH,
)
ENDING = frozenset({signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT})
# Processes a command leaves behind when it exits get this long to act on SIGTERM.
LEFTOVER_GRACE = 2.0


class Woken(Exception):
    """Breaks a blocking wait for the token: the command exited or we were told to end."""


class Supervision:
    """Signals for the command, its stops, its exit. ``strategy`` is the token loop's
    (None until it has one): it says whether a command is there to pass signals to."""

    def __init__(
        self,
        child: Child,
        ctx: Context,
        member: Member,
        warn: Callable[[str], None],
    ) -> None:
        self.child = child
        self.ctx = ctx
        self.member = member
        self.strategy: Strategy | None = None
        # Processes of the command stopped while it is released (.strays): pid: start.
        self.strays: dict[int, int] = {}
        self.pending_signal: int | None = None  # the last order to end
        self.ending_since: float | None = None  # when the first one came
        self.told_at: float | None = None  # when an order to end first reached the command
        self.queued = False  # the token loop is blocked in the kernel's queue for the token
        self.signalled = True  # a signal arrived (through the wakeup fd) since we last looked
        self.all_gone = False  # every process of the command has ended
        self._deferred: list[int] = []  # signals kept from a checkpointed command
        self._told_pid = 0  # the child an order to end was last passed to
        self._warn = warn
        self._warned: set[str] = set()

    def use(self, strategy: Strategy) -> None:
        """The token loop's strategy from now on."""
        self.strategy = strategy

    @contextmanager
    def queueing(self) -> Iterator[None]:
        """The token loop blocks in the kernel's queue for the token meanwhile: an exit
        or an order to end breaks the wait (Woken)."""
        self.queued = True
        try:
            yield
        finally:
            self.queued = False

    def woken(self, signalled: bool) -> None:
        """The loop woke; ``signalled``: a signal came through the wakeup fd."""
        self.signalled = signalled or self.signalled

    def warn(self, message: str, *, once: bool = False) -> None:
        """Pass a diagnostic to the caller; a diagnostic must never end the run."""
        if once:
            if message in self._warned:
                return
            self._warned.add(message)
        try:
            self._warn(message)
        except Exception:
            pass  # a closed stderr: the GPU work matters more than the message

    @property
    def _away(self) -> bool:
        """A release ended the command: nothing runs to pass a signal to."""
        return self.strategy is not None and self.strategy.killed

    def on_signal(self, signum: int) -> None:
        """From the signal handler: route ``signum``; may raise Woken (the token loop is
        queued) or Interrupted (a strategy waits interruptibly)."""
        if signum == signal.SIGCHLD:
            if self.queued:
                raise Woken  # the command may have exited: look before waiting on
            return
        if self.child.status is None and not self._away:
            # A stray stopped meanwhile (.strays) gets it all the same: it stays stopped,
            # the signal waiting in it for the command's turn, or is ended by it there.
            held = self.strategy is not None and self.strategy.defers_signals
            if held and self.member.state is not State.RESIDENT:
                self._deferred.append(signum)  # passed on once it is restored
            elif not (signum in ENDING and self.ended_by_releasing):
                self.pass_on(signum)
        if signum in ENDING:
            self.pending_signal = signum
            if self.ending_since is None:
                self.ending_since = time.monotonic()
            self.ctx.ending()  # raises inside a strategy's interruptible wait
            if self.queued:
                raise Woken

    def pass_on(self, signum: int) -> None:
        try:
            self.child.signal_group(signum)
        except StrategyError:
            pass  # a setuid command: it keeps the token we share until it exits
        if signum in ENDING:
            self._told_pid = self.child.pid
            if self.told_at is None:
                self.told_at = time.monotonic()

    def deaf_for(self, grace: float) -> float | None:
        """Seconds left before the command, told to end, has had ``grace`` to exit;
        None while it was not told, or has exited (or a release ended it)."""
        if self.told_at is None or self.child.status is not None or self._away:
            return None
        return self.told_at + grace - time.monotonic()

    def kill_deaf(self, grace: float) -> None:
        """The command did not end within ``grace`` of the order to end: SIGKILL every
        process of it (its group, its descendants, those that left the group)."""
        self.warn(
            f"the command did not end within {grace:g} s of"
            f" {signal.Signals(self.pending_signal or signal.SIGTERM).name}; killing it"
        )
        try:
            left = self.child.end_all(0.0, KILL_WAIT)
        except StrategyError as err:
            self.warn(f"{err}; holding the GPU until it exits")
            return
        if left:
            self.warn(f"processes {', '.join(map(str, left))} of the command outlived SIGKILL")
        self.child.poll()

    def resident_again(self) -> None:
        """The command is resident again: what it was told meanwhile reaches it now (the
        signals held back, an order to end that came while it was being started again)."""
        while self._deferred:
            self.pass_on(self._deferred.pop(0))
        told = self.pending_signal is not None and self._told_pid != self.child.pid
        if told and not self.ended_by_releasing:
            assert self.pending_signal is not None
            self.pass_on(self.pending_signal)

    @property
    def ended_by_releasing(self) -> bool:
        """An order to end is carried out by a release (``restart --on-release``), which
        the token loop makes, not passed on to the command."""
        return self.strategy is not None and self.strategy.ended_by_command

    def gone(self) -> int | None:
        """The command's wait status once it has exited by itself (not ended by a release)."""
        return None if self._away else self.child.poll()

    def ended_while_away(self) -> int | None:
        """Told to end while a release had ended the command: nothing runs to pass the
        signal to, and nothing is to be started again. Its status, then."""
        if self._away and self.pending_signal is not None:
            self.all_gone = True  # ended by us, every process reaped
            return 128 + self.pending_signal
        return None

    def tidy(self) -> None:
        """Reap adopted orphans that exited (after a SIGCHLD), and follow keyboard stops
        of the command (Ctrl-Z, a read from the terminal in the background)."""
        if self.signalled:
            self.signalled = False
            self.child.reap_orphans()
        stops, self.child.stops[:] = list(self.child.stops), []
        ours = self.strategy is not None and self.strategy.stops
        ours = ours or self.child.pid in self.strays  # the leader itself was a stray
        terminal = self.child.terminal
        if not stops or (ours and self.member.state is not State.RESIDENT) or terminal is None:
            return
        if stops[-1] in (signal.SIGTTIN, signal.SIGTTOU):
            # It touched the terminal before we made it the foreground group.
            terminal.give(self.child.pid)
        else:
            terminal.suspend_like_child()
        self.child.signal_group(signal.SIGCONT)

    def finish(self, code: int) -> int:
        """The command has exited: end what it left running, then give its status.

        The token is kept until every process of the command is gone: a worker left
        in its group (or adopted by us) would otherwise run while another member is
        resident. Leftovers get SIGTERM, then SIGKILL; one that cannot be ended keeps
        us (and the token) waiting for it.
        """
        left = self.child.processes()
        if left:
            pids = ", ".join(map(str, left))
            self.warn(
                f"the command exited and left {len(left)} process(es) running ({pids});"
                " ending them before the GPU is released"
            )
            self.member.describe(leftovers=left)
            # Those stopped while released stay stopped: they run only in the command's turn.
            stopped = set(self.strays) if self.member.state is not State.RESIDENT else set()
            try:
                left = self.child.end_all(LEFTOVER_GRACE, KILL_WAIT, stopped)
            except StrategyError as err:
                self.warn(f"{err}; holding the GPU until they exit")
            while left:
                self.warn(
                    f"processes {', '.join(map(str, left))} of the command are still alive;"
                    " holding the GPU until they are gone",
                    once=True,
                )
                self.member.describe(leftovers=left)
                left = self.child.wait_gone(1.0)
            self.member.describe(leftovers=[])
        self.all_gone = True
        return code
