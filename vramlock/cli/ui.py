"""``vramlock ui``: a live web page of one arena."""

from __future__ import annotations


def ui(arena: str | None, gpu: str | None, listen: str) -> int:
    """Show the arena live in a browser: members, VRAM, a timeline, the journal."""
    from ..ui import Watch, serve
    from .common import one_arena, warn

    opened, shown = one_arena(arena, gpu, "ui shows one arena; name one GPU")
    try:
        code = serve(Watch(opened, shown), listen, warn)
    finally:
        opened.close()
    return code
