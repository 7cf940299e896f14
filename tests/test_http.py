"""``--release http``: each preset against a fake of its engine's API, end to end.

The fake (fake_engine.py) runs as the wrapped command and logs every request and every
change of its pretend GPU memory (``gpu 1``/``gpu 0``, written before the change can be
seen through the API). An independent witness takes the token with plain flock calls,
and notes which of the fake's processes were alive at that moment. The witness's turn
must fall where the log says the memory was free and no process of the server lived on
(llama-server): whatever vramlock believes about itself.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from helpers.commands import vramlock, who_json
from helpers.engines import Engine, MakeEngine, Turn, Witness, wrap
from helpers.net import accepts, free_port
from helpers.processes import Spawn, kill_group, wait_until

from vramlock.strategies import PRESETS, AutoStrategy, Settings
from vramlock.strategies.presets import ready_url

pytestmark = pytest.mark.timeout(90)


def resident_again(arena: Path, eng: Engine, gpu: int = 2) -> None:
    """The wrapper is resident again, the fake holding its GPU for the ``gpu``-th time."""
    wait_until(lambda: eng.count("gpu 1") >= gpu, timeout=20)
    wait_until(lambda: who_json(arena)[0]["state"] == "resident", timeout=20)


def end(job: subprocess.Popen[str]) -> str:
    """SIGTERM the wrapper (passed on to the server); its standard error."""
    os.kill(job.pid, signal.SIGTERM)
    _, err = job.communicate(timeout=30)
    return err


# -- recognition and addresses (no process) -----------------------------------------------


@pytest.mark.parametrize(
    ("argv", "picked"),
    [
        (["llama-server", "-m", "m.gguf"], "http:llama-server"),
        (["/opt/llama/bin/llama-server", "--sleep-idle-seconds", "-1"], "http:llama-server"),
        (["llama-server", "--sleep-idle-seconds", "60"], "none"),
        (["llama-server", "--models-dir", "models"], "none"),
        (["llama-server-wrapper.sh"], "none"),
        (["vllm", "serve", "m", "--enable-sleep-mode"], "http:vllm"),
        (["vllm", "serve", "m"], "none"),  # the preset cannot work: auto does not pick it
        (["vllm", "bench", "--enable-sleep-mode"], "none"),
        (["python3", "-m", "vllm.entrypoints.openai.api_server", "--enable-sleep-mode"],
         "http:vllm"),
        (["python3.11", "-u", "-m", "sglang.launch_server", "--enable-memory-saver"],
         "http:sglang"),
        (["python", "-m", "sglang.launch_server"], "none"),
        (["python", "-c", "pass", "-m", "sglang.launch_server", "--enable-memory-saver"],
         "none"),
        (["python", "main.py", "--listen"], "none"),  # ComfyUI says nothing: name the preset
        (["ollama", "serve"], "http:ollama"),
        (["ollama", "run", "m"], "none"),
    ],
)  # fmt: skip
def test_auto_recognises_only_what_is_unambiguous(argv: list[str], picked: str) -> None:
    assert AutoStrategy.first(argv).name == picked


@pytest.mark.parametrize(
    ("preset", "argv", "env", "upstream", "address"),
    [
        ("llama-server", ["llama-server"], {}, None, "127.0.0.1:8080"),
        ("llama-server", ["llama-server", "--host", "0.0.0.0,::1", "--port=9000",
                          "--api-prefix", "/v1/"], {}, None, "127.0.0.1:9000/v1"),
        ("llama-server", ["llama-server"], {"LLAMA_ARG_HOST": "::", "LLAMA_ARG_PORT": "7000"},
         None, "[::1]:7000"),
        ("llama-server", ["llama-server", "--api-prefix", "/p"], {}, "[::1]:7001",
         "[::1]:7001/p"),
        ("vllm", ["vllm", "serve", "m"], {}, None, "127.0.0.1:8000"),
        ("vllm", ["vllm", "serve", "m", "--port", "8001"], {}, "9001", "127.0.0.1:9001"),
        ("sglang", ["python", "-m", "sglang.launch_server"], {}, None, "127.0.0.1:30000"),
        ("comfyui", ["python", "main.py", "--listen"], {}, None, "127.0.0.1:8188"),
        ("comfyui", ["python", "main.py", "--listen", "10.1.2.3,::", "--port", "8200"], {},
         None, "10.1.2.3:8200"),
        ("ollama", ["ollama", "serve"], {}, None, "127.0.0.1:11434"),
        ("ollama", ["ollama", "serve"], {"OLLAMA_HOST": "0.0.0.0:5000"}, None, "127.0.0.1:5000"),
        ("ollama", ["ollama", "serve"], {"OLLAMA_HOST": "http://[::1]:5001"}, None,
         "[::1]:5001"),
    ],
)  # fmt: skip
def test_server_address(
    preset: str, argv: list[str], env: dict[str, str], upstream: str | None, address: str
) -> None:
    assert str(PRESETS[preset].locate(argv, env, Settings(upstream=upstream))) == address


# -- refusals: before anything starts -------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "args", "code", "message"),
    [
        (["--preset", "vllm"], ["serve", "m"], 125,
         "--preset vllm: vLLM needs --enable-sleep-mode on its command line"),
        (["--release", "http", "--preset", "sglang"], ["--port", "30001"], 125,
         "--preset sglang: SGLang needs --enable-memory-saver on its command line"),
        (["--preset", "llama-server"], ["--sleep-idle-seconds", "30"], 125,
         "--preset llama-server: llama-server's --sleep-idle-seconds cannot be used with it"),
        (["--preset", "llama-server"], ["--host", "/run/l.sock"], 125,
         "--preset llama-server: the server listens on a unix socket (/run/l.sock)"),
        (["--preset", "comfyui"], ["--port", "http"], 125, "comfyui --port: bad port 'http'"),
        (["--preset", "tgi"], [], 2, "unknown preset 'tgi' (choose from llama-server,"),
        (["--release", "http"], [], 2,
         "--release http needs --preset NAME or --on-release-url URL"),
        (["--release", "restart", "--preset", "vllm"], [], 2,
         "--preset, --on-release-url and --on-restore-url need --release http"),
        (["--preset", "ollama", "--on-release-url", "http://h/x"], [], 2,
         "--preset and --on-release-url/--on-restore-url do not mix"),
        (["--on-release", "true", "--preset", "ollama"], [], 2,
         "--on-release/--on-restore (exec) and --preset/--on-release-url/--on-restore-url"),
        (["--on-release-url", "https://h/x"], [], 2,
         "--on-release-url: bad URL 'https://h/x' (http://HOST[:PORT]/PATH)"),
        (["--on-release-url", "http://127.0.0.1:0/off"], [], 2,  # not port 80
         "--on-release-url: bad URL 'http://127.0.0.1:0/off' (http://HOST[:PORT]/PATH)"),
        (["--on-release-url", "http://h/x", "--on-restore-url", "http://h:0/"], [], 2,
         "--on-restore-url: bad URL 'http://h:0/'"),
    ],
)  # fmt: skip
def test_refusals_say_one_line_before_anything_starts(
    arena: Path, tmp_path: Path, options: list[str], args: list[str], code: int, message: str
) -> None:
    started = tmp_path / "started"
    script = tmp_path / "server"
    script.write_text(f"#!/bin/sh\ntouch {started}\n")
    script.chmod(0o755)
    done = subprocess.run(vramlock("run", "--arena", str(arena), *options, "--", str(script),
                                   *args), capture_output=True, text=True, timeout=30)  # fmt: skip
    assert done.returncode == code, done.stderr
    assert done.stderr.startswith(f"vramlock: {message}"), done.stderr
    assert done.stderr.count("\n") == 1
    assert not started.exists()


# -- each preset: the right calls, and the token only once the memory is free --------------


def test_vllm_hands_over_once_is_sleeping_says_so(
    arena: Path, spawn: Spawn, tmp_path: Path, engine: MakeEngine
) -> None:
    # The fake answers /sleep at once and falls asleep 0.5 s later: the worst case.
    eng = engine("vllm", "--enable-sleep-mode", free_delay="0.5")
    job = wrap(spawn, arena, eng, "--preset", "vllm")
    turn = Witness(tmp_path, arena, eng.log).turn()
    eng.assert_free_during(turn)
    assert turn.start - eng.when("req POST /sleep?level=1") >= 0.5
    resident_again(arena, eng)
    # Without VLLM_SERVER_DEV_MODE=1, which the preset sets, these would all be 404s.
    assert eng.requests() == ["POST /sleep?level=1", "GET /is_sleeping", "POST /wake_up"]
    assert who_json(arena)[0]["strategy"] == "http:vllm"
    assert end(job) == ""


def test_sglang_releases_and_resumes(
    arena: Path, spawn: Spawn, tmp_path: Path, engine: MakeEngine
) -> None:
    eng = engine("sglang", "--enable-memory-saver")
    job = wrap(spawn, arena, eng)  # auto: python -m sglang.launch_server
    assert who_json(arena)[0]["strategy"] == "auto:http:sglang"
    turn = Witness(tmp_path, arena, eng.log).turn()
    eng.assert_free_during(turn)
    resident_again(arena, eng)
    assert eng.requests() == ["POST /release_memory_occupation", "POST /resume_memory_occupation"]
    assert end(job) == ""


@pytest.mark.parametrize("keep", [0, 1 << 30], ids=["all", "a-node-keeps-1GiB"])
def test_comfyui_hands_over_once_the_memory_is_really_free(
    arena: Path, spawn: Spawn, tmp_path: Path, engine: MakeEngine, keep: int
) -> None:
    """A prompt runs first; /free answers at once; the worker unloads (ComfyUI's vram_free
    grows, the device's free memory does not), pauses 0.8 s, then empties the cache."""
    eng = engine("comfyui", busy="0.6", free_delay="0.8", keep=str(keep))
    job = wrap(spawn, arena, eng, "--preset", "comfyui")
    turn = Witness(tmp_path, arena, eng.log).turn()
    eng.assert_free_during(turn)
    assert eng.when("req POST /free") >= eng.events()[0][0] + 0.6  # once the prompt is done
    assert eng.requests()[:3] == ["GET /queue", "POST /free", "GET /system_stats"]
    wait_until(lambda: who_json(arena)[0]["state"] == "resident", timeout=20)
    assert end(job) == ""


def test_ollama_unloads_the_models_on_the_gpu(
    arena: Path, spawn: Spawn, tmp_path: Path, engine: MakeEngine
) -> None:
    eng = engine("ollama", models="big:5000,on-cpu:0,small:100", free_delay="0.4")
    job = wrap(spawn, arena, eng)  # auto: ollama serve
    assert who_json(arena)[0]["strategy"] == "auto:http:ollama"
    turn = Witness(tmp_path, arena, eng.log).turn()
    eng.assert_free_during(turn)
    assert eng.requests() == ["GET /api/ps", "POST /api/generate", "GET /api/ps"]
    assert eng.count("req POST /api/generate") == 2  # not the model on the CPU
    wait_until(lambda: who_json(arena)[0]["state"] == "resident", timeout=20)
    assert end(job) == ""


def test_llama_server_saves_slots_ends_the_group_and_restores(
    arena: Path, spawn: Spawn, tmp_path: Path, engine: MakeEngine
) -> None:
    eng = engine("llama-server", "-np", "2", "--api-key", "k1,k2", loading="0.3")
    job = wrap(spawn, arena, eng)  # auto: llama-server
    assert who_json(arena)[0]["strategy"] == "auto:http:llama-server"
    child = who_json(arena)[0]["child_pid"]
    argv = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")
    slots = Path(argv[argv.index(b"--slot-save-path") + 1].decode())
    assert slots.is_dir() and slots.stat().st_mode & 0o777 == 0o700
    auth = {"Authorization": "Bearer k1"}
    prompt = {"prompt": "one two three four"}
    request = urllib.request.Request(f"http://127.0.0.1:{eng.port}/completion",
                                     json.dumps(prompt).encode(), auth)  # fmt: skip
    urllib.request.urlopen(request, timeout=10).close()

    turn = Witness(tmp_path, arena, eng.log).turn()
    assert turn.alive == []  # the server's process was gone when the witness got the token
    eng.assert_free_during(turn)
    resident_again(arena, eng)
    assert eng.requests() == [
        "POST /completion",  # the prompt above
        "GET /props", "GET /slots", "POST /slots/0?action=save", "POST /slots/1?action=save",
        "GET /health", "POST /slots/0?action=restore",  # slot 1 was empty: not restored
    ]  # fmt: skip
    assert eng.count("start " + str(child)) == 1 and eng.count("exit") == 1
    with urllib.request.urlopen(request, timeout=10) as reply:
        assert json.loads(reply.read())["timings"]["cache_n"] == 4  # the restored slot
    assert list(slots.iterdir()) == []  # restored files are removed
    end(job)
    assert not slots.exists()  # the private directory goes with the run


def test_generic_urls(arena: Path, spawn: Spawn, tmp_path: Path, engine: MakeEngine) -> None:
    eng = engine("generic")
    base = f"http://127.0.0.1:{eng.port}"
    job = wrap(spawn, arena, eng, "--on-release-url", f"{base}/off", "--on-restore-url",
               f"{base}/on")  # fmt: skip
    assert who_json(arena)[0]["strategy"] == "http"
    turn = Witness(tmp_path, arena, eng.log).turn()
    eng.assert_free_during(turn)
    resident_again(arena, eng)
    assert eng.requests() == ["POST /off", "POST /on"]
    assert end(job) == ""


# -- behind --demand listen -----------------------------------------------------------------


def read_stream(port: int, path: str) -> tuple[int, str]:
    """The events a streamed response brought, and "complete" or how it ended."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        got = b""
        while not got.endswith(b"\r\n0\r\n\r\n"):
            data = s.recv(65536)
            if not data:
                return got.count(b"data:"), "closed"
            got += data
        return got.count(b"data:"), "complete"


def stream_while_waited_for(
    spawn: Spawn, arena: Path, tmp_path: Path, eng: Engine, events: int, *options: str
) -> tuple[tuple[int, str], Turn]:
    """Behind the proxy, under the generic URLs: a stream of ``events`` events 1 s
    apart, and a witness that queues once the first one has come."""
    base, port = f"http://127.0.0.1:{eng.port}", free_port()
    urls = ["--on-release-url", f"{base}/off", "--on-restore-url", f"{base}/on"]
    listen = ["--demand", "listen", "--listen", str(port), "--upstream", str(eng.port)]
    wrap(spawn, arena, eng, *urls, *listen, *options)
    wait_until(lambda: who_json(arena)[0].get("listen") is not None)
    got: list[tuple[int, str]] = []
    reader = threading.Thread(
        target=lambda: got.append(read_stream(port, f"/stream?n={events}&gap=1")), daemon=True
    )
    reader.start()
    wait_until(lambda: eng.count("chunk 0") == 1)
    turn = Witness(tmp_path, arena, eng.log, hold=0.5).turn()
    reader.join(30)
    return got[0], turn


def test_a_response_in_progress_keeps_the_server_resident(
    arena: Path, spawn: Spawn, tmp_path: Path, engine: MakeEngine
) -> None:
    eng = engine("generic")
    (events, how), turn = stream_while_waited_for(spawn, arena, tmp_path, eng, 3)
    assert (events, how) == (3, "complete")
    chunks = [t for t, e in eng.events() if e.startswith("chunk ")]
    assert turn.start > chunks[-1]  # the engine produced none while the witness held the GPU
    eng.assert_free_during(turn)


def test_yield_within_cuts_a_response_before_the_release(
    arena: Path, spawn: Spawn, tmp_path: Path, engine: MakeEngine
) -> None:
    eng = engine("generic")
    (events, how), turn = stream_while_waited_for(
        spawn, arena, tmp_path, eng, 20, "--yield-within", "0.5"
    )
    assert events < 20 and how == "closed"
    assert not [t for t, e in eng.events() if e.startswith("chunk ") and t > turn.start]
    eng.assert_free_during(turn)


def test_a_budget_waiter_asks_an_idle_server_before_one_answering(
    arena: Path, spawn: Spawn, tmp_path: Path, engine: MakeEngine
) -> None:
    """Two servers on a budget, one more member that fits only if one goes: the one
    answering a request is passed over for the idle one, although that one was used
    last and keeps a connection open (a connection is not work)."""
    from helpers.budget import Budgeted

    room = Budgeted(spawn, arena, tmp_path, "3G")  # 12 units: 4 for each server, 4 free
    engines, ports = {}, {}
    for name in ("answering", "idle"):
        eng, port = engine("generic"), free_port()
        base = f"http://127.0.0.1:{eng.port}"
        wrap(spawn, arena, eng, "--vram", "1G", "--name", name, "--on-release-url",
             f"{base}/off", "--on-restore-url", f"{base}/on", "--demand", "listen",
             "--listen", str(port), "--upstream", str(eng.port))  # fmt: skip
        engines[name], ports[name] = eng, port
    reader = threading.Thread(
        target=read_stream, args=(ports["answering"], "/stream?n=30&gap=1"), daemon=True
    )
    reader.start()
    wait_until(lambda: engines["answering"].count("chunk 0") == 1)
    kept = http.client.HTTPConnection("127.0.0.1", ports["idle"], timeout=30)
    try:
        kept.request("GET", "/health")
        assert kept.getresponse().read() is not None
        wait_until(lambda: {r["name"]: r.get("connections") for r in who_json(arena)}["idle"] == 1)
        waiter = room.member("waiter", 5)
        waiter.wait_for("resident", timeout=10)
        assert engines["idle"].count("req POST /off") == 1
        assert engines["answering"].count("req POST /off") == 0
        assert reader.is_alive()  # still answering: nothing cut it
    finally:
        kept.close()
    assert room.over() == []


def ask(port: int, method: str = "GET", path: str = "/health", body: object = None) -> int:
    """One request through the proxy on ``port``: the status it got."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        data = None if body is None else json.dumps(body).encode()
        conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        response.read()
        return response.status
    finally:
        conn.close()


def listening(
    spawn: Spawn, arena: Path, eng: Engine, *options: str
) -> tuple[subprocess.Popen[str], int]:
    """``vramlock run --demand listen`` around the fake, returned as soon as the proxy
    listens (the fake may still be loading); the wrapper and the listen port."""
    port = free_port()
    started = time.monotonic()
    job = spawn(
        vramlock("run", "--arena", str(arena), "--min-hold", "0", "--demand", "listen",
                 "--listen", str(port), "--upstream", str(eng.port), *options, "--", *eng.argv),
        env=dict(os.environ, **eng.env),
    )  # fmt: skip
    wait_until(lambda: accepts(port) or job.poll() is not None, step=0.01)
    assert job.poll() is None, job.communicate()
    assert time.monotonic() - started < 2.0  # listening at once, whatever the server does
    return job, port


@pytest.mark.parametrize(
    ("name", "options"),
    [
        ("llama-server", ["--release", "restart"]),  # its /health, known without a preset
        ("generic", ["--ready-url", "/health"]),  # loads again after each POST /on
        ("generic", ["--ready-url", "/health", "--release", "signal"]),  # ... and restore
    ],
)
def test_no_client_sees_a_loading_server(
    arena: Path, spawn: Spawn, tmp_path: Path, engine: MakeEngine, name: str, options: list[str]
) -> None:
    signal_strategy = "signal" in options
    eng = engine(name, loading="1.0", cooperative="1" if signal_strategy else "0")
    if name == "generic" and not signal_strategy:
        base = f"http://127.0.0.1:{eng.port}"
        options += ["--on-release-url", f"{base}/off", "--on-restore-url", f"{base}/on"]
    job, port = listening(spawn, arena, eng, *options)
    assert ask(port, "GET", "/stream") == 200  # held while it loads, then served
    assert eng.count("gpu 1") == 1
    turn = Witness(tmp_path, arena, eng.log, hold=0.1).turn()
    assert ask(port, "GET", "/stream") == 200  # restored (or started again) and loaded
    assert eng.count("gpu 1") == 2
    loading = [t for t, e in eng.events() if e.startswith("503 ")]
    # The server did answer 503 after each start, to the readiness probe only.
    assert any(t < turn.start for t in loading) and any(t > turn.end for t in loading)
    assert {e for _, e in eng.events() if e.startswith("503 ")} == {"503 /health"}
    assert end(job) == ""


def test_an_ending_signal_during_the_first_load_ends_the_wrapper(
    arena: Path, spawn: Spawn, engine: MakeEngine
) -> None:
    eng = engine("llama-server", loading="60")
    job, port = listening(spawn, arena, eng)
    outcome: list[object] = []

    def client() -> None:
        try:
            outcome.append(ask(port))
        except (http.client.HTTPException, OSError) as err:
            outcome.append(type(err))

    held = threading.Thread(target=client, daemon=True)
    held.start()  # held: the server loads
    wait_until(lambda: eng.count("503 /health") >= 1)
    signalled = time.monotonic()
    job.send_signal(signal.SIGTERM)
    job.communicate(timeout=30)
    assert time.monotonic() - signalled < 2.0
    held.join(10)
    # Its connection was closed, and never answered 503.
    assert outcome in ([http.client.RemoteDisconnected], [ConnectionResetError])


@pytest.mark.parametrize(
    ("command", "preset", "url"),
    [
        (["llama-server", "-m", "m.gguf"], None, "/health"),
        (["llama-server", "--api-prefix", "/v/"], None, "/v/health"),
        (["vllm", "serve", "m"], None, "/health"),  # under any strategy: no sleep mode needed
        (["python3", "-m", "sglang.launch_server"], None, "/health"),
        (["ollama", "serve"], None, "/"),
        (["python", "main.py"], "comfyui", "/system_stats"),
        (["python", "main.py"], None, None),
        (["my-server"], None, None),
    ],
)
def test_the_ready_url_of_each_engine(command: list[str], preset: str | None, url: str) -> None:
    assert ready_url(command, preset) == url


# -- failures ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "args", "faults", "message"),
    [
        ("vllm", ["--enable-sleep-mode"], {"/sleep": {"status": 500, "body": '{"detail": "boom"}'}},
         "vllm: POST /sleep?level=1 answered 500: boom"),
        ("vllm", ["--enable-sleep-mode"], {"/is_sleeping": {"status": 200, "body": "{oops"}},
         "vllm: GET /is_sleeping answered with malformed JSON"),
        ("comfyui", [], {"/system_stats": {"status": 503, "body": "<html>busy</html>"}},
         "comfyui: GET /system_stats answered 503: <html>busy</html>"),
        ("ollama", [], {"/api/ps": {"status": 200, "body": '{"models": [{"name": "m"}]}'}},
         "ollama: a model of GET /api/ps has no number 'size_vram'"),
        ("llama-server", [],
         {"/slots/0": {"status": 500, "body": '{"error": {"message": "disk full"}}'}},
         "llama-server: POST /slots/0?action=save answered 500: disk full"),
        ("generic", [], {"/off": {"status": 302, "body": ""}},
         "http: POST /off answered 302: (no message)"),
    ],
)  # fmt: skip
def test_a_failed_release_keeps_the_gpu_with_one_line(
    arena: Path, spawn: Spawn, engine: MakeEngine,
    name: str, args: list[str], faults: dict[str, object], message: str,
) -> None:  # fmt: skip
    eng = engine(name, *args, faults=json.dumps(faults))
    options = ["--on-release-url", f"http://127.0.0.1:{eng.port}/off"] if name == "generic" else [
        "--preset", name]  # fmt: skip
    job = wrap(spawn, arena, eng, *options)
    waiter = subprocess.run(vramlock("wait", "--arena", str(arena), "-w", "2.5"), timeout=30)
    assert waiter.returncode == 1  # kept: tried again after a second, and failed again
    assert eng.count(f"req {eng.requests()[0]}") >= 2
    assert job.poll() is None
    assert end(job).splitlines() == [f"vramlock: release failed: {message}; staying resident"]


def test_a_llama_server_still_loading_is_released_by_ending_it(
    arena: Path, spawn: Spawn, engine: MakeEngine
) -> None:
    eng = engine("llama-server", loading="60")  # every request answers 503: loading
    job = spawn(vramlock("run", "--arena", str(arena), "--min-hold", "0", "--", *eng.argv),
                env=dict(os.environ, **eng.env))  # auto: llama-server  # fmt: skip

    def started() -> bool:
        return any(e.startswith("start ") for _, e in eng.events())

    wait_until(lambda: started() and who_json(arena)[0]["state"] == "resident")
    waiter = subprocess.run(vramlock("wait", "--arena", str(arena), "-w", "10"), timeout=30)
    assert waiter.returncode == 0  # no cache to save yet: ended, not kept
    # Once the waiter has dropped the token the wrapper may already be back: started again,
    # asking /health until it loads. Nothing else, and one /props only: no slot was saved.
    first, *after = eng.requests()
    assert first == "GET /props" and set(after) <= {"GET /health"}
    assert eng.count("503 /props") == 1 and eng.count("exit") == 1
    assert "release failed" not in end(job)


def test_a_refused_connection_keeps_the_gpu(arena: Path, spawn: Spawn, engine: MakeEngine) -> None:
    eng = engine("generic")
    closed = free_port()
    job = wrap(spawn, arena, eng, "--on-release-url", f"http://127.0.0.1:{closed}/off")
    waiter = subprocess.run(vramlock("wait", "--arena", str(arena), "-w", "1.5"), timeout=30)
    assert waiter.returncode == 1
    assert end(job).splitlines() == [
        f"vramlock: release failed: http: POST /off: connection refused (at 127.0.0.1:{closed});"
        " staying resident"
    ]


def test_a_slow_release_is_ended_at_yield_within(
    arena: Path, spawn: Spawn, tmp_path: Path, engine: MakeEngine
) -> None:
    eng = engine("sglang", "--enable-memory-saver",
                 faults=json.dumps({"/release_memory_occupation": {"delay": 20}}))  # fmt: skip
    job = wrap(spawn, arena, eng, "--yield-within", "0.5")
    turn = Witness(tmp_path, arena, eng.log).turn()
    assert turn.alive == []  # ended: the token went over only once it was gone
    assert 0.5 <= turn.start - turn.asked < 5.0
    wait_until(lambda: eng.count("gpu 1") == 2, timeout=20)  # started again on its turn
    err = end(job)
    assert "http:sglang release did not finish within 0.5 s; ending the command" in err


def test_yield_within_is_a_deadline_for_a_server_that_trickles(
    arena: Path, spawn: Spawn, tmp_path: Path, engine: MakeEngine
) -> None:
    # An answer a byte every 0.3 s, 40 bytes: each read is quick, the whole is 12 s.
    trickle = {"status": 200, "body": "{" + " " * 38 + "}", "trickle": 0.3}
    eng = engine("sglang", "--enable-memory-saver",
                 faults=json.dumps({"/release_memory_occupation": trickle}))  # fmt: skip
    job = wrap(spawn, arena, eng, "--yield-within", "1")
    turn = Witness(tmp_path, arena, eng.log).turn()
    assert turn.alive == []  # ended at the deadline
    assert 1.0 <= turn.start - turn.asked < 5.0
    assert "http:sglang release did not finish within 1.0 s; ending the command" in end(job)


def test_vllm_is_woken_when_its_release_fails_after_it_fell_asleep(
    arena: Path, spawn: Spawn, engine: MakeEngine
) -> None:
    faults = {"/is_sleeping": {"status": 500, "body": '{"detail": "boom"}'}}
    eng = engine("vllm", "--enable-sleep-mode", faults=json.dumps(faults), free_delay="0")
    job = wrap(spawn, arena, eng)
    waiter = subprocess.run(vramlock("wait", "--arena", str(arena), "-w", "0.5"), timeout=30)
    assert waiter.returncode == 1  # it stayed resident...
    wait_until(lambda: eng.count("req POST /wake_up") >= 1)
    assert job.poll() is None
    gpu = [e for _, e in eng.events() if e.startswith("gpu ")]
    assert gpu[:3] == ["gpu 1", "gpu 0", "gpu 1"]  # ... and awake: slept, then woken
    err = end(job)
    assert "vramlock: release failed: vllm: GET /is_sleeping answered 500: boom" in err


def test_vllm_that_can_be_neither_asleep_nor_woken_is_ended(
    arena: Path, spawn: Spawn, tmp_path: Path, engine: MakeEngine
) -> None:
    faults = {"/is_sleeping": {"status": 500}, "/wake_up": {"status": 500}}
    eng = engine("vllm", "--enable-sleep-mode", faults=json.dumps(faults))
    job = wrap(spawn, arena, eng)
    turn = Witness(tmp_path, arena, eng.log).turn()
    assert turn.alive == []  # released the other way: ended (started again on its turn)
    assert eng.requests()[:3] == ["POST /sleep?level=1", "GET /is_sleeping", "POST /wake_up"]
    assert "vllm release did not finish" in end(job)


def test_an_ending_signal_ends_a_restore_that_hangs(
    arena: Path, spawn: Spawn, tmp_path: Path, engine: MakeEngine
) -> None:
    eng = engine("generic")
    with socket.create_server(("127.0.0.1", 0)) as hung:  # accepts, never answers
        hung.settimeout(30)
        restore = f"http://127.0.0.1:{hung.getsockname()[1]}/on"
        job = wrap(spawn, arena, eng, "--on-release-url", f"http://127.0.0.1:{eng.port}/off",
                   "--on-restore-url", restore)  # fmt: skip
        Witness(tmp_path, arena, eng.log, hold=0.1).turn()
        conn, _ = hung.accept()  # the restore's request is on its way
        with conn:
            signalled = time.monotonic()
            job.send_signal(signal.SIGTERM)
            job.communicate(timeout=30)
            assert time.monotonic() - signalled < 2.0


def test_a_server_that_dies_mid_release_ends_the_run(
    arena: Path, spawn: Spawn, tmp_path: Path, engine: MakeEngine
) -> None:
    eng = engine("vllm", "--enable-sleep-mode", faults=json.dumps({"/sleep": {"die": True}}))
    job = wrap(spawn, arena, eng, "--preset", "vllm")
    turn = Witness(tmp_path, arena, eng.log).turn()
    assert turn.alive == []
    _, err = job.communicate(timeout=30)
    assert job.returncode == 3  # the server's own status
    assert err == ""
    kill_group(job)


@pytest.mark.parametrize("ending", ["SIGTERM", "exit"])
def test_the_private_slot_directory_goes_with_the_run(
    arena: Path, spawn: Spawn, tmp_path: Path, engine: MakeEngine, ending: str
) -> None:
    """The llama-server preset adds a --slot-save-path of its own, in TMPDIR; it is gone
    when the run ends, by a signal or by its command's exit."""
    eng = engine("llama-server")
    scratch = tmp_path / "scratch"
    scratch.mkdir(mode=0o700)
    eng.env["TMPDIR"] = str(scratch)
    job = wrap(spawn, arena, eng, "--release", "http", "--preset", "llama-server")
    assert len(list(scratch.glob("vramlock-slots-*"))) == 1
    if ending == "exit":
        os.kill(who_json(arena)[0]["child_pid"], signal.SIGTERM)
    else:
        os.kill(job.pid, getattr(signal, ending))
    job.communicate(timeout=30)
    assert list(scratch.glob("vramlock-slots-*")) == []
