"""One CUDA framework holding a known amount of VRAM, for the GPU tests.

    python tests/gpu_frameworks.py FRAMEWORK GIB

FRAMEWORK is one of ``FRAMEWORKS``: JAX, CuPy, Numba, cuda-python's driver
bindings, Triton (on a PyTorch tensor), ``torch.compile`` replaying CUDA graphs, a
one-rank ``torch.distributed`` job on NCCL, CuPy's cuFFT, or a C program built with nvcc
against the static CUDA runtime. Each fills GIB GiB of device memory with a pattern computed on
the GPU and prints ``ready <pid> <checksum>``; then it answers each ``check`` on stdin
with ``sum <checksum>``, reduced on the GPU again (or copied back, where the framework
has no reduction of its own), and exits at end of input: the protocol of
tests/gpu_worker.py, so its Client drives these too.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from typing import Any

PATH = os.path.abspath(__file__)
MASK = (1 << 64) - 1
# A multiplicative hash (Knuth's): every word differs from its neighbours, so a chunk
# that comes back from another place or not at all changes the sum.
GOLDEN = 2654435761


def _jax(words: int) -> Callable[[], int]:
    jnp: Any = importlib.import_module("jax.numpy")
    data = jnp.arange(words, dtype=jnp.uint32) * jnp.uint32(GOLDEN)
    # x64 is off by default in JAX: sum 32-bit halves of the data in 32 bits each.
    return lambda: int(jnp.sum(data & 0xFFFF)) + (int(jnp.sum(data >> 16)) << 16)


def _cupy(words: int) -> Callable[[], int]:
    cp: Any = importlib.import_module("cupy")
    data = cp.arange(words, dtype=cp.uint32) * cp.uint32(GOLDEN)
    return lambda: int(data.sum(dtype=cp.uint64))


def _numba(words: int) -> Callable[[], int]:
    np: Any = importlib.import_module("numpy")
    cuda: Any = importlib.import_module("numba.cuda")

    @cuda.jit  # type: ignore[untyped-decorator]
    def fill(out: Any) -> None:
        i = cuda.grid(1)
        if i < out.size:
            out[i] = np.uint32(i) * np.uint32(GOLDEN)

    data = cuda.device_array(words, dtype=np.uint32)
    fill[(words + 255) // 256, 256](data)
    return lambda: int(data.copy_to_host().sum(dtype=np.uint64))


def _driver(words: int) -> Callable[[], int]:
    """cuda-python's driver bindings: cuMemAlloc, and copies, no runtime library."""
    np: Any = importlib.import_module("numpy")
    drv: Any = importlib.import_module("cuda.bindings.driver")

    def ok(result: Any) -> Any:
        err, *rest = result if isinstance(result, tuple) else (result,)
        if int(err) != 0:
            raise RuntimeError(f"CUDA driver error {err}")
        return rest[0] if len(rest) == 1 else rest

    ok(drv.cuInit(0))
    ctx = ok(drv.cuDevicePrimaryCtxRetain(ok(drv.cuDeviceGet(0))))
    ok(drv.cuCtxSetCurrent(ctx))
    host = np.arange(words, dtype=np.uint32) * np.uint32(GOLDEN)
    ptr = ok(drv.cuMemAlloc(host.nbytes))
    ok(drv.cuMemcpyHtoD(ptr, host.ctypes.data, host.nbytes))
    back = np.empty_like(host)

    def check() -> int:
        ok(drv.cuMemcpyDtoH(back.ctypes.data, ptr, back.nbytes))
        return int(back.sum(dtype=np.uint64))

    return check


STATIC_SOURCE = r"""
#include <cstdio>
#include <cstdint>
#include <cstdlib>
#include <unistd.h>
#include <cuda_runtime.h>
__global__ void fill(uint32_t *d, size_t n) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x) d[i] = (uint32_t)i * 2654435761u;
}
__global__ void total(const uint32_t *d, size_t n, unsigned long long *out) {
  unsigned long long s = 0;
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x) s += d[i];
  atomicAdd(out, s);
}
int main(int argc, char **argv) {
  size_t n = strtoull(argv[1], 0, 10);
  uint32_t *d; unsigned long long *sum, h;
  if (cudaMalloc(&d, n * 4) || cudaMalloc(&sum, 8)) return 1;
  fill<<<1024, 256>>>(d, n);
  char line[64];
  for (int first = 1;; first = 0) {
    cudaMemset(sum, 0, 8);
    total<<<1024, 256>>>(d, n, sum);
    if (cudaMemcpy(&h, sum, 8, cudaMemcpyDeviceToHost)) return 1;
    if (first) printf("ready %d %llu\n", (int)getpid(), h);
    else printf("sum %llu\n", h);
    fflush(stdout);
    if (!fgets(line, sizeof line, stdin)) return 0;
  }
}
"""


def static_binary() -> str:
    """The C program, built once per test run with nvcc (whose default is the static
    CUDA runtime: no libcudart.so is loaded, the driver is found with dlopen)."""
    out = os.path.join(tempfile.gettempdir(), f"vramlock-static-cudart-{os.getuid()}")
    if not os.path.exists(out):
        src = out + ".cu"
        with open(src, "w") as f:
            f.write(STATIC_SOURCE)
        subprocess.run(["nvcc", "-O2", "-cudart", "static", "-o", out + ".tmp", src], check=True)
        os.rename(out + ".tmp", out)
    return out


def _triton(words: int) -> Callable[[], int]:
    """Kernels written in Triton (its own launcher, through the driver API) on a PyTorch
    tensor."""
    kernels: Any = importlib.import_module("gpu_triton")
    check: Callable[[], int] = kernels.program(words)
    return check


def _golden_words(words: int) -> Any:
    """A PyTorch tensor of ``words`` 32-bit words (kept in int64 halves: PyTorch's unsigned
    arithmetic is thin) holding the pattern."""
    torch: Any = importlib.import_module("torch")
    index = torch.arange(words // 2, dtype=torch.int64, device="cuda")
    return (index * GOLDEN) & 0xFFFFFFFF


def _compile(words: int) -> Callable[[], int]:
    """``torch.compile(mode="reduce-overhead")``: Triton kernels it generated, replayed
    from a CUDA graph (warmed up and recorded before ``ready``)."""
    torch: Any = importlib.import_module("torch")
    data = _golden_words(words)

    @torch.compile(mode="reduce-overhead")  # type: ignore[untyped-decorator, unused-ignore]
    def total(d: Any) -> Any:
        return (d & 0xFFFF).sum() + ((d >> 16).sum() << 16)

    def check() -> int:
        return int(total(data).item())

    for _ in range(3):  # the third call records the graph; later ones replay it
        check()
    return check


def _nccl(words: int) -> Callable[[], int]:
    """A one-rank ``torch.distributed`` job on NCCL: each check all-reduces the sum."""
    torch: Any = importlib.import_module("torch")
    dist: Any = importlib.import_module("torch.distributed")
    store = os.path.join(tempfile.mkdtemp(prefix="vramlock-nccl-"), "store")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"file://{store}", rank=0, world_size=1,
                            device_id=torch.device("cuda", 0))  # fmt: skip
    data = _golden_words(words)

    def check() -> int:
        total = data.sum().reshape(1)
        dist.all_reduce(total)
        return int(total.item())

    return check


def _cufft(words: int) -> Callable[[], int]:
    """CuPy's cuFFT: a plan made once, each check a forward transform of the data's first
    million words, its result's bits summed (a plan run on the same input gives the
    same bits), beside the sum of all the data."""
    cp: Any = importlib.import_module("cupy")
    data = cp.arange(words, dtype=cp.uint32) * cp.uint32(GOLDEN)
    signal = data[: 1 << 20].astype(cp.float32)

    def check() -> int:
        spectrum = cp.fft.rfft(signal)
        bits = spectrum.view(cp.uint32).sum(dtype=cp.uint64)
        return int(data.sum(dtype=cp.uint64)) + int(bits)

    return check


FRAMEWORKS: dict[str, Callable[[int], Callable[[], int]]] = {
    "jax": _jax,
    "cupy": _cupy,
    "numba": _numba,
    "driver": _driver,
    "triton": _triton,
    "compile": _compile,
    "nccl": _nccl,
    "cufft": _cufft,
}


def main() -> None:
    framework, gib = sys.argv[1], float(sys.argv[2])
    words = int(gib * (1 << 30)) // 4
    if framework == "static":
        os.execv(static_binary(), [static_binary(), str(words)])
    check = FRAMEWORKS[framework](words)
    print(f"ready {os.getpid()} {check() & MASK}", flush=True)
    for line in sys.stdin:
        if line.strip() == "check":
            print(f"sum {check() & MASK}", flush=True)


if __name__ == "__main__":
    main()
