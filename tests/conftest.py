"""Shared fixtures: every test gets its own arena and runtime directory, and every
process a test starts is reaped by the end of it."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

# The helpers' assertions say what they compared, as the tests' own do.
pytest.register_assert_rewrite("helpers")

from helpers import ROOT  # noqa: E402
from helpers.engines import FAKE, Engine, MakeEngine  # noqa: E402
from helpers.errors import ErrCli  # noqa: E402
from helpers.net import free_port  # noqa: E402
from helpers.processes import Spawn, kill_group  # noqa: E402
from helpers.swap_rig import Fakes, Rig, build_fakes, make_rig  # noqa: E402
from helpers.worker import WORKER  # noqa: E402


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
    # took its private slot directory with it. A wrapper that serve started is in a
    # session of its own, told to end as serve goes: on a loaded machine it may still be
    # removing its directory a moment after the test has reaped serve.
    deadline = time.monotonic() + 15
    while (left := sorted(p.name for p in scratch.glob("vramlock-slots-*"))) and (
        time.monotonic() < deadline
    ):
        time.sleep(0.1)
    assert not left, f"slot directories left behind: {left}"


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A directory short enough a path for a socket's name (a browser's), unlike
    tmp_path's."""
    path = Path(tempfile.mkdtemp(prefix="vramlock-ui-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def errcli(tmp_path: Path) -> ErrCli:
    """Runs ``python -m vramlock ARGS`` isolated from the real machine."""
    return ErrCli(tmp_path)


@pytest.fixture
def arena(tmp_path: Path) -> Path:
    """An empty arena directory of the test's own (mode 0700)."""
    path = tmp_path / "arena"
    path.mkdir(mode=0o700)
    return path


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


# -- the real llama-server (CPU) that tools/llama_server.py builds and caches ----------

sys.path.insert(0, str(ROOT / "tools"))


@pytest.fixture(scope="session")
def model() -> Path:
    """The tiny random-weight model the llama-server tests load (tools/tiny_gguf.py)."""
    import tiny_gguf  # numpy and gguf load only when a server will run

    path: Path = tiny_gguf.cached_model()
    return path


@pytest.fixture
def worker(tmp_path: Path) -> Path:
    """The signal worker (helpers/worker.py's WORKER) as a script in the test's directory."""
    path = tmp_path / "worker.py"
    path.write_text(WORKER)
    return path


@pytest.fixture
def engine(tmp_path: Path) -> MakeEngine:
    """A fake engine started the way the real one is (``vllm serve``, ``python -m
    sglang.launch_server``, ...): programs of those names run fake_engine.main."""
    bin_dir, modules = tmp_path / "bin", tmp_path / "modules"
    (modules / "sglang").mkdir(parents=True)
    bin_dir.mkdir()
    (modules / "sglang" / "__init__.py").write_text("")

    def body(name: str) -> str:
        return (
            f"import sys\nsys.path.insert(0, {str(FAKE.parent)!r})\nimport fake_engine\n"
            f"fake_engine.main({name!r}, sys.argv[1:])\n"
        )

    for program, name in (("llama-server", "llama-server"), ("vllm", "vllm"),
                          ("ollama", "ollama")):  # fmt: skip
        path = bin_dir / program
        path.write_text(f"#!{sys.executable}\n{body(name)}")
        path.chmod(0o755)
    (modules / "sglang" / "launch_server.py").write_text(body("sglang"))
    (tmp_path / "main.py").write_text(body("comfyui"))

    def make(name: str, *args: str, **settings: str) -> Engine:
        port = free_port()
        log = tmp_path / f"{name}-{port}.log"
        env = {f"FAKE_{k.upper()}": v for k, v in settings.items()}
        env["FAKE_LOG"] = str(log)
        env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{modules}"
        py = sys.executable
        argv = {
            "llama-server": [str(bin_dir / "llama-server"), "--port", str(port)],
            "vllm": [str(bin_dir / "vllm"), "serve", "some/model", "--port", str(port)],
            "sglang": [py, "-m", "sglang.launch_server", "--port", str(port)],
            "comfyui": [py, str(tmp_path / "main.py"), "--listen", "127.0.0.1", "--port",
                        str(port)],
            "ollama": [str(bin_dir / "ollama"), "serve"],
            "generic": [py, str(FAKE), "generic", "--port", str(port)],
        }[name]  # fmt: skip
        if name == "ollama":
            env["OLLAMA_HOST"] = f"127.0.0.1:{port}"
        return Engine(name, [*argv, *args], port, log, env)

    return make


@pytest.fixture(scope="session")
def fakes(tmp_path_factory: pytest.TempPathFactory) -> Fakes:
    """The fake CUDA driver and programs, built once a session (tests/fake_cuda/)."""
    return build_fakes(tmp_path_factory.mktemp("fake_cuda"))


@pytest.fixture
def rig(fakes: Fakes, arena: Path, tmp_path: Path) -> Rig:
    """One test's fake GPU (helpers/swap_rig.py)."""
    return make_rig(fakes, arena, tmp_path)
