"""``vramlock run``: the wrapper around a command.

The runner takes the token as a waiter *before* it starts the command, then loops:
probe want.lock while resident, release through the strategy when somebody
waits, drop the token, come back by ``--demand``. The command inherits the
token's open file description, so a SIGKILLed runner cannot leave it resident
without the token: the lock lives as long as the command does.
"""

from __future__ import annotations

import contextlib
import os
import signal
from types import FrameType
from typing import TYPE_CHECKING

from .. import procfs, strategies
from ..arena import footprint as footprints
from ..arena.budget import read_budget
from ..arena.hint import Hint
from ..arena.member import Member, harmless_signals, join
from ..arena.waiter import told
from ..command.context import Context
from ..command.control import ParentEnd
from ..command.process import Child, Terminal, become_subreaper
from ..errors import AddressError, NotObtained
from .options import DEFAULT_IDLE, DEFAULT_READY_WITHIN, RunOptions
from .scheduler import Scheduler
from .supervision import FORWARDED, WATCHED, Supervision

if TYPE_CHECKING:
    from .proxy import Proxy


def visible_devices(gpus: tuple[int, ...]) -> dict[str, str]:
    """The environment that shows a command the GPUs ``gpus`` (nvidia-smi's numbers)
    alone, in that order (the first is the command's device 0).

    CUDA numbers GPUs fastest first, nvidia-smi and NVML by PCI bus: name the GPUs by
    UUID where NVML can tell them, else by number in PCI bus order.
    """
    from ..gpu import nvml

    try:
        return {"CUDA_VISIBLE_DEVICES": ",".join(nvml.gpu(g).uuid for g in gpus)}
    except (nvml.NvmlUnavailable, nvml.NvmlError):
        return {
            "CUDA_VISIBLE_DEVICES": ",".join(map(str, gpus)),
            "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        }


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
        self.member: Member | None = None
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
                    with told(self.member):  # a resident that cannot release is said
                        got = self.member.acquire(opts.timeout)
                    if not got:
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

    def _say_whole_gpu(self, member: Member) -> None:
        """In an arena with a budget, a command without a footprint takes the whole GPU,
        or, where its footprint is measured, the whole budget until it is."""
        for part in member.residency.parts():
            arena = part.arenas[0]
            budget = read_budget(arena)
            if budget is None:
                continue
            sized = part.sized()
            if sized is None:
                self.opts.warn(
                    f"{arena.path} has a budget ({budget}); without --vram this"
                    " command takes the whole GPU"
                )
            elif sized.footprint.source == footprints.WHOLE:
                self.opts.warn(
                    f"{arena.path} has a budget ({budget}); without --vram this"
                    " command takes the whole budget until its footprint is measured"
                )

    def _listen(self, member: Member) -> Proxy | None:
        """--demand listen: the proxy, listening before the command starts (and before we
        wait for the token: clients are held meanwhile, and a busy address fails at once)."""
        opts = self.opts
        if opts.listen is None or opts.upstream is None:
            return None
        from ..strategies.presets import ready_url
        from .proxy import Proxy, owner

        # Before the proxy's thread starts: it may take a client at once (serve's
        # connection waits in the backlog of the listener it passes), and its count,
        # reported only when it changes, must not be overwritten by this 0.
        member.describe(connections=0)
        proxy = Proxy(
            opts.listen,
            opts.upstream,
            idle=DEFAULT_IDLE if opts.idle is None else opts.idle,
            ready_within=DEFAULT_READY_WITHIN if opts.ready_within is None else opts.ready_within,
            ready_url=opts.ready_url or ready_url(opts.command, opts.preset),
            report=lambda count: member.describe(connections=count),
            warn=opts.warn,
            working=member.working,
            note=lambda why: member.describe(note=why),
        )
        if opts.on_release is None:  # else its server is no process of ours (a container)
            taken = owner.in_use(proxy.upstream_port)
            if taken is not None:
                proxy.close()
                raise AddressError("--upstream", opts.upstream,
                                   f"port {proxy.upstream_port} is in use already, by {taken}:"
                                   " the command could not listen there, and its clients"
                                   " would reach that program")  # fmt: skip
        member.describe(listen=proxy.address)
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

    def _supervise(self, member: Member) -> int:
        opts, arenas = self.opts, member.arenas
        control = ParentEnd()
        env = dict(os.environ)
        env.update(control.child_env(member.residency.fds[0]))
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
            fds = (control.child_fd, *member.residency.fds)
            child = Child(command, env, fds, terminal=Terminal.if_foreground())
            if self.proxy is not None and opts.on_release is None:
                from .proxy.owner import Guard

                # Its processes as its tree (we adopt its orphans): no scan of the host.
                me = os.getpid()
                self.proxy.guard = Guard(
                    self.proxy.upstream_port, lambda: child.pid, lambda: procfs.descendants(me)
                )
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
            member.residency.drop(unlock=gone)
            control.close()
            if child is not None:
                child.close()
            scratch.close()


def run(opts: RunOptions) -> int:
    """``vramlock run``: the command's exit status (128+N if killed by signal N)."""
    return Runner(opts).run()
