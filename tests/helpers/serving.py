"""``vramlock serve`` on fake model servers that say, in a log of their own, when they
start and when they end: a witness of residency that is not serve's view of itself."""

from __future__ import annotations

import http.client
import json
import os
import sys
from pathlib import Path
from typing import Any

from helpers.commands import vramlock
from helpers.net import free_port, free_ports
from helpers.processes import Spawn, wait_until

# A model server: ``PORT NAME LOG``. It writes "up" when it starts and "down" when it is
# ended (SIGTERM), each line "MONOTONIC NAME up|down PID"; every POST answers its name
# and pid, after $DELAY seconds (0: at once).
FAKE_SERVER = """
import json, os, signal, sys, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
port, name, log = int(sys.argv[1]), sys.argv[2], sys.argv[3]
def note(what):
    with open(log, "a") as f:
        f.write(f"{time.monotonic():.6f} {name} {what} {os.getpid()}\\n")
def ended(signum, frame):
    note("down")
    os._exit(0)
signal.signal(signal.SIGTERM, ended)
class H(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # no 40 ms wait for a delayed ACK between head and body
    def log_message(self, *args):
        pass
    def do_GET(self):
        self.answer(b"{}")
    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        time.sleep(float(os.environ.get("DELAY", "0")))
        self.answer(json.dumps({"model": name, "pid": os.getpid()}).encode())
    def answer(self, body):
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
server = ThreadingHTTPServer(("127.0.0.1", port), H)
note("up")
server.serve_forever()
"""


def fake_models(tmp_path: Path, names: list[str], **per_model: str) -> str:
    """The ``models:`` section for fake servers ``names`` (released by ending them,
    1G each), with ``per_model[name]``'s lines added to a model's entry."""
    script = tmp_path / "fake_server.py"
    script.write_text(FAKE_SERVER)
    log = tmp_path / "servers.log"
    lines = ["models:"]
    for name, port in zip(names, free_ports(len(names)), strict=True):
        lines += [
            f"  {name}:",
            f"    cmd: {sys.executable} {script} {port} {name} {log}",
            f"    proxy: http://127.0.0.1:{port}",
            "    checkEndpoint: none",
            "    release: restart",
            "    vram: 1G",
            *(f"    {line}" for line in per_model.get(name, "").splitlines()),
        ]
    return "\n".join(lines) + "\n"


def server_events(tmp_path: Path) -> list[tuple[float, str, str]]:
    """The fake servers' log: (time, model, "up" or "down"), in order."""
    log = tmp_path / "servers.log"
    if not log.exists():
        return []
    out = []
    for line in log.read_text().splitlines():
        at, name, what, _ = line.split()
        out.append((float(at), name, what))
    return out


def up(tmp_path: Path) -> set[str]:
    """The models whose fake server runs now, by their log."""
    running: set[str] = set()
    for _, name, what in server_events(tmp_path):
        (running.add if what == "up" else running.discard)(name)
    return running


def start_serve(spawn: Spawn, tmp_path: Path, text: str, arena: Path) -> int:
    """serve started on a configuration ``text`` (a free startPort added), its output in
    serve.log; its port once it serves."""
    path = tmp_path / "serve.yaml"
    path.write_text(f"startPort: {free_port()}\n{text}")
    port = free_port()
    while f":{port}" in text:  # a model's
        port = free_port()
    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        spawn(vramlock("serve", str(path), "--listen", str(port)), stdout=out, stderr=out,
              env={**os.environ, "VRAMLOCK_ARENA": str(arena)})  # fmt: skip
    wait_until(lambda: "serving " in log.read_text(), timeout=30)
    return port


def serve_log(tmp_path: Path) -> str:
    return (tmp_path / "serve.log").read_text()


def ask(port: int, method: str, path: str, body: object = None) -> tuple[int, Any]:
    """One request on a fresh connection: (status, JSON body or text)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request(method, path, body=None if body is None else json.dumps(body))
        reply = conn.getresponse()
        raw = reply.read()
        try:
            return reply.status, json.loads(raw)
        except ValueError:
            return reply.status, raw.decode()
    finally:
        conn.close()


def complete(port: int, model: str) -> dict[str, Any]:
    """A completion for ``model``, which must answer 200."""
    status, reply = ask(port, "POST", "/v1/completions", {"model": model, "prompt": "Hi"})
    assert status == 200, reply
    assert isinstance(reply, dict)
    return reply
