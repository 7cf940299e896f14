"""``vramlock`` command lines, and what ``vramlock who`` says."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any


def vramlock(*args: str) -> list[str]:
    """The command line of ``python -m vramlock ARGS`` (the tree under test)."""
    return [sys.executable, "-m", "vramlock", *args]


def _no_constants(name: str) -> None:
    raise ValueError(f"not strict JSON: {name}")


def who_plain(arena: Path) -> str:
    """``vramlock who``'s plain text (not a terminal)."""
    return subprocess.run(
        vramlock("who", "--arena", str(arena)),
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout


def who_json(arena: Path) -> list[dict[str, Any]]:
    """``vramlock who --json``'s members, parsed as strict JSON (no NaN or Infinity)."""
    out = subprocess.run(
        vramlock("who", "--arena", str(arena), "--json"),
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout
    members: list[dict[str, Any]] = json.loads(out, parse_constant=_no_constants)["members"]
    return members


def strategy_of(arena: Path) -> str:
    """The strategy ``vramlock who`` shows for the arena's one member."""
    (row,) = [r for r in who_json(arena) if r["member"]]
    return str(row["strategy"])
