"""Two real llama-servers share one arena behind ``--demand listen``: the README recipe.

Each server is wrapped as ``vramlock run --demand listen --listen L --upstream U --release
http --preset llama-server`` (and with ``--release restart``). Clients only talk to the
listen ports. The witness is /proc: a thread samples, every few milliseconds, which of the
two llama-server processes are alive (with that preset a released server has ended), and
the test fails if it ever sees both. Skips without the llama-server tools/llama_server.py
caches.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from helpers.commands import vramlock
from helpers.llama import PROMPT, BothAlive, call, llama_binary, needs_llama
from helpers.net import accepts, free_ports
from helpers.processes import Spawn, wait_until

BINARY = llama_binary()

pytestmark = [needs_llama(BINARY), pytest.mark.timeout(180)]


def start_pair(
    spawn: Spawn, arena: Path, model: Path, tmp_path: Path, release: list[str]
) -> tuple[list[int], list[int]]:
    """Two wrapped servers; their listen ports and their servers' own ports."""
    listen, upstreams = [], []
    for name in ("a", "b"):
        port, upstream = free_ports(2)
        server = [str(BINARY), "-m", str(model), "--host", "127.0.0.1", "--port", str(upstream),
                  "-np", "1", "-c", "1024", "-t", "1"]  # fmt: skip
        with open(tmp_path / f"{name}.log", "w") as log:
            spawn(
                vramlock("run", "--arena", str(arena), "--name", name, "--demand", "listen",
                         "--listen", str(port), "--upstream", str(upstream), "--min-hold", "0",
                         "--idle", "100ms", *release, "--", *server),
                stdout=log,
                stderr=log,
                graceful=True,  # SIGKILLed, a wrapper would leave its slot directory
            )  # fmt: skip
        listen.append(port)
        upstreams.append(upstream)
    for port in listen:  # the wrapper binds its listen address before it queues
        wait_until(lambda p=port: accepts(p), timeout=30)  # type: ignore[misc]
    return listen, upstreams


def complete(port: int, prompt: str = PROMPT) -> dict[str, Any]:
    """One completion: 200 at once, also from a server that was just started (the proxy
    forwards once its /health says it serves, under every strategy)."""
    status, reply = call(port, "POST", "/completion", {"prompt": prompt, "n_predict": 4})
    assert status == 200, reply
    timings: dict[str, Any] = reply["timings"]
    return timings


@pytest.mark.parametrize(
    "release",
    [["--release", "http", "--preset", "llama-server"], ["--release", "restart"]],
    ids=["preset", "restart"],
)
def test_two_servers_answer_every_request_and_are_never_both_resident(
    arena: Path, spawn: Spawn, model: Path, tmp_path: Path, release: list[str]
) -> None:
    ports, upstreams = start_pair(spawn, arena, model, tmp_path, release)
    witness = BothAlive(upstreams)
    witness.start()
    try:
        first = complete(ports[0])
        complete(ports[1])
        for _ in range(3):  # alternating
            for port in ports:
                complete(port)
        with ThreadPoolExecutor(6) as pool:  # concurrent clients on both
            replies = list(pool.map(lambda i: complete(ports[i % 2]), range(12)))
        assert len(replies) == 12
        again = complete(ports[0])
        assert first["cache_n"] == 0
        if "http" in release:
            # the repeated prompt after swaps is served from the restored slot
            assert again["cache_n"] > 0
        else:
            assert again["cache_n"] == 0  # restart loses the cache
    finally:
        witness.stop.set()
        witness.join(5)
    assert witness.samples > 50
    assert witness.overlaps == []


def test_a_request_to_a_released_server_waits_and_is_answered(
    arena: Path, spawn: Spawn, model: Path, tmp_path: Path
) -> None:
    preset = ["--release", "http", "--preset", "llama-server"]
    ports, _ = start_pair(spawn, arena, model, tmp_path, preset)
    complete(ports[0])
    complete(ports[1])  # a is released now
    wait_until(lambda: call(ports[1], "GET", "/health")[0] == 200)
    started = time.monotonic()
    timings = complete(ports[0])
    assert time.monotonic() - started < 30
    assert timings["cache_n"] > 0
