"""``checkpoint``: the NVIDIA driver moves the command's whole GPU state to host memory.

Every CUDA process of the command (its process group and everything descended
from it) is locked, then checkpointed: weights, KV cache, CUDA graphs and the
context itself leave the GPU, and the processes keep running on the CPU, their
CUDA calls blocking until the restore. No change to the program is needed.

A restore that runs out of VRAM wedges the process for good (driver 580), so the
restore first checks, with NVML, that each GPU the command used has its footprint
there plus a margin free; when one has not (a process that is not a member holds
memory), the member gives the token back and queues again instead.
"""

from __future__ import annotations

import time

from .. import procfs
from ..errors import StrategyError
from ..gpu import cuda, nvml
from . import deadline as deadlines
from .base import Context, ReleaseTimeout, Settings, Strategy

# Free VRAM needed beyond the footprint NVML reported: the context and allocator slack.
RESTORE_MARGIN = 512 << 20


class VramTaken(StrategyError):
    """Too little free VRAM to restore: queue again rather than wedge the process."""

    def __init__(self, need: int, free: int, gpu: int = 0) -> None:
        super().__init__(
            f"the restore needs {need / 2**30:.1f} GiB of free VRAM on GPU {gpu} and it has"
            f" {free / 2**30:.1f} GiB (held by a process that is not a member?);"
            " queueing again until it is there"
        )
        self.need = need
        self.free = free
        self.gpu = gpu


def footprint(pids: list[int], gpus: tuple[int, ...] | None) -> dict[int, int]:
    """What NVML shows ``pids`` holding on each GPU of ``gpus`` (None: every GPU) that
    they use; NVML's errors as it raises them."""
    used = {g: nvml.used_by(pids, g) for g in (range(nvml.count()) if gpus is None else gpus)}
    return {g: n for g, n in used.items() if n}


def short_of(held: dict[int, int]) -> tuple[int, int, int] | None:
    """(need, free, GPU) for the first GPU without room to restore what ``held`` says was
    there, plus RESTORE_MARGIN; None when every one has room, or NVML is not there.
    NvmlError as NVML raises it."""
    for gpu, used in held.items():
        need = used + RESTORE_MARGIN
        try:
            free = nvml.free_bytes(gpu)
        except nvml.NvmlUnavailable:
            return None
        if free < need:
            return need, free, gpu
    return None


def usable() -> str | None:
    """Why the checkpoint strategy cannot be used here, or None when it can."""
    try:
        cuda.require_checkpoint_api()
    except cuda.CudaUnavailable as err:
        return err.reason
    return None


class CheckpointStrategy(Strategy):
    """Lock and checkpoint every CUDA process of the command; restore and unlock."""

    name = "checkpoint"
    defers_signals = True

    def __init__(self, ctx: Context, settings: Settings) -> None:
        super().__init__(ctx, settings)
        self.pids: list[int] = []  # the processes checkpointed by the last release
        self.idle: dict[int, int] = {}  # pid: start, the driver mapped, not checkpointed
        # Their VRAM before it, per GPU index, as NVML reported it (empty: unknown).
        self.footprint: dict[int, int] = {}
        # Initialise NVML and load libcuda now, not on the handoff path: nvmlInit alone
        # takes a good part of a second on a big machine.
        nvml.available()
        usable()

    @classmethod
    def finds_work(cls, ctx: Context) -> bool:
        """Does the command run CUDA, and can this driver checkpoint it? (For ``auto``.)"""
        if usable() is not None:
            return False
        try:
            return bool(cuda.cuda_pids(ctx.child.processes()))
        except cuda.CudaError:
            return False

    def release(self, deadline: float | None) -> None:
        try:
            pids = cuda.cuda_pids(self.ctx.child.processes())
        except cuda.CudaError as err:
            raise StrategyError(str(err)) from None
        self.pids = []
        if not pids:
            # Not on the GPU yet (still starting, say): handing over now would let it
            # start CUDA later while somebody else is resident. Keep the token until
            # there is something to checkpoint; the runner tries again.
            raise StrategyError(
                "no process of the command uses CUDA yet, so there is nothing to"
                " checkpoint; it keeps the GPU until there is"
            )
        for pid in pids:
            if deadlines.is_stopped(pid):  # its lock would wait on it for ever
                raise deadlines.stopped(pid)
        self.footprint = self._used(pids)
        with deadlines.bounded(deadline, self.settings.release_within, self._late) as end:
            self._checkpoint(pids, end)
        self.pids = pids
        # Those with the driver mapped but no context now (workers forked from a CUDA
        # process): loose only once they make one (``loose``).
        self.idle = {}
        for pid in self.ctx.child.processes():
            paths = procfs.mapped(pid) if pid not in pids else None
            start = procfs.starttime(pid)
            if paths is not None and cuda.driver_in(paths) and start is not None:
                self.idle[pid] = start

    def _checkpoint(self, pids: list[int], end: float) -> None:
        """Lock and checkpoint ``pids``, their submitted work paused by ``end`` or
        ReleaseTimeout (every one left running)."""
        try:
            cuda.checkpoint_all(pids, max(0.001, end - time.monotonic()))
        except cuda.LockTimeout:
            raise ReleaseTimeout from None
        except cuda.NotCheckpointable:
            raise  # as it is: the runner falls back to holding the GPU
        except cuda.CudaError as err:
            raise StrategyError(str(err)) from None

    @staticmethod
    def _late(within: float) -> deadlines.NoAnswer:
        return deadlines.late("the command's GPU work", "its GPU work", within)

    holds_processes = True

    def loose(self, pids: list[int]) -> tuple[list[int], list[int]]:
        """A process that was not checkpointed by the release and has the driver mapped
        (it may be making its context: the driver cannot checkpoint it yet) is loose,
        unless it had it mapped at the release already without a context, or is a copy
        of such a process or of a checkpointed one (a worker forked from a CUDA process,
        before the release or after it): that one is loose once the driver says it has
        one. Every other process that was not checkpointed could begin to."""
        held = set(self.pids)
        loose: list[int] = []
        suspects: list[int] = []
        for pid in pids:
            if pid in held:
                continue
            paths = procfs.mapped(pid)
            if paths is None:
                continue  # gone, or closed to us
            if not cuda.driver_in(paths):
                suspects.append(pid)
            elif self.idle.get(pid) != procfs.starttime(pid) and not self._forked(pid):
                loose.append(pid)
            else:
                try:
                    (loose if cuda.uses_cuda(pid) else suspects).append(pid)
                except cuda.CudaError:
                    suspects.append(pid)
        return loose, suspects

    def _forked(self, pid: int) -> bool:
        """Is ``pid`` forked, without an exec since, from a process the release
        checkpointed or found idle (through parents forked the same way)? A fork keeps
        its parent's layout (procfs.layout); an exec lays the program out anew."""
        image = procfs.layout(pid)
        parent = procfs.ppid(pid)
        while image is not None and parent:
            above = procfs.layout(parent)
            if above is None or above[1:] != image[1:]:
                return False
            if parent in self.pids or parent in self.idle:
                return True
            parent = procfs.ppid(parent)
        return False

    def _used(self, pids: list[int]) -> dict[int, int]:
        try:
            return footprint(pids, self.settings.gpus)
        except (nvml.NvmlUnavailable, nvml.NvmlError):
            return {}

    def verify(self, deadline: float | None) -> None:
        # A checkpointed process leaves NVML's list altogether: nothing may remain.
        self.verify_gone(lambda pid: pid in self.pids, keep_bytes=0)

    def _restore(self) -> None:
        if not self.pids:
            return
        self._check_free()
        try:
            cuda.restore_all(self.pids)
        except cuda.CudaError as err:
            raise StrategyError(f"restore: {err}") from None

    def _check_free(self) -> None:
        # Not cut short by an order to end: the command gets it once restored (a
        # checkpointed process must not run its exit path), so restoring is the way out.
        end = time.monotonic() + 1.0  # memory being freed by the last holder settles
        while True:
            short = self._short()
            if short is None:
                return
            if time.monotonic() >= end:
                raise VramTaken(*short)
            time.sleep(0.05)

    def _short(self) -> tuple[int, int, int] | None:
        """(need, free, GPU) for a GPU without room for its footprint plus the margin."""
        try:
            return short_of(self.footprint)
        except nvml.NvmlError as err:
            raise StrategyError(str(err)) from None
