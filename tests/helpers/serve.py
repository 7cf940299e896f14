"""``vramlock serve`` for the tests: started on a configuration, asked over HTTP."""

from __future__ import annotations

import http.client
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from . import ROOT
from .commands import vramlock
from .net import answers_health, free_port
from .processes import Spawn, wait_until

ECHO = ROOT / "tests" / "echo_server.py"


def write_config(tmp_path: Path, text: str) -> Path:
    """``text`` as ``tmp_path/serve.yaml``, its models' ports from a free one on."""
    path = tmp_path / "serve.yaml"
    path.write_text(f"startPort: {free_port()}\n{text}")
    return path


def echo_model(name: str, *extra: str, delay: float = 0) -> str:
    """A ``models:`` entry (its lines under ``models:``) of tests/echo_server.py, on a
    port of its own that was free an instant ago (startPort's next ones may not be)."""
    port = free_port()
    cmd = f"{sys.executable} {ECHO} {port} {name}" + (f" {delay}" if delay else "")
    lines = [f"  {name}:", f"    cmd: {cmd}", f"    proxy: http://127.0.0.1:{port}"]
    return "\n".join([*lines, *(f"    {e}" for e in extra)]) + "\n"


def start(
    spawn: Spawn, path: Path, arena: Path, *args: str, env: dict[str, str] | None = None
) -> tuple[subprocess.Popen[str], int]:
    """serve on ``path`` (the arena ``arena``; ``env`` added to the environment), once it
    answers /health: (process, port)."""
    port = free_port()
    proc = spawn(vramlock("serve", str(path), "--listen", str(port), *args),
                 env={**os.environ, "VRAMLOCK_ARENA": str(arena), **(env or {})},
                 graceful=True)  # fmt: skip
    wait_until(lambda: proc.poll() is not None or answers_health(port), 30)
    assert proc.poll() is None, proc.communicate()
    return proc, port


def call(
    port: int, method: str, path: str, body: object = None, headers: dict[str, str] | None = None
) -> tuple[int, dict[str, str], bytes]:
    """One request on a fresh connection: (status, headers, body)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        data = None if body is None else json.dumps(body)
        conn.request(method, path, body=data, headers=headers or {})
        reply = conn.getresponse()
        return reply.status, dict(reply.getheaders()), reply.read()
    finally:
        conn.close()


def call_json(port: int, method: str, path: str, body: object = None, **kw: Any) -> Any:
    status, _, data = call(port, method, path, body, **kw)
    assert status == 200, (status, data)
    return json.loads(data)


def sse(body: bytes) -> list[Any]:
    """An OpenAI-style event stream's JSON chunks, as a client parses them."""
    out = []
    for event in body.decode().split("\n\n"):
        for line in event.splitlines():
            if line.startswith("data: ") and line != "data: [DONE]":
                out.append(json.loads(line[len("data: ") :]))
    return out


class Events:
    """A client of /api/events: the events it reads, each (type, its data decoded)."""

    def __init__(self, port: int, headers: dict[str, str] | None = None) -> None:
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        self.conn.request("GET", "/api/events", headers=headers or {})
        self.reply = self.conn.getresponse()
        if self.reply.status != 200:
            self.conn.close()
            raise AssertionError(self.reply.status, self.reply.read())
        self.kept: list[tuple[str, Any]] = []  # read, not yet asked for

    def next(self) -> tuple[str, Any]:
        """The next event, as an EventSource's onmessage gets it, its envelope opened."""
        lines = []
        while (line := self.reply.readline()) not in (b"\n", b""):
            lines.append(line.decode().rstrip("\n"))
        assert lines, "the stream ended"
        assert lines[0] == "event:message" and lines[1].startswith("data:"), lines
        assert len(lines) == 2, lines
        envelope = json.loads(lines[1][len("data:") :])
        assert set(envelope) == {"type", "data"} and isinstance(envelope["data"], str)
        return envelope["type"], json.loads(envelope["data"])

    def until(self, kind: str, holds: Any = lambda data: True) -> Any:
        """The data of the next ``kind`` event for which ``holds(data)``; the ``kind``
        events before it are passed over, those of other types kept for their turn."""
        at = 0
        while True:
            if at == len(self.kept):
                self.kept.append(self.next())
            got, data = self.kept[at]
            if got != kind:
                at += 1
                continue
            del self.kept[at]
            if holds(data):
                return data

    def output(self, line: str) -> str:
        """The models' output from the next upstream logData until ``line`` (however
        their servers' writes came in chunks)."""
        said = ""
        while line not in said:
            said += self.until("logData", lambda d: d["source"] == "upstream")["data"]
        return said

    def close(self) -> None:
        self.conn.close()
