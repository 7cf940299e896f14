"""``vramlock run`` on a real NVIDIA GPU: checkpoint, swap, auto, verified release, ``who``.

Skipped without a GPU (torch, NVML and the driver's checkpoint API are all needed).
The witnesses are the kernel's lock table (who holds token.lock, read by the test),
NVML (which processes hold GPU memory) and the programs' own checksums.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from helpers.commands import vramlock, who_json
from helpers.gpu import ALLOCATORS, GIB, SWAP_KEEPS, TRAINER, BothOnGpu, TokenWatch, env_with, gpu
from helpers.processes import Spawn, wait_until, waiting_holder

from vramlock.gpu import cuda, nvml

pytestmark = [gpu, pytest.mark.timeout(300)]


def run_worker(spawn: Spawn, arena: Path, *options: str, gib: str = "2") -> Any:
    """``vramlock run OPTIONS -- gpu_worker.py --gib GIB``, talked to over its stdin."""
    worker = __import__("gpu_worker")
    argv = vramlock("run", "--arena", str(arena), *options, "--", sys.executable, worker.PATH)
    return worker.Client(spawn([*argv, "--gib", gib], stdin=subprocess.PIPE))


BALLAST = (
    "import sys, torch\n"
    "keep = [torch.empty(1 << 30, dtype=torch.uint8, device='cuda')"
    " for _ in range(int(sys.argv[1]))]\n"
    "torch.cuda.synchronize()\n"
    "print('ready', flush=True)\n"
    "sys.stdin.read()\n"
)


def ballast(spawn: Spawn, leave_gib: float) -> subprocess.Popen[str]:
    """A process that is no member, holding all but ``leave_gib`` GiB of the free VRAM."""
    gib = int(nvml.free_bytes(0) / GIB - leave_gib)
    proc = spawn([sys.executable, "-c", BALLAST, str(gib)], stdin=subprocess.PIPE)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


def end(proc: subprocess.Popen[str]) -> None:
    assert proc.stdin is not None
    proc.stdin.close()
    proc.wait(60)


def waiter(arena: Path, timeout: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        vramlock("wait", "--arena", str(arena), "-w", timeout),
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.parametrize(
    ("release", "allocator"),
    [("checkpoint", "caching"), ("swap", "caching"), ("swap", "expandable")],
    ids=["checkpoint", "swap", "swap-expandable"],
)
def test_trainers_that_do_not_fit_together_take_turns(
    release: str, allocator: str, arena: Path, spawn: Spawn
) -> None:
    """Two unmodified training jobs of ~8 GiB with ~12 GiB free: never both holding
    their memory on the GPU (NVML), and each ends with the same weights as an
    uninterrupted run would."""
    (arena / "token.lock").touch()
    big = ballast(spawn, leave_gib=12)
    watch, sampler = TokenWatch(arena), BothOnGpu()
    watch.start()
    sampler.start()
    job = [sys.executable, TRAINER, "--plain", "--layers", "2", "--scratch-gib", "7.5",
           "--steps", "120", "--step-sleep", "0.1"]  # fmt: skip
    run = vramlock("run", "--arena", str(arena), "--release", release, "--min-hold", "3s")
    procs = [spawn([*run, "--", *job], env=env_with(ALLOCATORS[allocator])) for _ in range(2)]

    def trainers() -> list[int]:
        return [r["child_pid"] for r in who_json(arena) if r["member"] and r["child_pid"]]

    wait_until(lambda: len(trainers()) == 2, timeout=60, step=0.2)
    a, b = trainers()
    sums = []
    for proc in procs:
        out, err = proc.communicate(timeout=280)
        assert proc.returncode == 0, err
        sums.append(out.split("sum=")[-1].strip())
    watch.stop.set()
    sampler.stop.set()
    sampler.join(5)
    print("token holders:", watch.holders, "NVML samples:", sampler.samples)
    assert sums[0] == sums[1]
    assert len(watch.holders) >= 4  # they took turns, more than once each
    # Released, a trainer keeps nothing (checkpoint) or its CUDA context (swap), not
    # the 8 GiB it trains in.
    assert sampler.overlaps(a, b, keep=SWAP_KEEPS if release == "swap" else -1) == []
    assert sampler.errors == [] and sampler.samples > 100
    end(big)


def test_auto_checkpoints_a_cuda_program_swap_cannot_reach(arena: Path, spawn: Spawn) -> None:
    """Its LD_PRELOAD removed, the worker runs CUDA without the swap library (auto swaps
    a program that has it: test_gpu_swap.py): auto leaves swap alone, and checkpoints it."""
    worker = __import__("gpu_worker")
    argv = vramlock("run", "--arena", str(arena), "--", "env", "-u", "LD_PRELOAD",
                    sys.executable, worker.PATH, "--gib", "2")  # fmt: skip
    w = worker.Client(spawn(argv, stdin=subprocess.PIPE))
    assert w.pid in nvml.processes(0)
    time.sleep(1.2)  # auto waits a moment for a hello before it looks for CUDA
    started = time.monotonic()
    got = waiter(arena, "60")
    print(f"auto: waiter got the GPU after {time.monotonic() - started:.2f} s")
    assert got.returncode == 0, got.stderr
    wait_until(lambda: cuda.process_state(w.pid) is cuda.ProcessState.RUNNING, timeout=60)
    assert w.check() == w.checksum
    rows = [r for r in who_json(arena) if r["child_pid"] == w.pid]
    assert rows and rows[0]["strategy"] == "auto:checkpoint"
    assert rows[0]["vram"] >= 2 * GIB


@pytest.mark.parametrize(
    ("options", "why"),
    [
        ([], "cannot be checkpointed"),
        (["--release", "checkpoint"], "cannot be checkpointed"),
        (["--release", "swap"], "managed memory"),
    ],
    ids=["auto", "checkpoint", "swap"],
)
def test_managed_memory_is_refused_unharmed(
    arena: Path, spawn: Spawn, options: list[str], why: str
) -> None:
    worker = __import__("gpu_worker")
    argv = vramlock("run", "--arena", str(arena), *options, "--", sys.executable, worker.PATH)
    proc = spawn([*argv, "--gib", "0.25", "--managed-mib", "64"], stdin=subprocess.PIPE)
    w = worker.Client(proc)
    time.sleep(1.2)
    got = waiter(arena, "4")
    assert got.returncode == 1  # not handed over: it cannot be checkpointed
    assert cuda.process_state(w.pid) is cuda.ProcessState.RUNNING
    assert w.check() == w.checksum  # unharmed
    w.close()
    err = proc.stderr.read() if proc.stderr else ""
    assert why in err, err


def test_restore_waits_for_free_vram_instead_of_wedging(arena: Path, spawn: Spawn) -> None:
    w = run_worker(spawn, arena, "--release", "checkpoint", "--min-hold", "0", gib="4")
    holder = waiting_holder(spawn, arena)
    assert cuda.process_state(w.pid) is cuda.ProcessState.CHECKPOINTED
    assert w.pid not in nvml.processes(0)  # verified: nothing of it left on the GPU
    big = ballast(spawn, leave_gib=2.5)  # a process that is no member takes the memory
    rows = who_json(arena)
    foreign = {r["pid"]: r for r in rows if r["state"] == "foreign"}
    assert big.pid in foreign and foreign[big.pid]["vram"] > 10 * GIB
    assert not {r["pid"] for r in rows if r["member"]} & set(foreign)
    assert holder.stdin is not None
    holder.stdin.write("go\n")
    holder.stdin.close()
    holder.wait(30)
    w.send("check")  # blocks while checkpointed
    assert w.silent(4.0)  # the wrapper got its turn, saw too little VRAM, queued again
    assert cuda.process_state(w.pid) is cuda.ProcessState.CHECKPOINTED
    end(big)
    word, value = w.read(120).split()
    assert (word, int(value)) == ("sum", w.checksum)
    rows = [r for r in who_json(arena) if r["child_pid"] == w.pid]
    assert rows and rows[0]["state"] == "resident" and rows[0]["vram"] >= 4 * GIB
    w.close()
    err = w.proc.stderr.read() if w.proc.stderr else ""
    assert "queueing again" in err, err


def test_checkpoint_takes_a_two_gpu_program_off_both(spawn: Spawn) -> None:
    """``--gpu 0,1 --release checkpoint``: a waiter for GPU 1 alone gets it once the
    program is off both GPUs (NVML); it comes back to both with the same data."""
    if nvml.count() < 2:
        pytest.skip("needs two GPUs")
    worker = __import__("gpu_worker")
    run = vramlock("run", "--gpu", "0,1", "--release", "checkpoint", "--min-hold", "0")
    proc = spawn([*run, "--", sys.executable, worker.PATH, "--gib", "1", "--devices", "2"],
                 stdin=subprocess.PIPE)  # fmt: skip
    w = worker.Client(proc)
    assert w.pid in nvml.processes(0) and w.pid in nvml.processes(1)
    gpu1 = Path(subprocess.run(vramlock("arena", "--gpu", "1"), capture_output=True,
                               text=True, check=True).stdout.strip())  # fmt: skip
    holder = waiting_holder(spawn, gpu1)
    assert cuda.process_state(w.pid) is cuda.ProcessState.CHECKPOINTED
    assert w.pid not in nvml.processes(0) and w.pid not in nvml.processes(1)
    (me,) = [r for r in who_json(gpu1.parent / "gpu0") if r["child_pid"] == w.pid]
    assert me["gpus"] == [0, 1] and me["state"] == "released"
    assert holder.stdin is not None
    holder.stdin.close()
    holder.wait(30)
    assert w.check() == w.checksum
    assert w.pid in nvml.processes(0) and w.pid in nvml.processes(1)
    w.close()
