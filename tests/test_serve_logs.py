"""``vramlock serve``'s logs as llama-swap keeps them: /logs, /logs/stream[/ID], logToStdout.

The models are tests/echo_server.py: it says ``NAME listening`` on stdout and each
request it gets on stderr, which the wrappers pass to serve through pipes.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.processes import Spawn, wait_until
from helpers.serve import call, call_json, echo_model, start, write_config

pytest.importorskip("aiohttp")

pytestmark = pytest.mark.timeout(90)


def logs(port: int) -> str:
    status, headers, body = call(port, "GET", "/logs")
    assert status == 200 and headers["Content-Type"].startswith("text/plain")
    return body.decode()


class Follow:
    """A client of /logs/stream...: what it has read so far."""

    def __init__(self, port: int, path: str) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=30)
        self.sock.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        self.got = b""

    def until(self, text: str, within: float = 30) -> str:
        end = time.monotonic() + within
        while text.encode() not in self.got:
            assert time.monotonic() < end, self.got
            data = self.sock.recv(65536)
            assert data, self.got
            self.got += data
        return self.got.decode()

    def close(self) -> None:
        self.sock.close()


def test_logs_hold_serve_s_lines_and_the_model_s_output(
    spawn: Spawn, tmp_path: Path, arena: Path
) -> None:
    path = write_config(tmp_path, "models:\n" + echo_model("m", "release: restart"))
    proc, port = start(spawn, path, arena)
    call_json(port, "POST", "/v1/completions", {"model": "m"})
    upstream = Follow(port, "/logs/stream/upstream")
    try:
        assert "m listening" in upstream.until("m got POST /v1/completions")
    finally:
        upstream.close()
    text = logs(port)  # what reaches serve's output: its own lines (logToStdout: proxy)
    assert "[INFO] serving m at http://127.0.0.1:" in text
    assert "m listening" not in text
    # on serve's own output, its own lines only (logToStdout's default: proxy)
    proc.terminate()
    out, err = proc.communicate(timeout=30)
    assert "m listening" not in out
    assert "m got POST /v1/completions" not in err and "vramlock: serving m" in err


def test_a_stream_sends_the_history_then_each_line_as_it_comes(
    spawn: Spawn, tmp_path: Path, arena: Path
) -> None:
    path = write_config(tmp_path, "models:\n" + echo_model("m", "release: restart", "aliases: [mm]")
                 + echo_model("other", "release: restart"))  # fmt: skip
    _, port = start(spawn, path, arena)
    call_json(port, "POST", "/v1/completions", {"model": "m"})
    by_alias = Follow(port, "/logs/stream/mm")
    upstream = Follow(port, "/logs/stream/upstream")
    fresh = Follow(port, "/logs/stream/m?no-history")
    try:
        head = by_alias.until("m got POST /v1/completions")
        assert "Transfer-Encoding: chunked" in head and "text/plain" in head
        assert "m listening" in head
        upstream.until("m got POST /v1/completions")
        fresh.until("\r\n\r\n")
        call_json(port, "POST", "/v1/embeddings", {"model": "m"})
        call_json(port, "POST", "/v1/embeddings", {"model": "other"})
        by_alias.until("m got POST /v1/embeddings")
        upstream.until("other got POST /v1/embeddings")
        assert "m got POST /v1/embeddings" in fresh.until("m got POST /v1/embeddings")
        assert "m listening" not in fresh.got.decode()
        assert "other" not in by_alias.got.decode()
    finally:
        for f in (by_alias, upstream, fresh):
            f.close()


def test_an_unknown_log_is_refused(spawn: Spawn, tmp_path: Path, arena: Path) -> None:
    path = write_config(tmp_path, "models:\n" + echo_model("m", "release: restart"))
    _, port = start(spawn, path, arena)
    status, _, body = call(port, "GET", "/logs/stream/nope")
    assert status == 400
    assert json.loads(body)["error"] == {
        "code": "bad_request", "message": "invalid logger. Use 'proxy', 'upstream' or a model's ID",
        "type": "invalid_request_error", "param": None}  # fmt: skip


def test_logs_asked_for_by_a_browser_is_the_page(spawn: Spawn, tmp_path: Path, arena: Path) -> None:
    path = write_config(tmp_path, "models:\n" + echo_model("m", "release: restart"))
    _, port = start(spawn, path, arena)
    status, headers, _ = call(port, "GET", "/logs", headers={"Accept": "text/html,*/*"})
    assert (status, headers["Location"]) == (302, "/ui/")
    status, headers, _ = call(port, "GET", "/logs")
    assert (status, headers["Content-Type"]) == (200, "text/plain")


@pytest.mark.parametrize("to_stdout", [None, "proxy", "upstream", "both", "none"])
def test_log_to_stdout_picks_what_reaches_serve_s_output(
    spawn: Spawn, tmp_path: Path, arena: Path, to_stdout: str | None
) -> None:
    key = "" if to_stdout is None else f"logToStdout: {to_stdout}\n"
    text = f"{key}models:\n" + echo_model("m", "release: restart")
    proc, port = start(spawn, write_config(tmp_path, text), arena)
    call_json(port, "POST", "/v1/completions", {"model": "m"})
    follow = Follow(port, "/logs/stream/m")
    follow.until("m got POST")  # serve has it
    follow.close()
    mux = logs(port)  # what went to serve's output
    proc.terminate()
    out, err = proc.communicate(timeout=30)
    # absent: llama-swap's default, proxy
    upstream = to_stdout in ("upstream", "both")
    proxy = to_stdout in (None, "proxy", "both")
    assert ("m listening" in out) == upstream == ("m listening" in mux)
    assert ("m got POST" in err) == upstream
    assert ("serving m" in err) == proxy == ("serving m" in mux)


DIES = """
import sys
print("loading model...", flush=True)
for i in range(8):
    print(f"detail {i}", file=sys.stderr, flush=True)
print("error: model file /x.gguf not found", file=sys.stderr, flush=True)
sys.exit(3)
"""


def said_by_serve(proc: subprocess.Popen[str]) -> list[str]:
    proc.terminate()
    _, err = proc.communicate(timeout=30)
    return err.splitlines()


def test_a_server_that_dies_at_start_is_said_with_its_status_and_last_lines(
    spawn: Spawn, tmp_path: Path, arena: Path
) -> None:
    """logToStdout's default keeps the models' output from serve's own: a model whose
    server exits is said there with its status and the end of its output."""
    script = tmp_path / "dies.py"
    script.write_text(DIES)
    text = (f"models:\n  m:\n    cmd: {sys.executable} {script} ${{PORT}}\n"
            "    release: restart\n  nf:\n    cmd: no-such-command-here ${PORT}\n"
            "    release: restart\n")  # fmt: skip
    proc, port = start(spawn, write_config(tmp_path, text), arena)
    status, _, body = call(port, "POST", "/v1/completions", {"model": "m"})
    assert (status, json.loads(body)["error"]["message"]) == (  # its last lines too
        502,
        "model m: its server did not answer: its wrapper exited with status 3; its last"
        " output: detail 4 | detail 5 | detail 6 | detail 7 | error: model file /x.gguf"
        " not found",
    )
    status, _, body = call(port, "POST", "/v1/completions", {"model": "nf"})
    assert (status, json.loads(body)["error"]["message"]) == (
        502, "model nf: its server did not answer: its wrapper exited with status 127"
             " (command not found); its last output: vramlock: no-such-command-here:"
             " command not found")  # fmt: skip
    lines = said_by_serve(proc)
    at = lines.index("vramlock: model m: its wrapper exited with status 3; the end of its"
                     " output (all of it: /logs/stream/m):")  # fmt: skip
    assert lines[at + 1 : at + 6] == [  # its last 5 lines, stdout's and stderr's
        *(f"vramlock: model m: | detail {i}" for i in (4, 5, 6, 7)),
        "vramlock: model m: | error: model file /x.gguf not found",
    ]
    assert lines[at + 6].startswith('vramlock: model m: 127.0.0.1 "POST /v1/completions" 502 ')
    at = lines.index("vramlock: model nf: its wrapper exited with status 127 (command not"
                     " found); the end of its output (all of it: /logs/stream/nf):")  # fmt: skip
    said = "vramlock: model nf: | vramlock: no-such-command-here: command not found"
    assert lines[at + 1] == said
    assert not any("loading model" in line for line in lines)  # the end only


def test_a_server_shown_on_serve_s_output_is_not_said_twice(
    spawn: Spawn, tmp_path: Path, arena: Path
) -> None:
    script = tmp_path / "dies.py"
    script.write_text(DIES)
    text = (f"logToStdout: both\nmodels:\n  m:\n    cmd: {sys.executable} {script} ${{PORT}}\n"
            "    release: restart\n")  # fmt: skip
    proc, port = start(spawn, write_config(tmp_path, text), arena)
    assert call(port, "POST", "/v1/completions", {"model": "m"})[0] == 502
    lines = said_by_serve(proc)
    assert "vramlock: model m: its wrapper exited with status 3" in lines
    assert lines.count("error: model file /x.gguf not found") == 1
    assert not any(line.startswith("vramlock: model m: |") for line in lines)


def test_a_server_that_fails_its_health_check_is_said_with_its_answer(
    spawn: Spawn, tmp_path: Path, arena: Path
) -> None:
    text = ("healthCheckTimeout: 2\nmodels:\n  m:\n"
            f"    cmd: {sys.executable} -m http.server --bind 127.0.0.1 ${{PORT}}\n"
            "    release: restart\n")  # fmt: skip
    proc, port = start(spawn, write_config(tmp_path, text), arena)
    status, _, body = call(port, "POST", "/v1/completions", {"model": "m"})
    message = json.loads(body)["error"]["message"]
    assert status == 502 and message.endswith(
        "answered 404 (no 2xx within healthCheckTimeout, 2 s)"
    )
    assert f"vramlock: {message}" in said_by_serve(proc)


def test_log_time_format_stamps_serve_s_lines(spawn: Spawn, tmp_path: Path, arena: Path) -> None:
    text = "logTimeFormat: rfc3339\nmodels:\n" + echo_model("m", "release: restart")
    _, port = start(spawn, write_config(tmp_path, text), arena)
    line = next(ln for ln in logs(port).splitlines() if "serving m" in ln)
    stamp, rest = line.split(" ", 1)
    assert rest.startswith("[INFO] serving m")
    assert time.strptime(stamp[:19], "%Y-%m-%dT%H:%M:%S")


CHATTY = """
import sys
from http.server import BaseHTTPRequestHandler, HTTPServer
class H(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()
import threading
threading.Thread(target=HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever).start()
line = b"x" * 1023 + b"\\n"
n = 0
while True:
    sys.stdout.buffer.write(b"%08d " % n + line)
    n += 1
"""


def test_a_chatty_server_whose_output_nobody_reads_blocks_nobody(
    spawn: Spawn, tmp_path: Path, arena: Path
) -> None:
    """serve's stdout is a pipe the test never reads: the server's output still flows
    (into the bounded history, the oldest dropped) and serve still answers."""
    script = tmp_path / "chatty.py"
    script.write_text(CHATTY)
    text = (f"logToStdout: both\nmodels:\n  m:\n    cmd: {sys.executable} {script} ${{PORT}}\n"
            "    release: restart\n")  # fmt: skip
    _, port = start(spawn, write_config(tmp_path, text), arena)
    call(port, "POST", "/v1/completions", {"model": "m"})  # starts it; what it answers: none

    def counter() -> int:
        last = logs(port).rstrip("\n").rsplit("\n", 1)[-1]
        return int(last[:8]) if last[:8].isdigit() else -1

    seen = []
    for _ in range(3):
        status, _, body = call(port, "GET", "/health")
        assert status == 200 and body == b"OK"
        seen.append(counter())
        time.sleep(1)
    assert seen[-1] > seen[0] > 1000  # far more than a pipe's 64 KiB
    assert len(logs(port)) <= 100 * 1024


# A C server's way: SIGPIPE's default action (death) on a write to a pipe nobody holds.
ENDS_BY_SIGTERM = """
import signal, sys, time
from http.server import BaseHTTPRequestHandler, HTTPServer
signal.signal(signal.SIGPIPE, signal.SIG_DFL)
def ended(*_):
    open(sys.argv[2], "w").write("SIGTERM")
    sys.exit(0)
signal.signal(signal.SIGTERM, ended)
class H(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()
import threading
threading.Thread(target=HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever,
                 daemon=True).start()
while True:
    sys.stdout.buffer.write(b"x" * 1023 + b"\\n")
    sys.stdout.flush()
    time.sleep(0.001)
"""


def test_a_server_outlives_a_sigkilled_serve_until_its_wrapper_ends_it(
    spawn: Spawn, tmp_path: Path, arena: Path
) -> None:
    """serve's pipes are held and drained after it dies: its models' servers are ended by
    their wrappers (SIGTERM, a release), not by SIGPIPE on their next line of output."""
    from vramlock import procfs

    script, said = tmp_path / "server.py", tmp_path / "ended"
    script.write_text(ENDS_BY_SIGTERM)
    text = (f"models:\n  m:\n    cmd: {sys.executable} {script} ${{PORT}} {said}\n"
            "    release: restart\n")  # fmt: skip
    proc, port = start(spawn, write_config(tmp_path, text), arena)
    call(port, "POST", "/v1/completions", {"model": "m"})
    everyone = procfs.descendants(proc.pid)
    proc.kill()
    proc.wait(10)
    wait_until(lambda: not any(procfs.living(p) for p in everyone), 30)
    assert said.read_text() == "SIGTERM"


def test_a_history_keeps_its_last_bytes_and_a_slow_follower_is_told_what_it_lost() -> None:
    import asyncio

    from vramlock.serve.logs import BEHIND, HISTORY, Ring

    async def scenario() -> list[bytes | None]:
        ring = Ring()
        queue = ring.follow()
        for i in range(BEHIND + 5):  # 5 more than a follower may be behind
            ring.write(b"%05d\n" % i)
        got = [queue.get_nowait() for _ in range(queue.qsize())]
        ring.write(b"next\n")
        got += [queue.get_nowait() for _ in range(queue.qsize())]
        ring.close()
        assert await queue.get() is None
        return got

    got = asyncio.run(scenario())
    assert got[:BEHIND] == [b"%05d\n" % i for i in range(BEHIND)]
    assert got[BEHIND:] == ["\n— 30 bytes dropped —\n".encode(), b"next\n"]
    ring = Ring()
    for i in range(3 * HISTORY // 1000):
        ring.write(b"%999d\n" % i)
    history = ring.history()
    assert HISTORY - 1000 < len(history) <= HISTORY
    assert history.endswith(b"%999d\n" % (3 * HISTORY // 1000 - 1))
