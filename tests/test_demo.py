"""``vramlock demo`` as a newcomer sees it: one row per member at 80 columns, and a summary
of the time it ran also when interrupted."""

from __future__ import annotations

import io
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
from helpers.commands import vramlock
from helpers.processes import kill_group, sigint_default, wait_until
from rich.cells import cell_len
from rich.console import Console

from vramlock.arena.roster import Row
from vramlock.cli.demo import demo_frame
from vramlock.demo import NAMES, Demo

pytestmark = pytest.mark.timeout(90)


def _render(show: Demo, rows: list[Row], width: int) -> list[str]:
    out = io.StringIO()
    Console(file=out, width=width, color_system=None).print(demo_frame(show, rows, time.time()))
    return out.getvalue().splitlines()


def _check_layout(lines: list[str], names: list[str]) -> None:
    wide = [line for line in lines if cell_len(line) > 80]
    assert not wide, "\n".join(wide)
    body = [line for line in lines if line.startswith("│")]  # the table's rows, one per line
    assert len(body) == len(names), "\n".join(lines)
    for name in names:
        assert sum(f" {name} " in line for line in body) == 1, "\n".join(lines)


@pytest.mark.parametrize("width", [80, 200])
def test_the_demo_view_is_one_row_per_member_in_80_columns(width: int) -> None:
    """The real members, their real command lines (full interpreter and log paths)."""
    show = Demo(members=len(NAMES), seconds=60)
    try:
        show.start()
        wait_until(lambda: len(show.snapshot()) == len(NAMES), timeout=60)
        _check_layout(_render(show, show.snapshot(), width), show.names)
    finally:
        show.stop()


def test_the_worst_case_rows_fit_too(tmp_path: Path) -> None:
    """Seven-digit pids, the longest state, an hour in it, a deep interpreter path."""
    show = Demo(members=len(NAMES), seconds=1)
    deep = "/" + "/".join(["very-long-directory-name"] * 12)
    rows = [
        Row(pid=4194300 + i, state="releasing", name=name, strategy="signal",
            command=f"{deep}/python3 -m vramlock.demo {name} {deep}/events.log",
            since=time.time() - 3599, child_pid=4194200 + i, member=True)
        for i, name in enumerate(show.names)
    ]  # fmt: skip
    try:
        _check_layout(_render(show, rows, 80), show.names)
    finally:
        show.stop()


def test_interrupted_demo_sums_up_the_time_it_ran(tmp_path: Path) -> None:
    """Ctrl-C: the programs are stopped, the summary is of the time run, exit 130, and the
    temporary arena is gone."""
    env = dict(os.environ, TMPDIR=str(tmp_path))
    proc = subprocess.Popen(vramlock("demo", "--seconds", "60"), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True, preexec_fn=sigint_default)  # fmt: skip
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline()
        assert "token -> " in first, first
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        kill_group(proc)
    assert proc.returncode == 130, err
    m = re.search(r"handoffs in ([\d.]+) s between 3 programs", out)
    assert m and float(m.group(1)) < 60, out
    assert "GPU share: llama" in out
    assert list(tmp_path.glob("vramlock-demo-*")) == []
