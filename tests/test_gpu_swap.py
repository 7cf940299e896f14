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

import contextlib
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
from helpers.processes import Spawn, token_free, wait_until, waiting_holder
from helpers.swap_rig import SWAP_SOURCES, swap_copies

from vramlock.gpu import nvml, swap

pytestmark = [gpu, pytest.mark.timeout(300)]

SWAPS = 3


def swap_worker(
    spawn: Spawn, arena: Path, allocator: str, *args: str, env: dict[str, str] | None = None
) -> Any:
    """``vramlock run --release swap -- gpu_worker.py ARGS`` under PyTorch's ALLOCATOR,
    with ``env`` besides."""
    worker = __import__("gpu_worker")
    run = vramlock("run", "--arena", str(arena), "--release", "swap", "--min-hold", "0")
    extra = {**ALLOCATORS[allocator], **(env or {})}
    proc = spawn([*run, "--", sys.executable, worker.PATH, *args],
                 stdin=subprocess.PIPE, env=env_with(extra))  # fmt: skip
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


MIB = 1 << 20
SEGMENT = 256 << 10  # digest.h's DIGEST_SEGMENT


def test_a_release_copies_out_only_what_changed(arena: Path, spawn: Spawn, tmp_path: Path) -> None:
    """A 1 GiB PyTorch program: its first release copies it all; one after nothing ran
    copies next to nothing; one after a float changed (the very last one, then one in the
    first tensor) copies little, and the program finds its data as it left it
    (the checksum, computed on the GPU, after the restore). The library's trace of each
    release says what it copied."""
    worker = __import__("gpu_worker")
    run = vramlock("run", "--arena", str(arena), "--release", "swap", "--min-hold", "0")
    err_file = tmp_path / "stderr"
    with err_file.open("w") as err:
        proc = spawn([*run, "--", sys.executable, worker.PATH, "--gib", "1"],
                     stdin=subprocess.PIPE, stderr=err,
                     env=env_with({"VRAMLOCK_SWAP_DEBUG": "1"}))  # fmt: skip
    w = worker.Client(proc)

    def swap_once() -> None:
        holder = waiting_holder(spawn, arena)
        assert holder.stdin is not None
        holder.stdin.close()
        holder.wait(30)
        wait_until(lambda: row_of(arena, w.pid)["state"] == "resident", timeout=60)

    swap_once()
    swap_once()  # nothing ran in between
    for index in (-1, 9 * SEGMENT // 4 - 1):
        changed = w.poke(index)
        swap_once()
        assert w.check() == changed  # the change came back with the rest
    w.close()
    copies = swap_copies(err_file.read_text())
    print("released, copied:", copies)
    assert len(copies) == 4, copies
    (held, first), (_, idle), (_, last), (_, boundary) = copies
    assert held >= first >= GIB  # all it had (what its mappings show of it)
    assert idle <= 4 * MIB
    # The float, and the checksum's temporaries (PyTorch's cache reuses their blocks).
    assert 0 < last <= 96 * MIB and 0 < boundary <= 96 * MIB


def test_the_gpu_digest_is_the_host_reference(tmp_path: Path) -> None:
    """The committed PTX, loaded by the driver, digests 1 GiB of pseudo-random words (and
    a short last segment) as digest.h's host reference does, lane for lane."""
    cc = swap.compiler()
    if cc is None:
        pytest.skip("no C compiler")
    prog = tmp_path / "gpu_digest"
    source = Path(__file__).parent / "gpu_digest.c"
    subprocess.run([cc, "-std=c11", "-O2", "-Wall", "-Wextra", "-Werror", "-I",
                    str(SWAP_SOURCES), "-o", str(prog), str(source), "-ldl"],
                   check=True, timeout=120)  # fmt: skip
    done = subprocess.run([str(prog), "1024"], capture_output=True, text=True, timeout=120)
    print(done.stdout, done.stderr)
    assert done.returncode == 0, done
    word, segments, rate = done.stdout.split()
    assert (word, int(segments)) == ("ok", (1024 * MIB + 48) // SEGMENT + 1)
    print(f"digest: {float(rate):.0f} GB/s")


def rss_anon(pid: int) -> int:
    """The process's anonymous resident memory, in bytes, as the kernel counts it."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no RssAnon for {pid}")


def test_host_copies_are_ready_before_the_first_release(arena: Path, spawn: Spawn) -> None:
    """A 2 GiB PyTorch program left idle: the library makes its host copies ready ahead
    (the kernel sees its resident host memory grow by them before anybody waits), and
    its first release then finds them and keeps the data (the checksum after the
    restore)."""
    w = swap_worker(spawn, arena, "caching", "--gib", "2")
    before = rss_anon(w.pid)
    wait_until(lambda: rss_anon(w.pid) - before >= 2 * GIB, timeout=60)
    print(f"host memory made ready: {(rss_anon(w.pid) - before) >> 20} MiB")
    started = time.monotonic()
    holder = waiting_holder(spawn, arena)
    out_s = time.monotonic() - started
    grown = rss_anon(w.pid) - before
    assert nvml.processes().get(w.pid, 0) <= SWAP_KEEPS
    w.send("check")
    assert w.silent(1.0)
    assert holder.stdin is not None
    holder.stdin.close()
    holder.wait(30)
    word, value = w.read(120).split()
    assert (word, int(value)) == ("sum", w.checksum)
    print(f"first release {out_s:.3f} s; host memory {grown >> 20} MiB")
    assert grown < 3 * GIB  # the release pinned no second copy
    w.close()
    assert w.proc.wait(30) == 0


def test_a_parked_member_leaves_nothing_on_the_gpu(arena: Path, spawn: Spawn) -> None:
    """Released a while (VRAMLOCK_PARK_AFTER=1), a swapped program's CUDA context leaves
    the GPU too: NVML lists the process no more. Its GPU work still waits while the
    other member holds the token, and it comes back whole, SWAPS times."""
    w = swap_worker(spawn, arena, "caching", "--gib", "1", env={"VRAMLOCK_PARK_AFTER": "1"})
    full = nvml.processes()[w.pid]
    for n in range(SWAPS):
        holder = waiting_holder(spawn, arena)
        released = nvml.processes().get(w.pid, 0)
        wait_until(lambda: w.pid not in nvml.processes(), timeout=30)
        w.send("check")
        assert w.silent(1.0)
        assert w.pid not in nvml.processes()
        assert holder.stdin is not None
        holder.stdin.close()
        holder.wait(30)
        started = time.monotonic()
        word, value = w.read(120).split()
        back_s = time.monotonic() - started
        assert (word, int(value)) == ("sum", w.checksum)
        now = nvml.processes()[w.pid]
        print(f"park {n}: GPU MiB {full >> 20} -> {released >> 20} -> parked 0 -> {now >> 20};"
              f" back + check {back_s:.3f} s")  # fmt: skip
        assert now >= full - (64 << 20)
    w.close()
    assert w.proc.wait(30) == 0


def test_a_parked_program_whose_wrapper_dies_stays_off_the_gpu(arena: Path, spawn: Spawn) -> None:
    """The wrapper is SIGKILLed while its program is parked: the library's own thread,
    in a process whose context the driver checkpointed, still sees its run go and says
    so (what lets a run killed while it unparks give the token back); the program runs
    nothing, holds nothing on the GPU, and the token is free for others."""
    w = swap_worker(spawn, arena, "caching", "--gib", "1", env={"VRAMLOCK_PARK_AFTER": "0"})
    try:
        holder = waiting_holder(spawn, arena)
        wait_until(lambda: w.pid not in nvml.processes(), timeout=30)
        w.proc.kill()
        w.proc.wait(10)
        assert holder.stdin is not None
        holder.stdin.close()
        holder.wait(30)
        w.send("check")
        assert w.silent(3.0)
        assert w.pid not in nvml.processes()
        assert w.proc.stderr is not None
        err = w.proc.stderr.fileno()
        os.set_blocking(err, False)
        said = b""

        def told() -> bool:
            nonlocal said
            with contextlib.suppress(BlockingIOError):
                said += os.read(err, 65536)
            return b"went away while the command was parked" in said

        wait_until(told, timeout=30)
        other = waiting_holder(spawn, arena)  # the token is nobody's: the next gets it
        assert other.stdin is not None
        other.stdin.close()  # its `read` meets the end of input: it exits 1, and lets go
        other.wait(30)
        assert token_free(arena)  # and the parked program did not take it back
        assert w.pid not in nvml.processes()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(w.pid, signal.SIGKILL)
