"""``vramlock stats``: the journal's statistics, from made-up journals and real members."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.commands import vramlock
from helpers.journal import T0, YIELD_ONCE, ev, handoff

from vramlock.arena import journal
from vramlock.arena.directory import Arena
from vramlock.arena.journal import Event
from vramlock.observe.stats import THRASH_WINDOW, compute, percentile, timeline


def test_residency_waits_switches_and_thrash() -> None:
    events = [
        ev(0, 1, "want"), ev(0, 1, "acquire"),
        *handoff(10, 1, 2, 0.5, 1.0),  # 2 waits 0.5 s, holds from 10.5
        *handoff(30, 2, 1, 0.25, 2.0),  # 1 waits 0.25 s, holds from 30.25
        ev(31, 2, "want"),
        ev(40, 1, "release-start"), ev(40, 1, "release-end"), ev(40, 2, "acquire"),
        ev(50, 2, "exit"), ev(50, 1, "exit"),
    ]  # fmt: skip
    report = compute(events, now=T0 + 50)
    one, two = report.members
    assert (one.name, two.name) == ("m1", "m2")
    assert one.resident == pytest.approx(10.5 + (40 - 30.25))
    assert two.resident == pytest.approx((30.25 - 10.5) + 10)
    assert report.handoffs == 3 and one.releases == 2 and two.releases == 1
    assert two.waits == pytest.approx([0.5, 9.0])
    assert one.waits == pytest.approx([0.0, 0.25])
    assert one.release_times == pytest.approx([0.5, 0.0])
    assert two.restore_times == pytest.approx([1.0])
    assert report.release_by_strategy == {"swap": pytest.approx([0.5, 0.25, 0.0])}
    assert one.thrash == two.thrash == 0
    data = report.as_json()
    assert data["members"][0]["share"] == pytest.approx(one.resident / 50)
    assert data["members"][1]["wait"] == {"count": 2, "p50": 0.5, "p95": 9.0, "max": 9.0}
    json.dumps(data, allow_nan=False)


def test_released_and_back_within_the_window_is_thrash() -> None:
    quick, slow = THRASH_WINDOW / 2, THRASH_WINDOW * 2
    events = [
        ev(0, 1, "acquire"), ev(1, 1, "release-start"), ev(1, 1, "release-end"),
        ev(1 + quick, 1, "acquire"), ev(2 + quick, 1, "release-start"),
        ev(2 + quick, 1, "release-end"), ev(2 + quick + slow, 1, "acquire"),
        ev(3 + quick + slow, 1, "exit"),
    ]  # fmt: skip
    assert compute(events).members[0].thrash == 1


def test_since_counts_what_was_going_on_then() -> None:
    events = [ev(0, 1, "acquire"), ev(100, 1, "release-start"), ev(101, 1, "release-end"),
              ev(102, 1, "exit")]  # fmt: skip
    # Holding since before the window: counted from the window's start, not from 0.
    report = compute(events, T0 + 50, now=T0 + 110)
    assert report.members[0].resident == pytest.approx(51)
    assert report.events == 3
    # Who left before the window is not shown.
    gone = [ev(0, 2, "acquire"), ev(1, 2, "exit"), *events]
    assert [m.name for m in compute(gone, T0 + 50, now=T0 + 110).members] == ["m1"]


def test_a_member_that_ended_without_a_line_held_until_its_last() -> None:
    events = [ev(0, 1, "acquire"), ev(5, 1, "want", name="m1")]
    # pid 1 with start time 0: never taken for a living process.
    report = compute(events, now=T0 + 100)
    assert report.members[0].resident == pytest.approx(5)
    assert report.members[0].state == "gone"


def test_untrusted_lines_mark_their_member() -> None:
    bad = ev(1, 2, "acquire")
    events = [ev(0, 1, "acquire"), bad._replace(trusted=False)]
    report = compute(events)
    assert [m.trusted for m in report.members] == [True, False]
    assert report.untrusted == 1


def test_timeline_marks_resident_and_waiting() -> None:
    events = [ev(0, 1, "acquire"), ev(0, 2, "want"), ev(5, 1, "release-start"),
              ev(5, 1, "release-end"), ev(5, 2, "acquire"), ev(10, 2, "exit"),
              ev(10, 1, "exit")]  # fmt: skip
    rows = timeline(compute(events, now=T0 + 10), 10)
    assert rows == [("m1", "#####     "), ("m2", ".....#####")]


def test_percentile_is_nearest_rank() -> None:
    assert percentile([], 50) is None
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([float(i) for i in range(1, 101)], 95) == 95.0


def test_a_rotated_journal_is_read_whole(arena: Path) -> None:
    """Both files, in order (bench/stats.py times 100,000 events)."""
    events = [ev(-1, 1, "acquire")]
    for i in range(2000):
        events += handoff(i * 2.0, 1 + i % 3, 1 + (i + 1) % 3, 0.1, 0.2)
    jdir = arena / journal.JOURNAL
    jdir.mkdir()
    lines = [json.dumps({**_fields(e), "trusted": None}) + "\n" for e in events]
    half = len(lines) // 2
    (jdir / f"{os.geteuid()}{journal.OLDER}").write_text("".join(lines[:half]))
    (jdir / f"{os.geteuid()}{journal.SUFFIX}").write_text("".join(lines[half:]))
    opened = Arena.open(str(arena))
    try:
        read = journal.read(opened)
    finally:
        opened.close()
    assert read == events
    report = compute(read, now=T0 + 4001)
    assert report.events == len(events) and report.handoffs == 2000
    assert [m.name for m in report.members] == ["m1", "m2", "m3"]


def _fields(e: Event) -> dict[str, object]:
    return e._asdict()


def test_stats_of_real_members(arena: Path) -> None:
    first = subprocess.Popen([sys.executable, "-c", YIELD_ONCE, str(arena)],
                             stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert first.stdout is not None and first.stdout.readline() == "resident\n"
    visit = "import sys, vramlock\nwith vramlock.resident(sys.argv[1], name='second'): pass"
    subprocess.run([sys.executable, "-c", visit, str(arena)], check=True, timeout=60)
    assert first.wait(60) == 0
    first.stdout.close()
    out = subprocess.run(vramlock("stats", "--arena", str(arena), "--json"),
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["arena"] == str(arena)
    by = {m["name"]: m for m in data["members"]}
    assert by["first"]["handoffs"] == 1 and by["second"]["handoffs"] == 0
    assert by["second"]["wait"]["count"] == 1 and by["first"]["restore"]["count"] == 1
    assert {m["state"] for m in data["members"]} == {"gone"}
    assert data["handoffs"] == 1
    text = subprocess.run(vramlock("stats", "--arena", str(arena)),
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert text.returncode == 0, text.stderr
    lines = text.stdout.splitlines()
    assert lines[0] == f"arena {arena}"
    assert lines[2].split()[:2] == ["NAME", "PID"]
    assert any(line.startswith("first ") for line in lines[3:5])
    assert "timeline" in text.stdout and "#" in text.stdout


def test_stats_of_an_arena_without_a_journal(arena: Path) -> None:
    out = subprocess.run(vramlock("stats", "--arena", str(arena)), capture_output=True,
                         text=True, timeout=60)  # fmt: skip
    assert out.returncode == 0
    assert out.stdout.splitlines()[-1] == "no events"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--since", "soon"],
            "--since: bad duration 'soon' (seconds, or a number followed by ms, s, m or h)",
        ),
        (["--gpu", "0,1"], "--gpu: stats reads one arena; name one GPU"),
    ],
)
def test_stats_usage_errors(arena: Path, args: list[str], message: str) -> None:
    out = subprocess.run(vramlock("stats", "--arena", str(arena), *args), capture_output=True,
                         text=True, timeout=60)  # fmt: skip
    assert out.returncode == 2
    assert out.stderr == f"vramlock: {message}\n"


def test_stats_of_a_missing_arena(tmp_path: Path) -> None:
    out = subprocess.run(vramlock("stats", "--arena", str(tmp_path / "nope")),
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert out.returncode == 125
    assert out.stderr.startswith(f"vramlock: arena {tmp_path / 'nope'}: does not exist (")


def test_plot_without_matplotlib_says_what_to_install(arena: Path, tmp_path: Path) -> None:
    blocker = tmp_path / "nomatplotlib"
    blocker.mkdir()
    (blocker / "matplotlib.py").write_text("raise ImportError('not installed')\n")
    env = {**os.environ, "PYTHONPATH": f"{blocker}{os.pathsep}{os.environ['PYTHONPATH']}"}
    plot = vramlock("stats", "--arena", str(arena), "--plot", str(tmp_path / "a.svg"))
    out = subprocess.run(plot, capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 2
    assert out.stderr == "vramlock: --plot needs matplotlib: pip install matplotlib\n"


def test_a_line_counts_only_for_the_member_of_its_file() -> None:
    """Another user's lines naming our member's pid and start time are a member of their
    own (the other user's), never merged into ours."""
    mine = [ev(0, 1, "acquire"), ev(1, 1, "exit")]
    other = os.geteuid() + 1
    lies = (ev(0.5, 1, "acquire"), ev(0.6, 1, "release-start"), ev(0.7, 1, "release-end"))
    forged = [e._replace(uid=other) for e in (*lies, ev(0.8, 1, "exit"))]
    report = compute(sorted([*mine, *forged]), now=T0 + 2)
    assert [(m.uid, m.releases) for m in report.members] == [(os.geteuid(), 0), (other, 1)]
    assert report.members[0].resident == pytest.approx(1.0)


def test_a_living_process_of_another_uid_is_not_the_member(tmp_path: Path) -> None:
    """Lines naming a living process of another uid: untrusted, and not taken as alive
    (its turn is not counted up to now)."""
    me = os.getpid()
    start = procfs_start(me)
    line = ev(0, me, "acquire")._replace(start=start, uid=os.geteuid() + 1)
    report = compute([line, ev(1, me, "want")._replace(start=start, uid=os.geteuid() + 1)],
                     now=T0 + 100)  # fmt: skip
    (member,) = report.members
    assert member.trusted is False
    assert member.resident == pytest.approx(1.0)  # to its last line, not to now


def procfs_start(pid: int) -> int:
    from vramlock import procfs

    start = procfs.starttime(pid)
    assert start is not None
    return start


BAD_LINES = [
    '{"time": -1e400, "mono": 5, "pid": 7, "uid": UID, "name": "a", "event": "acquire"}',
    '{"time": 9, "mono": 1e400, "pid": 7, "uid": UID, "name": "a", "event": "exit"}',
    '{"time": 1e400, "mono": 1e400, "pid": 8, "uid": UID, "name": "b", "event": "acquire"}',
    '{"time": NaN, "mono": 5, "pid": 8, "uid": UID, "name": "b", "event": "acquire"}',
]


def test_stats_and_the_page_never_fail_on_a_bad_line(arena: Path) -> None:
    jdir = arena / journal.JOURNAL
    jdir.mkdir()
    now = time.time()
    good = [json.dumps({**_fields(e), "trusted": None, "time": now - 10 + e.time - T0})
            for e in (ev(0, 1, "acquire"), ev(2, 1, "exit"))]  # fmt: skip
    uid = str(os.geteuid())
    lines = [good[0], *(b.replace("UID", uid) for b in BAD_LINES), good[1]]
    (jdir / f"{uid}{journal.SUFFIX}").write_text("\n".join(lines) + "\n")
    out = subprocess.run(vramlock("stats", "--arena", str(arena), "--json"),
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert (out.returncode, out.stderr) == (0, "")
    data = json.loads(out.stdout, parse_constant=lambda c: pytest.fail(c))
    assert [(m["pid"], m["resident_seconds"]) for m in data["members"]] == [(1, 2.0)]
    text = subprocess.run(vramlock("stats", "--arena", str(arena)),
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert (text.returncode, text.stderr) == (0, "")
    from vramlock.ui import Watch

    opened = Arena.open(str(arena))
    try:
        state = Watch(opened, None).state()
    finally:
        opened.close()
    json.dumps(state, allow_nan=False)
    assert [e["pid"] for e in state["journal"]] == [1, 1]


def test_a_table_of_several_users_says_whose_each_member_is(arena: Path) -> None:
    jdir = arena / journal.JOURNAL
    jdir.mkdir()
    me, other = os.geteuid(), 4_000_000_000  # a uid nobody has: shown as a number
    for uid, pid in ((me, 1), (other, 2)):
        line = {**_fields(ev(0, pid, "acquire")), "uid": uid, "trusted": None}
        path = jdir / f"{uid}{journal.SUFFIX}"
        path.write_text(json.dumps(line) + "\n")
        if uid != me:
            if me != 0:
                pytest.skip("needs root (a file of another uid)")
            os.chown(path, uid, 0)
    text = subprocess.run(vramlock("stats", "--arena", str(arena)),
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert text.returncode == 0, text.stderr
    table = text.stdout.splitlines()[2:5]
    assert table[0].split()[:3] == ["NAME", "PID", "USER"]
    import pwd

    assert sorted(r.split()[:3] for r in table[1:]) == [
        ["m1", "1", pwd.getpwuid(me).pw_name], ["m2", "2", str(other)]
    ]  # fmt: skip
