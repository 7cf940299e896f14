"""What is installed, and what each command loads: dependencies, imports, README, CI.

Start-up time is checked by what gets imported, not by timing: a command that does not
lock never imports portalocker (its import alone reads package metadata, ~17 ms), the core
never imports typer or rich, and ``bench/startup.py`` has the figures.
"""

from __future__ import annotations

import ast
import fcntl
import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import zipfile
from importlib import metadata
from pathlib import Path

import pytest
from helpers import ROOT
from helpers.commands import vramlock
from helpers.llama import needs_llama

from vramlock import procfs
from vramlock.arena import lockfd

pytestmark = pytest.mark.timeout(60)


def test_core_imports_neither_typer_nor_rich() -> None:
    code = (
        "import sys\n"
        "import vramlock, vramlock.arena.member, vramlock.run.runner, vramlock.child\n"
        "import vramlock.arena.roster\n"
        "import vramlock.demo, vramlock.strategies\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('typer', 'rich', 'click'))\n"
        "print(bad)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=30, cwd=ROOT)  # fmt: skip
    assert out.stdout.strip() == "[]"


# Runs the CLI in-process, then writes its exit status and every module loaded to argv[1].
LOADED = """\
import json, sys
from vramlock.cli import main
try:
    main(sys.argv[2:])
except SystemExit as end:
    code = end.code
with open(sys.argv[1], "w") as f:
    json.dump({"code": code, "modules": sorted(sys.modules)}, f)
"""

# Not for this command: the lock layer, the terminal UI, package metadata, GPU bindings,
# serve's HTTP and YAML libraries; for who and run, the typer app (click, vendored or not).
SERVE = ["vramlock.serve", "aiohttp", "yaml"]
TYPER = ["typer", "click", "vramlock.cli.app"]
NOT_LOADED = {
    "who": ["portalocker", "rich", "importlib.metadata", "vramlock.run.runner",
            "vramlock.strategies", "vramlock.gpu.cuda", *SERVE, *TYPER],
    "wait": ["rich", "vramlock.gpu.cuda", *SERVE],
    "run": ["rich", *SERVE, *TYPER],
}  # fmt: skip


@pytest.mark.parametrize(
    ("command", "args"),
    [("who", []), ("wait", ["-n"]), ("run", ["--release", "none", "--", "true"])],
    ids=["who", "wait", "run"],
)
def test_commands_load_only_what_they_use(
    arena: Path, tmp_path: Path, command: str, args: list[str]
) -> None:
    report = tmp_path / "loaded.json"
    argv = [command, "--arena", str(arena), *args]
    subprocess.run([sys.executable, "-c", LOADED, str(report), *argv], stdout=subprocess.DEVNULL,
                   stdin=subprocess.DEVNULL, timeout=30, check=True)  # fmt: skip
    loaded = json.loads(report.read_text())
    assert loaded["code"] == 0
    modules = set(loaded["modules"])
    assert [m for m in NOT_LOADED[command] if m in modules] == []


# -- the lock layer --------------------------------------------------------------------------


def _requirement(name: str) -> tuple[int, int]:
    """The major-version bounds ``NAME>=A.x,<B`` of a dependency in pyproject.toml."""
    text = (ROOT / "pyproject.toml").read_text()
    m = re.search(rf'"{name}>=(\d+)(?:\.\d+)*,<(\d+)"', text)
    assert m, f"pyproject.toml: no {name}>=A,<B requirement"
    return int(m.group(1)), int(m.group(2))


def test_installed_portalocker_is_the_pinned_major() -> None:
    low, high = _requirement("portalocker")
    assert low >= 4, "portalocker 3.x FlockLocker followed the module global (maybe lockf)"
    assert low <= int(metadata.version("portalocker").split(".")[0]) < high


def _lock_kinds(fd: int) -> list[tuple[str, int]]:
    """(FLOCK or POSIX, pid) of each lock on ``fd``'s inode, from /proc/locks."""
    st = os.fstat(fd)
    key = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    found = []
    for line in procfs.read_proc_locks().splitlines():
        fields = line.split()
        if len(fields) >= 6 and fields[1] != "->" and fields[5] == key:
            found.append((fields[1], int(fields[4])))
    return found


def test_locks_are_flock_even_when_portalocker_is_switched_to_lockf(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another library in the process may set portalocker's module-global LOCKER to lockf
    (per-process record locks, dropped when any descriptor of the file closes)."""
    import portalocker
    import portalocker.portalocker as locker_module

    monkeypatch.setattr(locker_module, "LOCKER", fcntl.lockf)
    ours = os.open(tmp_path / "ours", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    theirs = os.open(tmp_path / "theirs", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        lockfd.lock(ours, exclusive=True)
        portalocker.lock(theirs, portalocker.LockFlags.EXCLUSIVE)  # the switch took effect
        assert _lock_kinds(theirs) == [("POSIX", os.getpid())]
        assert _lock_kinds(ours) == [("FLOCK", os.getpid())]
    finally:
        os.close(ours)
        os.close(theirs)


# -- shell completion -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("words", "cword", "expected"),
    [
        ("vramlock r", 1, ["run"]),
        (
            "vramlock run --release ",
            3,
            [
                "auto",
                "signal",
                "checkpoint",
                "swap",
                "swap-vulkan",
                "http",
                "none",
                "restart",
                "stop",
                "exec",
            ],
        ),
        ("vramlock run --demand c", 3, ["child"]),
    ],
)
def test_shell_completion(words: str, cword: int, expected: list[str]) -> None:
    env = dict(os.environ, _VRAMLOCK_COMPLETE="complete_bash", COMP_WORDS=words,
               COMP_CWORD=str(cword))  # fmt: skip
    out = subprocess.run(vramlock(), env=env, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0
    assert out.stdout.split() == expected


@pytest.mark.parametrize(
    ("shell", "mark"),
    [("zsh", "#compdef vramlock"), ("fish", "complete --command vramlock"),
     ("bash", "complete -o default -F _vramlock_completion vramlock")],
)  # fmt: skip
def test_show_completion_for_the_shell_named(shell: str, mark: str) -> None:
    """Run from bash, which typer would detect: the shell named wins."""
    line = shlex.join(vramlock("--show-completion", shell)) + "; exit $?"  # bash stays the parent
    out = subprocess.run(["bash", "-c", line], capture_output=True, text=True, timeout=30)
    assert (out.returncode, out.stderr) == (0, "")
    assert mark in out.stdout


def test_install_completion_for_the_shell_named(tmp_path: Path) -> None:
    env = dict(os.environ, HOME=str(tmp_path))
    line = shlex.join(vramlock("--install-completion", "fish")) + "; exit $?"
    out = subprocess.run(["bash", "-c", line], env=env, capture_output=True, text=True,
                         timeout=30)  # fmt: skip
    assert out.returncode == 0, out.stderr
    script = tmp_path / ".config" / "fish" / "completions" / "vramlock.fish"
    assert "complete --command vramlock" in script.read_text()
    assert not (tmp_path / ".bashrc").exists()


@pytest.mark.parametrize(
    ("args", "fragment"),
    [(["--show-completion", "tcsh"], "unknown shell 'tcsh'"),
     (["--show-completion", "zsh", "x"], "unexpected argument 'x'")],
)  # fmt: skip
def test_completion_for_a_bad_shell_is_a_usage_error(args: list[str], fragment: str) -> None:
    out = subprocess.run(vramlock(*args), capture_output=True, text=True, timeout=30)
    assert (out.returncode, out.stdout) == (2, "")
    assert out.stderr.startswith("vramlock: ") and fragment in out.stderr


# -- what the wheel installs ---------------------------------------------------------------


@pytest.fixture(scope="module")
def prefix(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel built from this tree, checked, then installed under a prefix of its own,
    laid out as a virtual environment (or uv's tool environment) is."""
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out),
                    str(ROOT)], check=True, timeout=300, stdout=subprocess.DEVNULL)  # fmt: skip
    (wheel,) = out.glob("vramlock-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
    assert "vramlock/py.typed" in names  # a typed library: mypy reads its annotations
    data = "-".join(wheel.name.split("-")[:2]) + ".data/data/share/man"
    pages = {n.removeprefix(data + "/") for n in names if n.startswith(data + "/")}
    in_tree = {str(p.relative_to(ROOT / "man")) for p in (ROOT / "man").rglob("*.[0-9]")}
    assert pages == in_tree, "the wheel must install man/ as a manual tree, section by section"
    root = out / "prefix"
    # --ignore-installed: without it pip would first uninstall the vramlock under test.
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                    "--ignore-installed", "--prefix", str(root), str(wheel)], check=True,
                   timeout=300, stdout=subprocess.DEVNULL)  # fmt: skip
    return root


def _man_path(env: dict[str, str], *args: str) -> str:
    done = subprocess.run(["man", "-w", *args], env=env, capture_output=True, text=True,
                          timeout=30, check=False)  # fmt: skip
    return done.stdout.strip()


@pytest.mark.timeout(600)
@pytest.mark.skipif(shutil.which("man") is None, reason="man is not installed")
@pytest.mark.parametrize("page", ["vramlock", "vramlock-run", "vramlock-strategies"])
def test_man_finds_the_installed_pages(prefix: Path, page: str) -> None:
    """An activated environment: man finds its pages from PATH. Elsewhere (uv tool
    install links only the executable): the README's MANPATH line."""
    env = {k: v for k, v in os.environ.items() if k != "MANPATH"}
    section = "7" if page == "vramlock-strategies" else "1"
    want = str(prefix / "share" / "man" / f"man{section}" / f"{page}.{section}")
    activated = dict(env, PATH=f"{prefix / 'bin'}{os.pathsep}{env['PATH']}")
    assert _man_path(activated, page) == want
    readme = (ROOT / "README.md").read_text()
    assert 'export MANPATH="$(uv tool dir)/vramlock/share/man:"' in readme
    assert _man_path(dict(env, MANPATH=f"{prefix / 'share' / 'man'}:"), page) == want


# -- README and CI --------------------------------------------------------------------------


def _readme_commands() -> list[str]:
    """The commands of the README's first code block, which must open the README."""
    lines = (ROOT / "README.md").read_text().splitlines()
    assert lines[0] == "# vramlock"
    start = next(i for i, line in enumerate(lines) if line.startswith("```"))
    assert start <= 2, "the README must open with its commands, right under the title"
    end = lines.index("```", start + 1)
    return [line.split(" #", 1)[0].strip() for line in lines[start + 1 : end] if line.strip()]


def test_readme_opens_with_two_commands() -> None:
    """One to install and see it work, one to install and run every test."""
    commands = _readme_commands()
    assert len(commands) == 2, commands
    assert commands[0].startswith("pip install ") and commands[0].endswith("vramlock demo")
    assert commands[1].startswith("pip install ") and "python -m pytest" in commands[1]


def test_ci_runs_the_readme_test_command_verbatim() -> None:
    test_command = _readme_commands()[1]
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert test_command in [line.strip() for line in ci], f".ci/run does not run {test_command!r}"


@pytest.mark.parametrize(
    ("pip", "pytest_status"), [(1, 0), (0, 1), (0, 5)], ids=["install", "tests", "no-tests"]
)
def test_ci_fails_when_the_test_command_fails(pip: int, pytest_status: int) -> None:
    """.ci/run's lines around the README's test command, with pip and pytest stubbed: a
    failed install, a failed test and pytest's "no tests collected" (5) each end CI with
    their status, before the linters."""
    command = _readme_commands()[1]
    ci = (ROOT / ".ci" / "run").read_text()
    block = next(part for part in ci.split("\n\n") if command in part.splitlines())
    script = (
        f"set -euo pipefail\npip() {{ return {pip}; }}\npython() {{ return {pytest_status}; }}\n"
        f"{block}\necho linted\n"
    )
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=30)
    assert done.returncode == (pip or pytest_status), done
    assert "linted" not in done.stdout
    assert ("collected no tests" in done.stderr) == (pytest_status == 5), done.stderr


def test_the_readme_says_what_builds_the_llama_server_the_tests_skip_without() -> None:
    """The command the skip reason gives opens the README too, and CI runs it."""
    reason = needs_llama(None).mark.kwargs["reason"]
    found = re.search(r"`(python [^`]+)`", reason)
    assert found is not None, reason
    command = found.group(1)
    opening = (ROOT / "README.md").read_text().split("\n## ", 1)[0]
    assert f"`{command}`" in opening
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert any(line.startswith(command) for line in ci), f".ci/run does not run {command!r}"


def test_the_readme_names_every_extra() -> None:
    """The README's list of extras is pyproject.toml's."""
    pyproject = (ROOT / "pyproject.toml").read_text()
    section = pyproject.split("[project.optional-dependencies]\n", 1)[1].split("\n[", 1)[0]
    extras = re.findall(r"^([\w-]+) = ", section, re.MULTILINE)
    listed = re.search(r"\(extras: ([^)]*)\)", (ROOT / "README.md").read_text())
    assert listed is not None, "the README lists no extras"
    assert re.findall(r"`([\w-]+)`", listed.group(1)) == extras


def test_no_test_module_imports_another() -> None:
    """What tests share is in tests/helpers/ (and fixtures in conftest.py), so that moving
    or deleting one test module breaks no other."""
    found = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names = [node.module]
            found += [
                f"{path.relative_to(ROOT)}: {name}"
                for name in names
                if name.split(".")[0] == "conftest" or name.startswith("test_")
            ]
    assert not found, found


def test_every_document_cited_is_in_the_repository() -> None:
    """A docstring, page or document that names a Markdown file names one that is here."""
    texts = [ROOT / "README.md", ROOT / "pyproject.toml"] + [
        p
        for top in ("vramlock", "tests", "bench", "tools", "docs", "man")
        for p in (ROOT / top).rglob("*")
        if p.is_file() and p.suffix in (".py", ".md", ".1", ".7", ".c", ".toml")
    ]
    cited = {
        (path.relative_to(ROOT), name)
        for path in texts
        for name in re.findall(r"[\w./-]+\.md\b", path.read_text(encoding="utf-8"))
    }
    missing = sorted(
        (str(path), name)
        for path, name in cited
        if not (ROOT / name).is_file() and not (ROOT / path.parent / name).is_file()
    )
    assert not missing, f"documents cited but not in the repository: {missing}"


def test_every_source_file_the_documents_name_is_in_the_repository() -> None:
    """A module or C file named by path in the READMEs or docs/ is where they say."""
    texts = [ROOT / "README.md", ROOT / "bench" / "README.md", *(ROOT / "docs").glob("*.md")]
    source = re.compile(r"(?<![\w/.$-])((?:vramlock|tests|bench|tools)/[\w/-]*\.(?:py|c))\b")
    named = {
        (str(path.relative_to(ROOT)), name)
        for path in texts
        for name in source.findall(path.read_text(encoding="utf-8"))
    }
    missing = sorted((path, name) for path, name in named if not (ROOT / name).is_file())
    assert not missing, f"source files named but not in the repository: {missing}"


@pytest.mark.skipif(
    importlib.util.find_spec("hatchling") is None, reason="hatchling is not installed here"
)
@pytest.mark.parametrize("with_cc", [True, False], ids=["compiler", "no-compiler"])
def test_a_wheel_carries_the_swap_library_where_it_can_be_built(
    tmp_path: Path, with_cc: bool
) -> None:
    from vramlock.gpu import swap

    if with_cc and swap.compiler() is None:
        pytest.skip("no C compiler here")
    env = dict(os.environ)
    if not with_cc:
        env["CC"] = str(tmp_path / "no-such-cc")
    out = tmp_path / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "-w", str(out), str(ROOT)],
        env=env, check=True, timeout=120, capture_output=True,
    )  # fmt: skip
    (wheel,) = out.glob("*.whl")
    carried = "vramlock/gpu/swap/libvramlock-swap.so" in zipfile.ZipFile(wheel).namelist()
    assert carried == with_cc
    assert wheel.name.endswith("-none-any.whl") != with_cc  # a platform wheel with it


def test_the_benchmark_page_holds_current_figures_only() -> None:
    """docs/benchmarks.md is a page a reader can use: one table per benchmark, the history
    of figures in git, 500 lines at most."""
    lines = (ROOT / "docs/benchmarks.md").read_text().splitlines()
    assert len(lines) <= 500, len(lines)
