"""``vramlock ui``: a live web page of one arena."""

from __future__ import annotations

from ..errors import UsageError


def ui(arena: str | None, gpu: str | None, listen: str) -> int:
    """Show the arena live in a browser: members, VRAM, a timeline, the journal."""
    from ..arena.directory import Arena, default_gpu, locate, parse_gpus
    from ..ui import Watch, serve
    from .common import warn

    index = None if gpu is None else parse_gpus(gpu)
    if index is not None and len(index) > 1:
        raise UsageError("--gpu: ui shows one arena; name one GPU")
    opened = Arena.open(arena, None if index is None else index[0])
    # NVML's GPU: the arena's where that is known, else every GPU (an arena given by path).
    shown = index[0] if index else (default_gpu() if locate(arena)[1] else None)
    try:
        code = serve(Watch(opened, shown), listen, warn)
    finally:
        opened.close()
    return code
