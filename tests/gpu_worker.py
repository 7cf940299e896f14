"""A PyTorch process with a known amount of VRAM, for the GPU tests and benchmarks.

    python tests/gpu_worker.py --gib 2 [--devices 2] [--managed-mib 64] [--graph]
    python tests/gpu_worker.py --load FILE

Fills ``--gib`` GiB of device memory (on each of the first ``--devices`` GPUs it
sees) with seeded random data and prints
``ready <pid> <checksum>``; with ``--load`` it reads FILE to the GPU instead, the
way a server reloads its weights, and prints ``loaded <pid> <seconds>``.
Then it answers each line on stdin: ``check`` with ``sum <checksum>`` computed on
the GPU again, ``spin SECONDS`` by queueing a kernel that keeps the GPU busy about
that long and saying ``spinning``, and (with ``--graph``) ``replay`` by clearing the
output of a CUDA graph captured at the start, replaying the graph and saying
``replayed <checksum of the output>``, ``poke INDEX`` by adding 1 to the float at
that index of all its data (negative: from the end) and ``touch PERCENT`` by negating
that share of its tensors (every word of them changes), each saying ``poked`` or
``touched`` and the new checksum; ``want`` says ``want`` on vramlock's control channel
(under ``--demand child``: the command wants the GPU) and ``wanted``. It exits at end of
input.
``--managed-mib`` also takes that much managed (UVM) memory through the driver,
which makes the process impossible to checkpoint.
"""

from __future__ import annotations

import argparse
import importlib
import os
import select
import subprocess
import sys
import time
from typing import Any

torch: Any = importlib.import_module("torch")

PATH = os.path.abspath(__file__)
CHUNK = 256 << 20  # bytes per tensor
SUM_PART = 1 << 22  # int32s summed at a time: the temporaries stay small (32 MiB)
SPIN_HZ = 2_000_000_000  # GPU clock cycles a second, near enough for a busy kernel


def checksum(tensors: list[Any]) -> int:
    """An exact, order-independent sum of the data as 32-bit integers."""
    total = 0
    for t in tensors:
        flat = t.detach().reshape(-1).view(torch.uint8)
        flat = flat[: flat.numel() // 4 * 4].view(torch.int32)
        for part in flat.split(SUM_PART):
            total += int(part.to(torch.int64).sum().item())
    return total


def fill(gib: float, device: str = "cuda", seed: int = 1234) -> list[Any]:
    """``gib`` GiB of seeded random floats on ``device``, in tensors of CHUNK bytes."""
    gen = torch.Generator(device=device).manual_seed(seed)
    left = int(gib * (1 << 30)) // 4  # float32s
    chunks = []
    while left > 0:
        n = min(CHUNK // 4, left)
        chunks.append(torch.rand(n, generator=gen, device=device))
        left -= n
    return chunks


def load(path: str) -> list[Any]:
    """Map the file and copy it to the GPU piece by piece (pageable copies)."""
    size = os.path.getsize(path)
    mapped = torch.from_file(path, shared=False, size=size, dtype=torch.uint8)
    chunks = [part.to("cuda") for part in mapped.split(CHUNK)]
    torch.cuda.synchronize()
    return chunks


def poke(chunks: list[Any], index: int) -> None:
    """Add 1 to the float at ``index`` of all the data (negative: from the end)."""
    sizes = [c.numel() for c in chunks]
    index %= sum(sizes)
    for c, n in zip(chunks, sizes, strict=True):
        if index < n:
            c[index] += 1.0
            return
        index -= n


def touch(chunks: list[Any], percent: float) -> None:
    """Negate the first ``percent`` % of the tensors: every word of them changes."""
    for c in chunks[: round(len(chunks) * percent / 100)]:
        c.neg_()


def take_managed(mib: int) -> None:
    """Allocate managed memory in torch's context (its primary context is current)."""
    driver = importlib.import_module("cuda.bindings.driver")
    err, ptr = driver.cuMemAllocManaged(mib << 20, driver.CUmemAttach_flags.CU_MEM_ATTACH_GLOBAL)
    if err != driver.CUresult.CUDA_SUCCESS:
        raise SystemExit(f"cuMemAllocManaged: {err}")
    (err,) = driver.cuMemsetD8(ptr, 7, mib << 20)
    if err != driver.CUresult.CUDA_SUCCESS:
        raise SystemExit(f"cuMemsetD8: {err}")


class Graph:
    """A CUDA graph over the first and last chunk: its kernels hold their addresses (and
    those of a temporary in the graph's private memory pool) from the capture on."""

    def __init__(self, chunks: list[Any]) -> None:
        first, last = chunks[0], chunks[-1]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm up off the capturing stream, as PyTorch asks
            first * 2 + last
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.out = first * 2 + last

    def replay(self) -> int:
        self.out.zero_()
        self.graph.replay()
        return checksum([self.out])


class Client:
    """The other end: talks to a worker started as ``[python, WORKER_PATH, ...]``."""

    def __init__(self, proc: subprocess.Popen[str], timeout: float = 120) -> None:
        self.proc = proc
        self.started = time.perf_counter()
        self.first = self.read(timeout).split()
        self.ready_s = time.perf_counter() - self.started
        self.pid = int(self.first[1])
        self.checksum = int(self.first[2]) if self.first[0] == "ready" else None

    def read(self, timeout: float) -> str:
        """One line of the worker's, waiting at most ``timeout`` seconds for it."""
        assert self.proc.stdout is not None
        if not select.select([self.proc.stdout], [], [], timeout)[0]:
            raise TimeoutError(f"no answer from worker {self.proc.pid} in {timeout} s")
        return self.proc.stdout.readline().strip()

    def silent(self, timeout: float) -> bool:
        """True when the worker says nothing for ``timeout`` seconds."""
        assert self.proc.stdout is not None
        return not select.select([self.proc.stdout], [], [], timeout)[0]

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def check(self, timeout: float = 120) -> int:
        return self._ask("check", "sum", timeout)

    def replay(self, timeout: float = 120) -> int:
        return self._ask("replay", "replayed", timeout)

    def poke(self, index: int, timeout: float = 120) -> int:
        """Change the float at ``index``; the new checksum (kept as ``checksum``)."""
        self.checksum = self._ask(f"poke {index}", "poked", timeout)
        return self.checksum

    def touch(self, percent: float, timeout: float = 120) -> int:
        """Change ``percent`` % of the data; the new checksum (kept as ``checksum``)."""
        self.checksum = self._ask(f"touch {percent:g}", "touched", timeout)
        return self.checksum

    def _ask(self, request: str, answer: str, timeout: float) -> int:
        self.send(request)
        word, value = self.read(timeout).split()
        assert word == answer, word
        return int(value)

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(60)


def say_want() -> None:
    """``want`` on the control channel vramlock run gave us (VRAMLOCK_CONTROL_FD)."""
    fd = int(os.environ["VRAMLOCK_CONTROL_FD"])
    os.write(fd, b"want\n")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--load", metavar="FILE")
    parser.add_argument("--managed-mib", type=int, default=0)
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--graph", action="store_true", help="capture a CUDA graph (replay)")
    args = parser.parse_args()
    graph = None
    if args.load:
        started = time.perf_counter()
        chunks = load(args.load)
        print("loaded", os.getpid(), time.perf_counter() - started, flush=True)
    else:
        chunks = [c for d in range(args.devices) for c in fill(args.gib, f"cuda:{d}")]
        if args.managed_mib:
            take_managed(args.managed_mib)
        if args.graph:
            graph = Graph(chunks)
        torch.cuda.synchronize()
        print("ready", os.getpid(), checksum(chunks), flush=True)
    for line in sys.stdin:
        word, *rest = line.split() or [""]
        if word == "check":
            print("sum", checksum(chunks), flush=True)
        elif word == "spin":
            torch.cuda._sleep(int(float(rest[0]) * SPIN_HZ))
            print("spinning", flush=True)
        elif word == "replay" and graph is not None:
            print("replayed", graph.replay(), flush=True)
        elif word == "poke":
            poke(chunks, int(rest[0]))
            print("poked", checksum(chunks), flush=True)
        elif word == "touch":
            touch(chunks, float(rest[0]))
            print("touched", checksum(chunks), flush=True)
        elif word == "want":
            say_want()
            print("wanted", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
