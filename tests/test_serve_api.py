"""``vramlock serve``'s llama-swap /api/events (Server-Sent Events) and /api/version.

The models are tests/echo_server.py: it says ``NAME listening`` on stdout and each
request it gets on stderr, which reach serve's upstream log.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
from helpers.processes import Spawn
from helpers.serve import Events, call, call_json, echo_model, start, write_config

import vramlock

pytest.importorskip("aiohttp")

pytestmark = pytest.mark.timeout(90)


def states(data: list[dict[str, Any]]) -> dict[str, str]:
    return {m["id"]: m["state"] for m in data}


CONFIG = """\
peers:
  remote: {proxy: 'http://127.0.0.1:9', models: [x, y]}
profiles:
  fast: {description: quick, pins: {chat: m}}
models:
"""


def test_each_type_is_sent_at_connect(spawn: Spawn, tmp_path: Path, arena: Path) -> None:
    text = "ui: {activity: {session_id: [X-Mine]}}\n" + CONFIG + echo_model(
        "m", "release: restart", "name: Model M", "description: the first",
        "aliases: [mm, m2]", "capabilities: {in: [text, image], out: [text], tools: true,"
        " context: 8192}") + echo_model("a", "release: restart", "unlisted: true")  # fmt: skip
    _, port = start(spawn, write_config(tmp_path, text), arena)
    events = Events(port)
    try:
        headers = dict(events.reply.getheaders())
        assert headers["Content-Type"] == "text/event-stream"
        assert headers["Cache-Control"] == "no-cache"
        assert headers["X-Accel-Buffering"] == "no"
        kind, proxy = events.next()
        assert kind == "logData" and proxy["source"] == "proxy"
        assert "[INFO] serving m, a at http://127.0.0.1:" in proxy["data"]
        assert events.next() == ("logData", {"source": "upstream", "data": ""})
        assert events.next() == ("modelStatus", [
            {"id": "a", "name": "", "description": "", "state": "stopped", "unlisted": True,
             "peerID": ""},
            {"id": "m", "name": "Model M", "description": "the first", "state": "stopped",
             "unlisted": False, "peerID": "", "aliases": ["mm", "m2"],
             "capabilities": {"vision": True, "function_calling": True},
             "context_length": 8192},
            {"id": "remote/x", "name": "", "description": "", "state": "", "unlisted": False,
             "peerID": "remote"},
            {"id": "remote/y", "name": "", "description": "", "state": "", "unlisted": False,
             "peerID": "remote"},
        ])  # fmt: skip
        # the page's settings: the config's ui (its session headers)
        assert events.next() == ("uiConfig", {"activity": {"session_id": ["X-Mine"]}})
        assert events.next() == ("profileChanged", {"active": None})
        assert events.next() == ("inflight", {"operation": "snapshot", "requests": []})
    finally:
        events.close()


def test_states_and_the_model_s_output_follow_as_they_change(
    spawn: Spawn, tmp_path: Path, arena: Path
) -> None:
    text = "models:\n" + echo_model("m", "release: restart") + echo_model("b", "release: restart")
    _, port = start(spawn, write_config(tmp_path, text), arena)
    events = Events(port)
    try:
        assert states(events.until("modelStatus")) == {"b": "stopped", "m": "stopped"}
        call_json(port, "POST", "/v1/completions", {"model": "m"})  # starts it
        now = events.until("modelStatus", lambda d: states(d)["m"] == "ready")
        assert states(now)["b"] == "stopped"
        events.output("m got POST /v1/completions\n")
        call_json(port, "POST", "/v1/embeddings", {"model": "m"})
        assert events.output("m got POST /v1/embeddings\n") == "m got POST /v1/embeddings\n"
        status, _, body = call(port, "POST", "/api/models/unload/m")
        assert (status, body) == (200, b"OK")
        # released: its wrapper still runs, it holds no GPU and its next request loads it
        events.until("modelStatus", lambda d: states(d) == {"b": "stopped", "m": "stopped"})
    finally:
        events.close()


def test_a_profile_switched_is_sent(spawn: Spawn, tmp_path: Path, arena: Path) -> None:
    text = CONFIG + echo_model("m", "release: restart")
    _, port = start(spawn, write_config(tmp_path, text), arena)
    events = Events(port)
    try:
        assert events.until("profileChanged") == {"active": None}
        assert call_json(port, "PUT", "/api/profiles/active", {"name": "fast"}) == {
            "active": "fast"}  # fmt: skip
        assert events.until("profileChanged") == {"active": "fast"}
        call_json(port, "PUT", "/api/profiles/active", {"name": None})
        assert events.until("profileChanged") == {"active": None}
    finally:
        events.close()


def test_version_says_vramlock_s(spawn: Spawn, tmp_path: Path, arena: Path) -> None:
    _, port = start(spawn, write_config(tmp_path, "models:\n" + echo_model("m")), arena)
    status, headers, body = call(port, "GET", "/api/version")
    assert (status, headers["Content-Type"]) == (200, "application/json; charset=utf-8")
    assert json.loads(body) == {"version": vramlock.__version__, "commit": "", "build_date": ""}


def test_both_want_the_api_key(spawn: Spawn, tmp_path: Path, arena: Path) -> None:
    text = "apiKeys: [sk-1]\nmodels:\n" + echo_model("m", "release: restart")
    _, port = start(spawn, write_config(tmp_path, text), arena)
    for path in ("/api/events", "/api/version"):
        status, _, body = call(port, "GET", path)
        assert status == 401, body
        assert json.loads(body)["error"]["type"] == "authentication_error"
    assert call(port, "GET", "/api/version", headers={"x-api-key": "sk-1"})[0] == 200
    events = Events(port, {"Authorization": "Bearer sk-1"})
    try:
        assert events.next()[0] == "logData"
    finally:
        events.close()


def test_head_is_answered_at_once_and_another_method_is_a_405(
    spawn: Spawn, tmp_path: Path, arena: Path
) -> None:
    _, port = start(spawn, write_config(tmp_path, "models:\n" + echo_model("m")), arena)
    status, headers, body = call(port, "HEAD", "/api/events")
    assert (status, headers["Content-Type"], body) == (200, "text/event-stream", b"")
    for path in ("/api/events", "/api/version"):
        for method in ("POST", "PUT", "DELETE"):
            status, headers, body = call(port, method, path, {"model": "m"})
            assert (status, headers.get("Allow")) == (405, "GET, HEAD"), body
            assert json.loads(body)["error"]["message"] == (
                f"{method} {path}: method not allowed; allowed: GET, HEAD")  # fmt: skip


def test_streams_end_when_serve_ends(spawn: Spawn, tmp_path: Path, arena: Path) -> None:
    """A client that went away is forgotten; one still there sees its stream end (its
    last chunk, not a cut connection), and serve does not wait for it."""
    text = "models:\n" + echo_model("m", "release: restart")
    proc, port = start(spawn, write_config(tmp_path, text), arena)
    gone = Events(port)
    gone.until("inflight")
    gone.close()
    events = Events(port)
    events.until("inflight")
    began = time.monotonic()
    proc.terminate()
    assert events.reply.read() == b""  # the rest: nothing, then the stream's end
    proc.wait(10)
    took = time.monotonic() - began
    events.close()
    _, err = proc.communicate()
    assert took < 5, took
    assert "Traceback" not in err and "Error" not in err, err


def test_serve_keeps_no_thread_once_its_blocking_work_is_done(
    spawn: Spawn, tmp_path: Path, arena: Path
) -> None:
    # A scrape, an unload and a model's restart block, and run off the event loop. In a
    # pool's threads, which stay, they left serve with threads for good: each one alive
    # when serve is SIGKILLed makes the kernel send the wrappers their parent-death
    # signal once more, in the middle of the cleanup the first one began.
    text = "models:\n" + echo_model("m", "release: restart") + echo_model("b", "release: restart")
    proc, port = start(spawn, write_config(tmp_path, text), arena)
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    assert call(port, "POST", "/v1/chat/completions", body)[0] == 200
    assert call(port, "POST", "/v1/chat/completions", dict(body, model="b"))[0] == 200
    assert call(port, "GET", "/metrics")[0] == 200
    assert call(port, "POST", "/api/models/unload/m")[0] == 200
    assert call(port, "GET", "/unload")[0] == 200

    def threads() -> int:
        return len(os.listdir(f"/proc/{proc.pid}/task"))

    end = time.monotonic() + 10
    while threads() > 1 and time.monotonic() < end:
        time.sleep(0.05)
    assert threads() == 1, os.listdir(f"/proc/{proc.pid}/task")
