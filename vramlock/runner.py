"""``vramlock run`` and ``vramlock wait``: the wrapper around a command, and the shell's waiter.

The runner takes the token as a waiter *before* it starts the command, then loops:
probe want.lock while resident, release through the strategy when somebody
waits, drop the token, come back by ``--demand``. The command inherits the
token's open file description, so a SIGKILLed runner cannot leave it resident
without the token: the lock lives as long as the command does.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import FrameType

from . import strategies
from .arena import Arena
from .control import ParentEnd
from .errors import ControlError, NotObtained, StrategyError, UsageError
from .hint import Hint, drain
from .member import DEFAULT_MIN_HOLD, Member, State
from .process import Child, Terminal, exit_code

# How often a resident probes want.lock when nothing wakes it. Waiters that ring (ours, the
# nested flock(1) form) wake it at once through the inotify hint, so with the hint this only
# bounds how late a peer that does not ring is seen - and sets the idle CPU: 20 wake-ups a
# second cost 0.65 % of a core on a 2-vCPU VM, 4 a second 0.1-0.2 %.
PROBE_INTERVAL = 0.25
PROBE_INTERVAL_NO_HINT = 0.05  # no inotify: probing is all there is
# After a failed release (a hook exited non-zero), stay resident this long before retrying.
RETRY_AFTER_FAILURE = 1.0

DEMANDS = ("always", "child")
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
_ENDING = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT}


def _warn(message: str) -> None:
    print(f"vramlock: {message}", file=sys.stderr, flush=True)


@dataclass
class RunOptions:
    command: list[str]
    arena: str | None = None
    gpu: int | None = None
    name: str | None = None
    release: str = "auto"
    demand: str = "always"
    timeout: float | None = None  # None: wait forever; 0: -n
    min_hold: float = DEFAULT_MIN_HOLD
    yield_within: float | None = None
    on_release: str | None = None
    on_restore: str | None = None
    warn: Callable[[str], None] = field(default=_warn)

    def check(self) -> None:
        """Reject option mixes that cannot work, before anything is locked or started."""
        if not self.command:
            raise UsageError("no command given (usage: vramlock run [OPTIONS] -- COMMAND...)")
        hooks = self.on_release is not None or self.on_restore is not None
        if hooks and self.release == "auto":
            self.release = "exec"
        if self.release not in strategies.NAMES:
            raise StrategyError(
                f"unknown release strategy {self.release!r}"
                f" (choose from {', '.join(strategies.NAMES)})"
            )
        if self.demand not in DEMANDS:
            raise StrategyError(
                f"unknown demand {self.demand!r} (choose from {', '.join(DEMANDS)})"
            )
        if hooks and self.release != "exec":
            raise UsageError("--on-release/--on-restore need --release exec")
        if self.release == "exec" and self.on_release is None:
            raise UsageError("--release exec needs --on-release COMMAND")


class _Terminated(Exception):
    def __init__(self, signum: int) -> None:
        self.signum = signum


def _raise_terminated(signum: int, frame: FrameType | None) -> None:
    raise _Terminated(signum)


def _ignore(signum: int, frame: FrameType | None) -> None:
    pass


class Runner:
    """One ``vramlock run``: take the token, start the command, hand over to a Supervisor."""

    def __init__(self, opts: RunOptions) -> None:
        self.opts = opts
        self.arena: Arena | None = None
        self.member: Member | None = None
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._supervisor: Supervisor | None = None
        self._early_signals: list[int] = []

    def run(self) -> int:
        opts = self.opts
        opts.check()
        old = {s: signal.signal(s, _raise_terminated) for s in (signal.SIGTERM, signal.SIGHUP)}
        try:
            self.arena = Arena.open(opts.arena, opts.gpu)
            self.member = Member(
                self.arena,
                name=opts.name,
                min_hold=opts.min_hold,
                command=opts.command,
                strategy=opts.release,
            )
            if not self.member.acquire(opts.timeout):
                raise NotObtained(opts.timeout or 0.0)
        except _Terminated as t:
            self._close()
            return 128 + t.signum
        except KeyboardInterrupt:
            self._close()
            return 128 + signal.SIGINT
        except BaseException:
            self._close()
            raise
        finally:
            for s, h in old.items():
                signal.signal(s, h)
        try:
            return self._supervise(self.arena, self.member)
        finally:
            self._close()

    def _close(self) -> None:
        if self.member is not None:
            self.member.close()
            self.member = None
        if self.arena is not None:
            self.arena.close()
            self.arena = None
        os.close(self._wake_r)
        os.close(self._wake_w)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self._supervisor is None:
            self._early_signals.append(signum)  # the command is being started
        else:
            self._supervisor.on_signal(signum)

    def _supervise(self, arena: Arena, member: Member) -> int:
        opts = self.opts
        control = ParentEnd()
        env = dict(os.environ)
        env.update(control.child_env(member.token.fd))
        env["VRAMLOCK_ARENA"] = arena.path
        # Handlers first: a signal that arrives while the command starts must be
        # passed on, not kill us with the default action.
        old_wakeup = signal.set_wakeup_fd(self._wake_w, warn_on_full_buffer=False)
        old_handlers = {s: signal.signal(s, self._on_signal) for s in FORWARDED}
        old_handlers.update({s: signal.signal(s, _ignore) for s in WATCHED})
        hint = Hint(arena.dirfd)
        child: Child | None = None
        try:
            fds = (control.child_fd, member.token.fd)
            child = Child(opts.command, env, fds, terminal=Terminal.if_foreground())
            control.started()
            sup = Supervisor(opts, member, child, control, self._wake_r)
            self._supervisor = sup
            for signum in self._early_signals:
                sup.on_signal(signum)
            return sup.loop(hint)
        finally:
            for s, h in old_handlers.items():
                signal.signal(s, h)
            signal.set_wakeup_fd(old_wakeup)
            hint.close()
            gone = (
                child is None
                or child.status is not None
                or (self._supervisor is not None and self._supervisor.strategy.killed)
            )
            if member.token.held and gone:
                # Explicitly: the command's descendants may still share this open
                # file description, and must not keep the token.
                member.token.release()
            elif member.token.held:
                # We are failing while the command runs: it keeps the token (the
                # description it shares with us) until it exits. No LOCK_UN.
                member.token.held = False
            control.close()
            if child is not None:
                child.close()


class Supervisor:
    """The loop around a running command: probe, release, re-queue, restore."""

    def __init__(
        self, opts: RunOptions, member: Member, child: Child, control: ParentEnd, wake_r: int
    ) -> None:
        self.opts = opts
        self.member = member
        self.child = child
        self.ctx = strategies.Context(
            child=child,
            control=control,
            on_release=opts.on_release,
            on_restore=opts.on_restore,
        )
        self.strategy = strategies.pick(opts.release, self.ctx)
        self.pending_signal: int | None = None
        self._wake_r = wake_r
        self._acquired_r, self._acquired_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._acquire_error: BaseException | None = None
        self._acquire_done = False
        self._retry_at = 0.0
        self._describe()

    def _describe(self) -> None:
        name = self.strategy.name
        if self.opts.release == "auto":
            name = f"auto:{name}"
        self.member.describe(strategy=name, child_pid=self.child.pid)

    def on_signal(self, signum: int) -> None:
        if self.child.status is None and not self.strategy.killed:
            self.child.signal_group(signum)
        if signum in _ENDING:
            self.pending_signal = signum
            # A command stopped by `--release stop` acts on it once it is resumed,
            # which needs the token: ask for it back.
            self.ctx.wants = True

    def _job_control(self) -> None:
        """Keyboard stops of the command (Ctrl-Z, a read from the terminal in the background)."""
        stops, self.child.stops[:] = list(self.child.stops), []
        ours = isinstance(self.strategy, strategies.StopStrategy) and (
            self.member.state is not State.RESIDENT
        )
        terminal = self.child.terminal
        if not stops or ours or terminal is None:
            return
        if stops[-1] in (signal.SIGTTIN, signal.SIGTTOU):
            # It touched the terminal before we made it the foreground group.
            terminal.give(self.child.pid)
        else:
            terminal.suspend_like_child()
        self.child.signal_group(signal.SIGCONT)

    def _child_gone(self) -> int | None:
        if self.strategy.killed:
            return None
        return self.child.poll()

    def loop(self, hint: Hint) -> int:
        member, ctx = self.member, self.ctx
        while True:
            status = self._child_gone()
            if status is not None:
                return exit_code(status)
            self._job_control()
            if self.strategy.killed and self.pending_signal is not None:
                return 128 + self.pending_signal  # nothing is running to pass it to

            ctx.take_lines(ctx.control.read_lines())
            upgraded = strategies.upgrade(self.strategy, self.opts.release, ctx)
            if upgraded is not self.strategy:
                self.strategy = upgraded
                self._describe()

            timeout: float | None = None
            watch = [self._wake_r]
            if self.child.pidfd is not None and not self.strategy.killed:
                watch.append(self.child.pidfd)
            elif not self.strategy.killed:
                timeout = PROBE_INTERVAL_NO_HINT  # no pidfd: poll for the exit
            if not ctx.control.closed:
                watch.append(ctx.control.fileno())

            if member.state is State.RESIDENT and self.strategy.releases:
                now = time.monotonic()
                if now >= self._retry_at and member.should_release():
                    status = self._release()
                    if status is not None:
                        return status
                    continue
                interval = PROBE_INTERVAL_NO_HINT
                if hint.fd is not None:
                    watch.append(hint.fd)
                    interval = PROBE_INTERVAL
                hold_left = member.resident_since + member.min_hold - now
                interval = interval if hold_left <= 0 else min(interval, hold_left)
                timeout = interval if timeout is None else min(timeout, interval)
                if self._retry_at > now:
                    timeout = min(timeout, self._retry_at - now)
            elif member.state is State.RELEASED:
                # A command that was ended cannot say `want`: it comes back on its turn.
                if self.opts.demand == "always" or ctx.wants or self.strategy.killed:
                    self._start_acquire()
                    continue
            elif member.state is State.WAITING:
                watch.append(self._acquired_r)
                if self._acquire_done:
                    status = self._restore()
                    if status is not None:
                        return status
                    continue

            self._wait(watch, timeout)
            hint.drain()

    def _wait(self, fds: list[int], timeout: float | None) -> None:
        with contextlib.suppress(InterruptedError):
            select.select(fds, [], [], timeout)
        drain(self._wake_r)

    # -- transitions -------------------------------------------------------------

    def _release(self) -> int | None:
        """RESIDENT -> RELEASED. Returns an exit status if the command ended meanwhile."""
        member = self.member
        member.releasing()
        y = self.opts.yield_within
        started = time.monotonic()
        deadline = None if y is None else started + y
        try:
            self.strategy.release(deadline)
        except strategies.ReleaseTimeout:
            waited = time.monotonic() - started
            self.opts.warn(
                f"{self.strategy.name} release did not finish within {waited:.1f} s;"
                " ending the command (it is started again on its turn)"
            )
            self.strategy.force()
        except strategies.ChildExited:
            return exit_code(self.child.poll() or 0)
        except ControlError as err:
            self.opts.warn(f"{err}; holding the GPU until it exits")
            self.ctx.hello = False
            self.strategy = strategies.NoneStrategy(self.ctx)
            self._describe()
            member.resident()
            return None
        except StrategyError as err:
            self.opts.warn(f"release failed: {err}; staying resident")
            self._retry_at = time.monotonic() + RETRY_AFTER_FAILURE
            member.resident()
            return None
        member.release()
        return None

    def _start_acquire(self) -> None:
        member = self.member
        member.wait_polite()
        drain(self._acquired_r)
        member.waiting()
        self._acquire_error = None
        self._acquire_done = False

        # Blocking in the kernel's queue from a thread keeps the main loop free to
        # forward signals and notice the command's exit. The thread only locks;
        # every change of state happens here, in the loop.
        def acquire() -> None:
            try:
                member.take_token(None)
            except BaseException as err:  # surfaced by the loop in _restore
                self._acquire_error = err
            self._acquire_done = True
            os.write(self._acquired_w, b"!")

        threading.Thread(target=acquire, name="vramlock-acquire", daemon=True).start()

    def _restore(self) -> int | None:
        member = self.member
        self._acquire_done = False
        if self._acquire_error is not None:
            raise self._acquire_error
        member.restoring()
        try:
            self.strategy.restore()
        except strategies.ChildExited:
            return exit_code(self.child.poll() or 0)
        except (ControlError, StrategyError) as err:
            self.opts.warn(f"restore: {err}")
        if self.child.pid != member.records.record.child_pid:  # started again
            self._describe()
        member.resident()
        self.ctx.wants = False
        return None


def run(opts: RunOptions) -> int:
    """``vramlock run``: the command's exit status (128+N if killed by signal N)."""
    return Runner(opts).run()


def wait(
    arena: str | None = None,
    gpu: int | None = None,
    *,
    timeout: float | None = None,
    passive: bool = False,
    fd: int | None = None,
) -> None:
    """``vramlock wait``: queue as a waiter (residents step aside) until the token is ours.

    Without ``fd`` the token is dropped again when this returns. With ``fd`` the
    lock is taken on that descriptor's open file description (the calling
    shell's), so it stays held after we exit. Raises NotObtained.
    """
    opened = Arena.open(arena, gpu)
    try:
        member = Member(
            opened,
            name="vramlock wait",
            command=sys.argv,
            strategy="wait --free" if passive else "wait",
            token_fd=fd,
        )
        try:
            if not member.acquire(timeout, wanting=not passive):
                raise NotObtained(timeout or 0.0)
        finally:
            if fd is not None:
                # The lock is the caller's: closing our copy keeps it, LOCK_UN would not.
                member.token.held = False
            member.close()
    finally:
        opened.close()
