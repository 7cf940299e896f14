"""``vramlock stats``: what the arena's journal says, as a table, JSON, a plot or metrics."""

from __future__ import annotations

import json
import shutil
import sys
import time
from typing import TYPE_CHECKING, Any

from ..errors import UsageError

if TYPE_CHECKING:
    from ..arena.directory import Arena
    from ..observe.stats import Report


def _seconds(value: float | None) -> str:
    if value is None:
        return "-"
    if value < 1:
        return f"{value * 1000:.1f}ms"
    return f"{value:.1f}s" if value < 120 else f"{value / 60:.1f}m"


def _p(summary: dict[str, Any]) -> str:
    return f"{_seconds(summary['p50'])}/{_seconds(summary['p95'])}"


_HEADER = ("NAME", "PID", "RESIDENT", "SHARE", "HANDOFFS", "WAIT p50/p95/max",
           "RELEASE p50/p95", "RESTORE p50/p95", "THRASH", "STATE")  # fmt: skip


def _row(m: dict[str, Any]) -> list[str]:
    from ..arena.roster import printable

    name = printable(m["name"], 64) + ("" if m["trusted"] else " (unverified)")
    wait = m["wait"]
    return [
        name,
        str(m["pid"]),
        _seconds(m["resident_seconds"]),
        f"{m['share'] * 100:.0f}%",
        str(m["handoffs"]),
        f"{_p(wait)}/{_seconds(wait['max'])}",
        _p(m["release"]),
        _p(m["restore"]),
        str(m["thrash"]),
        m["state"],
    ]


def _user(uid: int) -> str:
    """The user's name, else the uid: a member is one user's (its journal file's owner)."""
    import pwd

    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def _text(path: str, report: Report, width: int) -> str:
    from ..arena.roster import printable
    from ..observe.stats import timeline

    data = report.as_json()
    lines = [
        f"arena {path}",
        f"{_seconds(data['seconds'])} journalled, {data['events']} events,"
        f" {data['handoffs']} handoffs, {data['thrash']} thrash",
    ]
    if not report.members:
        return "\n".join([*lines, "no events"])
    rows = [list(_HEADER), *(_row(m) for m in data["members"])]
    if len({m["uid"] for m in data["members"]}) > 1:  # a team arena: whose each member is
        for row, user in zip(rows, ["USER", *(_user(m["uid"]) for m in data["members"])],
                             strict=True):  # fmt: skip
            row.insert(2, user)
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    names = max(len(printable(m.name, 16)) for m in report.members)
    lines.append(f"timeline (# resident, . waiting), {_seconds(data['seconds'])}:")
    for name, cells in timeline(report, max(10, width - names - 3)):
        lines.append(f"{printable(name, 16).ljust(names)} |{cells}|")
    return "\n".join(lines)


def _plot(report: Report, path: str) -> None:
    """The timeline as an image (SVG, PNG: by the file's suffix), through matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UsageError("--plot needs matplotlib: pip install matplotlib") from None
    fig, ax = plt.subplots(figsize=(10, 1 + 0.4 * max(1, len(report.members))))
    for s in report.segments:
        color = "tab:green" if s.kind == "resident" else "tab:orange"
        height = 0.8 if s.kind == "resident" else 0.3
        ax.barh(s.member, s.end - s.start, left=s.start - report.start, height=height,
                color=color)  # fmt: skip
    ax.set_yticks(range(len(report.members)), [m.name for m in report.members])
    ax.set_xlabel("seconds (green: resident, orange: waiting)")
    fig.tight_layout()
    try:
        fig.savefig(path)
    except (OSError, ValueError) as err:
        raise UsageError(f"--plot: cannot write {path!r}: {err}") from None
    finally:
        plt.close(fig)


def _metrics(opened: Arena, gpu: int | None, path: str) -> None:
    """``--prometheus PATH`` (``-``: standard output); ``gpu``: NVML's GPU, the arena's
    where known, else None (every)."""
    from ..observe.prometheus import NotRegular, metrics, write_textfile

    if path == "-":
        sys.stdout.write(metrics(opened, gpu))
        return
    try:
        write_textfile(path, metrics(opened, gpu))
    except NotRegular as err:
        raise UsageError(f"--prometheus: {err} (name a file, or - for standard output)") from None
    except OSError as err:
        raise UsageError(f"--prometheus: cannot write {path!r}: {err.strerror or err}") from None


def stats(
    arena: str | None,
    gpu: str | None,
    since: str | None,
    as_json: bool,
    plot: str | None,
    prometheus: str | None,
) -> None:
    """Show who had the GPU and for how long, waits, switch times and thrash, from the
    arena's journal."""
    from ..arena import journal
    from ..observe.stats import compute
    from .common import one_arena, parse_duration

    start = None if since is None else time.time() - parse_duration(since, "--since")
    opened, shown = one_arena(arena, gpu, "stats reads one arena; name one GPU")
    try:
        if prometheus is not None:
            _metrics(opened, shown, prometheus)
            return
        report = compute(journal.read(opened), start)  # earlier: who was busy then
        if plot is not None:
            _plot(report, plot)
        if as_json:
            print(json.dumps({"arena": opened.path, **report.as_json()}, indent=2,
                             allow_nan=False))  # fmt: skip
        else:
            print(_text(opened.path, report, shutil.get_terminal_size().columns))
        sys.stdout.flush()
    finally:
        opened.close()
