"""The token loop around a running command: probe, release, re-queue, restore."""

from __future__ import annotations

import contextlib
import enum
import os
import select
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from .. import procfs, strategies
from ..arena import footprint as footprints
from ..arena import journal
from ..arena.budget import show_size
from ..arena.hint import Hint, drain
from ..arena.member import State
from ..command.context import ChildExited, Interrupted, ReleaseTimeout
from ..command.process import exit_code
from ..errors import ControlError, Immovable, StrategyError
from ..strategies.base import Strategy
from ..strategies.deadline import NoAnswer
from ..strategies.none import NoneStrategy
from . import demand as demands
from .options import RunOptions
from .strays import Strays
from .supervision import Supervision, Woken
from .unanswered import Unanswered

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
# The sources of who's note, in the order it gives them: how the command is released
# (auto: why swap could not be), processes stopped until the turn, a refused release.
NOTES = ("way", "strays", "refusal")


class Notes:
    """Who's note, joined from its sources (NOTES), so that one does not hide another."""

    def __init__(self, describe: Callable[[str | None], None]) -> None:
        self._describe = describe  # writes the note into the member's record
        self._notes: dict[str, str] = {}
        self._said: str | None = None

    def say(self, source: str, text: str | None) -> None:
        """What ``source`` has the note say now (None: nothing)."""
        if text is None:
            self._notes.pop(source, None)
        else:
            self._notes[source] = text
        note = "; ".join(self._notes[s] for s in NOTES if s in self._notes) or None
        if note != self._said:
            self._said = note
            self._describe(note)


class Event(enum.Enum):
    """What the token loop does next (``Scheduler._next`` decides, a handler acts)."""

    EXITED = "the command exited by itself"
    RELEASE = "release now: somebody waits, or the residency outgrew its units"
    ENDED_AWAY = "told to end while a release had ended the command"
    RELABEL = "auto changed its mind about how to release"
    REQUEUE = "released, and the command wants the GPU back"
    PARK = "released a while, or the GPU is short of room: free what the release left"
    WAIT = "nothing to do until a descriptor wakes us or a timeout runs out"


def end_grace(opts: RunOptions, strategy: str) -> float:
    """How long a command told to end may take to exit before it is killed: 10 s, or
    restart's ``--yield-within`` (restart ends commands: the option says how long)."""
    y = opts.yield_within
    return y if strategy == "restart" and y is not None else opts.settings.restart_grace


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
        self.strategy = strategies.pick(opts.release, self.ctx, opts.settings)
        sup.use(self.strategy)
        if self.strategy.releases:  # its releases are checked with NVML: ready it now
            from ..gpu import nvml

            nvml.warm()
        self.proxy = proxy
        self._wake_r = wake_r
        self._retry_at = 0.0
        self._requeue_at = 0.0  # a restore found too little free VRAM: queue again then
        self._wanted_since: float | None = None  # a waiter was seen while the demand was busy
        self._busy_left = 0.0  # the demand asked to put the release off this long
        self._started = time.monotonic()  # when the command was (last) started
        self._lost_run = 0.0  # how long the run a release ended had lasted
        self._status = 0  # the exit status an EXITED or ENDED_AWAY event ends with
        self._interval = PROBE_INTERVAL  # how often to probe; with no hint, more often
        self.unanswered = Unanswered(sup.warn)  # releases nobody took the token after
        self.notes = Notes(lambda note: self.member.describe(note=note))
        self._end_grace = end_grace(opts, self.strategy.name)
        self.meter = self._meter()
        self.strays = Strays(lambda: self.strategy, self._tree, self.child.processes, sup.warn,
                             lambda note: self.notes.say("strays", note))  # fmt: skip
        sup.strays = self.strays.stopped
        # This residency uses more than its units and no more are free: it steps aside.
        self._outgrown = False
        self._handlers: dict[Event, Callable[[Hint], int | None]] = {
            Event.EXITED: lambda hint: self.sup.finish(self._status),
            Event.RELEASE: lambda hint: self._release(),
            Event.ENDED_AWAY: lambda hint: self._status,
            Event.RELABEL: lambda hint: self._describe(),
            Event.REQUEUE: lambda hint: self._restore() if self._acquire() else None,
            Event.PARK: lambda hint: self._park(),
            Event.WAIT: self._wait,
        }
        self._describe()

    def _tree(self) -> list[int]:
        """The processes that descend from us, less our helpers: most of ``processes``,
        for a fraction of its cost (no look at every process of the host)."""
        ignored = self.child.ignored
        return [p for p in procfs.descendants(os.getpid()) if p not in ignored]

    def _meter(self) -> footprints.Meter | None:
        """NVML's sampler of the command's memory, for budget units."""
        if self.member.residency.sized() is None:
            return None
        return footprints.meter(self.child.owns, self.opts.settings.gpus)

    def _describe(self) -> None:
        self._shown = self.strategy.label
        self.member.describe(strategy=self._shown, child_pid=self.child.pid)
        self.notes.say("way", self.strategy.note)

    def _use(self, strategy: Strategy) -> None:
        self.strategy = strategy
        self.sup.use(strategy)

    def _releases_now(self) -> bool:
        """Resident, able to release, past min_hold and any retry delay, wanted, and not
        busy, or busy for --yield-within since the waiter was seen."""
        self._busy_left = 0.0
        if not (
            self.member.state is State.RESIDENT
            and self.strategy.releases
            and time.monotonic() >= self._retry_at
            and (self._outgrown or self.unanswered.wanted(self.member) or self._told_to_end())
        ):
            self._wanted_since = None
            return False
        busy = self.demand.busy_for()
        ending_since = self.sup.ending_since
        if ending_since is not None and self.child.status is None and not self._told_to_end():
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

    def _told_to_end(self) -> bool:
        """Told to end, where that is done by releasing (``restart --on-release``)."""
        return self.sup.pending_signal is not None and self.sup.ended_by_releasing

    def loop(self, hint: Hint) -> int:
        """Handle events until the command is done; its exit status."""
        # The proxy itself holds clients until the server is ready (--ready-url).
        self.demand = demands.make(self.opts.demand, self.ctx, self.proxy)
        # For budget waiters choosing whom to ask: how long a busy release may wait,
        # and a job taking turns works whenever it is resident.
        self.member.describe(yield_within=self.opts.yield_within)
        if self.demand.takes_turns:
            self.member.working(True)
        while True:
            status = self._handlers[self._next()](hint)
            if status is not None:
                return status

    def _next(self) -> Event:
        """The next event; the bookkeeping of the way (reaping, control lines, the meter)."""
        deaf = self.sup.deaf_for(self._end_grace)
        if deaf is not None and deaf <= 0:
            self.sup.kill_deaf(self._end_grace)
        status = self.sup.gone()
        if status is not None:
            self._status = exit_code(status)
            return Event.EXITED
        if self._releases_now():
            return Event.RELEASE  # first, when somebody waits: the bookkeeping can wait
        self.sup.tidy()
        away = self.sup.ended_while_away()
        if away is not None:
            self._status = away
            return Event.ENDED_AWAY
        if self.strategy.label != self._shown:  # auto chose another way as it released
            self._shown = self.strategy.label
            self.member.describe(strategy=self._shown)
        self.ctx.take_lines(self.ctx.control.read_lines())
        if self.member.state is State.RESIDENT and self._settled():
            return Event.RELABEL
        if self.member.state is State.RELEASED and self._comes_back():
            return Event.REQUEUE
        if self.member.state is State.RELEASED and self.strategy.park_in() == 0:
            return Event.PARK
        return Event.WAIT

    def _settled(self) -> bool:
        """Resident: meter the footprint, let auto settle; True when its label changed."""
        self._measure()
        label = self.strategy.label
        said = self.strategy.settle(self.member.wanted)  # auto may change its mind
        if said is not None:
            self.sup.warn(said)
            self.notes.say("way", self.strategy.note)
        return self.strategy.label != label

    def _comes_back(self) -> bool:
        """Released: queue for the token now? A command that was ended cannot ask: it
        comes back on its turn; one that was told to end needs the GPU to act on it."""
        if time.monotonic() < self._requeue_at:
            return False
        return (
            self.demand.wants()
            or self.sup.pending_signal is not None
            or (self.strategy.killed and self.demand.needs_command)
        )

    def _wait(self, hint: Hint) -> None:
        """Sleep until a descriptor we watch wakes us, or the next thing falls due."""
        watch, timeouts = self._watched(hint)
        timeouts += self._due()
        deaf = self.sup.deaf_for(self._end_grace)
        if deaf is not None:
            timeouts.append(max(0.0, deaf))
        with contextlib.suppress(InterruptedError):
            select.select(watch, [], [], min(timeouts, default=None))
        self.sup.woken(drain(self._wake_r))
        for fd in self.demand.fds():  # hints only: wants() decides
            drain(fd)
        hint.drain()

    def _watched(self, hint: Hint) -> tuple[list[int], list[float]]:
        """The descriptors to watch, and a poll interval where one must stand in."""
        watch = [self._wake_r, *self.demand.fds()]
        polls: list[float] = []
        if self.child.pidfd is not None and not self.strategy.killed:
            watch.append(self.child.pidfd)
        elif not self.strategy.killed:
            polls.append(PROBE_INTERVAL_NO_HINT)  # no pidfd: poll for the exit
        if not self.ctx.control.closed:
            watch.append(self.ctx.control.fileno())
        probing = self.strategy.releases or self.strategy.undecided
        if self.member.state is State.RESIDENT and probing and hint.fd is not None:
            watch.append(hint.fd)
        self._interval = PROBE_INTERVAL if hint.fd is not None else PROBE_INTERVAL_NO_HINT
        return watch, polls

    def _due(self) -> list[float]:
        """How soon each thing that falls due does: the probe, a retry, a busy release
        put off, a re-queue, the meter."""
        now, interval = time.monotonic(), self._interval
        state = self.member.state
        if state is State.RELEASED:
            park = self.strategy.park_in()
            due = [] if park is None else [park]
            return [*due, self._requeue_at - now] if now < self._requeue_at else due
        if state is not State.RESIDENT:
            return []
        due = [self.meter.due()] if self.meter is not None else []
        if self.strategy.releases:
            held = self.member.resident_since + self.member.min_hold
            hold_left = max(held, self.unanswered.until) - now
            due.append(interval if hold_left <= 0 else min(interval, hold_left))
            if self._retry_at > now:
                due.append(self._retry_at - now)
            if self._busy_left > 0:  # wanted, but busy: look again when that may be over
                due.append(self._busy_left)
        elif self.strategy.undecided:
            due.append(interval)
        return due

    # -- a budget member's footprint ------------------------------------------------

    def _measure(self) -> None:
        """Sample the command's memory when due; past its units, take free units, or,
        where too few are free, step aside (as for a waiter, min-hold aside) and ask for
        what it used at the next admission: the GPU holds more than the budget counts
        only until that release."""
        meter, sized = self.meter, self.member.residency.sized()
        if meter is None or sized is None or meter.due() > 0:
            return
        used = meter.sample()
        if used is None or used <= sized.held_bytes or sized.grow(used):
            return
        if not self._outgrown:
            self._outgrown = True
            asks = sized.footprint_after(used)
            then = "it steps aside and asks for" if self.strategy.releases else "it asks for"
            self.sup.warn(
                f"{self.member.name} uses {show_size(used)}, more than its"
                f" footprint of {show_size(sized.footprint.size)}, and too few units of"
                f" the budget are free; {then} {show_size(asks.size)} at its next admission"
            )

    def _resize(self) -> None:
        """After a release: the footprint the residency measured, for the next admission."""
        meter, sized = self.meter, self.member.residency.sized()
        if meter is None or sized is None:
            return
        self._outgrown = False
        peak = meter.take_peak()
        if peak > 0:  # else nothing was seen: NVML's pids may not be ours to see
            sized.resize(sized.footprint_after(peak))

    # -- transitions -------------------------------------------------------------

    def _release(self) -> int | None:
        """RESIDENT -> RELEASED. Returns an exit status if the command ended meanwhile."""
        member = self.member
        if self.meter is not None:
            self.meter.sample()  # the peak, with the memory as it is before it goes
        member.releasing()
        self.demand.releasing()
        self.unanswered.releasing()
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
                self._use(NoneStrategy(self.ctx, self.opts.settings))
            if self.strategy.releases:
                self.sup.warn(f"{err}; releasing it with {self.strategy.label} instead")
            else:
                self.sup.warn(f"{err}; holding the GPU until it exits")
            self._describe()
            self._resident_again()
            return None
        except StrategyError as err:
            said = "refused" if isinstance(err, NoAnswer) else "failed"
            self.sup.warn(f"release {said}: {err}; staying resident", once=True)
            self.notes.say(
                "refusal", f"release {said}: {err.brief if isinstance(err, NoAnswer) else err}"
            )
            self._retry_at = time.monotonic() + RETRY_AFTER_FAILURE
            self._resident_again()
            return None
        self.notes.say("refusal", None)  # (who: said no more)
        if self.strategy.killed:
            self._lost_run = time.monotonic() - self._started
            member.describe(child_pid=None)  # no process runs until it is started again
        elif self.strategy.holds_processes:
            self.strays.watch()  # from before the token goes
        member.step_aside()
        journal.moved(member.arenas, member.records.record, self.meter.peak if self.meter else None)
        self._resize()
        return None

    def _park(self) -> None:
        """Released: what the release left on the GPU leaves it too, where it can."""
        try:
            self.strategy.park()
        except StrategyError as err:
            self.sup.warn(str(err), once=True)

    def _resident_again(self) -> None:
        self.member.resident()
        self.demand.restored()
        self.sup.resident_again()

    def _acquire(self) -> bool:
        """Queue for the token, blocking in the kernel in this thread; True once it is ours.

        No helper thread: starting one cost a quarter of a millisecond on the handoff
        path. Signals still run their handlers while we block (forwarding to the
        command); SIGCHLD and the ending signals break the wait (False), so that the
        loop sees an exit or an order to end at once. A park that falls due meanwhile
        (``park_in``) is made between two waits, where no signal breaks it off: a
        command that comes back at once (``--demand always``) waits here all the while
        another member holds the token.
        """
        member, sup = self.member, self.sup
        member.wait_polite()
        # Nobody took the token, and want.lock is still held: that want is not for it.
        self.unanswered.judge(taken=member.taken_elsewhere(), wanted=member.wanted())
        member.waiting()
        self.strategy.come_back_early()  # while the holder finishes its turn
        while True:
            try:
                with sup.queueing():
                    # What came before we were queued cannot break the wait: look once more.
                    ended = self.strategy.killed and sup.pending_signal is not None
                    if ended or sup.gone() is not None:
                        member.released()
                        return False
                    if member.queue(self.strategy.park_in()):
                        return True
            except Woken:
                # The signal may have landed just after the kernel granted the lock.
                if member.came():
                    return True
                member.released()
                return False
            if self.strategy.park_in() == 0:
                self._park()

    def _restore(self) -> int | None:
        # The token is ours: no watch. What the watch stopped runs once the command is
        # resident again, not before: a run killed while restoring leaves it stopped.
        self.strays.pause()
        status = self.sup.ended_while_away()  # told to end as the token came back
        if status is not None:
            return status
        member = self.member
        member.restoring()
        pid = self.child.pid
        try:
            self.strategy.restore()  # tells the command first; bookkeeping after
        except ChildExited:
            self.strays.resume()  # leftovers now, ended by finish in our turn
            return self.sup.finish(exit_code(self.child.poll() or 0))
        except Interrupted:
            pass  # told to end while restoring: we hold the token, the command has the signal
        except strategies.VramTaken as err:
            # Restoring now would wedge the command: give the token back, queue again.
            self.sup.warn(str(err), once=True)
            if self.strategy.holds_processes and not self.strategy.killed:
                self.strays.watch()  # what it stopped stays stopped
            member.step_aside()
            self._requeue_at = time.monotonic() + RETRY_AFTER_FAILURE
            return None
        except (ControlError, StrategyError) as err:
            self.sup.warn(f"restore: {err}")
        if self.child.pid != pid:  # started again
            self._started = time.monotonic()
            if self.demand.takes_turns:
                member.set_min_hold(max(self.opts.min_hold, LOST_RUN_FACTOR * self._lost_run))
        self.strays.resume()
        self._resident_again()
        self.unanswered.restored()
        return None
