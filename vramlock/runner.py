"""``vramlock run`` and ``vramlock wait``: the wrapper around a command, and the shell's waiter.

The runner takes the token as a waiter *before* it starts the command, then loops:
probe want.lock while resident, release through the strategy when somebody
waits, drop the token, come back by ``--demand``. The command inherits the
token's open file description, so a SIGKILLed runner cannot leave it resident
without the token: the lock lives as long as the command does.
"""

from __future__ import annotations

import contextlib
import functools
import os
import select
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from types import FrameType
from typing import TYPE_CHECKING

from . import demand as demands
from . import footprint as footprints
from . import strategies
from .arena import default_gpu, one_arena_or_gpus
from .budget import show_size
from .context import ChildExited, Context, Interrupted, ReleaseTimeout
from .control import ParentEnd
from .errors import ControlError, Immovable, NotObtained, StrategyError, UsageError
from .hint import Hint, drain
from .member import DEFAULT_MIN_HOLD, Member, Members, State, harmless_signals, join
from .process import Child, Terminal, become_subreaper, exit_code
from .strategies.basic import NoneStrategy
from .supervise import FORWARDED, WATCHED, Supervision, Woken

if TYPE_CHECKING:
    from .proxy import Proxy

# How often a resident probes want.lock when nothing wakes it. Waiters that ring (ours, the
# nested flock(1) form) wake it at once through the inotify hint, so with the hint this only
# bounds how late a peer that does not ring is seen - and sets the idle CPU: 20 wake-ups a
# second cost 0.65 % of a core on a 2-vCPU VM, 4 a second 0.1-0.2 %.
PROBE_INTERVAL = 0.25
PROBE_INTERVAL_NO_HINT = 0.05  # no inotify: probing is all there is
# After a failed release (a hook exited non-zero), stay resident this long before retrying.
RETRY_AFTER_FAILURE = 1.0
# --demand listen: a connection is busy until this long without traffic, and clients wait
# this long for a restored server to accept connections before they are closed.
DEFAULT_IDLE = 0.3
DEFAULT_READY_WITHIN = 120.0
# A command told to end (SIGTERM, Ctrl-C) keeps the GPU this long for its exit, as a busy
# one would (--yield-within still bounds it): two members told to end at once would
# otherwise hand the token back and forth, each getting only as far as the next request.
ENDING_GRACE = 10.0
# A job whose run a release ended (restart) is given, when started again, a turn at
# least this many times as long as the run it lost, whatever --min-hold says: a job
# longer than --min-hold would otherwise be ended before its end, again and again.
LOST_RUN_FACTOR = 2.0

DEMANDS = tuple(demands.DEMANDS)


def visible_devices(gpus: tuple[int, ...]) -> dict[str, str]:
    """The environment that shows a command the GPUs ``gpus`` (nvidia-smi's numbers)
    alone, in that order (the first is the command's device 0).

    CUDA numbers GPUs fastest first, nvidia-smi and NVML by PCI bus: name the GPUs by
    UUID where NVML can tell them, else by number in PCI bus order.
    """
    from . import nvml

    try:
        return {"CUDA_VISIBLE_DEVICES": ",".join(nvml.gpu(g).uuid for g in gpus)}
    except (nvml.NvmlUnavailable, nvml.NvmlError):
        return {
            "CUDA_VISIBLE_DEVICES": ",".join(map(str, gpus)),
            "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        }


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
        from .address import same_socket

        if self.ready_url is not None and not self.ready_url.startswith("/"):
            raise UsageError(f"--ready-url: a path is wanted (/health), not {self.ready_url!r}")
        if self.listen is None or self.upstream is None:
            raise UsageError("--demand listen needs --listen ADDR and --upstream ADDR")
        if same_socket(self.listen, self.upstream):
            raise UsageError(
                f"--listen {self.listen} and --upstream {self.upstream} are the same socket:"
                " the proxy would forward to itself"
            )


class _Terminated(Exception):
    def __init__(self, signum: int) -> None:
        self.signum = signum


class _Once:
    """A handler that raises on the first ending signal only: a second one arriving
    while we clean up after the first must not interrupt the cleanup."""

    def __init__(self) -> None:
        self.signum: int | None = None

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is None:
            self.signum = signum
            raise _Terminated(signum)


class Runner:
    """One ``vramlock run``: take the token, start the command, then Supervision and Scheduler."""

    def __init__(self, opts: RunOptions) -> None:
        self.opts = opts
        self.member: Member | Members | None = None
        self._joined = contextlib.ExitStack()  # the arenas and our membership of each
        self.proxy: Proxy | None = None
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._supervision: Supervision | None = None
        self._early_signals: list[int] = []

    def run(self) -> int:
        opts = self.opts
        opts.check()
        once = _Once()
        old = {s: signal.signal(s, once) for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)}
        try:
            try:
                with harmless_signals():
                    self.member = join(
                        self._joined,
                        opts.arena,
                        opts.gpus,
                        name=opts.name,
                        command=opts.command,
                        strategy=opts.release,
                        min_hold=opts.min_hold,
                        vram=opts.vram,
                        measure=opts.vram is None,
                    )
                    self._say_whole_gpu(self.member)
                    self.proxy = self._listen(self.member)
                    if not self.member.acquire(opts.timeout):
                        raise NotObtained(opts.timeout or 0.0)
            except (_Terminated, KeyboardInterrupt) as err:
                self._close()
                return 128 + (err.signum if isinstance(err, _Terminated) else signal.SIGINT)
            except BaseException:
                self._close()
                raise
        except _Terminated as t:  # a second signal during the cleanup of the first
            return 128 + t.signum
        finally:
            if once.signum is None:
                for s, h in old.items():
                    signal.signal(s, h)
            # else: we are ending on that signal; _Once ignores further ones until we exit
        if once.signum is not None:  # arrived between the lock and here
            self._close()
            return 128 + once.signum
        try:
            return self._supervise(self.member)
        finally:
            self._close()

    def _say_whole_gpu(self, member: Member | Members) -> None:
        """In an arena with a budget, a command without a footprint takes the whole GPU,
        or, where its footprint is measured, the whole budget until it is."""
        for m in member.members if isinstance(member, Members) else [member]:
            if m.budget is None:
                continue
            if m.share is None:
                self.opts.warn(
                    f"{m.arena.path} has a budget ({m.budget}); without --vram this"
                    " command takes the whole GPU"
                )
            elif m.footprint is not None and m.footprint.source == footprints.WHOLE:
                self.opts.warn(
                    f"{m.arena.path} has a budget ({m.budget}); without --vram this"
                    " command takes the whole budget until its footprint is measured"
                )

    def _listen(self, member: Member | Members) -> Proxy | None:
        """--demand listen: the proxy, listening before the command starts (and before we
        wait for the token: clients are held meanwhile, and a busy address fails at once)."""
        opts = self.opts
        if opts.listen is None or opts.upstream is None:
            return None
        from .proxy import Proxy
        from .strategies.presets import ready_url

        proxy = Proxy(
            opts.listen,
            opts.upstream,
            idle=DEFAULT_IDLE if opts.idle is None else opts.idle,
            ready_within=DEFAULT_READY_WITHIN if opts.ready_within is None else opts.ready_within,
            ready_url=opts.ready_url or ready_url(opts.command, opts.preset),
            report=lambda count: member.describe(connections=count),
            warn=opts.warn,
            working=member.working,
        )
        member.describe(listen=proxy.address, connections=0)
        return proxy

    def _close(self) -> None:
        if self.proxy is not None:
            self.proxy.close()
            self.proxy = None
        self.member = None
        self._joined.close()
        if self._wake_r >= 0:
            os.close(self._wake_r)
            os.close(self._wake_w)
            self._wake_r = self._wake_w = -1

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self._supervision is None:
            if signum != signal.SIGCHLD:
                self._early_signals.append(signum)  # the command is being started
        else:
            self._supervision.on_signal(signum)

    def _supervise(self, member: Member | Members) -> int:
        opts, arenas = self.opts, member.arenas
        control = ParentEnd()
        env = dict(os.environ)
        env.update(control.child_env(member.token_fds[0]))
        env["VRAMLOCK_ARENA"] = arenas[0].path
        if opts.gpus:
            env.update(visible_devices(opts.gpus))
        # Orphans of the command become our children: none can slip away unseen.
        become_subreaper()
        # Handlers first: a signal that arrives while the command starts must be
        # passed on, not kill us with the default action.
        old_wakeup = signal.set_wakeup_fd(self._wake_w, warn_on_full_buffer=False)
        old_handlers = {s: signal.signal(s, self._on_signal) for s in FORWARDED}
        old_handlers.update({s: signal.signal(s, self._on_signal) for s in WATCHED})
        hint = Hint(*(a.dirfd for a in arenas))
        child: Child | None = None
        scratch = contextlib.ExitStack()  # what the strategy made for the run
        try:
            command = strategies.prepare(opts.release, opts.settings, opts.command, env, scratch)
            fds = (control.child_fd, *member.token_fds)
            child = Child(command, env, fds, terminal=Terminal.if_foreground())
            control.started()
            ctx = Context(
                child=child, control=control, started=lambda pid: member.describe(child_pid=pid)
            )
            sup = self._supervision = Supervision(child, ctx, member, opts.warn)
            for signum in self._early_signals:
                sup.on_signal(signum)
            return Scheduler(opts, sup, self._wake_r, self.proxy).loop(hint)
        finally:
            for s, h in old_handlers.items():
                signal.signal(s, h)
            signal.set_wakeup_fd(old_wakeup)
            hint.close()
            gone = child is None or (self._supervision is not None and self._supervision.all_gone)
            # Gone: explicitly, so that a descendant that outlived the command while
            # sharing this open file description does not keep the token. Else we are
            # failing while the command runs: it keeps the token (the description it
            # shares with us) until it exits - no LOCK_UN.
            member.drop_token(unlock=gone)
            control.close()
            if child is not None:
                child.close()
            scratch.close()


class Scheduler:
    """The token loop around a running command: probe, release, re-queue, restore.

    Signals are the Supervision's business, routed before this is made (picking a
    strategy may take a while: NVML's first call)."""

    demand: demands.Demand  # made once the command serves (``loop``)

    def __init__(
        self, opts: RunOptions, sup: Supervision, wake_r: int, proxy: Proxy | None = None
    ) -> None:
        self.opts = opts
        self.sup = sup
        self.member = sup.member
        self.child = sup.child
        self.ctx = sup.ctx
        self.strategy = sup.strategy = strategies.pick(opts.release, self.ctx, opts.settings)
        self.proxy = proxy
        self._wake_r = wake_r
        self._retry_at = 0.0
        self._requeue_at = 0.0  # a restore found too little free VRAM: queue again then
        self._wanted_since: float | None = None  # a waiter was seen while the demand was busy
        self._busy_left = 0.0  # the demand asked to put the release off this long
        self._started = time.monotonic()  # when the command was (last) started
        self._lost_run = 0.0  # how long the run a release ended had lasted
        self.meter = self._meter()
        # This residency uses more than its units and no more are free: it steps aside.
        self._outgrown = False
        self._describe()

    def _meter(self) -> footprints.Meter | None:
        """NVML's sampler of the command's memory, for a budget share in one arena."""
        member = self.member
        if not isinstance(member, Member) or member.share is None:
            return None
        return footprints.meter(self.child.owns, self.opts.settings.gpus)

    def _describe(self) -> None:
        self._shown = self.strategy.label
        self.member.describe(strategy=self._shown, child_pid=self.child.pid)

    def _releases_now(self) -> bool:
        """Resident, able to release, past min_hold and any retry delay, wanted, and not
        busy, or busy for --yield-within since the waiter was seen."""
        self._busy_left = 0.0
        if not (
            self.member.state is State.RESIDENT
            and self.strategy.releases
            and time.monotonic() >= self._retry_at
            and (self._outgrown or self.member.should_release())
        ):
            self._wanted_since = None
            return False
        busy = self.demand.busy_for()
        ending_since = self.sup.ending_since
        if ending_since is not None and self.child.status is None:
            busy = max(busy, ending_since + ENDING_GRACE - time.monotonic())
        if busy > 0:
            now = time.monotonic()
            if self._wanted_since is None:
                self._wanted_since = now
            y = self.opts.yield_within
            if y is None or now < self._wanted_since + y:
                self._busy_left = busy if y is None else min(busy, self._wanted_since + y - now)
                return False
            self.sup.warn(f"still busy {y:g} s after somebody began to wait; releasing anyway")
        self._wanted_since = None
        return True

    def loop(self, hint: Hint) -> int:
        member, ctx, sup = self.member, self.ctx, self.sup
        # The proxy itself holds clients until the server is ready (--ready-url).
        self.demand = demands.make(self.opts.demand, self.ctx, self.proxy)
        # For budget waiters choosing whom to ask: how long a busy release may wait,
        # and a job taking turns works whenever it is resident.
        member.describe(yield_within=self.opts.yield_within)
        if self.demand.takes_turns:
            member.working(True)
        while True:
            status = sup.gone()
            if status is not None:
                return sup.finish(exit_code(status))
            if self._releases_now():
                # First, when somebody waits: the bookkeeping below can come after.
                status = self._release()
                if status is not None:
                    return status
                continue
            sup.tidy()
            status = sup.ended_while_away()
            if status is not None:
                return status
            if self.strategy.label != self._shown:  # auto chose another way as it released
                self._shown = self.strategy.label
                member.describe(strategy=self._shown)

            ctx.take_lines(ctx.control.read_lines())
            if member.state is State.RESIDENT:
                self._measure()
                label = self.strategy.label
                said = self.strategy.settle(member.wanted)  # auto may change its mind
                if said is not None:
                    self.sup.warn(said)
                if self.strategy.label != label:
                    self._describe()
                    continue

            timeout: float | None = None
            watch = [self._wake_r, *self.demand.fds()]
            if self.child.pidfd is not None and not self.strategy.killed:
                watch.append(self.child.pidfd)
            elif not self.strategy.killed:
                timeout = PROBE_INTERVAL_NO_HINT  # no pidfd: poll for the exit
            if not ctx.control.closed:
                watch.append(ctx.control.fileno())

            now = time.monotonic()
            interval = PROBE_INTERVAL if hint.fd is not None else PROBE_INTERVAL_NO_HINT
            if member.state is State.RESIDENT and self.strategy.releases:
                if hint.fd is not None:
                    watch.append(hint.fd)
                hold_left = member.resident_since + member.min_hold - now
                interval = interval if hold_left <= 0 else min(interval, hold_left)
                timeout = interval if timeout is None else min(timeout, interval)
                if self._retry_at > now:
                    timeout = min(timeout, self._retry_at - now)
                if self._busy_left > 0:  # wanted, but busy: look again when that may be over
                    timeout = min(timeout, self._busy_left)
            elif member.state is State.RESIDENT and self.strategy.undecided:
                if hint.fd is not None:
                    watch.append(hint.fd)
                timeout = interval if timeout is None else min(timeout, interval)
            elif member.state is State.RELEASED:
                # A command that was ended cannot ask: it comes back on its turn; one that
                # was told to end needs the GPU to act on it.
                ending = sup.pending_signal is not None
                if now < self._requeue_at:
                    timeout = self._requeue_at - now
                elif (
                    self.demand.wants()
                    or ending
                    or (self.strategy.killed and self.demand.needs_command)
                ):
                    if self._acquire():
                        status = self._restore()
                        if status is not None:
                            return status
                    continue

            if member.state is State.RESIDENT and self.meter is not None:
                due = self.meter.due()
                timeout = due if timeout is None else min(timeout, due)
            self._wait(watch, timeout)
            hint.drain()

    def _wait(self, fds: list[int], timeout: float | None) -> None:
        with contextlib.suppress(InterruptedError):
            select.select(fds, [], [], timeout)
        self.sup.signalled = drain(self._wake_r) or self.sup.signalled
        for fd in self.demand.fds():  # hints only: wants() decides
            drain(fd)

    # -- a budget share's footprint ------------------------------------------------

    def _measure(self) -> None:
        """Sample the command's memory when due; past its units, take free units, or,
        where too few are free, step aside (as for a waiter, min-hold aside) and ask for
        what it used at the next admission: the GPU holds more than the budget counts
        only until that release."""
        meter, member = self.meter, self.member
        if meter is None or not isinstance(member, Member) or member.footprint is None:
            return
        if meter.due() > 0:
            return
        used = meter.sample()
        if used is None or used <= member.share_bytes or member.grow(used):
            return
        if not self._outgrown:
            self._outgrown = True
            asks = member.footprint_after(used)
            then = "it steps aside and asks for" if self.strategy.releases else "it asks for"
            self.sup.warn(
                f"{member.records.record.name} uses {show_size(used)}, more than its"
                f" footprint of {show_size(member.footprint.size)}, and too few units of"
                f" the budget are free; {then} {show_size(asks.size)} at its next admission"
            )

    def _resize(self) -> None:
        """After a release: the footprint the residency measured, for the next admission."""
        meter, member = self.meter, self.member
        if meter is None or not isinstance(member, Member):
            return
        self._outgrown = False
        peak = meter.take_peak()
        if peak > 0:  # else nothing was seen: NVML's pids may not be ours to see
            member.resize(member.footprint_after(peak))

    # -- transitions -------------------------------------------------------------

    def _release(self) -> int | None:
        """RESIDENT -> RELEASED. Returns an exit status if the command ended meanwhile."""
        member = self.member
        if self.meter is not None:
            self.meter.sample()  # the peak, with the memory as it is before it goes
        member.releasing()
        self.demand.releasing()
        y = self.opts.yield_within
        started = time.monotonic()
        deadline = None if y is None else started + y
        try:
            try:
                self.strategy.release(deadline)
            except ReleaseTimeout:
                waited = time.monotonic() - started
                self.sup.warn(
                    f"{self.strategy.label} release did not finish within {waited:.1f} s;"
                    " ending the command (it is started again on its turn)"
                )
                self.strategy.force()
            self.strategy.verify(deadline)
        except ChildExited:
            return self.sup.finish(exit_code(self.child.poll() or 0))
        except Interrupted:
            self._resident_again()  # told to end: the command has the signal
            return None
        except strategies.Unverified as err:
            self.sup.warn(f"{err}; handing the GPU over anyway")
        except (ControlError, Immovable) as err:
            if not self.strategy.fall_back(err):
                self.strategy = self.sup.strategy = NoneStrategy(self.ctx, self.opts.settings)
            if self.strategy.releases:
                self.sup.warn(f"{err}; releasing it with {self.strategy.label} instead")
            else:
                self.sup.warn(f"{err}; holding the GPU until it exits")
            self._describe()
            self._resident_again()
            return None
        except StrategyError as err:
            self.sup.warn(f"release failed: {err}; staying resident", once=True)
            self._retry_at = time.monotonic() + RETRY_AFTER_FAILURE
            self._resident_again()
            return None
        if self.strategy.killed:
            self._lost_run = time.monotonic() - self._started
            member.describe(child_pid=None)  # no process runs until it is started again
        member.release()
        self._resize()
        return None

    def _resident_again(self) -> None:
        self.member.resident()
        self.demand.restored()
        self.sup.resident_again()

    def _acquire(self) -> bool:
        """Queue for the token, blocking in the kernel in this thread; True once it is ours.

        No helper thread: starting one cost a quarter of a millisecond on the handoff
        path. Signals still run their handlers while we block (forwarding to the
        command); SIGCHLD and the ending signals break the wait (False), so that the
        loop sees an exit or an order to end at once.
        """
        member = self.member
        member.wait_polite()
        member.waiting()
        sup = self.sup
        sup.queued = True
        try:
            # What came before we were queued cannot break the wait: look once more.
            ended = self.strategy.killed and sup.pending_signal is not None
            if ended or sup.gone() is not None:
                member.released()
                return False
            return member.take_token(None)
        except Woken:
            # The signal may have landed just after the kernel granted the lock.
            sup.queued = False
            if member.token_came():
                return True
            member.released()
            return False
        finally:
            sup.queued = False

    def _restore(self) -> int | None:
        status = self.sup.ended_while_away()  # told to end as the token came back
        if status is not None:
            return status
        member = self.member
        member.restoring()
        pid = self.child.pid
        try:
            self.strategy.restore()  # tells the command first; bookkeeping after
        except ChildExited:
            return self.sup.finish(exit_code(self.child.poll() or 0))
        except Interrupted:
            pass  # told to end while restoring: we hold the token, the command has the signal
        except strategies.VramTaken as err:
            # Restoring now would wedge the command: give the token back, queue again.
            self.sup.warn(str(err), once=True)
            member.release()
            self._requeue_at = time.monotonic() + RETRY_AFTER_FAILURE
            return None
        except (ControlError, StrategyError) as err:
            self.sup.warn(f"restore: {err}")
        if self.child.pid != pid:  # started again
            self._started = time.monotonic()
            if self.demand.takes_turns:
                member.set_min_hold(max(self.opts.min_hold, LOST_RUN_FACTOR * self._lost_run))
        self._resident_again()
        return None


def run(opts: RunOptions) -> int:
    """``vramlock run``: the command's exit status (128+N if killed by signal N)."""
    return Runner(opts).run()
