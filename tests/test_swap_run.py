"""The run's side of ``--release swap``, against the fake driver of test_swap.py: its hub
and the socket a stranger may reach, and what a program does when its run is gone,
killed before answering, while released, or in the middle of a release.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.commands import who_json
from helpers.processes import Spawn, token_free, wait_until
from helpers.swap_rig import DEAF_PEER, Rig, read_line, resumed, swap_marks

from vramlock import procfs
from vramlock.arena import records
from vramlock.gpu import swap
from vramlock.procfs import descendants, environ, starttime
from vramlock.strategies.swap import Hub

pytestmark = swap_marks()


def check_orphan_record(arena: Path, pid: int) -> None:
    """The record the library wrote for ``pid`` is one vramlock.arena.records reads whole:
    every field it writes is a field of Record, and each the reader takes is right (a field
    renamed on either side fails here)."""
    members = os.open(arena / "members", os.O_RDONLY | os.O_DIRECTORY)
    try:
        found = [(rec, ok) for rec, ok in records.read_live(members) if rec.pid == pid]
    finally:
        os.close(members)
    assert len(found) == 1, found
    rec, trusted = found[0]
    assert trusted  # file owner, stated uid and process owner agree
    start = starttime(pid)
    raw = json.loads((arena / "members" / records.record_name(pid, start or 0)).read_text())
    assert set(raw) <= set(records.Record.FIELDS), raw
    assert raw["version"] == records.RECORD_VERSION
    assert (rec.pid, rec.starttime, rec.uid) == (pid, start, os.geteuid())
    assert rec.name == Path(f"/proc/{pid}/comm").read_text().strip()
    assert rec.command == Path(f"/proc/{pid}/cmdline").read_text().split("\0")[:-1]
    assert (rec.strategy, rec.state) == ("swap", "released")
    assert abs(rec.since - time.time()) < 60
    assert rec.note == "its vramlock run is gone: blocked until ended"


def test_a_wrapper_killed_while_released_leaves_the_program_blocked(
    rig: Rig, spawn: Spawn, tmp_path: Path
) -> None:
    err_file = tmp_path / "stderr"
    with err_file.open("w") as err:
        job = rig.run(spawn, "60", stderr=err)
    assert read_line(job) == ["ready"]
    program = descendants(job.pid)
    assert len(program) == 1
    try:
        holder = rig.holder(spawn)
        assert read_line(holder)[0] == "held"  # the command is released
        os.kill(job.pid, signal.SIGKILL)
        job.wait(10)
        wait_until(lambda: "went away" in err_file.read_text())
        launched = len(rig.launches())
        assert holder.stdin is not None
        holder.stdin.close()
        assert read_line(holder)[0] == "leaving"
        assert holder.wait(10) == 0
        assert token_free(rig.arena)  # nobody holds the token, and still:
        (row,) = [r for r in who_json(rig.arena) if r["pid"] == program[0]]
        assert row["state"] == "released" and row["strategy"] == "swap"
        assert "its vramlock run is gone" in row["note"]
        check_orphan_record(rig.arena, program[0])
        time.sleep(0.5)  # the program's loop would have launched dozens of times
        assert len(rig.launches()) == launched
        assert int(rig.phys.read_text()) == 0
        assert err_file.read_text().count("\n") == 1
    finally:
        for pid in program:
            os.kill(pid, signal.SIGKILL)


def test_the_hub_stops_listening_when_the_run_ends(tmp_path: Path) -> None:
    path = str(tmp_path / "control")
    hub = Hub(path, str(tmp_path / "lib.so"))
    assert hub.abstract  # and its abstract socket
    hub.close()
    assert not any(t.is_alive() for t in hub._threads)  # not left blocked in accept()
    for address in (path, f"\0{hub.abstract}"):
        with socket.socket(socket.AF_UNIX) as sock, pytest.raises(ConnectionRefusedError):
            sock.connect(address)


def test_a_process_whose_run_goes_before_answering_stays_off_the_gpu(
    rig: Rig, spawn: Spawn, tmp_path: Path
) -> None:
    import socket

    path, err_file = tmp_path / "control", tmp_path / "stderr"
    env = dict(rig.env, LD_PRELOAD=str(swap.library_path()), VRAMLOCK_SWAP_SOCKET=str(path))
    with socket.socket(socket.AF_UNIX) as server, err_file.open("w") as err:
        server.bind(str(path))
        server.listen()
        server.settimeout(30)
        prog = spawn([str(rig.fakes.program), "5"], env=env, stderr=err)
        conn, _ = server.accept()
        assert conn.recv(64).startswith(b"hello ")
        conn.close()  # as a SIGKILLed run would, before saying resident or release
    wait_until(lambda: "went away" in err_file.read_text())
    time.sleep(0.3)  # it would have initialised and launched by now
    assert prog.poll() is None
    assert rig.launches() == [] and int(rig.phys.read_text()) == 0


def line_within(proc: subprocess.Popen[str], seconds: float) -> list[str]:
    """``proc``'s next line, or [] when none came within ``seconds``."""
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], seconds)
    return proc.stdout.readline().split() if ready else []


def test_a_stranger_on_the_socket_is_dropped(rig: Rig, spawn: Spawn) -> None:
    # Any process of the same user can reach the socket and claim to be the program; the
    # kernel says who connected, and it is no process of the command.
    stop = rig.tmp / "stop"
    job = rig.run(spawn, "60", env=dict(rig.env, SWAP_PROG_STOP=str(stop)))
    assert read_line(job) == ["ready"]
    (program,) = descendants(job.pid)
    with socket.socket(socket.AF_UNIX) as stranger:
        stranger.connect(environ(program)["VRAMLOCK_SWAP_SOCKET"])
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # dropped already
            stranger.sendall(f"hello {program}\n".encode())
        stranger.settimeout(10)
        with contextlib.suppress(ConnectionResetError):  # dropped unread
            assert stranger.recv(64) == b""  # told nothing
        holder = rig.holder(spawn)
        held = line_within(holder, 20)  # not kept waiting for the stranger's answer
        assert held[:1] == ["held"] and int(held[2]) == 0
        assert holder.stdin is not None
        holder.stdin.close()
    stop.touch()
    out, err = job.communicate(timeout=60)
    assert job.returncode == 0, (out, err)


def test_a_wrapper_killed_mid_release_leaves_the_program_running_on_its_token(
    rig: Rig, spawn: Spawn, tmp_path: Path
) -> None:
    # Two processes; one does not answer (it said hello, then nothing: a stopped one
    # refuses the release before it starts), so the release waits, within its deadline,
    # with the other already swapped out, and the token still held. Killed then, the
    # run leaves the token with the command (its processes share the description): the
    # swapped one must take its memory back and run on, not block for good holding the
    # token. HUP is ignored, as under nohup, so that what is tested is the library's
    # way on, not the programs' end.
    prog, second = str(rig.fakes.program), tmp_path / "phys2"
    deaf = tmp_path / "deaf.py"
    deaf.write_text(DEAF_PEER)
    script = f"trap '' HUP; {sys.executable} {deaf} & FAKE_CUDA_PHYS={second} {prog} 60; wait"
    job = rig.command(spawn, "sh", "-c", script)
    assert sorted([read_line(job)[0], read_line(job)[0]]) == ["ready", "resident"]
    phys = {p: environ(p).get("FAKE_CUDA_PHYS") for p in descendants(job.pid)}
    programs = [p for p, path in phys.items() if path == str(second)]
    programs += [p for p in descendants(job.pid) if str(deaf) in procfs.text(p, "cmdline")]
    try:
        holder = rig.holder(spawn)  # queues: the release starts
        wait_until(lambda: int(second.read_text()) == 0)  # the running one swapped out
        os.kill(job.pid, signal.SIGKILL)
        job.wait(10)
        launched = len(rig.launches())
        wait_until(resumed(rig, launched))  # restored, running on
        assert int(second.read_text()) > 0
        assert not token_free(rig.arena) and line_within(holder, 0.3) == []
    finally:
        for pid in programs:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    assert line_within(holder, 20)[:1] == ["held"]  # the token went with the command
