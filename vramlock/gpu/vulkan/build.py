"""Compiling the Vulkan layer: shared by the package (at first use) and by the wheel
build hook (at install), so it imports nothing but the standard library."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

HERE = Path(__file__).parent
# The layer's parts, and the headers they share (vklayer.h says what each holds).
PARTS = ("layer", "table", "record", "cmds", "engine", "stage", "control")
SOURCES = tuple(HERE / f"{part}.c" for part in PARTS)
HEADERS = (HERE / "vklayer.h", HERE / "vkfuncs.h")
LIBRARY = "libvramlock-vulkan.so"
# The Vulkan headers (Debian's libvulkan-dev) are needed to build, not the loader: the
# loader finds the layer's entry points by name.
CFLAGS = ("-std=c11", "-O2", "-fPIC", "-shared", "-fvisibility=hidden", "-Wall", "-Wextra")
LIBS = ("-Wl,-z,defs", "-lpthread")
TIMEOUT = 120.0


class BuildError(Exception):
    """The layer cannot be compiled here (the message says why, in one line)."""


def compiler() -> str | None:
    """The C compiler to build the layer with: $CC, else cc or gcc on the PATH."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def build(target: Path, *extra: str) -> None:
    """Compile the layer to ``target``, atomically: a concurrent reader sees the whole
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
        if "vulkan/vk_layer.h" in done.stderr:
            raise BuildError("the Vulkan headers are not installed (libvulkan-dev)")
        first = next((ln for ln in done.stderr.splitlines() if "error" in ln), done.stderr.strip())
        raise BuildError(f"{cc} failed: {first[:200]}")
    os.replace(partial, target)
