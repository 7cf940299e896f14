"""A stand-in for pynvml, for benchmarks on a machine without an NVIDIA GPU.

Put this directory on ``PYTHONPATH`` and vramlock finds "NVML": one GPU with no
process on it, each process query taking 10 µs (about what
``nvmlDeviceGetComputeRunningProcesses`` took on an idle H200 host). It lets the
handoff benchmark run the verified-release path that GPU hosts run. Only what
vramlock's release path calls is here.
"""

from __future__ import annotations

import time

QUERY_SECONDS = 10e-6


class NVMLError(Exception):
    pass


def nvmlInit() -> None:
    pass


def nvmlDeviceGetCount() -> int:
    return 1


def nvmlDeviceGetHandleByIndex(index: int) -> int:
    return index


def _query() -> list[object]:
    end = time.perf_counter() + QUERY_SECONDS
    while time.perf_counter() < end:
        pass
    return []


def nvmlDeviceGetComputeRunningProcesses(handle: int) -> list[object]:
    return _query()


def nvmlDeviceGetGraphicsRunningProcesses(handle: int) -> list[object]:
    return _query()
