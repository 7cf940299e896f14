"""The command line. The only module that imports typer or rich.

Errors become one line on stderr and an exit status here, in ``main``, and
nowhere else. Heavy modules are imported inside the commands that need them,
so ``vramlock who`` stays fast.
"""

from __future__ import annotations

import json
import os
import re
import select
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Annotated, Any, NoReturn, TextIO

import typer
from typer.core import TyperGroup

from .. import __version__

# Imported here, not in _warn: a warning about running out of descriptors must not need
# one to import its formatting.
from ..arena.roster import printable
from ..errors import NotObtained, UsageError, VramlockError

if TYPE_CHECKING:
    from ..arena.directory import Arena
    from ..arena.roster import GpuView, Row
    from ..demo import Demo


class _ReaderGone(Exception):
    """Standard output's reader has gone (``vramlock who | head -1``): not a failure."""


@contextmanager
def _stdout_reader_may_go() -> Iterator[None]:
    """Turn EPIPE into _ReaderGone when it is stdout's reader that has gone (another pipe's
    EPIPE, a child's control channel say, stays an error)."""
    try:
        yield
    except BrokenPipeError as err:
        poller = select.poll()
        poller.register(1, select.POLLOUT)
        if not any(events & select.POLLERR for _, events in poller.poll(0)):
            raise
        raise _ReaderGone from err


class _Group(TyperGroup):
    """typer turns EPIPE into exit status 1 before main() sees it; here it reaches main()."""

    def make_context(self, *args: Any, **kwargs: Any) -> Any:  # --help and --version print here
        with _stdout_reader_may_go():
            return super().make_context(*args, **kwargs)

    def invoke(self, ctx: Any) -> Any:
        with _stdout_reader_may_go():
            return super().invoke(ctx)


app = typer.Typer(
    name="vramlock",
    cls=_Group,
    help="Time-share one GPU between always-loaded programs, with kernel file locks only.",
    no_args_is_help=True,
    add_completion=True,
    rich_markup_mode=None,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)

_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "": 1.0}


def parse_duration(text: str, option: str) -> float:
    """Seconds from ``2``, ``0.5``, ``250ms``, ``1.5s``, ``2m``, ``1h``; at most ``MAX_TIMEOUT``."""
    from ..arena.lockfd import MAX_TIMEOUT

    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*(ms|s|m|h|)\s*", text)
    if not m:
        raise UsageError(
            f"{option}: bad duration {text!r} (seconds, or a number followed by ms, s, m or h)"
        )
    seconds = float(m.group(1)) * _UNITS[m.group(2)]
    if not seconds <= MAX_TIMEOUT:  # also inf, from a few hundred digits
        raise UsageError(f"{option}: {text!r} is too long (at most {MAX_TIMEOUT} s, 68 years)")
    return seconds


def _maybe_size(text: str | None, option: str) -> int | None:
    from ..arena.budget import parse_size

    return None if text is None else parse_size(text, option)


def _maybe_duration(text: str | None, option: str) -> float | None:
    return None if text is None else parse_duration(text, option)


def _timeout(nonblock: bool, wait: str | None) -> float | None:
    if nonblock:
        return 0.0
    return _maybe_duration(wait, "--timeout")


ArenaOpt = Annotated[
    str | None,
    typer.Option(
        "--arena",
        metavar="PATH",
        help="Arena directory (must exist). Default: the --gpu arena, or VRAMLOCK_ARENA.",
        show_default=False,
    ),
]
GpusOpt = Annotated[
    str | None,
    typer.Option(
        "--gpu",
        metavar="N[,M...]",
        help="Use GPU N's default arena (default: CUDA_VISIBLE_DEVICES if one index, else 0);"
        " N,M...: each of those GPUs' arenas, taken in ascending order.",
        show_default=False,
    ),
]
NonblockOpt = Annotated[
    bool, typer.Option("-n", "--nonblock", help="Fail at once if the token is not free.")
]
TimeoutOpt = Annotated[
    str | None,
    typer.Option(
        "-w",
        "--timeout",
        metavar="SECONDS",
        help="Give up after SECONDS (fractions and ms/s/m/h suffixes accepted).",
        show_default=False,
    ),
]
ConflictOpt = Annotated[
    int,
    typer.Option(
        "-E",
        "--conflict-exit-code",
        min=0,
        max=255,
        metavar="CODE",
        help="Exit status when the token is not obtained.",
    ),
]


def _strategy_names() -> list[str]:
    from ..strategies import NAMES

    return list(NAMES)


def _preset_names() -> list[str]:
    from ..strategies import PRESETS

    return list(PRESETS)


def _demand_names() -> list[str]:
    from ..run.options import DEMANDS

    return list(DEMANDS)


def _conflict(err: NotObtained, code: int) -> NoReturn:
    """``-E CODE``: the exit status when the token was not obtained."""
    err.exit_status = code
    raise err


# A message names paths, commands and values as the user gave them: room for a long path.
_MESSAGE_MAX = 8192


def _warn(message: str) -> None:
    """A diagnostic or an error: one line on stderr, if stderr still takes it. What the
    user typed (a path, a command) may hold escapes or newlines: they are written escaped."""
    try:
        print(f"vramlock: {printable(message, _MESSAGE_MAX)}", file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass  # stderr closed or broken: the wrapper goes on without it


@app.command(context_settings={"allow_interspersed_args": False})
def run(
    command: Annotated[
        list[str],
        typer.Argument(
            metavar="COMMAND", help="The command to run and its arguments.", show_default=False
        ),
    ],
    nonblock: NonblockOpt = False,
    wait: TimeoutOpt = None,
    conflict_exit_code: ConflictOpt = 1,
    arena: ArenaOpt = None,
    gpu: GpusOpt = None,
    name: Annotated[
        str | None,
        typer.Option(
            metavar="NAME", help="Name shown by who (default: the command's).", show_default=False
        ),
    ] = None,
    release: Annotated[
        str,
        typer.Option(
            metavar="STRATEGY",
            help="How the command gives the GPU back: auto, signal, checkpoint, swap, http,"
            " none, restart, stop, exec.",
            autocompletion=_strategy_names,
        ),
    ] = "auto",
    demand: Annotated[
        str,
        typer.Option(
            metavar="DEMAND",
            help="When a released command wants the GPU back: always, child, listen.",
            autocompletion=_demand_names,
        ),
    ] = "always",
    listen: Annotated[
        str | None,
        typer.Option(
            metavar="ADDR",
            help="listen demand: take clients here (HOST:PORT, [IPv6]:PORT, or PORT on"
            " 127.0.0.1) and pass them on to --upstream.",
            show_default=False,
        ),
    ] = None,
    upstream: Annotated[
        str | None,
        typer.Option(
            metavar="ADDR",
            help="listen demand: the address the command's server listens on.",
            show_default=False,
        ),
    ] = None,
    idle: Annotated[
        str | None,
        typer.Option(
            metavar="SECONDS",
            help="listen demand: put a release off until connections had no traffic this long"
            " (default 300ms).",
            show_default=False,
        ),
    ] = None,
    ready_within: Annotated[
        str | None,
        typer.Option(
            metavar="SECONDS",
            help="listen demand: close waiting clients if the started or restored server is"
            " not ready this soon (default 2m).",
            show_default=False,
        ),
    ] = None,
    ready_url: Annotated[
        str | None,
        typer.Option(
            metavar="PATH",
            help="listen demand: forward clients once GET PATH answers 2xx after each start"
            " or restore (default /health, or the API's own, for the engines presets know;"
            " else once the server accepts connections).",
            show_default=False,
        ),
    ] = None,
    on_release: Annotated[
        str | None,
        typer.Option(
            metavar="CMD",
            help="exec strategy: shell command that frees the memory.",
            show_default=False,
        ),
    ] = None,
    on_restore: Annotated[
        str | None,
        typer.Option(
            metavar="CMD",
            help="exec strategy: shell command that takes it back.",
            show_default=False,
        ),
    ] = None,
    preset: Annotated[
        str | None,
        typer.Option(
            metavar="NAME",
            help="http strategy: the server's API: llama-server, vllm, sglang, comfyui, ollama.",
            autocompletion=_preset_names,
            show_default=False,
        ),
    ] = None,
    on_release_url: Annotated[
        str | None,
        typer.Option(
            metavar="URL",
            help="http strategy without a preset: POSTed to free the memory (2xx: done).",
            show_default=False,
        ),
    ] = None,
    on_restore_url: Annotated[
        str | None,
        typer.Option(
            metavar="URL",
            help="http strategy without a preset: POSTed to take it back.",
            show_default=False,
        ),
    ] = None,
    min_hold: Annotated[
        str,
        typer.Option(metavar="SECONDS", help="Stay resident at least this long after acquiring."),
    ] = "100ms",
    yield_within: Annotated[
        str | None,
        typer.Option(
            metavar="SECONDS",
            help="If a graceful release takes longer, end the command (restarted on its turn).",
            show_default=False,
        ),
    ] = None,
    vram: Annotated[
        str | None,
        typer.Option(
            metavar="SIZE",
            help="The command's GPU memory at most (6G, 512M): in an arena with a budget it is"
            " resident beside others while they fit.",
            show_default=False,
        ),
    ] = None,
) -> None:
    """Run COMMAND while it holds the GPU; release it whenever someone else waits."""
    from ..arena.directory import parse_gpus
    from ..run.options import RunOptions
    from ..run.runner import run as run_command

    opts = RunOptions(
        command=command,
        arena=arena,
        gpus=() if gpu is None else parse_gpus(gpu),
        name=name,
        release=release,
        demand=demand,
        timeout=_timeout(nonblock, wait),
        min_hold=parse_duration(min_hold, "--min-hold"),
        yield_within=_maybe_duration(yield_within, "--yield-within"),
        on_release=on_release,
        on_restore=on_restore,
        preset=preset,
        on_release_url=on_release_url,
        on_restore_url=on_restore_url,
        listen=listen,
        upstream=upstream,
        idle=_maybe_duration(idle, "--idle"),
        ready_within=_maybe_duration(ready_within, "--ready-within"),
        ready_url=ready_url,
        vram=_maybe_size(vram, "--vram"),
        warn=_warn,
    )
    try:
        code = run_command(opts)
    except NotObtained as err:
        _conflict(err, conflict_exit_code)
    raise typer.Exit(code)


@app.command()
def wait(
    nonblock: NonblockOpt = False,
    timeout: TimeoutOpt = None,
    conflict_exit_code: ConflictOpt = 1,
    arena: ArenaOpt = None,
    gpu: GpusOpt = None,
    free: Annotated[
        bool,
        typer.Option("--free", help="Wait passively until the GPU is free; ask nobody to leave."),
    ] = False,
    fd: Annotated[
        int | None,
        typer.Option(
            "--fd",
            min=0,
            max=2**31 - 1,  # a C int: larger cannot be a descriptor
            metavar="N",
            help="Lock the caller's descriptor N of token.lock, so the caller stays resident.",
            show_default=False,
        ),
    ] = None,
) -> None:
    """Queue for the GPU (residents step aside) and return once the token is obtained."""
    from ..arena.directory import parse_gpus
    from ..arena.waiter import wait as wait_for_token

    gpus = None if gpu is None else parse_gpus(gpu)
    try:
        wait_for_token(arena, gpus, timeout=_timeout(nonblock, timeout), passive=free, fd=fd)
    except NotObtained as err:
        _conflict(err, conflict_exit_code)


def _ago(since: float | None, now: float) -> str:
    if since is None:
        return "-"
    s = max(0.0, now - since)
    if s < 60:
        return f"{s:.1f}s"
    if s < 3600:
        return f"{int(s // 60)}m{int(s % 60):02d}s"
    return f"{int(s // 3600)}h{int(s % 3600 // 60):02d}m"


_COLUMNS = ("STATE", "PID", "NAME", "STRATEGY", "FOR", "CHILD", "VRAM", "NOTE", "COMMAND")


def _bytes(n: int | None) -> str:
    if n is None:
        return "-"
    if n >= 2**30:
        return f"{n / 2**30:.1f} GiB"
    return f"{n / 2**20:.0f} MiB"


def _cells(row: Row, now: float) -> list[str]:
    # Row's text is printable already (roster.printable): no escape reaches the terminal.
    return [
        row.state,
        str(row.pid),
        row.name,
        row.strategy,
        _ago(row.since, now),
        "-" if row.child_pid is None else str(row.child_pid),
        _bytes(row.vram),
        row.note or "-",
        row.command,
    ]


def _title(path: str) -> str:
    from ..arena.roster import printable

    return f"arena {printable(path, 4096)}"


def _gpu_lines(view: GpuView | None) -> list[str]:
    from ..arena.roster import printable

    if view is None:
        return []
    return [
        f"GPU {g.index} {printable(g.name, 64)}: {_bytes(g.used)} of {_bytes(g.total)} used"
        for g in view.gpus
    ]


def _plain(
    path: str, rows: list[Row], now: float, view: GpuView | None = None, budget: str | None = None
) -> str:
    lines = [_title(path), *_gpu_lines(view), *([budget] if budget else [])]
    if not rows:
        lines.append("no members")
        return "\n".join(lines)
    table = [list(_COLUMNS)] + [_cells(r, now) for r in rows]
    widths = [max(len(t[i]) for t in table) for i in range(len(_COLUMNS) - 1)]
    for t in table:
        lines.append("  ".join(c.ljust(w) for c, w in zip(t, widths, strict=False)) + "  " + t[-1])
    return "\n".join(lines)


_STYLE = {
    "resident": "bold green",
    "releasing": "yellow",
    "restoring": "yellow",
    "waiting": "cyan",
    "released": "dim",
}


def _rich_table(
    path: str, rows: list[Row], now: float, view: GpuView | None = None, budget: str | None = None
) -> Any:
    from rich.table import Table
    from rich.text import Text

    # Text, not str: rich would read "[...]" in a name or a command as markup.
    title = "\n".join([_title(path), *_gpu_lines(view), *([budget] if budget else [])])
    table = Table(title=Text(title), title_justify="left", expand=False)
    for col in _COLUMNS:
        table.add_column(col, overflow="fold" if col == "COMMAND" else "ellipsis")
    for row in rows:
        table.add_row(*(Text(c) for c in _cells(row, now)), style=_STYLE.get(row.state))
    if not rows:
        table.caption = "no members"
    return table


def _arenas(arena: str | None, gpu: str | None) -> list[tuple[Arena, int | None]]:
    """The arenas ``--arena``/``--gpu`` name (several GPUs: each one's, ascending), each with
    the GPU whose memory to show: the arena's where that is known, else None (every GPU)."""
    from ..arena.directory import Arena, default_gpu, locate, one_arena_or_gpus, parse_gpus

    gpus: list[int | None] = [*sorted(parse_gpus(gpu))] if gpu is not None else []
    one_arena_or_gpus(arena, gpus)
    opened: list[tuple[Arena, int | None]] = []
    try:
        for g in gpus or [None]:
            index = g if g is not None else (default_gpu() if locate(arena)[1] else None)
            opened.append((Arena.open(arena, g), index))
    except BaseException:
        for a, _ in opened:
            a.close()
        raise
    return opened


@app.command()
def who(
    arena: ArenaOpt = None,
    gpu: GpusOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
    watch: Annotated[
        bool, typer.Option("--watch", help="Refresh every second until Ctrl-C.")
    ] = False,
) -> None:
    """Show who is resident, who waits and who is released, from kernel lock state."""
    from dataclasses import asdict

    from ..arena.roster import budget_view, gpu_view, snapshot, with_vram

    arenas = _arenas(arena, gpu)
    tty = sys.stdout.isatty() and not as_json

    def one(opened: Arena, index: int | None) -> Any:
        rows, now, view = snapshot(opened), time.time(), gpu_view(index)
        budget = budget_view(opened)
        if view is not None:
            rows = with_vram(rows, view)
        line = None if budget is None else budget.line()
        if tty:
            return _rich_table(opened.path, rows, now, view, line)
        if as_json:
            members = [r.as_json(now) for r in rows]
            gpus = None if view is None else [asdict(g) for g in view.gpus]
            units = None if budget is None else {
                "unit": budget.budget.unit, "units": budget.budget.units, "held": budget.held
            }  # fmt: skip
            return {"arena": opened.path, "gpus": gpus, "budget": units, "members": members}
        return _plain(opened.path, rows, now, view, line)

    def frame() -> Any:
        parts = [one(opened, index) for opened, index in arenas]
        if tty:
            from rich.console import Group

            return parts[0] if len(parts) == 1 else Group(*parts)
        if as_json:
            # Several GPUs: an array of the one-arena documents, in GPU order.
            return json.dumps(parts[0] if len(parts) == 1 else parts, indent=2, allow_nan=False)
        return "\n\n".join(parts)

    try:
        if tty and watch:
            from rich.live import Live

            with Live(frame(), auto_refresh=False) as live:
                while True:
                    time.sleep(1.0)
                    live.update(frame(), refresh=True)
        elif tty:
            from rich.console import Console

            Console().print(frame())
        else:
            print(frame(), flush=True)
            while watch:
                time.sleep(1.0)
                print(flush=True)
                print(frame(), flush=True)
    except KeyboardInterrupt:
        pass  # the end of --watch
    finally:
        for opened, _ in arenas:
            opened.close()


@app.command("arena")
def arena_path(
    arena: ArenaOpt = None,
    gpu: GpusOpt = None,
    budget: Annotated[
        str | None,
        typer.Option(
            "--budget",
            metavar="SIZE|auto",
            help="Set the arena's VRAM budget (6G, 40G; auto: the GPU's total less 5%, at"
            " least 1G): members that declare a footprint are resident together while they"
            " fit. Only the arena's owner may.",
            show_default=False,
        ),
    ] = None,
) -> None:
    """Print the arena's directory, with its lock files created, for shell scripts
    (several GPUs: each one's, a line each)."""
    from ..arena.directory import default_gpu
    from ..arena.locks import Token, Want

    size = None
    if budget is not None and budget.strip() != "auto":
        from ..arena.budget import parse_size

        size = parse_size(budget, "--budget")
    arenas = _arenas(arena, gpu)
    try:
        for opened, index in arenas:
            Token(opened).close()
            Want(opened).close()
            if budget is not None:
                from ..arena.units import auto_size, store_budget

                chosen = store_budget(
                    opened,
                    size
                    if size is not None
                    else auto_size(default_gpu() if index is None else index),
                )
                print(f"vramlock: {opened.path}: budget {chosen}", file=sys.stderr)
            print(opened.path)
    finally:
        for opened, _ in arenas:
            opened.close()


@app.command()
def demo(
    members: Annotated[
        int, typer.Option(min=2, max=8, metavar="N", help="Simulated GPU programs (2-8).")
    ] = 3,
    seconds: Annotated[str, typer.Option(metavar="SECONDS", help="How long to run.")] = "8",
) -> None:
    """Simulated GPU programs share a temporary arena; watch the token move. No GPU needed."""
    from ..demo import Demo

    show = Demo(members=members, seconds=parse_duration(seconds, "--seconds"))
    show.start()
    interrupted = False
    try:
        if sys.stdout.isatty():
            _demo_live(show)
        else:
            last = None
            while show.running():
                time.sleep(0.05)
                holder = show.current()
                if holder != last and holder is not None:
                    print(f"{show.elapsed():6.2f}s  token -> {holder}", flush=True)
                    last = holder
    except KeyboardInterrupt:
        interrupted = True
    finally:
        print(show.stop())
    if interrupted:
        raise typer.Exit(130)


# The demo's table leaves out what a simulated program has not (VRAM) or what tells a
# newcomer little (CHILD, NOTE), and each path in a command line shows as its base name,
# so that a member is one row at 80 columns.
_DEMO_COLUMNS = ("STATE", "PID", "NAME", "STRATEGY", "FOR", "COMMAND")
_TIMELINE = 60


def _short_command(command: str) -> str:
    return " ".join(os.path.basename(w) if "/" in w else w for w in command.split(" "))


def _demo_table(path: str, rows: list[Row], now: float) -> Any:
    from rich.table import Table
    from rich.text import Text

    from ..demo import WIDTH

    picked = [_COLUMNS.index(c) for c in _DEMO_COLUMNS[:-1]]
    cells = [[_cells(row, now)[i] for i in picked] for row in rows]
    columns = zip(_DEMO_COLUMNS[:-1], *cells, strict=True)
    widths = [max(len(c) for c in column) for column in columns]
    # Each column takes its text and 3 cells of rule and padding, plus the closing rule:
    # the command gets the rest, and is cut, not wrapped.
    rest = WIDTH - sum(widths) - 3 * len(_DEMO_COLUMNS) - 1
    table = Table(title=Text(_title(path)), title_justify="left", expand=False)
    for col in _DEMO_COLUMNS[:-1]:
        table.add_column(col, no_wrap=True)
    table.add_column(_DEMO_COLUMNS[-1], no_wrap=True, overflow="ellipsis", max_width=rest)
    for row, texts in zip(rows, cells, strict=True):
        table.add_row(
            *(Text(c) for c in [*texts, _short_command(row.command)]),
            style=_STYLE.get(row.state),
        )
    return table


def demo_frame(show: Demo, rows: list[Row], now: float) -> Any:
    """What the demo shows on a terminal: the members, who held the token when, a legend."""
    from rich.console import Group
    from rich.text import Text

    strip = Text("token  ")
    for name in show.timeline(width=_TIMELINE):
        strip.append("█" if name else "·", style=show.color(name))
    legend = Text("       ")
    for name in show.names:
        legend.append(f"█ {name} ", style=show.color(name))
    return Group(_demo_table(show.arena, rows, now), strip, legend)


def _demo_live(show: Demo) -> None:
    from rich.console import Console
    from rich.live import Live

    from ..demo import WIDTH

    def frame() -> Any:
        return demo_frame(show, show.snapshot(), time.time())

    # Never wider than the layout: on a wide terminal the table stays as it is designed.
    console = Console(width=min(Console().width, WIDTH))
    with Live(frame(), console=console, auto_refresh=False) as live:
        while show.running():
            time.sleep(0.2)
            live.update(frame(), refresh=True)


@app.command()
def serve(
    config: Annotated[
        str | None,
        typer.Argument(
            metavar="CONFIG", help="llama-swap's YAML configuration file.", show_default=False
        ),
    ] = None,
    config_option: Annotated[
        str | None,
        typer.Option(
            "--config",
            metavar="FILE",
            help="The configuration file, as llama-swap takes it (instead of CONFIG).",
            show_default=False,
        ),
    ] = None,
    listen: Annotated[
        str,
        typer.Option(
            metavar="ADDR",
            help="Take the OpenAI API here (HOST:PORT, [IPv6]:PORT, PORT on 127.0.0.1, or"
            " :PORT on every interface).",
        ),
    ] = "127.0.0.1:8080",
) -> None:
    """Serve every model of CONFIG at one address; each model is a member of the arena."""
    from ..serve import serve as serve_models

    paths = [p for p in (config, config_option) if p is not None]
    if len(paths) != 1:
        raise UsageError("give the configuration file once: CONFIG or --config FILE")
    raise typer.Exit(serve_models(paths[0], listen, duration=parse_duration, warn=_warn))


def _version(value: bool) -> None:
    if value:
        print(f"vramlock {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option("--version", callback=_version, is_eager=True, help="Print the version."),
    ] = False,
) -> None:
    """Time-share one GPU between always-loaded programs, with kernel file locks only."""


def _click_exception_class() -> type[BaseException]:
    # typer has shipped click both vendored and as a dependency; find its base
    # exception class through a public subclass instead of importing either.
    return next(c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException")


def _reopen_closed_stdio() -> None:
    # A closed 0, 1 or 2 is the number the next open() returns: token.lock would get it,
    # and a command writing to its stdout would write into the lock file.
    for fd, name, mode in ((0, "stdin", "r"), (1, "stdout", "w"), (2, "stderr", "w")):
        try:
            os.fstat(fd)
        except OSError:
            null = os.open(os.devnull, os.O_RDWR)  # the lowest free number: this one
            os.set_inheritable(null, True)  # a command we start gets it too
            if getattr(sys, name) is None:  # Python found it closed at start-up
                setattr(sys, name, open(fd, mode, closefd=False))  # noqa: SIM115 (open for good)


def _discard(stream: TextIO) -> None:
    """Point ``stream``'s descriptor at /dev/null: what is still buffered, and the
    interpreter's flush at exit, then go nowhere instead of failing again."""
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, stream.fileno())
    except (OSError, ValueError):
        pass  # not a descriptor of ours (an in-process caller's replacement stream)
    finally:
        os.close(null)


# typer's, for --show-completion and --install-completion.
_SHELLS = ("bash", "zsh", "fish", "powershell", "pwsh")


def _completion_for_named_shell(command: Any, argv: list[str]) -> int | None:
    """``vramlock --show-completion zsh`` (or ``--install-completion``, or ``=zsh``).

    typer's options take no value and detect the shell that started us, so from bash the
    word ``zsh`` was ignored and bash's script printed; a shell named here wins."""
    option, _, shell = (argv[0] if argv else "").partition("=")
    if option not in ("--show-completion", "--install-completion"):
        return None
    rest = argv[1:]
    if not shell:
        if not rest:
            return None  # the option alone: typer detects the shell
        shell, rest = rest[0], rest[1:]
    if rest:
        raise UsageError(f"{option}: unexpected argument {rest[0]!r} after the shell")
    if shell not in _SHELLS:
        raise UsageError(f"{option}: unknown shell {shell!r} (one of {', '.join(_SHELLS)})")
    from typer.completion import install_callback, show_callback

    callback = show_callback if option == "--show-completion" else install_callback
    param = next(p for p in command.params if option in p.opts)
    with typer.Context(command, info_name="vramlock") as ctx:
        try:
            callback(ctx, param, shell)
        except SystemExit as end:  # how typer's callbacks finish
            return int(end.code or 0)
    return 0


def _run(argv: list[str] | None) -> int:
    command = typer.main.get_command(app)
    click_error = _click_exception_class()
    try:
        named = _completion_for_named_shell(command, sys.argv[1:] if argv is None else argv)
        if named is not None:
            return named
        code = command.main(args=argv, prog_name="vramlock", standalone_mode=False)
    except VramlockError as err:
        _warn(str(err))
        return err.exit_status
    except click_error as err:
        message = err.format_message()  # type: ignore[attr-defined]
        if type(err).__name__ == "NoArgsIsHelpError":  # plain `vramlock`: help, not an error
            print(message)
            return 0
        _warn(message)
        return int(getattr(err, "exit_code", 2))
    except KeyboardInterrupt:
        return 130
    return code if isinstance(code, int) else 0


def main(argv: list[str] | None = None) -> NoReturn:
    """Entry point: run the CLI, map every error to one stderr line and an exit status."""
    _reopen_closed_stdio()
    try:
        with _stdout_reader_may_go():
            code = _run(argv)
            sys.stdout.flush()
    except _ReaderGone:
        _discard(sys.stdout)  # what is still buffered goes nowhere, also at exit
        code = 0
    except OSError as err:  # stdout on a full disk (ENOSPC), an I/O error: no traceback
        _discard(sys.stdout)
        _warn(f"cannot write the output: {err.strerror or err}")
        code = 125
    try:
        sys.stderr.flush()
    except OSError:
        _discard(sys.stderr)  # broken: the exit status still tells
    sys.exit(code)
