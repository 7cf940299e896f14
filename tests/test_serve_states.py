"""serve's model states: the member's states, changing the way the member's table allows."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

pytest.importorskip("yaml")

from vramlock.arena.member import TRANSITIONS
from vramlock.arena.records import State
from vramlock.cli import parse_duration
from vramlock.errors import InvalidTransition
from vramlock.serve import members
from vramlock.serve.config import load
from vramlock.serve.members import Wrapper, follow


def test_follow_takes_the_member_s_way_between_two_looks() -> None:
    assert follow(State.WAITING, State.RESIDENT) == [State.RESIDENT]
    assert follow(State.RESIDENT, State.WAITING) == [State.RELEASED, State.WAITING]
    assert follow(State.RELEASING, State.RELEASING) == []


def test_follow_refuses_what_the_table_does_not_allow(monkeypatch: pytest.MonkeyPatch) -> None:
    table = {**TRANSITIONS, State.RELEASED: frozenset()}
    monkeypatch.setattr(members, "TRANSITIONS", table)
    with pytest.raises(InvalidTransition, match="cannot go from released to resident"):
        follow(State.RELEASED, State.RESIDENT)


@pytest.mark.parametrize(
    ("alive", "record", "shown"),
    [
        (True, "releasing", State.RELEASING),
        (True, "restoring", State.RESTORING),
        (True, "resident", State.RESIDENT),
        (True, None, State.WAITING),  # started, not joined yet
        (False, "resident", State.RELEASED),  # its wrapper ended
    ],
)
def test_a_model_shows_its_member_state(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, alive: bool, record: str | None, shown: State
) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(textwrap.dedent("models:\n  a:\n    cmd: srv --port ${PORT}\n"))
    config = load(str(path), parse_duration)
    w = Wrapper(config.models["a"], config, lambda _: None)
    try:
        monkeypatch.setattr(w, "alive", lambda: alive)
        monkeypatch.setattr(w, "member_state", lambda: record)
        w.shown = State.WAITING
        assert w.state() is shown
        assert w.shown is shown
    finally:
        w.close()


def test_a_wrapper_s_state_changes_through_its_own_methods_alone() -> None:
    """No module of serve but members.py sets a wrapper's attributes (its requests, its
    ttl, its process): each change goes through a method of the wrapper."""
    import ast

    serve = Path(members.__file__).parent
    state = {"admitted", "in_flight", "ttl_timer", "unloading", "ending", "proc", "shown",
             "config", "model", "starts", "since", "exited", "pipes"}  # fmt: skip
    found = []
    for path in sorted(serve.glob("**/*.py")):
        if path.name == "members.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.Assign):
                targets = node.targets
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
                targets = [node.target]
            for t in targets:
                for a in t.elts if isinstance(t, ast.Tuple) else [t]:
                    if not isinstance(a, ast.Attribute) or not isinstance(a.value, ast.Name):
                        continue
                    if a.attr in state and a.value.id != "self":
                        found.append(f"{path.name}:{a.lineno}: {a.value.id}.{a.attr}")
    assert found == []
