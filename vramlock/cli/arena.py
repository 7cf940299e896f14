"""``vramlock arena``: print an arena's directory, its lock files made; set its budget."""

from __future__ import annotations

import sys

from .common import arenas, close_all


def arena(arena: str | None, gpu: str | None, budget: str | None, group: str | None) -> None:
    """Print the arena's directory, with its lock files created, for shell scripts
    (several GPUs: each one's, a line each)."""
    from ..arena.directory import default_gpu
    from ..arena.locks import Token, Want

    size = None
    if budget is not None and budget.strip() != "auto":
        from ..arena.budget import parse_size

        size = parse_size(budget, "--budget")
    if group is not None:
        from ..arena.team import make

        make(arena, group)
    opened = arenas(arena, gpu, adopt=True)
    try:
        for one, index in opened:
            Token(one).close()
            Want(one).close()
            if budget is not None:
                from ..arena.units import auto_size, store_budget

                chosen = store_budget(
                    one,
                    size
                    if size is not None
                    else auto_size(default_gpu() if index is None else index),
                )
                print(f"vramlock: {one.path}: budget {chosen}", file=sys.stderr)
            print(one.path)
    finally:
        close_all(opened)
