"""``vramlock run --release swap`` on a real NVIDIA GPU, with unmodified PyTorch programs.

Skipped without a GPU (see tests/test_gpu.py). Servers, trainers, the CUDA llama-server
and managed memory under swap are in test_gpu_server.py, test_gpu_run.py and
test_gpu_llama.py, beside the same tests under checkpoint. The witnesses here are
independent of vramlock's own account: the program's answers (checksums computed on
the GPU, a CUDA graph's output), NVML (what the process holds on the GPU), and a
flock(1) member that holds the token while the test looks (tests/helpers/processes.py's
waiting_holder): while it does, the program's GPU work must not run.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from helpers.commands import vramlock, who_json
from helpers.gpu import ALLOCATORS, GIB, SWAP_KEEPS, env_with, gpu
from helpers.processes import Spawn, wait_until, waiting_holder

from vramlock.gpu import nvml

pytestmark = [gpu, pytest.mark.timeout(300)]

SWAPS = 3


def swap_worker(spawn: Spawn, arena: Path, allocator: str, *args: str) -> Any:
    """``vramlock run --release swap -- gpu_worker.py ARGS`` under PyTorch's ALLOCATOR."""
    worker = __import__("gpu_worker")
    run = vramlock("run", "--arena", str(arena), "--release", "swap", "--min-hold", "0")
    proc = spawn([*run, "--", sys.executable, worker.PATH, *args],
                 stdin=subprocess.PIPE, env=env_with(ALLOCATORS[allocator]))  # fmt: skip
    return worker.Client(proc)


def row_of(arena: Path, pid: int) -> dict[str, Any]:
    (row,) = [r for r in who_json(arena) if r["member"] and r["child_pid"] == pid]
    return row


@pytest.mark.parametrize(
    ("allocator", "graph"),
    [
        ("caching", False),
        ("expandable", False),
        ("async", False),
        ("caching", True),
        ("expandable", True),
    ],
    ids=["caching", "expandable", "async", "graph", "graph-expandable"],
)
def test_swap_keeps_a_pytorch_program_and_its_cuda_graph(
    allocator: str, graph: bool, arena: Path, spawn: Spawn
) -> None:
    """Released SWAPS times: its 2 GiB leave the GPU, its GPU work waits while another
    member holds the token, and it comes back with the same data at the same addresses
    (a CUDA graph captured at the start replays to the same output)."""
    w = swap_worker(spawn, arena, allocator, "--gib", "2", *(["--graph"] if graph else []))
    full = nvml.processes()[w.pid]
    assert full >= 2 * GIB
    replayed = w.replay() if graph else None
    for n in range(SWAPS):
        started = time.monotonic()
        holder = waiting_holder(spawn, arena)  # returns once the worker has let go
        out_s = time.monotonic() - started
        held = nvml.processes().get(w.pid, 0)
        # Its 2 GiB left (the library's copy streams add a few MiB to its context).
        assert held <= SWAP_KEEPS and full - held >= 2 * GIB - (16 << 20), (full, held)
        row = row_of(arena, w.pid)
        assert row["strategy"] == "swap" and row["state"] in ("released", "waiting"), row
        w.send("check")  # its kernels wait at the gate while the other member holds the token
        assert w.silent(1.0)
        assert holder.stdin is not None
        holder.stdin.close()
        holder.wait(30)
        started = time.monotonic()
        word, value = w.read(120).split()
        back_s = time.monotonic() - started
        assert (word, int(value)) == ("sum", w.checksum)
        now = nvml.processes()[w.pid]
        print(f"swap {n}: out {out_s:.3f} s, back + check {back_s:.3f} s;"
              f" GPU MiB {full >> 20} -> {held >> 20} -> {now >> 20}")  # fmt: skip
        assert now >= full - (64 << 20)
        if graph:
            assert w.replay() == replayed
    assert row_of(arena, w.pid)["state"] == "resident"
    w.close()
    assert w.proc.wait(30) == 0
    err = w.proc.stderr.read() if w.proc.stderr else ""
    assert "vramlock-swap" not in err, err  # the library says nothing on the happy path


def test_auto_swaps_a_pytorch_program(arena: Path, spawn: Spawn) -> None:
    """Under plain ``vramlock run`` (auto, no --release) a PyTorch worker is released by
    swap: while a flock(1) member holds the token NVML shows its 2 GiB gone but its CUDA
    context, its kernels wait, and it comes back with the same checksum."""
    worker = __import__("gpu_worker")
    run = vramlock("run", "--arena", str(arena), "--min-hold", "0")
    proc = spawn([*run, "--", sys.executable, worker.PATH, "--gib", "2"], stdin=subprocess.PIPE)
    w = worker.Client(proc)
    full = nvml.processes()[w.pid]
    assert full >= 2 * GIB
    for n in range(SWAPS):
        started = time.monotonic()
        holder = waiting_holder(spawn, arena)  # auto gives the command a second to say hello
        out_s = time.monotonic() - started
        held = nvml.processes().get(w.pid, 0)
        assert held <= SWAP_KEEPS and full - held >= 2 * GIB - (16 << 20), (full, held)
        wait_until(lambda: row_of(arena, w.pid)["strategy"] == "auto:swap")
        w.send("check")
        assert w.silent(1.0)
        assert holder.stdin is not None
        holder.stdin.close()
        holder.wait(30)
        word, value = w.read(120).split()
        assert (word, int(value)) == ("sum", w.checksum)
        print(f"auto swap {n}: out {out_s:.3f} s; GPU MiB {full >> 20} -> {held >> 20}")
    w.close()
    assert w.proc.wait(30) == 0
    err = w.proc.stderr.read() if w.proc.stderr else ""
    assert "vramlock" not in err, err  # neither the wrapper nor the library said anything


def test_a_released_program_whose_wrapper_dies_stays_off_the_gpu(arena: Path, spawn: Spawn) -> None:
    """The wrapper is SIGKILLed while its program is released: the program stays at its
    gate (no GPU work, no memory back on the GPU) even once the token is free again,
    and ``who`` still shows it."""
    w = swap_worker(spawn, arena, "caching", "--gib", "1")
    try:
        holder = waiting_holder(spawn, arena)
        held = nvml.processes().get(w.pid, 0)
        assert held <= SWAP_KEEPS
        w.proc.kill()
        w.proc.wait(10)
        assert holder.stdin is not None
        holder.stdin.close()
        holder.wait(30)  # the token is free: nobody may give the program the GPU
        w.send("check")
        assert w.silent(3.0)
        assert nvml.processes().get(w.pid, 0) <= held + (16 << 20)
        os.kill(w.pid, 0)  # alive, blocked at its gate
        (row,) = [r for r in who_json(arena) if r["pid"] == w.pid]  # the library's own record
        print("who:", row)
        assert (row["state"], row["strategy"]) == ("released", "swap"), row
    finally:
        try:
            os.kill(w.pid, signal.SIGKILL)  # orphaned: the spawn fixture no longer finds it
        except ProcessLookupError:
            pass
