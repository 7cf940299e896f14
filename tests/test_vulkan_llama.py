"""Two unmodified Vulkan llama-servers (llama.cpp's Vulkan backend, tools/llama_server.py
--vulkan) on Mesa's lavapipe share one arena under plain ``vramlock run`` (``auto``): each
is swapped, not restarted, when the other is asked.

Each server is wrapped as ``vramlock run --demand listen --listen L --upstream U --idle
100ms -- llama-server ...``, nothing else named: auto recognises llama-server, and swaps
it with the Vulkan layer once its process joined. The witness is the tests' own Vulkan
layer next to the driver (tests/helpers/vulkan.py): no submit of a server reaches the
driver while the other works, and a released server's device memory is gone. The answers
are those of the same server without vramlock (temperature 0, a fixed seed), and a
repeated prompt after the switches is served from the KV cache that was kept.

Skips, saying why, without lavapipe, glslc or the Vulkan build (``python
tools/llama_server.py --vulkan``; CI builds it where glslc is).
"""

from __future__ import annotations

import os
import re
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
from helpers import ROOT
from helpers.commands import vramlock, who_json
from helpers.llama import call
from helpers.net import accepts, free_ports
from helpers.processes import Spawn, wait_until
from helpers.vulkan import NAME, build_witness, held_at, logged, overlapping

from vramlock.gpu.cbuild import compiler
from vramlock.gpu.vulkan import loader_here

sys.path.insert(0, str(ROOT / "tools"))
import llama_server

LAVAPIPE = Path("/usr/share/vulkan/icd.d/lvp_icd.x86_64.json")
BINARY = llama_server.cached_binary(llama_server.VULKAN)

pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.skipif(compiler() is None, reason="no C compiler"),
    pytest.mark.skipif(not loader_here(), reason="no Vulkan loader (libvulkan.so.1)"),
    pytest.mark.skipif(not LAVAPIPE.exists(), reason="no lavapipe (mesa-vulkan-drivers)"),
    pytest.mark.skipif(shutil.which("glslc") is None, reason="no glslc: no Vulkan llama-server"),
    pytest.mark.skipif(
        BINARY is None,
        reason="no Vulkan llama-server built in"
        f" {llama_server.cache_dir(llama_server.VULKAN)}: run"
        " `python tools/llama_server.py --vulkan`",
    ),
]

PROMPTS = ("The quick brown fox jumps over the lazy dog. " * 6, "Once upon a time " * 8)
SWITCHES = 6


def server_args(model: Path, port: int) -> list[str]:
    """One slot, a small context, one thread, no warm-up: light on a 2-core machine."""
    return [str(BINARY), "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
            "-np", "1", "-c", "256", "-t", "1", "--no-warmup", "-ngl", "99",
            "-lv", "4"]  # fmt: skip


# VRAMLOCK_VULKAN_MAPPED for the servers: their compute buffer may take mappable
# device-local memory (and stays on the device through a release), their model not.
ALLOWANCE = 1 << 20


def lavapipe_env(log: Path | None = None, layers: Path | None = None) -> dict[str, str]:
    """Lavapipe only (llama.cpp skips a CPU device unless GGML_VK_VISIBLE_DEVICES names
    it), and the witness below everything where ``layers`` is given."""
    env = dict(os.environ, VK_ICD_FILENAMES=str(LAVAPIPE), VK_DRIVER_FILES=str(LAVAPIPE),
               GGML_VK_VISIBLE_DEVICES="0", VRAMLOCK_VULKAN_MAPPED=str(ALLOWANCE))  # fmt: skip
    if layers is not None and log is not None:
        env.update(VK_ADD_LAYER_PATH=str(layers), VK_INSTANCE_LAYERS=NAME, WITNESS_LOG=str(log))
    return env


def on_device(log: Path) -> int:
    """The device memory llama-server says it took for its model, KV cache and compute
    buffers (``Vulkan0 ... buffer size = N MiB`` in its log), in bytes, rounded down."""
    sizes = re.findall(r"Vulkan0 \w+ buffer size = +([0-9.]+) MiB", log.read_text())
    assert len(sizes) >= 3, sizes
    return int(sum(float(mib) - 0.005 for mib in sizes) * (1 << 20))


def complete(port: int, prompt: str) -> dict[str, Any]:
    body = {"prompt": prompt, "n_predict": 8, "temperature": 0, "seed": 42, "cache_prompt": True}
    status, reply = call(port, "POST", "/completion", body)
    assert status == 200, reply
    return reply  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import tiny_gguf

    path = tmp_path_factory.mktemp("model") / "tiny.gguf"
    tiny_gguf.write(path, llama_server.vocab_path(variant=llama_server.VULKAN))
    return path


@pytest.fixture(scope="module")
def witness(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cc = compiler()
    assert cc is not None
    return build_witness(cc, tmp_path_factory.mktemp("witness"))


def alone(spawn: Spawn, model: Path, tmp_path: Path) -> list[str]:
    """Each prompt's answer from one server without vramlock."""
    port = free_ports(1)[0]
    with open(tmp_path / "alone.log", "w") as log:
        proc = spawn(server_args(model, port), env=lavapipe_env(), stdout=log, stderr=log)
    wait_until(lambda: accepts(port) and call(port, "GET", "/health")[0] == 200, timeout=60)
    answers = [complete(port, prompt)["content"] for prompt in PROMPTS]
    proc.terminate()
    proc.wait(30)
    return answers


def test_two_vulkan_servers_are_swapped_in_turn_and_keep_their_cache(
    spawn: Spawn, arena: Path, model: Path, witness: Path, tmp_path: Path
) -> None:
    expected = alone(spawn, model, tmp_path)
    listen, logs = [], []
    for name in ("a", "b"):
        port, upstream = free_ports(2)
        logs.append(tmp_path / f"{name}.witness")
        with open(tmp_path / f"{name}.log", "w") as out:
            spawn(vramlock("run", "--arena", str(arena), "--name", name, "--demand", "listen",
                           "--listen", str(port), "--upstream", str(upstream), "--min-hold",
                           "0", "--idle", "100ms", "--", *server_args(model, upstream)),
                  env=lavapipe_env(logs[-1], witness), stdout=out, stderr=out,
                  graceful=True)  # fmt: skip
        listen.append(port)
    for port in listen:
        wait_until(lambda p=port: accepts(p), timeout=30)  # type: ignore[misc]
    firsts = [complete(listen[k], PROMPTS[k]) for k in (0, 1)]
    replies = [complete(listen[k % 2], PROMPTS[k % 2]) for k in range(SWITCHES)]
    for k, reply in enumerate(firsts + replies):
        assert reply["content"] == expected[k % 2], (k, reply["content"])
    assert [r["timings"]["cache_n"] for r in firsts] == [0, 0]
    # Each repeated prompt after a switch: the KV cache was kept through the swap.
    assert all(r["timings"]["cache_n"] > 0 for r in replies), [r["timings"] for r in replies]
    ways = {r["name"]: r["strategy"] for r in who_json(arena) if r["member"]}
    assert ways == {"a": "auto:swap-vulkan", "b": "auto:swap-vulkan"}, ways
    submits = [logged(log, "submit") for log in logs]
    assert submits[0] and submits[1]
    assert not overlapping(submits[0], submits[1])  # never both at work
    # While one works, the driver holds none of the other's model and KV cache, and of
    # its compute buffers no more than the mapped allowance (ALLOWANCE: the compute
    # buffer, 0.6 MiB, fits; the model, 4 MiB, does not). What else it keeps is memory it
    # maps: host memory on lavapipe, as it would be on any GPU.
    peak = [max(b for _, b in logged(log, "memory")) for log in logs]
    freed = [on_device(tmp_path / f"{name}.log") - ALLOWANCE for name in ("a", "b")]
    assert min(freed) > 3 << 20  # the model at least
    for k in (0, 1):
        other = 1 - k
        for start, _ in submits[k]:
            assert held_at(logs[other], start) <= peak[other] - freed[other], (k, start)
