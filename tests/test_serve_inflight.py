"""``vramlock serve``'s requests in progress, as llama-swap's: listed in /api/events'
``inflight`` and ended by ``POST /api/inflight/ID/cancel``.

Each test runs twice: through front.py (the common request is taken from the bytes)
and through aiohttp (API keys, and ``Connection: close``, which front.py hands over). The models are
tests/echo_server.py; one asked to ``hold`` says ``NAME saw its client go`` (in serve's
upstream log) once its connection is closed: the witness that a cancelled request
really ended at the model's server, not just at serve.
"""

from __future__ import annotations

import json
import signal
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from helpers.net import free_port
from helpers.processes import Spawn
from helpers.serve import ECHO, Events, call, call_json, echo_model, start, write_config

pytest.importorskip("aiohttp")

pytestmark = pytest.mark.timeout(90)

KEY = {"Authorization": "Bearer sk-1"}
PATHS = pytest.mark.parametrize("keys", [False, True], ids=["front", "aiohttp"])
# A model's load, in seconds, that a request waits for.
LOAD = 8.0


@pytest.fixture
def pool() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(2) as executor:
        yield executor


def serve(spawn: Spawn, tmp_path: Path, arena: Path, keys: bool) -> tuple[int, dict[str, str]]:
    """serve with one model, m, already started (the next request finds it resident,
    and a kept-alive connection to it): its port, and the headers a request needs."""
    text = ("apiKeys: [sk-1]\n" if keys else "") + "models:\n"
    _, port = start(spawn, write_config(tmp_path, text + echo_model("m", "release: restart")),
                    arena)  # fmt: skip
    auth = {**KEY, "Connection": "close"} if keys else {}
    call_json(port, "POST", "/v1/chat/completions", {"model": "m"}, headers=auth)
    return port, auth


def upsert(data: dict[str, Any]) -> bool:
    return bool(data["operation"] == "upsert")


def test_a_request_in_progress_is_listed_with_its_answer_so_far(
    spawn: Spawn, tmp_path: Path, arena: Path, pool: ThreadPoolExecutor
) -> None:
    port, _ = serve(spawn, tmp_path, arena, keys=False)
    events = Events(port)
    try:
        assert events.until("inflight") == {"operation": "snapshot", "requests": []}
        asked = {"model": "m", "stream": True, "hold": True}
        headers = {"X-Session-Id": "s-1", "x-api-key": "secret", "X-Forwarded-For": "10.1.2.3"}
        pending = pool.submit(call, port, "POST", "/v1/chat/completions?x=1", asked, headers)
        added = events.until("inflight", upsert)["request"]
        assert set(added) == {"id", "timestamp", "model", "req_path", "method", "req_headers",
                              "remote_ip", "resp_headers", "resp_bytes", "elapsed_ms"}  # fmt: skip
        assert (added["model"], added["req_path"], added["method"]) == (
            "m", "/v1/chat/completions", "POST")  # fmt: skip
        assert added["req_headers"]["X-Session-Id"] == "s-1"
        assert added["req_headers"]["X-Api-Key"] == "[REDACTED]"
        assert added["remote_ip"] == "10.1.2.3"
        assert (added["resp_headers"], added["resp_bytes"]) == ({}, 0)
        assert isinstance(added["elapsed_ms"], int) and added["timestamp"][:2] == "20"
        begun = events.until("inflight", lambda d: upsert(d) and d["request"]["resp_bytes"])
        assert begun["request"]["id"] == added["id"]
        assert begun["request"]["resp_headers"]["Content-Type"] == "text/event-stream"
        first = b'data: {"choices": [{"delta": {"content": "m"}}]}\n\n'
        assert begun["request"]["resp_bytes"] == len(first)
        later = Events(port)  # a newcomer's snapshot lists it
        try:
            snapshot = later.until("inflight")
            assert snapshot["operation"] == "snapshot"
            assert [r["id"] for r in snapshot["requests"]] == [added["id"]]
        finally:
            later.close()
        call_json(port, "POST", f"/api/inflight/{added['id']}/cancel")
        pending.result(30)
        assert events.until("inflight", lambda d: not upsert(d)) == {
            "operation": "remove", "id": added["id"]}  # fmt: skip
        assert events.until("activity") == {"id": 2}  # recorded (the warm-up was the first)
    finally:
        events.close()


def _cancel_when_listed(
    events: Events, port: int, auth: dict[str, str], began: bool
) -> dict[str, Any]:
    """Cancel the request that /api/events lists (once its answer ``began``)."""
    found: dict[str, Any] = events.until("inflight", lambda d: upsert(d) and (
        not began or d["request"]["resp_bytes"] > 0))["request"]  # fmt: skip
    assert call_json(port, "POST", f"/api/inflight/{found['id']}/cancel", headers=auth) == {
        "msg": "ok"}  # fmt: skip
    return found


@PATHS
def test_a_stream_cancelled_ends_where_it_stands(
    spawn: Spawn, tmp_path: Path, arena: Path, pool: ThreadPoolExecutor, keys: bool
) -> None:
    """As llama-swap's cancelled request: the stream ends (its last chunk, not a cut
    connection), without the rest, and the model's server sees its connection close."""
    port, auth = serve(spawn, tmp_path, arena, keys)
    events = Events(port, auth)
    try:
        asked = {"model": "m", "stream": True, "hold": True}
        pending = pool.submit(call, port, "POST", "/v1/chat/completions", asked, auth)
        found = _cancel_when_listed(events, port, auth, began=True)
        status, headers, body = pending.result(30)  # read to its end: no IncompleteRead
        assert (status, headers["Content-Type"]) == (200, "text/event-stream")
        assert body == b'data: {"choices": [{"delta": {"content": "m"}}]}\n\n'
        events.output("m saw its client go\n")
        assert events.until("inflight", lambda d: not upsert(d))["id"] == found["id"]
        done = call_json(port, "GET", "/api/metrics/activity", headers=auth)["data"][0]
        assert (done["req_path"], done["resp_status_code"]) == ("/v1/chat/completions", 200)
        assert done["resp_content_type"] == "text/event-stream"
    finally:
        events.close()


@PATHS
def test_a_request_cancelled_before_its_answer_gets_a_502(
    spawn: Spawn, tmp_path: Path, arena: Path, pool: ThreadPoolExecutor, keys: bool
) -> None:
    port, auth = serve(spawn, tmp_path, arena, keys)
    events = Events(port, auth)
    try:
        asked = {"model": "m", "hold": True}
        pending = pool.submit(call, port, "POST", "/v1/chat/completions", asked, auth)
        events.output("m got POST /v1/chat/completions\n")  # it reached the model's server
        _cancel_when_listed(events, port, auth, began=False)
        status, _, body = pending.result(30)
        assert status == 502
        assert json.loads(body)["error"] == {"message": "request cancelled", "type": "server_error",
                                             "param": None, "code": "bad_gateway"}  # fmt: skip
        events.output("m saw its client go\n")
        done = call_json(port, "GET", "/api/metrics/activity", headers=auth)["data"][0]
        assert (done["resp_status_code"], done["error_msg"]) == (502, "request cancelled")
    finally:
        events.close()


def test_the_first_request_of_a_connection_to_the_model_cancelled(
    spawn: Spawn, tmp_path: Path, arena: Path, pool: ThreadPoolExecutor
) -> None:
    """A model's first request (no kept-alive connection to it yet: front.py's task)."""
    path = write_config(tmp_path, "models:\n" + echo_model("m", "release: restart"))
    _, port = start(spawn, path, arena)
    events = Events(port)
    try:
        pending = pool.submit(call, port, "POST", "/v1/completions", {"model": "m", "hold": True})
        events.output("m got POST /v1/completions\n")
        _cancel_when_listed(events, port, {}, began=False)
        assert pending.result(30)[0] == 502
        events.output("m saw its client go\n")
        # the model is served on: the next request is answered
        assert call_json(port, "POST", "/v1/completions", {"model": "m"})["id"] == "m"
    finally:
        events.close()


@PATHS
def test_an_unknown_request_is_a_404(spawn: Spawn, tmp_path: Path, arena: Path, keys: bool) -> None:
    port, auth = serve(spawn, tmp_path, arena, keys)
    status, _, body = call(port, "POST", "/api/inflight/12345/cancel", headers=auth)
    assert status == 404
    assert json.loads(body)["error"]["message"] == "inflight request not found"
    status, headers, _ = call(port, "GET", "/api/inflight/1/cancel", headers=auth)
    assert (status, headers.get("Allow")) == (405, "POST")


def test_cancel_wants_the_api_key(
    spawn: Spawn, tmp_path: Path, arena: Path, pool: ThreadPoolExecutor
) -> None:
    port, auth = serve(spawn, tmp_path, arena, keys=True)
    events = Events(port, auth)
    try:
        asked = {"model": "m", "stream": True, "hold": True}
        pending = pool.submit(call, port, "POST", "/v1/chat/completions", asked, auth)
        # Once its answer began: cancelled before, it would be a 502.
        found = events.until("inflight", lambda d: upsert(d) and d["request"]["resp_bytes"] > 0)[
            "request"
        ]
        status, headers, _ = call(port, "POST", f"/api/inflight/{found['id']}/cancel")
        assert (status, headers["WWW-Authenticate"]) == (401, 'Basic realm="vramlock"')
        other = Events(port, auth)
        try:
            assert [r["id"] for r in other.until("inflight")["requests"]] == [found["id"]]
        finally:
            other.close()
        call_json(port, "POST", f"/api/inflight/{found['id']}/cancel", headers=auth)
        assert pending.result(30)[0] == 200
    finally:
        events.close()


@PATHS
def test_a_request_queued_for_a_loading_model_cancelled_answers_at_once(
    spawn: Spawn, tmp_path: Path, arena: Path, pool: ThreadPoolExecutor, keys: bool
) -> None:
    """A request waiting for its model to load, cancelled: answered at once (not once the
    model is up), and never sent to the model. The witness is the model's own output,
    written to a file of the test's."""
    said = tmp_path / "slow.out"
    port_of_model = free_port()
    cmd = f"{sys.executable} {ECHO} {port_of_model} slow {LOAD}"
    text = ("apiKeys: [sk-1]\n" if keys else "") + (
        f"models:\n  slow:\n    cmd: sh -c 'exec {cmd} >>{said} 2>&1'\n"
        f"    proxy: http://127.0.0.1:{port_of_model}\n    release: restart\n")  # fmt: skip
    _, port = start(spawn, write_config(tmp_path, text), arena)
    auth = {**KEY, "Connection": "close"} if keys else {}
    events = Events(port, auth)
    try:
        asked = {"model": "slow", "n": 1}
        pending = pool.submit(call, port, "POST", "/v1/chat/completions", asked, auth)
        _cancel_when_listed(events, port, auth, began=False)
        status, _, body = pending.result(LOAD / 2)
        assert (status, json.loads(body)["error"]["message"]) == (502, "request cancelled")
        assert "slow listening" not in _read(said)  # answered before the model was up
        # once the model is up, another request reaches it; the cancelled one never did
        assert call_json(port, "POST", "/v1/completions", {"model": "slow"}, headers=auth)[
            "id"] == "slow"  # fmt: skip
        assert "slow got POST /v1/completions" in _read(said)
        assert "slow got POST /v1/chat/completions" not in _read(said)
    finally:
        events.close()


def _read(path: Path) -> str:
    return path.read_text() if path.exists() else ""


@PATHS
def test_a_request_waiting_for_a_load_when_serve_ends_gets_a_json_error(
    spawn: Spawn, tmp_path: Path, arena: Path, pool: ThreadPoolExecutor, keys: bool
) -> None:
    """serve interrupted while a request waits for its model to load: the client is
    answered (a JSON 503 saying why), not left with an empty reply."""
    port_of_model = free_port()
    cmd = f"{sys.executable} {ECHO} {port_of_model} slow 60"
    text = ("apiKeys: [sk-1]\n" if keys else "") + (
        f"models:\n  slow:\n    cmd: {cmd}\n    proxy: http://127.0.0.1:{port_of_model}\n"
        "    release: restart\n")  # fmt: skip
    proc, port = start(spawn, write_config(tmp_path, text), arena)
    auth = {**KEY, "Connection": "close"} if keys else {}
    events = Events(port, auth)
    try:
        pending = pool.submit(call, port, "POST", "/v1/chat/completions", {"model": "slow"},
                              auth)  # fmt: skip
        events.until("inflight", upsert)
    finally:
        events.close()
    proc.send_signal(signal.SIGINT)
    status, headers, body = pending.result(30)
    assert (status, headers["Content-Type"]) == (503, "application/json; charset=utf-8")
    assert json.loads(body)["error"]["message"] == "serve is ending: the request was not answered"
    assert proc.wait(30) == 0
