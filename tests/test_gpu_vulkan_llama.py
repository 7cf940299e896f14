"""Two unmodified Vulkan llama-servers of a 5 GiB model share one NVIDIA GPU through its
Vulkan driver behind ``--demand listen``, under ``--release swap-vulkan`` and under plain
``auto`` (which swaps them with the Vulkan layer), and keep their weights and KV caches
across twenty switches.

Each llama-server (llama.cpp built with ``-DGGML_VULKAN=ON``, all layers on the GPU, one
slot) is wrapped as ``vramlock run --release swap-vulkan|auto --demand listen --listen L
--upstream U``; clients only talk to the listen ports, and every request after the first
two goes to the server just released. Skipped without a GPU (see tests/test_gpu.py) or
without ``VRAMLOCK_LLAMA_VULKAN``, the path of such a llama-server. The model is
``VRAMLOCK_BIG_GGUF``, or tools/tiny_gguf.py's ``--gib 5`` written once per session.

The witnesses are independent of vramlock's own account:

- NVML, sampled every 20 ms from before the first server starts: never both servers
  above 1 GiB; after each answer, the server that answered holds most of its model
  and the other at most 1 GiB. A Vulkan process is one of NVML's graphics processes
  (``vramlock.gpu.nvml.processes`` lists both kinds). The devices' own figure (all
  processes together) is sampled too: never one server's and a released one's
  exceeded, and most of a model held after every answer, so that an NVML that gives
  no figure per process for a Vulkan process cannot pass the test unwitnessed.
- llama-server's answers: the text of each prompt's first answer is that of the same
  server run without vramlock; every later answer has the same text and the same
  token probabilities as the same server's answer before any switch, its prompt's
  prefix taken from the KV cache its slot kept (``timings.cache_n``).
- the kernel's lock table: the holders of token.lock alternate, once a switch.
"""

from __future__ import annotations

import http.client
import importlib
import os
import statistics
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from helpers.commands import vramlock, who_json
from helpers.gpu import GIB, REQUEST_TIMEOUT, call, end_in_turn, gpu, watched
from helpers.gpu_llama import PROMPT_A, PROMPT_B, REQUEST, TOLERANCE, binary, deviation
from helpers.net import accepts, free_ports
from helpers.processes import Spawn, wait_until

from vramlock.gpu import nvml

LLAMA, NEEDS_LLAMA = binary("VRAMLOCK_LLAMA_VULKAN", "Vulkan")

pytestmark = [
    gpu,
    NEEDS_LLAMA,
    pytest.mark.timeout(240),
]

# Requests to the server just released, after each server's first two.
SWITCHES = 20
# What a released server may hold on the GPU: its device, queues and pipelines.
RELEASED_KEEPS = GIB
READY_TIMEOUT = 180.0


@pytest.fixture(scope="session")
def big_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``VRAMLOCK_BIG_GGUF``, or a ~5 GiB random llama written once per session."""
    given = os.environ.get("VRAMLOCK_BIG_GGUF")
    if given:
        return Path(given)
    # numpy and gguf load only when a server will run; imported by name, as tools/ is
    # not a package.
    tiny_gguf = importlib.import_module("tiny_gguf")
    llama_server = importlib.import_module("llama_server")
    path = tmp_path_factory.mktemp("model") / "big-5gib.gguf"
    tiny_gguf.write(path, llama_server.vocab_path(), tiny_gguf.sized(5))
    return path


def server_argv(model: Path, port: int) -> list[str]:
    return [LLAMA, "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
            "-ngl", "99", "-c", "4096", "--parallel", "1", "--no-warmup"]  # fmt: skip


def healthy(port: int) -> None:
    """GET /health until 200: llama-server accepts connections while it loads the
    model, and answers 503 until it has."""
    end = time.monotonic() + READY_TIMEOUT
    while True:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=REQUEST_TIMEOUT)
        try:
            conn.request("GET", "/health")
            reply = conn.getresponse()
            text = reply.read()
        except ConnectionError:  # not listening yet (without vramlock in front)
            reply, text = None, b""
        finally:
            conn.close()
        if reply is not None and reply.status == 200:
            return
        assert time.monotonic() < end, (reply and reply.status, text)
        assert reply is None or reply.status == 503, (reply.status, text)
        time.sleep(0.05)


def ask(port: int, prompt: str) -> dict[str, Any]:
    return call(port, "POST", "/completion", {"prompt": prompt, **REQUEST})


@pytest.fixture(scope="module")
def bare(big_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Each prompt's first answer from the same server without vramlock."""
    port = free_ports(1)[0]
    log = tmp_path_factory.mktemp("bare") / "bare.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(server_argv(big_model, port), stdout=out, stderr=out, text=True)
    try:
        healthy(port)
        return {prompt: ask(port, prompt)["content"] for prompt in (PROMPT_A, PROMPT_B)}
    finally:
        proc.terminate()
        proc.wait(60)


def start(
    spawn: Spawn, arena: Path, tmp_path: Path, model: Path, name: str, release: str
) -> tuple[subprocess.Popen[str], int]:
    """``vramlock run --release RELEASE --demand listen -- llama-server``, its output in
    ``tmp_path/NAME.log``; its wrapper and listen port once that takes clients."""
    listen, upstream = free_ports(2)
    with open(tmp_path / f"{name}.log", "w") as log:
        wrapper = spawn(
            vramlock("run", "--arena", str(arena), "--name", name, "--release", release,
                     "--min-hold", "0", "--demand", "listen", "--listen", f"127.0.0.1:{listen}",
                     "--upstream", f"127.0.0.1:{upstream}", "--", *server_argv(model, upstream)),
            stdout=log,
            stderr=log,
        )  # fmt: skip
    wait_until(lambda: accepts(listen), timeout=30)
    return wrapper, listen


class Server:
    """One wrapped server: its port, its prompt, its answers before any switch."""

    def __init__(self, name: str, port: int, prompt: str) -> None:
        self.name, self.port, self.prompt = name, port, prompt
        self.pid = 0  # the llama-server's own, as ``who`` shows it
        self.cold: dict[str, Any] = {}  # the first answer: the prompt evaluated
        self.ref: dict[str, Any] = {}  # the same again at once, from the cached prefix


def used_now() -> int:
    """What the GPUs hold, all processes together (NVML's figure for each device)."""
    return sum(g.used for g in nvml.gpus())


def quiet_base(timeout: float = 15.0) -> int:
    """What the GPUs hold once no process is on them (past ``timeout``, with whatever
    stays): the servers of the test before, or the bare one, may still be leaving."""
    end = time.monotonic() + timeout
    while nvml.processes() and time.monotonic() < end:
        time.sleep(0.1)
    return used_now()


class DeviceUse(threading.Thread):
    """Every 20 ms, what the GPUs hold beyond what they held when it was made: a
    witness that does not rest on NVML's account of each process."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.base = quiet_base()
        self.peak = 0
        self.stop = threading.Event()

    def run(self) -> None:
        """Sample until stopped."""
        while not self.stop.is_set():
            self.peak = max(self.peak, used_now() - self.base)
            time.sleep(0.02)


@contextmanager
def device_use() -> Iterator[DeviceUse]:
    """A DeviceUse sampling while the body runs (or until told to stop)."""
    device = DeviceUse()
    device.start()
    try:
        yield device
    finally:
        device.stop.set()
        device.join(5)


class Asked:
    """Requests in turn, how long each took, and what NVML showed right after each: per
    process, and the devices' use beyond the base."""

    def __init__(self, device: DeviceUse) -> None:
        self.device = device
        self.held: list[tuple[Server, Server, dict[int, int], int]] = []
        self.took: list[float] = []  # requests to a released server

    def ask(self, me: Server, other: Server, switch: bool) -> dict[str, Any]:
        started = time.monotonic()
        got = ask(me.port, me.prompt)
        took = time.monotonic() - started
        seen = nvml.processes()  # right after the answer: this server alone is resident
        used = used_now() - self.device.base
        self.held.append((me, other, seen, used))
        if switch:
            self.took.append(took)
        t = got["timings"]
        mib = {pid: n >> 20 for pid, n in seen.items()}
        print(f"{me.name} (pid {me.pid}): {took:.3f} s, cache_n={t['cache_n']}"
              f" prompt_n={t['prompt_n']} content={got['content']!r} GPU MiB {mib},"
              f" {used >> 20} MiB in all")  # fmt: skip
        return got


def from_cache(got: dict[str, Any], cold: dict[str, Any]) -> None:
    """The prompt's prefix came from the slot's KV cache: only its last token or so was
    evaluated again (for its logits)."""
    t = got["timings"]
    assert 0 < t["prompt_n"] <= 4, t
    assert t["cache_n"] == cold["timings"]["prompt_n"] - t["prompt_n"], t


def first_answers(asked: Asked, me: Server, other: Server, bare: dict[str, str]) -> None:
    """The server's first answer (its prompt evaluated, as without vramlock), then the
    reference: the same again, resident still."""
    me.cold = asked.ask(me, other, switch=False)
    assert me.cold["timings"]["cache_n"] == 0
    assert me.cold["timings"]["prompt_n"] > 200
    assert me.cold["content"] == bare[me.prompt]
    me.ref = asked.ask(me, other, switch=False)
    from_cache(me.ref, me.cold)
    assert me.ref["content"] == me.cold["content"]


def child_pids(arena: Path, names: set[str], label: str | None = None) -> dict[str, int]:
    """The llama-servers' pids by member name (``names``, all of them); their strategy
    is ``label`` if given."""
    rows = {r["name"]: r for r in who_json(arena) if r["member"]}
    assert set(rows) == names, rows
    if label is not None:
        assert {r["strategy"] for r in rows.values()} == {label}, rows
    return {name: row["child_pid"] for name, row in rows.items()}


def one_resident_at_a_time(asked: Asked, model_bytes: int) -> int:
    """Right after each answer the server that answered held most of its model on the
    GPU and the other at most RELEASED_KEEPS; what a released server kept at most.

    The devices' use, all along, stayed under one server's (its model, half as much
    again for its KV cache and buffers) and a released one's: two resident servers
    hold two models at least. It is checked also where NVML gives no figure per
    process (the driver may give none for a graphics process): then it is the
    witness."""
    assert asked.device.peak < model_bytes * 3 // 2 + RELEASED_KEEPS, asked.device.peak
    per_process = any(seen.get(me.pid, 0) > 0 for me, _, seen, _ in asked.held)
    if not per_process:
        print("NVML gives no memory per process for the servers: the devices' use alone")
    kept = 0
    for me, other, seen, used in asked.held:
        assert used > model_bytes // 2, (me.name, used)
        if per_process:
            assert seen.get(me.pid, 0) > model_bytes // 2, (me.name, seen)
            assert seen.get(other.pid, 0) <= RELEASED_KEEPS, (other.name, seen)
            kept = max(kept, seen.get(other.pid, 0))
    return kept


@pytest.mark.parametrize("release", ["swap-vulkan", "auto"])
def test_vulkan_llama_servers_keep_weights_and_kv_cache_across_switches(
    release: str,
    arena: Path,
    spawn: Spawn,
    tmp_path: Path,
    big_model: Path,
    bare: dict[str, str],
) -> None:
    label = "auto:swap-vulkan" if release == "auto" else release
    (arena / "token.lock").touch()
    model_bytes = big_model.stat().st_size
    a, b = Server("la", 0, PROMPT_A), Server("lb", 0, PROMPT_B)
    with watched(arena, tmp_path, ("la", "lb")) as (tokens, sampler), device_use() as device:
        asked = Asked(device)
        run_a, a.port = start(spawn, arena, tmp_path, big_model, "la", release)
        healthy(a.port)  # loaded, resident
        a.pid = child_pids(arena, {"la"})["la"]
        first_answers(asked, a, b, bare)
        run_b, b.port = start(spawn, arena, tmp_path, big_model, "lb", release)
        healthy(b.port)  # a is released
        b.pid = child_pids(arena, {"la", "lb"})["lb"]
        first_answers(asked, b, a, bare)
        for k in range(SWITCHES):
            me, other = (a, b) if k % 2 == 0 else (b, a)
            got = asked.ask(me, other, switch=True)
            # Weights and KV cache went to host memory and came back intact (the cache
            # as the slot left it, in the same process).
            from_cache(got, me.cold)
            assert got["content"] == me.cold["content"]
            off = deviation(got, me.ref)
            assert off <= TOLERANCE, (me.name, k, off)
        # Never restarted, and swapped by the layer.
        assert child_pids(arena, {"la", "lb"}, label) == {"la": a.pid, "lb": b.pid}
        holders = list(tokens.holders)
        device.stop.set()  # not while they end: the released one is restored to end
        end_in_turn(run_b, run_a)
    kept = one_resident_at_a_time(asked, model_bytes)
    took = sorted(asked.took)
    print(f"{release}: {SWITCHES} requests to the released server, p50"
          f" {statistics.median(took):.3f} s, p95 {took[int(0.95 * len(took))]:.3f} s;"
          f" a released server kept at most {kept / 2**20:.0f} MiB; the devices held"
          f" {device.peak / 2**20:.0f} MiB more at most")  # fmt: skip
    # a loaded, b started (a out), then a and b in turn at every switch.
    assert holders == [run_a.pid, run_b.pid] * (1 + SWITCHES // 2), holders
    assert sampler.errors == []
    assert sampler.samples > 50
    assert sampler.overlaps(a.pid, b.pid, RELEASED_KEEPS) == []
