"""``vramlock serve`` switching models: nothing of serve's keeps the last model resident.

serve keeps connections to a model's wrapper alive between requests; a wrapper counts a
connection with traffic in its last ``--idle`` as busy, and a busy model does not
release. Once another model of the arena takes its turn, serve closes them: the last
model releases as soon as it is wanted, not ``--idle`` later. Requests sent together
on one connection are answered in order, whichever part of serve takes each.
"""

from __future__ import annotations

import http.client
import os
import socket
import sys
from pathlib import Path

import pytest
from helpers.commands import vramlock, who_json
from helpers.net import free_port
from helpers.processes import Spawn, wait_until

pytest.importorskip("aiohttp")

pytestmark = pytest.mark.timeout(60)

# A keep-alive HTTP/1.1 server that answers every POST with "ok".
OK = r"""
import socket
import sys
from http.server import BaseHTTPRequestHandler, HTTPServer
class H(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"ok")
    def log_message(self, *args):
        pass
HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def test_the_last_model_s_connections_are_closed_when_another_takes_its_turn(
    spawn: Spawn, tmp_path: Path, arena: Path
) -> None:
    script = tmp_path / "ok.py"
    script.write_text(OK)
    lines = ["models:"]
    for name in ("a", "b"):  # ports of their own: startPort's next may be taken
        up = free_port()
        lines += [f"  {name}:", f"    cmd: {sys.executable} {script} {up}",
                  f"    proxy: http://127.0.0.1:{up}", "    checkEndpoint: none",
                  "    release: restart"]  # fmt: skip
    path = tmp_path / "serve.yaml"
    path.write_text("\n".join(lines) + "\n")
    port = free_port()
    proc = spawn(vramlock("serve", str(path), "--listen", str(port)),
                 env={**os.environ, "VRAMLOCK_ARENA": str(arena)})  # fmt: skip
    assert proc.stderr is not None and "serving" in proc.stderr.readline()

    def ask(name: str) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        try:
            conn.request("POST", "/v1/completions", body=f'{{"model": "{name}"}}')
            reply = conn.getresponse()
            got = reply.read()
            assert (reply.status, got) == (200, b"ok"), got
        finally:
            conn.close()

    def connections() -> dict[str, int]:
        return {m["name"]: m["connections"] or 0 for m in who_json(arena)}

    ask("a")
    wait_until(lambda: connections().get("a") == 1)  # kept alive, for a's next request
    ask("b")
    # b's turn: serve's connection to a's wrapper closed
    wait_until(lambda: connections().get("a") == 0)


def test_requests_sent_together_on_one_connection_are_each_answered(
    spawn: Spawn, tmp_path: Path, arena: Path
) -> None:
    """Pipelined: two POSTs for the model, then a GET of another route, in one write;
    serve answers them in order on the one connection (the GET by another server
    than the POSTs', with the bytes that came with them)."""
    script = tmp_path / "ok.py"
    script.write_text(OK)
    up = free_port()
    path = tmp_path / "serve.yaml"
    path.write_text(f"models:\n  a:\n    cmd: {sys.executable} {script} {up}\n"
                    f"    proxy: http://127.0.0.1:{up}\n    checkEndpoint: none\n")  # fmt: skip
    port = free_port()
    proc = spawn(vramlock("serve", str(path), "--listen", str(port)),
                 env={**os.environ, "VRAMLOCK_ARENA": str(arena)})  # fmt: skip
    assert proc.stderr is not None and "serving" in proc.stderr.readline()
    post = b'POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 14\r\n\r\n{"model": "a"}'
    get = b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(post + post + get)
        answers = b""
        while chunk := s.recv(65536):
            answers += chunk
    bodies = [part.partition(b"\r\n\r\n")[2] for part in answers.split(b"HTTP/1.1 ")[1:]]
    assert answers.count(b"HTTP/1.1 200") == 3, answers
    assert bodies == [b"ok", b"ok", b"OK"], answers
