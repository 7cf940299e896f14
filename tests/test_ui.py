"""``vramlock ui``: the page in a real headless browser (Debian's chromium), driven over
the DevTools protocol; skipped where there is no browser."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers.commands import vramlock
from helpers.net import accepts, free_port
from helpers.processes import Spawn, wait_until

aiohttp = pytest.importorskip("aiohttp", reason="the serve extra")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_browser = pytest.mark.skipif(
    CHROMIUM is None, reason="no chromium (apt-get install chromium)"
)

FIRST = textwrap.dedent(
    """
    import sys
    import vramlock
    with vramlock.resident(sys.argv[1], name="first", min_hold=0) as me:
        print("resident", flush=True)
        sys.stdin.readline()  # told once the other waits
        assert me.yield_if_wanted(release=lambda: None, restore=lambda: None)
        print("back", flush=True)
        sys.stdin.readline()
    """
)
SECOND = textwrap.dedent(
    """
    import sys
    import vramlock
    with vramlock.resident(sys.argv[1], name="second"):
        print("resident", flush=True)
        sys.stdin.readline()
    """
)


class Browser:
    """A headless chromium showing ``url``, asked through its DevTools websocket."""

    def __init__(self, spawn: Spawn, url: str, scratch: Path) -> None:
        assert CHROMIUM is not None
        # Its sockets go in its profile, TMPDIR and XDG_RUNTIME_DIR: a test's own
        # directories are too long a path for a socket's name.
        profile = scratch / "profile"
        env = {**os.environ, "TMPDIR": str(scratch), "XDG_RUNTIME_DIR": str(scratch)}
        self.proc = spawn([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu",
                           "--no-first-run", "--remote-debugging-port=0",
                           f"--user-data-dir={profile}", "--window-size=420,900", url],
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                          env=env)  # fmt: skip
        active = profile / "DevToolsActivePort"
        wait_until(lambda: active.exists() and active.read_text().count("\n") >= 1, 60)
        port = active.read_text().split("\n")[0]
        pages: list[dict[str, Any]] = []

        def listed() -> bool:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10) as r:
                pages[:] = [t for t in json.load(r) if t["type"] == "page"]
            return bool(pages)

        wait_until(listed, 60)
        self.ws = pages[0]["webSocketDebuggerUrl"]

    def call(self, method: str, **params: Any) -> Any:
        async def once() -> Any:
            async with aiohttp.ClientSession() as s, s.ws_connect(self.ws, max_msg_size=0) as ws:
                await ws.send_json({"id": 1, "method": method, "params": params})
                async for msg in ws:
                    answer = json.loads(msg.data)
                    if answer.get("id") == 1:
                        return answer["result"]
            raise AssertionError(f"no answer to {method}")

        return asyncio.run(once())

    def evaluate(self, expression: str) -> Any:
        return self.call("Runtime.evaluate", expression=expression, returnByValue=True)[
            "result"
        ].get("value")

    def members(self) -> list[list[str]]:
        found = self.evaluate(
            "JSON.stringify([...document.querySelectorAll('.member')]"
            ".map(e => [e.dataset.name, e.dataset.state]))"
        )
        return json.loads(found) if found else []


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="vramlock-ui-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _started(spawn: Spawn, script: str, arena: Path) -> subprocess.Popen[str]:
    proc = spawn([sys.executable, "-c", script, str(arena)], stdin=subprocess.PIPE)
    assert proc.stdout is not None and proc.stdout.readline() == "resident\n"
    return proc


def _say(proc: subprocess.Popen[str]) -> None:
    assert proc.stdin is not None
    proc.stdin.write("\n")
    proc.stdin.flush()


@needs_browser
def test_the_page_shows_every_member_and_a_swap(arena: Path, spawn: Spawn, short_tmp: Path) -> None:
    port = free_port()
    ui = spawn(vramlock("ui", "--arena", str(arena), "--listen", f"127.0.0.1:{port}"))
    wait_until(lambda: accepts(port), 30)
    first = _started(spawn, FIRST, arena)
    second = spawn([sys.executable, "-c", SECOND, str(arena)], stdin=subprocess.PIPE)
    browser = Browser(spawn, f"http://127.0.0.1:{port}/", short_tmp)
    wait_until(lambda: browser.members() == [["first", "resident"], ["second", "waiting"]], 60)
    assert browser.evaluate("document.getElementById('arena').textContent") == str(arena)

    _say(first)  # it yields to the waiter
    assert second.stdout is not None and second.stdout.readline() == "resident\n"
    wait_until(lambda: browser.members() == [["second", "resident"], ["first", "waiting"]], 60)
    changes = json.loads(browser.evaluate("JSON.stringify(window.vramlockChanges)"))
    assert {"name": "first", "from": "resident", "to": "waiting"} in changes
    assert {"name": "second", "from": "waiting", "to": "resident"} in changes
    # The switch is listed with its duration, and the journal's lines are shown.
    wait_until(lambda: browser.evaluate("document.querySelectorAll('#switches tr').length"), 30)
    log = browser.evaluate("document.getElementById('log').textContent")
    assert "release-start" in log and "first" in log

    _say(second)
    assert first.stdout is not None and first.stdout.readline() == "back\n"
    _say(first)
    assert first.wait(30) == 0 and second.wait(30) == 0
    assert ui.poll() is None


def test_the_state_endpoint_needs_no_browser(arena: Path, spawn: Spawn) -> None:
    port = free_port()
    spawn(vramlock("ui", "--arena", str(arena), "--listen", f"127.0.0.1:{port}"))
    wait_until(lambda: accepts(port), 30)
    first = _started(spawn, FIRST, arena)
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/state", timeout=10) as r:
        data = json.load(r)
    assert data["arena"] == str(arena)
    assert [(m["name"], m["state"]) for m in data["members"]] == [("first", "resident")]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=10) as r:
        html = r.read().decode()
    assert "<script>" in html and "http://" not in html.replace("http://www.w3.org", "")
    first.kill()


def test_an_address_in_use_is_refused(arena: Path, spawn: Spawn) -> None:
    port = free_port()
    spawn(vramlock("ui", "--arena", str(arena), "--listen", f"127.0.0.1:{port}"))
    wait_until(lambda: accepts(port), 30)
    again = subprocess.run(vramlock("ui", "--arena", str(arena), "--listen", f"127.0.0.1:{port}"),
                           capture_output=True, text=True, timeout=60)  # fmt: skip
    assert again.returncode == 125
    assert again.stderr == f"vramlock: --listen 127.0.0.1:{port}: Address already in use\n"


def test_several_gpus_are_a_usage_error() -> None:
    done = subprocess.run(vramlock("ui", "--gpu", "0,1"), capture_output=True, text=True,
                          timeout=60)  # fmt: skip
    assert done.returncode == 2
    assert done.stderr == "vramlock: --gpu: ui shows one arena; name one GPU\n"
