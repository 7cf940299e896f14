"""The file's top level: the Config it is read into, its keys, and ``load``."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import yaml

from ..logs import TIME_FORMATS, TO_STDOUT
from ..routing import Routing
from . import routing
from .macros import expand_file, parse
from .merge import merged_root
from .models import Model, find, read_models
from .peers import Peer, read_peers
from .reader import Duration, Reader, read_config_text
from .selectors import Names, Profile, Selector, read_profiles, read_selectors
from .timeouts import read_unload_timeout

DEFAULT_START_PORT = 5800
DEFAULT_HEALTH_TIMEOUT = 120.0
LOG_LEVELS = ("debug", "info", "warn", "error")
# logToStdout absent: serve's own lines only, as llama-swap's default; the models' output
# is in /logs/stream/upstream and /logs/stream/MODEL (a wrapper that exits unasked is
# said with its last lines of output).
DEFAULT_TO_STDOUT = "proxy"
# llama-swap's metricsMaxInMemory, captureBuffer (MB) and performance.every defaults, and
# the shortest performance.every it takes.
DEFAULT_KEEP = 1000
DEFAULT_CAPTURE_MB = 5
DEFAULT_EVERY = 5.0
MIN_EVERY = 5.0
# upstream.ignorePaths when it is absent or empty (llama-swap's): static files.
DEFAULT_IGNORE_PATHS = (r".*\.(js|json|css|png|gif|jpg|jpeg|ico|txt)$",)

# The request headers that name a client's session in the activity (llama-swap's
# ui.activity.session_id, which /api/events tells the page as its uiConfig).
DEFAULT_SESSION_HEADERS = ("X-Session-ID", "X-Litellm-Session-Id")

# llama-swap's keys that have no meaning here, and why.
IGNORED_TOP = {
    "store": "serve keeps its activity in memory (the last metricsMaxInMemory requests)",
}
TOP_KEYS = frozenset(
    {"models", "macros", "startPort", "healthCheckTimeout", "globalTTL", "hooks", "apiKeys",
     "includeAliasesInList", "logLevel", "routing", "groups", "matrix", "unloadTimeout",
     "logToStdout", "logTimeFormat", "sendLoadingState", "upstream", "peers", "profiles",
     "selectors", "metricsMaxInMemory", "captureBuffer", "performance", "ui"}
)  # fmt: skip

Top = dict[str, tuple[yaml.Node, yaml.Node]]


@dataclass(frozen=True)
class Config:
    path: str
    models: dict[str, Model]
    health_timeout: float
    warnings: list[str]
    preload: tuple[str, ...] = ()  # models started with serve; others on their first request
    api_keys: tuple[str, ...] = ()  # a request must carry one of them (none: no check)
    aliases_listed: bool = False  # includeAliasesInList: /v1/models has an entry per alias
    log_level: str = "info"  # logLevel: info and debug say each request and start
    routing: Routing = field(default_factory=Routing)  # who is resident together
    unload_timeout: float | None = None  # unloadTimeout (None: healthCheckTimeout, no hard stop)
    log_to_stdout: str = DEFAULT_TO_STDOUT  # logToStdout: which logs reach serve's output
    log_time_format: str | None = None  # logTimeFormat, as a strftime format
    ignore_paths: tuple[re.Pattern[str], ...] = ()  # upstream.ignorePaths
    peers: dict[str, Peer] = field(default_factory=dict)
    selectors: dict[str, Selector] = field(default_factory=dict)
    profiles: dict[str, Profile] = field(default_factory=dict)
    activity_kept: int = DEFAULT_KEEP  # metricsMaxInMemory: requests kept for /api/metrics
    capture_mb: int = DEFAULT_CAPTURE_MB  # captureBuffer: MB of captures (0: none)
    performance_every: float | None = DEFAULT_EVERY  # performance.every (None: disabled)
    session_headers: tuple[str, ...] = DEFAULT_SESSION_HEADERS  # ui.activity.session_id

    def find(self, name: str) -> Model | None:
        """The model ``name`` names, directly or as an alias."""
        return find(self.models, name)

    def known(self) -> list[str]:
        """The names a 404 may tell: listed models, then their aliases (an unlisted
        model is served, not told of)."""
        listed = [m for m in self.models.values() if not m.unlisted]
        return [*(m.name for m in listed), *(a for m in listed for a in m.listed_aliases())]


def load(path: str | None, duration: Duration, config_dir: str | None = None) -> Config:
    """Read the file ``path``, and (``config_dir``) the ``*.yaml`` and ``*.yml`` files of
    that directory merged in, as llama-swap's ``-config-dir``; ConfigError (exit 2) if
    they cannot be used. ``duration`` parses a duration as ``vramlock run`` does."""
    shown = path if path is not None else str(config_dir)
    reader = Reader(shown, duration)
    if config_dir is None:
        root = parse(reader, read_config_text(shown))
    else:
        root = merged_root(reader, path, config_dir)
    ports = expand_file(reader, root, TOP_KEYS | frozenset(IGNORED_TOP), DEFAULT_START_PORT)
    top = reader.entries(root, "the file")
    reader.check_keys(top, TOP_KEYS, IGNORED_TOP, "")
    health = DEFAULT_HEALTH_TIMEOUT
    if "healthCheckTimeout" in top:
        health = reader.number(top["healthCheckTimeout"][1], "healthCheckTimeout", 1)
    global_ttl = reader.number(top["globalTTL"][1], "globalTTL", 0) if "globalTTL" in top else 0.0
    loading = "sendLoadingState" in top and reader.flag(
        top["sendLoadingState"][1], "sendLoadingState"
    )
    models: dict[str, Model] = {}
    if "models" in top:
        models = read_models(reader, top["models"][1], ports, global_ttl, loading)
    if not models and "peers" not in top:
        reader.warn(top["models"][0] if "models" in top else root, "no models (models:)")
    unload = None
    if "unloadTimeout" in top:
        unload = read_unload_timeout(reader, top["unloadTimeout"][1], "unloadTimeout")
    aliases = {a: m.name for m in models.values() for a in m.aliases}
    rules = routing.read(reader, top, set(models), aliases)
    return Config(path=shown, models=models, health_timeout=health, warnings=reader.warnings,
                  routing=rules, unload_timeout=unload, **_access(reader, top, models),
                  **_newer(reader, top, models, rules))  # fmt: skip


def _access(reader: Reader, top: Top, models: dict[str, Model]) -> dict[str, Any]:
    """The Config fields of hooks, apiKeys, includeAliasesInList and logLevel."""
    out: dict[str, Any] = {}
    if "hooks" in top:
        out["preload"] = _preload(reader, top["hooks"][1], models)
    if "apiKeys" in top:
        out["api_keys"] = _api_keys(reader, top["apiKeys"][1])
    if "includeAliasesInList" in top:
        node = top["includeAliasesInList"][1]
        out["aliases_listed"] = reader.flag(node, "includeAliasesInList")
    if "logLevel" in top:
        node = top["logLevel"][1]
        out["log_level"] = reader.text(node, "logLevel")
        if out["log_level"] not in LOG_LEVELS:
            raise reader.fail(node, f"logLevel must be one of {', '.join(LOG_LEVELS)}")
    return out


def _api_keys(reader: Reader, node: yaml.Node) -> tuple[str, ...]:
    """``apiKeys``: each one non-empty, without spaces."""
    if not isinstance(node, yaml.SequenceNode):
        raise reader.fail(node, "apiKeys must be a list")
    keys = []
    for i, item in enumerate(node.value):
        key = reader.text(item, f"apiKeys[{i}]")
        if not key or not key.isprintable() or " " in key:
            raise reader.fail(item, f"apiKeys[{i}]: a key must be non-empty, without spaces")
        keys.append(key)
    return tuple(keys)


def _preload(reader: Reader, node: yaml.Node, models: dict[str, Model]) -> tuple[str, ...]:
    """``hooks.on_startup.preload``: the models started with serve (names or aliases)."""
    hooks = reader.entries(node, "hooks")
    reader.check_keys(hooks, frozenset({"on_startup"}), {}, "hooks: ")
    if "on_startup" not in hooks:
        return ()
    start = reader.entries(hooks["on_startup"][1], "hooks.on_startup")
    reader.check_keys(start, frozenset({"preload"}), {}, "hooks.on_startup: ")
    if "preload" not in start:
        return ()
    out: list[str] = []
    preload = start["preload"][1]
    for name in reader.strings(preload, "hooks.on_startup.preload"):
        if not name.strip():
            continue  # as llama-swap
        found = find(models, name.strip())
        if found is None:
            reader.warn(preload, f"hooks.on_startup.preload: no model {name!r}; not preloaded")
        elif found.name not in out:
            out.append(found.name)
    return tuple(out)


def _newer(reader: Reader, top: Top, models: dict[str, Model], rules: Routing) -> dict[str, Any]:
    """The Config fields of logToStdout, logTimeFormat, upstream, peers, selectors,
    profiles, metricsMaxInMemory, captureBuffer and performance."""
    out: dict[str, Any] = {"log_to_stdout": DEFAULT_TO_STDOUT}
    if "logToStdout" in top:
        node = top["logToStdout"][1]
        out["log_to_stdout"] = reader.text(node, "logToStdout")
        if out["log_to_stdout"] not in TO_STDOUT:
            raise reader.fail(node, f"logToStdout must be one of {', '.join(TO_STDOUT)}")
    if "logTimeFormat" in top:
        node = top["logTimeFormat"][1]
        name = reader.text(node, "logTimeFormat").strip().lower()
        if name and name not in TIME_FORMATS:
            raise reader.fail(node, f"logTimeFormat must be one of {', '.join(TIME_FORMATS)}")
        out["log_time_format"] = TIME_FORMATS.get(name)
    out["ignore_paths"] = _ignore_paths(reader, top)
    peers = read_peers(reader, top["peers"][1], models) if "peers" in top else {}
    out["peers"] = peers
    names = Names(models, peers)
    if "selectors" in top:
        out["selectors"] = read_selectors(reader, top["selectors"][1], names, rules)
    if "profiles" in top:
        known = names.local | set(names.full) | set(names.bare) | set(out.get("selectors", {}))
        out["profiles"] = read_profiles(reader, top["profiles"][1], known, set(names.full))
    out.update(_observed(reader, top))
    if "ui" in top:
        out["session_headers"] = _session_headers(reader, top["ui"][1])
    return out


def _session_headers(reader: Reader, node: yaml.Node) -> tuple[str, ...]:
    """``ui.activity.session_id``: header names, trimmed, the empty and the repeated
    (in any case) left out, as llama-swap reads them."""
    ui = reader.entries(node, "ui")
    reader.check_keys(ui, frozenset({"activity"}), {}, "ui: ")
    activity = reader.entries(ui["activity"][1], "ui.activity") if "activity" in ui else {}
    reader.check_keys(activity, frozenset({"session_id"}), {}, "ui.activity: ")
    if "session_id" not in activity:
        return DEFAULT_SESSION_HEADERS
    names = reader.strings(activity["session_id"][1], "ui.activity.session_id")
    found: dict[str, str] = {}
    for name in (n.strip() for n in names):
        if name and name.lower() not in found:
            found[name.lower()] = name
    return tuple(found.values())


def _ignore_paths(reader: Reader, top: Top) -> tuple[re.Pattern[str], ...]:
    """``upstream.ignorePaths``: regular expressions (absent or empty: the default)."""
    patterns: list[str] = []
    node: yaml.Node | None = None
    if "upstream" in top:
        ups = reader.entries(top["upstream"][1], "upstream")
        reader.check_keys(ups, frozenset({"ignorePaths"}), {}, "upstream: ")
        if "ignorePaths" in ups:
            node = ups["ignorePaths"][1]
            patterns = reader.strings(node, "upstream.ignorePaths")
    compiled = []
    for pattern in patterns or DEFAULT_IGNORE_PATHS:
        try:
            compiled.append(re.compile(pattern))
        except re.error as err:
            what = f"upstream.ignorePaths: invalid regular expression {pattern!r}: {err}"
            raise reader.fail(node, what) from None
    return tuple(compiled)


# A Go duration, as llama-swap's performance.every takes one: 15s, 1m30s, 500ms.
_GO_DURATION = re.compile(r"((?:\d+(?:\.\d*)?|\.\d+)(?:ns|us|µs|ms|s|m|h))+")
_GO_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def _go_duration(text: str) -> float | None:
    text = text.strip()
    if not _GO_DURATION.fullmatch(text):
        return None
    parts = re.findall(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)", text)
    return sum(float(n) * _GO_UNITS[unit] for n, unit in parts)


def _observed(reader: Reader, top: Top) -> dict[str, Any]:
    """The Config fields of metricsMaxInMemory, captureBuffer and performance."""
    out: dict[str, Any] = {}
    if "metricsMaxInMemory" in top:
        kept = reader.whole(top["metricsMaxInMemory"][1], "metricsMaxInMemory")
        out["activity_kept"] = kept if kept > 0 else DEFAULT_KEEP  # as llama-swap's
    if "captureBuffer" in top:
        out["capture_mb"] = max(reader.whole(top["captureBuffer"][1], "captureBuffer"), 0)
    if "performance" in top:
        perf = reader.entries(top["performance"][1], "performance")
        reader.check_keys(perf, frozenset({"disabled", "every"}), {}, "performance: ")
        every = DEFAULT_EVERY
        if "every" in perf:
            node = perf["every"][1]
            found = _go_duration(reader.text(node, "performance.every"))
            if found is None or found < MIN_EVERY:
                raise reader.fail(node, "performance.every must be a duration of at least"
                                        f" {MIN_EVERY:g}s (15s, 1m30s)")  # fmt: skip
            every = found
        disabled = "disabled" in perf and reader.flag(perf["disabled"][1], "performance.disabled")
        out["performance_every"] = None if disabled else every
    return out
