"""How many of llama-swap's router and server cases serve passes, per area.

    python bench/conformance.py

Each cell: cases as llama-swap / divergence named / failing.

Runs tests/test_llamaswap_*.py (each case a llama-swap test's facts asked of a real
``vramlock serve``) and counts each area's cases from their ids (``AREA/NAME``): as
llama-swap (passed), a divergence named in docs/serve.md (passed, id ending
``~diverges``), failing today (a strict xfail saying what serve does otherwise).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FILES = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_llamaswap_*.py"))
# llama-swap's test files each area comes from
AREAS = {
    "groups": "router/group_test.go",
    "loading": "router/loading_test.go",
    "api": "server/api_test.go",
    "server": "server/server_test.go",
    "apigroup": "server/apigroup_test.go",
    "auth": "server/auth_test.go",
    "filters": "server/filters_test.go",
    "log": "server/log_test.go",
    "profiles": "server/profiles_test.go",
    "selectors": "server/selector_test.go",
    "main": "llama-swap.go",
}
LINE = re.compile(r"^(PASSED|XFAIL|XPASS|FAILED|ERROR) \S+\[([^\]]+)\]")


def run() -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider",
                           *FILES], cwd=ROOT, env=env, capture_output=True, text=True)  # fmt: skip
    return done.stdout


def count(output: str) -> dict[str, Counter[str]]:
    """Each area's cases by verdict: same, diverges, failing, broken (a plain failure)."""
    areas: dict[str, Counter[str]] = {a: Counter() for a in AREAS}
    for line in output.splitlines():
        found = LINE.match(line)
        if found is None:
            continue
        outcome, case = found.groups()
        area = case.split("/", 1)[0]
        if outcome == "PASSED":
            verdict = "diverges" if case.endswith("~diverges") else "same"
        else:
            verdict = "failing" if outcome == "XFAIL" else "broken"
        areas.setdefault(area, Counter())[verdict] += 1
    return areas


def table(areas: dict[str, Counter[str]]) -> list[str]:
    """One column per area (llama-swap's test file: AREAS), each cell its cases as
    llama-swap / divergence named / failing; the last column all of them."""
    total: Counter[str] = Counter()
    for c in areas.values():
        total.update(c)

    def cell(c: Counter[str]) -> str:
        return f"{c['same']} / {c['diverges']} / {c['failing'] + c['broken']}"

    n = sum(total.values())
    share = f" ({100 * total['same'] / n:.1f} %)" if n else ""
    rows = [
        "| | " + " | ".join(areas) + " | all (≥ 97 %) |",
        "|---|" + "---:|" * (len(areas) + 1),
        "| cases | " + " | ".join(cell(c) for c in areas.values()) + f" | {cell(total)}{share} |",
    ]
    if total["broken"]:
        rows.append(f"\n{total['broken']} case(s) failed outright: see pytest's output.")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.parse_args()
    print("\n".join(table(count(run()))))


if __name__ == "__main__":
    main()
