"""``vramlock serve`` with ``apiKeys``: no way in without a key, whatever the method,
the path, the content type or the connection (aiohttp's or front.py's), but the doors
llama-swap leaves open; CORS as llama-swap answers it.

The witness that nothing got in is the model's own port: its server (tests/echo_server.py)
is started by a request that reaches it, and nothing listens there until then.
"""

from __future__ import annotations

import base64
import http.client
import json
import re
import socket
from pathlib import Path

import pytest
from helpers.browser import Browser, needs_browser
from helpers.processes import Spawn, wait_until
from helpers.serve import call, echo_model, start, write_config

pytest.importorskip("aiohttp")

pytestmark = pytest.mark.timeout(180)

KEY = "sk-right"
METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE")
# Every route serve has (and some it has not), each asked with every method.
PATHS = (
    "/", "/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/chat/completions",
    "/v1/models", "/models", "/v1/models/m", "/running", "/unload", "/models/unload",
    "/models/unload/m", "/api/models/unload", "/api/models/unload/m", "/upstream",
    "/upstream/m", "/upstream/m/", "/upstream/m/v1/chat/completions", "/comfyui",
    "/comfyui/prompt", "/logs", "/logs/stream", "/logs/stream/m", "/api/events",
    "/api/profiles", "/api/profiles/active", "/api/version", "/api/metrics/activity",
    "/api/metrics/stats", "/api/performance", "/api/hardware", "/api/captures/1",
    "/api/inflight/1/cancel", "/metrics", "/ui", "/ui/", "/ui/api/state", "/props",
    "/props?model=m", "/v1/audio/voices", "/v/chat/completions", "/audioapi/v1/tasks/run",
    "/health", "/wol-health", "/favicon.ico", "/nope", "/%68ealth/x", "//v1/models",
)  # fmt: skip
# What llama-swap answers without a key (and OPTIONS, anywhere).
OPEN = {"/health", "/wol-health", "/", "/upstream", "/favicon.ico"}


def _basic(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


WRONG: tuple[dict[str, str], ...] = (
    {}, {"Authorization": "Bearer sk-wrong"}, {"Authorization": "Bearer " + KEY + "x"},
    {"Authorization": _basic("u", "sk-wrong")}, {"x-api-key": "sk-wrong"},
    {"Authorization": "Basic " + base64.b64encode(KEY.encode()).decode()},  # no colon
    {"Authorization": "Bearer"}, {"Authorization": "Token " + KEY},
    {"Authorization": "Bearer sk-wrong", "x-api-key": KEY},  # a bearer first, as llama-swap
)  # fmt: skip
RIGHT: tuple[dict[str, str], ...] = (
    {"Authorization": "Bearer " + KEY}, {"Authorization": "bearer " + KEY},
    {"Authorization": _basic("anyone", KEY)}, {"x-api-key": KEY},
    {"Authorization": "Basic !!", "x-api-key": KEY},
)  # fmt: skip


def _serve(spawn: Spawn, tmp_path: Path, arena: Path) -> tuple[int, int]:
    """serve with apiKeys and one model, m: (serve's port, m's server's port)."""
    model = echo_model("m", "release: restart")
    found = re.search(r"127\.0\.0\.1:(\d+)", model)
    assert found is not None
    text = f"apiKeys: [sk-other, {KEY}]\nmodels:\n{model}"
    _, port = start(spawn, write_config(tmp_path, text), arena)
    return port, int(found.group(1))


def _listens(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
    except ConnectionRefusedError:
        return False
    return True


def _ask(
    port: int, method: str, path: str, headers: dict[str, str], kind: str = "application/json"
) -> tuple[int, dict[str, str], bytes]:
    """``call``, a body naming model m with every method but GET and HEAD."""
    body = None if method in ("GET", "HEAD") else json.dumps({"model": "m"})
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        sent = {**headers, "Content-Type": kind} if body is not None else headers
        conn.request(method, path, body=body, headers=sent)
        reply = conn.getresponse()
        return reply.status, dict(reply.getheaders()), reply.read()
    finally:
        conn.close()


def test_no_method_no_path_gets_in_without_the_key(
    spawn: Spawn, tmp_path: Path, arena: Path
) -> None:
    port, model_port = _serve(spawn, tmp_path, arena)
    let_in = []
    for method in METHODS:
        for path in PATHS:
            for headers in WRONG if path in ("/", "/v1/chat/completions") else WRONG[:2]:
                status, got, body = _ask(port, method, path, headers)
                is_open = method in ("GET", "HEAD") and path in OPEN
                if (status == 401) == is_open:
                    let_in.append((method, path, headers, status))
                elif status == 401:
                    assert got["WWW-Authenticate"] == 'Basic realm="vramlock"'
                    if method != "HEAD":
                        message = json.loads(body)["error"]["message"]
                        assert message == "unauthorized: invalid or missing API key"
    # a cross-origin form's POST (text/plain: no preflight) is a POST as any other
    for path in ("/", "/v1/chat/completions", "/upstream/m/v1/chat/completions"):
        status, _, _ = _ask(port, "POST", path, {"Origin": "http://elsewhere"}, "text/plain")
        if status != 401:
            let_in.append(("POST text/plain", path, {}, status))
    assert let_in == []
    assert not _listens(model_port)  # no request reached, nor started, the model
    # the witness can see it: with the key, the same request starts the model
    status, _, body = _ask(port, "POST", "/", RIGHT[0])
    assert (status, json.loads(body)["id"]) == (200, "m")
    assert _listens(model_port)


def test_every_way_of_giving_the_key_lets_in(spawn: Spawn, tmp_path: Path, arena: Path) -> None:
    port, _ = _serve(spawn, tmp_path, arena)
    for headers in RIGHT:
        status, _, body = _ask(port, "POST", "/v1/chat/completions", headers)
        assert (status, json.loads(body)["path"]) == (200, "/v1/chat/completions"), headers
        for path in ("/v1/models", "/running", "/ui/api/state", "/upstream/m/health"):
            assert _ask(port, "GET", path, headers)[0] == 200, (path, headers)


def test_a_kept_alive_connection_is_asked_for_the_key_at_each_request(
    spawn: Spawn, tmp_path: Path, arena: Path
) -> None:
    """The common request (a small JSON POST on a kept-alive connection) is taken by
    front.py, not aiohttp: it asks for the key all the same, and answers as aiohttp."""
    port, model_port = _serve(spawn, tmp_path, arena)
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    body = json.dumps({"model": "m"})
    answers = []
    for headers in (WRONG[1], RIGHT[0], WRONG[0], RIGHT[3], WRONG[4], RIGHT[2]):
        conn.request("POST", "/v1/chat/completions", body=body, headers=headers)
        reply = conn.getresponse()
        answers.append((reply.status, reply.getheader("WWW-Authenticate"), reply.read()))
    conn.close()
    assert [a[0] for a in answers] == [401, 200, 401, 200, 401, 200]
    aiohttp_s = _ask(port, "GET", "/v1/models", {})
    assert answers[0][1:] == (aiohttp_s[1]["WWW-Authenticate"], aiohttp_s[2])
    # many at once, sent before any answer: each refused in its turn
    with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
        one = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: "
               f"{len(body)}\r\n\r\n{body}").encode()  # fmt: skip
        s.sendall(one * 2000)
        got = b""
        while got.count(b"HTTP/1.1 401 ") < 2000:
            more = s.recv(1 << 16)
            assert more, got.count(b"HTTP/1.1 401 ")
            got += more
    assert _ask(port, "GET", "/health", {})[0] == 200  # serve still answers
    assert _listens(model_port)


def test_cors_as_llama_swap(spawn: Spawn, tmp_path: Path, arena: Path) -> None:
    port, _ = _serve(spawn, tmp_path, arena)
    status, headers, _ = _ask(port, "OPTIONS", "/v1/models", {
        "Origin": "http://elsewhere", "Access-Control-Request-Method": "GET"})  # fmt: skip
    assert (status, headers.get("Access-Control-Allow-Origin")) == (204, "*"), headers
    assert headers["Access-Control-Allow-Headers"] == (
        "Content-Type, Authorization, Accept, X-Requested-With")  # fmt: skip
    # a browser page of another origin may read the listing (its Origin echoed)
    asked = {**RIGHT[0], "Origin": "http://elsewhere:8080"}
    status, headers, _ = _ask(port, "GET", "/v1/models", asked)
    assert (status, headers["Access-Control-Allow-Origin"]) == (200, "http://elsewhere:8080")
    status, headers, _ = _ask(port, "GET", "/models", RIGHT[0])
    assert status == 200 and "Access-Control-Allow-Origin" not in headers
    # without the key, no listing, whatever the origin
    status, headers, _ = _ask(port, "GET", "/v1/models", {"Origin": "http://elsewhere"})
    assert status == 401 and "Access-Control-Allow-Origin" not in headers


def test_the_open_doors_lead_nowhere_else(spawn: Spawn, tmp_path: Path, arena: Path) -> None:
    """What llama-swap answers without a key: health, and redirects."""
    port, _ = _serve(spawn, tmp_path, arena)
    assert call(port, "GET", "/health")[::2] == (200, b"OK")
    status, headers, _ = call(port, "GET", "/")
    assert (status, headers["Location"]) == (302, "/ui")
    status, headers, _ = call(port, "GET", "/upstream")
    assert (status, headers["Location"]) == (302, "/ui/models")
    assert call(port, "GET", "/ui/")[0] == 401


@needs_browser
def test_the_page_works_in_a_browser_with_keys(
    spawn: Spawn, tmp_path: Path, arena: Path, short_tmp: Path
) -> None:
    """A browser given the key as the page's Basic credentials shows the models (the
    page's own fetch of its state carries them)."""
    port, _ = _serve(spawn, tmp_path, arena)
    browser = Browser(spawn, f"http://user:{KEY}@127.0.0.1:{port}/ui/", short_tmp)

    def shown() -> list[str]:
        found = browser.evaluate(
            "JSON.stringify([...document.querySelectorAll('#models tr')]"
            ".map(e => e.dataset.model).filter(m => m))"
        )
        return list(json.loads(found)) if found else []

    wait_until(lambda: shown() == ["m"], 60)
    said = browser.evaluate("document.getElementById('summary').textContent")
    assert "not answering" not in said and "error" not in said
