"""The arena's journal: real members write it, concurrent writers rotate it once, and
lines that another user could have written are not believed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from helpers.budget import Budgeted, run_measured
from helpers.journal import YIELD_ONCE
from helpers.processes import Spawn, wait_until

from vramlock.arena import journal
from vramlock.arena.directory import Arena
from vramlock.arena.member import Member
from vramlock.arena.records import Record

VISITOR = textwrap.dedent(
    """
    import sys
    import vramlock
    with vramlock.resident(sys.argv[1], name="second"):
        pass
    """
)


def _mine(arena: Path) -> list[dict[str, object]]:
    path = arena / journal.JOURNAL / f"{os.geteuid()}{journal.SUFFIX}"
    return [json.loads(line) for line in path.read_text().splitlines()]


def _read(arena: Path, since: float | None = None) -> list[journal.Event]:
    opened = Arena.open(str(arena))
    try:
        return journal.read(opened, since)
    finally:
        opened.close()


def test_a_handoff_is_journalled_in_order(arena: Path, spawn: Spawn) -> None:
    first = spawn([sys.executable, "-c", YIELD_ONCE, str(arena)])
    assert first.stdout is not None and first.stdout.readline() == "resident\n"
    second = subprocess.run(
        [sys.executable, "-c", VISITOR, str(arena)], capture_output=True, text=True, timeout=60
    )
    assert second.returncode == 0, second.stderr
    assert first.wait(60) == 0
    events = _read(arena)
    seen = [(e.name, e.event) for e in events]
    assert [ev for name, ev in seen if name == "first"] == [
        "want", "acquire", "release-start", "release-end",
        "want", "restore-start", "restore-end", "exit",
    ]  # fmt: skip
    assert [ev for name, ev in seen if name == "second"] == ["want", "acquire", "exit"]
    # The second is resident between the first's release and its restore (release-end
    # and exit are noted just after the token is dropped, so may come a little late).
    assert seen.index(("first", "release-start")) < seen.index(("second", "acquire"))
    assert seen.index(("second", "acquire")) < seen.index(("first", "restore-start"))
    assert {e.pid for e in events if e.name == "first"} == {first.pid}
    assert all(e.trusted and e.uid == os.geteuid() and e.strategy == "api" for e in events)
    monotonic = [e.mono for e in events if e.name == "first"]
    assert monotonic == sorted(monotonic)
    raw = _mine(arena)
    assert {"time", "mono", "pid", "uid", "name", "event", "strategy"} <= set(raw[0])


def test_vramlock_journal_off_journals_nothing_of_that_member(arena: Path) -> None:
    quiet = {**os.environ, "VRAMLOCK_JOURNAL": "off"}
    done = subprocess.run([sys.executable, "-c", VISITOR, str(arena)], env=quiet,
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert _read(arena) == []
    done = subprocess.run([sys.executable, "-c", VISITOR, str(arena)], capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert [e.event for e in _read(arena)] == ["want", "acquire", "exit"]  # on by default


def test_a_scheduler_release_journals_the_bytes_moved(arena: Path) -> None:
    opened = Arena.open(str(arena))
    member = Member(opened, name="mover", strategy="swap")
    try:
        journal.moved(member.arenas, member.records.record, 3 << 30)
        journal.moved(member.arenas, member.records.record, None)  # unknown: no line
    finally:
        member.close()
        opened.close()
    moved = [e for e in _read(arena) if e.event == "moved"]
    assert [(e.name, e.strategy, e.bytes) for e in moved] == [("mover", "swap", 3 << 30)]


WRITER = textwrap.dedent(
    """
    import os, sys
    from vramlock.arena import journal
    from vramlock.arena.directory import Arena
    from vramlock.arena.records import Record
    journal.MAX_BYTES = int(sys.argv[2])
    arena = Arena.open(sys.argv[1])
    record = Record(pid=os.getpid(), name="w" * 40, command=[], strategy="none",
                    state="released", since=0.0)
    for i in range(int(sys.argv[3])):
        journal.note(arena, record, "moved", size=i)
        if i % 50 == 0:
            journal.flush()
    journal.flush()
    """
)


def test_concurrent_writers_rotate_once_and_lose_no_line(arena: Path) -> None:
    writers, each = 4, 400
    record = Record(pid=1 << 22, name="w" * 40, command=[], strategy="none",
                    state="released", since=0.0, starttime=1 << 40)  # fmt: skip
    line = len(journal._line(time.time(), time.monotonic(), record, "none", "moved", None, each))
    # Room for every line in the file and its older one, but not in one file.
    cap = int(writers * each * (line + 24) * 0.6)
    procs = [
        subprocess.Popen([sys.executable, "-c", WRITER, str(arena), str(cap), str(each)])
        for _ in range(writers)
    ]
    assert [p.wait(120) for p in procs] == [0] * writers
    jdir = arena / journal.JOURNAL
    names = sorted(p.name for p in jdir.iterdir())
    me = f"{os.geteuid()}{journal.SUFFIX}"
    assert names == [me, me + ".1"]
    assert (jdir / (me + ".1")).stat().st_size >= cap
    lines = [raw for p in jdir.iterdir() for raw in p.read_bytes().splitlines()]
    parsed = [json.loads(raw) for raw in lines]  # every line whole: no interleaving
    assert len(parsed) == writers * each
    assert sorted((d["pid"], d["bytes"]) for d in parsed) == sorted(
        (p.pid, n) for p in procs for n in range(each)
    )


def test_no_line_is_lost_while_the_writer_takes_the_queue(arena: Path) -> None:
    """Events queued while another thread writes what is queued (as the writer thread
    does): every one reaches the file, once, whole."""
    opened = Arena.open(str(arena))
    record = Record(pid=os.getpid(), name="racer", command=[], strategy="none",
                    state="released", since=0.0, starttime=1)  # fmt: skip
    done = threading.Event()

    def flushing() -> None:
        while not done.is_set():
            journal.flush()

    other = threading.Thread(target=flushing)
    other.start()
    try:
        for n in range(1, 20001):
            journal.note(opened, record, "moved", size=n)
    finally:
        done.set()
        other.join()
        journal.flush()
        opened.close()
    sizes = [d["bytes"] for d in _mine(arena) if d.get("name") == "racer"]
    assert sorted(n for n in sizes if isinstance(n, int)) == list(range(1, 20001))
    assert len(sizes) == 20000


def _write_file(arena: Path, name: str, uid: int, mode: int = 0o644) -> None:
    jdir = arena / journal.JOURNAL
    jdir.mkdir(exist_ok=True)
    line = {"time": 1.0, "mono": 1.0, "pid": 42, "uid": uid, "name": "n", "event": "want"}
    path = jdir / name
    path.write_text(json.dumps(line) + "\n")
    path.chmod(mode)


def test_a_line_for_another_uid_is_untrusted_and_its_files_owners(arena: Path) -> None:
    me = os.geteuid()
    _write_file(arena, f"{me}{journal.SUFFIX}", me + 1)  # our file, claiming another uid
    with (arena / journal.JOURNAL / f"{me}{journal.SUFFIX}").open("a") as f:
        f.write(_lines_of(me, 43))
    _write_file(arena, f"{me + 1}{journal.SUFFIX}", me + 1)  # ours: not the named uid's
    events = _read(arena)
    assert sorted((e.pid, e.uid, e.trusted) for e in events) == [(42, me, False), (43, me, True)]


def test_a_group_writable_file_is_untrusted(arena: Path) -> None:
    me = os.geteuid()
    _write_file(arena, f"{me}{journal.SUFFIX}", me, mode=0o664)
    assert [e.trusted for e in _read(arena)] == [False]


def test_malformed_lines_and_other_files_are_skipped(arena: Path) -> None:
    me = os.geteuid()
    _write_file(arena, f"{me}{journal.SUFFIX}", me)
    _write_file(arena, "notes.txt", me)
    path = arena / journal.JOURNAL / f"{me}{journal.SUFFIX}"
    with path.open("a") as f:
        f.write('{"time": NaN}\n[1]\n{"time": 1, "mono": 1, "pid": -3}\nnot json\n')
    assert len(_read(arena)) == 1


def test_a_symlink_planted_for_our_file_is_not_followed(arena: Path, tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.write_text("")
    jdir = arena / journal.JOURNAL
    jdir.mkdir()
    (jdir / f"{os.geteuid()}{journal.SUFFIX}").symlink_to(target)
    opened = Arena.open(str(arena))
    member = Member(opened, name="m")
    try:
        member.acquire()
    finally:
        member.close()
        opened.close()
    assert target.read_text() == ""
    assert _read(arena) == []


def test_since_keeps_later_events(arena: Path) -> None:
    opened = Arena.open(str(arena))
    member = Member(opened, name="m")
    try:
        member.acquire()
        journal.flush()
        later = _read(arena)[-1].time
        member.release()
    finally:
        member.close()
        opened.close()
    events = _read(arena, since=later)
    assert [e.event for e in events] == ["acquire", "release-end", "exit"]


@pytest.mark.parametrize(
    ("old", "new", "event"),
    [
        ("released", "waiting", "want"),
        ("waiting", "resident", "acquire"),
        ("resident", "releasing", "release-start"),
        ("releasing", "resident", "refusal"),
        ("releasing", "released", "release-end"),
        ("resident", "released", "release-end"),
        ("waiting", "released", "gave-up"),
        ("waiting", "restoring", "restore-start"),
        ("restoring", "resident", "restore-end"),
    ],
)
def test_every_state_change_names_its_event(old: str, new: str, event: str) -> None:
    assert journal.event_of(old, new) == event
    assert event in journal.EVENTS


@pytest.fixture
def budget_room(spawn: Spawn, arena: Path, tmp_path: Path) -> Budgeted:
    return Budgeted(spawn, arena, tmp_path, "3G")


def test_a_measured_release_journals_the_bytes_it_moved(budget_room: Budgeted) -> None:
    """vramlock run in a budget arena (NVML: tests/fake_nvml) notes what it released."""
    first = run_measured(budget_room, "first", 1 << 30)
    first.wait_for("resident")
    second = run_measured(budget_room, "second", 1 << 30, vram="1G")
    second.wait_for("resident")
    first.wait_for("release")

    def moved() -> list[tuple[str, str, int | None]]:
        return [(e.name, e.strategy, e.bytes) for e in _read(budget_room.arena)
                if e.event == "moved"]  # fmt: skip

    wait_until(lambda: moved() == [("first", "signal", 1 << 30)])


def test_a_rotation_that_cannot_rename_still_keeps_the_cap(arena: Path) -> None:
    """The older file's name is taken by something the writer cannot replace (in a team
    arena, another user's file in the sticky ``journal/``; here a directory): the file
    starts again instead of growing past the cap."""
    jdir = arena / journal.JOURNAL
    jdir.mkdir()
    me = f"{os.geteuid()}{journal.SUFFIX}"
    (jdir / (me + ".1")).mkdir()
    record = Record(pid=1 << 22, name="w" * 40, command=[], strategy="none",
                    state="released", since=0.0, starttime=1 << 40)  # fmt: skip
    line = len(journal._line(time.time(), time.monotonic(), record, "none", "moved", None, 999))
    cap, each = 40 * line, 1000
    done = subprocess.run([sys.executable, "-c", WRITER, str(arena), str(cap), str(each)],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    # A batch (at most 51 lines here: the writer flushes every 50) may cross the cap.
    assert (jdir / me).stat().st_size < cap + 51 * (line + 8)
    assert (jdir / (me + ".1")).is_dir()
    assert done.stderr == ""


def _lines_of(uid: int, pid: int) -> str:
    line = {"time": 1.0, "mono": 1.0, "pid": pid, "uid": uid, "name": "n", "event": "want"}
    return json.dumps(line) + "\n"


def test_only_canonical_names_of_their_owner_are_read(arena: Path) -> None:
    me = os.geteuid()
    jdir = arena / journal.JOURNAL
    jdir.mkdir()
    (jdir / f"{me}{journal.SUFFIX}").write_text(_lines_of(me, 1))
    (jdir / f"{me}{journal.OLDER}").write_text(_lines_of(me, 2))
    for pid, name in enumerate([f"0{me}.jsonl", f"00{me}.jsonl", f"{me}.jsonl.2",
                                f"{me}.jsonl.1.1", f"{me + 1}.jsonl", f"{me + 1}.jsonl.1",
                                "99999999999999999999.jsonl"], start=10):  # fmt: skip
        (jdir / name).write_text(_lines_of(me, pid))
    assert sorted(e.pid for e in _read(arena)) == [1, 2]


def _journal_of(jdir: Path, uid: int, lines: int, name: str = "") -> int:
    """A journal file of ``uid`` (pids 10000, 10001, ... in order: lines of one size),
    owned by it; one line's size."""
    text = "".join(_lines_of(uid, pid) for pid in range(10000, 10000 + lines))
    path = jdir / (name or f"{uid}{journal.SUFFIX}")
    path.write_text(text)
    os.chown(path, uid, uid)
    return len(text) // lines


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (files of other uids)")
def test_the_total_read_is_bounded(arena: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Many users' journals (24 here): what is read stops at ``READ_TOTAL`` bytes,
    shared among them, the newest lines of each."""
    jdir = arena / journal.JOURNAL
    jdir.mkdir()
    for uid in range(60000, 60024):
        line = _journal_of(jdir, uid, 100)
    monkeypatch.setattr(journal, "READ_TOTAL", 24 * 5 * line, raising=False)
    events = _read(arena)
    assert len(events) == 24 * 5
    assert sorted((e.uid, e.pid) for e in events) == [
        (uid, pid) for uid in range(60000, 60024) for pid in range(10095, 10100)
    ]
    assert all(e.trusted for e in events)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (files of other uids)")
def test_one_users_big_journal_leaves_the_others_read(
    arena: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    jdir = arena / journal.JOURNAL
    jdir.mkdir()
    line = _journal_of(jdir, 60000, 30)
    _journal_of(jdir, 60001, 1000)
    _journal_of(jdir, 60001, 1000, name=f"60001{journal.OLDER}")
    monkeypatch.setattr(journal, "READ_TOTAL", 100 * line, raising=False)
    events = _read(arena)
    assert sorted(e.pid for e in events if e.uid == 60000) == list(range(10000, 10030))
    # What is left (70 lines) goes to the big one: its current file's newest lines.
    assert sorted(e.pid for e in events if e.uid == 60001) == list(range(10930, 11000))


def test_non_finite_and_unknown_values_are_dropped_line_by_line(arena: Path) -> None:
    me = os.geteuid()
    jdir = arena / journal.JOURNAL
    jdir.mkdir()
    good = {"time": 5.0, "mono": 5.0, "pid": 7, "uid": me, "name": "n", "event": "want"}
    bad: list[dict[str, object]] = [
        {"time": -1e400}, {"mono": 1e400}, {"time": 1e400}, {"mono": -1e400},
        {"time": -5.0}, {"event": "\x1b[2Jgone"}, {"state": "\x1b[2J"},
    ]  # fmt: skip
    raw = [json.dumps(good)] + [json.dumps({**good, **b}).replace("Infinity", "1e400")
                                for b in bad]  # fmt: skip
    raw.append('{"time": NaN, "mono": 5, "pid": 7, "uid": 0, "name": "n", "event": "want"}')
    (jdir / f"{me}{journal.SUFFIX}").write_text("\n".join(raw) + "\n")
    events = _read(arena)
    assert [(e.pid, e.time, e.mono, e.event) for e in events] == [(7, 5.0, 5.0, "want")]
