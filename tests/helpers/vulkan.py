"""The Vulkan tests' own witness (tests/vulkan/witness_layer.c): building it, and reading
what it logged. It is a layer put next to the driver (below vramlock's): it writes every
submit that reached the driver, with when its work was done, and the device memory the
program holds there after every change (its header says more)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from helpers import ROOT

SOURCES = ROOT / "tests" / "vulkan"
STRICT = ("-std=c11", "-O2", "-Wall", "-Wextra", "-Werror")
NAME = "VK_LAYER_VRAMLOCK_TEST_witness"


def build_witness(cc: str, out: Path) -> Path:
    """The witness layer compiled into ``out`` with its manifest: the directory to name in
    VK_ADD_LAYER_PATH (and NAME in VK_INSTANCE_LAYERS, WITNESS_LOG the log's path)."""
    subprocess.run([cc, *STRICT, "-fPIC", "-shared", "-fvisibility=hidden", "-o",
                    str(out / "libwitness.so"), str(SOURCES / "witness_layer.c")],
                   check=True, timeout=120)  # fmt: skip
    manifest = {
        "file_format_version": "1.2.0",
        "layer": {"name": NAME, "type": "GLOBAL",
                  "library_path": str(out / "libwitness.so"), "api_version": "1.3.0",
                  "implementation_version": "1", "description": "the tests' witness"},
    }  # fmt: skip
    (out / "witness.json").write_text(json.dumps(manifest))
    return out


def logged(log: Path, kind: str) -> list[tuple[int, int]]:
    """The witness's lines of ``kind`` in ``log`` so far (complete lines only): ``submit``
    (start, end) or ``memory`` (when, bytes held)."""
    if not log.exists():
        return []
    text = log.read_text()
    rows = (ln.split() for ln in text[: text.rfind("\n") + 1].splitlines())
    return [(int(a), int(b)) for k, a, b in rows if k == kind]


def held_at(log: Path, ns: int) -> int:
    """The device memory the program held at the driver at ``ns``."""
    return ([b for at, b in logged(log, "memory") if at <= ns] or [0])[-1]


def overlapping(work: list[tuple[int, int]], turns: list[tuple[int, int]]) -> list[object]:
    """The pairs of intervals, one of each list, that overlap."""
    return [(w, t) for w in work for t in turns if w[0] <= t[1] and w[1] >= t[0]]
