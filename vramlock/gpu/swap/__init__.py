"""The preload library behind ``--release swap``: where it is, and building it.

A wheel built where a C compiler exists carries the library, compiled at install
(``libvramlock-swap.so`` beside this file). Anywhere else (a source checkout, a
wheel built without a compiler) it is compiled once from its sources (``*.c``,
``*.h``) into the user's cache directory, under a name that changes with any of them.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..cbuild import SWAP, BuildError, compiler
from ..core.protocol import SwapUnavailable

__all__ = ["SwapUnavailable", "build", "cache_dir", "compiler", "library_path"]


def build(target: Path, *extra: str) -> None:
    """Compile the library to ``target``; SwapUnavailable when it cannot be."""
    try:
        SWAP.build(target, *extra)
    except BuildError as err:
        raise SwapUnavailable(f"the swap library is not built, and {err}") from None


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "vramlock"


def library_path() -> Path:
    """The library to preload, built first if needed; SwapUnavailable when it cannot be."""
    try:
        return SWAP.path(cache_dir())
    except BuildError as err:
        raise SwapUnavailable(str(err)) from None
