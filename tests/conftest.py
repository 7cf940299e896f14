"""Shared fixtures: every test gets its own arena and runtime directory, and every
process a test starts is reaped by the end of it."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from netutil import accepts as accepts
from netutil import free_port as free_port
from netutil import free_ports as free_ports

from vramlock.procfs import descendants, proc_stat

if TYPE_CHECKING:
    from test_cli_errors import ErrCli

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def _isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    runtime = tmp_path / "runtime"
    runtime.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    # What the test's processes make in TMPDIR (llama-server's slot directories) stays in
    # the test's own directory, where it is checked for below.
    scratch = tmp_path / "tmp"
    scratch.mkdir(mode=0o700)
    monkeypatch.setenv("TMPDIR", str(scratch))
    monkeypatch.delenv("VRAMLOCK_ARENA", raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    # The tree under test first; what the caller put on the path (pinned wheels) after.
    path = os.environ.get("PYTHONPATH")
    monkeypatch.setenv("PYTHONPATH", str(ROOT) + (os.pathsep + path if path else ""))
    yield
    # After every process the test started is reaped: a run that ended, even by a signal,
    # took its private slot directory with it.
    left = sorted(p.name for p in scratch.glob("vramlock-slots-*"))
    assert not left, f"slot directories left behind: {left}"


@pytest.fixture
def errcli(tmp_path: Path) -> ErrCli:
    """Runs ``python -m vramlock ARGS`` isolated from the real machine (test_cli_errors)."""
    from test_cli_errors import ErrCli

    return ErrCli(tmp_path)


@pytest.fixture
def arena(tmp_path: Path) -> Path:
    path = tmp_path / "arena"
    path.mkdir(mode=0o700)
    return path


Spawn = Callable[..., "subprocess.Popen[str]"]


@pytest.fixture
def spawn() -> Iterator[Spawn]:
    """Start a process in its own session; SIGKILL and reap whatever is left at the end
    (``graceful=True``: SIGTERM first, so that a ``vramlock run`` can clean up)."""
    procs: list[subprocess.Popen[str]] = []
    to_end: list[subprocess.Popen[str]] = []  # graceful=True: SIGTERM first

    def start(args: list[str], *, graceful: bool = False, **kw: object) -> subprocess.Popen[str]:
        kw.setdefault("stdout", subprocess.PIPE)
        kw.setdefault("stderr", subprocess.PIPE)
        kw.setdefault("stdin", subprocess.DEVNULL)
        proc: subprocess.Popen[str] = subprocess.Popen(
            args,
            text=True,
            start_new_session=True,
            **kw,  # type: ignore[call-overload]
        )
        procs.append(proc)
        if graceful:
            to_end.append(proc)
        return proc

    yield start
    for proc in to_end:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(30)
    for proc in procs:
        kill_group(proc)
        if proc.stdin is not None and proc.stdin.closed:
            proc.stdin = None  # closed by the test: communicate() would flush it
        proc.communicate(timeout=10)


def kill_group(proc: subprocess.Popen[str]) -> None:
    """SIGKILL the process and everything it started, then reap it.

    ``vramlock run`` puts its command in a process group of its own, so the
    descendants are found through /proc and killed one by one as well.
    """
    pids = [*descendants(proc.pid), proc.pid]
    for pid in pids:
        for kill in (os.killpg, os.kill):
            try:
                kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    proc.wait(10)
    # Dead means exited (a zombie at most), and only then are its locks gone.
    wait_until(lambda: all(_state(pid) in ("Z", "X", None) for pid in pids))


def _state(pid: int) -> str | None:
    fields = proc_stat(pid)
    return fields[0] if fields else None


def vramlock(*args: str) -> list[str]:
    return [sys.executable, "-m", "vramlock", *args]


def wait_until(what: Callable[[], object], timeout: float = 10.0, step: float = 0.005) -> None:
    """Poll a condition with a deadline (a check, not synchronisation by sleeping)."""
    end = time.monotonic() + timeout
    while not what():
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(step)


def queued(pid: int) -> bool:
    """Is ``pid`` blocked in a flock (a "->" line of /proc/locks)?"""
    with open("/proc/locks") as f:
        return any(f" {pid} " in line and "->" in line for line in f)


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
        if ctl and ctl.requested() and os.environ.get("WORKER_DEAF"):
            continue
        if ctl:
            ctl.yield_if_asked(lambda: note("release"), lambda: note("restore"), want=want)
    """
)


def events(log: Path) -> list[tuple[float, str, str]]:
    if not log.exists():
        return []
    out = []
    for line in log.read_text().splitlines():
        t, name, what = line.split()
        out.append((float(t), name, what))
    return out


def whats(log: Path, name: str) -> list[str]:
    return [w for _, n, w in events(log) if n == name]


def _no_constants(name: str) -> None:
    raise ValueError(f"not strict JSON: {name}")


def who_plain(arena: Path) -> str:
    """``vramlock who``'s plain text (not a terminal)."""
    return subprocess.run(
        vramlock("who", "--arena", str(arena)),
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout


def who_json(arena: Path) -> list[dict[str, Any]]:
    """``vramlock who --json``'s members, parsed as strict JSON (no NaN or Infinity)."""
    out = subprocess.run(
        vramlock("who", "--arena", str(arena), "--json"),
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout
    members: list[dict[str, Any]] = json.loads(out, parse_constant=_no_constants)["members"]
    return members


def hold(spawn: Spawn, path: Path, mode: str = "-x") -> subprocess.Popen[str]:
    """A flock(1) process holding ``path`` until killed; returns once it holds it."""
    proc = spawn(["flock", mode, str(path), "sh", "-c", "echo held; exec sleep 60"])
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


def waiting_holder(spawn: Spawn, arena: Path) -> subprocess.Popen[str]:
    """flock(1) as a waiter (want.lock shared, then token.lock), holding the token until its
    stdin is closed; returns once it holds it. Residents see it waiting, as any member."""
    proc = spawn(
        ["flock", "-s", str(arena / "want.lock"), "flock", "-x", str(arena / "token.lock"),
         "sh", "-c", "echo held; read line"],
        stdin=subprocess.PIPE,
    )  # fmt: skip
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


# -- the real llama-server (CPU) that tools/llama_server.py builds and caches ----------

sys.path.insert(0, str(ROOT / "tools"))


def llama_binary() -> Path | None:
    """The cached llama-server, or None; built first (minutes) with VRAMLOCK_BUILD_LLAMA=1."""
    import llama_server

    found: Path | None = llama_server.cached_binary()
    if found is None and os.environ.get("VRAMLOCK_BUILD_LLAMA") == "1":
        found = llama_server.ensure()
    return found


def needs_llama(binary: Path | None) -> pytest.MarkDecorator:
    import llama_server

    return pytest.mark.skipif(
        binary is None,
        reason=f"no llama-server built in {llama_server.cache_dir()}: run "
        "`python tools/llama_server.py` or set VRAMLOCK_BUILD_LLAMA=1",
    )


@pytest.fixture(scope="session")
def model() -> Path:
    """The tiny random-weight model the llama-server tests load (tools/tiny_gguf.py)."""
    import tiny_gguf  # numpy and gguf load only when a server will run

    path: Path = tiny_gguf.cached_model()
    return path


def token_free(arena: Path) -> bool:
    probe = subprocess.run(["flock", "-n", "-x", str(arena / "token.lock"), "true"], timeout=10)
    return probe.returncode == 0


@pytest.fixture
def worker(tmp_path: Path) -> Path:
    path = tmp_path / "worker.py"
    path.write_text(WORKER)
    return path


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
