"""The CUDA driver binding: the one module that calls ``libcuda.so.1``.

Only the driver's checkpoint API (r570+) is bound, through ctypes with declared
``argtypes``/``restype``. The library is loaded, and ``cuInit`` called, on first
use: importing this module costs nothing and needs no GPU. ``cuInit`` creates no
context, so the calling process takes no VRAM.

A checkpoint moves a whole process's device memory (and its CUDA context) into
host memory that the driver manages, and a restore brings it back; the process
keeps running on the CPU meanwhile, and its CUDA calls block until it is unlocked::

    pids = cuda.cuda_pids(procfs.descendants(child_pid) + [child_pid])
    cuda.checkpoint_all(pids, lock_timeout_s=30)  # VRAM free once this returns
    ...
    cuda.restore_all(pids)                        # check free VRAM first (nvml)

Never SIGSTOP a target: the driver does the work on a thread inside it.

Errors (all carry their data)::

    VramlockError
    ├── CudaUnavailable           no libcuda.so.1, no checkpoint API, or cuInit failed (reason)
    └── CudaError                 a driver call failed (call, code, name, pid)
        ├── InvalidValue          1
        ├── OutOfMemory           2: a restore lacked VRAM; the target is wedged until killed
        ├── NotInitialized        3: the pid uses no CUDA
        ├── DriverOSError         304: also what a pid that does not exist gets
        ├── IllegalState          401: the call does not fit the process's state
        ├── LockTimeout           600: work still running at the lock timeout; still RUNNING
        └── NotSupported          801: managed memory, MPS, MIG...
            └── NotCheckpointable raised by checkpoint after unlocking: still RUNNING
"""

from __future__ import annotations

import ctypes
import enum
import math
import os
import threading
from collections.abc import Iterable, Sequence

from .. import procfs
from ..errors import Immovable, VramlockError

LIBRARY = "libcuda.so.1"


class ProcessState(enum.IntEnum):
    """CUprocessState: where a process stands in the checkpoint cycle."""

    RUNNING = 0
    LOCKED = 1
    CHECKPOINTED = 2
    FAILED = 3


class CudaUnavailable(VramlockError):
    """The driver cannot checkpoint here: no libcuda, an old driver, or no usable GPU."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"CUDA checkpoint API unavailable: {reason}")
        self.reason = reason


class CudaError(VramlockError):
    """A driver call returned an error code."""

    code = -1

    def __init__(
        self, call: str, code: int, pid: int | None = None, name: str = "", says: str = ""
    ) -> None:
        self.call = call
        self.code = code
        self.pid = pid
        self.name = name or _NAMES.get(code, f"CUDA_ERROR_{code}")
        target = "" if pid is None else f" for pid {pid}"
        super().__init__(says or f"{call}{target}: {self.name} ({code})")


class InvalidValue(CudaError):
    code = 1


class OutOfMemory(CudaError):
    """Too little free VRAM for a restore: the driver leaves the process wedged (driver 580)."""

    code = 2


class NotInitialized(CudaError):
    """The pid has no CUDA context (or is gone)."""

    code = 3


class DriverOSError(CudaError):
    code = 304


class IllegalState(CudaError):
    code = 401


class LockTimeout(CudaError):
    """CUDA_ERROR_NOT_READY from a lock: submitted work outlasted the timeout."""

    code = 600


class NotSupported(CudaError):
    code = 801


class NotCheckpointable(NotSupported, Immovable):
    """The process uses something the driver cannot checkpoint (managed memory, MPS,
    MIG); it was unlocked again and keeps running."""

    def __init__(self, pid: int) -> None:
        super().__init__(
            "cuCheckpointProcessCheckpoint",
            NotSupported.code,
            pid,
            says=f"process {pid} cannot be checkpointed (it uses managed memory, MPS or MIG);"
            " it was left running",
        )


_NAMES = {
    1: "CUDA_ERROR_INVALID_VALUE",
    2: "CUDA_ERROR_OUT_OF_MEMORY",
    3: "CUDA_ERROR_NOT_INITIALIZED",
    4: "CUDA_ERROR_DEINITIALIZED",
    100: "CUDA_ERROR_NO_DEVICE",
    304: "CUDA_ERROR_OPERATING_SYSTEM",
    401: "CUDA_ERROR_ILLEGAL_STATE",
    600: "CUDA_ERROR_NOT_READY",
    801: "CUDA_ERROR_NOT_SUPPORTED",
    999: "CUDA_ERROR_UNKNOWN",
}

# The one place where result codes become exceptions.
_BY_CODE: dict[int, type[CudaError]] = {
    cls.code: cls
    for cls in (
        InvalidValue,
        OutOfMemory,
        NotInitialized,
        DriverOSError,
        IllegalState,
        LockTimeout,
        NotSupported,
    )
}


class _LockArgs(ctypes.Structure):
    # CUcheckpointLockArgs. timeoutMs comes first: docs that list the members
    # alphabetically put it after reserved0, which silently disables the timeout.
    _fields_ = (
        ("timeoutMs", ctypes.c_uint),
        ("reserved0", ctypes.c_uint),
        ("reserved1", ctypes.c_uint64 * 7),
    )


class _Args(ctypes.Structure):
    # The checkpoint, restore and unlock args: 64 bytes, all zero means defaults
    # (restore's gpuPairs pointer and count at offsets 0 and 8 stay NULL/0).
    _fields_ = (("reserved", ctypes.c_uint64 * 8),)


assert ctypes.sizeof(_LockArgs) == ctypes.sizeof(_Args) == 64

_PID = ctypes.c_int
_INT_P = ctypes.POINTER(ctypes.c_int)

# name -> argtypes; every one returns CUresult (an int).
_SIGNATURES: dict[str, tuple[object, ...]] = {
    "cuInit": (ctypes.c_uint,),
    "cuDriverGetVersion": (_INT_P,),
    "cuGetErrorName": (ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)),
}
_CHECKPOINT_SIGNATURES: dict[str, tuple[object, ...]] = {
    "cuCheckpointProcessGetState": (_PID, _INT_P),
    "cuCheckpointProcessGetRestoreThreadId": (_PID, _INT_P),
    "cuCheckpointProcessLock": (_PID, ctypes.POINTER(_LockArgs)),
    "cuCheckpointProcessCheckpoint": (_PID, ctypes.POINTER(_Args)),
    "cuCheckpointProcessRestore": (_PID, ctypes.POINTER(_Args)),
    "cuCheckpointProcessUnlock": (_PID, ctypes.POINTER(_Args)),
}

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_missing: str | None = None  # why the checkpoint API cannot be used, once known


def _declare(lib: ctypes.CDLL, signatures: dict[str, tuple[object, ...]]) -> None:
    for name, argtypes in signatures.items():
        fn = getattr(lib, name)  # AttributeError: the driver lacks it
        fn.argtypes = argtypes
        fn.restype = ctypes.c_int


def _load() -> ctypes.CDLL:
    """The driver library with cuInit done and the checkpoint API declared."""
    global _lib, _missing
    with _lock:
        if _lib is not None:
            return _lib
        if _missing is not None:
            raise CudaUnavailable(_missing)
        try:
            lib = ctypes.CDLL(LIBRARY)
            _declare(lib, _SIGNATURES)
        except (OSError, AttributeError) as e:
            _missing = f"cannot load {LIBRARY} ({e})"
            raise CudaUnavailable(_missing) from None
        try:
            _declare(lib, _CHECKPOINT_SIGNATURES)
        except AttributeError:
            _missing = f"driver {_version(lib)} has no checkpoint API (needs 570 or newer)"
            raise CudaUnavailable(_missing) from None
        code = lib.cuInit(0)
        if code != 0:
            _missing = f"cuInit failed: {_name(lib, code)} ({code})"
            raise CudaUnavailable(_missing)
        _lib = lib
        return lib


def _version(lib: ctypes.CDLL) -> str:
    out = ctypes.c_int(0)
    if lib.cuDriverGetVersion(ctypes.byref(out)) != 0:
        return "?"
    return f"API {out.value // 1000}.{out.value % 1000 // 10}"


def _name(lib: ctypes.CDLL, code: int) -> str:
    if code in _NAMES:
        return _NAMES[code]
    out = ctypes.c_char_p()
    if lib.cuGetErrorName(code, ctypes.byref(out)) == 0 and out.value:
        return out.value.decode()
    return f"CUDA_ERROR_{code}"


def _call(call: str, pid: int, *args: object) -> None:
    lib = _load()
    code = getattr(lib, call)(pid, *args)
    if code != 0:
        cls = _BY_CODE.get(code, CudaError)
        raise cls(call, code, pid, _name(lib, code))


def require_checkpoint_api() -> None:
    """Raise CudaUnavailable (with the reason) unless the driver here can checkpoint."""
    _load()


def has_checkpoint_api() -> bool:
    """True when the driver here can checkpoint processes (loads the library once)."""
    try:
        _load()
    except CudaUnavailable:
        return False
    return True


def driver_version() -> int:
    """The CUDA API version the driver supports, e.g. 13000 for 13.0."""
    try:
        lib = ctypes.CDLL(LIBRARY)
        _declare(lib, {"cuDriverGetVersion": _SIGNATURES["cuDriverGetVersion"]})
    except (OSError, AttributeError) as e:
        raise CudaUnavailable(f"cannot load {LIBRARY} ({e})") from None
    out = ctypes.c_int(0)
    code = lib.cuDriverGetVersion(ctypes.byref(out))
    if code != 0:
        raise _BY_CODE.get(code, CudaError)("cuDriverGetVersion", code)
    return out.value


def process_state(pid: int) -> ProcessState:
    """The checkpoint state of ``pid``; NotInitialized when it uses no CUDA. ~0.2 ms."""
    out = ctypes.c_int(-1)
    _call("cuCheckpointProcessGetState", pid, ctypes.byref(out))
    return ProcessState(out.value)


def restore_thread_id(pid: int) -> int:
    """The thread inside ``pid`` that does its checkpoint and restore work."""
    out = ctypes.c_int(0)
    _call("cuCheckpointProcessGetRestoreThreadId", pid, ctypes.byref(out))
    return out.value


def driver_in(paths: set[str]) -> bool:
    """Do these mapped files (``procfs.mapped``) hold the CUDA driver?"""
    return any(os.path.basename(p).startswith("libcuda.so") for p in paths)


def uses_cuda(pid: int) -> bool:
    """Does ``pid`` have a CUDA context the driver could checkpoint?"""
    try:
        process_state(pid)
    except NotInitialized:
        return False
    except DriverOSError:
        if not procfs.living(pid):
            return False  # the driver answers 304 for a pid that is gone
        raise
    return True


def cuda_pids(pids: Iterable[int]) -> list[int]:
    """The pids among ``pids`` that use CUDA, in the given order, duplicates dropped.

    Give it a whole process tree: a job may run CUDA in any of its processes.
    """
    seen: set[int] = set()
    out: list[int] = []
    for pid in pids:
        if pid not in seen:
            seen.add(pid)
            if uses_cuda(pid):
                out.append(pid)
    return out


def lock(pid: int, timeout_s: float | None = None) -> None:
    """RUNNING -> LOCKED: wait for submitted work, then block new CUDA calls.

    ``None`` waits as long as the work takes; LockTimeout leaves the process RUNNING.
    """
    args = _LockArgs()
    # 0 means "no timeout" to the driver, so a tiny positive timeout rounds up to 1 ms.
    args.timeoutMs = 0 if timeout_s is None else max(1, math.ceil(timeout_s * 1000))
    _call("cuCheckpointProcessLock", pid, ctypes.byref(args))


def unlock(pid: int) -> None:
    """LOCKED -> RUNNING: blocked CUDA calls go on."""
    _call("cuCheckpointProcessUnlock", pid, ctypes.byref(_Args()))


def _checkpoint_locked(pid: int) -> None:
    """LOCKED -> CHECKPOINTED: device memory and context move to host memory."""
    _call("cuCheckpointProcessCheckpoint", pid, ctypes.byref(_Args()))


def _restore_checkpointed(pid: int) -> None:
    """CHECKPOINTED -> LOCKED. Check free VRAM first: OutOfMemory wedges the process."""
    _call("cuCheckpointProcessRestore", pid, ctypes.byref(_Args()))


def _unlock_quietly(pids: Iterable[int]) -> None:
    for pid in pids:
        try:
            unlock(pid)
        except CudaError:
            pass  # already failing: the first error is the one to report


def checkpoint_all(pids: Sequence[int], lock_timeout_s: float | None = None) -> None:
    """Lock every pid, then checkpoint each: all of a job's VRAM is free on return.

    All are locked before any is checkpointed, so that no process of the job
    runs on against a peer whose memory is gone. On failure everything done is
    undone (restored, unlocked) and the error raised: LockTimeout (still running),
    NotCheckpointable (801; still running), or another CudaError.
    """
    locked: list[int] = []
    done: list[int] = []
    try:
        for pid in pids:
            lock(pid, lock_timeout_s)
            locked.append(pid)
        for pid in pids:
            try:
                _checkpoint_locked(pid)
            except NotSupported:
                raise NotCheckpointable(pid) from None
            done.append(pid)
    except CudaError:
        # The VRAM just freed by `done` is there again for their restore.
        for pid in done:
            try:
                _restore_checkpointed(pid)
            except CudaError:
                pass
        _unlock_quietly(locked)
        raise


def restore_all(pids: Sequence[int]) -> None:
    """Restore every pid, then unlock each: the job runs again on return.

    Confirm first that the GPU has free VRAM for the job's footprint plus a
    margin (``nvml.wait_free``): a restore that runs out of memory raises
    OutOfMemory and leaves that process wedged until it is killed. A pid that is
    gone (killed while checkpointed) is passed over: the others must not stay
    checkpointed for want of it.
    """
    living = []
    for pid in pids:
        try:
            _restore_checkpointed(pid)
        except CudaError:
            if procfs.living(pid):
                raise
            continue
        living.append(pid)
    for pid in living:
        try:
            unlock(pid)
        except CudaError:
            if procfs.living(pid):
                raise


def checkpoint(pid: int, lock_timeout_s: float | None = None) -> None:
    """``checkpoint_all`` for one process."""
    checkpoint_all([pid], lock_timeout_s)


def restore(pid: int) -> None:
    """``restore_all`` for one process."""
    restore_all([pid])
