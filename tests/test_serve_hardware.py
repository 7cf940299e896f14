"""``vramlock serve``'s llama-swap /api/hardware and /api/performance, in its shapes.

The GPU is tests/fake_nvml's stand-in (an H100-like card of 80 GiB), or none.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
from helpers.budget import FAKE_NVML
from helpers.processes import Spawn, wait_until
from helpers.serve import call, call_json, echo_model, start, write_config

import vramlock

pytest.importorskip("aiohttp")

pytestmark = pytest.mark.timeout(90)


def serve(
    spawn: Spawn, tmp_path: Path, arena: Path, top: str = "", nvml: str = "", **extra: str
) -> int:
    """serve with the stand-in NVML (``nvml``: FAKE_NVML_DIR; "none": no driver)."""
    path = write_config(tmp_path, top + "models:\n" + echo_model("m"))
    env = {"PYTHONPATH": os.pathsep.join([FAKE_NVML, os.environ.get("PYTHONPATH", "")]),
           "FAKE_NVML_DIR": nvml or str(tmp_path), **extra}  # fmt: skip
    return start(spawn, path, arena, env=env)[1]


def test_the_hardware_is_described_in_llama_swap_s_schema(
    spawn: Spawn, tmp_path: Path, arena: Path
) -> None:
    port = serve(spawn, tmp_path, arena)
    status, headers, body = call(port, "GET", "/api/hardware")
    assert (status, headers["Content-Type"]) == (200, "application/json; charset=utf-8")
    got = json.loads(body)
    assert list(got) == ["schema_version", "captured_at", "capture", "architecture",
                         "operating_system", "environment", "cpu", "memory",
                         "accelerators"]  # fmt: skip
    assert got["schema_version"] == 1 and got["captured_at"].endswith("Z")
    assert got["capture"] == {"scope": "inference_host", "method": "detected",
                              "detector": {"name": "vramlock",
                                           "version": vramlock.__version__}}  # fmt: skip
    assert got["architecture"]["name"] in ("x86_64", "arm64", "armv7", "ppc64le", "riscv64",
                                           "s390x", "other")  # fmt: skip
    assert got["operating_system"]["family"] == "linux"
    assert got["operating_system"]["kernel"] == os.uname().release
    assert got["environment"]["kind"] in ("native", "container", "virtual_machine", "wsl",
                                          "unknown")  # fmt: skip
    assert set(got["cpu"]) == {"vendor", "model", "socket_count", "physical_core_count",
                               "logical_thread_count"}  # fmt: skip
    assert got["cpu"]["logical_thread_count"] == os.cpu_count()
    capacity = got["memory"]["capacity_bytes"]  # within a cgroup's limit: no more to say
    assert isinstance(capacity, int) and capacity > 0
    assert got["accelerators"] == [{
        "index": 0, "kind": "gpu", "vendor": "NVIDIA", "model": "stand-in GPU",
        "architecture": "Hopper", "memory": {"kind": "dedicated", "capacity_bytes": 80 << 30},
        "driver": {"name": "NVIDIA", "version": "0.0 (stand-in)"},
        "power_limit_watts": 700.0,
    }]  # fmt: skip
    assert call_json(port, "GET", "/api/hardware") == got  # found once, kept


def test_without_nvml_no_accelerator_is_listed(spawn: Spawn, tmp_path: Path, arena: Path) -> None:
    port = serve(spawn, tmp_path, arena, nvml="none")
    assert call_json(port, "GET", "/api/hardware")["accelerators"] == []


def _sampled(port: int) -> dict[str, Any]:
    found: dict[str, Any] = {}

    def sampled() -> bool:
        found.update(call_json(port, "GET", "/api/performance"))
        return bool(found["sys_stats"])

    wait_until(sampled, 30, 0.25)
    return found


def test_performance_is_sampled_every_period(spawn: Spawn, tmp_path: Path, arena: Path) -> None:
    began = time.time()
    port = serve(spawn, tmp_path, arena, "performance: {every: 5s}\n")
    assert call_json(port, "GET", "/api/performance") == {
        "enabled": True, "sys_stats": None, "gpu_stats": None}  # fmt: skip
    got = _sampled(port)
    assert time.time() - began >= 5
    (sys_stat,) = got["sys_stats"]
    assert list(sys_stat) == ["timestamp", "cpu_util_per_core", "mem_total_mb", "mem_used_mb",
                              "mem_free_mb", "swap_total_mb", "swap_used_mb", "load_avg_1",
                              "load_avg_5", "load_avg_15", "net_io"]  # fmt: skip
    assert len(sys_stat["cpu_util_per_core"]) == os.cpu_count()
    assert all(0 <= p <= 100 for p in sys_stat["cpu_util_per_core"])
    assert 0 < sys_stat["mem_used_mb"] < sys_stat["mem_total_mb"]
    assert all(set(n) == {"name", "bytes_recv", "bytes_sent"} and n["name"] != "lo"
               for n in sys_stat["net_io"])  # fmt: skip
    (gpu,) = got["gpu_stats"]
    assert gpu == {
        "timestamp": sys_stat["timestamp"], "id": 0, "name": "stand-in GPU",
        "uuid": "GPU-00000000-0000-0000-0000-000000000000", "temp_c": 41, "vram_temp_c": 0,
        "gpu_util_pct": 7.0, "mem_util_pct": 0.0, "mem_used_mb": 0, "mem_total_mb": 81920,
        "fan_speed_pct": 0.0, "power_draw_w": 71.5,
    }  # fmt: skip
    after = sys_stat["timestamp"].replace("+", "%2B")
    assert call_json(port, "GET", f"/api/performance?after={after}") == {
        "enabled": True, "sys_stats": [], "gpu_stats": []}  # fmt: skip
    status, _, body = call(port, "GET", "/api/performance?after=soon")
    assert status == 400
    assert json.loads(body)["error"]["message"] == "invalid 'after' timestamp, use RFC3339 format"


def test_a_sample_is_seen_whole_while_the_gpus_are_slow_to_answer(
    spawn: Spawn, tmp_path: Path, arena: Path
) -> None:
    """A client that polls with ?after= the last time it saw never misses the GPUs' part
    of a sample: the machine's and the GPUs' are published together."""
    port = serve(spawn, tmp_path, arena, "performance: {every: 5s}\n", FAKE_NVML_SLOW_MS="500")
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        got = call_json(port, "GET", "/api/performance")
        if got["sys_stats"]:
            break
        time.sleep(0.02)
    times = {s["timestamp"] for s in got["sys_stats"]}
    assert times and times == {g["timestamp"] for g in got["gpu_stats"] or []}, got


def test_performance_disabled_is_a_503(spawn: Spawn, tmp_path: Path, arena: Path) -> None:
    port = serve(spawn, tmp_path, arena, "performance: {disabled: true}\n")
    status, _, body = call(port, "GET", "/api/performance")
    got = json.loads(body)
    assert (status, got["enabled"]) == (503, False)
    assert got["error"]["message"] == "performance monitoring is disabled"
