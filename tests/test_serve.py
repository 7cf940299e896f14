"""``vramlock serve`` with three real CPU llama-servers (tiny models of different seeds).

The witness is /proc, sampled by a thread (``BothAlive`` of test_servers): with the
llama-server preset that ``--release auto`` picks, a released server has ended, so two
of them alive at once would be two models on the GPU at once. Skips without the
llama-server that tools/llama_server.py caches.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from helpers.commands import vramlock, who_json
from helpers.llama import BothAlive, llama_binary, needs_llama
from helpers.net import answers_health, free_port, free_ports
from helpers.processes import Spawn, wait_until, waiting_holder

from vramlock import procfs
from vramlock.serve.turns import GROUP_WAIT

pytest.importorskip("aiohttp")

BINARY = llama_binary()

pytestmark = [needs_llama(BINARY), pytest.mark.timeout(90)]

NAMES = ("a", "b", "c")


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """Three tiny models, one seed each: three different servers."""
    import llama_server
    import tiny_gguf

    out = tmp_path_factory.mktemp("models")
    paths = [out / f"tiny-{seed}.gguf" for seed in range(3)]
    for seed, path in enumerate(paths):
        tiny_gguf.write(path, llama_server.vocab_path(), seed=seed)
    return paths


def call(port: int, method: str, path: str, body: object = None) -> tuple[int, Any]:
    """One request on a fresh connection: (status, JSON body). A request may wait for two
    swaps on a loaded 2-core machine: a minute, not test_llama_preset's 10 s."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request(method, path, body=None if body is None else json.dumps(body))
        reply = conn.getresponse()
        return reply.status, json.loads(reply.read() or b"null")
    finally:
        conn.close()


@dataclass
class Served:
    proc: subprocess.Popen[str]
    port: int
    upstreams: list[int]  # the servers' own ports, in NAMES order
    arena: Path

    def call(self, method: str, path: str, body: object = None) -> tuple[int, Any]:
        return call(self.port, method, path, body)

    def complete(self, model: str, path: str = "/v1/completions") -> dict[str, Any]:
        body = {"model": model, "prompt": "Hi", "max_tokens": 3,
                "messages": [{"role": "user", "content": "Hi"}]}  # fmt: skip
        status, reply = self.call("POST", path, body)
        assert status == 200, reply
        return reply  # type: ignore[no-any-return]

    def states(self) -> dict[str, str]:
        status, listing = self.call("GET", "/v1/models")
        assert status == 200
        return {m["id"]: m["state"] for m in listing["data"]}


def servers_alive(upstreams: list[int]) -> list[int]:
    return BothAlive(upstreams).servers()


def serve_config(tmp_path: Path, models: list[Path], extra: str = "", **per_model: str) -> Path:
    """a, b, c on ports of their own (given by proxy), plus ``extra`` models."""
    lines = [
        "healthCheckTimeout: 30",
        "macros:",
        f'  srv: "{BINARY} --host 127.0.0.1 -np 1 -c 1024 -t 1"',
        "models:",
    ]
    for name, model, port in zip(NAMES, models, free_ports(3), strict=True):
        lines += [
            f"  {name}:",
            f"    cmd: ${{srv}} -m {model} --port {port}",
            f"    proxy: http://127.0.0.1:{port}",
            f"    aliases: [{name}-alias]",
            *(f"    {line}" for line in per_model.get(name, "").splitlines()),
        ]
    path = tmp_path / "serve.yaml"
    path.write_text("\n".join(lines) + "\n" + extra)
    return path


def upstream_ports(config: Path) -> list[int]:
    text = config.read_text()
    return [int(line.rsplit(":", 1)[1]) for line in text.splitlines() if "proxy: http" in line]


@pytest.fixture
def start(spawn: Spawn, arena: Path, tmp_path: Path) -> Iterator[Any]:
    """Starts serve on a config (its output in serve.log); returns once it answers."""
    logs = []

    def go(config: Path) -> Served:
        port = free_port()
        log = open(tmp_path / "serve.log", "w")  # noqa: SIM115 (closed with the test)
        logs.append(log)
        proc = spawn(vramlock("serve", str(config), "--listen", f"127.0.0.1:{port}"),
                     graceful=True, stdout=log, stderr=log,
                     env={**os.environ, "VRAMLOCK_ARENA": str(arena)})  # fmt: skip
        served = Served(proc, port, upstream_ports(config)[:3], arena)
        wait_until(lambda: answers_health(port), timeout=20)
        return served

    yield go
    for log in logs:
        log.close()


def test_three_models_many_clients_one_resident_at_a_time(
    start: Any, tmp_path: Path, models: list[Path], arena: Path
) -> None:
    config = serve_config(tmp_path, models, c="unlisted: true")
    served = start(config)
    witness = BothAlive(served.upstreams)
    witness.start()
    try:
        # every model, by name and by alias, through every OpenAI route the router knows
        assert served.complete("a")["model"].endswith("tiny-0.gguf")
        assert served.complete("b-alias")["model"].endswith("tiny-1.gguf")
        assert served.complete("c", "/v1/chat/completions")["model"].endswith("tiny-2.gguf")
        with ThreadPoolExecutor(12) as pool:
            replies = list(pool.map(lambda i: served.complete(NAMES[i % 3]), range(24)))
        assert [r["model"][-6:-5] for r in replies] == [str(i % 3) for i in range(24)]
    finally:
        witness.stop.set()
        witness.join(5)
    assert witness.samples > 50
    assert witness.overlaps == []
    # /v1/models lists the listed ones, each with its state; who shows all three
    assert sorted(served.states()) == ["a", "b"]
    # (a restored member's record says resident a few ms after it serves)
    wait_until(lambda: set(served.states().values()) <= {"resident", "released"})
    assert sorted(r["name"] for r in who_json(arena)) == ["a", "b", "c"]
    # starts and swaps of llama-servers warn of nothing: serve's lines are its own news
    said = [ln for ln in (tmp_path / "serve.log").read_text().splitlines()
            if ln.startswith("vramlock: ")]  # fmt: skip
    news = re.compile(r"vramlock: (serving a, b, c at .*|model [abc]: (starting its wrapper"
                      r'|[0-9.]+ "POST /v1/(chat/)?completions" 200 [0-9]+ "[^"]*"'
                      r" [0-9.]+ s))")  # fmt: skip
    assert [ln for ln in said if not news.fullmatch(ln)] == []


def test_a_model_starts_on_its_first_request_or_preloaded(
    start: Any, tmp_path: Path, models: list[Path], arena: Path
) -> None:
    preload = "hooks:\n  on_startup:\n    preload: [b-alias]\n"
    served = start(serve_config(tmp_path, models, extra=preload))
    wait_until(lambda: [r["name"] for r in who_json(arena)] == ["b"], timeout=30)
    assert served.complete("a")["model"].endswith("tiny-0.gguf")
    assert sorted(r["name"] for r in who_json(arena)) == ["a", "b"]
    # c was never asked for: no wrapper, no server
    assert servers_alive([served.upstreams[2]]) == []
    assert served.states()["c"] == "released"


def test_unknown_model_404_lists_the_known_ones(
    start: Any, tmp_path: Path, models: list[Path]
) -> None:
    served = start(serve_config(tmp_path, models))
    status, reply = served.call("POST", "/v1/completions", {"model": "nope", "prompt": "x"})
    assert status == 404
    assert reply["models"] == ["a", "b", "c", "a-alias", "b-alias", "c-alias"]
    status, reply = served.call("POST", "/v1/completions", {"prompt": "x"})
    assert status == 400
    # JSON nested deeper than Python's parser recurses: a 400 too, not a 500 and a traceback
    conn = http.client.HTTPConnection("127.0.0.1", served.port, timeout=60)
    try:
        conn.request("POST", "/v1/completions", body=b"[" * 100_000 + b"]" * 100_000)
        reply = conn.getresponse()
        assert (reply.status, json.loads(reply.read())["error"]["code"]) == (400, "bad_request")
    finally:
        conn.close()
    # a request aiohttp cannot parse: a 400, and one line on serve's output
    with socket.create_connection(("127.0.0.1", served.port), timeout=60) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n")
        assert sock.recv(100).startswith(b"HTTP/1.0 400 Bad Request")
    wait_until(
        lambda: "Invalid character in Content-Length" in (tmp_path / "serve.log").read_text()
    )
    assert "Traceback" not in (tmp_path / "serve.log").read_text()


def test_streaming_passes_through(start: Any, tmp_path: Path, models: list[Path]) -> None:
    served = start(serve_config(tmp_path, models))
    body = {"model": "b", "prompt": "Hi", "max_tokens": 8, "stream": True}
    with socket.create_connection(("127.0.0.1", served.port), timeout=30) as s:
        data = json.dumps(body).encode()
        head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
        s.sendall(head + b"Content-Length: %d\r\n\r\n%s" % (len(data), data))
        reply = b""
        while chunk := s.recv(65536):
            reply += chunk
    head, _, rest = reply.partition(b"\r\n\r\n")
    assert b"200 OK" in head and b"text/event-stream" in head
    events = [line for line in rest.split(b"\n") if line.startswith(b"data: ")]
    assert len(events) >= 8
    assert events[-1] == b"data: [DONE]"


def model_runs(served: Served) -> tuple[BothAlive, list[str]]:
    """A witness thread (not started) that records which model's server was alive, in
    order, repeats collapsed."""
    runs: list[str] = []
    witness = BothAlive(served.upstreams)
    port_of = {str(port): name for name, port in zip(NAMES, served.upstreams, strict=True)}

    def sample() -> None:
        while not witness.stop.is_set():
            alive = witness.servers()
            cmd = procfs.text(alive[0], "cmdline").split() if len(alive) == 1 else []
            if "--port" in cmd:  # (not if it ended since servers() saw it)
                name = port_of[cmd[cmd.index("--port") + 1]]
                if not runs or runs[-1] != name:
                    runs.append(name)
            time.sleep(0.003)

    witness.run = sample  # type: ignore[method-assign]
    return witness, runs


def test_burst_is_served_grouped_by_model(start: Any, tmp_path: Path, models: list[Path]) -> None:
    served = start(serve_config(tmp_path, models))
    witness, runs = model_runs(served)
    witness.start()
    try:
        with ThreadPoolExecutor(15) as pool:  # a b c a b c ...: 15 requests at once
            replies = list(pool.map(lambda i: served.complete(NAMES[i % 3]), range(15)))
    finally:
        witness.stop.set()
        witness.join(5)
    assert len(replies) == 15
    # after the model resident before the burst, one turn per model: at most three swaps
    # (the minimum is two), not one per request
    assert len(runs[1:]) == len(set(runs[1:])) <= 3, runs


def test_clients_that_never_pause_take_turns_in_groups(
    start: Any, tmp_path: Path, models: list[Path]
) -> None:
    """One client per model, each sending its next request as soon as the last is
    answered: every model is served (nobody starves), a group of requests per turn."""
    served = start(serve_config(tmp_path, models))
    witness, runs = model_runs(served)
    end = time.monotonic() + 8

    waits: list[float] = []  # each request's time, the wait for its turn included

    def client(name: str) -> int:
        done = 0
        while time.monotonic() < end:
            started = time.monotonic()
            served.complete(name)
            waits.append(time.monotonic() - started)
            done += 1
        return done

    witness.start()
    try:
        with ThreadPoolExecutor(3) as pool:
            done = list(pool.map(client, NAMES))
    finally:
        witness.stop.set()
        witness.join(5)
    assert min(done) >= 2, (done, runs)  # nobody starves: each model had a turn or more
    swaps = len(runs) - 1
    # turns of about GROUP_WAIT (its swap included), not one request each (~1,700 here)
    assert swaps <= 2 * 8 / GROUP_WAIT, runs
    assert max(waits) < 2 * GROUP_WAIT + 4, (waits, runs)


def test_client_gone_while_its_model_loads_stalls_nobody(
    start: Any, tmp_path: Path, models: list[Path], arena: Path
) -> None:
    served = start(serve_config(tmp_path, models))
    for name in NAMES:  # c resident; a released, and nothing else asks for it
        served.complete(name)
    released, resident = "a", "c"
    with socket.create_connection(("127.0.0.1", served.port), timeout=10) as s:
        data = json.dumps({"model": released, "prompt": "Hi", "max_tokens": 3}).encode()
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s"
                  % (len(data), data))  # fmt: skip
        # the request is in: its model's wrapper holds it, and the model comes back for it
        wait_until(lambda: any(r["name"] == released and r["state"] != "released"
                               for r in who_json(arena)))  # fmt: skip
    # the turn it held is given back: every model answers after it
    for name in (resident, released, *NAMES):
        served.complete(name)


def test_unload_and_ttl_release_a_resident_model(
    start: Any, tmp_path: Path, models: list[Path]
) -> None:
    served = start(serve_config(tmp_path, models, c="ttl: 1"))
    served.complete("a")
    a_port = served.upstreams[0]
    assert servers_alive([a_port])
    status, reply = served.call("POST", "/models/unload/a")
    assert (status, reply) == (200, {"model": "a", "released": True})
    wait_until(lambda: not servers_alive([a_port]))
    wait_until(lambda: served.states()["a"] == "released")
    assert served.call("POST", "/models/unload")[1] == {"released": []}  # nobody resident
    # ttl: 1: released a second after its last request, by itself
    served.complete("c")
    c_port = served.upstreams[2]
    assert servers_alive([c_port])
    wait_until(lambda: not servers_alive([c_port]), timeout=10)
    wait_until(lambda: served.states()["c"] == "released")
    # /running, /health, /upstream/MODEL/... raw
    assert served.call("GET", "/running") == (200, {"running": []})
    assert served.call("GET", "/upstream/b/health") == (200, {"status": "ok"})


def test_a_dead_server_is_started_again_on_the_next_request(
    start: Any, tmp_path: Path, models: list[Path]
) -> None:
    served = start(serve_config(tmp_path, models))
    served.complete("b")
    (pid,) = servers_alive([served.upstreams[1]])
    os.kill(pid, signal.SIGKILL)
    # Its wrapper ended: not only said so (its record says released a moment before it
    # exits, and a request in that moment would reach the ending wrapper), but gone.
    wait_until(lambda: served.states()["b"] == "released" and who_json(served.arena) == [])
    assert served.complete("b")["model"].endswith("tiny-1.gguf")
    assert served.complete("a")["model"].endswith("tiny-0.gguf")


def test_a_server_that_never_listens_fails_its_requests_only(
    start: Any, tmp_path: Path, models: list[Path]
) -> None:
    port = free_port()
    extra = (
        "  never:\n"
        f"    cmd: sleep 600 ${{PORT}}\n"
        f"    proxy: http://127.0.0.1:{port}\n"
        "    release: restart\n"
    )
    config = serve_config(tmp_path, models, extra=extra)
    config.write_text(config.read_text().replace("healthCheckTimeout: 30", "healthCheckTimeout: 1"))
    served = start(config)
    started = time.monotonic()
    status, reply = served.call("POST", "/v1/completions", {"model": "never", "prompt": "x"})
    assert status == 502, reply
    assert time.monotonic() - started < 10
    served.complete("a")


def test_sigkilled_serve_leaves_nothing_running_without_the_token(
    start: Any, spawn: Spawn, tmp_path: Path, models: list[Path], arena: Path
) -> None:
    served = start(serve_config(tmp_path, models))
    for name in NAMES:
        served.complete(name)
    wrappers = [r["pid"] for r in who_json(arena)]
    assert len(wrappers) == 3
    # vramlock wait takes turns with the models: a waiter gets the token, a releases
    holder = waiting_holder(spawn, arena)
    assert servers_alive(served.upstreams) == []
    os.kill(served.proc.pid, signal.SIGKILL)
    served.proc.wait(5)
    # a test-owned witness: while the flock member holds the token, no server runs
    end = time.monotonic() + 2
    while time.monotonic() < end:
        assert servers_alive(served.upstreams) == []
    assert holder.stdin is not None
    holder.stdin.close()
    holder.wait(5)
    # the wrappers end (SIGTERM from the kernel when serve died), servers with them
    wait_until(lambda: not any(procfs.living(p) for p in wrappers), timeout=20)
    assert servers_alive(served.upstreams) == []


def test_start_up_holds_clients_wait_takes_turns_sigterm_ends_all(
    start: Any, tmp_path: Path, models: list[Path], arena: Path
) -> None:
    served = start(serve_config(tmp_path, models))
    # at once, while the wrappers start and queue: held, then answered (no 502, no 503)
    with ThreadPoolExecutor(3) as pool:
        replies = list(pool.map(served.complete, NAMES))
    assert [r["model"][-6:-5] for r in replies] == ["0", "1", "2"]
    # vramlock wait takes its turn: the resident model releases, and stays released
    waited = subprocess.run(vramlock("wait", "--arena", str(arena), "-w", "30"), timeout=60)
    assert waited.returncode == 0
    assert servers_alive(served.upstreams) == []
    served.complete("b")
    wrappers = [r["pid"] for r in who_json(served.arena)]
    served.proc.send_signal(signal.SIGTERM)
    assert served.proc.wait(25) == 0
    assert not any(procfs.living(p) for p in wrappers)
    assert servers_alive(served.upstreams) == []


def test_models_that_fit_the_budget_stay_resident_together(
    start: Any, tmp_path: Path, models: list[Path], arena: Path
) -> None:
    subprocess.run(vramlock("arena", "--arena", str(arena), "--budget", "3G"),
                   check=True, capture_output=True, timeout=30)  # fmt: skip
    config = serve_config(tmp_path, models, a="vram: 1G", b="vram: 1G", c="vram: 1G")
    served = start(config)
    for name in NAMES:
        served.complete(name)
    wait_until(lambda: len(servers_alive(served.upstreams)) == 3, timeout=30)
    before = sorted(servers_alive(served.upstreams))
    for name in NAMES * 3:  # alternating requests: no swap, the three fit together
        served.complete(name)
    assert sorted(servers_alive(served.upstreams)) == before
    assert sorted(r["state"] for r in who_json(arena)) == ["resident"] * 3
