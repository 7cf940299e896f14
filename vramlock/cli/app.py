"""The typer app: every command's words, options and help, the root callback and
``--version``. Each command's work is in its own module (``run.py``, ``who.py``, ...);
the functions here turn typer's values into a call of it.
"""

from __future__ import annotations

from typing import Annotated, Any

import typer
from typer.core import TyperCommand, TyperGroup

from ..errors import UsageError
from . import arena as arena_command
from . import demo as demo_command
from . import run as run_command
from . import serve as serve_command
from . import stats as stats_command
from . import ui as ui_command
from . import wait as wait_command
from . import who as who_command
from .common import stdout_reader_may_go
from .params import (
    ArenaOpt,
    BudgetOpt,
    CommandArg,
    ConfigArg,
    ConfigDirOpt,
    ConfigOpt,
    ConflictOpt,
    DemandOpt,
    FdOpt,
    FreeOpt,
    GpusOpt,
    GroupOpt,
    IdleOpt,
    JsonOpt,
    ListenOpt,
    MembersOpt,
    MinHoldOpt,
    NameOpt,
    NonblockOpt,
    OneGpuOpt,
    OnReleaseOpt,
    OnReleaseUrlOpt,
    OnRestoreOpt,
    OnRestoreUrlOpt,
    PlotOpt,
    PresetOpt,
    PrometheusOpt,
    ReadyUrlOpt,
    ReadyWithinOpt,
    ReleaseOpt,
    ReleaseWithinOpt,
    SecondsOpt,
    ServeListenOpt,
    SinceOpt,
    TimeoutOpt,
    UiListenOpt,
    UpstreamOpt,
    VramOpt,
    WatchConfigOpt,
    WatchOpt,
    YieldWithinOpt,
)


class _Group(TyperGroup):
    """typer turns EPIPE into exit status 1 before main() sees it; here it reaches main()."""

    def make_context(self, *args: Any, **kwargs: Any) -> Any:  # --help and --version print here
        with stdout_reader_may_go():
            return super().make_context(*args, **kwargs)

    def invoke(self, ctx: Any) -> Any:
        with stdout_reader_may_go():
            return super().invoke(ctx)


class _AfterDashes(TyperCommand):
    """``run``'s usage line: ``[OPTIONS] -- COMMAND...``, the way to keep the command's own
    options from being read as vramlock's (typer would write ``{COMMAND}``)."""

    def collect_usage_pieces(self, ctx: Any) -> list[str]:
        pieces: list[str] = super().collect_usage_pieces(ctx)
        return [*pieces[:-1], "--", "COMMAND..."]


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


@app.command(cls=_AfterDashes, context_settings={"allow_interspersed_args": False})
def run(
    command: CommandArg,
    nonblock: NonblockOpt = False,
    wait: TimeoutOpt = None,
    conflict_exit_code: ConflictOpt = 1,
    arena: ArenaOpt = None,
    gpu: GpusOpt = None,
    name: NameOpt = None,
    release: ReleaseOpt = "auto",
    demand: DemandOpt = "always",
    listen: ListenOpt = None,
    upstream: UpstreamOpt = None,
    idle: IdleOpt = None,
    ready_within: ReadyWithinOpt = None,
    ready_url: ReadyUrlOpt = None,
    on_release: OnReleaseOpt = None,
    on_restore: OnRestoreOpt = None,
    preset: PresetOpt = None,
    on_release_url: OnReleaseUrlOpt = None,
    on_restore_url: OnRestoreUrlOpt = None,
    min_hold: MinHoldOpt = "100ms",
    yield_within: YieldWithinOpt = None,
    release_within: ReleaseWithinOpt = None,
    vram: VramOpt = None,
) -> None:
    """Run COMMAND while it holds the GPU; release it whenever someone else waits."""
    # Every parameter, by its name: the same call fast.py makes from its table.
    raise typer.Exit(run_command.run(**locals()))


@app.command()
def wait(
    nonblock: NonblockOpt = False,
    timeout: TimeoutOpt = None,
    conflict_exit_code: ConflictOpt = 1,
    arena: ArenaOpt = None,
    gpu: GpusOpt = None,
    free: FreeOpt = False,
    fd: FdOpt = None,
) -> None:
    """Queue for the GPU (residents step aside) and return once the token is obtained."""
    wait_command.wait(nonblock, timeout, conflict_exit_code, arena, gpu, free, fd)


@app.command()
def who(
    arena: ArenaOpt = None,
    gpu: GpusOpt = None,
    as_json: JsonOpt = False,
    watch: WatchOpt = False,
) -> None:
    """Show who is resident, who waits and who is released, from kernel lock state."""
    who_command.who(arena=arena, gpu=gpu, as_json=as_json, watch=watch)


@app.command("arena")
def arena_path(
    arena: ArenaOpt = None, gpu: GpusOpt = None, budget: BudgetOpt = None, group: GroupOpt = None
) -> None:
    """Print the arena's directory, with its lock files created, for shell scripts
    (several GPUs: each one's, a line each)."""
    arena_command.arena(arena, gpu, budget, group)


@app.command()
def demo(members: MembersOpt = 3, seconds: SecondsOpt = "8") -> None:
    """Simulated GPU programs share a temporary arena; watch the token move. No GPU needed."""
    raise typer.Exit(demo_command.demo(members, seconds))


@app.command()
def serve(
    config: ConfigArg = None,
    config_option: ConfigOpt = None,
    listen: ServeListenOpt = "127.0.0.1:8080",
    watch_config: WatchConfigOpt = False,
    config_dir: ConfigDirOpt = None,
) -> None:
    """Serve every model of CONFIG at one address; each model is a member of the arena."""
    raise typer.Exit(serve_command.serve(config, config_option, listen, watch_config, config_dir))


@app.command()
def stats(
    arena: ArenaOpt = None,
    gpu: OneGpuOpt = None,
    since: SinceOpt = None,
    as_json: JsonOpt = False,
    plot: PlotOpt = None,
    prometheus: PrometheusOpt = None,
) -> None:
    """Show who had the GPU and for how long, waits, switch times and thrash, from the
    arena's journal."""
    stats_command.stats(arena, gpu, since, as_json, plot, prometheus)


@app.command()
def ui(
    arena: ArenaOpt = None, gpu: OneGpuOpt = None, listen: UiListenOpt = "127.0.0.1:8090"
) -> None:
    """Show the arena live in a browser: members, VRAM, a timeline, the journal."""
    raise typer.Exit(ui_command.ui(arena, gpu, listen))


def _version(value: bool) -> None:
    if value:
        from .. import __version__

        print(f"vramlock {__version__}")
        raise typer.Exit()


VersionOpt = Annotated[
    bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version.")
]


@app.callback()
def _root(version: VersionOpt = False) -> None:
    """Time-share one GPU between always-loaded programs, with kernel file locks only."""


def _click_exception_class() -> type[BaseException]:
    # typer has shipped click both vendored and as a dependency; find its base
    # exception class through a public subclass instead of importing either.
    return next(c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException")


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


def run_app(argv: list[str]) -> int:
    """Run the typer app on ``argv``: its exit status; its usage errors as one line on
    stderr (VramlockError and KeyboardInterrupt are the caller's)."""
    from .common import warn

    command = typer.main.get_command(app)
    click_error = _click_exception_class()
    try:
        named = _completion_for_named_shell(command, argv)
        if named is not None:
            return named
        code = command.main(args=argv, prog_name="vramlock", standalone_mode=False)
    except click_error as err:
        message = err.format_message()  # type: ignore[attr-defined]
        if type(err).__name__ == "NoArgsIsHelpError":  # plain `vramlock`: help, not an error
            print(message)
            return 0
        warn(message)
        return int(getattr(err, "exit_code", 2))
    return code if isinstance(code, int) else 0
