"""For the tests on a real NVIDIA GPU: the mark that skips them elsewhere, and the
witnesses (the token's holders, NVML samples)."""

from __future__ import annotations

import http.client
import importlib
import importlib.util
import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from helpers import ROOT
from vramlock import procfs
from vramlock.gpu import cuda, nvml

TRAINER = str(ROOT / "tests" / "gpu_trainer.py")


GIB = 1 << 30


def _gpu_ready(root: Path = Path("/")) -> str | None:
    """Why the GPU tests cannot run here, or None when they can: no GPU first (a machine
    without one needs no torch), then what is missing to drive it."""
    devices = [*(root / "dev").glob("nvidia[0-9]*"), *(root / "proc/driver/nvidia/gpus").glob("*")]
    if not devices:
        return "there is none here (no /dev/nvidia*)"
    for mod in ("torch", "pynvml"):
        if importlib.util.find_spec(mod) is None:
            return f"{mod} is not installed"
    if not nvml.available():
        return "NVML is unavailable"
    if not cuda.has_checkpoint_api():
        return "the CUDA driver has no checkpoint API"
    return None


_WHY = _gpu_ready()


gpu = pytest.mark.skipif(_WHY is not None, reason=f"needs an NVIDIA GPU: {_WHY}")


class TokenWatch(threading.Thread):
    """Polls /proc/locks: the sequence of processes that held token.lock."""

    def __init__(self, arena: Path) -> None:
        super().__init__(daemon=True)
        st = (arena / "token.lock").stat()
        self.key = (st.st_dev, st.st_ino)
        self.holders: list[int] = []
        self.stop = threading.Event()

    def run(self) -> None:
        """Sample /proc/locks until stopped."""
        while not self.stop.is_set():
            entries = procfs.parse_proc_locks(procfs.read_proc_locks(), *self.key)
            held = [e.pid for e in entries if not e.blocked]
            if held and (not self.holders or self.holders[-1] != held[0]):
                self.holders.append(held[0])
            time.sleep(0.01)


class BothOnGpu(threading.Thread):
    """Samples NVML every 20 ms: what each process held whenever two or more were on the
    GPUs."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.crowded: list[dict[int, int]] = []
        self.samples = 0
        self.errors: list[str] = []
        self.stop = threading.Event()

    def run(self) -> None:
        """Sample NVML until stopped."""
        while not self.stop.is_set():
            try:
                held = nvml.processes()
            except nvml.NvmlError as err:
                self.errors.append(str(err))
            else:
                self.samples += 1
                if len(held) > 1:
                    self.crowded.append(held)
            time.sleep(0.02)

    def overlaps(self, a: int, b: int, keep: int = -1) -> list[dict[int, int]]:
        """The samples in which ``a`` and ``b`` both held more than ``keep`` bytes (by
        default: were on the GPU at all)."""
        return [held for held in self.crowded if min(held.get(a, -1), held.get(b, -1)) > keep]


# PyTorch's allocators, as PYTORCH_CUDA_ALLOC_CONF picks them: the caching allocator over
# cudaMalloc (the default), over the driver's virtual memory management, and the
# driver's stream-ordered allocator (cudaMallocAsync).
ALLOCATORS = {
    "caching": {},
    "expandable": {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"},
    "async": {"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"},
}


# What a process released by swap keeps on the GPU, at most: its CUDA context, with the
# code of the kernels it has loaded (under a GiB for PyTorch with cuBLAS).
SWAP_KEEPS = 3 * GIB // 2


def env_with(extra: dict[str, str]) -> dict[str, str]:
    """The test's environment with ``extra`` set."""
    return {**os.environ, **extra}


# A request to a checkpointed server waits for the other one's checkpoint and its restore.
REQUEST_TIMEOUT = 120.0


def call(port: int, method: str, path: str, body: object = None) -> dict[str, Any]:
    """One request through a listen port; the JSON answer of a 200."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=REQUEST_TIMEOUT)
    try:
        data = None if body is None else json.dumps(body)
        conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
        reply = conn.getresponse()
        text = reply.read()
    finally:
        conn.close()
    assert reply.status == 200, (reply.status, text)
    answer: dict[str, Any] = json.loads(text)
    return answer


@contextmanager
def watched(
    arena: Path, tmp_path: Path, names: tuple[str, str]
) -> Iterator[tuple[TokenWatch, BothOnGpu]]:
    """The token's holders (/proc/locks) and NVML, sampled while the body runs; then the
    wrappers' logs (``tmp_path/NAME.log``) and what the witnesses saw are printed."""
    tokens, sampler = TokenWatch(arena), BothOnGpu()
    tokens.start()
    sampler.start()
    try:
        yield tokens, sampler
    finally:
        tokens.stop.set()
        sampler.stop.set()
        tokens.join(5)
        sampler.join(5)
        for name in names:
            log = tmp_path / f"{name}.log"
            if log.exists():
                print(f"--- {name}:\n{log.read_text(errors='replace')}")
        print("token holders:", tokens.holders, "NVML samples:", sampler.samples)


def end_in_turn(resident: subprocess.Popen[str], released: subprocess.Popen[str]) -> None:
    """Told to end, each wrapper ends cleanly: the resident one at once, then the
    released one, which is restored first and only then gets the signal (its exit
    path runs CUDA calls). One at a time here; both at once is tested without a GPU
    (test_run.py)."""
    resident.send_signal(signal.SIGTERM)
    assert resident.wait(60) == 0
    released.send_signal(signal.SIGTERM)
    assert released.wait(120) == 0
