"""The CUDA driver binding, NVML and the PyTorch offload helper.

The first part runs anywhere, against stand-ins for libcuda and pynvml. The rest
needs an NVIDIA GPU with the checkpoint API (driver 570+), PyTorch and
nvidia-ml-py, and skips cleanly without them; it runs real PyTorch processes
(tests/gpu_worker.py, tests/gpu_trainer.py).
"""

from __future__ import annotations

import ctypes
import importlib
import importlib.util
import os
import re
import subprocess
import sys
import threading
import time
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers.commands import vramlock
from helpers.gpu import GIB, TRAINER, gpu
from helpers.processes import Spawn

from vramlock.gpu import cuda, nvml

pytestmark = pytest.mark.timeout(60)


# -- without a GPU: the binding's own logic ------------------------------------------


@pytest.fixture
def fresh_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """Forget whatever the binding loaded; monkeypatch puts it back afterwards."""
    monkeypatch.setattr(cuda, "_lib", None)
    monkeypatch.setattr(cuda, "_missing", None)


class FakeDriver:
    """Stands in for libcuda: records calls, answers each with a scripted result code."""

    def __init__(self, codes: dict[tuple[str, int], int] | None = None) -> None:
        self.codes = codes or {}
        self.calls: list[tuple[str, int]] = []
        self.lock_timeouts: list[int] = []

    def __getattr__(self, name: str) -> Callable[..., int]:
        short = name.removeprefix("cuCheckpointProcess")

        def call(pid: int, arg: Any = None) -> int:
            self.calls.append((short, pid))
            if short == "Lock":
                self.lock_timeouts.append(arg._obj.timeoutMs)
            elif short == "GetState":
                arg._obj.value = cuda.ProcessState.RUNNING
            return self.codes.get((short, pid), 0)

        return call

    def cuGetErrorName(self, code: int, out: Any) -> int:
        return 1  # unknown to the driver too


@pytest.fixture
def fake_driver(fresh_cuda: None, monkeypatch: pytest.MonkeyPatch) -> FakeDriver:
    driver = FakeDriver()
    monkeypatch.setattr(cuda, "_lib", driver)
    return driver


def test_no_libcuda_means_no_checkpoint_api(
    fresh_cuda: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cuda, "LIBRARY", "libcuda-missing.so.1")
    assert not cuda.has_checkpoint_api()
    with pytest.raises(cuda.CudaUnavailable, match=r"cannot load libcuda-missing\.so\.1"):
        cuda.process_state(os.getpid())
    with pytest.raises(cuda.CudaUnavailable):
        cuda.driver_version()


def test_lock_args_put_the_timeout_first(fake_driver: FakeDriver) -> None:
    assert cuda._LockArgs.timeoutMs.offset == 0
    assert ctypes.sizeof(cuda._LockArgs) == ctypes.sizeof(cuda._Args) == 64
    cuda.lock(10, None)
    cuda.lock(10, 0.0001)  # rounds up: 0 would mean "no timeout"
    cuda.lock(10, 2.5)
    assert fake_driver.lock_timeouts == [0, 1, 2500]


def test_result_codes_become_exceptions_with_data(fake_driver: FakeDriver) -> None:
    fake_driver.codes = {("GetState", 7): 3, ("Unlock", 7): 401, ("Lock", 7): 12345}
    with pytest.raises(cuda.NotInitialized) as got:
        cuda.process_state(7)
    assert (got.value.pid, got.value.code, got.value.name) == (7, 3, "CUDA_ERROR_NOT_INITIALIZED")
    with pytest.raises(cuda.IllegalState, match="pid 7: CUDA_ERROR_ILLEGAL_STATE"):
        cuda.unlock(7)
    with pytest.raises(cuda.CudaError) as other:
        cuda.lock(7)
    assert type(other.value) is cuda.CudaError
    assert other.value.code == 12345


def test_checkpoint_undoes_everything_when_one_process_cannot(fake_driver: FakeDriver) -> None:
    fake_driver.codes = {("Checkpoint", 2): 801}
    with pytest.raises(cuda.NotCheckpointable) as got:
        cuda.checkpoint_all([1, 2], lock_timeout_s=5)
    assert (got.value.pid, got.value.code) == (2, 801)
    assert isinstance(got.value, cuda.NotSupported)
    assert fake_driver.calls == [
        ("Lock", 1),
        ("Lock", 2),
        ("Checkpoint", 1),
        ("Checkpoint", 2),
        ("Restore", 1),
        ("Unlock", 1),
        ("Unlock", 2),
    ]


def test_lock_timeout_unlocks_the_locked_ones(fake_driver: FakeDriver) -> None:
    fake_driver.codes = {("Lock", 2): 600}
    with pytest.raises(cuda.LockTimeout):
        cuda.checkpoint_all([1, 2], lock_timeout_s=0.5)
    assert fake_driver.calls == [("Lock", 1), ("Lock", 2), ("Unlock", 1)]


def test_restore_all_restores_then_unlocks(fake_driver: FakeDriver) -> None:
    cuda.restore_all([1, 2])
    assert fake_driver.calls == [("Restore", 1), ("Restore", 2), ("Unlock", 1), ("Unlock", 2)]


def test_restore_all_passes_over_a_process_that_is_gone(fake_driver: FakeDriver) -> None:
    gone = 0x3FFFFFFF  # beyond pid_max: no such process (killed while checkpointed)
    fake_driver.codes = {("Restore", gone): 304}
    cuda.restore_all([gone, 1])
    assert fake_driver.calls == [("Restore", gone), ("Restore", 1), ("Unlock", 1)]
    fake_driver.codes[("Restore", os.getpid())] = 304  # alive: a real error
    with pytest.raises(cuda.DriverOSError):
        cuda.restore_all([os.getpid()])


def test_cuda_pids_keeps_cuda_processes_only(fake_driver: FakeDriver) -> None:
    gone = 0x3FFFFFFF  # beyond pid_max: no such process
    fake_driver.codes = {("GetState", 2): 3, ("GetState", gone): 304}
    assert cuda.cuda_pids([1, 2, 1, gone, 3]) == [1, 3]
    fake_driver.codes[("GetState", os.getpid())] = 304  # alive: a real error
    with pytest.raises(cuda.DriverOSError):
        cuda.cuda_pids([os.getpid()])


@pytest.fixture
def fresh_nvml(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(nvml, "_pynvml", None)
    monkeypatch.setattr(nvml, "_missing", None)


class NVMLError(Exception):
    pass


def fake_pynvml(listings: list[list[tuple[int, int | None]]], free: int = 8 * GIB) -> Any:
    """A pynvml with one GPU. Each look at its processes shows the next of ``listings``
    (the last one stays); each process is listed as compute and as graphics."""
    mod: Any = types.ModuleType("pynvml")
    mod.NVMLError = NVMLError
    mod.nvmlInit = lambda: None
    mod.nvmlDeviceGetCount = lambda: 1
    mod.nvmlDeviceGetHandleByIndex = lambda i: "h0" if i == 0 else _raise(NVMLError("Not Found"))
    mod.nvmlDeviceGetHandleByUUID = lambda u: "h0" if u == "GPU-0" else _raise(NVMLError("nope"))
    mod.nvmlDeviceGetIndex = lambda h: 0
    mod.nvmlDeviceGetUUID = lambda h: b"GPU-0"  # versions before 11.515 return bytes
    mod.nvmlDeviceGetName = lambda h: "Fake GPU"
    mod.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(
        total=16 * GIB, used=16 * GIB - free, free=free
    )
    shown: list[list[Any]] = []

    def compute(h: str) -> list[Any]:
        now = listings[min(len(shown), len(listings) - 1)]
        shown.append([types.SimpleNamespace(pid=p, usedGpuMemory=m) for p, m in now])
        return shown[-1]

    mod.nvmlDeviceGetComputeRunningProcesses = compute
    mod.nvmlDeviceGetGraphicsRunningProcesses = lambda h: shown[-1]
    return mod


def _raise(err: Exception) -> Any:
    raise err


def test_nvml_missing_is_unavailable(fresh_nvml: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import raises ImportError
    assert not nvml.available()
    with pytest.raises(nvml.NvmlUnavailable, match="not installed"):
        nvml.gpus()


def test_nvml_init_failure_is_unavailable(
    fresh_nvml: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    mod = fake_pynvml([[]])
    mod.nvmlInit = lambda: _raise(NVMLError("Driver Not Loaded"))
    monkeypatch.setitem(sys.modules, "pynvml", mod)
    assert not nvml.available()
    with pytest.raises(nvml.NvmlUnavailable, match="Driver Not Loaded"):
        nvml.free_bytes(0)


def test_nvml_gpus_and_processes(fresh_nvml: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml([[(10, 3 * GIB), (11, None)]]))
    assert nvml.available()
    assert nvml.gpus() == [nvml.Gpu(0, "GPU-0", "Fake GPU", 16 * GIB, 8 * GIB, 8 * GIB)]
    assert nvml.gpu("GPU-0").index == 0
    # Listed as compute and graphics: counted once.
    assert nvml.processes(0) == {10: 3 * GIB, 11: 0}
    assert nvml.used_by([10, 11, 12], 0) == nvml.used_by([10], None) == 3 * GIB
    with pytest.raises(nvml.NvmlError, match="nope"):
        nvml.gpu("GPU-x")


def test_nvml_waits(fresh_nvml: None, monkeypatch: pytest.MonkeyPatch) -> None:
    held: list[tuple[int, int | None]] = [(10, GIB)]
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml([held, held, held, []]))
    assert nvml.wait_released([10], 0, timeout=5, interval=0.001)
    assert nvml.wait_released([10], 0, timeout=0, keep_bytes=0)
    assert not nvml.wait_free(0, 9 * GIB, timeout=0.02, interval=0.005)
    assert nvml.wait_free(0, 8 * GIB, timeout=0)


def test_importing_the_gpu_modules_imports_no_gpu_library() -> None:
    code = (
        "import sys, vramlock.gpu.cuda, vramlock.gpu.nvml, vramlock.offload;"
        "print(sorted({'torch', 'pynvml'} & set(sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# -- on a GPU -------------------------------------------------------------------------


def start_worker(spawn: Spawn, *args: str) -> Any:
    """A tests/gpu_worker.py process holding VRAM, and its client end."""
    worker = importlib.import_module("gpu_worker")
    return worker.Client(spawn([sys.executable, worker.PATH, *args], stdin=subprocess.PIPE))


@gpu
@pytest.mark.timeout(300)
def test_checkpoint_frees_vram_and_restores_the_same_data(spawn: Spawn) -> None:
    w = start_worker(spawn, "--gib", "2")
    bystander = spawn([sys.executable, "-c", "import time; time.sleep(60)"])
    assert cuda.cuda_pids([bystander.pid, w.pid]) == [w.pid]
    footprint = nvml.used_by([w.pid], 0)
    assert footprint > 2 * GIB

    cuda.checkpoint(w.pid, lock_timeout_s=10)
    assert cuda.process_state(w.pid) is cuda.ProcessState.CHECKPOINTED
    assert nvml.wait_released([w.pid], 0, timeout=5)
    assert w.pid not in nvml.processes(0)

    w.send("check")  # CUDA calls block while checkpointed, and finish after restore
    assert w.silent(0.5)
    # A restore with too little free VRAM wedges the process: it must not be tried.
    assert not nvml.wait_free(0, nvml.gpu(0).total + 1, timeout=0.3)
    assert cuda.process_state(w.pid) is cuda.ProcessState.CHECKPOINTED
    assert nvml.wait_free(0, footprint + GIB // 2, timeout=5)

    cuda.restore(w.pid)
    assert cuda.process_state(w.pid) is cuda.ProcessState.RUNNING
    word, value = w.read(60).split()
    assert (word, int(value)) == ("sum", w.checksum)
    assert nvml.used_by([w.pid], 0) >= footprint - (64 << 20)
    assert w.check() == w.checksum


@gpu
@pytest.mark.timeout(300)
def test_managed_memory_is_refused_and_left_running(spawn: Spawn) -> None:
    w = start_worker(spawn, "--gib", "0.25", "--managed-mib", "64")
    with pytest.raises(cuda.NotCheckpointable) as got:
        cuda.checkpoint(w.pid, lock_timeout_s=10)
    assert got.value.pid == w.pid
    assert cuda.process_state(w.pid) is cuda.ProcessState.RUNNING
    assert w.check() == w.checksum


@gpu
@pytest.mark.timeout(300)
def test_lock_times_out_on_a_busy_process_and_leaves_it_running(spawn: Spawn) -> None:
    w = start_worker(spawn, "--gib", "0.25")
    w.send("spin 3")
    assert w.read(60) == "spinning"
    with pytest.raises(cuda.LockTimeout) as got:
        cuda.checkpoint(w.pid, lock_timeout_s=0.2)
    assert (got.value.pid, got.value.code) == (w.pid, 600)
    assert cuda.process_state(w.pid) is cuda.ProcessState.RUNNING
    assert w.check() == w.checksum


@pytest.fixture
def torch_gpu() -> Iterator[Any]:
    torch = importlib.import_module("torch")
    yield torch
    torch.cuda.empty_cache()


@gpu
@pytest.mark.timeout(300)
def test_offload_module_and_adam_round_trip(torch_gpu: Any) -> None:
    from vramlock.offload import Offloader

    torch = torch_gpu
    checksum = importlib.import_module("gpu_worker").checksum

    def make() -> tuple[Any, Any]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(4096, 4096) for _ in range(8)]).cuda()
        model[1].weight = model[0].weight  # tied: one parameter in two places
        table = torch.arange(1 << 20, dtype=torch.float32, device="cuda")
        model.register_buffer("table", table)
        model.register_buffer("front", table[: 1 << 19])  # a view of another buffer
        opt = torch.optim.Adam(model.parameters())
        return model, opt

    def step(model: Any, opt: Any) -> None:
        x = torch.randn(256, 4096, generator=torch.Generator("cuda").manual_seed(1), device="cuda")
        model(x).square().mean().backward()
        opt.step()

    model, opt = make()
    twin, twin_opt = make()
    step(model, opt)
    step(twin, twin_opt)
    tensors = [*model.parameters(), *(p.grad for p in model.parameters()), *model.buffers()]
    tensors += [v for s in opt.state.values() for v in s.values() if v.is_cuda]
    before = checksum(tensors)
    allocated = torch.cuda.memory_allocated()

    off = Offloader(model, opt)
    off.prepare()
    hosts = [off._host]
    for _ in range(2):
        off.offload()
        hosts.append(off._host)
        assert not any(t.is_cuda for t in tensors)
        assert model.front.data_ptr() == model.table.data_ptr()
        freed = allocated - torch.cuda.memory_allocated()
        # 7 distinct weights (two layers share one), each with a gradient and Adam's two.
        assert freed >= off.nbytes >= 4 * 7 * 4096 * 4096 * 4
        off.restore()
        assert all(t.is_cuda for t in tensors)
        assert checksum(tensors) == before
    assert hosts[0] is hosts[1] is hosts[2]  # pinned once, reused
    assert model[1].weight is model[0].weight
    model.table[0] = -1.0
    assert model.front[0].item() == -1.0  # still one storage
    model.table[0] = 0.0

    step(model, opt)  # the optimizer still drives the same tensors
    step(twin, twin_opt)
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(a, b)
    off.close()


def _trainer_sizes() -> list[str]:
    """Two trainers that together need more VRAM than the GPU has."""
    free = nvml.free_bytes(0)
    each = free // 2 + 2 * GIB
    layer = 4096 * 4096 * 4 * 4  # weights, gradients and Adam's two moments
    layers = max(1, int(each * 0.1 // layer))
    scratch = (each - layers * layer) / GIB
    return ["--layers", str(layers), "--scratch-gib", f"{scratch:.2f}", "--steps", "60"]


@gpu
@pytest.mark.timeout(400)
@pytest.mark.parametrize("how", ["run --release signal", "Member API"])
def test_two_trainers_that_do_not_fit_together_take_turns(
    how: str, arena: Path, spawn: Spawn
) -> None:
    sizes = _trainer_sizes()
    if how == "Member API":
        argv = [sys.executable, TRAINER, "--arena", str(arena), "--min-hold", "1", *sizes]
    else:
        run = vramlock("run", "--arena", str(arena), "--release", "signal", "--min-hold", "1s")
        argv = [*run, "--", sys.executable, TRAINER, *sizes]
    procs = [spawn(argv), spawn(argv)]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=360)
        assert proc.returncode == 0, err
        found = re.search(r"done steps=\d+ swaps=(\d+) bad=(\d+) sum=(-?\d+)", out)
        assert found, out
        results.append(tuple(int(g) for g in found.groups()))
    print(how, [f"swaps={s} bad={b}" for s, b, _ in results])
    assert all(swaps >= 1 and bad == 0 for swaps, bad, _ in results)
    assert results[0][2] == results[1][2]  # the same training, however it was interrupted


def test_nvml_is_warmed_in_a_thread_of_its_own_once(monkeypatch: pytest.MonkeyPatch) -> None:
    # A wrapper's first NVML call used to initialise NVML on its first handoff, a
    # waiter's time; warm() does it at start in a thread, and a call meanwhile waits for
    # that one rather than initialising NVML again.
    calls: list[str] = []

    class FakeNvml(types.ModuleType):
        class NVMLError(Exception):
            pass

        @staticmethod
        def nvmlInit() -> None:
            calls.append(threading.current_thread().name)
            time.sleep(0.2)

    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml("pynvml"))
    monkeypatch.setattr(nvml, "_pynvml", None)
    monkeypatch.setattr(nvml, "_missing", None)
    nvml.warm()
    time.sleep(0.05)  # the thread has begun initialising
    assert nvml.available()
    assert calls == ["vramlock-nvml"]
    nvml.warm()  # ready: nothing more
    assert calls == ["vramlock-nvml"]
