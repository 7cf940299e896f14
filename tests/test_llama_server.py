"""A real llama-server (CPU, tiny random-weight model): what an HTTP release/restore relies on.

Health while loading, prompt-cache reuse, a slot saved, the server restarted and the slot
restored, and the error answers. Needs the binary that tools/llama_server.py caches, and
skips without it; with VRAMLOCK_BUILD_LLAMA=1 it builds it first (minutes).
docs/llama-server.md records the figures and the commands.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from helpers import ROOT
from helpers.llama import call, llama_binary, needs_llama
from helpers.net import free_port
from helpers.processes import Spawn

BINARY = llama_binary()

pytestmark = [needs_llama(BINARY), pytest.mark.timeout(60)]

# Long enough that a reused prefix is unmistakable, short enough for a 1024-token context.
PROMPT = "The quick brown fox jumps over the lazy dog. " * 20
READY_TIMEOUT = 30.0


@dataclass
class Server:
    proc: subprocess.Popen[str]
    port: int
    log: Path

    def call(self, method: str, path: str, body: object = None) -> tuple[int, Any]:
        """One request on a fresh connection: (status, decoded JSON body)."""
        return call(self.port, method, path, body)

    def complete(self) -> dict[str, Any]:
        status, reply = self.call("POST", "/completion", {"prompt": PROMPT, "n_predict": 4})
        assert status == 200, reply
        return reply  # type: ignore[no-any-return]

    def slot(self, action: str, filename: str) -> tuple[int, Any]:
        return self.call("POST", f"/slots/0?action={action}", {"filename": filename})

    def wait_ready(self) -> list[int]:
        """Poll /health until 200; returns the statuses seen (503 while the model loads)."""
        seen: list[int] = []
        end = time.monotonic() + READY_TIMEOUT
        while not seen or seen[-1] != 200:
            assert self.proc.poll() is None, f"exited {self.proc.returncode}: {self.tail()}"
            assert time.monotonic() < end, f"not ready in {READY_TIMEOUT} s: {self.tail()}"
            try:
                seen.append(self.call("GET", "/health")[0])
            except ConnectionRefusedError:
                time.sleep(0.01)  # not listening yet
        return seen

    def stop(self) -> int:
        """SIGTERM, as a release would, and wait for the exit."""
        os.killpg(self.proc.pid, signal.SIGTERM)
        return self.proc.wait(10)

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-2000:]


Serve = Callable[..., Server]


@pytest.fixture
def serve(spawn: Spawn, model: Path, tmp_path: Path) -> Serve:
    """Start llama-server on a port; the `spawn` fixture kills its group at the end."""
    assert BINARY is not None
    count = 0

    def start(port: int, *extra: str) -> Server:
        nonlocal count
        count += 1
        log = tmp_path / f"server-{count}.log"
        args = [str(BINARY), "-m", str(model), "--host", "127.0.0.1", "--port", str(port)]
        # One slot, a small context and one thread: fast to load, light on a shared CI box.
        args += ["-np", "1", "-c", "1024", "-t", "1", *extra]
        with open(log, "w") as out:
            proc = spawn(args, stdout=out, stderr=subprocess.STDOUT)
        return Server(proc, port, log)

    return start


def test_health_then_repeated_prompt_served_from_cache(serve: Serve) -> None:
    server = serve(free_port())
    seen = server.wait_ready()
    assert set(seen) <= {503, 200}, seen
    assert server.call("GET", "/health") == (200, {"status": "ok"})

    cold = server.complete()
    assert cold["timings"]["cache_n"] == 0
    prompt_n = cold["timings"]["prompt_n"]
    assert prompt_n == cold["tokens_evaluated"] > 100

    warm = server.complete()
    # All but the last prompt token: that one is evaluated again for its logits.
    assert warm["timings"]["cache_n"] == prompt_n - 1
    assert warm["timings"]["prompt_n"] == 1


def test_saved_slot_restores_the_prompt_cache_after_a_restart(serve: Serve, tmp_path: Path) -> None:
    slots = tmp_path / "slots"
    slots.mkdir()
    port = free_port()
    server = serve(port, "--slot-save-path", str(slots))
    server.wait_ready()
    prompt_n = server.complete()["timings"]["prompt_n"]

    status, saved = server.slot("save", "slot0.bin")
    assert status == 200, saved
    assert saved["id_slot"] == 0 and saved["filename"] == "slot0.bin"
    # The prompt and all but the last generated token are in the slot's cache.
    assert saved["n_saved"] == prompt_n + 4 - 1
    assert saved["n_written"] == (slots / "slot0.bin").stat().st_size > 0
    assert saved["timings"]["save_ms"] > 0  # the save was timed: it wrote the file
    assert server.stop() == 0

    # The same port at once: llama-server's listener takes it back without TIME_WAIT trouble.
    server = serve(port, "--slot-save-path", str(slots))
    server.wait_ready()
    status, restored = server.slot("restore", "slot0.bin")
    assert status == 200, restored
    assert restored["n_restored"] == saved["n_saved"]
    assert restored["n_read"] == saved["n_written"]
    assert restored["timings"]["restore_ms"] > 0

    again = server.complete()
    assert again["timings"]["cache_n"] == prompt_n - 1
    assert again["timings"]["prompt_n"] == 1


def test_slot_actions_answer_errors_as_json(serve: Serve, tmp_path: Path) -> None:
    bare = serve(free_port())
    bare.wait_ready()
    status, reply = bare.slot("save", "x.bin")
    assert status == 501 and reply["error"]["type"] == "not_supported_error"

    slots = tmp_path / "slots"
    slots.mkdir()
    server = serve(free_port(), "--slot-save-path", str(slots))
    server.wait_ready()
    for filename in ("missing.bin", "../escape.bin"):
        status, reply = server.slot("restore", filename)
        assert status == 400 and reply["error"]["code"] == 400, reply
    assert server.call("POST", "/slots/0?action=nonsense", {"filename": "x.bin"})[0] == 400
    # A failed restore leaves the slot usable and empty.
    assert server.complete()["timings"]["cache_n"] == 0


def test_a_second_server_on_a_taken_port_exits(serve: Serve) -> None:
    port = free_port()
    first = serve(port)
    first.wait_ready()
    second = serve(port)
    assert second.proc.wait(READY_TIMEOUT) == 1
    assert "couldn't bind" in second.tail()
    assert first.call("GET", "/health")[0] == 200


@pytest.mark.skipif(shutil.which("ldd") is None, reason="no ldd here")
def test_it_links_the_libraries_the_docs_name() -> None:
    """docs/llama-server.md names every shared library the cached binary loads."""
    out = subprocess.run(
        ["ldd", str(BINARY)], capture_output=True, text=True, timeout=30, check=True
    ).stdout
    linked = {line.split()[0] for line in out.splitlines() if "=>" in line}
    doc = (ROOT / "docs/llama-server.md").read_text()
    assert set(re.findall(r"`(lib[\w+-]+\.so\.\d+)`", doc)) == linked, out
