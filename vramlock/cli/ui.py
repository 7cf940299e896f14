"""``vramlock ui``: a live web page of one arena."""

from __future__ import annotations

from typing import Annotated

import typer

from ..errors import UsageError


def ui(
    arena: Annotated[
        str | None,
        typer.Option("--arena", metavar="PATH", show_default=False,
                     help="Arena directory (must exist). Default: the --gpu arena, or"
                     " VRAMLOCK_ARENA."),
    ] = None,
    gpu: Annotated[
        str | None,
        typer.Option("--gpu", metavar="N", show_default=False,
                     help="Use GPU N's default arena (default: CUDA_VISIBLE_DEVICES if one"
                     " index, else 0)."),
    ] = None,
    listen: Annotated[
        str,
        typer.Option(metavar="ADDR",
                     help="Serve the page here (HOST:PORT, [IPv6]:PORT, or PORT on"
                     " 127.0.0.1)."),
    ] = "127.0.0.1:8090",
) -> None:  # fmt: skip
    """Show the arena live in a browser: members, VRAM, a timeline, the journal."""
    from ..arena.directory import Arena, default_gpu, locate, parse_gpus
    from ..ui import Watch, serve
    from . import _warn

    index = None if gpu is None else parse_gpus(gpu)
    if index is not None and len(index) > 1:
        raise UsageError("--gpu: ui shows one arena; name one GPU")
    opened = Arena.open(arena, None if index is None else index[0])
    # NVML's GPU: the arena's where that is known, else every GPU (an arena given by path).
    shown = index[0] if index else (default_gpu() if locate(arena)[1] else None)
    try:
        code = serve(Watch(opened, shown), listen, _warn)
    finally:
        opened.close()
    raise typer.Exit(code)
