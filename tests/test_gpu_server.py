"""Two unmodified PyTorch servers share one GPU behind ``--demand listen`` with ``--release
checkpoint`` or ``swap``, and keep their weights and caches across every swap.

Each server (tests/gpu_server.py) keeps its weights and a per-prompt cache on the GPU,
and is wrapped as ``vramlock run --release checkpoint|swap --demand listen --listen L
--upstream U``; clients only talk to the listen ports. Skipped without a GPU (torch,
NVML and the driver's checkpoint API are all needed). The witnesses are independent of
vramlock's own account: the servers' answers (the same process, the cache entry kept
since the first request, checksums computed on the GPU now), NVML (sampled by the test
every 20 ms: never both servers holding their memory on the GPU; after each answer, only
the server that answered) and the kernel's lock table (who held token.lock, in turn). A
server released by ``checkpoint`` leaves the GPU altogether; one released by ``swap``
keeps its CUDA context there, not its 2 GiB of weights.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from helpers import ROOT
from helpers.commands import vramlock, who_json
from helpers.gpu import ALLOCATORS, GIB, SWAP_KEEPS, call, end_in_turn, env_with, gpu, watched
from helpers.net import accepts, free_ports
from helpers.processes import Spawn, wait_until

from vramlock.gpu import nvml

pytestmark = [gpu, pytest.mark.timeout(300)]

SERVER = str(ROOT / "tests" / "gpu_server.py")
ROUNDS = 3


def start(
    spawn: Spawn,
    arena: Path,
    tmp_path: Path,
    name: str,
    listen: int,
    upstream: int,
    release: str = "checkpoint",
    env: dict[str, str] | None = None,
) -> subprocess.Popen[str]:
    """``vramlock run --release RELEASE --demand listen -- gpu_server.py``, its output in
    ``tmp_path/NAME.log``; returns once its wrapper takes clients."""
    with open(tmp_path / f"{name}.log", "w") as log:
        wrapper = spawn(
            vramlock("run", "--arena", str(arena), "--name", name, "--release", release,
                     "--min-hold", "0", "--demand", "listen", "--listen", f"127.0.0.1:{listen}",
                     "--upstream", f"127.0.0.1:{upstream}", "--",
                     sys.executable, SERVER, "--port", str(upstream), "--gib", "2"),
            stdout=log,
            stderr=log,
            env=env,
        )  # fmt: skip
    # The wrapper binds its listen address before it queues for the token; a client
    # that connects while it waits is held until the server serves.
    wait_until(lambda: accepts(listen), timeout=30)
    return wrapper


def on_gpu(keep: int = -1) -> set[int]:
    """The processes NVML sees holding more than ``keep`` bytes on any GPU (by default:
    there at all; CUDA's device 0 need not be NVML's GPU 0)."""
    return {pid for pid, used in nvml.processes().items() if used > keep}


def take_turns(servers: list[tuple[int, int, int, str]], keep: int) -> dict[int, dict[str, Any]]:
    """Requests to each server in turn, ``ROUNDS`` times after the first: each answered
    from the same process, alone on the GPU, with the data it had: its first answers."""
    first: dict[int, dict[str, Any]] = {}
    for turn in range(1 + ROUNDS):
        for port, me, other, prompt in servers:
            started = time.monotonic()
            got = call(port, "POST", "/complete", {"prompt": prompt})
            took = time.monotonic() - started
            seen = on_gpu(keep)  # right after the answer: this server alone is resident
            print(f"turn {turn} pid {me}: answered in {took:.2f} s, cached={got['cached']}")
            assert me in seen and other not in seen, (me, other, seen)
            assert got["pid"] == me
            assert got["consistent"]  # the entry matches the weights as they are now
            if turn == 0:
                assert got["cached"] is False
                first[me] = got
            else:
                # Served from GPU memory kept since the first request, by the same
                # process: weights and cache went to host memory and came back intact.
                assert got == {**first[me], "cached": True}
    return first


@pytest.mark.parametrize(
    ("release", "allocator"),
    [("checkpoint", "caching"), ("swap", "caching"), ("swap", "expandable")],
    ids=["checkpoint", "swap", "swap-expandable"],
)
def test_two_servers_keep_weights_and_cache_across_swaps(
    release: str, allocator: str, arena: Path, spawn: Spawn, tmp_path: Path
) -> None:
    (arena / "token.lock").touch()
    keep = SWAP_KEEPS if release == "swap" else -1  # what a released server keeps
    listen_a, upstream_a, listen_b, upstream_b = free_ports(4)
    env = env_with(ALLOCATORS[allocator])
    with watched(arena, tmp_path, ("sa", "sb")) as (tokens, sampler):
        run_a = start(spawn, arena, tmp_path, "sa", listen_a, upstream_a, release, env)
        assert call(listen_a, "GET", "/health") == {"status": "ok"}  # loaded, resident
        run_b = start(spawn, arena, tmp_path, "sb", listen_b, upstream_b, release, env)
        assert call(listen_b, "GET", "/health") == {"status": "ok"}  # a is released

        rows = {r["name"]: r for r in who_json(arena) if r["member"]}
        assert set(rows) == {"sa", "sb"}, rows
        for row in rows.values():
            assert row["strategy"] == release
            assert row["listen"] is not None
        assert (rows["sa"]["state"], rows["sb"]["state"]) == ("released", "resident")
        a, b = rows["sa"]["child_pid"], rows["sb"]["child_pid"]  # the servers themselves
        wrappers = rows["sa"]["pid"], rows["sb"]["pid"]
        assert b in on_gpu(keep) and a not in on_gpu(keep)
        assert rows["sb"]["vram"] >= 2 * GIB

        servers = [(listen_a, a, b, "the first prompt"), (listen_b, b, a, "another prompt")]
        first = take_turns(servers, keep)

        stats = call(listen_b, "GET", "/stats")  # b is resident: no swap
        assert stats == {"pid": b, "entries": 1, "weights": first[b]["weights"]}
        rows = {r["name"]: r for r in who_json(arena) if r["member"]}
        assert (rows["sa"]["child_pid"], rows["sb"]["child_pid"]) == (a, b)  # never restarted
        assert all(r["strategy"] == release for r in rows.values())
        swaps = list(tokens.holders)
        end_in_turn(run_b, run_a)
    # a loaded, b started (a out), then a and b in turn for every round.
    assert swaps == list(wrappers) * (2 + ROUNDS)
    assert sampler.errors == []
    assert sampler.samples > 100
    assert sampler.overlaps(a, b, keep) == []
