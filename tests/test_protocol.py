"""The lock protocol with real processes: token, want probe, fork hygiene, no barging."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from helpers.processes import Spawn, hold, kill_group, wait_until

from vramlock import procfs
from vramlock.arena import lockfd
from vramlock.arena.directory import Arena
from vramlock.arena.locks import Token, Want, wait_turn
from vramlock.arena.member import Member, State, resident
from vramlock.errors import ArenaError, InvalidTransition, LockError, NotObtained

pytestmark = pytest.mark.timeout(60)


def test_token_excludes_other_processes(arena: Path, spawn: Spawn) -> None:
    a = Arena.open(str(arena))
    token = Token(a)
    holder = hold(spawn, arena / "token.lock")
    assert not token.acquire(0)
    assert token.held_elsewhere()
    kill_group(holder)  # the lock goes when its last holder (flock's child) has died
    wait_until(lambda: token.acquire(0))
    probe = subprocess.run(["flock", "-n", "-x", str(arena / "token.lock"), "true"], timeout=10)
    assert probe.returncode == 1
    token.drop()
    probe = subprocess.run(["flock", "-n", "-x", str(arena / "token.lock"), "true"], timeout=10)
    assert probe.returncode == 0


def test_probe_sees_a_shell_waiter_on_its_own_description(arena: Path, spawn: Spawn) -> None:
    a = Arena.open(str(arena))
    want = Want(a)
    assert not want.probe()
    waiter = hold(spawn, arena / "want.lock", "-s")
    assert want.probe()
    assert want.probe()  # probing never latches or converts anything
    kill_group(waiter)
    wait_until(lambda: not want.probe())


def test_own_enter_is_seen_by_own_probe_because_descriptions_differ(arena: Path) -> None:
    # The probe uses a second open(): with a dup it would convert our own shared
    # lock to exclusive and report nobody waiting.
    a = Arena.open(str(arena))
    want = Want(a)
    assert want.enter(None)
    assert want.probe()
    want.leave()
    assert not want.probe()


def test_flock1_waiter_makes_a_member_step_aside(arena: Path, spawn: Spawn) -> None:
    a = Arena.open(str(arena))
    member = Member(a, name="holder", min_hold=0.0)
    assert member.acquire(0)
    shell = spawn(
        [
            "flock", "-s", str(arena / "want.lock"),
            "flock", "-x", str(arena / "token.lock"), "sh", "-c", "echo got-it",
        ]
    )  # fmt: skip
    log: list[str] = []
    wait_until(member.wanted)
    assert member.yield_if_wanted(lambda: log.append("release"), lambda: log.append("restore"))
    out, _ = shell.communicate(timeout=10)
    assert out.strip() == "got-it"
    assert log == ["release", "restore"]
    assert member.state is State.RESIDENT
    member.close()


def test_min_hold_delays_the_release(arena: Path, spawn: Spawn) -> None:
    a = Arena.open(str(arena))
    member = Member(a, min_hold=0.3)
    assert member.acquire(0)
    hold(spawn, arena / "want.lock", "-s")
    assert member.wanted()
    assert not member.should_release()
    wait_until(member.should_release, timeout=5)
    assert time.monotonic() - member.resident_since >= 0.3
    member.close()


def test_timeout_in_main_thread_keeps_kernel_queue(arena: Path, spawn: Spawn) -> None:
    a = Arena.open(str(arena))
    token = Token(a)
    hold(spawn, arena / "token.lock")
    start = time.monotonic()
    assert not token.acquire(0.3)
    assert 0.25 <= time.monotonic() - start < 3


def test_timeout_from_another_thread(arena: Path, spawn: Spawn) -> None:
    a = Arena.open(str(arena))
    token = Token(a)
    hold(spawn, arena / "token.lock")
    result: list[bool] = []
    t = threading.Thread(target=lambda: result.append(token.acquire(0.2)))
    t.start()
    t.join(10)
    assert result == [False]


def test_resident_context_manager_times_out(arena: Path, spawn: Spawn) -> None:
    hold(spawn, arena / "token.lock")
    with pytest.raises(NotObtained, match=r"within 0\.2 s"), resident(str(arena), timeout=0.2):
        pass


def test_forked_child_closes_lock_descriptors_without_unlocking(arena: Path) -> None:
    a = Arena.open(str(arena))
    token = Token(a)
    assert token.acquire(0)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        try:
            os.fstat(token.fd)
            os.write(w, b"open")
        except OSError:
            os.write(w, b"closed")
        os._exit(0)
    os.waitpid(pid, 0)
    assert os.read(r, 16) == b"closed"
    # The child's exit neither unlocked the parent nor kept anything alive.
    probe = subprocess.run(["flock", "-n", "-x", str(arena / "token.lock"), "true"], timeout=10)
    assert probe.returncode == 1
    token.drop()


def test_lock_file_replaced_while_locking_is_refused(arena: Path) -> None:
    a = Arena.open(str(arena))
    token = Token(a)
    (arena / "other").write_text("")
    os.rename(arena / "other", arena / "token.lock")
    with pytest.raises(ArenaError, match="removed or replaced"):
        token.acquire(0)
    assert not token.held


def test_no_barging_after_release(arena: Path, spawn: Spawn) -> None:
    """A member that releases and re-queues at once must not win the token back."""
    a = Arena.open(str(arena))
    member = Member(a, min_hold=0.0)
    for _ in range(20):
        assert member.acquire(0)
        waiter = spawn(
            [
                sys.executable, "-c",
                "import fcntl, os, sys, time\n"
                f"w = os.open({str(arena / 'want.lock')!r}, os.O_RDONLY)\n"
                f"t = os.open({str(arena / 'token.lock')!r}, os.O_RDONLY)\n"
                "fcntl.flock(w, fcntl.LOCK_SH)\n"
                "fcntl.flock(t, fcntl.LOCK_EX)\n"
                "print(time.monotonic(), flush=True)\n"
                "fcntl.flock(w, fcntl.LOCK_UN)\n"
                "time.sleep(0.02)\n",
            ]
        )  # fmt: skip
        wait_until(member.wanted)
        member.release()
        member.wait_polite()
        assert member.acquire(None)
        got_back = time.monotonic()
        out, _ = waiter.communicate(timeout=10)
        assert float(out) < got_back, "the releasing member barged past the queued waiter"
        member.release()
    member.close()


def test_wait_turn_passive_does_not_want(arena: Path, spawn: Spawn) -> None:
    a = Arena.open(str(arena))
    holder = Member(a, min_hold=0.0)
    assert holder.acquire(0)
    other = Arena.open(str(arena))
    want, token = Want(other), Token(other)
    done = threading.Event()

    def passive() -> None:
        wait_turn(want, token, None, wanting=False)
        done.set()

    t = threading.Thread(target=passive, daemon=True)
    t.start()
    time.sleep(0.1)  # give a wrong implementation time to show itself
    assert not holder.wanted()
    holder.release()
    assert done.wait(10)
    token.drop()


def test_proc_locks_parsing_matches_exact_fields() -> None:
    text = (
        "1: FLOCK  ADVISORY  WRITE 100 fe:00:2171250 0 EOF\n"
        "1: -> FLOCK  ADVISORY  WRITE 101 fe:00:2171250 0 EOF\n"
        "2: FLOCK  ADVISORY  WRITE 102 fe:00:21712500 0 EOF\n"
        "3: POSIX  ADVISORY  WRITE 103 fe:00:2171250 0 EOF\n"
        "4: FLOCK  ADVISORY  READ 104 fe:00:2171250 0 EOF\n"
        "garbage line\n"
    )
    dev = os.makedev(0xFE, 0)
    entries = procfs.parse_proc_locks(text, dev, 2171250)
    assert [(e.pid, e.write, e.blocked) for e in entries] == [
        (100, True, False),
        (101, True, True),
        (104, False, False),
    ]


def test_lock_files_are_never_followed_or_truncated(arena: Path, tmp_path: Path) -> None:
    target = tmp_path / "precious"
    target.write_text("keep me")
    (arena / "token.lock").symlink_to(target)
    a = Arena.open(str(arena))
    with pytest.raises(ArenaError, match="symbolic link"):
        Token(a)
    assert target.read_text() == "keep me"


def test_try_lock_reports_real_errors() -> None:
    r, w = os.pipe()
    os.close(r)
    os.close(w)
    with pytest.raises(LockError, match="EBADF"):
        lockfd.try_lock(r, exclusive=True)


def test_member_states_change_only_as_the_table_allows(arena: Path) -> None:
    a = Arena.open(str(arena))
    member = Member(a, name="t")
    try:
        for wrong in (member.releasing, member.release, member.restoring, member.resident):
            with pytest.raises(InvalidTransition):
                wrong()
            assert member.state is State.RELEASED  # refused: nothing changed
        assert member.acquire(0)
        with pytest.raises(InvalidTransition, match="cannot go from resident to waiting"):
            member.acquire(0)
        member.releasing()
        member.release()
        assert member.state is State.RELEASED
    finally:
        member.close()
        a.close()
