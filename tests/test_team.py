"""Team arenas (``vramlock arena --arena PATH --group GROUP``) with real users: made when
the tests run as root (as CI does), skipped otherwise."""

from __future__ import annotations

import grp
import json
import os
import pwd
import shutil
import stat
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import portalocker
import pytest
from helpers import ROOT
from helpers.commands import vramlock
from helpers.processes import Spawn

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("useradd") is None or shutil.which("setpriv") is None,
    reason="needs root, useradd and setpriv (it makes users)",
)


@dataclass
class Team:
    group: str
    gid: int
    alice: int  # in the group
    bob: int  # in the group
    mallory: int  # not
    python: str
    env: dict[str, str]
    top: Path  # where the team arena goes: a directory everybody may enter

    def run(self, uid: int, args: list[str]) -> subprocess.CompletedProcess[str]:
        """``args`` as user ``uid``, with its own groups."""
        user = pwd.getpwuid(uid)
        return subprocess.run(
            ["setpriv", f"--reuid={uid}", f"--regid={user.pw_gid}", "--init-groups", "--",
             *args], capture_output=True, text=True, timeout=60, env=self.env, cwd="/",
        )  # fmt: skip

    def py(self, uid: int, script: str, *args: str) -> subprocess.CompletedProcess[str]:
        return self.run(uid, [self.python, "-c", textwrap.dedent(script), *args])

    def spawn(self, spawn: Spawn, uid: int, script: str, *args: str) -> subprocess.Popen[str]:
        """``script`` as user ``uid``, running (stdin and stdout piped), reaped by ``spawn``."""
        user = pwd.getpwuid(uid)
        return spawn(["setpriv", f"--reuid={uid}", f"--regid={user.pw_gid}", "--init-groups",
                      "--", self.python, "-c", textwrap.dedent(script), *args],
                     stdin=subprocess.PIPE, env=self.env, cwd="/")  # fmt: skip


def _find_python(team: Team, uid: int) -> bool:
    """Set ``team``'s interpreter to one that another user can run (a tree under /root is
    not), with vramlock and its dependencies on its path; False when there is none."""
    site = str(Path(portalocker.__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{site}"}
    for exe in (sys.executable, shutil.which("python3") or ""):
        team.python, team.env = exe, env
        if exe and team.py(uid, "import vramlock, portalocker").returncode == 0:
            return True
    return False


def _add_user(name: str, group: str | None) -> int:
    extra = ["-G", group] if group else []
    subprocess.run(["useradd", "-M", "-N", "-s", "/bin/sh", *extra, name], check=True)
    return pwd.getpwnam(name).pw_uid


@pytest.fixture(scope="module")
def team() -> Iterator[Team]:
    tag = os.urandom(3).hex()
    group = f"vlteam{tag}"
    subprocess.run(["groupadd", group], check=True)
    users: list[str] = []
    top = Path(tempfile.mkdtemp(prefix="vramlock-team-", dir="/tmp"))
    try:
        uids = []
        for who, member in (("a", True), ("b", True), ("m", False)):
            users.append(f"vl{who}{tag}")
            uids.append(_add_user(users[-1], group if member else None))
        top.chmod(0o755)
        alice, bob, mallory = uids
        made = Team(group, grp.getgrnam(group).gr_gid, alice, bob, mallory, "", {}, top)
        if not _find_python(made, made.alice):
            pytest.skip("no Python interpreter that another user may run")
        yield made
    finally:
        shutil.rmtree(top, ignore_errors=True)
        for user in users:
            subprocess.run(["userdel", user], check=False)
        subprocess.run(["groupdel", group], check=False)


@pytest.fixture
def arena(team: Team) -> Path:
    path = team.top / os.urandom(4).hex()
    done = subprocess.run(vramlock("arena", "--arena", str(path), "--group", team.group),
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"{path}\n"
    return path


def _mode(path: Path) -> tuple[int, int, int]:
    st = path.lstat()
    return st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)


def test_a_team_arena_is_root_owned_and_the_groups(team: Team, arena: Path) -> None:
    assert _mode(arena) == (0, team.gid, 0o750)
    assert _mode(arena / "token.lock") == (0, team.gid, 0o640)
    assert _mode(arena / "want.lock") == (0, team.gid, 0o640)
    assert _mode(arena / "members") == (0, team.gid, 0o1770)
    assert _mode(arena / "journal") == (0, team.gid, 0o1770)


JOIN = """
import sys, vramlock
from vramlock.arena import journal
with vramlock.resident(sys.argv[1], name=sys.argv[2], timeout=30):
    pass
journal.flush()
"""


def test_members_of_the_group_take_turns_and_are_believed(team: Team, arena: Path) -> None:
    for uid, name in ((team.alice, "alice"), (team.bob, "bob")):
        done = team.py(uid, JOIN, str(arena), name)
        assert done.returncode == 0, done.stderr
    shown = team.run(team.alice, [team.python, "-m", "vramlock", "stats", "--arena", str(arena),
                                  "--json"])  # fmt: skip
    assert shown.returncode == 0, shown.stderr
    members = {m["name"]: m for m in json.loads(shown.stdout)["members"]}
    assert (members["alice"]["uid"], members["bob"]["uid"]) == (team.alice, team.bob)
    assert members["alice"]["trusted"] and members["bob"]["trusted"]
    bobs = _mode(arena / "journal" / f"{team.bob}.jsonl")
    assert (bobs[0], bobs[2]) == (team.bob, 0o644)  # bob's alone to write


def test_nobody_else_may_join(team: Team, arena: Path) -> None:
    done = team.run(team.mallory, [team.python, "-m", "vramlock", "wait", "-n", "--arena",
                                   str(arena)])  # fmt: skip
    assert done.returncode == 125
    assert done.stderr == f"vramlock: arena {arena}: permission denied\n"


TAMPER = """
import json, os, sys
arena, victim = sys.argv[1], int(sys.argv[2])
results = {}
def attempt(what, call):
    try:
        call()
        results[what] = "done"
    except OSError as err:
        results[what] = err.errno
attempt("unlink token", lambda: os.unlink(f"{arena}/token.lock"))
attempt("replace want", lambda: os.rename(f"{arena}/journal", f"{arena}/want.lock"))
attempt("truncate journal", lambda: os.truncate(f"{arena}/journal/{victim}.jsonl", 0))
attempt("remove journal", lambda: os.unlink(f"{arena}/journal/{victim}.jsonl"))
attempt("write token", lambda: open(f"{arena}/token.lock", "w"))
# A line of our own that claims to be the victim's.
line = {"time": 1.0, "mono": 1.0, "pid": 1, "uid": victim, "name": "bob", "event": "acquire"}
with open(f"{arena}/journal/{os.geteuid()}.jsonl", "a") as f:
    f.write(json.dumps(line) + "\\n")
print(json.dumps(results))
"""


def test_a_member_cannot_tamper_with_what_others_rely_on(team: Team, arena: Path) -> None:
    import errno

    assert team.py(team.bob, JOIN, str(arena), "bob").returncode == 0
    done = team.py(team.alice, TAMPER, str(arena), str(team.bob))
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {
        "unlink token": errno.EACCES,
        "replace want": errno.EACCES,
        "truncate journal": errno.EACCES,
        "remove journal": errno.EPERM,
        "write token": errno.EACCES,
    }
    shown = subprocess.run(vramlock("stats", "--arena", str(arena), "--json"),
                           capture_output=True, text=True, timeout=60)  # fmt: skip
    data = json.loads(shown.stdout)
    forged = [m for m in data["members"] if m["pid"] == 1]  # alice's, claiming bob's uid
    assert [(m["uid"], m["trusted"]) for m in forged] == [(team.alice, False)]
    assert data["untrusted_events"] == 1


def test_only_root_makes_a_team_arena(team: Team) -> None:
    path = team.top / "by-alice"
    done = team.run(team.alice, [team.python, "-m", "vramlock", "arena", "--arena", str(path),
                                 "--group", team.group])  # fmt: skip
    assert done.returncode == 2
    assert done.stderr == (
        "vramlock: --group: only root can make a team arena (root owns it, so that no"
        " member can replace its files)\n"
    )
    assert not path.exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--group", "no-such-group-here"], "--group: no group 'no-such-group-here'"),
        (["--group", "root", "--gpu", "0"],
         "--group: name the team arena's directory with --arena PATH"),
    ],
)  # fmt: skip
def test_team_usage_errors(team: Team, args: list[str], message: str) -> None:
    extra = ["--arena", str(team.top / "x")] if "--gpu" not in args else []
    done = subprocess.run(vramlock("arena", *extra, *args), capture_output=True, text=True,
                          timeout=60)  # fmt: skip
    assert done.returncode == 2
    assert done.stderr == f"vramlock: {message}\n"


HOLD = """
import os, sys, vramlock
from vramlock import procfs
from vramlock.arena import journal
with vramlock.resident(sys.argv[1], name=sys.argv[2], timeout=30):
    journal.flush()
    print(os.getpid(), procfs.starttime(os.getpid()), flush=True)
    sys.stdin.readline()
"""

FORGE = """
import json, os, sys, time
arena, pid, start = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
now, mono = time.time(), time.monotonic()
lines = []
for i in range(50):  # 50 handoffs over the last 83 minutes, said to be bob's process
    at = 5000 - i * 100
    for event, late in (("acquire", 0), ("release-start", 90), ("release-end", 91)):
        lines.append({"time": now - at + late, "mono": max(0.0, mono - at + late), "pid": pid,
                      "start": start, "uid": os.geteuid(), "name": "bob", "event": event})
with open(f"{arena}/journal/{os.geteuid()}.jsonl", "a") as f:
    f.write("".join(json.dumps(line) + "\\n" for line in lines))
"""


def _stats(arena: Path) -> dict[str, Any]:
    shown = subprocess.run(vramlock("stats", "--arena", str(arena), "--json"),
                           capture_output=True, text=True, timeout=60)  # fmt: skip
    assert shown.returncode == 0, shown.stderr
    data: dict[str, Any] = json.loads(shown.stdout)
    return data


def test_lines_naming_another_members_process_are_not_its(
    team: Team, arena: Path, spawn: Spawn
) -> None:
    """Alice writes, in her own file, lines naming bob's living process (its pid, start
    time and name): bob's row stays his, and hers is unverified."""
    bob = team.spawn(spawn, team.bob, HOLD, str(arena), "bob")
    assert bob.stdout is not None
    pid, start = map(int, bob.stdout.readline().split())
    done = team.py(team.alice, FORGE, str(arena), str(pid), str(start))
    assert done.returncode == 0, done.stderr
    members = _stats(arena)["members"]
    bobs = [m for m in members if m["uid"] == team.bob]
    assert [(m["pid"], m["handoffs"], m["trusted"]) for m in bobs] == [(pid, 0, True)]
    assert bobs[0]["resident_seconds"] < 60
    forged = [m for m in members if m["uid"] == team.alice]
    assert [(m["pid"], m["handoffs"], m["trusted"]) for m in forged] == [(pid, 50, False)]
    # Its turns end at its last line: bob's living process does not make them last.
    assert forged[0]["resident_seconds"] == pytest.approx(50 * 91, abs=1)
    assert bob.stdin is not None
    bob.stdin.close()
    assert bob.wait(60) == 0


WRITE = """
import os, sys
from vramlock.arena import journal
from vramlock.arena.directory import Arena
from vramlock.arena.records import Record
journal.MAX_BYTES = int(sys.argv[2])
arena = Arena.open(sys.argv[1])
record = Record(pid=os.getpid(), name="w" * 40, command=[], strategy="none",
                state="released", since=0.0)
for i in range(1000):
    journal.note(arena, record, "moved", size=i)
    if i % 50 == 0:
        journal.flush()
journal.flush()
"""


def test_a_planted_older_file_does_not_unbound_a_journal(team: Team, arena: Path) -> None:
    """Alice makes ``<bob>.jsonl.1`` in the sticky ``journal/``, which bob cannot then
    replace: his journal still keeps to its cap (lowered here)."""
    plant = arena / "journal" / f"{team.bob}.jsonl.1"
    done = team.run(team.alice, ["touch", str(plant)])
    assert done.returncode == 0, done.stderr
    cap = 20_000
    done = team.py(team.bob, WRITE, str(arena), str(cap))
    assert (done.returncode, done.stderr) == (0, "")
    mine = arena / "journal" / f"{team.bob}.jsonl"
    line = len(mine.read_bytes().splitlines()[-1]) + 1
    assert mine.stat().st_size < cap + 51 * line  # a batch (51 lines) may cross it
    assert plant.stat().st_uid == team.alice and plant.stat().st_size == 0
    assert _stats(arena)["events"] < 2 * cap // line


STRANGER = """
import fcntl, os, sys
path = sys.argv[1]
os.mkdir(path, 0o755)
fd = os.open(os.path.join(path, "token.lock"), os.O_RDONLY | os.O_CREAT, 0o644)
print("opened", flush=True)
sys.stdin.readline()  # the directory is root's now, or not
fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
print("holding", flush=True)
sys.stdin.readline()
"""


def test_a_directory_another_user_made_is_refused(team: Team, spawn: Spawn) -> None:
    """Mallory made the directory and keeps its token.lock open: making it a team arena
    would let her hold the token through that descriptor, so it is refused."""
    shared = team.top / f"shared-{os.urandom(3).hex()}"
    shared.mkdir()
    shared.chmod(0o1777)
    path = shared / "arena"
    mallory = team.spawn(spawn, team.mallory, STRANGER, str(path))
    assert mallory.stdout is not None and mallory.stdout.readline() == "opened\n"
    done = subprocess.run(vramlock("arena", "--arena", str(path), "--group", team.group),
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 125
    assert done.stderr == (
        f"vramlock: arena {path}: already exists and is neither an empty directory of"
        f" root's nor a team arena of {team.group}: other users may hold its files open (a"
        " descriptor outlives a chown); remove it, or name a new directory\n"
    )
    assert path.stat().st_uid == team.mallory  # left as it was
    assert mallory.stdin is not None
    mallory.stdin.close()
    assert mallory.wait(60) == 0


def test_a_team_arena_is_made_again_as_it_is(team: Team, arena: Path) -> None:
    before = {p.name: p.stat().st_ino for p in arena.iterdir()}
    done = subprocess.run(vramlock("arena", "--arena", str(arena), "--group", team.group),
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert (done.returncode, done.stdout) == (0, f"{arena}\n"), done.stderr
    assert {p.name: p.stat().st_ino for p in arena.iterdir()} == before
    assert _mode(arena) == (0, team.gid, 0o750)


@pytest.mark.parametrize("case", ["another group's", "a plain arena", "root's empty"])
def test_what_an_existing_directory_becomes(team: Team, case: str) -> None:
    path = team.top / os.urandom(4).hex()
    if case == "another group's":
        made = subprocess.run(vramlock("arena", "--arena", str(path), "--group", "root"),
                              capture_output=True, text=True, timeout=60)  # fmt: skip
        assert made.returncode == 0, made.stderr
    else:
        path.mkdir(mode=0o755)
        if case == "a plain arena":  # root's, but its token.lock anybody could open
            plain = subprocess.run(vramlock("arena", "--arena", str(path)),
                                   capture_output=True, text=True, timeout=60)  # fmt: skip
            assert plain.returncode == 0, plain.stderr
    done = subprocess.run(vramlock("arena", "--arena", str(path), "--group", team.group),
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    if case == "root's empty":
        assert (done.returncode, done.stderr) == (0, "")
        assert _mode(path / "token.lock") == (0, team.gid, 0o640)
    else:
        assert done.returncode == 125
        assert "already exists and is neither" in done.stderr
