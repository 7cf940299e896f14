"""The token loop around a running command: probe, release, re-queue, restore."""

from __future__ import annotations

import contextlib
import select
import time
from typing import TYPE_CHECKING

from .. import strategies
from ..arena import footprint as footprints
from ..arena import journal
from ..arena.budget import show_size
from ..arena.hint import Hint, drain
from ..arena.member import Member, State
from ..command.context import ChildExited, Interrupted, ReleaseTimeout
from ..command.process import exit_code
from ..errors import ControlError, Immovable, StrategyError
from ..strategies.none import NoneStrategy
from . import demand as demands
from .options import RunOptions
from .supervision import Supervision, Woken

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
# A command told to end (SIGTERM, Ctrl-C) keeps the GPU this long for its exit, as a busy
# one would (--yield-within still bounds it): two members told to end at once would
# otherwise hand the token back and forth, each getting only as far as the next request.
ENDING_GRACE = 10.0
# A job whose run a release ended (restart) is given, when started again, a turn at
# least this many times as long as the run it lost, whatever --min-hold says: a job
# longer than --min-hold would otherwise be ended before its end, again and again.
LOST_RUN_FACTOR = 2.0


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
        journal.moved(member, self.strategy.label, self.meter.peak if self.meter else None)
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
