"""The real llama-server (CPU) that tools/llama_server.py builds and caches: finding it,
asking it, and watching its processes."""

from __future__ import annotations

import http.client
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from helpers import ROOT
from vramlock import procfs

sys.path.insert(0, str(ROOT / "tools"))


def llama_binary() -> Path | None:
    """The cached llama-server, or None; built first (minutes) with VRAMLOCK_BUILD_LLAMA=1."""
    import llama_server

    found: Path | None = llama_server.cached_binary()
    if found is None and os.environ.get("VRAMLOCK_BUILD_LLAMA") == "1":
        found = llama_server.ensure()
    return found


# The binary BothAlive looks for among the processes.
BINARY = llama_binary()


def needs_llama(binary: Path | None) -> pytest.MarkDecorator:
    """The mark that skips a module when ``binary`` is None, saying how to build it."""
    import llama_server

    return pytest.mark.skipif(
        binary is None,
        reason=f"no llama-server built in {llama_server.cache_dir()}: run "
        "`python tools/llama_server.py` or set VRAMLOCK_BUILD_LLAMA=1",
    )


PROMPT = "The quick brown fox jumps over the lazy dog. " * 20


def call(port: int, method: str, path: str, body: object = None) -> tuple[int, Any]:
    """One request on a fresh connection: (status, decoded JSON body)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        data = None if body is None else json.dumps(body)
        conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
        reply = conn.getresponse()
        return reply.status, json.loads(reply.read() or b"null")
    finally:
        conn.close()


class BothAlive(threading.Thread):
    """Samples /proc for the servers listening on ``ports``: times both were alive."""

    def __init__(self, ports: list[int]) -> None:
        super().__init__(daemon=True)
        self.ports = [str(p) for p in ports]
        self.overlaps: list[list[int]] = []
        self.samples = 0
        self.stop = threading.Event()

    def servers(self) -> list[int]:
        """The pids of the watched servers alive now."""
        alive = []
        for pid in procfs.all_pids():
            cmd = procfs.text(pid, "cmdline").split()
            if cmd and cmd[0] == str(BINARY) and procfs.living(pid):
                port = cmd[cmd.index("--port") + 1] if "--port" in cmd else ""
                if port in self.ports:
                    alive.append(pid)
        return alive

    def run(self) -> None:
        """Sample /proc every 3 ms until stopped."""
        while not self.stop.is_set():
            alive = self.servers()
            self.samples += 1
            if len(alive) > 1:
                self.overlaps.append(alive)
            time.sleep(0.003)
