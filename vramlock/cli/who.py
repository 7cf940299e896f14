"""``vramlock who``: the arena's members as a table (rich on a terminal), plain text or JSON.

Plain text and JSON need neither typer nor rich: ``who`` in a shell loop pays for neither.
"""

from __future__ import annotations

import json
import sys
import time
from typing import TYPE_CHECKING, Any

from .common import arenas, close_all

if TYPE_CHECKING:
    from ..arena.directory import Arena
    from ..arena.roster import GpuView, Row


def ago(since: float | None, now: float) -> str:
    """How long since ``since``: ``4.2s``, ``3m05s``, ``2h10m``; ``-`` when unknown."""
    if since is None:
        return "-"
    s = max(0.0, now - since)
    if s < 60:
        return f"{s:.1f}s"
    if s < 3600:
        return f"{int(s // 60)}m{int(s % 60):02d}s"
    return f"{int(s // 3600)}h{int(s % 3600 // 60):02d}m"


COLUMNS = ("STATE", "PID", "NAME", "STRATEGY", "FOR", "CHILD", "VRAM", "NOTE", "COMMAND")

STYLE = {
    "resident": "bold green",
    "releasing": "yellow",
    "restoring": "yellow",
    "waiting": "cyan",
    "released": "dim",
}


def _bytes(n: int | None) -> str:
    if n is None:
        return "-"
    if n >= 2**30:
        return f"{n / 2**30:.1f} GiB"
    return f"{n / 2**20:.0f} MiB"


def cells(row: Row, now: float) -> list[str]:
    """The row's text, one string per column of ``COLUMNS``."""
    # Row's text is printable already (roster.printable): no escape reaches the terminal.
    return [
        row.state,
        str(row.pid),
        row.name,
        row.strategy,
        ago(row.since, now),
        "-" if row.child_pid is None else str(row.child_pid),
        _bytes(row.vram),
        row.note or "-",
        row.command,
    ]


def title(path: str) -> str:
    """The line above an arena's table."""
    from ..arena.roster import printable

    return f"arena {printable(path, 4096)}"


def _gpu_lines(view: GpuView | None) -> list[str]:
    from ..arena.roster import printable

    if view is None:
        return []
    return [
        f"GPU {g.index} {printable(g.name, 64)}: {_bytes(g.used)} of {_bytes(g.total)} used"
        for g in view.gpus
    ]


def _plain(
    path: str, rows: list[Row], now: float, view: GpuView | None = None, budget: str | None = None
) -> str:
    lines = [title(path), *_gpu_lines(view), *([budget] if budget else [])]
    if not rows:
        lines.append("no members")
        return "\n".join(lines)
    table = [list(COLUMNS)] + [cells(r, now) for r in rows]
    widths = [max(len(t[i]) for t in table) for i in range(len(COLUMNS) - 1)]
    for t in table:
        lines.append("  ".join(c.ljust(w) for c, w in zip(t, widths, strict=False)) + "  " + t[-1])
    return "\n".join(lines)


def _rich_table(
    path: str, rows: list[Row], now: float, view: GpuView | None = None, budget: str | None = None
) -> Any:
    from rich.table import Table
    from rich.text import Text

    # Text, not str: rich would read "[...]" in a name or a command as markup.
    heading = "\n".join([title(path), *_gpu_lines(view), *([budget] if budget else [])])
    table = Table(title=Text(heading), title_justify="left", expand=False)
    for col in COLUMNS:
        table.add_column(col, overflow="fold" if col == "COMMAND" else "ellipsis")
    for row in rows:
        table.add_row(*(Text(c) for c in cells(row, now)), style=STYLE.get(row.state))
    if not rows:
        table.caption = "no members"
    return table


def _one(opened: Arena, index: int | None, tty: bool, as_json: bool) -> Any:
    """One arena's part of a frame: a rich table, a JSON document or plain text."""
    from dataclasses import asdict

    from ..arena.roster import budget_view, gpu_view, snapshot, with_vram

    rows, now, view = snapshot(opened), time.time(), gpu_view(index)
    budget = budget_view(opened)
    if view is not None:
        rows = with_vram(rows, view)
    line = None if budget is None else budget.line()
    if tty:
        return _rich_table(opened.path, rows, now, view, line)
    if as_json:
        members = [r.as_json(now) for r in rows]
        gpus = None if view is None else [asdict(g) for g in view.gpus]
        units = None if budget is None else {
            "unit": budget.budget.unit, "units": budget.budget.units, "held": budget.held
        }  # fmt: skip
        return {"arena": opened.path, "gpus": gpus, "budget": units, "members": members}
    return _plain(opened.path, rows, now, view, line)


def _frame(opened: list[tuple[Arena, int | None]], tty: bool, as_json: bool) -> Any:
    """Every arena's part, together."""
    parts = [_one(a, index, tty, as_json) for a, index in opened]
    if tty:
        from rich.console import Group

        return parts[0] if len(parts) == 1 else Group(*parts)
    if as_json:
        # Several GPUs: an array of the one-arena documents, in GPU order.
        return json.dumps(parts[0] if len(parts) == 1 else parts, indent=2, allow_nan=False)
    return "\n\n".join(parts)


def who(arena: str | None, gpu: str | None, as_json: bool, watch: bool) -> None:
    """Show who is resident, who waits and who is released, from kernel lock state."""
    opened = arenas(arena, gpu)
    tty = sys.stdout.isatty() and not as_json
    try:
        if tty and watch:
            from rich.live import Live

            with Live(_frame(opened, tty, as_json), auto_refresh=False) as live:
                while True:
                    time.sleep(1.0)
                    live.update(_frame(opened, tty, as_json), refresh=True)
        elif tty:
            from rich.console import Console

            Console().print(_frame(opened, tty, as_json))
        else:
            print(_frame(opened, tty, as_json), flush=True)
            while watch:
                time.sleep(1.0)
                print(flush=True)
                print(_frame(opened, tty, as_json), flush=True)
    except KeyboardInterrupt:
        pass  # the end of --watch
    finally:
        close_all(opened)
