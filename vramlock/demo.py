"""``vramlock demo``: simulated GPU programs share a temporary arena under ``vramlock run``.

Each simulated program is a real ``vramlock run --release signal`` wrapping a
small Python process that "computes" in steps, offloads when asked and logs when
it is resident to an append-only event log; the summary is computed from that log.

Run as ``python -m vramlock.demo NAME LOG`` it is one simulated program.
"""

from __future__ import annotations

import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time

from .arena.directory import Arena
from .arena.roster import Row, snapshot

NAMES = ("llama", "comfy", "trainer", "vllm", "whisper", "sglang", "ollama", "torch")
COLORS = ("green", "magenta", "cyan", "yellow", "blue", "red", "white", "bright_green")
STEP = 0.02  # one simulated kernel launch
OFFLOAD = 0.03  # simulated copy of the program's memory to the host, and back
WIDTH = 80  # the demo's output fits a plain terminal


def _log(fd: int, name: str, what: str) -> None:
    # One write per line on an O_APPEND descriptor: lines never interleave.
    os.write(fd, f"{time.monotonic():.6f} {name} {what}\n".encode())


def simulated_program(name: str, log_path: str) -> None:
    """The child: compute in steps, hand the GPU back whenever vramlock asks."""
    from .child import connect

    log = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
    ctl = connect()
    if ctl is None:
        sys.exit("not run by vramlock")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the demo ends us with SIGTERM
    _log(log, name, "enter")

    # Resident from the first byte loaded to the last byte freed.
    def offload() -> None:
        time.sleep(OFFLOAD)
        _log(log, name, "leave")

    def reload() -> None:
        _log(log, name, "enter")
        time.sleep(OFFLOAD)

    while True:
        time.sleep(STEP)
        ctl.yield_if_asked(release=offload, restore=reload)


class Demo:
    """Starts the members, reports who holds the token, and sums up at the end."""

    def __init__(self, members: int = 3, seconds: float = 8.0) -> None:
        self.names = list(NAMES[:members])
        self.seconds = seconds
        self.tmp = tempfile.mkdtemp(prefix="vramlock-demo-")
        self.arena = self.tmp
        self.log_path = os.path.join(self.tmp, "events.log")
        self.procs: list[subprocess.Popen[bytes]] = []
        self.started = 0.0
        self._first: float | None = None
        self._stopped = 0.0
        self._arena = Arena.open(self.arena)

    def start(self) -> None:
        self.started = time.monotonic()
        env = dict(os.environ)
        env.pop("VRAMLOCK_ARENA", None)
        for name in self.names:
            cmd = [
                sys.executable, "-m", "vramlock", "run", "--arena", self.arena,
                "--release", "signal", "--name", name, "--min-hold", "250ms", "--",
                sys.executable, "-m", "vramlock.demo", name, self.log_path,
            ]  # fmt: skip
            # A session of their own: Ctrl-C is for the demo, which then ends them.
            self.procs.append(
                subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, start_new_session=True)
            )

    def running(self) -> bool:
        return self.elapsed() < self.seconds and all(p.poll() is None for p in self.procs)

    def elapsed(self) -> float:
        """Seconds since the first program became resident (starting Python takes a while)."""
        first = self._first_enter()
        if first is None:
            return 0.0 if time.monotonic() - self.started < 30 else self.seconds
        return time.monotonic() - first

    def _first_enter(self) -> float | None:
        if self._first is None:
            self._first = next((t for t, _, what in self._events() if what == "enter"), None)
        return self._first

    def snapshot(self) -> list[Row]:
        return snapshot(self._arena)

    def color(self, name: str | None) -> str:
        return COLORS[self.names.index(name)] if name in self.names else "dim"

    def _events(self) -> list[tuple[float, str, str]]:
        try:
            with open(self.log_path) as f:
                lines = f.read().splitlines()
        except OSError:
            return []
        out = []
        for line in lines:
            t, name, what = line.split()
            out.append((float(t), name, what))
        return out

    def current(self) -> str | None:
        holder = None
        for _, name, what in self._events():
            holder = name if what == "enter" else (None if holder == name else holder)
        return holder

    def timeline(self, width: int) -> list[str | None]:
        """Who was resident in each of ``width`` slices of the run so far."""
        events = self._events()
        span = max(self.seconds, 1e-3)
        slots: list[str | None] = [None] * width
        origin = self._first_enter() or time.monotonic()
        holder, since = None, origin
        for t, name, what in [*events, (time.monotonic(), "", "now")]:
            if holder is not None:
                lo = int((since - origin) / span * width)
                hi = int((t - origin) / span * width)
                for i in range(max(lo, 0), min(hi + 1, width)):
                    slots[i] = holder
            if what == "enter":
                holder, since = name, t
            elif name == holder:
                holder = None
        return slots

    def stop(self) -> str:
        """End the programs and sum up the time run (shorter than asked when interrupted)."""
        self._stopped = time.monotonic()
        ran = min(self.elapsed(), self.seconds)
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        codes = [p.wait() for p in self.procs]
        self._arena.close()
        summary = self.summary(codes, ran)
        shutil.rmtree(self.tmp, ignore_errors=True)
        return summary

    def summary(self, codes: list[int], ran: float) -> str:
        events = self._events()
        gaps, resident = [], dict.fromkeys(self.names, 0.0)
        last_leave: tuple[float, str] | None = None
        entered: dict[str, float] = {}
        for t, name, what in events:
            if what == "enter":
                entered[name] = t
                if last_leave is not None and last_leave[1] != name:
                    gaps.append(t - last_leave[0])
                last_leave = None
            else:
                resident[name] += t - entered.pop(name, t)
                last_leave = (t, name)
        for name, since in entered.items():  # still resident when the demo ended
            resident[name] += self._stopped - since
        total = sum(resident.values()) or 1.0
        lines = [f"{len(gaps)} handoffs in {round(ran, 1):g} s between {len(self.names)} programs"]
        if gaps:
            lines.append(
                f"median handoff {statistics.median(gaps) * 1000:.1f} ms"
                " (memory freed -> the next program starts loading)"
            )
        share = ", ".join(f"{n} {resident[n] / total:.0%}" for n in self.names)
        lines.append(textwrap.fill(f"GPU share: {share}", WIDTH, subsequent_indent=" " * 11))
        bad = [c for c in codes if c not in (0, -signal.SIGTERM, 128 + signal.SIGTERM)]
        if bad:
            lines.append(f"warning: members exited with {bad}")
        return "\n".join(lines)


if __name__ == "__main__":
    simulated_program(sys.argv[1], sys.argv[2])
