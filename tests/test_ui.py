"""``vramlock ui``: the page in a real headless browser (Debian's chromium), driven over
the DevTools protocol; skipped where there is no browser."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import urllib.error
import urllib.request
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from helpers.browser import Browser, needs_browser
from helpers.commands import vramlock, who_json
from helpers.net import free_port
from helpers.processes import Spawn, wait_until

aiohttp = pytest.importorskip("aiohttp", reason="the serve extra")

TOKEN = "test-token-0123456789abcdef0123456789"

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


def _started(spawn: Spawn, script: str, arena: Path) -> subprocess.Popen[str]:
    proc = spawn([sys.executable, "-c", script, str(arena)], stdin=subprocess.PIPE)
    assert proc.stdout is not None and proc.stdout.readline() == "resident\n"
    return proc


def _say(proc: subprocess.Popen[str]) -> None:
    assert proc.stdin is not None
    proc.stdin.write("\n")
    proc.stdin.flush()


def _ui(spawn: Spawn, arena: Path, listen: str) -> tuple[subprocess.Popen[str], str]:
    """``vramlock ui`` of ``arena`` with the token TOKEN, once it listens: (process, the
    address it printed)."""
    ui = spawn(vramlock("ui", "--arena", str(arena), "--listen", listen),
               env={**os.environ, "VRAMLOCK_UI_TOKEN": TOKEN})  # fmt: skip
    assert ui.stderr is not None
    line = ui.stderr.readline()
    assert line.startswith(f"vramlock: showing {arena} at http://"), line
    return ui, line.split(" at ", 1)[1].strip()


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


@needs_browser
def test_the_page_shows_every_member_and_a_swap(arena: Path, spawn: Spawn, short_tmp: Path) -> None:
    ui, url = _ui(spawn, arena, f"127.0.0.1:{free_port()}")
    first = _started(spawn, FIRST, arena)
    second = spawn([sys.executable, "-c", SECOND, str(arena)], stdin=subprocess.PIPE)
    browser = Browser(spawn, url, short_tmp)
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
    _ui(spawn, arena, f"127.0.0.1:{port}")
    first = _started(spawn, FIRST, arena)
    status, body = _get(f"http://127.0.0.1:{port}/api/state?token={TOKEN}")
    assert status == 200
    data = json.loads(body)
    assert data["arena"] == str(arena)
    assert [(m["name"], m["state"]) for m in data["members"]] == [("first", "resident")]
    status, html = _get(f"http://127.0.0.1:{port}/?token={TOKEN}")
    assert status == 200
    assert "<script>" in html and "http://" not in html.replace("http://www.w3.org", "")
    first.kill()


def test_the_page_and_its_state_want_the_printed_token(arena: Path, spawn: Spawn) -> None:
    """A team arena's page is not for every local user: only who has the address printed
    (on the terminal of whoever started it) gets the page or its data."""
    port = free_port()
    _, url = _ui(spawn, arena, str(port))
    assert url == f"http://127.0.0.1:{port}/?token={TOKEN}"
    for path in ("/", "/api/state", "/api/state?token=wrong", f"/api/state?token={TOKEN}x"):
        status, body = _get(f"http://127.0.0.1:{port}{path}")
        assert status == 403 and "open the address vramlock ui printed" in body, (path, body)
        assert str(arena) not in body
    assert _get(f"http://127.0.0.1:{port}/api/state?token={TOKEN}")[0] == 200


def test_a_fresh_token_each_start_without_the_variable(arena: Path, spawn: Spawn) -> None:
    urls = []
    for _ in range(2):
        env = {k: v for k, v in os.environ.items() if k != "VRAMLOCK_UI_TOKEN"}
        ui = spawn(vramlock("ui", "--arena", str(arena), "--listen", str(free_port())), env=env)
        assert ui.stderr is not None
        urls.append(ui.stderr.readline().strip().split(" at ", 1)[1])
        ui.terminate()
        assert ui.wait(30) == 0
    tokens = [u.split("?token=", 1)[1] for u in urls]
    assert tokens[0] != tokens[1] and all(len(t) >= 32 for t in tokens)


def test_a_listen_beyond_loopback_is_said(arena: Path, spawn: Spawn) -> None:
    port = free_port()
    ui = spawn(vramlock("ui", "--arena", str(arena), "--listen", f"0.0.0.0:{port}"),
               env={**os.environ, "VRAMLOCK_UI_TOKEN": TOKEN})  # fmt: skip
    assert ui.stderr is not None
    said = ui.stderr.readline()
    assert said == (
        f"vramlock: --listen 0.0.0.0:{port} is not loopback: whoever can reach it and has"
        " the address below sees the arena's members, their commands and its journal"
        " (over plain HTTP)\n"
    )
    assert (
        ui.stderr.readline()
        == f"vramlock: showing {arena} at http://127.0.0.1:{port}/?token={TOKEN}\n"
    )


def test_an_address_in_use_is_refused(arena: Path, spawn: Spawn) -> None:
    port = free_port()
    _ui(spawn, arena, f"127.0.0.1:{port}")
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
                "timeline": {"start": now - 5, "end": now, "segments": [seg],
                             "members": [{"name": member, "pid": 1, "live": True}]},
                "switches": [{"time": now, "name": member}],
                "journal": [{"time": now, "name": member}]}  # fmt: skip

    one = state("/a", 100.0, "x")
    assert merge([one]) is one
    both = merge([one, state("/b", 101.0, "y")])
    assert both["arena"] == "/a, /b" and both["now"] == 101.0
    assert [m["name"] for m in both["members"]] == ["x", "y"]
    assert (both["waiters"], both["handoffs"]) == (2, 4)
    assert [m["name"] for m in both["timeline"]["members"]] == ["x", "y"]
    assert [s["member"] for s in both["timeline"]["segments"]] == [0, 1]
    assert (both["timeline"]["start"], both["timeline"]["end"]) == (95.0, 101.0)
    assert [s["name"] for s in both["switches"]] == ["y", "x"]  # newest first
    assert [e["name"] for e in both["journal"]] == ["y", "x"]


ONCE = textwrap.dedent(
    """
    import sys
    import vramlock
    with vramlock.resident(sys.argv[1], name=sys.argv[2]):
        pass
    """
)


def _listed(arena: Path, name: str) -> bool:
    return name in {m["name"] for m in who_json(arena)}


@needs_browser
def test_the_page_reads_at_a_glance(arena: Path, spawn: Spawn, short_tmp: Path) -> None:
    """One labelled timeline row per live member, the gone ones folded into one; every
    table with its header; one handoff said so."""
    for name in ("early-1", "early-2", "early-3"):  # members that came and went
        done = subprocess.run([sys.executable, "-c", ONCE, str(arena), name], timeout=60)
        assert done.returncode == 0
    first = _started(spawn, FIRST, arena)
    for name in ("second", "third"):  # in this order
        spawn([sys.executable, "-c", SECOND.replace('"second"', "sys.argv[2]"), str(arena), name],
              stdin=subprocess.PIPE)  # fmt: skip
        wait_until(partial(_listed, arena, name), 60)
    _, url = _ui(spawn, arena, str(free_port()))
    browser = Browser(spawn, url, short_tmp)

    def lanes() -> list[list[str]]:
        found = browser.evaluate(
            "JSON.stringify([...document.querySelectorAll('#timeline .lane')]"
            ".map(e => [e.dataset.name, e.querySelector('.label').textContent]))"
        )
        return json.loads(found) if found else []

    wait_until(lambda: len(browser.members()) == 3, 60)
    wait_until(lambda: len(lanes()) == 4, 60)
    assert lanes() == [["first", "first"], ["second", "second"], ["third", "third"],
                       ["gone", "3 gone"]]  # fmt: skip

    # Each live row's bars are its own: the resident's holds, the others wait.
    def bars(name: str) -> set[str]:
        return set(json.loads(browser.evaluate(
            f"JSON.stringify([...document.querySelectorAll('.lane[data-name={name}] rect')]"
            ".map(r => r.getAttribute('class')))"
        )))  # fmt: skip

    assert "resident" in bars("first")
    assert bars("second") == bars("third") == {"waiting"}
    headers = json.loads(browser.evaluate(
        "JSON.stringify([...document.querySelectorAll('table')]"
        ".map(t => [...t.querySelectorAll('thead th')].map(th => th.textContent)))"
    ))  # fmt: skip
    assert len(headers) == 3 and all(headers), headers
    assert ["ended", "took", "strategy", "member"] in headers
    said = str(browser.evaluate("document.getElementById('summary').textContent"))
    assert " 0 handoffs" in said and "2 waiting" in said, said

    _say(first)  # it yields to a waiter: one handoff
    summary = "document.getElementById('summary').textContent"
    wait_until(lambda: " 1 handoff," in str(browser.evaluate(summary)), 60)


@needs_browser
def test_serve_s_page_under_api_keys(
    arena: Path, spawn: Spawn, tmp_path: Path, short_tmp: Path
) -> None:
    """Opened with the key as Basic auth's password (how a browser is asked for it), the
    page's own polls carry it too: it shows the models, one request said so."""
    from helpers.serve import call, echo_model, start, write_config

    path = write_config(tmp_path, f"apiKeys:\n  - {TOKEN}\nmodels:\n{echo_model('a')}")
    _, port = start(spawn, path, arena)
    status, _, _ = call(port, "GET", "/ui/api/state")
    assert status == 401  # the key is asked for
    browser = Browser(spawn, f"http://me:{TOKEN}@127.0.0.1:{port}/ui/", short_tmp)

    def models() -> str:
        return str(browser.evaluate("document.getElementById('models').textContent") or "")

    wait_until(lambda: "0 requests" in models(), 60)
    status, _, _ = call(port, "POST", "/v1/completions", {"model": "a", "prompt": "x"},
                        headers={"Authorization": f"Bearer {TOKEN}"})  # fmt: skip
    assert status == 200
    wait_until(lambda: "1 request" in models() and "1 requests" not in models(), 60)
    summary = browser.evaluate("document.getElementById('summary').textContent")
    assert "not answering" not in summary and "error" not in summary
