"""``vramlock serve CONFIG``: llama-swap's YAML configuration, read into models.

What llama-swap's keys mean here:

- ``models.NAME``: ``cmd`` (required; lines starting with ``#`` dropped, then split as a
  shell would), ``proxy`` (``http://HOST:PORT[/PATH]``, no spaces or control characters;
  default ``http://localhost:${PORT}``, as in llama-swap, whether the command uses
  ``${PORT}`` or not), ``checkEndpoint`` (default ``/health``; ``none``; no spaces or
  control characters),
  ``ttl`` (seconds; 0 never, -1 ``globalTTL``), ``aliases`` (names, or objects of ``id``,
  ``name`` and ``unlisted``), ``env`` (``NAME=value``),
  ``unlisted``, ``name`` and ``description`` (shown by ``/v1/models``), ``macros``,
  ``concurrencyLimit``, ``useModelName``, ``filters``, ``metadata``, ``capabilities``,
  ``unloadTimeout`` and ``timeouts`` (``timeouts.py``), ``cmdStop`` (its release:
  ``vramlock run --release restart --on-release``; ``${PID}`` the cmd's pid);
- top level: ``models``, ``macros`` (``${NAME}``, ``${env.VAR}``, ``${PORT}``,
  ``${MODEL_ID}``), ``startPort`` (default 5800), ``healthCheckTimeout`` (default 120 s),
  ``globalTTL``, ``hooks.on_startup.preload`` (the models started with serve; any other
  starts on its first request), ``apiKeys``, ``includeAliasesInList``, ``logLevel``,
  ``unloadTimeout``, ``routing`` and the older ``groups`` and ``matrix`` (``routing.py``),
  ``logToStdout``, ``logTimeFormat`` (``logs``), ``sendLoadingState`` (also per model:
  ``loading``), ``upstream.ignorePaths``, ``peers`` (``peers``), ``selectors`` and
  ``profiles`` (``selectors``), ``metricsMaxInMemory`` and ``captureBuffer``
  (``activity``), ``performance.disabled`` and ``performance.every`` (``hardware``).

vramlock's own keys, per model: ``release``, ``preset``, ``min_hold``, ``yield_within``,
``vram``, ``gpu``, ``arena`` (``vramlock run``'s options of those names; absent: what
``run`` picks).

Keys that mean nothing under vramlock (``ui``, ``compat``, ...) are ignored with a
warning that says why; an unknown key is ignored with a warning. Anything else wrong is a
ConfigError: ``FILE:LINE: what is wrong`` (exit status 2).
"""

from __future__ import annotations

import math
import os
import re
import shlex
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any
from urllib.parse import urlsplit

import yaml

from ..arena.directory import parse_gpus
from ..errors import UsageError
from . import routing
from .logs import TIME_FORMATS, TO_STDOUT
from .timeouts import PEER_DEFAULTS, Timeouts, read_timeouts, read_unload_timeout

DEFAULT_START_PORT = 5800
DEFAULT_HEALTH_TIMEOUT = 120.0
DEFAULT_CHECK_ENDPOINT = "/health"
LOG_LEVELS = ("debug", "info", "warn", "error")
# logToStdout absent: serve's own lines only, as llama-swap's default; the models' output
# is in /logs/stream/upstream and /logs/stream/MODEL (a wrapper that exits unasked is
# said with its last lines of output).
DEFAULT_TO_STDOUT = "proxy"
DEFAULT_CONCURRENCY = 10  # llama-swap's, where concurrencyLimit is absent or 0
# The model that llama-swap's /comfyui/ reaches, and the concurrencyLimit it has at least
# (a ComfyUI page asks for many assets at once).
COMFYUI_MODEL = "comfyui_auto"
COMFYUI_CONCURRENCY = 50
# llama-swap's metricsMaxInMemory, captureBuffer (MB) and performance.every defaults, and
# the shortest performance.every it takes.
DEFAULT_KEEP = 1000
DEFAULT_CAPTURE_MB = 5
DEFAULT_EVERY = 5.0
MIN_EVERY = 5.0

_MACRO = re.compile(r"\$\{([^${}]*)\}")
_MACRO_NAME = re.compile(r"[A-Za-z0-9_-]{1,63}")
_RESERVED = frozenset({"PID", "PORT", "MODEL_ID"})
# What one value may expand to: macros that double each other must not exhaust memory.
MAX_EXPANDED = 1 << 20

# llama-swap's keys that have no meaning here, and why.
_NO_UI = "serve's /ui, /metrics and /logs have no settings of their own"

IGNORED_TOP = {
    "ui": _NO_UI,
    "store": "serve keeps its activity in memory (the last metricsMaxInMemory requests)",
}
IGNORED_MODEL = {
    "compat": "a websocket through /upstream is a connection like any other",
}
TOP_KEYS = frozenset(
    {"models", "macros", "startPort", "healthCheckTimeout", "globalTTL", "hooks", "apiKeys",
     "includeAliasesInList", "logLevel", "routing", "groups", "matrix", "unloadTimeout",
     "logToStdout", "logTimeFormat", "sendLoadingState", "upstream", "peers", "profiles",
     "selectors", "metricsMaxInMemory", "captureBuffer", "performance"}
)  # fmt: skip
MODEL_KEYS = frozenset(
    {"cmd", "proxy", "checkEndpoint", "ttl", "aliases", "env", "unlisted", "name",
     "description", "macros", "concurrencyLimit", "useModelName", "filters", "release",
     "preset", "min_hold", "yield_within", "vram", "gpu", "arena", "metadata", "capabilities",
     "unloadTimeout", "timeouts", "cmdStop", "sendLoadingState"}
)  # fmt: skip


class ConfigError(UsageError):
    """The configuration file cannot be used: ``FILE:LINE: what is wrong``."""

    def __init__(self, path: str, line: int | None, what: str) -> None:
        super().__init__(f"{path}:{line}: {what}" if line else f"{path}: {what}")
        self.path, self.line, self.what = path, line, what


@dataclass(frozen=True)
class Model:
    """One model as ``vramlock serve`` runs it."""

    name: str
    line: int  # where the file defines it
    command: list[str]
    upstream: str  # HOST:PORT of the model's server, for ``vramlock run --upstream``
    prefix: str  # the path the server's API is under ("": the root)
    check_endpoint: str | None  # None: "none", no check
    ttl: float  # 0: never released for being idle
    aliases: tuple[str, ...] = ()
    alias_names: dict[str, str] = field(default_factory=dict)  # an alias object's name
    unlisted_aliases: tuple[str, ...] = ()  # served, never told of (/v1/models, 404s)
    env: dict[str, str] = field(default_factory=dict)
    unlisted: bool = False
    title: str | None = None  # llama-swap's ``name``
    description: str | None = None
    release: str = "auto"
    preset: str | None = None
    run_options: tuple[str, ...] = ()  # vramlock run's options from the vramlock keys
    arena: str | None = None
    gpu: str | None = None
    concurrency: int = DEFAULT_CONCURRENCY  # requests at once; more get 429
    filters: Filters = field(default_factory=lambda: Filters())
    metadata: dict[str, Any] = field(default_factory=dict)  # shown by /v1/models
    capabilities: dict[str, Any] = field(default_factory=dict)  # shown by /v1/models
    unload_timeout: float | None = None  # unloadTimeout (None: the top level's)
    stop_command: str | None = None  # cmdStop, for sh -c (${PID}: $VRAMLOCK_CHILD_PID)
    timeouts: Timeouts = field(default_factory=Timeouts)
    loading_state: bool | None = (
        False  # sendLoadingState (None while being read): loading progress in a chat stream
    )

    def listed_aliases(self) -> list[str]:
        """The aliases /v1/models and a 404 may tell."""
        return [a for a in self.aliases if a not in self.unlisted_aliases]


@dataclass(frozen=True)
class Filters:
    """What is changed in a request's JSON body before its model gets it: llama-swap's
    useModelName and filters (``model`` itself is never stripped or set by them)."""

    model: str | None = None  # useModelName
    strip: tuple[str, ...] = ()  # stripParams
    set: dict[str, Any] = field(default_factory=dict)  # setParams
    by_name: dict[str, dict[str, Any]] = field(default_factory=dict)  # setParamsByID

    def __bool__(self) -> bool:
        return bool(self.model or self.strip or self.set or self.by_name)

    def apply(self, body: dict[str, Any], asked: str) -> dict[str, Any]:
        """``body`` as the model gets it, asked for by the name ``asked``."""
        out = {k: v for k, v in body.items() if k == "model" or k not in self.strip}
        for params in (self.set, self.by_name.get(asked, {})):
            out.update((k, v) for k, v in params.items() if k != "model")
        if self.model is not None:
            out["model"] = self.model
        return out


@dataclass(frozen=True)
class Peer:
    """llama-swap's ``peers.ID``: a remote OpenAI-compatible server, no process here."""

    name: str
    line: int
    base: str  # ``proxy``: the request's path is appended to it
    models: tuple[str, ...]
    api_key: str = ""  # sent as Authorization: Bearer and x-api-key ("": nothing)
    filters: Filters = field(default_factory=lambda: Filters())
    timeouts: Timeouts = PEER_DEFAULTS  # connect, responseHeader, tlsHandshake


@dataclass(frozen=True)
class Selector:
    """llama-swap's ``selectors.ID``: a name that picks one of its targets per request."""

    name: str
    line: int
    strategy: str  # warm, pin or spillover
    targets: tuple[str, ...]
    spillover: int = 1  # settings.spillover: requests per active target before the next
    title: str | None = None
    description: str | None = None
    unlisted: bool = False
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Profile:
    """llama-swap's ``profiles.ID``: names replaced while it is the active profile."""

    name: str
    description: str
    pins: dict[str, str | None]  # None (or ""): the name answers 404 meanwhile


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
    routing: routing.Routing = field(default_factory=routing.Routing)  # who is resident together
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

    def find(self, name: str) -> Model | None:
        """The model ``name`` names, directly or as an alias."""
        return _find(self.models, name)

    def known(self) -> list[str]:
        """The names a 404 may tell: listed models, then their aliases (an unlisted
        model is served, not told of)."""
        listed = [m for m in self.models.values() if not m.unlisted]
        return [*(m.name for m in listed), *(a for m in listed for a in m.listed_aliases())]


def _find(models: dict[str, Model], name: str) -> Model | None:
    found = models.get(name)
    if found is not None:
        return found
    return next((m for m in models.values() if name in m.aliases), None)


Duration = Callable[[str, str], float]


# The most values one value of the file may hold (metadata, setParams, a list...),
# each use of an alias counting again.
MAX_VALUES = 100_000


class _Reader:
    """Walks the YAML node tree, so that every error can name its line."""

    def __init__(self, path: str, duration: Duration) -> None:
        self.path = path
        self.duration = duration
        self.warnings: list[str] = []
        self._loader: Any = None

    def fail(self, node: yaml.Node | None, what: str) -> ConfigError:
        return ConfigError(self.path, None if node is None else node.start_mark.line + 1, what)

    def warn(self, node: yaml.Node, what: str) -> None:
        self.warnings.append(f"{self.path}:{node.start_mark.line + 1}: {what}")

    def check_keys(
        self,
        entries: dict[str, tuple[yaml.Node, yaml.Node]],
        known: frozenset[str],
        ignored: dict[str, str],
        where: str,
    ) -> None:
        """One warning for each key of ``entries`` (name -> (key node, value node)) that is
        llama-swap's but means nothing here (``ignored``: why), or that nobody knows."""
        for name, (key, _) in entries.items():
            if name in ignored:
                self.warn(key, f"{where}{name} ignored: {ignored[name]}")
            elif name not in known:
                self.warn(key, f"{where}unknown key {name} ignored")

    def root(self, text: str) -> yaml.MappingNode:
        try:
            self._loader = yaml.SafeLoader(text)
            node = self._loader.get_single_node()
        except yaml.MarkedYAMLError as err:
            mark = err.problem_mark or err.context_mark
            line = None if mark is None else mark.line + 1
            raise ConfigError(self.path, line, f"not valid YAML: {err.problem or err}") from None
        except yaml.YAMLError as err:
            raise ConfigError(self.path, None, f"not valid YAML: {err}") from None
        if not isinstance(node, yaml.MappingNode):
            raise self.fail(node, "the file must be a mapping with a models: key")
        return node

    def value(self, node: yaml.Node) -> Any:
        if not isinstance(node, yaml.ScalarNode):
            self._bounded(node)
        try:
            return self._loader.construct_object(node, deep=True)
        except yaml.YAMLError as err:
            raise self.fail(node, f"not valid YAML: {err}") from None

    def _bounded(self, node: yaml.Node) -> None:
        """Refuse a value of more than ``MAX_VALUES`` values, counted as they are used:
        YAML aliases make a few lines name billions (aliases of aliases), which would
        be walked, copied and listed each time."""
        left, stack = MAX_VALUES, [node]
        while stack:
            item = stack.pop()
            left -= 1
            if left < 0:
                raise self.fail(node, f"a value of more than {MAX_VALUES} values"
                                      " (aliases of aliases?)")  # fmt: skip
            if isinstance(item, yaml.SequenceNode):
                stack.extend(item.value)
            elif isinstance(item, yaml.MappingNode):
                stack.extend(v for pair in item.value for v in pair)

    def pairs(self, node: yaml.Node, what: str) -> list[tuple[str, yaml.Node, yaml.Node]]:
        if isinstance(node, yaml.ScalarNode) and node.tag == "tag:yaml.org,2002:null":
            return []  # a key left empty (its entries commented out): none, as llama-swap
        if not isinstance(node, yaml.MappingNode):
            raise self.fail(node, f"{what} must be a mapping")
        out, seen = [], set()
        for key, value in node.value:
            name = self.value(key)
            if not isinstance(name, str | int) or isinstance(name, bool):
                raise self.fail(key, f"{what}: a key must be a name")
            name = str(name)
            if name in seen:
                raise self.fail(key, f"{what}: {name!r} appears twice")
            seen.add(name)
            out.append((name, key, value))
        return out

    def text(self, node: yaml.Node, what: str) -> str:
        value = self.value(node)
        if not isinstance(value, str | int | float) or isinstance(value, bool):
            raise self.fail(node, f"{what} must be a string")
        return str(value)

    def number(self, node: yaml.Node, what: str, low: float) -> float:
        value = self.value(node)
        if (not isinstance(value, int | float) or isinstance(value, bool) or not value >= low
                or not math.isfinite(value)):  # fmt: skip
            raise self.fail(node, f"{what} must be a number of seconds, at least {low:g}")
        return float(value)

    def port(self, node: yaml.Node) -> int:
        value = self.value(node)
        if not isinstance(value, int) or isinstance(value, bool) or not 0 < value < 65536:
            raise self.fail(node, "startPort must be a port number (1-65535)")
        return value

    def flag(self, node: yaml.Node, what: str) -> bool:
        value = self.value(node)
        if not isinstance(value, bool):
            raise self.fail(node, f"{what} must be true or false")
        return value

    def strings(self, node: yaml.Node, what: str) -> list[str]:
        if not isinstance(node, yaml.SequenceNode):
            raise self.fail(node, f"{what} must be a list")
        return [self.text(item, what) for item in node.value]

    def seconds(self, node: yaml.Node, what: str) -> str:
        """A duration as ``vramlock run`` takes it (checked here): 2, 0.5, 250ms, 2m."""
        text = self.text(node, what)
        try:
            self.duration(text, what)
        except UsageError as err:
            raise self.fail(node, str(err)) from None
        return text

    def size(self, node: yaml.Node, what: str) -> str:
        """A memory size as ``vramlock run --vram`` takes it (checked here): 6G, 512M."""
        from ..arena.budget import parse_size

        text = self.text(node, what)
        try:
            parse_size(text, what)
        except UsageError as err:
            raise self.fail(node, str(err)) from None
        return text


class _Macros:
    """``${NAME}`` substitution: ``${env.VAR}`` from the environment, macros defined so
    far, and ``${PORT}``/``${MODEL_ID}`` left for the model to fill in."""

    def __init__(self, reader: _Reader, values: dict[str, str] | None = None) -> None:
        self.reader = reader
        self.values = dict(values or {})

    def define(self, node: yaml.Node) -> None:
        for name, key, value in self.reader.pairs(node, "macros"):
            if not _MACRO_NAME.fullmatch(name) or name in _RESERVED:
                raise self.reader.fail(
                    key,
                    f"macros: bad name {name!r} (letters, digits, _, -; not PID, PORT, MODEL_ID)",
                )
            raw = self.reader.value(value)
            if isinstance(raw, bool):
                raw = "true" if raw else "false"
            if not isinstance(raw, str | int | float):
                raise self.reader.fail(value, f"macros: {name} must be a string or a number")
            self.values[name] = self.expand(str(raw).strip(), value, f"macro {name}", pid=True)

    def expand(self, text: str, node: yaml.Node, where: str, *, pid: bool = False) -> str:
        """``text`` with its macros expanded, in one pass: what a macro or variable brings
        in is not expanded again. ``${PORT}`` and ``${MODEL_ID}`` are left as marks for
        ``fill``, and ``${PID}`` where ``pid`` allows it (cmdStop, and macros, checked
        where they are used). The result is at most ``MAX_EXPANDED`` characters."""
        if "\0" in text:
            raise self.reader.fail(node, f"{where}: a NUL character cannot be passed to a program")
        size = len(text)

        def one(m: re.Match[str]) -> str:
            nonlocal size
            value = self._value(m.group(1), node, where)
            size += len(value) - len(m.group(0))
            if size > MAX_EXPANDED:
                limit = f"{MAX_EXPANDED >> 20} MiB"
                raise self.reader.fail(node, f"{where}: its macros expand to more than {limit}")
            return value

        out = _MACRO.sub(one, text)
        if not pid and _mark("PID") in out:
            raise self.reader.fail(node, f"{where}: ${{PID}} is for cmdStop")
        return out

    def _value(self, name: str, node: yaml.Node, where: str) -> str:
        if name.startswith("env."):
            found = os.environ.get(name[4:])
            if found is None:
                raise self.reader.fail(node, f"{where}: ${{{name}}}: {name[4:]} is not set")
            return found
        if name in _RESERVED:
            return _mark(name)  # the model fills these in
        if name in self.values:
            return self.values[name]
        raise self.reader.fail(node, f"{where}: ${{{name}}} is not a defined macro")

    def fill_in(
        self, text: str, node: yaml.Node, where: str, model: dict[str, str], *, pid: bool = False
    ) -> str:
        """``text`` expanded, the model's ``${PORT}`` and ``${MODEL_ID}`` filled in."""
        return fill(self.expand(text, node, where, pid=pid), model)


def _mark(name: str) -> str:
    """Where ``${PORT}`` or ``${MODEL_ID}`` goes, until ``fill``: NUL is refused in the
    file's text and cannot be in the environment, so no value can look like it."""
    return f"\0{name}\0"


def fill(text: str, model: dict[str, str]) -> str:
    """``text`` (expanded) with the model's ``${PORT}`` and ``${MODEL_ID}`` filled in."""
    for name, value in model.items():
        text = text.replace(_mark(name), value)
    return text


def _words(text: str) -> list[str]:
    """Comment lines dropped, line continuations joined, split as a shell would (quotes,
    no expansion). ValueError: an unclosed quote."""
    lines = [ln for ln in text.replace("\\\n", " ").splitlines() if not ln.strip().startswith("#")]
    return shlex.split(" ".join(lines))


def _command(text: str) -> list[str]:
    """llama-swap's ``cmd``: its words (``_words``), none with a NUL character."""
    words = _words(text)
    if any("\0" in word for word in words):
        raise ValueError("a NUL character cannot be passed to a program")
    return words


def _plain_url(url: str) -> bool:
    """No spaces or control characters: nothing that could end a request line."""
    return url.isprintable() and not any(c.isspace() for c in url)


def _upstream(reader: _Reader, node: yaml.Node, url: str, where: str) -> tuple[str, str]:
    """(HOST:PORT, path prefix) from ``proxy: http://HOST:PORT[/PATH]``."""
    if not _plain_url(url):
        # urlsplit drops CR, LF and tabs, and the prefix goes into each request line.
        raise reader.fail(node, f"{where}: proxy must be an http://HOST:PORT URL, without"
                                f" spaces or control characters, not {url!r}")  # fmt: skip
    try:
        parts = urlsplit(url)
        port = parts.port or 80
    except ValueError as err:
        raise reader.fail(node, f"{where}: bad proxy URL {url!r}: {err}") from None
    if parts.scheme != "http" or not parts.hostname:
        raise reader.fail(node, f"{where}: proxy must be an http://HOST:PORT URL, not {url!r}")
    # llama-swap's default proxy says localhost; servers listen on 127.0.0.1 by default.
    host = "127.0.0.1" if parts.hostname == "localhost" else parts.hostname
    host = f"[{host}]" if ":" in host else host
    return f"{host}:{port}", parts.path.rstrip("/")


def load(path: str, duration: Duration) -> Config:
    """Read ``path``; ConfigError (exit 2) if it cannot be used. ``duration`` parses a
    duration as ``vramlock run`` does (the command line's parser)."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as err:
        reason = err.strerror if isinstance(err, OSError) else "not UTF-8 text"
        raise ConfigError(path, None, f"cannot read it: {reason}") from None
    reader = _Reader(path, duration)
    root = reader.root(text)
    top = {name: (key, value) for name, key, value in reader.pairs(root, "the file")}
    reader.check_keys(top, TOP_KEYS, IGNORED_TOP, "")
    if "models" not in top:
        raise reader.fail(root, "no models: key (the models to serve)")
    macros = _Macros(reader)
    if "macros" in top:
        macros.define(top["macros"][1])
    start_port = reader.port(top["startPort"][1]) if "startPort" in top else DEFAULT_START_PORT
    health = DEFAULT_HEALTH_TIMEOUT
    if "healthCheckTimeout" in top:
        health = reader.number(top["healthCheckTimeout"][1], "healthCheckTimeout", 1)
    global_ttl = reader.number(top["globalTTL"][1], "globalTTL", 0) if "globalTTL" in top else 0.0

    loading = "sendLoadingState" in top and reader.flag(
        top["sendLoadingState"][1], "sendLoadingState"
    )
    models = _models(reader, macros, top["models"][1], start_port, global_ttl, loading)
    rules = routing.read(reader, top, set(models))
    unload = None
    if "unloadTimeout" in top:
        unload = read_unload_timeout(reader, top["unloadTimeout"][1], "unloadTimeout")
    preload = _preload(reader, top["hooks"][1], models) if "hooks" in top else ()
    keys = _api_keys(reader, macros, top["apiKeys"][1]) if "apiKeys" in top else ()
    listed = "includeAliasesInList" in top and reader.flag(
        top["includeAliasesInList"][1], "includeAliasesInList"
    )
    level = "info"
    if "logLevel" in top:
        level = reader.text(top["logLevel"][1], "logLevel")
        if level not in LOG_LEVELS:
            raise reader.fail(
                top["logLevel"][1], f"logLevel must be one of {', '.join(LOG_LEVELS)}"
            )
    return Config(path=path, models=models, health_timeout=health, warnings=reader.warnings,
                  preload=preload, api_keys=keys, aliases_listed=listed,
                  log_level=level, routing=rules, unload_timeout=unload,
                  **_newer(reader, macros, top, models))  # fmt: skip


def _models(
    reader: _Reader,
    macros: _Macros,
    models_node: yaml.Node,
    start_port: int,
    global_ttl: float,
    loading: bool,
) -> dict[str, Model]:
    """The ``models:`` entries, each taking the next automatic port it uses."""
    models: dict[str, Model] = {}
    names: dict[str, int] = {}  # model names and aliases -> line, for clashes
    next_port = start_port
    entries = reader.pairs(models_node, "models")
    if not entries:
        raise reader.fail(models_node, "models: is empty")
    for name, key, node in entries:
        line = key.start_mark.line + 1
        if name in names:
            raise reader.fail(key, f"model {name!r} is already an alias (line {names[name]})")
        names[name] = line
        model, uses_port = _model(reader, macros, name, key, node, next_port, global_ttl)
        if model.loading_state is None:  # absent: the top level's
            model = replace(model, loading_state=loading)
        next_port += uses_port
        for alias in model.aliases:
            if alias in names:
                taken = f"alias {alias!r} is taken (line {names[alias]})"
                raise reader.fail(node, f"model {name!r}: {taken}")
            names[alias] = line
        models[name] = model
    return models


def _api_keys(reader: _Reader, macros: _Macros, node: yaml.Node) -> tuple[str, ...]:
    """``apiKeys``: each one non-empty, without spaces, its macros (``${env.VAR}``) expanded."""
    if not isinstance(node, yaml.SequenceNode):
        raise reader.fail(node, "apiKeys must be a list")
    keys = []
    for i, item in enumerate(node.value):
        key = macros.expand(reader.text(item, f"apiKeys[{i}]"), item, f"apiKeys[{i}]")
        if not key or not key.isprintable() or " " in key:
            raise reader.fail(item, f"apiKeys[{i}]: a key must be non-empty, without spaces")
        keys.append(key)
    return tuple(keys)


def _preload(reader: _Reader, node: yaml.Node, models: dict[str, Model]) -> tuple[str, ...]:
    """``hooks.on_startup.preload``: the models started with serve (names or aliases)."""
    hooks = {name: (key, value) for name, key, value in reader.pairs(node, "hooks")}
    reader.check_keys(hooks, frozenset({"on_startup"}), {}, "hooks: ")
    if "on_startup" not in hooks:
        return ()
    start = {n: (k, v) for n, k, v in reader.pairs(hooks["on_startup"][1], "hooks.on_startup")}
    reader.check_keys(start, frozenset({"preload"}), {}, "hooks.on_startup: ")
    if "preload" not in start:
        return ()
    out: list[str] = []
    preload = start["preload"][1]
    for name in reader.strings(preload, "hooks.on_startup.preload"):
        found = _find(models, name)
        if found is None:
            reader.warn(preload, f"hooks.on_startup.preload: no model {name!r}; not preloaded")
        elif found.name not in out:
            out.append(found.name)
    return tuple(out)


class _Entry:
    """One ``models:`` entry being read: its fields, its macros, where errors point."""

    def __init__(
        self, reader: _Reader, macros: _Macros, name: str, node: yaml.Node, port: int
    ) -> None:
        self.reader, self.name = reader, name
        self.where = f"model {name!r}"
        self.fields = {k: (kn, vn) for k, kn, vn in reader.pairs(node, self.where)}
        reader.check_keys(self.fields, MODEL_KEYS, IGNORED_MODEL, f"{self.where}: ")
        self.macros = _Macros(reader, macros.values)
        if "macros" in self.fields:
            self.macros.define(self.fields["macros"][1])
        self.filled = {"PORT": str(port), "MODEL_ID": name}

    def node(self, key: str) -> yaml.Node:
        return self.fields[key][1]

    def text(self, key: str) -> str | None:
        """The field ``key`` as a string, as written; None when absent."""
        return (
            self.reader.text(self.node(key), f"{self.where}: {key}") if key in self.fields else None
        )

    def marked(self, key: str, text: str) -> str:
        """``text`` (the field ``key``'s) with its macros expanded, ${PORT} and
        ${MODEL_ID} marked (see ``fill``)."""
        return self.macros.expand(text, self.node(key), f"{self.where}: {key}")

    def expanded(self, key: str, text: str) -> str:
        """``text`` (the field ``key``'s) with its macros expanded, ${PORT} and
        ${MODEL_ID} filled in."""
        return self.macros.fill_in(text, self.node(key), f"{self.where}: {key}", self.filled)

    def server(self, key: yaml.Node) -> tuple[list[str], str, str, bool]:
        """The command, its server's HOST:PORT and path prefix, and whether it takes the
        automatic port (llama-swap's default proxy does, as does a cmd with ${PORT})."""
        if "cmd" not in self.fields:
            raise self.reader.fail(
                key, f"{self.where}: no cmd (the command that starts its server)"
            )
        cmd_text = self.marked("cmd", self.text("cmd") or "")
        proxy = self.text("proxy")
        if proxy is None:
            proxy_text, proxy_node = f"http://localhost:{_mark('PORT')}", self.node("cmd")
        else:
            proxy_text, proxy_node = self.marked("proxy", proxy), self.node("proxy")
        uses_port = _mark("PORT") in cmd_text + proxy_text
        try:
            command = _command(fill(cmd_text, self.filled))
        except ValueError as err:
            raise self.reader.fail(self.node("cmd"), f"{self.where}: cmd: {err}") from None
        if not command:
            raise self.reader.fail(self.node("cmd"), f"{self.where}: cmd is empty")
        url = fill(proxy_text, self.filled)
        upstream, prefix = _upstream(self.reader, proxy_node, url, self.where)
        return command, upstream, prefix, uses_port

    def check_endpoint(self) -> str | None:
        """checkEndpoint: a path, or None for ``none``."""
        text = self.text("checkEndpoint")
        if text is None:
            return DEFAULT_CHECK_ENDPOINT
        check = self.expanded("checkEndpoint", text)
        if check == "none":
            return None
        if not check.startswith("/") or not check.isprintable() or " " in check:
            path = "/PATH (no spaces or control characters)"
            raise self.reader.fail(
                self.node("checkEndpoint"), f"{self.where}: checkEndpoint must be {path} or none"
            )
        return check

    def ttl(self, global_ttl: float) -> float:
        if "ttl" not in self.fields:
            return global_ttl
        ttl = self.reader.number(self.node("ttl"), f"{self.where}: ttl", -1)
        ttl = global_ttl if ttl == -1 else ttl
        if ttl < 0:
            raise self.reader.fail(
                self.node("ttl"), f"{self.where}: ttl must be 0 or more seconds, or -1"
            )
        return ttl

    def env(self) -> dict[str, str]:
        env: dict[str, str] = {}
        if "env" not in self.fields:
            return env
        for item in self.reader.strings(self.node("env"), f"{self.where}: env"):
            var, eq, value = item.partition("=")
            if not eq or not var or "\0" in item:
                raise self.reader.fail(
                    self.node("env"), f"{self.where}: env entry {item!r} is not NAME=value"
                )
            env[var] = self.expanded("env", value)
        return env

    def run_options(self) -> tuple[list[str], str | None, str | None]:
        """vramlock run's options from the vramlock keys, and the gpu and arena."""
        release, preset = self.release(), self.text("preset")
        run = ["--release", release] + (["--preset", preset] if preset is not None else [])
        for k, option in (("min_hold", "--min-hold"), ("yield_within", "--yield-within")):
            if k in self.fields:
                run += [option, self.reader.seconds(self.node(k), f"{self.where}: {k}")]
        if "vram" in self.fields:
            run += ["--vram", self.reader.size(self.node("vram"), f"{self.where}: vram")]
        gpu, arena = self.text("gpu"), self.text("arena")
        if gpu is not None and arena is not None:
            raise self.reader.fail(
                self.fields["arena"][0], f"{self.where}: give gpu or arena, not both"
            )
        if gpu is not None:
            try:
                parse_gpus(gpu, "gpu")
            except UsageError as err:
                raise self.reader.fail(self.node("gpu"), f"{self.where}: {err}") from None
            run += ["--gpu", gpu]
        if arena is not None:
            arena = os.path.abspath(os.path.join(os.path.dirname(self.reader.path), arena))
            run += ["--arena", arena]
        return run, gpu, arena

    def concurrency(self) -> int:
        """concurrencyLimit: more than 0, else llama-swap's default."""
        if "concurrencyLimit" not in self.fields:
            return DEFAULT_CONCURRENCY
        node = self.node("concurrencyLimit")
        value = self.reader.value(node)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise self.reader.fail(node, f"{self.where}: concurrencyLimit must be 0 or more")
        return value or DEFAULT_CONCURRENCY

    def filters(self) -> Filters:
        """useModelName and filters (stripParams, setParams, setParamsByID, whose names
        become aliases)."""
        model = self.text("useModelName")
        if "filters" not in self.fields:
            return Filters(model=model)
        where = f"{self.where}: filters"
        node = self.node("filters")
        return read_filters(self.reader, node, where, model, self._fill)

    def _fill(self, text: str, node: yaml.Node, where: str) -> str:
        return self.macros.fill_in(text, node, where, self.filled)

    def shown(self, key: str) -> dict[str, Any]:
        """metadata or capabilities: a mapping for /v1/models, macros expanded in its
        strings (one that is a macro alone takes its value's type: ``port: ${PORT}``
        stays a number)."""
        if key not in self.fields:
            return {}
        node = self.node(key)
        value = self._params(node, f"{self.where}: {key}")
        where = f"{self.where}: {key}"

        def walk(v: Any) -> Any:
            if isinstance(v, dict):
                return {k: walk(x) for k, x in v.items()}
            if isinstance(v, list):
                return [walk(x) for x in v]
            if not isinstance(v, str):
                return v
            text = self.macros.fill_in(v, node, where, self.filled)
            if not _MACRO.fullmatch(v) or not text:
                return text
            try:
                typed = yaml.safe_load(text)
            except yaml.YAMLError:
                return text
            return typed if isinstance(typed, int | float | bool) else text

        result: dict[str, Any] = walk(value)
        return result

    def _params(self, node: yaml.Node, where: str) -> dict[str, Any]:
        return _params(self.reader, node, where)

    def release(self) -> str:
        """The release strategy: a model with cmdStop is released by being stopped."""
        release = self.text("release")
        if "cmdStop" in self.fields and release not in (None, "restart"):
            raise self.reader.fail(self.node("release"), f"{self.where}: cmdStop stops the"
                                   " model to release it: release must be restart")  # fmt: skip
        return release or ("restart" if "cmdStop" in self.fields else "auto")

    def stop_command(self) -> str | None:
        """cmdStop as a line for ``sh -c``: its words as cmd's are split, macros filled
        in, each ${PID} the model's command's pid (``$VRAMLOCK_CHILD_PID``)."""
        text = self.text("cmdStop")
        if text is None:
            return None
        node, pid = self.node("cmdStop"), '"$VRAMLOCK_CHILD_PID"'
        try:
            where = f"{self.where}: cmdStop"
            line = self.macros.fill_in(text, node, where, self.filled, pid=True)
            words = [w.split(_mark("PID")) for w in _words(line)]
        except ValueError as err:
            raise self.reader.fail(node, f"{self.where}: cmdStop: {err}") from None
        if any("\0" in part for parts in words for part in parts):
            raise self.reader.fail(node, f"{self.where}: cmdStop: a NUL character cannot be"
                                         " passed to a program")  # fmt: skip
        if not words:
            raise self.reader.fail(node, f"{self.where}: cmdStop is empty")
        return " ".join(
            pid.join(shlex.quote(p) if p or len(parts) == 1 else "" for p in parts)
            for parts in words
        )

    def timeouts(self) -> dict[str, Any]:
        """unloadTimeout and timeouts, as Model's fields."""
        out: dict[str, Any] = {}
        if "unloadTimeout" in self.fields:
            what = f"{self.where}: unloadTimeout"
            out["unload_timeout"] = read_unload_timeout(
                self.reader, self.node("unloadTimeout"), what
            )
        if "timeouts" in self.fields:
            out["timeouts"] = read_timeouts(self.reader, self.node("timeouts"), self.where)
        return out

    def flag(self, key: str) -> bool:
        return key in self.fields and self.reader.flag(self.node(key), f"{self.where}: {key}")

    def aliases(self) -> tuple[list[str], dict[str, str], tuple[str, ...]]:
        """``aliases``: names, or objects of an ``id`` with a ``name`` and ``unlisted``
        (the form llama-swap has been proposed); the ids, the names, the unlisted."""
        ids: list[str] = []
        names: dict[str, str] = {}
        unlisted: list[str] = []
        if "aliases" not in self.fields:
            return ids, names, ()
        node = self.node("aliases")
        if not isinstance(node, yaml.SequenceNode):
            raise self.reader.fail(node, f"{self.where}: aliases must be a list")
        for i, item in enumerate(node.value):
            where = f"{self.where}: aliases[{i}]"
            if isinstance(item, yaml.ScalarNode):
                ids.append(self.reader.text(item, where))
                continue
            if not isinstance(item, yaml.MappingNode):
                raise self.reader.fail(item, f"{where} must be a name or a mapping with an id")
            f = {n: (k, v) for n, k, v in self.reader.pairs(item, where)}
            self.reader.check_keys(f, frozenset({"id", "name", "unlisted"}), {}, f"{where}: ")
            if "id" not in f:
                raise self.reader.fail(item, f"{where}: an alias object needs an id")
            alias = self.reader.text(f["id"][1], f"{where}: id")
            ids.append(alias)
            if "name" in f:
                names[alias] = self.reader.text(f["name"][1], f"{where}: name")
            if "unlisted" in f and self.reader.flag(f["unlisted"][1], f"{where}: unlisted"):
                unlisted.append(alias)
        return ids, names, tuple(unlisted)


def _model(
    reader: _Reader,
    global_macros: _Macros,
    name: str,
    key: yaml.Node,
    node: yaml.Node,
    port: int,
    global_ttl: float,
) -> tuple[Model, bool]:
    """One ``models:`` entry, and whether it took the automatic port ``port``."""
    entry = _Entry(reader, global_macros, name, node, port)
    command, upstream, prefix, uses_port = entry.server(key)
    check, ttl, env = entry.check_endpoint(), entry.ttl(global_ttl), entry.env()
    run, gpu, arena = entry.run_options()
    filters = entry.filters()
    aliases, alias_names, unlisted = entry.aliases()
    model = Model(
        name=name,
        line=key.start_mark.line + 1,
        command=command,
        upstream=upstream,
        prefix=prefix,
        check_endpoint=check,
        ttl=ttl,
        aliases=(*aliases, *(n for n in filters.by_name if n != name)),
        alias_names=alias_names,
        unlisted_aliases=unlisted,
        env=env,
        unlisted=entry.flag("unlisted"),
        title=entry.text("name"),
        description=entry.text("description"),
        release=entry.release(),
        stop_command=entry.stop_command(),
        preset=entry.text("preset"),
        run_options=tuple(run),
        arena=arena,
        gpu=gpu,
        concurrency=max(entry.concurrency(), COMFYUI_CONCURRENCY if name == COMFYUI_MODEL else 0),
        filters=filters,
        metadata=entry.shown("metadata"),
        capabilities=entry.shown("capabilities"),
        **entry.timeouts(),
        loading_state=entry.flag("sendLoadingState")
        if "sendLoadingState" in entry.fields
        else None,
    )
    return model, uses_port


def _params(reader: _Reader, node: yaml.Node, where: str) -> dict[str, Any]:
    value = reader.value(node)
    if not isinstance(value, dict):
        raise reader.fail(node, f"{where}: parameters must be a mapping")
    return value


def read_filters(
    reader: _Reader,
    node: yaml.Node,
    where: str,
    model: str | None,
    fill: Callable[[str, yaml.Node, str], str],
) -> Filters:
    """``filters``: stripParams, setParams, setParamsByID (its names through ``fill``)."""
    entries = {n: (k, v) for n, k, v in reader.pairs(node, where)}
    known = frozenset({"stripParams", "setParams", "setParamsByID"})
    reader.check_keys(entries, known, {}, f"{where}: ")
    strip: tuple[str, ...] = ()
    if "stripParams" in entries:
        text = reader.text(entries["stripParams"][1], f"{where}: stripParams")
        strip = tuple(p.strip() for p in text.split(",") if p.strip())
    params = _params(reader, entries["setParams"][1], where) if "setParams" in entries else {}
    by_name = {}
    if "setParamsByID" in entries:
        by_id = entries["setParamsByID"][1]
        for name, key, value in reader.pairs(by_id, f"{where}: setParamsByID"):
            by_name[fill(name, key, where)] = _params(reader, value, where)
    return Filters(model=model, strip=strip, set=params, by_name=by_name)


# upstream.ignorePaths when it is absent or empty (llama-swap's): static files.
DEFAULT_IGNORE_PATHS = (r".*\.(js|json|css|png|gif|jpg|jpeg|ico|txt)$",)


def _newer(
    reader: _Reader, macros: _Macros, top: dict[str, tuple[yaml.Node, yaml.Node]],
    models: dict[str, Model],
) -> dict[str, Any]:  # fmt: skip
    """The Config fields of logToStdout, logTimeFormat, upstream and peers."""
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
    patterns: list[str] = []
    if "upstream" in top:
        ups = {n: (k, v) for n, k, v in reader.pairs(top["upstream"][1], "upstream")}
        reader.check_keys(ups, frozenset({"ignorePaths"}), {}, "upstream: ")
        if "ignorePaths" in ups:
            patterns = reader.strings(ups["ignorePaths"][1], "upstream.ignorePaths")
            node = ups["ignorePaths"][1]
    compiled = []
    for pattern in patterns or DEFAULT_IGNORE_PATHS:
        try:
            compiled.append(re.compile(pattern))
        except re.error as err:
            what = f"upstream.ignorePaths: invalid regular expression {pattern!r}: {err}"
            raise reader.fail(node, what) from None
    out["ignore_paths"] = tuple(compiled)
    if "peers" in top:
        out["peers"] = _peers(reader, macros, top["peers"][1], models)
    known = set(models) | {a for m in models.values() for a in m.aliases}
    known |= {f"{p.name}/{m}" for p in out.get("peers", {}).values() for m in p.models}
    bare = [m for p in out.get("peers", {}).values() for m in p.models]
    known |= {m for m in bare if bare.count(m) == 1}
    if "selectors" in top:
        out["selectors"] = _selectors(reader, top["selectors"][1], models, known)
    if "profiles" in top:
        targets = known | set(out.get("selectors", {}))
        out["profiles"] = _profiles(reader, top["profiles"][1], targets)
    out.update(_observed(reader, top))
    return out


def _whole(reader: _Reader, node: yaml.Node, what: str) -> int:
    value = reader.value(node)
    if not isinstance(value, int) or isinstance(value, bool):
        raise reader.fail(node, f"{what} must be a whole number")
    return value


# A Go duration, as llama-swap's performance.every takes one: 15s, 1m30s, 500ms.
_GO_DURATION = re.compile(r"((?:\d+(?:\.\d*)?|\.\d+)(?:ns|us|µs|ms|s|m|h))+")
_GO_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def _go_duration(text: str) -> float | None:
    text = text.strip()
    if not _GO_DURATION.fullmatch(text):
        return None
    parts = re.findall(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)", text)
    return sum(float(n) * _GO_UNITS[unit] for n, unit in parts)


def _observed(reader: _Reader, top: dict[str, tuple[yaml.Node, yaml.Node]]) -> dict[str, Any]:
    """The Config fields of metricsMaxInMemory, captureBuffer and performance."""
    out: dict[str, Any] = {}
    if "metricsMaxInMemory" in top:
        kept = _whole(reader, top["metricsMaxInMemory"][1], "metricsMaxInMemory")
        out["activity_kept"] = kept if kept > 0 else DEFAULT_KEEP  # as llama-swap's
    if "captureBuffer" in top:
        out["capture_mb"] = max(_whole(reader, top["captureBuffer"][1], "captureBuffer"), 0)
    if "performance" in top:
        perf = {n: (k, v) for n, k, v in reader.pairs(top["performance"][1], "performance")}
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


STRATEGIES = ("warm", "pin", "spillover")


def _selectors(
    reader: _Reader, node: yaml.Node, models: dict[str, Model], known: set[str]
) -> dict[str, Selector]:
    """``selectors``: each a new name (no model, alias or peer model has it), its
    strategy, its targets (known names; local models for warm; no selectors)."""
    names = {n for n, _, _ in reader.pairs(node, "selectors")}
    out: dict[str, Selector] = {}
    for name, key, value in reader.pairs(node, "selectors"):
        where = f"selectors.{name}"
        if name in known:
            raise reader.fail(key, f"{where}: a model, alias or peer model is named so")
        f = {n: (k, v) for n, k, v in reader.pairs(value, where)}
        reader.check_keys(f, frozenset({"strategy", "targets", "settings", "name",
                          "description", "unlisted", "metadata"}), {}, f"{where}: ")  # fmt: skip
        strategy = reader.text(f["strategy"][1], f"{where}.strategy") if "strategy" in f else ""
        if strategy not in STRATEGIES:
            what = "is required" if not strategy else f"{strategy!r} is not warm, pin or spillover"
            raise reader.fail(f.get("strategy", (key, key))[1], f"{where}.strategy {what}")
        tnode = f["targets"][1] if "targets" in f else key
        listed = reader.strings(tnode, f"{where}.targets") if "targets" in f else []
        if not listed:
            raise reader.fail(tnode, f"{where}.targets must have at least one entry")
        targets = []
        for i, target in enumerate(listed):
            if target in names:
                raise reader.fail(tnode, f"{where}.targets[{i}]: {target!r} is a selector")
            if target not in known:
                # As a group's member that is no model (llama-swap's own example has
                # such targets): left out, said once.
                reader.warn(tnode, f"{where}.targets[{i}]: no model {target!r}: left out")
                continue
            if strategy == "warm" and _find(models, target) is None:
                raise reader.fail(tnode, f"{where}.targets[{i}]: warm picks local models only")
            targets.append(target)
        if not targets:
            reader.warn(tnode, f"{where}: none of its targets is a model: left out")
            continue
        resolved = [(m.name if (m := _find(models, t)) else t) for t in targets]
        twice = next((t for i, t in enumerate(resolved) if t in resolved[:i]), None)
        if strategy == "spillover" and twice is not None:
            raise reader.fail(tnode, f"{where}.targets: {twice!r} is there twice")
        spill = 1
        if "settings" in f:
            settings = {n: (k, v) for n, k, v in reader.pairs(f["settings"][1], where)}
            if "spillover" in settings:
                spill = int(reader.number(settings["spillover"][1], f"{where}.spillover", 1))
        out[name] = Selector(name, key.start_mark.line + 1, strategy, tuple(targets), spill,
            reader.text(f["name"][1], where) if "name" in f else None,
            reader.text(f["description"][1], where) if "description" in f else None,
            "unlisted" in f and reader.flag(f["unlisted"][1], f"{where}.unlisted"),
            _params(reader, f["metadata"][1], where) if "metadata" in f else {})  # fmt: skip
    return out


def _profiles(reader: _Reader, node: yaml.Node, known: set[str]) -> dict[str, Profile]:
    """``profiles``: each a mapping of description and pins (name: target, or null)."""
    out: dict[str, Profile] = {}
    for name, key, value in reader.pairs(node, "profiles"):
        where = f"profiles.{name}"
        if isinstance(value, yaml.SequenceNode):  # llama-swap refuses it too
            raise reader.fail(value, f"{where}: a list of models is llama-swap's old profile,"
                              " which it no longer takes either: for models resident"
                              " together, use a group with swap: false; a profile is a"
                              " mapping of description and pins")  # fmt: skip
        if not isinstance(value, yaml.MappingNode):
            raise reader.fail(value, f"{where}: a profile is a mapping of description and pins")
        f = {n: (k, v) for n, k, v in reader.pairs(value, where)}
        reader.check_keys(f, frozenset({"description", "pins"}), {}, f"{where}: ")
        pins: dict[str, str | None] = {}
        pnode = f["pins"][1] if "pins" in f else key
        for pin, _, target in reader.pairs(pnode, f"{where}.pins") if "pins" in f else []:
            text = None if reader.value(target) is None else reader.text(target, where)
            if text and text not in known:
                # The pin stays, answering 404 as a null one does: what it would have
                # named is not there (llama-swap's own example pins such names).
                reader.warn(target, f"{where}.pins.{pin}: no model {text!r}: it answers 404")
                text = None
            pins[pin] = text or None
        if not pins:
            raise reader.fail(pnode, f"{where}.pins must have at least one entry")
        text = reader.text(f["description"][1], where) if "description" in f else ""
        out[name] = Profile(name, text, pins)
    return out


def _peers(
    reader: _Reader, macros: _Macros, node: yaml.Node, models: dict[str, Model]
) -> dict[str, Peer]:
    """``peers``: each with proxy (an http(s) URL) and models (not empty), apiKey and
    filters; a PEER/MODEL name that a local model or alias has is refused."""
    peers: dict[str, Peer] = {}
    for name, key, value in reader.pairs(node, "peers"):
        where = f"peer {name!r}"
        fields = {n: (k, v) for n, k, v in reader.pairs(value, where)}
        known = frozenset({"proxy", "models", "apiKey", "filters", "timeouts"})
        reader.check_keys(fields, known, {}, f"{where}: ")
        if "proxy" not in fields:
            raise reader.fail(key, f"{where}: proxy is required")
        pnode = fields["proxy"][1]
        base = macros.expand(reader.text(pnode, f"{where}: proxy"), pnode, f"{where}: proxy")
        parts = urlsplit(base)
        if parts.scheme not in ("http", "https") or not parts.netloc or not _plain_url(base):
            raise reader.fail(pnode, f"{where}: proxy must be an http(s)://HOST[:PORT] URL,"
                                     " without spaces or control characters")  # fmt: skip
        listed = (
            reader.strings(fields["models"][1], f"{where}: models") if "models" in fields else []
        )
        if not listed:
            raise reader.fail(key, f"{where}: models must not be empty")
        for model in listed:
            if _find(models, f"{name}/{model}") is not None:
                what = f"{where}: {name}/{model} is already a local model's name or alias"
                raise reader.fail(fields["models"][1], what)
        api_key = ""
        if "apiKey" in fields:
            knode = fields["apiKey"][1]
            api_key = macros.expand(reader.text(knode, f"{where}: apiKey"), knode, where)
        filters = Filters()
        if "filters" in fields:
            fnode = fields["filters"][1]
            filters = read_filters(reader, fnode, f"{where}: filters", None, macros.expand)
        bounds = PEER_DEFAULTS
        if "timeouts" in fields:
            bounds = read_timeouts(reader, fields["timeouts"][1], where, peer=True)
        peers[name] = Peer(name, key.start_mark.line + 1, base.rstrip("/"),
                           tuple(dict.fromkeys(listed)), api_key, filters, bounds)  # fmt: skip
    return peers
