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

import portalocker
import pytest
from helpers import ROOT
from helpers.commands import vramlock

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
    forged = [m for m in data["members"] if m["pid"] == 1]
    assert [(m["uid"], m["trusted"]) for m in forged] == [(team.bob, False)]
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
