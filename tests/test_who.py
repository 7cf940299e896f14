"""``vramlock who``, the roster and member records, with real processes.

Records are display-only input that anybody who may write in ``members/`` (or name a
process) controls: these tests feed hostile ones and check that nothing reaches the
terminal raw, nothing blocks, the kernel is believed, and the GPU work never waits.
"""

from __future__ import annotations

import errno
import fcntl
import importlib.util
import io
import json
import os
import pty
import re
import signal
import struct
import subprocess
import sys
import termios
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from helpers import ROOT
from helpers.commands import vramlock, who_json, who_plain
from helpers.processes import Spawn, hold, kill_group, sigint_default, token_free, wait_until

from vramlock import procfs
from vramlock.arena import roster
from vramlock.arena.directory import Arena
from vramlock.arena.member import Member, State
from vramlock.arena.records import record_name
from vramlock.cli.who import COLUMNS

pytestmark = pytest.mark.timeout(90)

# Never a pid: the kernel's PID_MAX_LIMIT is 4194304, and pids stay below pid_max.
NO_PID = 4194304

# A member in a process of its own; its name and command come from a JSON file.
MEMBER = """
import json, sys, time
from vramlock.arena.directory import Arena
from vramlock.arena.member import Member
spec = json.load(open(sys.argv[2]))
m = Member(Arena.open(sys.argv[1]), name=spec["name"], command=spec["command"])
if spec.get("acquire"):
    m.acquire()
m.records.flush()
print("ready", flush=True)
time.sleep(60)
"""


def who_in_terminal(arena: Path) -> str:
    """``vramlock who`` on a 50x400 terminal: the rich table, as the terminal received it."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 400, 0, 0))
    env = dict(os.environ, TERM="xterm-256color", COLUMNS="400")
    proc = subprocess.Popen(
        vramlock("who", "--arena", str(arena)),
        stdin=subprocess.DEVNULL,
        stdout=slave,
        stderr=slave,
        env=env,
        start_new_session=True,
    )
    os.close(slave)
    seen = b""
    try:
        while chunk := _read_terminal(master):
            seen += chunk
        assert proc.wait(30) == 0, seen
    finally:
        os.close(master)
    return seen.decode(errors="replace")


def _read_terminal(master: int) -> bytes:
    try:
        return os.read(master, 65536)
    except OSError as err:  # EIO: everybody closed the terminal
        assert err.errno == errno.EIO
        return b""


def spawn_member(
    spawn: Spawn, arena: Path, tmp_path: Path, name: str, command: list[str], acquire: bool = False
) -> subprocess.Popen[str]:
    spec = tmp_path / f"{name}.json"
    spec.write_text(json.dumps({"name": name, "command": command, "acquire": acquire}))
    proc = spawn([sys.executable, "-c", MEMBER, str(arena), str(spec)])
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


def record_path(arena: Path, pid: int) -> Path:
    return arena / "members" / record_name(pid, procfs.starttime(pid) or 0)


def write_record(arena: Path, pid: int, **fields: Any) -> Path:
    """Plant a record for the living process ``pid``: a valid one, but for ``fields``."""
    data = {
        "pid": pid,
        "name": "planted",
        "command": ["planted"],
        "strategy": "signal",
        "state": "released",
        "since": time.time(),
        "starttime": procfs.starttime(pid),
        "child_pid": None,
        "uid": os.geteuid(),
        "version": 1,
    }
    data.update(fields)
    path = record_path(arena, pid)
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(data))
    return path


def sleeper(spawn: Spawn) -> int:
    """A living process that holds no lock."""
    proc = spawn(["sh", "-c", "echo up; exec sleep 60"])
    assert proc.stdout is not None and proc.stdout.readline().strip() == "up"
    return proc.pid


# -- the roster ------------------------------------------------------------------------------


def test_roster_merges_kernel_state_records_and_foreign_lockers(arena: Path, spawn: Spawn) -> None:
    a = Arena.open(str(arena))
    member = Member(a, name="me", command=["python", "job.py"], strategy="signal")
    assert member.acquire(0)
    shell = spawn(["flock", "-x", str(arena / "token.lock"), "true"])
    wait_until(lambda: any(r.state == "waiting" for r in roster.snapshot(a)))
    rows = roster.snapshot(a)
    assert rows[0].pid == os.getpid() and rows[0].state == "resident" and rows[0].name == "me"
    assert rows[0].command == "python job.py" and rows[0].strategy == "signal"
    foreign = [r for r in rows if not r.member]
    assert [r.pid for r in foreign] == [shell.pid] and foreign[0].name == "flock"
    member.close()
    shell.wait(10)
    assert roster.snapshot(a) == []


def test_roster_survives_garbage_and_sweeps_by_file_name(arena: Path) -> None:
    members = arena / "members"
    members.mkdir()
    dead = [f"{NO_PID}-1.json", f"{NO_PID}-2.json", f"{NO_PID}-3.json", f"{NO_PID}-4.json"]
    (members / dead[0]).write_text("{not json")
    (members / dead[1]).write_text('{"pid": "x"}')
    (members / dead[2]).write_text("[]")
    os.mkfifo(members / dead[3])
    stale = {
        "pid": NO_PID,
        "name": "gone",
        "command": ["x"],
        "strategy": "none",
        "state": "released",
        "since": 0,
        "starttime": 5,
    }
    (members / f"{NO_PID}-5.json").write_text(json.dumps(stale))
    (members / f".{NO_PID}-6.0123abcd.tmp").write_text("a dead member's leftover")
    (members / "README").write_text("not a record name: never swept")
    (members / "007-1.json").write_text("a second spelling of a pid: never swept")
    a = Arena.open(str(arena))
    assert roster.snapshot(a) == []
    member = Member(a, name="fresh")  # joining sweeps what is stale
    assert sorted(os.listdir(members)) == sorted(
        ["007-1.json", "README", record_name(os.getpid(), procfs.starttime(os.getpid()) or 0)]
    )
    assert [r.name for r in roster.snapshot(a)] == ["fresh"]
    member.close()


def test_a_live_members_unreadable_record_is_not_swept(
    arena: Path, spawn: Spawn, tmp_path: Path
) -> None:
    """Only the file name says whose record it is: an oversized record is not a dead member's."""
    other = spawn_member(spawn, arena, tmp_path, "big", ["job"])
    path = record_path(arena, other.pid)
    assert json.loads(path.read_text())["name"] == "big"
    path.write_text(json.dumps({"pid": other.pid, "name": "x" * 200_000}))
    a = Arena.open(str(arena))
    member = Member(a, name="joining")  # sweeps
    assert path.exists()
    assert [r.name for r in roster.snapshot(a)] == ["joining"]  # unreadable: not shown
    member.close()


# -- records never block anybody -------------------------------------------------------------

PLANT_AND_RUN = """
import os, sys
from vramlock import procfs
members = sys.argv[1]
os.makedirs(members, exist_ok=True)
me = os.getpid()
# The temporary name a record of this process once had; exec keeps pid and start time.
os.mkfifo(f"{members}/.{me}-{procfs.starttime(me)}.json.tmp")
os.execv(sys.executable, [sys.executable, "-m", "vramlock", *sys.argv[2:]])
"""


def test_a_fifo_at_a_records_temporary_name_does_not_hang_run(arena: Path) -> None:
    run = subprocess.run(
        [sys.executable, "-c", PLANT_AND_RUN, str(arena / "members"),
         "run", "--arena", str(arena), "--", "true"],
        timeout=30,
    )  # fmt: skip
    assert run.returncode == 0
    planted = [n for n in os.listdir(arena / "members") if n.endswith(".tmp")]
    assert len(planted) == 1  # never opened or removed while its process lived
    Member(Arena.open(str(arena))).close()  # the process is gone now: swept
    assert os.listdir(arena / "members") == []


def test_who_does_not_block_on_a_fifo_record(arena: Path) -> None:
    path = record_path(arena, os.getpid())
    path.parent.mkdir()
    os.mkfifo(path)
    assert who_plain(arena).splitlines() == [f"arena {arena}", "no members"]


def test_state_changes_never_wait_for_record_io(
    arena: Path, spawn: Spawn, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A disk that stalls record writes delays neither the release nor the next holder."""
    a = Arena.open(str(arena))
    member = Member(a, name="slow-disk", min_hold=0.0)
    assert member.acquire(0)
    disk = threading.Event()
    rename = os.rename

    def stalled_rename(*args: Any, **kw: Any) -> None:
        disk.wait(5)
        rename(*args, **kw)

    monkeypatch.setattr(os, "rename", stalled_rename)
    waiter = spawn(
        [sys.executable, "-c",
         "import fcntl, os, time\n"
         f"w = os.open({str(arena / 'want.lock')!r}, os.O_RDONLY)\n"
         f"t = os.open({str(arena / 'token.lock')!r}, os.O_RDONLY)\n"
         "fcntl.flock(w, fcntl.LOCK_SH)\n"
         "fcntl.flock(t, fcntl.LOCK_EX)\n"
         "print(time.monotonic(), flush=True)\n"]
    )  # fmt: skip
    wait_until(member.wanted)
    start = time.monotonic()
    member.releasing()
    member.release()
    out, _ = waiter.communicate(timeout=10)
    assert float(out) - start < 1.0, "the next holder waited for our record"
    start = time.monotonic()
    assert member.acquire(5)
    member.releasing()  # a release that did not happen: resident again
    member.resident()
    assert time.monotonic() - start < 1.0
    disk.set()
    member.records.flush()
    assert json.loads(record_path(arena, os.getpid()).read_text())["state"] == "resident"
    member.close()


def test_record_write_errors_never_reach_the_member(
    arena: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    a = Arena.open(str(arena))
    member = Member(a, name="full-disk", min_hold=0.0)

    def full(*args: Any, **kw: Any) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "rename", full)
    assert member.acquire(0)
    member.describe(strategy="signal")
    member.records.flush()
    member.release()
    member.records.flush()
    assert [n for n in os.listdir(arena / "members") if n.startswith(".")] == []
    member.close()
    assert os.listdir(arena / "members") == []


def test_the_record_writer_neither_outlives_close_nor_keeps_a_process_alive(
    arena: Path, tmp_path: Path
) -> None:
    a = Arena.open(str(arena))
    before = set(threading.enumerate())
    member = Member(a, name="closing")
    assert member.acquire(0)
    (writer,) = set(threading.enumerate()) - before
    assert writer.name == "vramlock-record" and writer.daemon
    member.close()
    assert not writer.is_alive()
    assert os.listdir(arena / "members") == []

    code = (
        "import sys\nfrom vramlock.arena.directory import Arena\n"
        "from vramlock.arena.member import Member\n"
        "m = Member(Arena.open(sys.argv[1]))\nm.acquire()\nm.describe(strategy='x')\n"
    )  # ends without close()
    done = subprocess.run([sys.executable, "-c", code, str(arena)], timeout=30)
    assert done.returncode == 0


# -- callbacks that raise --------------------------------------------------------------------


def test_a_release_callback_that_raises_keeps_the_member_resident(
    arena: Path, spawn: Spawn
) -> None:
    a = Arena.open(str(arena))
    member = Member(a, min_hold=0.0)
    assert member.acquire(0)
    hold(spawn, arena / "want.lock", "-s")
    wait_until(member.wanted)

    def fail() -> None:
        raise RuntimeError("offload failed")

    with pytest.raises(RuntimeError, match="offload failed"):
        member.yield_if_wanted(release=fail, restore=lambda: None)
    assert member.state is State.RESIDENT and member.residency.held
    assert not token_free(arena)
    member.close()


def test_a_restore_callback_that_raises_lets_waiters_in(arena: Path, spawn: Spawn) -> None:
    a = Arena.open(str(arena))
    member = Member(a, min_hold=0.0)
    assert member.acquire(0)
    first = spawn(
        ["flock", "-s", str(arena / "want.lock"),
         "flock", "-x", str(arena / "token.lock"), "true"]
    )  # fmt: skip
    wait_until(member.wanted)

    def fail() -> None:
        raise RuntimeError("reload failed")

    with pytest.raises(RuntimeError, match="reload failed"):
        member.yield_if_wanted(release=lambda: None, restore=fail)
    assert first.wait(10) == 0
    assert member.state is State.RELEASED and not member.residency.held
    second = subprocess.run(
        ["flock", "-x", "-w", "5", str(arena / "token.lock"), "true"], timeout=30
    )
    assert second.returncode == 0
    member.close()


# -- what who shows --------------------------------------------------------------------------

EVIL_NAME = "evil\x1b]0;pwned\x07\nresident 1 spoof\u202e"


def test_who_escapes_hostile_names_and_commands(arena: Path) -> None:
    a = Arena.open(str(arena))
    command = ["\x1b[2J", "[red]x[/red]", "A" * 3_000_000]
    member = Member(a, name=EVIL_NAME, command=command)
    assert member.acquire(0)
    member.records.flush()
    assert record_path(arena, os.getpid()).stat().st_size < 64 * 1024  # clipped when written

    escaped_name = "evil\\x1b]0;pwned\\x07\\nresident 1 spoof\\u202e"
    plain = who_plain(arena)
    assert len(plain.splitlines()) == 3  # title, header, one member: no spoofed rows
    assert escaped_name in plain and "\\x1b[2J [red]x[/red] AAA" in plain
    for raw in ("\x1b", "\x07", "\u202e"):
        assert raw not in plain
    assert len(plain) < 2000

    (row,) = who_json(arena)
    assert row["name"] == escaped_name and row["state"] == "resident"
    assert len(row["command"]) <= roster.COMMAND_MAX and row["command"].endswith("…")

    screen = who_in_terminal(arena)
    assert "[red]x[/red]" in screen  # not taken for markup
    assert "pwned" in screen and "\x1b]" not in screen and "\x07" not in screen
    assert "\x1b[2J" not in screen
    member.close()


def test_who_json_is_strict_and_non_finite_times_are_rejected(arena: Path, spawn: Spawn) -> None:
    write_record(arena, sleeper(spawn), since=float("nan"))  # json.dumps writes NaN
    write_record(arena, sleeper(spawn), since=float("inf"))  # and Infinity
    huge = write_record(arena, sleeper(spawn), since=123456.5)
    huge.write_text(huge.read_text().replace("123456.5", "1e999"))  # a float overflow
    write_record(arena, sleeper(spawn), since=-1.0)
    fine = sleeper(spawn)
    write_record(arena, fine, name="fine")
    assert [(r["pid"], r["name"]) for r in who_json(arena)] == [(fine, "fine")]


def test_a_record_claiming_the_token_without_the_kernel_is_not_resident(
    arena: Path, spawn: Spawn
) -> None:
    liar = sleeper(spawn)
    write_record(arena, liar, name="liar", state="resident")
    (row,) = who_json(arena)
    assert (row["pid"], row["name"], row["state"]) == (liar, "liar", "?")


@pytest.mark.parametrize("forged", ["uid field", "file owner"])
def test_a_record_written_for_somebody_elses_process_is_unverified(
    arena: Path, spawn: Spawn, forged: str
) -> None:
    if forged == "file owner" and os.geteuid() != 0:
        pytest.skip("only root can give a file away")
    holder = hold(spawn, arena / "token.lock")
    other_uid = os.geteuid() + 4242
    uid = other_uid if forged == "uid field" else os.geteuid()
    path = write_record(arena, holder.pid, name="boss", state="released", uid=uid)
    if forged == "file owner":
        os.chown(path, other_uid, -1)
    (row,) = who_json(arena)
    assert (row["pid"], row["state"], row["name"]) == (holder.pid, "resident", "boss")
    assert row["note"] == "unverified record" and row["member"] is False
    assert row["strategy"] == "-" and row["since"] is None and row["command"].startswith("flock")


def test_who_flags_stopped_members_and_children(arena: Path, spawn: Spawn) -> None:
    job = spawn(vramlock("run", "--arena", str(arena), "--name", "frozen", "--", "sleep", "60"))
    wait_until(lambda: any(r["child_pid"] for r in who_json(arena)))
    (row,) = who_json(arena)
    assert row["note"] is None
    os.kill(job.pid, signal.SIGSTOP)
    wait_until(lambda: procfs.state(job.pid) == "T")
    assert who_json(arena)[0]["note"] == "stopped"
    os.kill(row["child_pid"], signal.SIGSTOP)
    wait_until(lambda: procfs.state(row["child_pid"]) == "T")
    assert who_json(arena)[0]["note"] == "stopped; child stopped"
    assert "stopped; child stopped" in who_plain(arena)
    kill_group(job)


def test_who_names_the_holder_when_the_wrapper_is_gone(arena: Path, spawn: Spawn) -> None:
    job = spawn(vramlock("run", "--arena", str(arena), "--name", "wrapped", "--", "sleep", "60"))
    wait_until(lambda: any(r["child_pid"] for r in who_json(arena)))
    child = who_json(arena)[0]["child_pid"]
    try:
        job.send_signal(signal.SIGKILL)
        job.wait(10)
        assert not token_free(arena)  # the command kept the token
        (row,) = who_json(arena)
        assert (row["pid"], row["state"], row["name"]) == (child, "resident", "sleep")
        assert row["note"] == f"locker {job.pid} gone"
    finally:
        os.kill(child, signal.SIGKILL)
    wait_until(lambda: token_free(arena))


SHARERS = """
import fcntl, os, sys, time
path, n = sys.argv[1], int(sys.argv[2])
r, w = os.pipe()
pids = []
for _ in range(n):
    pid = os.fork()
    if pid == 0:
        fcntl.flock(os.open(path, os.O_RDONLY), fcntl.LOCK_SH)
        os.write(w, b"!")
        time.sleep(60)
        os._exit(0)
    pids.append(pid)
while n:
    n -= len(os.read(r, n))
print(*pids, flush=True)
time.sleep(60)
"""


def test_who_reads_a_lock_listing_longer_than_one_read(arena: Path, spawn: Spawn) -> None:
    """/proc/locks comes a page per read: 150 waiters (about 8 KiB) must all be listed."""
    a = Arena.open(str(arena))
    member = Member(a, name="head")
    assert member.acquire(0)
    sharers = spawn([sys.executable, "-c", SHARERS, str(arena / "want.lock"), "150"])
    assert sharers.stdout is not None
    waiting = sorted(int(p) for p in sharers.stdout.readline().split())
    rows = who_json(arena)
    assert (rows[0]["pid"], rows[0]["state"], rows[0]["name"]) == (os.getpid(), "resident", "head")
    assert sorted(r["pid"] for r in rows[1:] if r["state"] == "waiting") == waiting
    member.close()


def test_who_imports_no_lock_layer_nvml_or_rich(arena: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "vramlock", "who", "--arena", str(arena)],
        capture_output=True, text=True, timeout=30, check=True, cwd=ROOT,
    )  # fmt: skip
    loaded = {line.split("|")[-1].strip() for line in out.stderr.splitlines() if "|" in line}
    heavy = {
        "portalocker",
        "vramlock.arena.lockfd",
        "vramlock.arena.member",
        "vramlock.arena.locks",
        "rich",
    }
    assert "vramlock.arena.roster" in loaded
    assert not loaded & (heavy | {"pynvml", "vramlock.gpu.nvml", "vramlock.run.runner"})


def _imported(args: list[str]) -> set[str]:
    """The modules a fresh interpreter imports to run ``args`` (python's own included)."""
    out = subprocess.run(
        [sys.executable, "-X", "importtime", *args],
        capture_output=True, text=True, timeout=30, check=True, cwd=ROOT,
    )  # fmt: skip
    return {line.split("|")[-1].strip() for line in out.stderr.splitlines() if "|" in line}


@pytest.mark.parametrize("flags", [[], ["--json"]])
def test_who_imports_no_dataclasses_typing_or_typer(arena: Path, flags: list[str]) -> None:
    """who in a shell loop costs little more than the interpreter: no dataclasses (it
    imports inspect, ast, dis and tokenize), no typing, and no typer, click or rich."""
    loaded = _imported(["-m", "vramlock", "who", "--arena", str(arena), *flags])
    loaded -= _imported(["-c", "pass"])  # what this interpreter loads anyway (site, .pth)
    assert "vramlock.arena.roster" in loaded
    assert loaded & {"dataclasses", "inspect", "typing", "typer", "click", "rich"} == set()


# -- the command -----------------------------------------------------------------------------


def test_who_plain_text_and_json(arena: Path, spawn: Spawn) -> None:
    spawn(vramlock("run", "--arena", str(arena), "--name", "sleeper", "--", "sleep", "30"))
    wait_until(lambda: who_json(arena) and who_json(arena)[0]["state"] == "resident")
    spawn(vramlock("run", "--arena", str(arena), "--name", "second", "--", "true"))
    wait_until(lambda: len(who_json(arena)) == 2)
    rows = who_json(arena)
    states = [(r["name"], r["state"]) for r in rows]
    assert states == [("sleeper", "resident"), ("second", "waiting")]
    plain = who_plain(arena).splitlines()
    assert plain[0] == f"arena {arena}"
    assert plain[1].split() == ["STATE", "PID", "NAME", "STRATEGY", "FOR", "SWITCH", "CHILD",
                                "VRAM", "NOTE", "COMMAND"]  # fmt: skip
    assert plain[2].split()[0] == "resident" and "sleeper" in plain[2]
    assert plain[3].split()[0] == "waiting" and "second" in plain[3]


# Releases in 0.3 s and restores in 0.2 s, once the other member waits.
SLOW_SWITCH = """
import sys, time
import vramlock
with vramlock.resident(sys.argv[1], name="slow", min_hold=0) as me:
    print("resident", flush=True)
    sys.stdin.readline()
    # The other's record may show it waiting an instant before it asks for the GPU.
    while not me.yield_if_wanted(release=lambda: time.sleep(0.3),
                                 restore=lambda: time.sleep(0.2)):
        time.sleep(0.01)
    print("back", flush=True)
    sys.stdin.readline()
"""


def test_who_shows_how_long_the_last_switch_took(arena: Path, spawn: Spawn) -> None:
    slow = spawn([sys.executable, "-c", SLOW_SWITCH, str(arena)], stdin=subprocess.PIPE)
    assert slow.stdout is not None and slow.stdout.readline() == "resident\n"
    assert [r["last_release"] for r in who_json(arena)] == [None]
    other = spawn(vramlock("run", "--arena", str(arena), "--name", "other", "--", "true"))
    wait_until(lambda: len(who_json(arena)) == 2)
    assert slow.stdin is not None
    slow.stdin.write("\n")
    slow.stdin.flush()
    assert slow.stdout.readline() == "back\n"  # released, the other ran, restored
    assert other.wait(30) == 0
    wait_until(lambda: who_json(arena)[0]["last_restore"] is not None)
    (row,) = who_json(arena)
    assert 0.3 <= row["last_release"] < 5 and 0.2 <= row["last_restore"] < 5, row
    plain = who_plain(arena).splitlines()
    at = plain[1].index("SWITCH")
    assert re.fullmatch(r"\d+ms/\d+ms|\d+ms/\d\.\ds|\d\.\ds/\d+ms|\d\.\ds/\d\.\ds",
                        plain[2][at:].split()[0]), plain  # fmt: skip
    slow.stdin.write("\n")
    slow.stdin.flush()
    assert slow.wait(30) == 0


def test_who_empty_arena(arena: Path) -> None:
    out = subprocess.run(
        vramlock("who", "--arena", str(arena)), capture_output=True, text=True, timeout=30
    )
    assert out.returncode == 0
    assert out.stdout.splitlines() == [f"arena {arena}", "no members"]


def _terminal_table(rows: list[roster.Row], width: int) -> list[str]:
    """who's table on a terminal ``width`` cells wide, as lines of text."""
    from rich.console import Console

    from vramlock.cli.who import _rich_table

    out = io.StringIO()
    table = _rich_table("/run/user/1000/vramlock/gpu0", rows, time.time(), width=width)
    Console(file=out, width=width, color_system=None).print(table)
    return out.getvalue().splitlines()


def _wide_rows() -> list[roster.Row]:
    command = "/usr/local/bin/llama-server -m /models/qwen2.5-7b-instruct-q4_k_m.gguf --port 8081"
    return [
        roster.Row(pid=4194301, state="resident", name="llama", strategy="http", command=command,
                   since=time.time() - 75, child_pid=4194302, member=True,
                   note="listen 127.0.0.1:8080, 2 connection(s)", vram=6 * 2**30),
        roster.Row(pid=4194303, state="waiting", name="trainer", strategy="swap",
                   command="python3 train.py --epochs 10", since=time.time() - 3,
                   child_pid=None, member=True),
    ]  # fmt: skip


def test_who_reads_at_80_columns() -> None:
    """A member is one line (its command cut, not wrapped); a note is whole, under the table."""
    from rich.cells import cell_len

    lines = _terminal_table(_wide_rows(), 80)
    assert max(map(cell_len, lines)) <= 80, lines
    members = [ln for ln in lines if ln.split()[:1] in (["resident"], ["waiting"])]
    assert len(members) == 2 and "6.0 GiB  llama-server -m" in members[0], lines
    assert members[0].endswith("…") and "python3 train.py" in members[1], lines
    assert "4194301: listen 127.0.0.1:8080, 2 connection(s)" in lines, lines
    assert len(lines) == 6, lines  # title, header, rule, two members, one note


def test_who_on_a_wide_terminal_keeps_every_column() -> None:
    lines = _terminal_table(_wide_rows(), 200)
    assert tuple(lines[1].split()) == COLUMNS
    assert "listen 127.0.0.1:8080, 2 connection(s)" in lines[3]
    assert "/usr/local/bin/llama-server -m /models/" in lines[3]


def test_who_watch_refreshes_until_interrupted(arena: Path, spawn: Spawn) -> None:
    watch = spawn(vramlock("who", "--arena", str(arena), "--watch"), preexec_fn=sigint_default)
    assert watch.stdout is not None
    assert watch.stdout.readline().strip() == f"arena {arena}"
    assert watch.stdout.readline().strip() == "no members"
    job = spawn(vramlock("run", "--arena", str(arena), "--name", "late", "--", "sleep", "30"))
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:  # a later frame shows the newcomer
        line = watch.stdout.readline()
        if "late" in line:
            break
    else:
        raise AssertionError("--watch never showed the new member")
    watch.send_signal(signal.SIGINT)
    assert watch.wait(10) == 0
    kill_group(job)


def test_vram_per_member_and_foreign_gpu_processes(arena: Path, spawn: Spawn) -> None:
    """NVML's pid -> bytes becomes each member's VRAM (its processes together) and a
    ``foreign`` row for any GPU process of no member; a pid nobody here can see is said so."""
    from vramlock.arena.directory import Arena
    from vramlock.arena.roster import GpuView, snapshot, with_vram
    from vramlock.gpu.nvml import Gpu

    spawn(vramlock("run", "--arena", str(arena), "--name", "job", "--", "sleep", "30"))
    wait_until(lambda: who_json(arena) and who_json(arena)[0]["child_pid"])
    child = int(who_json(arena)[0]["child_pid"])
    stranger = spawn(["sleep", "30"])
    gone = 4_000_000  # above pid_max: no such process here
    used = {child: 5 << 30, stranger.pid: 1 << 30, gone: 2 << 30}
    view = GpuView(gpus=[Gpu(0, "GPU-x", "Test GPU", 8 << 30, 8 << 30, 0)], used=used)
    opened = Arena.open(str(arena))
    try:
        rows = with_vram(snapshot(opened), view)
    finally:
        opened.close()
    assert [(r.state, r.vram) for r in rows] == [
        ("resident", 5 << 30),
        ("foreign", 1 << 30),
        ("foreign", 2 << 30),
    ]
    assert (rows[1].pid, rows[1].name, rows[1].note) == (stranger.pid, "sleep", "not a member")
    assert (rows[2].pid, rows[2].name, rows[2].note) == (gone, "?", "pid not visible here")


def test_who_without_nvml_says_so_in_json(arena: Path) -> None:
    out = subprocess.run(
        vramlock("who", "--arena", str(arena), "--json"),
        capture_output=True, text=True, timeout=30, check=True,
    ).stdout  # fmt: skip
    if importlib.util.find_spec("pynvml") is not None:
        pytest.skip("pynvml is installed here")
    assert json.loads(out)["gpus"] is None


def test_the_shell_recipe_is_a_waiter_then_resident(arena: Path, spawn: Spawn) -> None:
    """``flock -s want.lock flock -x token.lock CMD``: the outer flock holds want.lock for
    the whole run, the inner one queues for the token, then holds it. One row: waiting
    while the inner one is blocked, resident once it has the token."""
    token = arena / "token.lock"
    held = os.open(token, os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC, 0o644)
    fcntl.flock(held, fcntl.LOCK_EX)  # the test's own holder
    shell = spawn(["flock", "-s", str(arena / "want.lock"),
                   "flock", "-x", str(token), "sh", "-c", "echo in; exec sleep 60"])  # fmt: skip
    st = token.stat()

    def blocked() -> bool:  # the witness: the kernel's queue for the token
        entries = procfs.parse_proc_locks(procfs.read_proc_locks(), st.st_dev, st.st_ino)
        return any(e.blocked for e in entries)

    wait_until(blocked, 30)
    rows = [(r["state"], r["name"]) for r in who_json(arena) if r["pid"] != os.getpid()]
    assert rows == [("waiting", "flock")]
    os.close(held)
    assert shell.stdout is not None and shell.stdout.readline() == "in\n"
    assert [(r["state"], r["name"]) for r in who_json(arena)] == [("resident", "flock")]
