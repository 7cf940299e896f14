"""``swap``: a preloaded library moves the command's GPU memory to pinned host memory.

``prepare`` puts the swap library in front of the command (``LD_PRELOAD``, before
any the user set) and opens a hub for it (vramlock/gpu/core/protocol.py: the socket,
its words and their answers). A release is refused while a process of the command has
the driver loaded without being a connected peer, or cannot be seen (its memory map
unreadable); a process that reaches neither of the hub's sockets runs without swap
under ``auto`` (``VRAMLOCK_SWAP_UNREACHED``), or exits under ``--release swap``.

A refusal makes the member hold the GPU until the command exits, as a driver
checkpoint that is not supported does; after a failure it stays resident and
tries again. ``restore`` / ``restored`` bring it back; a process that finds no
memory for its restore answers ``failed``, and the member releases them all
again, gives the token back and queues again. The CUDA context itself (a few
hundred MiB per process, its stack lowered by the library) stays on the GPU, until
the member is *parked*: released for ``PARK_AFTER`` seconds, or at once when its GPU
has less than ``SHORT_OF_ROOM`` free, the driver checkpoints what its processes still
hold there (their contexts, their memory already in host memory), where the driver
can; the next restore brings the contexts back first, then the memory. Around a park,
``unpin`` / ``unpinned`` has each process unlock its host copies first (the driver's
restore would lock them again, slowly), and ``pin`` / ``pinned`` lock them again where
the contexts come back before the token (``come_back_early``); a restore locks
whatever is still unlocked.
"""

from __future__ import annotations

import contextlib
import os
import select
import threading
import time
from collections.abc import Mapping
from contextlib import ExitStack
from typing import NoReturn

from .. import procfs
from ..errors import Immovable, StrategyError
from ..gpu import cuda, nvml
from ..gpu.core import protocol
from ..gpu.core.protocol import (
    ENV_ABSTRACT,
    ENV_SOCKET,
    ENV_UNREACHED,
    PARKED,
    SET_UP,
    UNJOINED,
    Peer,
    image,
    open_hub,
    prepared_hub,
    unreached,
)
from ..gpu.swap import SwapUnavailable, library_path
from . import deadline as deadlines
from .base import ChildExited, Context, ReleaseTimeout, Settings, Strategy
from .checkpoint import RESTORE_MARGIN, VramTaken, footprint, short_of
from .checkpoint import usable as checkpoint_usable

# A process whose connection closed without an answer, and still there this much later,
# did not exit: it closed the connection itself.
EXIT_WITHIN = 1.0
CLOSED = "it closed its connection to vramlock"
# How long a process that cannot be verified may take to become one that can (it was
# caught starting) before the release is refused.
VERIFY_WITHIN = 0.5
# Releases that failed in a row (each a second apart) before swap is given up as
# refused: the member then releases another way, or holds the GPU until it exits.
GIVE_UP_AFTER = 3
# Virtual memory management came with CUDA 10.2.
VMM_VERSION = 10020
# Released this long, a member's processes' CUDA contexts leave the GPU too (parked);
# at once when a GPU it uses has less than SHORT_OF_ROOM free, looked at every LOOK_EVERY.
# VRAMLOCK_PARK_AFTER (seconds, or "off") in vramlock run's environment says otherwise.
PARK_AFTER = 30.0
ENV_PARK_AFTER = "VRAMLOCK_PARK_AFTER"
SHORT_OF_ROOM = 1 << 30
LOOK_EVERY = 1.0
# How long the libraries may take to unlock or lock their host copies around a park.
PIN_WITHIN = 5.0
# Contexts brought back early (queued) are not parked again before this (seconds), unless
# the GPU runs short of room, whatever VRAMLOCK_PARK_AFTER says: the token is coming.
KEEP_EARLY = 30.0
# A released command runs no GPU work: its lock is taken at once, or not at all.
PARK_LOCK_TIMEOUT = 5.0

__all__ = [
    "ENV_SOCKET",
    "ENV_UNREACHED",
    "Hub",
    "SwapStrategy",
    "hub_of",
    "open_hub",
    "prepared_hub",
]


class Refused(Immovable):
    """A process of the command cannot be swapped; every process was left running."""


class NotRestored(VramTaken):
    """A process could not take its memory back (another process holds the GPU's
    memory): every process of the command is released again, and the member gives the
    token back and queues again rather than hold it with a program that cannot run."""

    def __init__(self, pid: int, why: str) -> None:
        StrategyError.__init__(
            self,
            f"process {pid} of the command could not be restored ({why});"
            " giving the GPU back and queueing again",
        )
        self.need = self.free = self.gpu = 0
        self.pid = pid


class Hub(protocol.Hub):
    """The hub of a command the swap library is in front of: who may run on the GPU
    without the hub's word is checked here (the conversation is protocol.Hub's)."""

    def __init__(self, path: str, library: str) -> None:
        self.library = os.path.realpath(library)  # as /proc/PID/maps names it
        super().__init__(path)

    def unverified(self, pids: list[int]) -> str | None:
        """Why a release cannot reach every CUDA process among ``pids``, or None when it
        can: each that has the CUDA driver loaded, or whose memory map cannot be read,
        must be connected now as a verified peer, or have the library saying it has not
        joined yet (its GPU calls wait for the join), or be still starting with it
        (``_starting``). One that is none of these would run on without the token."""
        peers = self.connected()
        for pid in pids:
            if pid in peers:
                continue
            paths = procfs.mapped(pid)
            if paths is None and procfs.living(pid):
                return (
                    f"process {pid} of the command cannot be verified: its memory map cannot"
                    " be read (a setuid or non-dumpable program)"
                )
            cause = None if paths is None else unreached(paths)
            if cause is not None:
                return (
                    f"process {pid} of the command could not reach vramlock run ({cause})"
                    " and runs without swap"
                )
            if paths is not None and cuda.driver_in(paths):
                if self.library in paths and (
                    any(UNJOINED in p for p in paths) or self._starting(pid, paths)
                ):
                    continue  # it runs no GPU call before it joins (told release if it does)
                return (
                    f"process {pid} of the command uses CUDA without the swap library (were"
                    f" LD_PRELOAD or {ENV_SOCKET} removed on the way, or its connection to"
                    " vramlock closed?)"
                )
        return None

    def loose(self, pids: list[int]) -> tuple[list[int], list[int]]:
        """Among ``pids``: those that have the driver mapped without the library's gate,
        and those without it that have not mapped the driver yet (a program exec'd by
        the system call itself, or a static one, or one whose library was not given the
        socket's name), which could."""
        peers = self.connected()  # (a connection that closed on exec noticed)
        loose: list[int] = []
        suspects: list[int] = []
        for pid in pids:
            if pid in peers:
                continue
            paths = procfs.mapped(pid)
            if paths is None or self._gated(pid, paths):
                continue  # gone, or closed to us (refused at the next release), or held
            (loose if cuda.driver_in(paths) else suspects).append(pid)
        return loose, suspects

    def _starting(self, pid: int, paths: set[str]) -> bool:
        """Is ``pid`` (the library among its mapped files ``paths``) still starting? The
        dynamic linker maps a program's libraries, the driver among them where the
        program links it, and runs their constructors (a CUDA program's can take
        seconds) before the library's. Until the library has set up, which its mark
        shows, nothing of the process passes to the GPU but through it, and where it was
        given this run's socket, setting up joins the run. One that has set up and is
        neither joined nor joining has lost its connection: it is not starting. Nor is
        one that connected, running the program it runs now: its library had set up,
        though its mark may not show (it could not be made: no descriptor left, say)."""
        if any(SET_UP in p for p in paths):
            return False
        seen = self.connected_at_once(pid)
        if seen is not None and seen == image(pid):
            return False
        return procfs.environ(pid).get(ENV_SOCKET) == self.path

    def _gated(self, pid: int, paths: set[str]) -> bool:
        """Does the library keep ``pid`` (not a peer, its mapped files ``paths``) off the
        GPU while the command is released? Where it is loaded and was given the socket's
        name: until the process joins it shows its mapping; a process whose connection
        closed waits for the token itself; and one whose library has not set up yet
        (the dynamic linker maps a program's libraries, a driver it links among them,
        and runs their constructors before the library's), or a child that shares its
        parent's memory until it execs (vfork, posix_spawn), calls nothing on the GPU
        that does not pass the library first. Its environment at start tells."""
        if self.library not in paths or unreached(paths) is not None:
            return False  # (one that could not reach us runs on its own)
        if any(UNJOINED in p for p in paths):
            return True
        return procfs.environ(pid).get(ENV_SOCKET) == self.path


def hub_of(ctx: Context) -> Hub | None:
    """The hub ``prepare`` made for the command, or None: it was started without one."""
    hub = prepared_hub(ctx.child.env)
    return hub if isinstance(hub, Hub) else None


def park_after() -> float | None:
    """How long a released member waits before it parks (VRAMLOCK_PARK_AFTER); None: never.
    A value that is no number of seconds is taken as the default."""
    given = os.environ.get(ENV_PARK_AFTER, "").strip().lower()
    if given == "off":
        return None
    try:
        seconds = float(given)
    except ValueError:
        return PARK_AFTER
    return seconds if seconds >= 0 else PARK_AFTER


def usable() -> str | None:
    """Why the swap strategy cannot be used here, or None when it can (the library is
    built first where it has to be)."""
    try:
        version = cuda.driver_version()
    except cuda.CudaUnavailable as err:
        return err.reason
    except cuda.CudaError as err:
        return str(err)
    if version < VMM_VERSION:
        return (
            f"the driver supports CUDA {version // 1000}.{version % 1000 // 10};"
            " swapping needs 10.2 or newer"
        )
    try:
        library = str(library_path())
    except SwapUnavailable as err:
        return err.reason
    if any(c in library for c in " :"):  # LD_PRELOAD splits at both
        return f"the swap library's path {library!r} cannot go in LD_PRELOAD"
    return None


class SwapStrategy(Strategy):
    """Swap every CUDA process of the command out to host memory, and back."""

    name = "swap"

    def __init__(self, ctx: Context, settings: Settings) -> None:
        super().__init__(ctx, settings)
        hub = hub_of(ctx)
        assert hub is not None, "the command was started without the swap library"
        self.hub = hub
        self._failures = 0  # releases that failed in a row
        self._released_at: float | None = None  # when the last release succeeded
        self._parked: list[int] = []  # processes whose contexts the driver checkpointed
        self._parked_used: dict[int, int] = {}  # what they held, per GPU, as NVML saw it
        self._park_after = park_after()
        self._park_refused = self._park_after is None  # never, when told so
        self._early: threading.Thread | None = None  # contexts coming back before the token
        self._park_not_before = 0.0  # brought back early: kept a while, queued as it is

    @classmethod
    def finds_work(cls, ctx: Context) -> bool:
        """Did the command's CUDA processes join this run's hub, and does none of them
        use CUDA without the library? (For ``auto``.)"""
        hub = hub_of(ctx)
        return hub is not None and hub.joined() and hub.unverified(ctx.child.processes()) is None

    @classmethod
    def unreached(cls, ctx: Context) -> str | None:
        """Which process of the command could not reach this run's hub, and why, where
        one could not (it runs without swap); None where none did. (For ``auto``.)"""
        if hub_of(ctx) is None:
            return None
        for pid in ctx.child.processes():
            paths = procfs.mapped(pid)
            cause = None if paths is None else unreached(paths)
            if cause is not None:
                return f"process {pid} of the command could not reach vramlock run ({cause})"
        return None

    @classmethod
    def fit(cls, command: list[str], env: Mapping[str, str], settings: Settings) -> None:
        why = usable()
        if why is not None:
            raise SwapUnavailable(why)

    @classmethod
    def prepare(cls, command: list[str], env: dict[str, str], scratch: ExitStack) -> list[str]:
        library = str(library_path())
        hub = open_hub(lambda path: Hub(path, library), env, scratch)
        if hub.abstract:
            env[ENV_ABSTRACT] = hub.abstract
        env[ENV_UNREACHED] = "exit"  # auto says "run"
        # Ours first: its dlsym must see the program's lookups before anybody's.
        theirs = env.get("LD_PRELOAD", "").strip()
        env["LD_PRELOAD"] = f"{library}:{theirs}" if theirs else library
        return command

    def release(self, deadline: float | None) -> None:
        why = self._unverified(deadline)
        if why is not None:
            raise Refused(f"{why}; it was left running")
        for pid in self.hub.stopped():
            raise deadlines.stopped(pid)
        within = self.settings.release_within or deadlines.RELEASE_WITHIN
        bad = self._tell(protocol.RELEASE, protocol.RELEASED, deadline, time.monotonic() + within)
        # A process that could not reach us while the others released runs on its own.
        late = None if bad else self.unreached(self.ctx)
        if not bad and late is None:
            self._failures = 0
            self._released_at = time.monotonic()
            return
        # Whoever released comes back: one process cannot be swapped, so none is. One
        # that did not answer is told too, and not waited for: it answers when it can.
        deaf = [pid for pid, word, _ in bad if word == deadlines.UNANSWERED]
        back = self._tell(protocol.RESTORE, protocol.RESTORED, None, time.monotonic() + within)
        if [pid for pid, _, _ in back if pid not in deaf]:
            raise StrategyError("the command could be neither swapped out nor restored")
        if late is not None:
            raise Refused(f"{late} and runs without swap; it was left running")
        if deaf:
            raise deadlines.unanswered(deaf[0], within)
        pid, word, why = bad[0]
        if word == protocol.REFUSED:
            raise Refused(
                f"process {pid} of the command cannot be swapped: {why}; it was left running"
            )
        self._failures += 1
        if self._failures >= GIVE_UP_AFTER:
            # Not a passing moment (a graph being captured) but a lasting lack (host
            # memory to pin): a way that can release it is better than none.
            raise Refused(
                f"process {pid} of the command could not be swapped out {self._failures}"
                f" times in a row ({why}); it was left running"
            )
        raise StrategyError(f"process {pid} of the command could not be swapped out: {why}")

    @property
    def defers_signals(self) -> bool:
        # A parked process's exit path would block in the driver: restore it first.
        return bool(self._parked)

    holds_processes = True

    def loose(self, pids: list[int]) -> tuple[list[int], list[int]]:
        return self.hub.loose(pids)

    def park_in(self) -> float | None:
        if self._parked or self._released_at is None or self._park_refused:
            return None
        assert self._park_after is not None
        due = max(self._released_at + self._park_after, self._park_not_before)
        left = due - time.monotonic()
        if left > 0 and not self._short_of_room():
            return min(left, LOOK_EVERY)
        # Due: the driver is loaded here only now, off the handoff path.
        self._park_refused = checkpoint_usable() is not None
        return None if self._park_refused else 0.0

    def _gpus(self) -> list[int]:
        gpus = self.settings.gpus
        return list(range(nvml.count())) if gpus is None else list(gpus)

    def _short_of_room(self) -> bool:
        """Does a GPU of ours have less than SHORT_OF_ROOM free? (NVML; no: cannot tell.)"""
        try:
            return nvml.available() and any(
                nvml.free_bytes(g) < SHORT_OF_ROOM for g in self._gpus()
            )
        except (nvml.NvmlUnavailable, nvml.NvmlError):
            return False

    def park(self) -> None:
        """Checkpoint what the released processes still hold on the GPU (their contexts:
        their memory is in host memory already). Refused once, never tried again; a
        process that ended meanwhile refuses nothing: the next look parks the others."""
        self._early_done()  # its last step (pin) may still be under way
        self._mark_parked(True)  # before the driver's first step: see _mark_parked
        try:
            pids = cuda.cuda_pids(self.ctx.child.processes())
            used: dict[int, int] = {}
            if pids and nvml.available():
                used = footprint(pids, self.settings.gpus)
            if pids:
                self._unpin()
                cuda.checkpoint_all(pids, PARK_LOCK_TIMEOUT)
        except cuda.CudaError as err:
            self._mark_parked(False)  # checkpoint_all undid what it did
            if err.pid is not None and not procfs.living(err.pid):
                return  # everything undone: not parked, and due again
            self._refuse_park(err)
        except (nvml.NvmlUnavailable, nvml.NvmlError) as err:
            self._mark_parked(False)
            self._refuse_park(err)
        self._parked, self._parked_used = pids, used
        if not pids:
            self._mark_parked(False)

    def _unpin(self) -> None:
        """Before a park: the libraries unlock their host copies (their contents stay),
        which the driver's restore would otherwise lock again, slower than they do when
        they copy each piece back (bench/park.py: 0.24 s for a context alone, 0.50 s
        with 5 GiB locked). A process that does not answer is parked as it is (and a
        command that ended is not parked: the checkpoint finds it gone)."""
        with contextlib.suppress(ReleaseTimeout, ChildExited):
            self._tell(protocol.UNPIN, protocol.UNPINNED, time.monotonic() + PIN_WITHIN)

    def _mark_parked(self, parked: bool) -> None:
        """The mark the library looks for when this run is gone (``PARKED``, beside the
        hub's socket): while it is there, a process of the command may be checkpointed,
        so none may run on the token the command shares with us; each gives the token
        back instead and stays blocked. Made before the first checkpoint, removed once
        every context is back: a run killed in between (unparking, the token taken)
        leaves a command that cannot run, but not holding the token for good."""
        mark = os.path.join(os.path.dirname(self.hub.path), PARKED)
        if not parked:
            with contextlib.suppress(OSError):
                os.unlink(mark)
            return
        try:
            with open(mark, "a"):
                pass
        except OSError as err:
            self._refuse_park(err)

    def _refuse_park(self, err: Exception) -> NoReturn:
        self._park_refused = True
        raise StrategyError(f"its CUDA contexts stay on the GPU while released: {err}") from None

    def _unpark(self) -> None:
        """The contexts back first (the memory follows): where a GPU has no room for
        them, VramTaken (queue again) rather than a restore that wedges the process."""
        try:
            short = short_of(self._parked_used)
        except nvml.NvmlError:
            short = None  # NVML cannot say: the driver's restore is the judge
        if short is not None:
            raise VramTaken(*short)
        try:
            cuda.restore_all(self._parked)
        except cuda.CudaError as err:
            raise StrategyError(f"the CUDA contexts could not be restored: {err}") from None
        self._parked, self._parked_used = [], {}
        self._mark_parked(False)

    def come_back_early(self) -> None:
        """Parked and queued: the contexts come back now, in a thread, while the member
        holding the token finishes its turn (the driver's restore, ~0.3 s, no longer
        waits for it), where NVML shows room for them beside SHORT_OF_ROOM (else they
        would be parked again at once). The processes stay released: the library holds
        their GPU calls until the token is the command's, as before the park. Without
        NVML the room is not known: they come back on the token, as before. Nor do they
        come back early where one of the processes is not held by the library any more
        (its connection closed while it was parked: an exec, say)."""
        if not self._parked or self._early is not None or not self._room_early():
            return
        if self.hub.unverified(self._parked) is not None:
            return
        self._early = threading.Thread(target=self._unpark_early, name="vramlock-unpark")
        self._early.start()

    def _room_early(self) -> bool:
        try:
            return nvml.available() and all(
                nvml.free_bytes(g) >= self._parked_used.get(g, 0) + RESTORE_MARGIN + SHORT_OF_ROOM
                for g in self._gpus()
            )
        except (nvml.NvmlUnavailable, nvml.NvmlError):
            return False

    def _unpark_early(self) -> None:
        # Whatever goes wrong here, the token's restore does it again and says why.
        with contextlib.suppress(VramTaken, StrategyError, ChildExited, ReleaseTimeout, OSError):
            # About to run: parked again only if the wait lasts, or room runs short. Said
            # before the contexts are back, so that no look in between finds a park due.
            self._park_not_before = time.monotonic() + KEEP_EARLY
            self._unpark()
            # The host copies too.
            self._tell(protocol.PIN, protocol.PINNED, time.monotonic() + PIN_WITHIN)

    def _early_done(self) -> None:
        """Wait for the contexts coming back early (``come_back_early``), if they are."""
        early, self._early = self._early, None
        if early is not None:
            early.join()

    def _unverified(self, deadline: float | None) -> str | None:
        """Why the release cannot reach every CUDA process of the command, once that has
        lasted VERIFY_WITHIN: a process caught starting (its exec, the driver mapped before
        the library's constructor ran) is not yet what it will be a moment later, and a
        refusal is for good."""
        end = time.monotonic() + VERIFY_WITHIN
        if deadline is not None:
            end = min(end, deadline)
        while (why := self.hub.unverified(self.ctx.child.processes())) is not None:
            if not self.ctx.child.alive:
                raise ChildExited
            if time.monotonic() >= end:
                return why
            time.sleep(0.02)
        return None

    def _restore(self) -> None:
        self._early_done()
        self._park_not_before = 0.0  # the token came: the next release parks as it says
        if self._parked:
            self._unpark()
        self._released_at = None
        bad = self._tell(protocol.RESTORE, protocol.RESTORED, None)
        if not bad:
            return
        # Those that came back must not run without the token we are about to give back.
        if self._tell(protocol.RELEASE, protocol.RELEASED, None):
            raise StrategyError("the command could be neither restored nor released again")
        pid, _, why = bad[0]
        raise NotRestored(pid, why)

    def _tell(
        self, word: str, answer: str, deadline: float | None, answer_by: float | None = None
    ) -> list[tuple[int, str, str]]:
        """Say ``word`` to every process and wait for them all: (pid, first word, the
        rest) of each that did not answer ``answer`` (UNANSWERED: not by ``answer_by``)."""
        peers = self.hub.tell(word, released=word != protocol.RESTORE)
        return [
            (pid, words[0], " ".join(words[1:]) or "no reason given")
            for pid, words in self._answers(peers, deadline, answer_by).items()
            if words[0] != answer
        ]

    def restore(self) -> None:
        if self.killed:
            self.hub.reset()
        super().restore()

    def _answers(
        self, peers: list[Peer], deadline: float | None, answer_by: float | None = None
    ) -> dict[int, list[str]]:
        """Each live process's answer (its words), by pid. A process that closed its
        connection without answering has none once it is gone (it exited); one that lives
        on a while later closed it itself, and can no longer be asked: refused. One that
        has not answered by ``answer_by``: UNANSWERED."""
        answers: dict[int, list[str]] = {}
        waiting = {p.channel.fileno(): p for p in peers}
        closing: dict[int, float] = {}  # pid: until when it may still be exiting
        while waiting or closing:
            if not self.ctx.child.alive:
                raise ChildExited
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise ReleaseTimeout
            if answer_by is not None and time.monotonic() >= answer_by:
                answers.update((p.pid, [deadlines.UNANSWERED]) for p in waiting.values())
                answers.update((pid, [protocol.REFUSED, *CLOSED.split()]) for pid in closing)
                return answers
            step = 0.05 if left is None else min(0.05, left)
            ready, _, _ = select.select(list(waiting), [], [], step)
            for fd in ready:
                peer = waiting[fd]
                lines = peer.channel.read_lines()
                if lines:
                    answers[peer.pid] = lines[0].split() or ["?"]
                elif peer.channel.closed:
                    closing[peer.pid] = time.monotonic() + EXIT_WITHIN
                if lines or peer.channel.closed:
                    del waiting[fd]
            for pid, until in list(closing.items()):
                if not self.ctx.child.owns(pid):
                    del closing[pid]
                elif time.monotonic() > until:
                    answers[pid] = [protocol.REFUSED, *CLOSED.split()]
                    del closing[pid]
        return answers
