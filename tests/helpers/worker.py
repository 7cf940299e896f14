"""The signal worker: a child of ``vramlock run`` that logs when it starts, releases and
restores."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from helpers.commands import vramlock, who_json
from helpers.processes import Spawn, wait_until

WORKER = textwrap.dedent(
    """
    import os, sys, time
    from vramlock import child
    log = os.open(sys.argv[1], os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    name = sys.argv[2]
    def note(what):
        os.write(log, f"{time.monotonic():.6f} {name} {what}\\n".encode())
    # WORKER_LINGER=S: on SIGTERM, go on (obeying requests) for S seconds, then exit 0.
    # Set before "start" is noted: a test sends SIGTERM as soon as it reads it.
    linger, ending = float(os.environ.get("WORKER_LINGER", "0")), []
    if linger:
        import signal
        signal.signal(signal.SIGTERM, lambda *a: ending.append(time.monotonic() + linger))
    ctl = child.connect()
    note("start" if ctl else "no-control")
    want = os.environ.get("WORKER_WANT", "1") == "1"
    while True:
        time.sleep(0.005)
        if ending and time.monotonic() > ending[0]:
            note("exit")
            sys.exit(0)
        if os.environ.get("WORKER_DEAF"):
            continue  # never answers (a request could come between a look and a yield)
        if ctl:
            ctl.yield_if_asked(lambda: note("release"), lambda: note("restore"), want=want)
    """
)


def events(log: Path) -> list[tuple[float, str, str]]:
    """The worker log: (monotonic time, name, event) in order."""
    if not log.exists():
        return []
    out = []
    for line in log.read_text().splitlines():
        t, name, what = line.split()
        out.append((float(t), name, what))
    return out


def whats(log: Path, name: str) -> list[str]:
    """The events ``name`` logged, in order."""
    return [w for _, n, w in events(log) if n == name]


def run_worker(
    spawn: Spawn,
    arena: Path,
    worker: Path,
    log: Path,
    name: str,
    *options: str,
    env: dict[str, str] | None = None,
) -> subprocess.Popen[str]:
    """``vramlock run --min-hold 0 OPTIONS -- python WORKER``, once it is resident and signal."""
    job = spawn(
        vramlock("run", "--arena", str(arena), "--min-hold", "0", *options, "--",
                 sys.executable, str(worker), str(log), name),
        env=env,
    )  # fmt: skip
    wait_until(lambda: whats(log, name) == ["start"])
    wait_until(lambda: any(str(r["strategy"]).endswith("signal") for r in who_json(arena)))
    return job
