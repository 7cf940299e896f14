"""``vramlock ui``: the page in a real headless browser (Debian's chromium), driven over
the DevTools protocol; skipped where there is no browser."""

from __future__ import annotations

import json
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
from helpers.browser import Browser, needs_browser
from helpers.commands import vramlock
from helpers.net import accepts, free_port
from helpers.processes import Spawn, wait_until

aiohttp = pytest.importorskip("aiohttp", reason="the serve extra")

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


def test_several_arenas_are_one_page_s_data() -> None:
    from vramlock.ui import merge

    def state(arena: str, now: float, member: str) -> dict[str, Any]:
        seg = {"member": 0, "kind": "resident", "start": now - 5, "end": now}
        return {"arena": arena, "now": now, "gpu": None, "budget": None, "waiters": 1,
                "members": [{"name": member}], "handoffs": 2,
                "timeline": {"start": now - 5, "end": now, "members": [member], "segments": [seg]},
                "switches": [{"time": now, "name": member}],
                "journal": [{"time": now, "name": member}]}  # fmt: skip

    one = state("/a", 100.0, "x")
    assert merge([one]) is one
    both = merge([one, state("/b", 101.0, "y")])
    assert both["arena"] == "/a, /b" and both["now"] == 101.0
    assert [m["name"] for m in both["members"]] == ["x", "y"]
    assert (both["waiters"], both["handoffs"]) == (2, 4)
    assert both["timeline"]["members"] == ["x", "y"]
    assert [s["member"] for s in both["timeline"]["segments"]] == [0, 1]
    assert (both["timeline"]["start"], both["timeline"]["end"]) == (95.0, 101.0)
    assert [s["name"] for s in both["switches"]] == ["y", "x"]  # newest first
    assert [e["name"] for e in both["journal"]] == ["y", "x"]
