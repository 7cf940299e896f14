"""A peer's requests (``PEER/MODEL``) take the exchange's way as a local model's do:
listed in /api/events' ``inflight`` while they run, ended by
``POST /api/inflight/ID/cancel``, and counted in /metrics and /api/metrics/activity,
under the name the client asked for, as llama-swap lists and counts them.

The peer is tests/echo_server.py, started by the test itself: one asked to ``hold``
says ``NAME saw its client go`` on its stderr (which the test reads) once serve closed
its connection to it, the witness that a cancel reached the peer.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from helpers.net import accepts, free_port
from helpers.processes import Spawn, wait_until
from helpers.serve import ECHO, Events, call, call_json, echo_model, start, write_config

pytest.importorskip("aiohttp")

pytestmark = pytest.mark.timeout(90)

FIRST = b'data: {"choices": [{"delta": {"content": "peer-p"}}]}\n\n'


@pytest.fixture
def pool() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(2) as executor:
        yield executor


def serve_with_peer(spawn: Spawn, tmp_path: Path, arena: Path) -> tuple[int, subprocess.Popen[str]]:
    """serve with peer p (model ``far``) and a local model: serve's port, and the peer."""
    far = free_port()
    peer = spawn([sys.executable, str(ECHO), str(far), "peer-p"])
    wait_until(lambda: accepts(far), 30)
    text = (f"peers:\n  p:\n    proxy: http://127.0.0.1:{far}\n    models: [far]\n"
            "models:\n" + echo_model("m", "release: restart"))  # fmt: skip
    _, port = start(spawn, write_config(tmp_path, text), arena)
    return port, peer


def said(peer: subprocess.Popen[str], line: str) -> None:
    """Wait until the peer says ``line`` on its stderr."""
    assert peer.stderr is not None
    while (got := peer.stderr.readline()) != line:
        assert got, f"the peer ended before saying {line!r}"


def upsert(data: dict[str, Any]) -> bool:
    return bool(data["operation"] == "upsert")


def cancel_listed(events: Events, port: int, began: bool) -> dict[str, Any]:
    """Cancel the request that /api/events lists (once its answer ``began``)."""
    found: dict[str, Any] = events.until("inflight", lambda d: upsert(d) and (
        not began or d["request"]["resp_bytes"] > 0))["request"]  # fmt: skip
    assert call_json(port, "POST", f"/api/inflight/{found['id']}/cancel") == {"msg": "ok"}
    return found


def counted(port: int, model: str, status: int) -> int:
    """/metrics' count of ``model``'s requests answered ``status``."""
    _, _, text = call(port, "GET", "/metrics")
    mark = f'vramlock_serve_requests_total{{model="{model}",status="{status}"}} '
    lines = [line for line in text.decode().splitlines() if line.startswith(mark)]
    return int(float(lines[0][len(mark) :])) if lines else 0


def test_a_peer_s_stream_is_listed_cancelled_and_counted(
    spawn: Spawn, tmp_path: Path, arena: Path, pool: ThreadPoolExecutor
) -> None:
    port, peer = serve_with_peer(spawn, tmp_path, arena)
    events = Events(port)
    try:
        assert events.until("inflight") == {"operation": "snapshot", "requests": []}
        asked = {"model": "p/far", "stream": True, "hold": True}
        pending = pool.submit(call, port, "POST", "/v1/chat/completions", asked)
        found = cancel_listed(events, port, began=True)
        assert (found["model"], found["req_path"], found["method"]) == (
            "p/far", "/v1/chat/completions", "POST")  # fmt: skip
        assert found["resp_headers"]["Content-Type"] == "text/event-stream"
        status, headers, body = pending.result(30)  # read to its end: no IncompleteRead
        assert (status, headers["Content-Type"], body) == (200, "text/event-stream", FIRST)
        said(peer, "peer-p saw its client go\n")
        assert events.until("inflight", lambda d: not upsert(d))["id"] == found["id"]
        done = call_json(port, "GET", "/api/metrics/activity")["data"][0]
        assert (done["model"], done["req_path"], done["resp_status_code"]) == (
            "p/far", "/v1/chat/completions", 200)  # fmt: skip
        assert counted(port, "p/far", 200) == 1
    finally:
        events.close()


def test_a_peer_s_request_cancelled_before_its_answer_gets_a_502(
    spawn: Spawn, tmp_path: Path, arena: Path, pool: ThreadPoolExecutor
) -> None:
    port, peer = serve_with_peer(spawn, tmp_path, arena)
    events = Events(port)
    try:
        asked = {"model": "p/far", "hold": True}
        pending = pool.submit(call, port, "POST", "/v1/completions", asked)
        said(peer, "peer-p got POST /v1/completions\n")  # it reached the peer
        cancel_listed(events, port, began=False)
        status, _, body = pending.result(30)
        assert status == 502
        assert json.loads(body)["error"]["message"] == "request cancelled"
        said(peer, "peer-p saw its client go\n")
        done = call_json(port, "GET", "/api/metrics/activity")["data"][0]
        assert (done["model"], done["resp_status_code"], done["error_msg"]) == (
            "p/far", 502, "request cancelled")  # fmt: skip
        assert counted(port, "p/far", 502) == 1
    finally:
        events.close()


def test_a_peer_s_answered_requests_are_counted(spawn: Spawn, tmp_path: Path, arena: Path) -> None:
    """An answer whole, by the bare name, and through /upstream: each counted under the
    name it was asked by (llama-swap's), not the peer's own name for it."""
    port, _ = serve_with_peer(spawn, tmp_path, arena)
    assert call_json(port, "POST", "/v1/chat/completions", {"model": "far"})["id"] == "peer-p"
    assert call_json(port, "POST", "/v1/chat/completions", {"model": "p/far"})["id"] == "peer-p"
    got = call_json(port, "POST", "/upstream/p/far/v1/embeddings", {"input": "x"})
    assert got["path"] == "/v1/embeddings"
    assert (counted(port, "far", 200), counted(port, "p/far", 200)) == (1, 2)
    page = call_json(port, "GET", "/api/metrics/activity")
    assert [(e["model"], e["req_path"]) for e in page["data"]] == [
        ("p/far", "/v1/embeddings"), ("p/far", "/v1/chat/completions"),
        ("far", "/v1/chat/completions")]  # fmt: skip
