"""The Vulkan layer on the engine's core: a Vulkan process that cannot reach vramlock
run follows ``VRAMLOCK_SWAP_UNREACHED`` as a CUDA one does (the core's control.c),
where the layer alone used to wait for good. The program (tests/vulkan/vk_prog.c) runs
on Mesa's lavapipe under the layer, named to a socket nobody listens on; the witness
is the program's own output: ``ready`` once its buffers are made on the device, ``done
ROUNDS ok`` at the end."""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers.vulkan import MARKS, build_program

from vramlock.gpu.vulkan import LAYER_NAME, layer_path, write_manifest

pytestmark = MARKS


@dataclass
class Layer:
    program: Path
    manifests: Path  # the directory of the layer's manifest


@pytest.fixture(scope="module")
def layer(tmp_path_factory: pytest.TempPathFactory) -> Layer:
    out = tmp_path_factory.mktemp("vulkan-engine")
    program = build_program(out)
    write_manifest(str(out), layer_path())
    return Layer(program, out)


def _unreached(layer: Layer, tmp_path: Path, **extra: str) -> subprocess.CompletedProcess[str]:
    """vk_prog under the layer, told a socket in a directory that is not there."""
    env = dict(os.environ, VK_ADD_LAYER_PATH=str(layer.manifests),
               VK_INSTANCE_LAYERS=LAYER_NAME, VK_PROG_STOP="/",
               VRAMLOCK_SWAP_SOCKET=str(tmp_path / "gone" / "control"))  # fmt: skip
    for name in ("VRAMLOCK_SWAP_ABSTRACT", "VRAMLOCK_SWAP_UNREACHED", "VRAMLOCK_TOKEN_FD"):
        env.pop(name, None)
    env.update(extra)
    return subprocess.run([str(layer.program), "64"], env=env, capture_output=True, text=True,
                          timeout=60)  # fmt: skip


def test_a_vulkan_process_that_cannot_reach_its_run_ends_before_its_gpu_work(
    layer: Layer, tmp_path: Path
) -> None:
    done = _unreached(layer, tmp_path)
    assert done.returncode == 1, (done.stdout, done.stderr)
    assert "ready" not in done.stdout  # no buffer made on the device
    (line,) = [ln for ln in done.stderr.splitlines() if ln.startswith("vramlock-")]
    assert line.startswith("vramlock-vulkan: pid ")
    assert "cannot reach vramlock run (" in line and "No such file or directory" in line
    assert "--release swap-vulkan cannot release this process, so it ends before its GPU" in line


def test_a_vulkan_process_told_to_run_unreached_runs_without_swap(
    layer: Layer, tmp_path: Path
) -> None:
    done = _unreached(layer, tmp_path, VRAMLOCK_SWAP_UNREACHED="run")
    assert done.returncode == 0, (done.stdout, done.stderr)
    assert done.stdout.split()[:1] == ["ready"] and "ok" in done.stdout.split()
    assert "vramlock-" not in done.stderr  # said only in the trace (VRAMLOCK_SWAP_DEBUG=1)
