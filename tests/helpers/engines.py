"""Fake inference engines (tests/fake_engine.py) started as the real ones are, and a
witness that takes the token with plain flock calls."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from helpers import ROOT
from helpers.commands import vramlock
from helpers.processes import Spawn, wait_until
from helpers.stamps import witness_script

FAKE = ROOT / "tests" / "fake_engine.py"


WITNESS = witness_script(
    """
    import fcntl, os, sys, time
    arena, out, hold, log = sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4]
    asked = time.monotonic()
    """,
    """
    alive = []  # the server's processes (logged at start) living now
    for line in open(log).read().splitlines():
        parts = line.split()
        if parts[1:2] == ["start"]:
            try:
                with open(f"/proc/{parts[2]}/stat") as f:
                    state = f.read().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if state not in ("Z", "X"):
                alive.append(parts[2])
    open(out + ".held", "w").close()
    time.sleep(hold)
    with open(out, "w") as f:
        f.write(f"{asked} {t0} {time.monotonic()} {','.join(alive)}")
    """,
)


@dataclass
class Turn:
    """The witness's turn: when it asked, held and let go of the token, and which of the
    server's processes were alive when it got it."""

    asked: float
    start: float
    end: float
    alive: list[str]


class Witness:
    """A process that takes the token with plain flock calls, as any member, and notes
    which of the server's processes (logged at their start) were alive then."""

    def __init__(self, tmp: Path, arena: Path, log: Path, hold: float = 0.3) -> None:
        script = tmp / "witness.py"
        script.write_text(WITNESS)
        self.out = tmp / f"witness-{time.monotonic_ns()}"
        self.proc = subprocess.Popen(
            [sys.executable, str(script), str(arena), str(self.out), str(hold), str(log)],
            start_new_session=True,
        )

    def turn(self, timeout: float = 60) -> Turn:
        """Wait for the witness to have held the token; what it saw."""
        self.proc.wait(timeout)
        asked, start, end, alive = self.out.read_text().split(" ")
        return Turn(float(asked), float(start), float(end), [p for p in alive.split(",") if p])


@dataclass
class Engine:
    """One fake engine: the command that starts it, its port, its log and settings."""

    name: str
    argv: list[str]
    port: int
    log: Path
    env: dict[str, str] = field(default_factory=dict)

    def events(self) -> list[tuple[float, str]]:
        """The fake's log: (monotonic time, event) in order."""
        if not self.log.exists():
            return []
        lines = self.log.read_text().splitlines()
        return [(float(t), e) for t, e in (ln.split(" ", 1) for ln in lines)]

    def requests(self) -> list[str]:
        """The requests in order, a run of the same one (a poll) counted once."""
        out: list[str] = []
        for _, event in self.events():
            if event.startswith("req ") and (not out or out[-1] != event[4:]):
                out.append(event[4:])
        return out

    def when(self, event: str, nth: int = 1) -> float:
        """When ``event`` was logged for the ``nth`` time."""
        return [t for t, e in self.events() if e == event][nth - 1]

    def count(self, event: str) -> int:
        """How many times ``event`` was logged."""
        return sum(e == event for _, e in self.events())

    def assert_free_during(self, turn: Turn) -> None:
        """The pretend GPU memory was free for the whole of the witness's turn."""
        held = False
        for t, event in self.events():
            if event in ("gpu 0", "gpu 1"):
                if t < turn.start:
                    held = event == "gpu 1"
                elif t < turn.end:
                    assert event != "gpu 1", f"the server took the GPU at {t} in {turn}"
        assert not held, f"the GPU was still the server's when the witness got it: {turn}"


MakeEngine = Callable[..., Engine]


def wrap(spawn: Spawn, arena: Path, eng: Engine, *options: str) -> subprocess.Popen[str]:
    """``vramlock run OPTIONS -- <the fake>``, returned once the fake holds its GPU."""
    job = spawn(
        vramlock("run", "--arena", str(arena), "--min-hold", "0", *options, "--", *eng.argv),
        env=dict(os.environ, **eng.env),
    )
    wait_until(lambda: eng.count("gpu 1") >= 1 or job.poll() is not None)
    assert job.poll() is None, job.communicate()
    return job
