"""A stand-in for pynvml, for tests and benchmarks on a machine without an NVIDIA GPU.

Put this directory on ``PYTHONPATH`` and vramlock finds "NVML": one GPU of 80 GiB,
each process query taking 10 µs (about what ``nvmlDeviceGetComputeRunningProcesses``
took on an idle H200 host). Only what vramlock calls is here.

The processes on the GPU are what ``$FAKE_NVML_DIR`` says: a file named after a pid
holds the bytes that process uses (a test's command writes its own). Without the
variable, or for a pid that is gone, nobody uses the GPU. ``FAKE_NVML_DIR=none``: a
machine without the driver (``nvmlInit`` fails).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

QUERY_SECONDS = 10e-6
TOTAL = 80 << 30


class NVMLError(Exception):
    pass


@dataclass
class _Process:
    pid: int
    usedGpuMemory: int


@dataclass
class _Memory:
    total: int
    used: int
    free: int


def nvmlInit() -> None:
    if os.environ.get("FAKE_NVML_DIR") == "none":
        raise NVMLError("Driver Not Loaded")
    gate = os.environ.get("FAKE_NVML_INIT_GATE")
    if gate:  # a FIFO: the first call is as slow as the test makes it (a driver waking up)
        with open(gate) as f:
            f.read()


def nvmlSystemGetDriverVersion() -> str:
    return "0.0 (stand-in)"


def nvmlDeviceGetCount() -> int:
    return 1


def nvmlDeviceGetHandleByIndex(index: int) -> int:
    if index != 0:
        raise NVMLError("Invalid Argument")
    return index


def nvmlDeviceGetHandleByUUID(uuid: str) -> int:
    if uuid != nvmlDeviceGetUUID(0):
        raise NVMLError("Not Found")
    return 0


def nvmlDeviceGetIndex(handle: int) -> int:
    return handle


def nvmlDeviceGetUUID(handle: int) -> str:
    return "GPU-00000000-0000-0000-0000-000000000000"


def nvmlDeviceGetName(handle: int) -> str:
    return "stand-in GPU"


def _used() -> list[_Process]:
    where = os.environ.get("FAKE_NVML_DIR")
    if not where:
        return []
    out = []
    for name in os.listdir(where):
        if name.isdigit() and os.path.exists(f"/proc/{name}"):
            try:
                with open(os.path.join(where, name)) as f:
                    out.append(_Process(int(name), int(f.read() or 0)))
            except (OSError, ValueError):
                continue  # being written
    return out


def _query() -> list[_Process]:
    end = time.perf_counter() + QUERY_SECONDS
    while time.perf_counter() < end:
        pass
    return _used()


def nvmlDeviceGetMemoryInfo(handle: int) -> _Memory:
    used = sum(p.usedGpuMemory for p in _used())
    return _Memory(total=TOTAL, used=used, free=TOTAL - used)


def nvmlDeviceGetComputeRunningProcesses(handle: int) -> list[_Process]:
    return _query()


def nvmlDeviceGetGraphicsRunningProcesses(handle: int) -> list[_Process]:
    return []


# What a performance sample and the hardware's description read: an H100-like card,
# passively cooled (no fan to read).
NVML_TEMPERATURE_GPU = 0


@dataclass
class _Rates:
    gpu: int
    memory: int


def nvmlDeviceGetTemperature(handle: int, sensor: int) -> int:
    return 41


def nvmlDeviceGetUtilizationRates(handle: int) -> _Rates:
    # FAKE_NVML_SLOW_MS: as a busy driver, slow to answer
    time.sleep(float(os.environ.get("FAKE_NVML_SLOW_MS", "0")) / 1000)
    return _Rates(gpu=7, memory=3)


def nvmlDeviceGetFanSpeed(handle: int) -> int:
    raise NVMLError("Not Supported")


def nvmlDeviceGetPowerUsage(handle: int) -> int:
    return 71_500  # milliwatts


def nvmlDeviceGetPowerManagementLimit(handle: int) -> int:
    return 700_000


def nvmlDeviceGetCudaComputeCapability(handle: int) -> tuple[int, int]:
    return (9, 0)
