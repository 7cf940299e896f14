"""``vramlock who``: the arena's members as a table (rich on a terminal), plain text or JSON.

Plain text and JSON need neither typer nor rich: ``who`` in a shell loop pays for neither.
"""

from __future__ import annotations

import json
import os
import sys
import time

from .common import arenas, close_all

TYPE_CHECKING = False  # typing's, without importing typing (~3 ms); mypy takes it as True
if TYPE_CHECKING:
    from typing import Any

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


COLUMNS = ("STATE", "PID", "NAME", "STRATEGY", "FOR", "SWITCH", "CHILD", "VRAM", "NOTE",
           "COMMAND")  # fmt: skip

STYLE = {
    "resident": "bold green",
    "releasing": "yellow",
    "restoring": "yellow",
    "waiting": "cyan",
    "released": "dim",
}


def took(seconds: float | None) -> str:
    """A release's or a restore's duration: ``850us``, ``42ms``, ``3.1s``; ``-`` unknown."""
    if seconds is None:
        return "-"
    if seconds < 0.001:
        return f"{seconds * 1e6:.0f}us"
    if seconds < 1:
        return f"{seconds * 1000:.0f}ms"
    return f"{seconds:.1f}s"


def switch(row: Row) -> str:
    """The member's last switch: its last release's duration, then its last restore's."""
    if row.last_release is None and row.last_restore is None:
        return "-"
    return f"{took(row.last_release)}/{took(row.last_restore)}"


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
        switch(row),
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


# On a terminal, columns are two cells apart, as in the plain text. On one too narrow for
# every column, SWITCH, CHILD and VRAM go where no row has one, paths in commands show as
# their base names, notes go under the table (wrapped at their spaces, never cut inside an
# address), and the command keeps to one line, cut.
_GAP = 2
_OPTIONAL = ("SWITCH", "CHILD", "VRAM")
_NOTE = COLUMNS.index("NOTE")
_COMMAND_MIN = 12


def short_command(command: str) -> str:
    """``command`` with each absolute path shown as its base name."""
    return " ".join(os.path.basename(w) if w.startswith("/") else w for w in command.split(" "))


def _fitted(texts: list[list[str]], width: int) -> tuple[list[int], int | None]:
    """The columns of ``texts`` (its first row the header) to show on a terminal ``width``
    cells wide, and the width the command must keep to (None: its own)."""
    from rich.cells import cell_len

    widths = [max(cell_len(t[i]) for t in texts) for i in range(len(COLUMNS))]
    shown = list(range(len(COLUMNS)))

    def total() -> int:
        return sum(widths[i] for i in shown) + _GAP * (len(shown) - 1)

    if total() <= width or len(texts) == 1:
        return shown, None
    used = [i for i in shown if any(t[i] != "-" for t in texts[1:])]
    shown = [i for i in shown if i != _NOTE and (COLUMNS[i] not in _OPTIONAL or i in used)]
    for t in texts[1:]:
        t[-1] = short_command(t[-1])
    widths[-1] = max(cell_len(t[-1]) for t in texts)
    return shown, max(_COMMAND_MIN, widths[-1] - (total() - width))


def _rich_table(
    path: str,
    rows: list[Row],
    now: float,
    view: GpuView | None = None,
    budget: str | None = None,
    width: int = 80,
) -> Any:
    from rich import box
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    texts = [list(COLUMNS), *(cells(r, now) for r in rows)]
    shown, command_width = _fitted(texts, width)
    # Text, not str: rich would read "[...]" in a name or a command as markup.
    heading = "\n".join([title(path), *_gpu_lines(view), *([budget] if budget else [])])
    table = Table(title=Text(heading), title_justify="left", expand=False, box=box.SIMPLE_HEAD,
                  show_edge=False, pad_edge=False, collapse_padding=True)  # fmt: skip
    for i in shown:
        fixed = command_width if i == len(COLUMNS) - 1 else None
        table.add_column(COLUMNS[i], width=fixed, no_wrap=True, overflow="ellipsis")
    for row, t in zip(rows, texts[1:], strict=True):
        table.add_row(*(Text(t[i]) for i in shown), style=STYLE.get(row.state))
    if not rows:
        table.caption = "no members"
    if _NOTE in shown:
        return table
    notes = [Text(f"{r.pid}: {r.note}", style=STYLE.get(r.state, "")) for r in rows if r.note]
    return Group(table, *notes)


def _one(opened: Arena, index: int | None, tty: int, as_json: bool) -> Any:
    """One arena's part of a frame: a rich table, a JSON document or plain text."""
    from ..arena.roster import budget_view, gpu_view, snapshot, with_vram

    rows, now, view = snapshot(opened), time.time(), gpu_view(index)
    budget = budget_view(opened)
    if view is not None:
        rows = with_vram(rows, view)
    line = None if budget is None else budget.line()
    if tty:
        return _rich_table(opened.path, rows, now, view, line, width=tty)
    if as_json:
        members = [r.as_json(now) for r in rows]
        gpus = None
        if view is not None:
            from dataclasses import asdict  # nvml's Gpu: with NVML, dataclasses is loaded

            gpus = [asdict(g) for g in view.gpus]
        units = None if budget is None else {
            "unit": budget.budget.unit, "units": budget.budget.units, "held": budget.held
        }  # fmt: skip
        return {"arena": opened.path, "gpus": gpus, "budget": units, "members": members}
    return _plain(opened.path, rows, now, view, line)


def _frame(opened: list[tuple[Arena, int | None]], tty: int, as_json: bool) -> Any:
    """Every arena's part, together; ``tty``: the terminal's width (0: not a terminal)."""
    parts = [_one(a, index, tty, as_json) for a, index in opened]
    if tty:
        from rich.console import Group

        return parts[0] if len(parts) == 1 else Group(*parts)
    if as_json:
        # Several GPUs: an array of the one-arena documents, in GPU order.
        return json.dumps(parts[0] if len(parts) == 1 else parts, indent=2, allow_nan=False)
    return "\n\n".join(parts)


def _terminal_width() -> int:
    from rich.console import Console

    return Console().width


def who(arena: str | None, gpu: str | None, as_json: bool, watch: bool) -> None:
    """Show who is resident, who waits and who is released, from kernel lock state."""
    opened = arenas(arena, gpu)
    tty = _terminal_width() if sys.stdout.isatty() and not as_json else 0
    try:
        if tty and watch:
            from rich.live import Live

            with Live(_frame(opened, tty, as_json), auto_refresh=False) as live:
                while True:
                    time.sleep(1.0)
                    # The terminal's width now: a resized window gets a table that fits.
                    live.update(_frame(opened, live.console.width, as_json), refresh=True)
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
