"""Handoff benchmarks (targets: docs/benchmarks.md), each with its floor measured in the same run.

Two modes (``--mode``, default both): ``protocol``, the overhead of the want/token protocol
between ``Member`` objects, against a bare flock ping-pong; and ``e2e``, what a program feels
through real ``vramlock run`` wrappers, against a bare-flock C pair (``bench/floor.c``).
``--journal both`` runs the protocol mode with the members journalling and with
``VRAMLOCK_JOURNAL=off``, alternating ``--repeat`` times, side by side: what the journal costs.

**protocol.** N member processes use ``vramlock.arena.member.Member`` directly (no
``vramlock run``),
with ``min_hold=0`` and no simulated work. Each loops as a holder does in ``vramlock run``:
sleep in poll() on the inotify hint descriptor for at most ``PROBE_INTERVAL`` (250 ms), drain
it, then ``yield_if_wanted``: when somebody waits, release at once, re-queue politely
(``wait_polite``) and acquire again. Every process logs ``time.monotonic_ns()`` stamps in memory
and writes them to a file of its own when it ends; the parent pairs them up:

- arrive: just before a waiter's ``want.lock`` LOCK_SH call (granted at once unless a probe
  holds it for an instant, so this errs early by a few µs: detection is never flattered);
- own: its token flock returned (and its still-linked check, a few µs);
- ready: ``resident()`` returned, after the acquire and restore bookkeeping (member records);
  ``min_hold`` counts from here, so a holder cannot be asked to release sooner;
- notice: the holder's ``wanted()`` returned True;
- unlock: just before the holder's ``LOCK_UN`` of the token.

Per handoff:

- detection = notice - max(holder's ready, earliest arrival of a waiter still queued): the
  holder's reaction time, hint wake-up or probe interval included;
- kernel = next own - unlock: the kernel's wake-up of the first queued waiter;
- overhead = detection + kernel (per handoff, then the percentiles).

Excluded, and shown on their own: the release (notice -> unlock) and the restore (own ->
ready). With no simulated work both are only vramlock's bookkeeping (member records were written
there, at a cost that depends on the arena's filesystem, until a background thread took them
over). Also shown: a waiter's whole wait (arrive -> own), queueing behind other waiters included.

The reference is two processes handing a plain flock back and forth (unlock -> the other's
blocking flock returns), sequenced by pipes so that neither barges: the kernel's own cost.

**e2e.** N programs, each under ``vramlock run --release signal --min-hold 0 --demand child``
in one arena. Each program is this file with ``--role child``: it speaks the control protocol
raw on ``VRAMLOCK_CONTROL_FD`` (``hello``; ``release`` is answered ``released`` at once,
``restore`` is answered ``restored``; it says ``want`` when it wants the GPU back) and stamps
``time.monotonic_ns()`` (CLOCK_MONOTONIC, one clock for the whole machine):

- T0: a released program says ``want`` (its wrapper then queues on want.lock and token.lock);
- T1: the resident program reads ``release``;
- T2: it says ``released`` (T2 - T1 is the program's own release cost, about 0 here);
- T3: the waiting program reads ``restore``; T4: it says ``restored``.

end-to-end = (T3 - T0) - (T2 - T1) = ask + hand over, where ask = T1 - T0 (want -> the
resident is told to release) and hand over = T3 - T2 (released -> the waiter is told to
restore). Under contention T0 becomes the later of the earliest ``want`` still queued and the
resident's T4 (a resident cannot be asked before it is back), as ``detection`` above. A
program sends its stamps to the benchmark over a Unix socket only between handoffs: after its
own ``restored`` in the one-waiter phase, and when asked to flush.

Per member count, two phases: **one waiter at a time** (the benchmark tells one released
program to say ``want``, waits for its ``restore``, pauses 5-10 ms so that both wrappers
settle, and repeats), then **all contending** (every program says ``want`` as soon as it has
released). Before them, start-up: each wrapper in turn takes the token, starts its program and
is asked to release at once, until the last one stays resident.

The floor is ``bench/floor.c``, compiled with gcc into a temporary directory: two bare C
processes doing the same want/token protocol with the same 5-10 ms pauses, the holder sleeping
in poll() on inotify as vramlock's do (its comment has the details). Without gcc it is skipped.

The benchmark is a child subreaper, starts every wrapper in a session of its own, and at the
end (also on Ctrl-C, SIGTERM or an error) SIGKILLs every wrapper's and program's process group
and reaps them. Programs also die with their wrapper (``PR_SET_PDEATHSIG``) and exit when the
benchmark's socket closes. Every wait has a deadline.

    python bench/handoff.py                          # both modes, 2 and 8 members, ~1 min
    python bench/handoff.py --mode e2e --members 2,8,64
    python bench/handoff.py --dir /dev/shm           # arenas on tmpfs (like $XDG_RUNTIME_DIR)
    python bench/handoff.py --mode protocol --members 2,4,8,16,64 --seconds 5
"""

from __future__ import annotations

import argparse
import bisect
import fcntl
import itertools
import json
import os
import random
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

from handoff_e2e import PR_SET_CHILD_SUBREAPER, prctl, report_e2e, run_e2e, run_floor
from handoff_figures import WARMUP, cell, filesystem, pct, quantiles

from vramlock.arena.directory import Arena
from vramlock.arena.hint import Hint
from vramlock.arena.locks import Token, Want
from vramlock.arena.member import Member
from vramlock.arena.residency import WholeGpu
from vramlock.run.scheduler import PROBE_INTERVAL

Stamp = tuple[str, int]  # (kind, monotonic ns)

# -- a member ------------------------------------------------------------------------------


class _Log:
    def __init__(self) -> None:
        self.stamps: list[Stamp] = []

    def __call__(self, kind: str) -> None:
        self.stamps.append((kind, time.monotonic_ns()))


class TimedWant(Want):
    def __init__(self, arena: Arena, log: _Log) -> None:
        super().__init__(arena)
        self.log = log

    def enter(self, timeout: float | None) -> bool:
        self.log("arrive")
        return super().enter(timeout)


class TimedToken(Token):
    def __init__(self, arena: Arena, log: _Log) -> None:
        super().__init__(arena)
        self.log = log

    def acquire(self, timeout: float | None) -> bool:
        ok = super().acquire(timeout)
        if ok:
            self.log("own")
        return ok

    def drop(self) -> None:
        self.log("unlock")
        super().drop()


class TimedMember(Member):
    def __init__(self, arena: Arena, name: str, log: _Log) -> None:
        super().__init__(arena, name=name, min_hold=0.0, command=["bench", name])
        whole = self.residency
        assert isinstance(whole, WholeGpu)  # an arena without a budget
        whole.want.close()
        whole.token.close()
        whole.want = TimedWant(arena, log)
        whole.token = TimedToken(arena, log)
        self.log = log

    def resident(self) -> None:
        super().resident()  # where min_hold starts counting: after acquire, after a restore
        self.log("ready")

    def wanted(self) -> bool:
        if super().wanted():
            self.log("notice")
            return True
        return False


def _go(ready_fd: int, go_fd: int) -> None:
    os.write(ready_fd, b"!")
    os.close(ready_fd)
    os.read(go_fd, 1)  # EOF when the parent closes its end: everybody starts at once
    os.close(go_fd)


def member_main(arena_path: str, name: str, out: str, seconds: float, ready: int, go: int) -> None:
    log = _Log()
    arena = Arena.open(arena_path)
    member = TimedMember(arena, name, log)
    hint = Hint(arena.dirfd)
    poller = select.poll()
    if hint.fd is not None:
        poller.register(hint.fd, select.POLLIN)
    timeout_ms = int(PROBE_INTERVAL * 1000)
    _go(ready, go)
    deadline = time.monotonic() + seconds
    member.acquire()

    def nothing() -> None:
        pass

    while time.monotonic() < deadline:
        # As `vramlock run` does: probe, else sleep on the hint for at most PROBE_INTERVAL.
        if member.yield_if_wanted(release=nothing, restore=nothing):
            continue
        poller.poll(timeout_ms)
        hint.drain()
    member.close()
    hint.close()
    arena.close()
    _write(out, log.stamps)


# -- the reference: a bare flock ping-pong ------------------------------------------------------


def pingpong_main(path: str, first: bool, rounds: int, out: str, rd: int, wr: int) -> None:
    """Two of these hand ``path`` back and forth. The peer says "r" (about to block) and "o"
    (owns it); a holder unlocks 1 ms after "r" and re-queues only after "o": no barging."""
    log = _Log()
    fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)

    def expect(word: bytes) -> None:
        got = os.read(rd, 1)
        if got != word:
            raise SystemExit(f"ping-pong: expected {word!r}, got {got!r}")

    def hold_then_hand_over() -> None:
        expect(b"r")
        time.sleep(0.001)  # the peer is blocked in the kernel by now
        log("unlock")
        fcntl.flock(fd, fcntl.LOCK_UN)
        expect(b"o")

    def wait_turn() -> None:
        os.write(wr, b"r")
        fcntl.flock(fd, fcntl.LOCK_EX)
        log("own")
        os.write(wr, b"o")

    if first:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.write(wr, b"!")  # tell the peer we hold it
    else:
        expect(b"!")
    for _ in range(rounds):
        if first:
            hold_then_hand_over()
            wait_turn()
        else:
            wait_turn()
            hold_then_hand_over()
    fcntl.flock(fd, fcntl.LOCK_UN)
    os.close(fd)
    _write(out, log.stamps)


def _write(path: str, stamps: list[Stamp]) -> None:
    with open(path, "w") as f:
        f.writelines(f"{kind} {t}\n" for kind, t in stamps)


def _read(path: str) -> list[Stamp]:
    with open(path) as f:
        return [(k, int(t)) for k, t in (line.split() for line in f)]


# -- the parent ---------------------------------------------------------------------------------


@dataclass
class Figures:
    handoffs: int
    seconds: float
    detection: list[int]
    kernel: list[int]
    overhead: list[int]
    release: list[int]  # notice -> unlock: releasing bookkeeping (excluded)
    restore: list[int]  # own -> ready: acquire/restore bookkeeping (excluded)
    wait: list[int]  # a waiter's whole wait, arrive -> own (queueing included)


def analyse(logs: dict[str, list[Stamp]], start: int, end: int) -> Figures:
    """Pair the stamps into handoffs (see the module's docstring)."""
    events = sorted((t, kind, who) for who, stamps in logs.items() for kind, t in stamps)
    # Waits: each member's arrive, then its next own.
    waits: list[tuple[int, int, str]] = []  # (own, arrive, who)
    pending: dict[str, int] = {}
    for t, kind, who in events:
        if kind == "arrive":
            pending[who] = t
        elif kind == "own" and who in pending:
            waits.append((t, pending.pop(who), who))
    waits.sort()
    # Tenures: own -> ready -> notice? -> unlock, one member at a time (or the protocol is
    # broken). "ready": resident() returned, i.e. acquire and restore bookkeeping are done.
    tenures: list[tuple[str, int, int, int | None, int]] = []  # who, own, ready, notice, unlock
    cur: list[int] | None = None  # [own, ready, notice or -1]
    owner = ""
    for t, kind, who in events:
        if kind == "own":
            if cur is not None:
                raise SystemExit(f"two owners at once: {owner} and {who} at {t}")
            cur, owner = [t, t, -1], who
        elif cur is None or who != owner:
            continue
        elif kind == "ready" and cur[2] < 0:
            cur[1] = t
        elif kind == "notice" and cur[2] < 0:
            cur[2] = t
        elif kind == "unlock":
            tenures.append((who, cur[0], cur[1], None if cur[2] < 0 else cur[2], t))
            cur = None
    # The earliest arrival among the waits that end after a given own: suffix minima.
    owns = [o for o, _, _ in waits]
    earliest = [a for _, a, _ in waits]
    for i in range(len(earliest) - 2, -1, -1):
        earliest[i] = min(earliest[i], earliest[i + 1])
    figures = Figures(0, (end - start) / 1e9, [], [], [], [], [], [])
    figures.wait = [o - a for o, a, _ in waits if a >= start and o <= end]
    for (_, own, ready, seen, unlock), nxt in itertools.pairwise(tenures):
        if seen is None or own < start or nxt[1] > end:
            continue
        # Waiters still queued while this member held the token: their wait ends after its
        # own began. (Its own next wait starts after its unlock, so never counts here.)
        i = bisect.bisect_right(owns, own)
        if i == len(owns) or earliest[i] > seen:
            continue
        detection = seen - max(ready, earliest[i])
        kernel = nxt[1] - unlock
        figures.handoffs += 1
        figures.detection.append(detection)
        figures.kernel.append(kernel)
        figures.overhead.append(detection + kernel)
        figures.release.append(unlock - seen)
        figures.restore.append(ready - own)
    return figures


def pingpong_figures(logs: dict[str, list[Stamp]]) -> Figures:
    events = sorted((t, kind, who) for who, stamps in logs.items() for kind, t in stamps)
    kernel = []
    unlock: tuple[int, str] | None = None
    for t, kind, who in events:
        if kind == "unlock":
            unlock = (t, who)
        elif kind == "own" and unlock is not None and unlock[1] != who:
            kernel.append(t - unlock[0])
            unlock = None
    seconds = (events[-1][0] - events[0][0]) / 1e9 if events else 0.0
    return Figures(len(kernel), seconds, [], kernel, kernel, [], [], [])


def _spawn(
    args: list[str], fds: tuple[int, ...], env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), *args],
        pass_fds=fds,
        stdin=subprocess.DEVNULL,
        env=env,
    )


def _reap(procs: list[subprocess.Popen[bytes]], timeout: float) -> None:
    end = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(max(0.1, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    bad = [p.returncode for p in procs if p.returncode != 0]
    if bad:
        raise SystemExit(f"benchmark processes failed: exit codes {bad}")


def run_members(tmp: str, n: int, seconds: float, journal: bool = True) -> Figures:
    """``n`` members for ``seconds``; ``journal`` False: with ``VRAMLOCK_JOURNAL=off``."""
    arena = tempfile.mkdtemp(prefix=f"arena{n}-", dir=tmp)
    env = {**os.environ, "VRAMLOCK_JOURNAL": "on" if journal else "off"}
    ready_r, ready_w = os.pipe()
    go_r, go_w = os.pipe()
    open_fds = {ready_r, ready_w, go_r, go_w}

    def close(fd: int) -> None:
        open_fds.discard(fd)
        os.close(fd)

    outs = [f"{arena}-m{i}.log" for i in range(n)]
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for i, out in enumerate(outs):
            args = ["--role", "member", arena, f"m{i}", out, str(seconds), str(ready_w), str(go_r)]
            procs.append(_spawn(args, (ready_w, go_r), env))
        close(ready_w)
        close(go_r)
        got = 0
        while got < n:
            chunk = os.read(ready_r, n)
            if not chunk:
                raise SystemExit("a member died before it was ready")
            got += len(chunk)
        start = time.monotonic_ns()
        close(go_w)  # EOF: go
        _reap(procs, seconds + 60 + n)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for fd in list(open_fds):
            close(fd)
    logs = {f"m{i}": _read(out) for i, out in enumerate(outs)}
    figures = analyse(logs, start + int(WARMUP * 1e9), start + int(seconds * 1e9))
    written = _journalled(arena)
    if (written > 0) != journal:
        raise SystemExit(f"journal {'on' if journal else 'off'}, yet {written} bytes journalled")
    return figures


def _journalled(arena: str) -> int:
    """Bytes in the arena's journal files."""
    jdir = os.path.join(arena, "journal")
    try:
        return sum(os.path.getsize(os.path.join(jdir, name)) for name in os.listdir(jdir))
    except OSError:
        return 0


def run_pingpong(tmp: str, rounds: int) -> Figures:
    path = os.path.join(tmp, "pingpong.lock")
    open(path, "w").close()
    a_r, b_w = os.pipe()  # b -> a
    b_r, a_w = os.pipe()  # a -> b
    outs = [os.path.join(tmp, "pp-a.log"), os.path.join(tmp, "pp-b.log")]
    procs = [
        _spawn(["--role", "pingpong", path, "1", str(rounds), outs[0], str(a_r), str(a_w)],
               (a_r, a_w)),
        _spawn(["--role", "pingpong", path, "0", str(rounds), outs[1], str(b_r), str(b_w)],
               (b_r, b_w)),
    ]  # fmt: skip
    for fd in (a_r, a_w, b_r, b_w):
        os.close(fd)
    _reap(procs, 60 + rounds * 0.01)
    return pingpong_figures({"a": _read(outs[0]), "b": _read(outs[1])})


def _terminated(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds through the clean-up, as Ctrl-C does


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[int]]:
    """The options, and the member counts they name."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--mode", choices=("all", "protocol", "e2e"), default="all", help="default: both"
    )
    parser.add_argument("--members", default="2,8", help="comma-separated member counts")
    parser.add_argument("--seconds", type=float, default=6.0, help="per member count and phase")
    parser.add_argument(
        "--rounds", type=int, default=1000, help="ping-pong round trips, floor handoffs"
    )
    parser.add_argument("--seed", type=int, default=1, help="for the e2e waiters and pauses")
    parser.add_argument(
        "--journal",
        choices=("on", "off", "both"),
        default="on",
        help="protocol mode: members journal (on), do not (off, VRAMLOCK_JOURNAL=off), or"
        " both side by side, alternating --repeat times per member count",
    )
    parser.add_argument("--repeat", type=int, default=3, help="--journal both: rounds of each")
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    parser.add_argument(
        "--dir",
        default=os.environ.get("XDG_RUNTIME_DIR") or None,
        help="where the arenas go (default: $XDG_RUNTIME_DIR, else the temporary directory)",
    )
    opts = parser.parse_args(argv)
    counts = [int(x) for x in opts.members.split(",") if x.strip()]
    if not counts or min(counts) < 2:
        parser.error("--members: counts of at least 2")
    return opts, counts


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:2] == ["--role", "member"]:
        a = argv[2:]
        member_main(a[0], a[1], a[2], float(a[3]), int(a[4]), int(a[5]))
        return 0
    if argv[:2] == ["--role", "pingpong"]:
        a = argv[2:]
        pingpong_main(a[0], a[1] == "1", int(a[2]), a[3], int(a[4]), int(a[5]))
        return 0
    opts, counts = parse(argv)
    signal.signal(signal.SIGTERM, _terminated)
    prctl(PR_SET_CHILD_SUBREAPER, 1)  # programs orphaned by a wrapper's SIGKILL are ours
    tmp = tempfile.mkdtemp(prefix="vramlock-bench-", dir=opts.dir)
    where = os.path.dirname(tmp)
    out: dict[str, object] = {}
    try:
        if opts.mode in ("all", "protocol"):
            bare = run_pingpong(tmp, opts.rounds)
            if opts.journal == "both":
                out["journal"] = journal_side_by_side(tmp, counts, opts.seconds, opts.repeat)
            else:
                on = opts.journal == "on"
                results = {n: run_members(tmp, n, opts.seconds, on) for n in counts}
                out.update(report(bare, results, where))
        if opts.mode in ("all", "e2e"):
            floor = run_floor(tmp, opts.rounds)
            rng = random.Random(opts.seed)
            e2e = {n: run_e2e(tmp, n, opts.seconds, rng) for n in counts}
            out["e2e"] = report_e2e(floor, e2e, where)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if opts.json:
        with open(opts.json, "w") as fh:
            json.dump(out, fh, indent=2)
    return 0


def report(bare: Figures, results: dict[int, Figures], where: str) -> dict[str, object]:
    base = pct(bare.kernel, 50)
    print(
        f"machine: {os.cpu_count()} CPUs, Python {sys.version.split()[0]},"
        f" probe interval {PROBE_INTERVAL * 1000:g} ms, arenas in {where} ({filesystem(where)})"
    )
    print("protocol: Member objects, no wrappers; times in µs: p50 / p99 (max)")
    print(
        f"{'':>18} {'handoffs':>9} {'/s':>6}  {'detection':>22}  {'kernel handoff':>22}"
        f"  {'overhead':>22}  {'x bare p50':>10}"
    )
    print(
        f"{'bare flock':>18} {bare.handoffs:>9} {bare.handoffs / max(bare.seconds, 1e-9):>6.0f}"
        f"  {'-':>22}  {cell(bare.kernel)}  {cell(bare.overhead)}  {1.0:>10.1f}"
    )
    members: dict[str, object] = {}
    for n, f in results.items():
        ratio = pct(f.overhead, 50) / base if base else float("nan")
        print(
            f"{f'{n} members':>18} {f.handoffs:>9} {f.handoffs / max(f.seconds, 1e-9):>6.0f}"
            f"  {cell(f.detection)}  {cell(f.kernel)}  {cell(f.overhead)}  {ratio:>10.1f}"
        )
        members[str(n)] = {**_summary(f), "overhead_p50_over_bare_p50": round(ratio, 2)}
    for label, attr in (
        ("release (notice -> unlock)", "release"),
        ("restore (own -> resident again)", "restore"),
        ("whole wait (arrive -> own, queueing included)", "wait"),
    ):
        parts = ", ".join(f"{n}: {cell(getattr(f, attr)).strip()}" for n, f in results.items())
        print(f"{label}: {parts}")
    return {"bare": _summary(bare), "members": members}


def journal_side_by_side(
    tmp: str, counts: list[int], seconds: float, repeat: int
) -> dict[str, object]:
    """The protocol's overhead with the journal on and off, runs alternating (on, off,
    on, ...) so that both see the same machine; each side's handoffs pooled."""
    print("protocol, journal on vs off (VRAMLOCK_JOURNAL=off), runs alternating;"
          " overhead in µs: p50 / p99 (max)")  # fmt: skip
    print(f"{'':>18} {'':>4} {'handoffs':>9} {'/s':>6}  {'overhead':>22}  {'release':>22}")
    out: dict[str, object] = {}
    for n in counts:
        pooled = {
            True: Figures(0, 0.0, [], [], [], [], [], []),
            False: Figures(0, 0.0, [], [], [], [], [], []),
        }
        for _ in range(repeat):
            for on in (True, False):
                f = run_members(tmp, n, seconds, on)
                p = pooled[on]
                p.handoffs += f.handoffs
                p.seconds += f.seconds
                p.overhead += f.overhead
                p.release += f.release
                p.detection += f.detection
                p.kernel += f.kernel
        for on in (True, False):
            f = pooled[on]
            print(
                f"{f'{n} members':>18} {'on' if on else 'off':>4} {f.handoffs:>9}"
                f" {f.handoffs / max(f.seconds, 1e-9):>6.0f}"
                f"  {cell(f.overhead)}  {cell(f.release)}"
            )
            out[f"{n} {'on' if on else 'off'}"] = _summary(f)
    return out


def _summary(f: Figures) -> dict[str, object]:
    q = quantiles
    return {
        "handoffs": f.handoffs,
        "per_second": round(f.handoffs / max(f.seconds, 1e-9), 1),
        "detection": q(f.detection),
        "kernel": q(f.kernel),
        "overhead": q(f.overhead),
        "release": q(f.release),
        "restore": q(f.restore),
        "wait": q(f.wait),
    }


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # everything was cleaned up on the way out
        sys.exit(128 + signal.SIGINT)
