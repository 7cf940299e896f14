"""``vramlock demo``: simulated GPU programs share a temporary arena; the token moves."""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING, Any

from .common import parse_duration
from .who import COLUMNS, STYLE, cells, short_command, title

if TYPE_CHECKING:
    from ..arena.roster import Row
    from ..demo import Demo


def demo(members: int, seconds: str) -> int:
    """Simulated GPU programs share a temporary arena; watch the token move. No GPU needed."""
    from ..demo import Demo

    show = Demo(members=members, seconds=parse_duration(seconds, "--seconds"))
    show.start()
    try:
        if sys.stdout.isatty():
            _demo_live(show)
        else:
            _demo_lines(show)
    except KeyboardInterrupt:
        return 130
    finally:
        print(show.stop())
    return 0


def _demo_lines(show: Demo) -> None:
    """Not a terminal: a line each time the token moves."""
    last = None
    while show.running():
        time.sleep(0.05)
        holder = show.current()
        if holder != last and holder is not None:
            print(f"{show.elapsed():6.2f}s  token -> {holder}", flush=True)
            last = holder


# The demo's table leaves out what a simulated program has not (VRAM) or what tells a
# newcomer little (CHILD, NOTE), and each path in a command line shows as its base name,
# so that a member is one row at 80 columns.
_DEMO_COLUMNS = ("STATE", "PID", "NAME", "STRATEGY", "FOR", "COMMAND")
_TIMELINE = 60


def _demo_table(path: str, rows: list[Row], now: float) -> Any:
    from rich.table import Table
    from rich.text import Text

    from ..demo import WIDTH

    picked = [COLUMNS.index(c) for c in _DEMO_COLUMNS[:-1]]
    texts = [[cells(row, now)[i] for i in picked] for row in rows]
    columns = zip(_DEMO_COLUMNS[:-1], *texts, strict=True)
    widths = [max(len(c) for c in column) for column in columns]
    # Each column takes its text and 3 cells of rule and padding, plus the closing rule:
    # the command gets the rest, and is cut, not wrapped.
    rest = WIDTH - sum(widths) - 3 * len(_DEMO_COLUMNS) - 1
    table = Table(title=Text(title(path)), title_justify="left", expand=False)
    for col in _DEMO_COLUMNS[:-1]:
        table.add_column(col, no_wrap=True)
    table.add_column(_DEMO_COLUMNS[-1], no_wrap=True, overflow="ellipsis", max_width=rest)
    for row, shown in zip(rows, texts, strict=True):
        table.add_row(
            *(Text(c) for c in [*shown, short_command(row.command)]),
            style=STYLE.get(row.state),
        )
    return table


def demo_frame(show: Demo, rows: list[Row], now: float) -> Any:
    """What the demo shows on a terminal: the members, who held the token when, a legend."""
    from rich.console import Group
    from rich.text import Text

    strip = Text("token  ")
    for name in show.timeline(width=_TIMELINE):
        strip.append("█" if name else "·", style=show.color(name))
    legend = Text("       ")
    for name in show.names:
        legend.append(f"█ {name} ", style=show.color(name))
    return Group(_demo_table(show.arena, rows, now), strip, legend)


def _demo_live(show: Demo) -> None:
    from rich.console import Console
    from rich.live import Live

    from ..demo import WIDTH

    def frame() -> Any:
        return demo_frame(show, show.snapshot(), time.time())

    # Never wider than the layout: on a wide terminal the table stays as it is designed.
    console = Console(width=min(Console().width, WIDTH))
    with Live(frame(), console=console, auto_refresh=False) as live:
        while show.running():
            time.sleep(0.2)
            live.update(frame(), refresh=True)
