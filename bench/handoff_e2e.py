"""The end-to-end mode of bench/handoff.py (its docstring has the method): N programs
under real ``vramlock run`` wrappers handing the GPU over, against a bare-flock C pair
(bench/floor.c). This file is also each program (``--role child``)."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import math
import os
import random
import select
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from handoff_figures import WARMUP, cell, filesystem, pct, quantiles

# -- end to end: programs under `vramlock run` ---------------------------------------------------

ENV_CONTROL_FD = "VRAMLOCK_CONTROL_FD"
GAP = (0.005, 0.010)  # seconds between two one-waiter samples: both wrappers settle meanwhile
SAMPLE_TIMEOUT = 10.0  # one handoff taking longer than this is a failure, not a figure
PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
Event = tuple[int, str, str]  # (monotonic ns, kind, program)


def prctl(option: int, value: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(option, value, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl")


class Program:
    """A program under ``vramlock run``: the control protocol, raw, with stamps."""

    def __init__(self, ctl: socket.socket, bench: socket.socket, name: str) -> None:
        self.ctl, self.bench, self.name = ctl, bench, name
        self.stamps: list[str] = []  # sent only between handoffs (flush)
        self.released = self.contend = False

    def stamp(self, kind: str, t: int) -> None:
        self.stamps.append(f"{kind} {self.name} {t}\n")

    def want(self) -> None:
        t0 = time.monotonic_ns()
        self.ctl.sendall(b"want\n")
        self.stamp("want", t0)

    def flush(self) -> None:
        self.bench.sendall("".join(self.stamps).encode())
        self.stamps.clear()

    def from_vramlock(self, word: bytes) -> None:
        if word == b"release":
            t1 = time.monotonic_ns()
            t2 = time.monotonic_ns()  # nothing to free
            self.ctl.sendall(b"released\n")
            self.stamp("release", t1)
            self.stamp("released", t2)
            self.released = True
            if self.contend:
                self.want()
        elif word == b"restore":
            t3 = time.monotonic_ns()
            t4 = time.monotonic_ns()  # nothing to load
            self.ctl.sendall(b"restored\n")
            self.stamp("restore", t3)
            self.stamp("restored", t4)
            self.released = False
            if not self.contend:
                self.flush()  # the benchmark waits for this before its next sample

    def from_benchmark(self, word: bytes) -> None:
        if word == b"want" and self.released:
            self.want()
        elif word == b"contend":
            self.contend = True
            if self.released:
                self.want()
        elif word == b"flush":
            self.stamp("flushed", time.monotonic_ns())
            self.flush()

    def serve(self) -> None:
        """Until the wrapper or the benchmark goes away."""
        handlers = {self.ctl.fileno(): self.from_vramlock, self.bench.fileno(): self.from_benchmark}
        partial = dict.fromkeys(handlers, b"")
        poller = select.poll()
        for fd in handlers:
            poller.register(fd, select.POLLIN)
        while True:
            for fd, _ in poller.poll():
                data = os.read(fd, 4096)
                if not data:
                    return
                *lines, partial[fd] = (partial[fd] + data).split(b"\n")
                for line in lines:
                    handlers[fd](line.strip())


def child_main(sock_path: str, name: str) -> None:
    """The program's start: die with the wrapper, say hello, then serve."""
    wrapper = os.getppid()
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # our wrapper's death ends us too
    if os.getppid() != wrapper:
        return
    ctl = socket.socket(fileno=int(os.environ[ENV_CONTROL_FD]))
    bench = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    bench.connect(sock_path)
    ctl.sendall(b"hello\n")
    bench.sendall(f"start {name} {time.monotonic_ns()} {os.getpid()}\n".encode())
    Program(ctl, bench, name).serve()


class Hub:
    """The benchmark's end of the programs' sockets: their stamps in, commands out."""

    def __init__(self, path: str, check: Callable[[], None]) -> None:
        self.path = path
        self.check = check  # raises if a wrapper died
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(path)
        self.listener.listen(1024)
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.listener, selectors.EVENT_READ)
        self.partial: dict[socket.socket, bytes] = {}
        self.conns: dict[str, socket.socket] = {}
        self.pids: dict[str, int] = {}
        self.events: list[Event] = []
        self.latest: tuple[int, str] = (0, "")  # the last start or restore seen: the resident
        self.restored_at: dict[str, int] = {}
        self.flushed: dict[str, int] = {}  # program -> when it last sent all its stamps

    @property
    def resident(self) -> str:
        return self.latest[1]

    def _line(self, sock: socket.socket, line: str) -> None:
        kind, name, t, *rest = line.split()
        if kind == "flushed":
            self.flushed[name] = int(t)
            return
        self.events.append((int(t), kind, name))
        if kind == "start":
            self.conns[name] = sock
            self.pids[name] = int(rest[0])
        if kind in ("start", "restore"):
            self.latest = max(self.latest, (int(t), name))
        if kind == "restore":
            self.restored_at[name] = int(t)

    def wait(self, done: Callable[[], bool], seconds: float, what: str = "") -> None:
        """Take in stamps until ``done()`` (never, for a pause); fail after ``seconds`` if
        ``what`` says what we waited for."""
        end = time.monotonic() + seconds
        while not done():
            self.check()
            left = end - time.monotonic()
            if left <= 0:
                if what:
                    raise SystemExit(f"e2e: no {what} within {seconds:g} s")
                return
            for key, _ in self.selector.select(min(left, 0.5)):
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                if sock is self.listener:
                    conn, _ = self.listener.accept()
                    self.partial[conn] = b""
                    self.selector.register(conn, selectors.EVENT_READ)
                    continue
                data = sock.recv(65536)
                if not data:
                    self.selector.unregister(sock)
                    continue
                *lines, self.partial[sock] = (self.partial[sock] + data).split(b"\n")
                for line in lines:
                    self._line(sock, line.decode())

    def restored_since(self, name: str, t: int) -> bool:
        return self.restored_at.get(name, 0) > t

    def send(self, name: str, word: str) -> None:
        self.conns[name].sendall(word.encode() + b"\n")

    def flush(self) -> int:
        """Have every program send its stamps; all stamps before the returned time are in."""
        self.flushed.clear()
        for name in self.conns:
            self.send(name, "flush")
        self.wait(lambda: len(self.flushed) == len(self.conns), SAMPLE_TIMEOUT, "flush")
        return min(self.flushed.values())

    def close(self) -> None:
        for conn in self.partial:
            conn.close()
        self.selector.close()
        self.listener.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


@dataclass
class EndToEnd:
    seconds: float
    e2e: list[int] = field(default_factory=list)  # ask + hand over
    ask: list[int] = field(default_factory=list)  # want -> the resident is told to release
    handover: list[int] = field(default_factory=list)  # released -> the waiter told to restore
    release: list[int] = field(default_factory=list)  # the program's own release (excluded)
    wait: list[int] = field(default_factory=list)  # want -> restore, queueing included

    def add(self, t0: int, t1: int, t2: int, t3: int) -> None:
        self.e2e.append((t1 - t0) + (t3 - t2))
        self.ask.append(t1 - t0)
        self.handover.append(t3 - t2)
        self.release.append(t2 - t1)


def analyse_e2e(events: list[Event], start: int, end: int, cutoff: int) -> EndToEnd:
    """Pair the programs' stamps into handoffs (see the module's docstring). Stamps from
    ``cutoff`` on are left out: some programs had not sent theirs yet."""
    figures = EndToEnd((end - start) / 1e9)
    queued: dict[str, int] = {}  # program -> its want, until it is told to restore
    resident: str | None = None
    ready = 0  # the resident said restored (or started)
    asked: tuple[int | None, int] | None = None  # (T0, T1) of the release under way
    handing: tuple[int | None, int, int] | None = None  # (T0, T1, T2) of the last release
    for t, kind, who in sorted(e for e in events if e[0] < cutoff):
        if kind == "want":
            queued.setdefault(who, t)
        elif kind == "release":
            asked = (max(ready, min(queued.values())) if queued else None, t)
        elif kind == "released":
            if who != resident or asked is None:
                raise SystemExit(f"e2e: {who} released while {resident} was resident")
            handing, asked, resident = (*asked, t), None, None
        elif kind in ("start", "restore"):
            if resident is not None:
                raise SystemExit(f"e2e: two residents at once: {resident} and {who} at {t}")
            resident, ready = who, t
            wanted = queued.pop(who, None)
            if wanted is not None and start <= wanted and t <= end:
                figures.wait.append(t - wanted)
            if handing is not None:
                t0, t1, t2 = handing
                if t0 is not None and start <= t0 and t <= end:
                    figures.add(t0, t1, t2, t)
                handing = None
        elif kind == "restored":
            ready = t
    return figures


def _spawn_wrapper(arena: str, sock: str, name: str, err: str) -> subprocess.Popen[bytes]:
    cmd = [
        sys.executable, "-m", "vramlock", "run", "--arena", arena, "--name", name,
        "--release", "signal", "--min-hold", "0", "--demand", "child", "--",
        sys.executable, os.path.abspath(__file__), "--role", "child", sock, name,
    ]  # fmt: skip
    with open(err, "wb") as f:
        return subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=f,
            start_new_session=True,  # a process group of its own, to SIGKILL at the end
        )  # fmt: skip


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def _reap_orphans(seconds: float) -> None:
    """Reap programs whose wrapper died before them (we are their subreaper)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            time.sleep(0.01)  # SIGKILLed processes that are not gone yet


def run_e2e(tmp: str, n: int, seconds: float, rng: random.Random) -> tuple[EndToEnd, EndToEnd]:
    """One arena of ``n`` wrapped programs: the one-waiter phase, then all contending."""
    arena = os.path.join(tmp, f"e2e{n}")
    os.mkdir(arena, 0o700)
    errs = [os.path.join(tmp, f"e2e{n}-{i}.err") for i in range(n)]
    wrappers: list[subprocess.Popen[bytes]] = []

    def check() -> None:
        for p, err in zip(wrappers, errs, strict=False):
            if p.poll() is not None:
                with open(err, errors="replace") as f:
                    tail = f.read()[-600:]
                raise SystemExit(f"e2e: a wrapper exited with {p.returncode}: {tail!r}")

    hub = Hub(os.path.join(tmp, f"e2e{n}.sock"), check)
    try:
        for i in range(n):
            wrappers.append(_spawn_wrapper(arena, hub.path, f"e{i}", errs[i]))
        # Start-up: each wrapper in turn takes the token, starts its program and is asked to
        # release at once (the others wait), until the last one stays resident.
        hub.wait(lambda: len(hub.pids) == n, 30 + 1.0 * n, f"start of all {n} programs")
        hub.wait(lambda: False, 0.3)

        start = time.monotonic_ns()
        end_by = time.monotonic() + seconds
        while time.monotonic() < end_by:
            hub.wait(lambda: False, rng.uniform(*GAP))
            waiter = rng.choice([name for name in hub.pids if name != hub.resident])
            sent = time.monotonic_ns()
            hub.send(waiter, "want")
            hub.wait(functools.partial(hub.restored_since, waiter, sent), SAMPLE_TIMEOUT, "handoff")
        one = (start, time.monotonic_ns())
        hub.flush()

        for name in hub.pids:
            hub.send(name, "contend")
        start = time.monotonic_ns() + int((WARMUP + 0.01 * n) * 1e9)  # the first rush
        hub.wait(lambda: False, seconds)
        contending = (start, time.monotonic_ns())
        cutoff = hub.flush()
    finally:
        for pgid in [p.pid for p in wrappers] + list(hub.pids.values()):
            _kill_group(pgid)
        hub.close()
        for p in wrappers:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(10)
        _reap_orphans(10.0)
    return (
        analyse_e2e(hub.events, *one, cutoff),
        analyse_e2e(hub.events, *contending, cutoff),
    )


def run_floor(tmp: str, rounds: int) -> EndToEnd | None:
    """bench/floor.c, compiled here and now; None without a C compiler."""
    cc = shutil.which("gcc")
    if cc is None:
        return None
    exe = os.path.join(tmp, "floor")
    source = os.path.join(os.path.dirname(os.path.abspath(__file__)), "floor.c")
    subprocess.run([cc, "-O2", "-Wall", "-o", exe, source], check=True)
    arena = os.path.join(tmp, "floor-arena")
    os.mkdir(arena, 0o700)
    for name in ("token.lock", "want.lock"):
        open(os.path.join(arena, name), "w").close()
    gap_us = [str(int(s * 1e6)) for s in GAP]
    proc = subprocess.Popen(
        [exe, arena, str(rounds), *gap_us], stdout=subprocess.PIPE, start_new_session=True
    )
    try:
        out, _ = proc.communicate(timeout=30 + rounds * GAP[1] * 2)
    finally:
        if proc.poll() is None:
            _kill_group(proc.pid)  # its two members too (they also die with it)
            proc.wait()
    if proc.returncode != 0:
        raise SystemExit(f"floor: exited with {proc.returncode}")
    rows = [[int(x) for x in line.split()] for line in out.decode().splitlines()]
    skip = len(rows) // 20  # warm-up
    figures = EndToEnd((rows[-1][3] - rows[skip][0]) / 1e9)
    for t0, t1, t2, t3 in rows[skip:]:
        figures.add(t0, t1, t2, t3)
    return figures


TARGET_P50_US, TARGET_P99_US = 500.0, 5000.0  # the end-to-end target, 2-64 members


def report_e2e(
    floor: EndToEnd | None, results: dict[int, tuple[EndToEnd, EndToEnd]], where: str
) -> dict[str, object]:
    print()
    print(
        "e2e: programs under `vramlock run --release signal --min-hold 0 --demand child`,"
        f" arenas in {where} ({filesystem(where)})"
    )
    print(
        f"target: end-to-end p50 <= {TARGET_P50_US:g} µs and p99 <= {TARGET_P99_US:g} µs;"
        " times in µs: p50 / p99 (max)"
    )
    print(
        f"{'':>18} {'samples':>9} {'/s':>6}  {'ask: want -> release':>22}"
        f"  {'released -> restore':>22}  {'end-to-end':>22}  {'x floor p50':>11}  target"
    )
    base = pct(floor.e2e, 50) if floor is not None else float("nan")

    def row(label: str, f: EndToEnd) -> dict[str, object]:
        ratio = None if math.isnan(base) else round(pct(f.e2e, 50) / base, 2)
        met = pct(f.e2e, 50) <= TARGET_P50_US and pct(f.e2e, 99) <= TARGET_P99_US
        print(
            f"{label:>18} {len(f.e2e):>9} {len(f.e2e) / max(f.seconds, 1e-9):>6.0f}"
            f"  {cell(f.ask)}  {cell(f.handover)}  {cell(f.e2e)}"
            f"  {'-' if ratio is None else f'{ratio:.1f}':>11}  {'met' if met else 'missed'}"
        )
        return {**_e2e_summary(f), "e2e_p50_over_floor_p50": ratio, "target_met": met}

    out: dict[str, object] = {}
    if floor is None:
        print(f"{'floor (C pair)':>18}  skipped: no gcc to compile bench/floor.c")
    else:
        out["floor"] = row("floor (C pair)", floor)
    for phase, index in (("one waiter at a time", 0), ("all contending", 1)):
        print(f"{phase}:")
        out[phase] = {str(n): row(f"{n} members", pair[index]) for n, pair in results.items()}
    for label, attr in (
        ("whole wait, all contending (want -> restore, queueing included)", "wait"),
        ("the programs' own release (release -> released, excluded)", "release"),
    ):
        parts = ", ".join(f"{n}: {cell(getattr(c, attr)).strip()}" for n, (_, c) in results.items())
        print(f"{label}: {parts}")
    return out


def _e2e_summary(f: EndToEnd) -> dict[str, object]:
    return {
        "samples": len(f.e2e),
        "per_second": round(len(f.e2e) / max(f.seconds, 1e-9), 1),
        **{k: quantiles(getattr(f, k)) for k in ("ask", "handover", "e2e", "release", "wait")},
    }


if __name__ == "__main__":
    if sys.argv[1:3] != ["--role", "child"]:
        raise SystemExit("usage: run by bench/handoff.py (--role child SOCKET NAME)")
    child_main(sys.argv[3], sys.argv[4])
