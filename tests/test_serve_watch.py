"""serve's ``/metrics`` and ``/ui``: its arena and its requests by model, read back with
prometheus_client's parser and in a headless browser; watching is never activity (a
scrape wakes no model, starts none, and does not keep one resident past its ttl)."""

from __future__ import annotations

import http.client
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from helpers.browser import Browser, needs_browser
from helpers.commands import vramlock, who_json
from helpers.net import free_port, free_ports
from helpers.processes import Spawn, wait_until

pytest.importorskip("aiohttp")
parser = pytest.importorskip(
    "prometheus_client.parser", reason="the test extra's prometheus-client"
)

pytestmark = pytest.mark.timeout(120)

# A server no preset knows, answering every POST with its pid.
PLAIN = """
import os, sys
from http.server import BaseHTTPRequestHandler, HTTPServer
class H(BaseHTTPRequestHandler):
    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        body = str(os.getpid()).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def _serve(spawn: Spawn, tmp_path: Path, arena: Path, a_ttl: str = "") -> int:
    """serve with models a and b (plain servers, released by restarting them); its port."""
    script = tmp_path / "plain.py"
    script.write_text(PLAIN)
    # Ports of their own (not startPort's next ones, which something may hold).
    a, b = (f"    cmd: {sys.executable} {script} {p}\n    proxy: http://127.0.0.1:{p}\n"
            "    checkEndpoint: none\n    release: restart\n" for p in free_ports(2))  # fmt: skip
    path = tmp_path / "serve.yaml"
    path.write_text(f"models:\n  a:\n{a}{a_ttl}  b:\n{b}")
    port = free_port()
    proc = spawn(vramlock("serve", str(path), "--listen", str(port)),
                 env={**os.environ, "VRAMLOCK_ARENA": str(arena)})  # fmt: skip
    assert proc.stderr is not None and "serving" in proc.stderr.readline()
    return port


def _get(port: int, path: str) -> tuple[int, str]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("GET", path)
        reply = conn.getresponse()
        return reply.status, reply.read().decode()
    finally:
        conn.close()


def _complete(port: int, model: str) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("POST", "/v1/completions", body=json.dumps({"model": model}).encode())
        reply = conn.getresponse()
        body = reply.read()
        assert reply.status == 200, body
        return int(body)
    finally:
        conn.close()


def _scrape(port: int) -> dict[str, Any]:
    status, text = _get(port, "/metrics")
    assert status == 200
    return {f.name: f for f in parser.text_string_to_metric_families(text)}


def _value(family: Any, name: str, **labels: str) -> float:
    found = [
        s.value for s in family.samples if s.name == name and labels.items() <= s.labels.items()
    ]
    assert len(found) == 1, (name, labels, family.samples)
    return float(found[0])


def _members(arena: Path) -> dict[str, str]:
    return {m["name"]: m["state"] for m in who_json(arena)}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_metrics_count_requests_and_a_scrape_is_never_activity(
    spawn: Spawn, tmp_path: Path, arena: Path
) -> None:
    port = _serve(spawn, tmp_path, arena, a_ttl="    ttl: 1\n")
    fams = _scrape(port)  # before any request: no model is started for it
    assert "vramlock_serve_requests" not in fams
    assert _members(arena) == {}

    server = _complete(port, "a")
    began = time.monotonic()
    fams = _scrape(port)
    requests = fams["vramlock_serve_requests"]
    assert requests.type == "counter"
    assert _value(requests, "vramlock_serve_requests_total", model="a", status="200") == 1
    seconds = fams["vramlock_serve_request_seconds"]
    assert seconds.type == "histogram"
    assert _value(seconds, "vramlock_serve_request_seconds_count", model="a", status="200") == 1
    assert _value(seconds, "vramlock_serve_request_seconds_bucket", model="a", status="200",
                  le="+Inf") == 1  # fmt: skip
    state = fams["vramlock_member_state"]
    assert _value(state, "vramlock_member_state", member="a", arena=str(arena),
                  vramlock_member_state="resident") == 1  # fmt: skip

    # Scraped (and the page polled) all the while: the ttl still fires on time.
    while _alive(server):
        assert time.monotonic() - began < 30, "the ttl did not fire under scrapes"
        _scrape(port)
        assert _get(port, "/ui/api/state")[0] == 200
        time.sleep(0.1)
    assert _members(arena) == {"a": "released"}
    for _ in range(20):  # and it stays released: scrapes and polls wake nobody
        fams = _scrape(port)
        assert _get(port, "/ui/api/state")[0] == 200
        time.sleep(0.1)
    assert _value(fams["vramlock_member_state"], "vramlock_member_state", member="a",
                  vramlock_member_state="released") == 1  # fmt: skip
    assert _members(arena) == {"a": "released"}  # b, never asked, never started
    assert _value(fams["vramlock_serve_requests"], "vramlock_serve_requests_total",
                  model="a") == 1  # fmt: skip


@needs_browser
def test_the_page_shows_every_model_and_a_swap(
    spawn: Spawn, tmp_path: Path, arena: Path, short_tmp: Path
) -> None:
    port = _serve(spawn, tmp_path, arena)
    assert _get(port, "/ui")[0] == 302  # to /ui/
    status, html = _get(port, "/ui/")
    assert status == 200 and 'id="models"' in html
    browser = Browser(spawn, f"http://127.0.0.1:{port}/ui/", short_tmp)

    def models() -> list[list[str]]:
        found = browser.evaluate(
            "JSON.stringify([...document.querySelectorAll('#models tr')]"
            ".map(e => [e.dataset.model, e.dataset.state, e.textContent]))"
        )
        return [row[:2] for row in json.loads(found)] if found else []

    wait_until(lambda: models() == [["a", "released"], ["b", "released"]], 60)
    _complete(port, "a")
    wait_until(lambda: browser.members() == [["a", "resident"]], 60)
    wait_until(lambda: models() == [["a", "resident"], ["b", "released"]], 60)
    shown = browser.evaluate("document.getElementById('models').textContent")
    assert "1 request" in shown and "1 requests" not in shown

    _complete(port, "b")  # a swap: a released for b
    wait_until(lambda: models() == [["a", "released"], ["b", "resident"]], 60)
    wait_until(lambda: dict(browser.members()) == {"a": "released", "b": "resident"}, 60)
    changes = json.loads(browser.evaluate("JSON.stringify(window.vramlockChanges)"))
    assert any(c["name"] == "a" and c["from"] == "resident" for c in changes)
    assert browser.evaluate("document.getElementById('arena').textContent") == str(arena)

    # serve's own log lines, as /logs has them: the request that brought b in, among them.
    def shown_lines() -> str:
        return str(browser.evaluate("document.getElementById('lines').textContent") or "")

    wait_until(lambda: '"POST /v1/completions" 200' in shown_lines(), 30)
    assert browser.evaluate("document.getElementById('lines-box').hidden") is False
