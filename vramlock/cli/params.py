"""The commands' typer options and arguments, one ``Annotated`` alias each, so that a
command's signature is one line per option. Help texts here are what ``--help`` prints."""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any

import typer


def _strategy_names() -> list[str]:
    from ..strategies import NAMES

    return list(NAMES)


def _preset_names() -> list[str]:
    from ..strategies import PRESETS

    return list(PRESETS)


def _demand_names() -> list[str]:
    from ..run.options import DEMANDS

    return list(DEMANDS)


def _text(metavar: str, help: str, autocompletion: Callable[[], list[str]] | None = None) -> Any:
    """An option taking a value whose default (None, or one help states) is not shown."""
    return typer.Option(
        metavar=metavar, help=help, show_default=False, autocompletion=autocompletion
    )


MaybeText = str | None  # an option without a value of its own when not given

# -- shared by several commands ---------------------------------------------------------------

ArenaOpt = Annotated[
    MaybeText,
    typer.Option(
        "--arena",
        metavar="PATH",
        help="Arena directory (must exist). Default: the --gpu arena, or VRAMLOCK_ARENA.",
        show_default=False,
    ),
]
GpusOpt = Annotated[
    MaybeText,
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
    MaybeText,
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

# -- run --------------------------------------------------------------------------------------

CommandArg = Annotated[
    list[str],
    typer.Argument(
        metavar="COMMAND", help="The command to run and its arguments.", show_default=False
    ),
]
NameOpt = Annotated[MaybeText, _text("NAME", "Name shown by who (default: the command's).")]
ReleaseOpt = Annotated[
    str,
    typer.Option(
        metavar="STRATEGY",
        help="How the command gives the GPU back: auto, signal, checkpoint, swap,"
        " swap-vulkan, http, none, restart, stop, exec.",
        autocompletion=_strategy_names,
    ),
]
DemandOpt = Annotated[
    str,
    typer.Option(
        metavar="DEMAND",
        help="When a released command wants the GPU back: always, child, listen.",
        autocompletion=_demand_names,
    ),
]
ListenOpt = Annotated[
    MaybeText,
    _text(
        "ADDR",
        "listen demand: take clients here (HOST:PORT, [IPv6]:PORT, or PORT on"
        " 127.0.0.1) and pass them on to --upstream.",
    ),
]
UpstreamOpt = Annotated[
    MaybeText, _text("ADDR", "listen demand: the address the command's server listens on.")
]
IdleOpt = Annotated[
    MaybeText,
    _text(
        "SECONDS",
        "listen demand: put a release off until connections had no traffic this long"
        " (default 300ms).",
    ),
]
ReadyWithinOpt = Annotated[
    MaybeText,
    _text(
        "SECONDS",
        "listen demand: close waiting clients if the started or restored server is"
        " not ready this soon (default 2m).",
    ),
]
ReadyUrlOpt = Annotated[
    MaybeText,
    _text(
        "PATH",
        "listen demand: forward clients once GET PATH answers 2xx after each start"
        " or restore (default /health, or the API's own, for the engines presets know;"
        " else once the server accepts connections).",
    ),
]
OnReleaseOpt = Annotated[
    MaybeText, _text("CMD", "exec strategy: shell command that frees the memory.")
]
OnRestoreOpt = Annotated[
    MaybeText, _text("CMD", "exec strategy: shell command that takes it back.")
]
PresetOpt = Annotated[
    MaybeText,
    _text(
        "NAME",
        "http strategy: the server's API: llama-server, vllm, sglang, comfyui, ollama.",
        autocompletion=_preset_names,
    ),
]
OnReleaseUrlOpt = Annotated[
    MaybeText,
    _text("URL", "http strategy without a preset: POSTed to free the memory (2xx: done)."),
]
OnRestoreUrlOpt = Annotated[
    MaybeText, _text("URL", "http strategy without a preset: POSTed to take it back.")
]
MinHoldOpt = Annotated[
    str, typer.Option(metavar="SECONDS", help="Stay resident at least this long after acquiring.")
]
YieldWithinOpt = Annotated[
    MaybeText,
    _text(
        "SECONDS", "If a graceful release takes longer, end the command (restarted on its turn)."
    ),
]
ReleaseWithinOpt = Annotated[
    MaybeText,
    _text(
        "SECONDS",
        "A release that the command (a process, a hook, its server) does not answer within"
        " this is refused; the command stays resident (default 120 s).",
    ),
]
VramOpt = Annotated[
    MaybeText,
    _text(
        "SIZE",
        "The command's GPU memory at most (6G, 512M): in an arena with a budget it is"
        " resident beside others while they fit.",
    ),
]

# -- wait -------------------------------------------------------------------------------------

FreeOpt = Annotated[
    bool, typer.Option("--free", help="Wait passively until the GPU is free; ask nobody to leave.")
]
FdOpt = Annotated[
    int | None,
    typer.Option(
        "--fd",
        min=0,
        max=2**31 - 1,  # a C int: larger cannot be a descriptor
        metavar="N",
        help="Lock the caller's descriptor N of token.lock, so the caller stays resident.",
        show_default=False,
    ),
]

# -- who --------------------------------------------------------------------------------------

JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON.")]
WatchOpt = Annotated[bool, typer.Option("--watch", help="Refresh every second until Ctrl-C.")]

# -- arena ------------------------------------------------------------------------------------

BudgetOpt = Annotated[
    MaybeText,
    typer.Option(
        "--budget",
        metavar="SIZE|auto",
        help="Set the arena's VRAM budget (6G, 40G; auto: the GPU's total less 5%, at"
        " least 1G): members that declare a footprint are resident together while they"
        " fit. Only the arena's owner may.",
        show_default=False,
    ),
]

# -- demo -------------------------------------------------------------------------------------

MembersOpt = Annotated[
    int, typer.Option(min=2, max=8, metavar="N", help="Simulated GPU programs (2-8).")
]
SecondsOpt = Annotated[str, typer.Option(metavar="SECONDS", help="How long to run.")]

# -- serve ------------------------------------------------------------------------------------

ConfigArg = Annotated[
    MaybeText,
    typer.Argument(
        metavar="CONFIG", help="llama-swap's YAML configuration file.", show_default=False
    ),
]
ConfigOpt = Annotated[
    MaybeText,
    typer.Option(
        "--config",
        metavar="FILE",
        help="The configuration file, as llama-swap takes it (instead of CONFIG).",
        show_default=False,
    ),
]
ConfigDirOpt = Annotated[
    MaybeText,
    typer.Option(
        "--config-dir",
        metavar="DIR",
        help="Merge DIR's *.yaml and *.yml files (sorted) into the configuration, as"
        " llama-swap's -config-dir: with CONFIG, or alone.",
        show_default=False,
    ),
]
ServeListenOpt = Annotated[
    str,
    typer.Option(
        metavar="ADDR",
        help="Take the OpenAI API here (HOST:PORT, [IPv6]:PORT, PORT on 127.0.0.1, or"
        " :PORT on every interface).",
    ),
]

WatchConfigOpt = Annotated[
    bool,
    typer.Option(
        "--watch-config",
        help="Read CONFIG again when it changes: models whose entry is unchanged keep"
        " running; a file that does not load is logged and the one in use kept.",
    ),
]

# -- stats, ui ---------------------------------------------------------------------------------

OneGpuOpt = Annotated[
    MaybeText,
    _text("N", "Use GPU N's default arena (default: CUDA_VISIBLE_DEVICES if one index, else 0)."),
]
SinceOpt = Annotated[
    MaybeText, _text("DURATION", "Only the last DURATION (30m, 2h); default: the whole journal.")
]
PlotOpt = Annotated[
    MaybeText, _text("FILE", "Also draw the timeline into FILE (.svg, .png; the plot extra).")
]
PrometheusOpt = Annotated[
    MaybeText,
    _text(
        "FILE",
        "Write the arena's metrics into FILE (replaced atomically) for node_exporter's"
        " textfile collector, instead of printing.",
    ),
]
UiListenOpt = Annotated[
    str,
    typer.Option(
        metavar="ADDR", help="Serve the page here (HOST:PORT, [IPv6]:PORT, or PORT on 127.0.0.1)."
    ),
]
GroupOpt = Annotated[
    MaybeText,
    _text(
        "GROUP",
        "Make --arena PATH a team arena of GROUP (as root): members of GROUP may join,"
        " nobody else; nobody can replace its files.",
    ),
]
