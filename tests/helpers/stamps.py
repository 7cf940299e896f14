"""The release strategies' witnesses, owned by the test and not by vramlock: a separate
process that joins the arena with plain flock calls and stamps when it held the token,
and a ticker that stands in for a command's GPU work, stamping every tick in a log of
its own. A tick inside the witness's interval is two residents at once."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from helpers.processes import wait_until

# A witness takes the token as a member does: it queues on want.lock, takes token.lock
# (t0: when it holds it) and leaves the queue.
TAKE_TOKEN = textwrap.dedent(
    """
    want = os.open(os.path.join(arena, "want.lock"), os.O_RDONLY)
    fcntl.flock(want, fcntl.LOCK_SH)
    token = os.open(os.path.join(arena, "token.lock"), os.O_RDONLY)
    fcntl.flock(token, fcntl.LOCK_EX)
    t0 = time.monotonic()
    fcntl.flock(want, fcntl.LOCK_UN)
    """
)


def witness_script(head: str, tail: str) -> str:
    """A witness's script: ``head`` (its imports, and its argv read into names, arena
    first), the token taken, then ``tail``."""
    return textwrap.dedent(head) + TAKE_TOKEN.lstrip("\n") + textwrap.dedent(tail).lstrip("\n")


WITNESS = witness_script(
    """
    import fcntl, os, sys, time
    arena, out, hold = sys.argv[1], sys.argv[2], float(sys.argv[3])
    """,
    """
    open(out + ".held", "w").close()
    time.sleep(hold)
    t1 = time.monotonic()
    with open(out, "w") as f:
        f.write(f"{t0} {t1}")
    """,
)

# Stands in for GPU work: stamps a tick every 2 ms; ignores the signals named.
TICKER = textwrap.dedent(
    """
    import os, signal, sys, time
    for name in sys.argv[2:]:
        signal.signal(getattr(signal, name), signal.SIG_IGN)
    log = os.open(sys.argv[1], os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    while True:
        os.write(log, f"{time.monotonic():.6f} {os.getpid()}\\n".encode())
        time.sleep(0.002)
    """
)


class Witness:
    def __init__(self, tmp: Path, arena: Path, hold: float, name: str = "witness") -> None:
        script = tmp / "witness.py"
        script.write_text(WITNESS)
        self.out = tmp / name
        self.proc = subprocess.Popen(
            [sys.executable, str(script), str(arena), str(self.out), str(hold)],
            start_new_session=True,
        )

    def wait_held(self, timeout: float = 30) -> None:
        wait_until(lambda: Path(f"{self.out}.held").exists(), timeout=timeout)

    def interval(self, timeout: float = 60) -> tuple[float, float]:
        self.proc.wait(timeout)
        t0, t1 = self.out.read_text().split()
        return float(t0), float(t1)


def ticks(log: Path) -> list[tuple[float, int]]:
    out = []
    if log.exists():
        for line in log.read_text().splitlines():
            parts = line.split()
            if len(parts) == 2:  # a process killed mid-write leaves a partial line
                out.append((float(parts[0]), int(parts[1])))
    return out


def ticks_inside(log: Path, span: tuple[float, float]) -> list[tuple[float, int]]:
    return [t for t in ticks(log) if span[0] < t[0] < span[1]]
