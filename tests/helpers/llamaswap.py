"""llama-swap's configuration test cases, as tables: a case is the YAML of one of its
tests and the verdict llama-swap reaches (a value read, or a refusal), or serve's own
verdict where it differs on purpose (``diverges``: why, also in docs/serve.md)."""

from __future__ import annotations

import textwrap
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from . import ROOT

PROXY = "    proxy: http://localhost:8080\n"

# Why serve's verdict differs, where it does (each also in docs/serve.md).
CHECK = "checkEndpoint is a path: serve checks the model where its proxy is"
ARENA = (
    "without routing rules serve lets the arena decide which models are resident"
    " together (llama-swap swaps them all)"
)
STORE = (
    "serve keeps its activity in memory: store is ignored with a warning, and its path"
    " is neither written nor checked"
)
COMPAT = (
    "a websocket through /upstream is a connection like any other: compat is ignored with a warning"
)


@dataclass(frozen=True)
class Case:
    """``text`` loads and ``probe`` of it is ``want`` (``refused``: it is refused with
    that fragment in its message). ``files``: other files, by name, beside it."""

    id: str
    text: str | dict[str, str]  # the file, or several by name (written by the test)
    probe: Callable[[Any], Any] | None = None
    want: Any = None
    refused: str = ""
    env: dict[str, str] = field(default_factory=dict)
    diverges: str = ""  # why serve's verdict is not llama-swap's ("": it is)


def ok(
    id: str, text: str | dict[str, str], probe: Callable[[Any], Any], want: Any, **kw: Any
) -> Any:
    return pytest.param(Case(id, text, probe, want, **kw), id=id)


def no(id: str, text: str | dict[str, str], refused: str, **kw: Any) -> Any:
    return pytest.param(Case(id, text, refused=refused, **kw), id=id)


def m(config: Any, name: str = "test") -> Any:
    return config.models[name]


def verdict(case: Case, load: Callable[[Path], Any], tmp_path: Path,
            monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """Check ``case``: its text written to a file, read by ``load``."""
    from vramlock.serve.config import ConfigError

    for name, value in case.env.items():
        monkeypatch.setenv(name, value)
    path = tmp_path / "config.yaml"
    if isinstance(case.text, str):
        path.write_text(textwrap.dedent(case.text))
    if case.refused:
        with pytest.raises(ConfigError) as err:
            load(path)
        assert case.refused in str(err.value)
        assert err.value.exit_status == 2
        return
    assert case.probe is not None
    assert case.probe(load(path)) == case.want


def named(cases: list[Any]) -> tuple[int, int]:
    """(cases, cases that diverge), each divergence's reason checked to be in
    docs/serve.md, under "Where serve differs from llama-swap"."""
    page = " ".join((ROOT / "docs/serve.md").read_text().split())
    part = page[page.index("Where serve differs from llama-swap") :]
    reasons = [p.values[0].diverges for p in cases if p.values[0].diverges]
    for reason in reasons:
        assert reason in part, reason
    return len(cases), len(reasons)
