"""NVML, through ``pynvml`` (the optional extra ``nvml``): the one module that uses it.

What the GPUs are and what they hold: used to confirm a release (the member's memory
is really gone: "Verified release" in vramlock-strategies(7)), to check free VRAM
before a checkpoint restore, for ``who``, and for serve's llama-swap performance samples
and hardware description (``readings``, ``cards``). Importing this module imports nothing;
``pynvml`` is imported, and NVML initialised, on first use. Without it, ``available()``
is False and the other functions raise NvmlUnavailable.

A GPU is named by its NVML index or its UUID (``GPU-…``). NVML's indexes follow the
PCI bus order, which is not CUDA's default order: pass UUIDs between processes, or
set ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` for children.

Per-process figures are what NVML reports: pids in the namespace NVML sees, and 0
for a process whose usage the driver does not report.

Errors::

    VramlockError
    ├── NvmlUnavailable       pynvml is not installed or NVML did not initialise (reason)
    └── NvmlError             an NVML call failed (call, reason)
"""

from __future__ import annotations

import importlib
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

from ..errors import VramlockError

POLL_INTERVAL = 0.05

# Which GPUs a question is about: an index, a UUID, several indices, or None for all.
Which: TypeAlias = int | str | Sequence[int] | None


class NvmlUnavailable(VramlockError):
    """NVML cannot be used here."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"NVML unavailable: {reason}")
        self.reason = reason


class NvmlError(VramlockError):
    """An NVML call failed (a GPU fell off the bus, an unknown UUID...)."""

    def __init__(self, call: str, reason: str) -> None:
        super().__init__(f"NVML {call}: {reason}")
        self.call = call
        self.reason = reason


@dataclass(frozen=True)
class Gpu:
    """One GPU as NVML sees it; memory figures in bytes, read when this was made."""

    index: int
    uuid: str
    name: str
    total: int
    used: int
    free: int


_lock = threading.Lock()
_pynvml: Any = None
_missing: str | None = None


def _nvml() -> Any:
    """The initialised pynvml module (imported and initialised once)."""
    global _pynvml, _missing
    with _lock:
        if _pynvml is not None:
            return _pynvml
        if _missing is not None:
            raise NvmlUnavailable(_missing)
        try:
            # The old `pynvml` wrapper package warns on import that it is deprecated.
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                pynvml = importlib.import_module("pynvml")
        except ImportError:
            _missing = "pynvml is not installed (the nvml extra: pip install nvidia-ml-py)"
            raise NvmlUnavailable(_missing) from None
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as e:
            _missing = f"nvmlInit failed: {e}"
            raise NvmlUnavailable(_missing) from None
        _pynvml = pynvml
        return pynvml


def _call(what: str, fn: Callable[..., Any], *args: Any) -> Any:
    nv = _nvml()
    try:
        return fn(*args)
    except nv.NVMLError as e:
        raise NvmlError(what, str(e)) from None


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value  # bytes before 11.515


def warm() -> None:
    """Import pynvml and initialise NVML in a thread of its own, now: the first call
    otherwise pays it (tenths of a second on a GPU host), and a wrapper's first is on
    its first handoff, a waiter's time. A call meanwhile waits for it, not twice."""
    if _pynvml is None and _missing is None:
        threading.Thread(target=available, name="vramlock-nvml", daemon=True).start()


def available() -> bool:
    """Is NVML usable here? (Imports pynvml and initialises NVML once.)"""
    try:
        _nvml()
    except NvmlUnavailable:
        return False
    return True


def driver_version() -> str:
    """The kernel driver's version, e.g. ``580.159.04``."""
    nv = _nvml()
    return _text(_call("nvmlSystemGetDriverVersion", nv.nvmlSystemGetDriverVersion))


def _handle(gpu: int | str) -> Any:
    nv = _nvml()
    if isinstance(gpu, str):
        return _call("nvmlDeviceGetHandleByUUID", nv.nvmlDeviceGetHandleByUUID, gpu)
    return _call("nvmlDeviceGetHandleByIndex", nv.nvmlDeviceGetHandleByIndex, gpu)


def _describe(handle: Any) -> Gpu:
    nv = _nvml()
    mem = _call("nvmlDeviceGetMemoryInfo", nv.nvmlDeviceGetMemoryInfo, handle)
    return Gpu(
        index=_call("nvmlDeviceGetIndex", nv.nvmlDeviceGetIndex, handle),
        uuid=_text(_call("nvmlDeviceGetUUID", nv.nvmlDeviceGetUUID, handle)),
        name=_text(_call("nvmlDeviceGetName", nv.nvmlDeviceGetName, handle)),
        total=int(mem.total),
        used=int(mem.used),
        free=int(mem.free),
    )


def count() -> int:
    nv = _nvml()
    return int(_call("nvmlDeviceGetCount", nv.nvmlDeviceGetCount))


def gpus() -> list[Gpu]:
    """Every GPU, by NVML index."""
    return [gpu(i) for i in range(count())]


def gpu(which: int | str) -> Gpu:
    """One GPU by NVML index or UUID."""
    return _describe(_handle(which))


def free_bytes(which: int | str) -> int:
    return gpu(which).free


def _processes(handle: Any) -> dict[int, int]:
    nv = _nvml()
    out: dict[int, int] = {}
    for call in ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses"):
        for proc in _call(call, getattr(nv, call), handle):
            used = proc.usedGpuMemory or 0  # None: the driver does not say
            # A process with both kinds of context is listed twice with its one total.
            out[proc.pid] = max(out.get(proc.pid, 0), int(used))
    return out


def processes(which: Which = None) -> dict[int, int]:
    """pid -> bytes of GPU memory, for compute and graphics processes on one GPU (an
    index or a UUID), on several (a sequence of indices) or on every GPU (``None``),
    summed per pid."""
    if isinstance(which, (int, str)):
        return _processes(_handle(which))
    out: dict[int, int] = {}
    for index in range(count()) if which is None else which:
        for pid, used in _processes(_handle(index)).items():
            out[pid] = out.get(pid, 0) + used
    return out


def used_by(pids: Iterable[int], which: Which = None) -> int:
    """Bytes of GPU memory that ``pids`` hold together on ``which`` (see ``processes``)."""
    procs = processes(which)
    return sum(procs.get(pid, 0) for pid in set(pids))


def _poll(done: Callable[[], bool], timeout: float | None, interval: float) -> bool:
    end = None if timeout is None else time.monotonic() + timeout
    while not done():
        if end is not None and time.monotonic() >= end:
            return False
        time.sleep(interval)
    return True


def wait_released(
    pids: Iterable[int],
    which: Which,
    timeout: float | None,
    *,
    keep_bytes: int = 0,
    interval: float = POLL_INTERVAL,
) -> bool:
    """Poll until ``pids`` hold at most ``keep_bytes`` of GPU memory; False at ``timeout``.

    A checkpointed process leaves NVML's list altogether (``keep_bytes=0``); one that
    offloads its tensors itself keeps its CUDA context (about 0.5 GiB on an H200).
    """
    wanted = set(pids)
    return _poll(lambda: used_by(wanted, which) <= keep_bytes, timeout, interval)


def wait_free(
    which: int | str,
    need_bytes: int,
    timeout: float | None,
    *,
    interval: float = POLL_INTERVAL,
) -> bool:
    """Poll until the GPU has ``need_bytes`` free; False at ``timeout``.

    Call before a checkpoint restore, with the footprint plus a margin: a restore
    that runs out of memory wedges the process.
    """
    return _poll(lambda: free_bytes(which) >= need_bytes, timeout, interval)


def _optional(call: str, *args: Any) -> Any:
    """NVML's ``call`` (a pynvml function's name); None where this NVML or this GPU does
    not have it (a fan on a passively cooled card, an older pynvml)."""
    nv = _nvml()
    fn = getattr(nv, call, None)
    if fn is None:
        return None
    try:
        return fn(*args)
    except nv.NVMLError:
        return None


@dataclass(frozen=True)
class Reading:
    """One GPU's figures of the moment; None where NVML does not say."""

    gpu: Gpu
    temperature: int | None  # °C, the GPU's sensor
    utilization: int | None  # % of the last sample period in which a kernel ran
    fan: int | None  # % of the fan's full speed
    power: float | None  # watts drawn


def readings() -> list[Reading]:
    """Every GPU's figures of the moment, by NVML index."""
    nv = _nvml()
    out = []
    for index in range(count()):
        handle = _handle(index)
        rates = _optional("nvmlDeviceGetUtilizationRates", handle)
        power = _optional("nvmlDeviceGetPowerUsage", handle)  # milliwatts
        sensor = getattr(nv, "NVML_TEMPERATURE_GPU", 0)
        out.append(Reading(
            gpu=_describe(handle),
            temperature=_optional("nvmlDeviceGetTemperature", handle, sensor),
            utilization=None if rates is None else int(rates.gpu),
            fan=_optional("nvmlDeviceGetFanSpeed", handle),
            power=None if power is None else power / 1000,
        ))  # fmt: skip
    return out


@dataclass(frozen=True)
class Card:
    """What a GPU is, beyond ``Gpu``: None where NVML does not say."""

    gpu: Gpu
    compute_capability: tuple[int, int] | None  # (major, minor)
    power_limit: float | None  # watts: the power management limit


def cards() -> list[Card]:
    """Every GPU, by NVML index."""
    out = []
    for index in range(count()):
        handle = _handle(index)
        capability = _optional("nvmlDeviceGetCudaComputeCapability", handle)
        limit = _optional("nvmlDeviceGetPowerManagementLimit", handle)  # milliwatts
        out.append(Card(
            gpu=_describe(handle),
            compute_capability=None if capability is None else (capability[0], capability[1]),
            power_limit=None if not limit else limit / 1000,
        ))  # fmt: skip
    return out
