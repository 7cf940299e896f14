"""``vramlock serve``'s remaining llama-swap routes: /v/ and /audioapi/ (their prefix
stripped), /comfyui/, /upstream/MODEL's redirect, /wol-health, the root, CORS preflights,
and 405 for a method that a route has not.

The models are tests/echo_server.py, which answers what it received.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers.processes import Spawn, wait_until
from helpers.serve import call, call_json, echo_model, start, write_config

pytest.importorskip("aiohttp")

pytestmark = pytest.mark.timeout(90)


def error(body: bytes) -> str:
    message = json.loads(body)["error"]["message"]
    assert isinstance(message, str)
    return message


@pytest.mark.parametrize(
    ("sent", "received"),
    [("/v/chat/completions", "/chat/completions"),
     ("/v/embeddings?x=1", "/embeddings?x=1"),
     ("/audioapi/v1/tasks/run", "/v1/tasks/run")],
)  # fmt: skip
def test_a_stripped_prefix_is_taken_off_before_the_model_s_server_gets_it(
    spawn: Spawn, tmp_path: Path, arena: Path, sent: str, received: str
) -> None:
    path = write_config(tmp_path, "models:\n" + echo_model("m", "release: restart"))
    _, port = start(spawn, path, arena)
    got = call_json(port, "POST", sent, {"model": "m"})
    assert (got["id"], got["path"]) == ("m", received)
    status, _, body = call(port, "POST", sent, {"model": "nope"})
    assert (status, error(body)) == (404, "model 'nope' not found")
    metrics = call(port, "GET", "/metrics")[2].decode()
    assert 'vramlock_serve_requests_total{model="m",status="200"} 1' in metrics


def test_a_post_to_audio_voices_is_routed_by_its_body(
    spawn: Spawn, tmp_path: Path, arena: Path
) -> None:
    path = write_config(tmp_path, "models:\n" + echo_model("m", "release: restart"))
    _, port = start(spawn, path, arena)
    got = call_json(port, "POST", "/v1/audio/voices", {"model": "m"})
    assert (got["method"], got["path"]) == ("POST", "/v1/audio/voices")
    assert call_json(port, "GET", "/v1/audio/voices?model=m")["method"] == "GET"


def test_comfyui_reaches_comfyui_auto_and_only_its_root_starts_it(
    spawn: Spawn, tmp_path: Path, arena: Path
) -> None:
    path = write_config(tmp_path, "models:\n" + echo_model("comfyui_auto", "release: restart"))
    _, port = start(spawn, path, arena)
    status, _, body = call(port, "GET", "/comfyui/api/jobs")
    assert (status, error(body)) == (
        409, "model comfyui_auto is not loaded; only /comfyui/ can start it")  # fmt: skip
    status, headers, _ = call(port, "GET", "/comfyui?a=1")
    assert (status, headers["Location"]) == (301, "/comfyui/?a=1")
    status, headers, _ = call(port, "POST", "/comfyui", {})
    assert (status, headers["Location"]) == (308, "/comfyui/")
    assert call_json(port, "GET", "/comfyui/?a=1")["path"] == "/?a=1"
    wait_until(lambda: call_json(port, "GET", "/running")["running"] != [], 30)
    got = call_json(port, "POST", "/comfyui/prompt", {"x": 1})
    assert (got["method"], got["path"]) == ("POST", "/prompt")


def test_comfyui_without_its_model_is_a_404(spawn: Spawn, tmp_path: Path, arena: Path) -> None:
    path = write_config(tmp_path, "models:\n" + echo_model("m", "release: restart"))
    _, port = start(spawn, path, arena)
    status, _, body = call(port, "GET", "/comfyui/")
    assert (status, error(body)) == (404, "local model comfyui_auto not found")


def test_comfyui_auto_may_take_50_requests_at_once(tmp_path: Path) -> None:
    from vramlock.cli import parse_duration
    from vramlock.serve.config import load

    text = "models:\n" + echo_model("comfyui_auto") + echo_model("m", "concurrencyLimit: 3")
    config = load(str(write_config(tmp_path, text)), parse_duration)
    assert config.models["comfyui_auto"].concurrency == 50
    assert config.models["m"].concurrency == 3


def test_upstream_model_without_its_slash_is_redirected(
    spawn: Spawn, tmp_path: Path, arena: Path
) -> None:
    text = "models:\n" + echo_model("org/m", "release: restart", "aliases: [mm]")
    _, port = start(spawn, write_config(tmp_path, text), arena)
    for method, sent, status, location in [
        ("GET", "/upstream/org/m", 301, "/upstream/org/m/"),
        ("GET", "/upstream/mm?x=1", 301, "/upstream/mm/?x=1"),
        ("POST", "/upstream/mm", 308, "/upstream/mm/"),
    ]:
        got, headers, _ = call(port, method, sent, {} if method == "POST" else None)
        assert (got, headers["Location"]) == (status, location)
    assert call_json(port, "GET", "/upstream/mm/")["path"] == "/"
    status, _, body = call(port, "GET", "/upstream/nope")
    assert (status, error(body)) == (404, "model 'nope' not found")


def test_the_open_routes_answer_without_a_key(spawn: Spawn, tmp_path: Path, arena: Path) -> None:
    text = "apiKeys: [sk-1]\nmodels:\n" + echo_model("m", "release: restart")
    _, port = start(spawn, write_config(tmp_path, text), arena)
    assert call(port, "GET", "/wol-health")[::2] == (200, b"OK")
    status, headers, _ = call(port, "GET", "/")
    assert (status, headers["Location"]) == (302, "/ui")
    status, headers, _ = call(port, "OPTIONS", "/v1/chat/completions", headers={
        "Origin": "http://elsewhere", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type, bad header"})  # fmt: skip
    assert status == 204
    assert headers["Access-Control-Allow-Origin"] == "*"
    assert headers["Access-Control-Allow-Headers"] == "authorization, content-type"
    assert "POST" in headers["Access-Control-Allow-Methods"]
    assert call(port, "GET", "/running")[0] == 401
    assert call(port, "GET", "/upstream/m/")[0] == 401


@pytest.mark.parametrize(
    ("method", "path", "allowed"),
    [("POST", "/ui/", "GET, HEAD"), ("POST", "/ui/api/state", "GET, HEAD"),
     ("POST", "/health", "GET, HEAD"), ("DELETE", "/v1/models", "GET, HEAD"),
     ("POST", "/v1/models/m", "GET, HEAD"), ("POST", "/logs", "GET, HEAD"),
     ("POST", "/logs/stream/m", "GET, HEAD"), ("POST", "/running", "GET, HEAD"),
     ("POST", "/props", "GET, HEAD"), ("POST", "/api/profiles/active", "PUT"),
     ("GET", "/api/models/unload", "POST"), ("GET", "/models/unload/m", "POST")],
)  # fmt: skip
def test_a_method_that_a_route_has_not_is_a_405(
    spawn: Spawn, tmp_path: Path, arena: Path, method: str, path: str, allowed: str
) -> None:
    _, port = start(spawn, write_config(tmp_path, "models:\n" + echo_model("m")), arena)
    status, headers, body = call(port, method, path, {"model": "m"} if method == "POST" else None)
    assert (status, headers.get("Allow")) == (405, allowed), body
    assert error(body) == f"{method} {path}: method not allowed; allowed: {allowed}"
    assert call_json(port, "GET", "/running")["running"] == []  # nothing started
    status, _, body = call(port, "GET", "/ui/nothing")
    assert (status, error(body)) == (404, "GET /ui/nothing: no such route")
