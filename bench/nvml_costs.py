"""What a verified release asks of the machine: NVML's process queries, and a scan of
/proc of the kind that finding a command's process group takes.

    python bench/nvml_costs.py

Medians (and maxima) of 200 calls each, 20 for the scan. Without NVML only the /proc
figures are printed.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable

from vramlock import procfs
from vramlock.gpu import nvml


def timed(call: Callable[[], object], n: int) -> str:
    spent = []
    for _ in range(n):
        t = time.perf_counter_ns()
        call()
        spent.append(time.perf_counter_ns() - t)
    return f"median {statistics.median(spent) / 1000:.1f} us, max {max(spent) / 1000:.1f} us"


def main() -> None:
    print("cpus", os.cpu_count(), "processes", len(procfs.all_pids()))
    t = time.perf_counter()
    ok = nvml.available()
    print("nvml.available", ok, f"{(time.perf_counter() - t) * 1000:.1f} ms")
    if ok:
        print("processes((0,))", timed(lambda: nvml.processes((0,)), 200))
    print("scan of /proc (group_pids)", timed(lambda: procfs.group_pids(1), 20))
    print("descendants of this process", timed(lambda: procfs.descendants(os.getpid()), 50))


if __name__ == "__main__":
    main()
