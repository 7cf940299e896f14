"""llama-swap's ``GET /api/hardware`` and ``GET /api/performance``: what the machine is,
and how busy it has been.

The hardware is described once, when it is first asked for (not at start, which it
would slow), in llama-swap's schema (version 1): the architecture, the operating
system, whether it runs in a container or a virtual machine (``unknown`` where that
cannot be told), the CPUs, the memory, and the GPUs that NVML sees (none without
NVML: the ``nvml`` extra). What is not known is null, never guessed.

The performance is sampled every ``performance.every`` (5 s by default, at least
5 s), its last hour kept: each CPU's use, the memory and swap, the load averages and
each network interface's bytes (from /proc), and each GPU's temperature, use, memory,
fan and power (from NVML; none without it). ``vram_temp_c`` is 0: NVML has no memory
temperature to read.

/proc is read in the event loop (about 50 us a sample); what may block (NVML, a command)
runs in a thread of its own that ends with it (``passing.briefly``), never in a pool's threads,
which would outlive it: when serve is SIGKILLed, each of its threads still alive makes
the kernel signal the wrappers once more as they are handed from thread to thread (their
parent-death signal), in the middle of the cleanup the first signal began.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import platform
import subprocess
import sys
import time
from collections import deque
from typing import Any, TypeVar

from .config import DEFAULT_EVERY
from .inflight import stamp
from .passing import briefly

_MB = 1024 * 1024
# The GPU architectures by CUDA compute capability (NVIDIA's names).
_ARCHITECTURES = {
    "2": "Fermi", "3": "Kepler", "5": "Maxwell", "6": "Pascal", "7.0": "Volta",
    "7.2": "Volta", "7.5": "Turing", "8.0": "Ampere", "8.6": "Ampere", "8.7": "Ampere",
    "8.9": "Ada Lovelace", "9.0": "Hopper", "10": "Blackwell", "11": "Blackwell",
    "12": "Blackwell",
}  # fmt: skip
_MACHINES = {"x86_64": "x86_64", "amd64": "x86_64", "aarch64": "arm64", "arm64": "arm64",
             "armv7l": "armv7", "armv7": "armv7", "ppc64le": "ppc64le", "riscv64": "riscv64",
             "s390x": "s390x"}  # fmt: skip
_CONTAINERS = ("docker", "lxc", "rkt", "podman", "containerd", "systemd-nspawn")
_NAMES = {"docker": "Docker", "kvm": "KVM", "vmware": "VMware", "oracle": "VirtualBox",
          "microsoft": "Hyper-V", "lxc": "LXC", "podman": "Podman"}  # fmt: skip


T = TypeVar("T")


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def _fields(text: str, sep: str = ":") -> dict[str, str]:
    """``NAME: VALUE`` lines (the first of each name)."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        name, colon, value = line.partition(sep)
        if colon and name.strip() not in out:
            out[name.strip()] = value.strip()
    return out


def _kib(fields: dict[str, str], name: str) -> int:
    """A /proc/meminfo figure in bytes (0 if absent)."""
    try:
        return int(fields.get(name, "0").split()[0]) * 1024
    except (ValueError, IndexError):
        return 0


def _text(value: str | None) -> str | None:
    """A value, or None for an empty or unknown one."""
    value = (value or "").strip()
    return None if value.lower() in ("", "n/a", "unknown") else value


# -- the hardware ------------------------------------------------------------------


def _architecture() -> dict[str, Any]:
    raw = platform.machine()
    name = _MACHINES.get(raw.lower(), "other")
    return {"name": name, "raw_name": raw if raw and raw != name else None}


def _operating_system() -> dict[str, Any]:
    families = {"linux": "linux", "darwin": "macos", "win32": "windows"}
    family = families.get(sys.platform, "freebsd" if sys.platform.startswith("freebsd") else "")
    release = _fields(_read("/etc/os-release"), "=")
    out: dict[str, Any] = {
        "family": family or "other",
        "name": _text(release.get("ID", "").strip('"')),
        "version": _text(release.get("VERSION_ID", "").strip('"')),
        "kernel": _text(platform.release()),
    }
    if not family:
        out["raw_family"] = sys.platform
    return out


def _environment() -> dict[str, Any]:
    """Native, a container, a virtual machine or WSL, by their marks; else unknown."""
    kernel = platform.release().lower()
    if "microsoft" in kernel or "wsl" in kernel:
        return {"kind": "wsl", "name": "WSL", "version": None}
    if os.path.exists("/.dockerenv"):
        return {"kind": "container", "name": "Docker", "version": None}
    if os.path.exists("/run/.containerenv"):
        return {"kind": "container", "name": "Podman", "version": None}
    try:
        found = subprocess.run(["systemd-detect-virt"], capture_output=True, text=True,
                               timeout=2, check=False)  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return {"kind": "unknown", "name": None, "version": None}
    what = found.stdout.strip()
    if found.returncode == 0 and what and what != "none":
        kind = "container" if what in _CONTAINERS else "virtual_machine"
        return {"kind": kind, "name": _NAMES.get(what, what), "version": None}
    if found.returncode == 1:
        return {"kind": "native", "name": None, "version": None}
    return {"kind": "unknown", "name": None, "version": None}


def _cpu() -> dict[str, Any]:
    vendor = model = None
    sockets, cores = set(), set()
    for block in _read("/proc/cpuinfo").split("\n\n"):
        info = _fields(block)
        vendor = vendor or _text(info.get("vendor_id"))
        model = model or _text(info.get("model name"))
        if "physical id" in info:
            sockets.add(info["physical id"])
            if "core id" in info:
                cores.add((info["physical id"], info["core id"]))
    logical = os.cpu_count()
    physical = len(cores) or None
    if physical is not None and logical is not None and physical > logical:
        physical = None
    return {"vendor": vendor, "model": model, "socket_count": len(sockets) or None,
            "physical_core_count": physical, "logical_thread_count": logical}  # fmt: skip


def _memory() -> int:
    """The machine's memory, as llama-swap counts it: every present page (the kernel
    keeps some from MemTotal) where /proc/zoneinfo tells, within a cgroup's limit."""
    total = _kib(_fields(_read("/proc/meminfo")), "MemTotal")
    present, counted = 0, True
    for line in _read("/proc/zoneinfo").splitlines():
        words = line.split()
        if len(words) >= 4 and words[0] == "Node" and words[2] == "zone":
            counted = words[3] != "Device"
        elif counted and len(words) == 2 and words[0] == "present" and words[1].isdigit():
            present += int(words[1])
    total = max(total, present * os.sysconf("SC_PAGE_SIZE") if present else 0)
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        limit = _read(path).strip()
        if limit.isdigit() and 0 < int(limit) < total:
            total = int(limit)
    return total


def _architecture_of(capability: tuple[int, int] | None) -> str | None:
    if capability is None:
        return None
    major, minor = capability
    return _ARCHITECTURES.get(f"{major}.{minor}") or _ARCHITECTURES.get(str(major))


def _accelerators() -> list[dict[str, Any]]:
    """The GPUs NVML sees (none without it)."""
    from ..gpu import nvml

    try:
        cards = nvml.cards()
        driver = _text(nvml.driver_version())
    except nvml.NvmlUnavailable:
        return []
    except nvml.NvmlError:
        return []
    return [{
        "index": i, "kind": "gpu", "vendor": "NVIDIA", "model": _text(card.gpu.name),
        "architecture": _architecture_of(card.compute_capability),
        "memory": {"kind": "dedicated", "capacity_bytes": card.gpu.total or None},
        "driver": None if driver is None else {"name": "NVIDIA", "version": driver},
        "power_limit_watts": card.power_limit,
    } for i, card in enumerate(cards)]  # fmt: skip


def hardware(version: str) -> dict[str, Any] | None:
    """The machine in llama-swap's hardware schema; None if its memory cannot be read
    (the one fact the schema requires). Blocking: run it in a worker thread."""
    memory = _memory()
    if memory <= 0:
        return None
    return {
        "schema_version": 1,
        "captured_at": stamp_utc(time.time()),
        "capture": {"scope": "inference_host", "method": "detected",
                    "detector": {"name": "vramlock", "version": version}},
        "architecture": _architecture(),
        "operating_system": _operating_system(),
        "environment": _environment(),
        "cpu": _cpu(),
        "memory": {"capacity_bytes": memory},
        "accelerators": _accelerators(),
    }  # fmt: skip


def stamp_utc(wall: float) -> str:
    """A time in UTC as Go's JSON writes one (``...Z``)."""
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(wall)) + f".{int(wall % 1 * 1e6):06d}Z"


class Hardware:
    """``/api/hardware``'s answer, found on the first request and kept."""

    def __init__(self, version: str) -> None:
        self.version = version
        self._found: asyncio.Future[dict[str, Any] | None] | None = None

    async def get(self) -> dict[str, Any] | None:
        if self._found is None:
            self._found = asyncio.ensure_future(briefly(functools.partial(hardware, self.version)))
        return await asyncio.shield(self._found)


# -- the performance -----------------------------------------------------------------


def _cpu_times() -> list[tuple[int, int]]:
    """Each CPU's (busy, total) jiffies since boot."""
    out = []
    for line in _read("/proc/stat").splitlines():
        if line.startswith("cpu") and line[3:4].isdigit():
            v = [int(x) for x in line.split()[1:9]] + [0] * 8
            total = sum(v[:8])  # user nice system idle iowait irq softirq steal
            out.append((total - v[3] - v[4], total))
    return out


def _percent(before: tuple[int, int], now: tuple[int, int]) -> float:
    busy, total = now[0] - before[0], now[1] - before[1]
    if busy <= 0:
        return 0.0
    if total <= 0:
        return 100.0
    return min(100.0, max(0.0, busy / total * 100))


def _net() -> list[dict[str, Any]]:
    """Each interface's bytes (loopback left out), as /proc/net/dev counts them."""
    out = []
    for line in _read("/proc/net/dev").splitlines()[2:]:
        name, _, rest = line.partition(":")
        words = rest.split()
        if name.strip() == "lo" or len(words) < 9:
            continue
        out.append({"name": name.strip(), "bytes_recv": int(words[0]),
                    "bytes_sent": int(words[8])})  # fmt: skip
    return out


class Performance:
    """Samples every ``every`` seconds, the last hour of them kept (``start`` in the
    event loop, ``stop`` at the end)."""

    def __init__(self, every: float = DEFAULT_EVERY) -> None:
        self.every = every
        size = max(1, int(3600 // every))
        # Each sample with its time in microseconds (as its timestamp says it, to compare
        # with ?after= exactly).
        self.sys: deque[tuple[int, dict[str, Any]]] = deque(maxlen=size)
        self.gpu: deque[tuple[int, list[dict[str, Any]]]] = deque(maxlen=size)
        self._cpu: list[tuple[int, int]] = []
        self._nvml = True  # until NVML turns out absent
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _run(self) -> None:
        self._cpu = _cpu_times()
        while True:
            await asyncio.sleep(self.every)
            at, sys_stat = self.sample()
            gpu_stats = None
            if self._nvml:
                gpu_stats = await briefly(functools.partial(self._gpus, at / 1e6))
            # Published together: a reader between the two would take `at` for done, and
            # with ?after=at never see the GPUs' sample of that time.
            self.sys.append((at, sys_stat))
            if gpu_stats:
                self.gpu.append((at, gpu_stats))

    def sample(self) -> tuple[int, dict[str, Any]]:
        """The machine's sample, and its time in microseconds (from /proc: quick)."""
        micros = round(time.time() * 1e6)
        wall = micros / 1e6
        times = _cpu_times()
        cores = [_percent(a, b) for a, b in zip(self._cpu, times, strict=False)]
        self._cpu = times
        mem = _fields(_read("/proc/meminfo"))
        total, free = _kib(mem, "MemTotal"), _kib(mem, "MemFree")
        cached = _kib(mem, "Cached") + _kib(mem, "SReclaimable")
        used = total - free - _kib(mem, "Buffers") - cached
        swap = _kib(mem, "SwapTotal")
        try:
            load = os.getloadavg()
        except OSError:
            load = (0.0, 0.0, 0.0)
        sys_stat = {
            "timestamp": stamp(wall), "cpu_util_per_core": cores,
            "mem_total_mb": total // _MB, "mem_used_mb": max(used, 0) // _MB,
            "mem_free_mb": free // _MB, "swap_total_mb": swap // _MB,
            "swap_used_mb": max(swap - _kib(mem, "SwapFree"), 0) // _MB,
            "load_avg_1": load[0], "load_avg_5": load[1], "load_avg_15": load[2],
            "net_io": _net(),
        }  # fmt: skip
        return micros, sys_stat

    def _gpus(self, wall: float) -> list[dict[str, Any]]:
        """Each GPU's sample, from NVML (none without it, and NVML is not asked again).
        Blocking."""
        from ..gpu import nvml

        try:
            readings = nvml.readings()
        except nvml.NvmlUnavailable:
            self._nvml = False
            return []
        except nvml.NvmlError:
            return []
        out = []
        for r in readings:
            used, total = r.gpu.used // _MB, r.gpu.total // _MB
            out.append({
                "timestamp": stamp(wall), "id": r.gpu.index, "name": r.gpu.name,
                "uuid": r.gpu.uuid, "temp_c": r.temperature or 0, "vram_temp_c": 0,
                "gpu_util_pct": float(r.utilization or 0),
                "mem_util_pct": used / total * 100 if total else 0.0,
                "mem_used_mb": used, "mem_total_mb": total,
                "fan_speed_pct": float(r.fan or 0), "power_draw_w": r.power or 0.0,
            })  # fmt: skip
        return out

    def current(self, after: float | None = None) -> dict[str, Any]:
        """``/api/performance``'s answer: every sample kept, or those after ``after``
        (as llama-swap's, null for none kept, [] for none after ``after``)."""
        since = None if after is None else round(after * 1e6)
        sys_stats = [s for at, s in self.sys if since is None or at > since]
        gpu_stats = [g for at, gs in self.gpu if since is None or at > since for g in gs]
        return {
            "enabled": True,
            "sys_stats": sys_stats if sys_stats or after is not None else None,
            "gpu_stats": gpu_stats if gpu_stats or after is not None else None,
        }
