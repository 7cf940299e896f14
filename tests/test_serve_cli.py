"""``vramlock serve`` end to end without a llama-server: errors, warnings, streaming.

A bad configuration or --listen value is a usage error (2) naming the file and line;
an address in use is vramlock's own failure (125); warnings do not stop it. A streamed
answer reaches the client chunk by chunk, not when it is complete; a server that never
answers its checkEndpoint never has a request forwarded.
"""

from __future__ import annotations

import base64
import errno
import http.client
import json
import os
import re
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from helpers.commands import vramlock, who_json
from helpers.errors import ErrCli, expect_error
from helpers.net import free_port, start_port
from helpers.processes import Spawn, wait_until

from vramlock import procfs

pytest.importorskip("aiohttp")

pytestmark = pytest.mark.timeout(60)

GOOD = "models:\n  m:\n    cmd: sleep 60 ${PORT}\n    release: restart\n"


def config(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "serve.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    ("text", "fragments"),
    [
        ("models:\n  m:\n    cmd: [x\n", [":4: not valid YAML"]),
        ("models:\n  m:\n    proxy: http://127.0.0.1:9\n", [":2: model 'm': no cmd"]),
        ("models:\n  m:\n    cmd: sleep ${PORT}\n    release: bogus\n",
         [":2: model 'm': unknown release strategy 'bogus'"]),
        (GOOD + "selectors:\n  s:\n    strategy: pin\n    targets: [m, nope]\n",
         [":8: selectors.s.targets[1] references unknown model 'nope'"]),
    ],
    ids=["bad-yaml", "missing-cmd", "bad-release", "selector-of-no-model"],
)  # fmt: skip
def test_bad_configuration(errcli: ErrCli, tmp_path: Path, text: str, fragments: list[str]) -> None:
    path = config(tmp_path, text)
    expect_error(errcli("serve", str(path)), 2, str(path), *fragments)


def test_missing_file(errcli: ErrCli, tmp_path: Path) -> None:
    path = tmp_path / "nope.yaml"
    expect_error(errcli("serve", str(path)), 2, f"{path}: cannot read it")


def test_bad_listen_address(errcli: ErrCli, tmp_path: Path) -> None:
    out = errcli("serve", str(config(tmp_path, GOOD)), "--listen", "nowhere")
    expect_error(out, 2, "--listen: bad address 'nowhere'")


def test_listen_address_in_use(errcli: ErrCli, tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        out = errcli("serve", str(config(tmp_path, GOOD)), "--listen", str(port))
    expect_error(out, 125, f"--listen {port}: Address already in use")


def test_unknown_key_warns_and_serve_runs(spawn: Spawn, tmp_path: Path, arena: Path) -> None:
    path = config(tmp_path, GOOD + "    colour: blue\n")
    port = free_port()
    proc = spawn(vramlock("serve", str(path), "--listen", str(port)),
                 env={**os.environ, "VRAMLOCK_ARENA": str(arena)})  # fmt: skip
    assert proc.stderr is not None
    assert proc.stderr.readline() == f"vramlock: {path}:5: model 'm': unknown key colour ignored\n"
    assert proc.stderr.readline() == f"vramlock: serving m at http://127.0.0.1:{port}\n"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0


def test_llama_swap_s_command_line(spawn: Spawn, tmp_path: Path, arena: Path) -> None:
    """--config FILE and --listen :PORT, as llama-swap takes them."""
    port = free_port()
    proc = spawn(vramlock("serve", "--config", str(config(tmp_path, GOOD)), "--listen", f":{port}"),
                 env={**os.environ, "VRAMLOCK_ARENA": str(arena)})  # fmt: skip
    assert proc.stderr is not None
    assert proc.stderr.readline() == f"vramlock: serving m on port {port} of every interface\n"
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("GET", "/health")
    assert conn.getresponse().read() == b"OK"
    conn.close()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0


@pytest.mark.parametrize("listen", ["{port}", "127.0.0.1:{port}", ":{port}"])
def test_a_fifo_in_place_of_the_configuration_is_refused_at_once(
    spawn: Spawn, tmp_path: Path, arena: Path, listen: str
) -> None:
    """A FIFO that nobody writes is not waited on (serve would answer nothing, its port
    open): it is refused, exit status 2, and a client that came early is let go."""
    path = tmp_path / "serve.yaml"
    os.mkfifo(path)
    port = free_port()
    proc = spawn(vramlock("serve", str(path), "--listen", listen.format(port=port)),
                 env={**os.environ, "VRAMLOCK_ARENA": str(arena)})  # fmt: skip
    assert proc.wait(30) == 2
    assert proc.stderr is not None
    assert proc.stderr.read() == (f"vramlock: {path}: cannot read it: a FIFO, not a regular file\n")


@pytest.mark.parametrize(
    ("argv", "bound"),
    [
        (["c.yaml"], "127.0.0.1:8080"),
        (["c.yaml", "--listen", "9001"], "9001"),
        (["--listen=:9002", "--config", "c.yaml"], ":9002"),
        (["c.yaml", "--listen", "[::1]:9003"], "[::1]:9003"),
        (["c.yaml", "--listen", "localhost:9004"], None),  # a name: resolved later, by serve
        (["c.yaml", "--listen"], None),
        (["--help"], None),
        (["c.yaml", "--listenx", "1"], None),
    ],
)
def test_which_addresses_are_listened_on_before_the_command_line(
    argv: list[str], bound: str | None
) -> None:
    from vramlock.net import prebind

    listen = prebind._listen_option(argv)
    where = None if listen is None else prebind._literal(listen)
    assert (listen if where is not None else None) == bound


@pytest.mark.parametrize("twice", [False, True])
def test_the_configuration_once(errcli: ErrCli, tmp_path: Path, twice: bool) -> None:
    path = str(config(tmp_path, GOOD))
    args = [path, "--config", path] if twice else []
    expect_error(errcli("serve", *args), 2, "give the configuration once: CONFIG or --config FILE")


def test_serve_without_its_extra_says_what_to_install(errcli: ErrCli, tmp_path: Path) -> None:
    # aiohttp made unimportable, as where the serve extra is not installed
    code = "import sys; sys.modules['aiohttp'] = None; from vramlock.cli import main; main()"
    out = errcli("serve", str(config(tmp_path, GOOD)), python_code=code)
    expect_error(out, 125, "vramlock serve needs aiohttp: pip install 'vramlock[serve]'")


# A server that streams two chunks a second apart (what a slow model's SSE looks like).
SLOW_STREAM = """
import sys, time
from http.server import BaseHTTPRequestHandler, HTTPServer
class H(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for i, line in enumerate((b"data: first\\n\\n", b"data: last\\n\\n")):
            if i:
                time.sleep(1)
            self.wfile.write(b"%x\\r\\n%s\\r\\n" % (len(line), line))
            self.wfile.flush()
        self.wfile.write(b"0\\r\\n\\r\\n")
HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def test_a_stream_is_passed_on_as_it_comes(spawn: Spawn, tmp_path: Path, arena: Path) -> None:
    script = tmp_path / "slow.py"
    script.write_text(SLOW_STREAM)
    path = config(tmp_path, f"models:\n  m:\n    cmd: {sys.executable} {script} ${{PORT}}\n"
                            f"    checkEndpoint: none\nstartPort: {start_port()}\n")  # fmt: skip
    port = free_port()
    proc = spawn(vramlock("serve", str(path), "--listen", str(port)),
                 env={**os.environ, "VRAMLOCK_ARENA": str(arena)})  # fmt: skip
    assert proc.stderr is not None and "serving m" in proc.stderr.readline()
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        body = b'{"model": "m", "stream": true}'
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s"
                  % (len(body), body))  # fmt: skip
        got, first = b"", None
        while b"data: last" not in got:
            got += s.recv(65536)
            if first is None and b"data: first" in got:
                first = time.monotonic()
        assert first is not None and time.monotonic() - first > 0.8
    assert b"200 OK" in got and b"text/event-stream" in got


# A server that answers 503 to everything, as llama-server does while it loads.
LOADING = """
import sys
from http.server import BaseHTTPRequestHandler, HTTPServer
class H(BaseHTTPRequestHandler):
    def answer(self):
        self.send_response(503)
        self.send_header("Content-Length", "0")
        self.end_headers()
    do_GET = do_POST = answer
HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def test_a_model_that_never_gets_healthy_fails_without_its_503(
    spawn: Spawn, tmp_path: Path, arena: Path
) -> None:
    script = tmp_path / "loading.py"
    script.write_text(LOADING)
    path = config(tmp_path, f"healthCheckTimeout: 1\nstartPort: {start_port()}\nmodels:\n"
                            f"  m:\n    cmd: {sys.executable} {script} ${{PORT}}\n")  # fmt: skip
    port = free_port()
    proc = spawn(vramlock("serve", str(path), "--listen", str(port)),
                 env={**os.environ, "VRAMLOCK_ARENA": str(arena)})  # fmt: skip
    assert proc.stderr is not None and "serving m" in proc.stderr.readline()
    started = time.monotonic()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("POST", "/v1/completions", body=b'{"model": "m"}')
    reply = conn.getresponse()
    body = json.loads(reply.read())
    conn.close()
    # held while /health said 503, then serve's own answer: the engine's 503 never
    assert reply.status == 502, body
    assert body["error"]["message"].startswith("model m: its server did not answer")
    # the cause, not a bare errno
    assert "/health on 127.0.0.1:" in body["error"]["message"]
    assert "answered 503 (no 2xx within healthCheckTimeout, 1 s)" in body["error"]["message"]
    assert time.monotonic() - started < 10


def test_a_model_that_never_listens_fails_naming_the_timeout(
    spawn: Spawn, tmp_path: Path, arena: Path
) -> None:
    path = config(tmp_path, f"healthCheckTimeout: 1\nstartPort: {start_port()}\nmodels:\n"
                            "  m:\n    cmd: sleep 60 ${PORT}\n    release: restart\n")  # fmt: skip
    status, body = ask(serve_on(spawn, path, arena), "POST", "/v1/completions", b'{"model": "m"}')
    assert status == 502
    # the health check's answer (none: nothing listens) and the bound it was waited for
    assert re.fullmatch(
        r"model m: its server did not answer: GET /health on 127\.0\.0\.1:\d+: connection"
        r" refused \(no 2xx within healthCheckTimeout, 1 s\)",
        body["error"]["message"],
    ), body


def serve_on(spawn: Spawn, path: Path, arena: Path) -> int:
    """serve started on ``path``; its port, once it serves."""
    port = free_port()
    proc = spawn(vramlock("serve", str(path), "--listen", str(port)),
                 env={**os.environ, "VRAMLOCK_ARENA": str(arena)})  # fmt: skip
    assert proc.stderr is not None and "serving" in proc.stderr.readline()
    return port


def ask(port: int, method: str, path: str, body: bytes | None = None) -> tuple[int, Any]:
    status, _, data = exchange(port, method, path, body)
    return status, json.loads(data)


def exchange(
    port: int, method: str, path: str, body: bytes | None = None, **headers: str
) -> tuple[int, dict[str, str], bytes]:
    """A request's status, headers (lower-case names) and body."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request(
            method, path, body=body, headers={k.replace("_", "-"): v for k, v in headers.items()}
        )
        reply = conn.getresponse()
        return reply.status, {k.lower(): v for k, v in reply.getheaders()}, reply.read()
    finally:
        conn.close()


def test_a_command_not_found_is_said_in_the_502(spawn: Spawn, tmp_path: Path, arena: Path) -> None:
    path = config(tmp_path, "models:\n  m:\n    cmd: vramlock-test-no-such-command ${PORT}\n"
                            "    release: restart\n")  # fmt: skip
    status, body = ask(serve_on(spawn, path, arena), "POST", "/v1/completions", b'{"model": "m"}')
    assert status == 502
    assert body["error"]["message"] == (
        "model m: its server did not answer: its wrapper exited with status 127 (command not"
        " found); its last output: vramlock: vramlock-test-no-such-command: command not found"
    )


# A server no preset knows (auto finds no way to release it): answers with its pid.
PLAIN = """
import os, sys
from http.server import BaseHTTPRequestHandler, HTTPServer
class H(BaseHTTPRequestHandler):
    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        body = str(os.getpid()).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def test_a_model_auto_cannot_release_is_restarted_for_another(
    spawn: Spawn, tmp_path: Path, arena: Path
) -> None:
    script = tmp_path / "plain.py"
    script.write_text(PLAIN)
    model = f"    cmd: {sys.executable} {script} ${{PORT}}\n    checkEndpoint: none\n"
    path = config(tmp_path, f"startPort: {start_port()}\nmodels:\n  a:\n{model}  b:\n{model}")
    port = serve_on(spawn, path, arena)

    def pid(name: str) -> int:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        try:
            conn.request("POST", "/v1/completions", body=json.dumps({"model": name}))
            reply = conn.getresponse()
            body = reply.read()
            assert reply.status == 200, body
            return int(body)
        finally:
            conn.close()

    first = pid("a")
    assert [r["strategy"] for r in who_json(arena)] == ["auto:none"]
    pid("b")  # not held for good behind a: a was ended first
    assert not os.path.exists(f"/proc/{first}")
    assert pid("a") != first  # started again on its next request


def test_api_keys_are_asked_for_as_llama_swap_does(
    spawn: Spawn, tmp_path: Path, arena: Path
) -> None:
    path = config(tmp_path, GOOD + 'apiKeys: ["sk-one", "${env.SERVE_TEST_KEY}"]\n')
    port = free_port()
    env = {**os.environ, "VRAMLOCK_ARENA": str(arena), "SERVE_TEST_KEY": "sk-env"}
    proc = spawn(vramlock("serve", str(path), "--listen", str(port)), env=env)
    assert proc.stderr is not None and "serving" in proc.stderr.readline()

    def status(headers: dict[str, str], path: str = "/v1/models") -> int:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        try:
            conn.request("GET", path, headers=headers)
            reply = conn.getresponse()
            body = reply.read()
            if reply.status == 401:
                message = json.loads(body)["error"]["message"]
                assert message == "unauthorized: invalid or missing API key"
                assert reply.getheader("WWW-Authenticate") == 'Basic realm="vramlock"'
            return reply.status
        finally:
            conn.close()

    basic = base64.b64encode(b"anyone:sk-one").decode()
    assert status({}) == 401
    assert status({"Authorization": "Bearer sk-nope"}) == 401
    assert status({"Authorization": "Bearer sk-one"}) == 200
    assert status({"x-api-key": "sk-env"}) == 200  # from the environment
    assert status({"Authorization": f"Basic {basic}"}) == 200
    assert status({}, "/health") == 200  # no key asked
    # as llama-swap answers a client that asks for text or a page
    refused, headers, text = exchange(port, "GET", "/v1/models", Accept="text/plain")
    assert (refused, headers["content-type"]) == (401, "text/plain; charset=utf-8")
    assert text == b"vramlock: unauthorized: invalid or missing API key"
    assert headers["www-authenticate"] == 'Basic realm="vramlock"'
    refused, headers, text = exchange(port, "POST", "/v1/completions", b'{"model": "m"}',
                                      Accept="text/html,*/*")  # fmt: skip
    assert (refused, headers["content-type"]) == (401, "text/html; charset=utf-8")
    assert text == (b"<html><body><h1>vramlock</h1><p>unauthorized: invalid or missing API"
                    b" key</p></body></html>")  # fmt: skip


def test_requests_over_concurrency_limit_get_429(spawn: Spawn, tmp_path: Path, arena: Path) -> None:
    script = tmp_path / "slow.py"
    script.write_text(SLOW_STREAM)
    path = config(tmp_path, f"models:\n  m:\n    cmd: {sys.executable} {script} ${{PORT}}\n"
                            f"    checkEndpoint: none\n    concurrencyLimit: 1\n"
                            f"startPort: {start_port()}\n")  # fmt: skip
    port = serve_on(spawn, path, arena)
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        body = b'{"model": "m", "stream": true}'
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s"
                  % (len(body), body))  # fmt: skip
        got = b""
        while b"data: first" not in got:  # the one request allowed is in progress
            got += s.recv(65536)
        over = "model m: 1 requests at once already (concurrencyLimit)"
        refused, headers, data = exchange(port, "POST", "/v1/completions", b'{"model": "m"}')
        assert (refused, headers["retry-after"]) == (429, "1")
        assert json.loads(data) == {"src": "vramlock", "error": {
            "message": over, "type": "rate_limit_error", "param": None,
            "code": "concurrency_limit"}}  # fmt: skip
        # a client that asks for text takes the other path through serve: the same answer
        refused, headers, data = exchange(port, "POST", "/v1/completions", b'{"model": "m"}',
                                          Accept="text/plain")  # fmt: skip
        assert (refused, headers["retry-after"], data) == (429, "1", f"vramlock: {over}".encode())
        while b"data: last" not in got:
            got += s.recv(65536)

    def status() -> int:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        try:
            conn.request("POST", "/v1/completions", body=b'{"model": "m"}')
            return conn.getresponse().status
        finally:
            conn.close()

    wait_until(lambda: status() != 429)  # its end gives the place back
    assert status() == 200


def test_llama_swap_s_other_routes(spawn: Spawn, tmp_path: Path, arena: Path) -> None:
    slashed = (
        "  org/big:\n    cmd: sleep 60 ${PORT}\n    release: restart\n"
        "    aliases: [big, {id: large, name: Large}, {id: hidden, unlisted: true}]\n"
        "    metadata:\n      port: ${PORT}\n    capabilities: {context: 8}\n"
    )
    text = "healthCheckTimeout: 1\nincludeAliasesInList: true\n" + GOOD + slashed
    port = serve_on(spawn, config(tmp_path, text), arena)
    status, entry = ask(port, "GET", "/v1/models/org/big")
    assert (status, entry["id"], entry["state"]) == (200, "org/big", "released")
    assert entry["meta"] == {"llamaswap": {"port": 5801, "type": "model",
                                           "aliases": ["big", "large"]}, "n_ctx": 8}  # fmt: skip
    assert (entry["context_length"], entry["status"]) == (8, {"value": "unloaded"})
    assert "capabilities" not in entry  # a context length alone: no flag to show
    listed = ask(port, "GET", "/v1/models")[1]["data"]
    assert [(e["id"], e["meta"]["llamaswap"]["type"], e.get("name")) for e in listed] == [
        ("big", "alias", None), ("large", "alias", "Large"), ("m", "model", None),
        ("org/big", "model", None)]  # sorted by id, as llama-swap's  # fmt: skip
    assert listed[3]["aliases"] == ["big", "large"]  # an unlisted alias is not told
    # an id is retrieved as it is listed: an alias as an alias
    assert ask(port, "GET", "/v1/models/large") == (200, listed[1])
    status, entry = ask(port, "GET", "/v1/models/hidden")
    assert (status, entry["id"]) == (200, "hidden")
    assert entry["meta"]["llamaswap"]["modelID"] == "org/big"
    assert ask(port, "GET", "/v1/models/nope")[0] == 404
    # a name with a slash reaches its server (here: none listens)
    status, reply = ask(port, "GET", "/upstream/org/big/health")
    assert status == 502 and reply["error"]["message"].startswith("model org/big: ")
    assert ask(port, "POST", "/api/models/unload") == (200, {"msg": "ok"})
    assert ask(port, "POST", "/api/models/unload/nope")[0] == 404
    for method, path in (("GET", "/unload"), ("POST", "/api/models/unload/org/big")):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        conn.request(method, path)
        reply = conn.getresponse()
        assert (reply.status, reply.read()) == (200, b"OK")
        conn.close()


def test_no_other_program_takes_a_model_s_port_between_its_runs(
    spawn: Spawn, tmp_path: Path, arena: Path
) -> None:
    script = tmp_path / "plain.py"
    script.write_text(PLAIN)
    path = config(tmp_path, f"startPort: {start_port()}\nmodels:\n  m:\n"
                            f"    cmd: {sys.executable} {script} ${{PORT}}\n"
                            "    checkEndpoint: none\n    release: restart\n")  # fmt: skip
    port = serve_on(spawn, path, arena)

    def pid() -> int:
        status, answer = ask(port, "POST", "/v1/completions", b'{"model": "m"}')
        assert status == 200, answer
        return int(answer)

    first = pid()
    (row,) = who_json(arena)
    os.kill(row["pid"], signal.SIGTERM)  # the wrapper ends, and its server with it
    # Reaped by serve: its pid names nothing. (A zombie alone is not enough: the main
    # thread of a process is one while its other threads end, and waitpid cannot take
    # it yet; a request then still goes to that wrapper, and gets a 502 saying it exited.)
    wait_until(lambda: procfs.state(row["pid"]) is None)
    # its port stays serve's: a program that took it would get the model's requests
    with socket.socket() as thief, pytest.raises(OSError) as err:
        thief.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # past any TIME_WAIT
        thief.bind(("127.0.0.1", int(row["listen"].rsplit(":", 1)[1])))
    assert err.value.errno == errno.EADDRINUSE
    assert pid() != first  # started again on its next request


@pytest.mark.parametrize("level", ["info", "warn"])
def test_each_start_and_request_is_said_at_log_level_info(
    spawn: Spawn, tmp_path: Path, arena: Path, level: str
) -> None:
    script = tmp_path / "plain.py"
    script.write_text(PLAIN)
    path = config(tmp_path, f"logLevel: {level}\nstartPort: {start_port()}\nmodels:\n  m:\n"
                            f"    cmd: {sys.executable} {script} ${{PORT}}\n"
                            "    checkEndpoint: none\n")  # fmt: skip
    port = free_port()
    proc = spawn(vramlock("serve", str(path), "--listen", str(port)),
                 env={**os.environ, "VRAMLOCK_ARENA": str(arena)})  # fmt: skip
    assert proc.stderr is not None and "serving m" in proc.stderr.readline()
    assert ask(port, "POST", "/v1/completions", b'{"model": "m"}')[0] == 200
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    said = [line for line in err.splitlines() if line.startswith("vramlock: model m: ")]
    if level == "warn":
        assert said == []
    else:
        assert said[0] == "vramlock: model m: starting its wrapper"
        assert re.fullmatch(
            r'vramlock: model m: 127\.0\.0\.1 "POST /v1/completions" 200 [0-9]+ "[^"]*" [0-9.]+ s',
            said[1],
        )


# A websocket server: each message answered with it and the Authorization it got.
WS_ECHO = """
import sys
from aiohttp import web
async def ws(request):
    out = web.WebSocketResponse()
    await out.prepare(request)
    async for msg in out:
        await out.send_str(f"{msg.data} {request.headers.get('Authorization', '-')}")
    return out
app = web.Application()
app.router.add_get("/ws", ws)
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=None)
"""


def test_a_websocket_passes_through_upstream(spawn: Spawn, tmp_path: Path, arena: Path) -> None:
    import asyncio

    import aiohttp

    script = tmp_path / "ws.py"
    script.write_text(WS_ECHO)
    path = config(tmp_path, f"startPort: {start_port()}\nmodels:\n  m:\n"
                            f"    cmd: {sys.executable} {script} ${{PORT}}\n"
                            "    checkEndpoint: none\n")  # fmt: skip
    port = serve_on(spawn, path, arena)

    async def talk() -> list[str]:
        async with (
            aiohttp.ClientSession() as client,
            client.ws_connect(
                f"http://127.0.0.1:{port}/upstream/m/ws", headers={"Authorization": "Bearer k"}
            ) as ws,
        ):
            got = []
            for text in ("one", "two"):
                await ws.send_str(text)
                got.append((await ws.receive(timeout=30)).data)
            return got

    assert asyncio.run(talk()) == ["one Bearer k", "two Bearer k"]
    # a path the server has no websocket on: serve's 502, saying so
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("GET", "/upstream/m/none", headers={
        "Upgrade": "websocket", "Connection": "Upgrade", "Sec-WebSocket-Version": "13",
        "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ=="})  # fmt: skip
    reply = conn.getresponse()
    message = json.loads(reply.read())["error"]["message"]
    conn.close()
    assert reply.status == 502
    assert message.startswith("model m: no websocket from its server: 404")


# A server that answers with the JSON body it received.
ECHO = """
import sys
from http.server import BaseHTTPRequestHandler, HTTPServer
class H(BaseHTTPRequestHandler):
    def do_POST(self):
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def test_use_model_name_and_filters_reach_the_server(
    spawn: Spawn, tmp_path: Path, arena: Path
) -> None:
    script = tmp_path / "echo.py"
    script.write_text(ECHO)
    path = config(tmp_path, f"startPort: {start_port()}\nmodels:\n  m:\n"
                            f"    cmd: {sys.executable} {script} ${{PORT}}\n"
                            "    checkEndpoint: none\n    useModelName: served-name\n"
                            "    filters:\n      stripParams: temperature\n"
                            "      setParams: {top_p: 0.5}\n")  # fmt: skip
    port = serve_on(spawn, path, arena)
    sent = {"model": "m", "temperature": 2, "prompt": "x"}
    status, got = ask(port, "POST", "/v1/completions", json.dumps(sent).encode())
    assert (status, got) == (200, {"model": "served-name", "prompt": "x", "top_p": 0.5})


def test_a_body_over_the_limit_is_refused_413(spawn: Spawn, tmp_path: Path, arena: Path) -> None:
    from vramlock.serve.reading import MAX_BODY

    port = serve_on(spawn, config(tmp_path, GOOD), arena)
    message = f"the request body is over {MAX_BODY >> 20} MiB"
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        # said from Content-Length, before any of the body is read
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n"
                  % (MAX_BODY + 1))  # fmt: skip
        head, _, body = s.recv(65536).partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 413 ")
        assert json.loads(body)["error"]["message"] == message
    # a chunked body is counted as it passes: tests/test_serve_bodies.py


def test_unknown_routes_and_models_answer_openai_json(
    spawn: Spawn, tmp_path: Path, arena: Path
) -> None:
    hidden = "  secret:\n    cmd: sleep 60 ${PORT}\n    release: restart\n    unlisted: true\n"
    port = serve_on(spawn, config(tmp_path, GOOD + hidden), arena)
    status, body = ask(port, "GET", "/no/such/route")
    assert status == 404
    assert body == {"src": "vramlock", "error": {
        "code": "not_found", "message": "GET /no/such/route: no such route",
        "type": "invalid_request_error", "param": None}}  # fmt: skip
    status, body = ask(port, "DELETE", "/models/unload")
    assert (status, body["error"]["message"]) == (
        405, "DELETE /models/unload: method not allowed; allowed: POST")  # fmt: skip
    # the page's routes too
    status, body = ask(port, "GET", "/ui/no/such/page")
    assert (status, body["error"]["message"]) == (404, "GET /ui/no/such/page: no such route")
    status, body = ask(port, "PUT", "/ui/")
    assert (status, body["error"]["message"]) == (
        405, "PUT /ui/: method not allowed; allowed: GET, HEAD")  # fmt: skip
    # an unlisted model is served, not told of
    status, body = ask(port, "POST", "/v1/completions", b'{"model": "nope"}')
    assert (status, body["models"]) == (404, ["m"])
