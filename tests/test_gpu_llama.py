"""Two unmodified CUDA llama-servers share one GPU behind ``--demand listen`` with
``--release checkpoint``, ``swap`` or ``auto`` (which swaps them), and keep their weights
and KV caches across every swap.

Each llama-server (all layers on the GPU, one slot) is wrapped as ``vramlock run
--release checkpoint|swap|auto --demand listen --listen L --upstream U``; clients only talk to
the listen ports. Nothing in llama.cpp knows: the driver's checkpoint, or the swap
library in front of the server, moves the server's GPU memory (weights, KV cache,
llama.cpp's own pool) to host memory and back. Skipped without a GPU
(see tests/test_gpu.py) or without ``VRAMLOCK_LLAMA_CUDA``, the path of a llama-server
built with CUDA; the model is ``VRAMLOCK_TINY_GGUF`` or tools/tiny_gguf.py's.

The witnesses are independent of vramlock's own account: llama-server's answers (the
same text and the same token log-probabilities as before the first swap, with the
prompt's prefix taken from the KV cache its slot kept: ``timings.cache_n``), NVML
(sampled every 20 ms: never both servers holding their memory on the GPU; after each
answer, only the server that answered) and the kernel's lock table (who held token.lock,
in turn). A server released by ``swap`` keeps its CUDA context on the GPU: what it holds
then is measured (once both have run every kernel they use; loading kernels grows a
context), and the resident one must hold clearly more.
"""

from __future__ import annotations

import http.client
import importlib
import os
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from helpers.commands import vramlock, who_json
from helpers.gpu import GIB, REQUEST_TIMEOUT, call, end_in_turn, gpu, watched
from helpers.gpu_llama import PROMPT_A, PROMPT_B, REQUEST, TOLERANCE, binary, deviation
from helpers.net import accepts, free_ports
from helpers.processes import Spawn, wait_until

from vramlock.gpu import nvml

LLAMA, NEEDS_LLAMA = binary("VRAMLOCK_LLAMA_CUDA", "CUDA")

pytestmark = [
    gpu,
    NEEDS_LLAMA,
    pytest.mark.timeout(300),
]

ROUNDS = 3
READY_TIMEOUT = 120.0
# How much more than a released server (under swap) a resident one must hold, at least:
# the tiny model's weights, KV cache and compute buffers come to more.
RESIDENT_MORE = 32 << 20


@pytest.fixture(scope="module")
def model() -> Path:
    given = os.environ.get("VRAMLOCK_TINY_GGUF")
    if given:
        return Path(given)
    # numpy and gguf load only when a server will run; imported by name, as tools/ is
    # not a package (mypy checks it along with the tests, or not at all).
    tiny_gguf = importlib.import_module("tiny_gguf")
    path: Path = tiny_gguf.cached_model()
    return path


def start(
    spawn: Spawn,
    arena: Path,
    tmp_path: Path,
    model: Path,
    name: str,
    listen: int,
    upstream: int,
    release: str,
) -> subprocess.Popen[str]:
    """``vramlock run --release RELEASE --demand listen -- llama-server``, its output in
    ``tmp_path/NAME.log``; returns once its wrapper takes clients."""
    server = [LLAMA, "-m", str(model), "--host", "127.0.0.1", "--port", str(upstream),
              "-ngl", "99", "-c", "4096", "--parallel", "1", "--no-warmup"]  # fmt: skip
    with open(tmp_path / f"{name}.log", "w") as log:
        wrapper = spawn(
            vramlock("run", "--arena", str(arena), "--name", name, "--release", release,
                     "--min-hold", "0", "--demand", "listen", "--listen", f"127.0.0.1:{listen}",
                     "--upstream", f"127.0.0.1:{upstream}", "--", *server),
            stdout=log,
            stderr=log,
        )  # fmt: skip
    # The wrapper binds its listen address before it queues for the token; a client
    # that connects while it waits is held until the server accepts.
    wait_until(lambda: accepts(listen), timeout=30)
    return wrapper


def healthy(port: int) -> None:
    """GET /health through the listen port until 200: llama-server accepts connections
    while it loads the model, and answers 503 until it has."""
    end = time.monotonic() + READY_TIMEOUT
    while True:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=REQUEST_TIMEOUT)
        try:
            conn.request("GET", "/health")
            reply = conn.getresponse()
            text = reply.read()
        finally:
            conn.close()
        if reply.status == 200:
            return
        assert reply.status == 503 and time.monotonic() < end, (reply.status, text)
        time.sleep(0.05)


def as_started(arena: Path, label: str, before: str, how: str) -> tuple[int, int, tuple[int, int]]:
    """Once b started: a released, b resident under their strategies, as ``who`` and NVML
    see them; the servers' pids and their wrappers'."""
    rows = {r["name"]: r for r in who_json(arena) if r["member"]}
    assert set(rows) == {"la", "lb"}, rows
    assert (rows["la"]["strategy"], rows["lb"]["strategy"]) == (label, before)
    for row in rows.values():
        assert row["listen"] is not None
    assert (rows["la"]["state"], rows["lb"]["state"]) == ("released", "resident")
    a, b = rows["la"]["child_pid"], rows["lb"]["child_pid"]  # the llama-servers themselves
    seen = nvml.processes()
    assert b in seen and (how == "swap" or a not in seen), (a, b, seen)
    assert rows["lb"]["vram"] > 0
    print(f"llama-server b holds {rows['lb']['vram'] / GIB:.2f} GiB")
    return a, b, (rows["la"]["pid"], rows["lb"]["pid"])


class Asked:
    """Requests to the servers in turn, and what NVML showed right after each."""

    def __init__(self) -> None:
        # (turn, the server that answered, the other, what NVML showed right after)
        self.held: list[tuple[int, int, int, dict[int, int]]] = []

    def ask(self, turn: int, port: int, me: int, other: int, prompt: str) -> dict[str, Any]:
        started = time.monotonic()
        got = call(port, "POST", "/completion", {"prompt": prompt, **REQUEST})
        took = time.monotonic() - started
        seen = nvml.processes()  # right after the answer: this server alone is resident
        self.held.append((turn, me, other, seen))
        t = got["timings"]
        mib = {pid: used >> 20 for pid, used in seen.items()}
        print(f"turn {turn} pid {me}: answered in {took:.3f} s, cache_n={t['cache_n']}"
              f" prompt_n={t['prompt_n']} prompt_ms={t['prompt_ms']:.1f}"
              f" content={got['content']!r} GPU MiB {mib}")  # fmt: skip
        return got


def from_cache(got: dict[str, Any], prompt_n: int) -> None:
    """The prompt's prefix came from the slot's KV cache: only its last token or so was
    evaluated again (for its logits)."""
    t = got["timings"]
    assert 0 < t["prompt_n"] <= 4, t
    assert t["cache_n"] == prompt_n - t["prompt_n"], t


def one_resident_at_a_time(held: list[tuple[int, int, int, dict[int, int]]], how: str) -> int:
    """Right after each answer the server that answered held its memory and the other
    did not: what a released server keeps is nothing (checkpoint), its context (swap),
    which is returned."""
    keep = -1
    if how == "swap":
        keep = max(seen.get(other, 0) for turn, _, other, seen in held if turn > 0)
    for _, me, other, seen in held:
        assert seen.get(me, -1) > keep + (RESIDENT_MORE if how == "swap" else 0), seen
        assert seen.get(other, -1) <= keep, seen
    return keep


@pytest.mark.parametrize("release", ["checkpoint", "swap", "auto"])
def test_cuda_llama_servers_keep_weights_and_kv_cache_across_swaps(
    release: str, arena: Path, spawn: Spawn, tmp_path: Path, model: Path
) -> None:
    # auto (the README's recipe) swaps them: the llama-server preset it recognised until
    # a server is released for the first time, swap from then on.
    how = "swap" if release == "auto" else release
    label = "auto:swap" if release == "auto" else release
    before = "auto:http:llama-server" if release == "auto" else release
    (arena / "token.lock").touch()
    listen_a, upstream_a, listen_b, upstream_b = free_ports(4)
    with watched(arena, tmp_path, ("la", "lb")) as (tokens, sampler):
        run_a = start(spawn, arena, tmp_path, model, "la", listen_a, upstream_a, release)
        healthy(listen_a)  # loaded, resident
        run_b = start(spawn, arena, tmp_path, model, "lb", listen_b, upstream_b, release)
        healthy(listen_b)  # a is released

        a, b, wrappers = as_started(arena, label, before, how)
        asked = Asked()
        servers = [(listen_a, a, b, PROMPT_A), (listen_b, b, a, PROMPT_B)]
        cold: dict[int, dict[str, Any]] = {}  # the first answer: the prompt evaluated
        ref: dict[int, dict[str, Any]] = {}  # the same again at once, before any swap
        for turn in range(1 + ROUNDS):
            for port, me, other, prompt in servers:
                got = asked.ask(turn, port, me, other, prompt)
                if turn == 0:
                    assert got["timings"]["cache_n"] == 0
                    assert got["timings"]["prompt_n"] > 200
                    cold[me] = got
                    # Resident still (no one else asked): the reference for later turns,
                    # computed the way they are, from the cached prefix.
                    ref[me] = got = asked.ask(turn, port, me, other, prompt)
                # Weights and KV cache went to host memory and came back intact (the
                # cache as the slot left it, in the same process): the same text, and the
                # same token probabilities as the same computation before any swap.
                from_cache(got, cold[me]["timings"]["prompt_n"])
                assert got["content"] == cold[me]["content"]
                off = deviation(got, ref[me])
                print(f"  largest log-probability difference from the reference: {off:g}")
                assert off <= TOLERANCE

        rows = {r["name"]: r for r in who_json(arena) if r["member"]}
        assert (rows["la"]["child_pid"], rows["lb"]["child_pid"]) == (a, b)  # never restarted
        assert all(r["strategy"] == label for r in rows.values())
        swaps = list(tokens.holders)
        end_in_turn(run_b, run_a)
    keep = one_resident_at_a_time(asked.held, how)
    # a loaded, b started (a out), then a and b in turn for every round.
    assert swaps == list(wrappers) * (2 + ROUNDS)
    assert sampler.errors == []
    assert sampler.samples > 50  # a second of sampling at least: CUDA's start alone takes more
    assert sampler.overlaps(a, b, keep) == []
