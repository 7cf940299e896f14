"""Compiling the swap library: shared by the package (at first use) and by the wheel
build hook (at install), so it imports nothing but the standard library."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

HERE = Path(__file__).parent
# The library's parts, and the one header they share (swap.h says what each holds).
PARTS = (
    *("entry", "hooks", "gate", "table", "engine", "delta", "hostmem", "prepare"),
    *("exec", "control", "record"),
)
SOURCES = tuple(HERE / f"{part}.c" for part in PARTS)
# swap.h, and the digest's arithmetic and kernel (digest.h; digest_ptx.h, made by
# gen_digest.py from digest.cu).
HEADERS = (HERE / "swap.h", HERE / "digest.h", HERE / "digest_ptx.h")
LIBRARY = "libvramlock-swap.so"
# No CUDA headers or libraries: the library declares the driver types it uses and
# finds the driver at run time.
CFLAGS = ("-std=c11", "-O2", "-fPIC", "-shared", "-fvisibility=hidden", "-Wall", "-Wextra")
# -z defs: a name one part uses and none defines fails here, not at load.
LIBS = ("-Wl,-z,defs", "-ldl", "-lpthread")
TIMEOUT = 120.0


class BuildError(Exception):
    """The library cannot be compiled here (the message says why, in one line)."""


def compiler() -> str | None:
    """The C compiler to build the library with: $CC, else cc or gcc on the PATH."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def build(target: Path, *extra: str) -> None:
    """Compile the library to ``target``, atomically: a concurrent reader sees the whole
    file or none."""
    cc = compiler()
    if cc is None:
        raise BuildError("there is no C compiler (cc)")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise BuildError(f"{target.parent} cannot be made: {err.strerror}") from None
    partial = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        done = subprocess.run(
            [cc, *CFLAGS, *extra, "-o", str(partial), *map(str, SOURCES), *LIBS],
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
        )
    except (OSError, subprocess.TimeoutExpired) as err:
        raise BuildError(f"cannot run {cc}: {err}") from None
    if done.returncode != 0:
        partial.unlink(missing_ok=True)
        first = next((ln for ln in done.stderr.splitlines() if "error" in ln), done.stderr.strip())
        raise BuildError(f"{cc} failed: {first[:200]}")
    os.replace(partial, target)
