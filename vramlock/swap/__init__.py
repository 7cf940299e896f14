"""The preload library behind ``--release swap``: where it is, and building it.

A wheel built where a C compiler exists carries the library, compiled at install
(``libvramlock-swap.so`` beside this file). Anywhere else (a source checkout, a
wheel built without a compiler) it is compiled once from ``vramlock_swap.c`` into
the user's cache directory, under a name that changes with the source, and moved
into place atomically so that concurrent runs never load a half-written file.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

from ..errors import StrategyError

SOURCE = Path(__file__).with_name("vramlock_swap.c")
LIBRARY = "libvramlock-swap.so"
# No CUDA headers or libraries: the library declares the driver types it uses and
# finds the driver at run time.
CFLAGS = ("-std=c11", "-O2", "-fPIC", "-shared", "-fvisibility=hidden", "-Wall", "-Wextra")
LIBS = ("-ldl", "-lpthread")
BUILD_TIMEOUT = 120.0


class SwapUnavailable(StrategyError):
    """The preload library is not there and cannot be built here."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"--release swap cannot be used here: {reason}")
        self.reason = reason


def compiler() -> str | None:
    """The C compiler to build the library with: $CC, else cc or gcc on the PATH."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def build(target: Path, *extra: str) -> None:
    """Compile the library to ``target`` (atomically); SwapUnavailable when it cannot be."""
    cc = compiler()
    if cc is None:
        raise SwapUnavailable("the swap library is not built and there is no C compiler (cc)")
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        done = subprocess.run(
            [cc, *CFLAGS, *extra, "-o", str(partial), str(SOURCE), *LIBS],
            capture_output=True,
            text=True,
            timeout=BUILD_TIMEOUT,
        )
    except (OSError, subprocess.TimeoutExpired) as err:
        raise SwapUnavailable(f"cannot build the swap library with {cc}: {err}") from None
    if done.returncode != 0:
        partial.unlink(missing_ok=True)
        first = next((ln for ln in done.stderr.splitlines() if "error" in ln), done.stderr.strip())
        raise SwapUnavailable(f"building the swap library with {cc} failed: {first[:200]}")
    os.replace(partial, target)


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "vramlock"


def library_path() -> Path:
    """The library to preload, built first if needed; SwapUnavailable when it cannot be."""
    packaged = SOURCE.with_name(LIBRARY)
    if packaged.is_file():
        return packaged
    try:
        digest = hashlib.sha256(SOURCE.read_bytes() + " ".join(CFLAGS).encode()).hexdigest()
    except OSError as err:
        raise SwapUnavailable(f"the swap library's source is missing ({err.strerror})") from None
    cached = cache_dir() / f"libvramlock-swap-{digest[:16]}.so"
    if not cached.is_file():
        build(cached)
    return cached
