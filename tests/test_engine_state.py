"""The engine's states (vramlock/gpu/core/state.h): every change goes through
``transition``, which makes the legal moves and refuses every other with one line on
stderr, the state left as it was. A C program of the test's own
(tests/engine/transitions.c) tries every move from every state against the core's
state.c, compiled as both libraries compile it; the table of legal moves is written
here, by hand, from the life of a swapped process."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from helpers import ROOT

from vramlock.gpu.cbuild import compiler

pytestmark = pytest.mark.skipif(compiler() is None, reason="no C compiler")

CORE = ROOT / "vramlock" / "gpu" / "core"
STATES = ("resident", "releasing", "released", "parked", "restoring")
LEGAL = {
    ("resident", "releasing"),  # a release begins
    ("releasing", "released"),  # its memory is out
    ("releasing", "resident"),  # it failed, and was put back as it was
    ("released", "restoring"),  # a restore begins
    ("released", "parked"),  # its host copies unlocked around a checkpoint
    ("parked", "released"),  # locked again
    ("parked", "restoring"),  # restored straight from a park
    ("restoring", "resident"),  # its memory is back
    ("restoring", "released"),  # it could not come back: released as before
}


@pytest.fixture(scope="module")
def moves(tmp_path_factory: pytest.TempPathFactory) -> subprocess.CompletedProcess[str]:
    cc = compiler()
    assert cc is not None
    out = tmp_path_factory.mktemp("engine") / "transitions"
    subprocess.run(
        [cc, "-std=c11", "-O2", "-Wall", "-Wextra", "-Werror", f"-I{CORE}", "-o", str(out),
         str(ROOT / "tests" / "engine" / "transitions.c"), str(CORE / "state.c")],
        check=True,
    )  # fmt: skip
    return subprocess.run([str(out)], capture_output=True, text=True, timeout=30, check=True)


def _table(done: subprocess.CompletedProcess[str]) -> dict[tuple[str, str], tuple[int, str]]:
    rows = [w for w in map(str.split, done.stdout.splitlines()) if len(w) == 4 and w[0] in STATES]
    return {(f, t): (int(r), after) for f, t, r, after in rows}


def test_the_legal_moves_are_made(moves: subprocess.CompletedProcess[str]) -> None:
    table = _table(moves)
    for move in sorted(LEGAL):
        assert table[move] == (0, move[1]), move


def test_every_other_move_is_refused_and_said(moves: subprocess.CompletedProcess[str]) -> None:
    """Restore while resident, release while restoring, a state to itself: each is
    refused, the state unchanged, and stderr says which move and where it stands."""
    table = _table(moves)
    refused = [(f, t) for f in STATES for t in STATES if (f, t) not in LEGAL]
    assert len(table) == len(STATES) ** 2
    for f, t in refused:
        assert table[f, t] == (-1, f), (f, t)
    said = moves.stderr.splitlines()
    assert ("resident", "restoring") in refused and ("restoring", "releasing") in refused
    assert any(
        line.endswith("refused a state change from resident to restoring: the process is resident")
        for line in said
    )
    assert any("from restoring to releasing: the process is restoring" in line for line in said)
    # One line for each refused move, and one for the stale one below: nothing else.
    assert len(said) == len(refused) + 1


def test_a_move_from_a_state_not_held_is_refused(
    moves: subprocess.CompletedProcess[str],
) -> None:
    """The move must start where the process is: released -> restoring is legal, but
    not while the process is resident."""
    assert "stale released restoring -1 resident" in moves.stdout.splitlines()


def test_released_means_its_memory_is_off_the_device(
    moves: subprocess.CompletedProcess[str],
) -> None:
    off = {line.split()[1]: line.split()[2] for line in moves.stdout.splitlines()
           if line.startswith("off ")}  # fmt: skip
    assert off == {"resident": "0", "releasing": "0", "released": "1", "parked": "1",
                   "restoring": "0"}  # fmt: skip


def test_the_source_has_no_path_around_transition() -> None:
    """Only state.c writes the state: every front end moves it by ``transition``."""
    writes = [
        f"{path.relative_to(ROOT)}: {line.strip()}"
        for path in sorted(Path(ROOT / "vramlock" / "gpu").rglob("*.[ch]"))
        if path.name != "state.c"
        for line in path.read_text(encoding="utf-8").splitlines()
        if re.search(r"engine\.state\s*=(?!=)", line)
    ]
    assert not writes, writes
