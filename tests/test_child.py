"""The child's side of the control channel, against a scripted parent end."""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Iterator

import pytest

from vramlock import child
from vramlock.command.control import ENV_CONTROL_FD, LineChannel

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def parent(monkeypatch: pytest.MonkeyPatch) -> Iterator[LineChannel]:
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    monkeypatch.setenv(ENV_CONTROL_FD, str(theirs.detach()))
    yield LineChannel(mine)
    mine.close()


def test_connect_without_vramlock_gives_none(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_CONTROL_FD, raising=False)
    assert child.connect() is None
    monkeypatch.setenv(ENV_CONTROL_FD, "²")  # not an ASCII number: ignored, not a crash
    assert child.connect() is None
    r, w = os.pipe()  # a descriptor that is not a socket
    monkeypatch.setenv(ENV_CONTROL_FD, str(r))
    assert child.connect() is None
    os.close(r)
    os.close(w)


def test_hello_then_yield_when_asked(parent: LineChannel) -> None:
    ctl = child.connect()
    assert ctl is not None
    assert parent.wait_lines(5) == ["hello"]
    calls: list[str] = []
    assert not ctl.yield_if_asked(lambda: calls.append("release"), lambda: calls.append("x"))
    parent.send("release")

    def parent_side() -> None:
        got: list[str] = []
        while "want" not in got:
            got += parent.wait_lines(5)
        assert got == ["released", "want"]
        parent.send("restore")

    t = threading.Thread(target=parent_side)
    t.start()
    assert ctl.yield_if_asked(
        lambda: calls.append("release"), lambda: calls.append("restore"), want=True
    )
    t.join(5)
    assert calls == ["release", "restore"]
    assert parent.wait_lines(5) == ["restored"]
    assert not ctl.released
    ctl.close()


def test_released_child_learns_when_vramlock_is_gone(parent: LineChannel) -> None:
    ctl = child.connect()
    assert ctl is not None
    parent.send("release")
    parent.wait_lines(5)
    parent.close()
    with pytest.raises(child.ControlLost):
        ctl.yield_if_asked(lambda: None, lambda: None)
    ctl.close()


def test_serve_in_a_thread_and_ensure_resident(parent: LineChannel) -> None:
    ctl = child.connect()
    assert ctl is not None
    events: list[str] = []
    ctl.serve(lambda: events.append("release"), lambda: events.append("restore"))
    assert ctl.ensure_resident(0)  # resident from the start
    assert parent.wait_lines(5) == ["hello"]
    with ctl.lock:  # GPU work in progress: the release waits for it
        parent.send("release")
        assert parent.wait_lines(0.2) == []
        assert events == []
    assert parent.wait_lines(5) == ["released"]
    assert ctl.released
    assert not ctl.ensure_resident(0.1)  # says want, nobody restores yet
    assert parent.wait_lines(5) == ["want"]
    parent.send("restore")
    assert ctl.ensure_resident(5)
    assert events == ["release", "restore"]
    assert parent.wait_lines(5) == ["restored"]
    ctl.close()


def test_ensure_resident_raises_when_vramlock_leaves_while_released(parent: LineChannel) -> None:
    ctl = child.connect()
    assert ctl is not None
    ctl.serve(lambda: None, lambda: None)
    parent.send("release")
    while "released" not in parent.wait_lines(5):
        pass
    parent.close()
    with pytest.raises(child.ControlLost):
        ctl.ensure_resident(5)
    ctl.close()


def test_close_while_serving_is_quiet(monkeypatch: pytest.MonkeyPatch) -> None:
    """close() from the program while the serving thread waits must not blow up that thread."""
    errors: list[BaseException | None] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: errors.append(args.exc_value))
    for _ in range(200):
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        monkeypatch.setenv(ENV_CONTROL_FD, str(theirs.detach()))
        ctl = child.connect()
        assert ctl is not None
        ctl.serve(lambda: None, lambda: None)
        ctl.close()
        assert ctl._thread is not None
        ctl._thread.join(5)
        mine.close()
    assert errors == []
