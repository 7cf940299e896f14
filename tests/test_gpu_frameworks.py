"""Plain ``vramlock run`` swaps every CUDA framework the GPU machine has, not only PyTorch.

JAX (XLA's allocator and its preallocated pool), CuPy (its memory pool), Numba, the
driver API through cuda-python, a C program built with the static CUDA runtime,
``torch.compile``'s CUDA graphs of Triton kernels, a one-rank NCCL job and CuPy's cuFFT
(tests/gpu_frameworks.py). Witnesses are the test's own: the program's checksum
reduced on the GPU, NVML's account of what the process holds, and a flock(1) member
that holds the token while the test looks. Skipped without a GPU.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from helpers.commands import vramlock, who_json
from helpers.gpu import GIB, SWAP_KEEPS, BothOnGpu, gpu
from helpers.processes import Spawn, wait_until, waiting_holder

from vramlock.gpu import nvml

pytestmark = [gpu, pytest.mark.timeout(300)]

SWAPS = 5
FRAMEWORKS = ["jax", "cupy", "numba", "driver", "static", "triton", "compile", "nccl", "cufft"]
# JAX takes 75 % of the GPU at its first use unless told less: on a 141 GB card that is
# more than the host can pin. Its default is tested on its own below. Told 10 %: a pool
# of 8 GB on an 80 GB card, room for the 2 GiB program and the reduction it runs on it.
JAX_FRACTION = {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.1"}
# Two in a 12 GiB budget: JAX allocates as it goes instead (its pool would outgrow 7 GiB).
JAX_GROWS = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}


@functools.cache
def available(framework: str) -> str | None:
    """Why ``framework`` cannot run here, or None: its program is tried bare, without
    vramlock, on 1 MiB (a framework whose own kernels do not build on this machine, as
    a numba-cuda older than the NumPy beside it, is no test of vramlock)."""
    if framework == "static" and shutil.which("nvcc") is None:
        return "no nvcc"
    programs = __import__("gpu_frameworks")
    tried = subprocess.run([sys.executable, "-W", "ignore", programs.PATH, framework, "0.001"],
                           stdin=subprocess.DEVNULL, capture_output=True, text=True,
                           timeout=240, env={**os.environ, **JAX_FRACTION})  # fmt: skip
    if tried.returncode != 0 or not tried.stdout.startswith("ready "):
        last = (tried.stderr.strip().splitlines() or ["no output"])[-1]
        return f"it does not run here without vramlock either: {last}"
    return None


def start(
    spawn: Spawn,
    arena: Path,
    framework: str,
    gib: float,
    *run: str,
    jax: dict[str, str] = JAX_FRACTION,
) -> Any:
    """``vramlock run [RUN...] -- gpu_frameworks.py FRAMEWORK GIB``, its Client once ready
    (``jax``: XLA's memory settings)."""
    if (why := available(framework)) is not None:
        pytest.skip(f"{framework}: {why}")
    worker = __import__("gpu_worker")
    programs = __import__("gpu_frameworks")
    wrap = vramlock("run", "--arena", str(arena), "--min-hold", "0", *run)
    env = {**os.environ, **jax}
    proc = spawn([*wrap, "--", sys.executable, programs.PATH, framework, str(gib)],
                 stdin=subprocess.PIPE, env=env)  # fmt: skip
    return worker.Client(proc, timeout=240)


def strategy_of(arena: Path, pid: int) -> str:
    (row,) = [r for r in who_json(arena) if r["member"] and r["child_pid"] == pid]
    return str(row["strategy"])


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_auto_swaps_the_framework_and_keeps_its_data(
    framework: str, arena: Path, spawn: Spawn
) -> None:
    """Under plain ``vramlock run``: while a flock(1) member holds the token NVML shows
    the program's memory gone, its GPU work waits, and it comes back with the same
    checksum, five times."""
    w = start(spawn, arena, framework, 2)
    full = nvml.processes()[w.pid]
    assert full >= 2 * GIB
    for n in range(SWAPS):
        started = time.monotonic()
        holder = waiting_holder(spawn, arena)
        out_s = time.monotonic() - started
        held = nvml.processes().get(w.pid, 0)
        assert held <= SWAP_KEEPS and full - held >= 2 * GIB - (16 << 20), (full, held)
        wait_until(lambda: strategy_of(arena, w.pid) == "auto:swap")
        w.send("check")
        assert w.silent(1.0), "the program ran on the GPU while another member held it"
        assert holder.stdin is not None
        holder.stdin.close()
        holder.wait(30)
        word, value = w.read(120).split()
        assert (word, int(value)) == ("sum", w.checksum)
        print(f"{framework} swap {n}: out {out_s:.3f} s; GPU MiB {full >> 20} -> {held >> 20}")
    w.close()
    assert w.proc.wait(30) == 0


PAIRS = [("jax", "cupy"), ("driver", "static"), ("compile", "nccl"), ("cufft", "triton")]


@pytest.mark.parametrize(("a", "b"), PAIRS)
def test_two_that_do_not_fit_together_take_turns(
    a: str, b: str, tmp_path: Path, spawn: Spawn
) -> None:
    """Two programs in an arena whose budget holds one of them at a time: both answer
    right, and NVML never sees both holding their data at once."""
    arena = tmp_path / "arena"
    arena.mkdir()
    # Each declares more than it holds (a CUDA context, torch's and NCCL's own buffers
    # beside the data), and two declarations overrun the budget: one at a time.
    subprocess.run(vramlock("arena", "--arena", str(arena), "--budget", "12G"), check=True)
    sampler = BothOnGpu()
    sampler.start()
    try:
        first = start(spawn, arena, a, 2, "--vram", "7G", jax=JAX_GROWS)
        second = start(spawn, arena, b, 2, "--vram", "7G", jax=JAX_GROWS)  # first steps aside
        for _ in range(3):
            assert first.check() == first.checksum
            assert second.check() == second.checksum
    finally:
        sampler.stop.set()
        sampler.join()
    assert sampler.overlaps(first.pid, second.pid, keep=SWAP_KEEPS) == []
    assert sampler.errors == [] and sampler.samples > 50
    for w in (first, second):
        w.close()
        assert w.proc.wait(30) == 0


def test_jax_with_its_default_preallocation_is_released(arena: Path, spawn: Spawn) -> None:
    """JAX as it starts by default takes 75 % of the GPU for its pool: it is released
    all the same (or auto says why not and the waiter is not left waiting)."""
    w = start(spawn, arena, "jax", 2, jax={})
    full = nvml.processes()[w.pid]
    started = time.monotonic()
    holder = waiting_holder(spawn, arena)
    out_s = time.monotonic() - started
    held = nvml.processes().get(w.pid, 0)
    print(f"jax default: {full >> 20} MiB, out {out_s:.1f} s, {held >> 20} MiB left")
    assert held <= SWAP_KEEPS, (full, held)
    assert holder.stdin is not None
    holder.stdin.close()
    holder.wait(60)
    assert w.check() == w.checksum
    w.close()
    assert w.proc.wait(60) == 0
