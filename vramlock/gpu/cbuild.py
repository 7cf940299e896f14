"""Compiling the C libraries (the swap library, the Vulkan layer): shared by the package
(at first use) and by the wheel build hook (at install), so it imports nothing but the
standard library.

Each library is a ``Library`` below: its sources, headers and link flags. Both are built
from the engine's core (``core/``: the process's state, the gate, the connection to
vramlock run, host memory) and a front end of their own, each with its own copy of the
core. A wheel built
where a C compiler exists carries it beside its sources; anywhere else ``Library.path``
compiles it once into a cache directory, under a name that changes with any source.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).parent
CFLAGS = ("-std=c11", "-O2", "-fPIC", "-shared", "-fvisibility=hidden", "-Wall", "-Wextra")
TIMEOUT = 120.0


class BuildError(Exception):
    """A library cannot be compiled here (the message says why, in one line)."""


def compiler() -> str | None:
    """The C compiler to build with: $CC, else cc or gcc on the PATH."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


@dataclass(frozen=True)
class Library:
    what: str  # in messages: "the swap library"
    here: Path  # the directory of its front end, where a wheel puts it too
    parts: tuple[str, ...]  # its .c files, from this directory (HERE)
    headers: tuple[str, ...]  # and its headers
    name: str  # the shared object's file name
    libs: tuple[str, ...]
    # A compiler error that names the first: the second says what is missing.
    needs: tuple[tuple[str, str], ...] = ()

    @property
    def sources(self) -> tuple[Path, ...]:
        return tuple(HERE / f"{part}.c" for part in self.parts)

    def build(self, target: Path, *extra: str) -> None:
        """Compile the library to ``target``, atomically: a concurrent reader sees the
        whole file or none."""
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
                [cc, *CFLAGS, *extra, "-o", str(partial), *map(str, self.sources), *self.libs],
                capture_output=True,
                text=True,
                timeout=TIMEOUT,
            )
        except (OSError, subprocess.TimeoutExpired) as err:
            raise BuildError(f"cannot run {cc}: {err}") from None
        if done.returncode != 0:
            partial.unlink(missing_ok=True)
            for needle, missing in self.needs:
                if needle in done.stderr:
                    raise BuildError(missing)
            lines = done.stderr.splitlines()
            first = next((ln for ln in lines if "error" in ln), done.stderr.strip())
            raise BuildError(f"{cc} failed: {first[:200]}")
        os.replace(partial, target)

    def path(self, cache: Path) -> Path:
        """The library to load: the one a wheel carries, else one compiled into ``cache``
        (first if need be); BuildError when it cannot be."""
        found = self._where(cache)
        if not found.is_file():
            try:
                self.build(found)
            except BuildError as err:
                raise BuildError(f"{self.what} is not built, and {err}") from None
        return found

    def built(self, cache: Path) -> Path | None:
        """The library ``path`` would give, where it is there already; nothing compiled."""
        try:
            found = self._where(cache)
        except BuildError:
            return None
        return found if found.is_file() else None

    def _where(self, cache: Path) -> Path:
        """Where the library is or would be: the wheel's, else its name in ``cache`` for
        these sources (BuildError: a source is missing)."""
        packaged = self.here / self.name
        if packaged.is_file():
            return packaged
        digest = hashlib.sha256(" ".join(CFLAGS + self.libs).encode())
        try:
            for source in (*self.sources, *(HERE / name for name in self.headers)):
                name = source.relative_to(HERE).as_posix()
                digest.update(name.encode() + b"\0" + source.read_bytes())
        except OSError as err:
            raise BuildError(f"{self.what}'s source is missing ({err.strerror})") from None
        return cache / f"{self.name.removesuffix('.so')}-{digest.hexdigest()[:16]}.so"


# The engine's core, in both libraries (core/state.h draws the states).
CORE_PARTS = tuple(
    f"core/{part}" for part in ("state", "gate", "control", "proc", "hostmem", "record")
)
CORE_HEADERS = tuple(
    f"core/{name}.h" for name in ("state", "gate", "control", "proc", "hostmem", "record")
)

SWAP = Library(
    what="the swap library",
    here=HERE / "swap",
    # Its parts, and the headers they share (swap.h says what each holds).
    parts=(
        *CORE_PARTS,
        *(f"swap/{part}" for part in ("entry", "exec", "hooks", "start", "engine", "prepare")),
        *(f"swap/{part}" for part in ("delta", "copy", "table", "hostcopy", "driver")),
    ),
    # swap.h and hooks.h, and the digest's arithmetic and kernel (digest.h; digest_ptx.h,
    # made by gen_digest.py from digest.cu). No CUDA headers or libraries: the library
    # declares the driver types it uses and finds the driver at run time.
    headers=(
        *CORE_HEADERS,
        *(f"swap/{name}" for name in ("swap.h", "hooks.h", "digest.h", "digest_ptx.h")),
    ),
    name="libvramlock-swap.so",
    # -z defs: a name one part uses and none defines fails here, not at load.
    libs=("-Wl,-z,defs", "-ldl", "-lpthread"),
)

VULKAN = Library(
    what="the Vulkan layer",
    here=HERE / "vulkan",
    # Its parts, and the headers they share (vklayer.h says what each holds).
    parts=(
        *CORE_PARTS,
        *(f"vulkan/{part}" for part in ("layer", "table", "record", "cmds", "cmds2", "engine")),
        *(f"vulkan/{part}" for part in ("stage", "writes", "spirv", "memtypes", "devices")),
        "vulkan/ahead",
        "vulkan/start",
    ),
    headers=(*CORE_HEADERS, "vulkan/vklayer.h", "vulkan/vkfuncs.h"),
    name="libvramlock-vulkan.so",
    libs=("-Wl,-z,defs", "-lpthread"),
    # The Vulkan headers (Debian's libvulkan-dev) are needed to build, not the loader:
    # the loader finds the layer's entry points by name.
    needs=(("vulkan/vk_layer.h", "the Vulkan headers are not installed (libvulkan-dev)"),),
)

LIBRARIES = {"swap": SWAP, "vulkan": VULKAN}
