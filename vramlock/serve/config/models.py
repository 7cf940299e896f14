"""``models:``: each entry read into a Model (its macros already expanded: ``macros``)."""

from __future__ import annotations

import os
import shlex
from dataclasses import dataclass, field, replace
from typing import Any
from urllib.parse import urlsplit

import yaml

from ...arena.directory import parse_gpus
from ...errors import UsageError
from ..timeouts import Timeouts
from .filters import Filters, read_filters
from .reader import ConfigError, Reader
from .timeouts import read_timeouts, read_unload_timeout

DEFAULT_CHECK_ENDPOINT = "/health"
DEFAULT_CONCURRENCY = 10  # llama-swap's, where concurrencyLimit is absent or 0
# The model that llama-swap's /comfyui/ reaches, and the concurrencyLimit it has at least
# (a ComfyUI page asks for many assets at once).
COMFYUI_MODEL = "comfyui_auto"
COMFYUI_CONCURRENCY = 50
# capabilities.in and .out: llama-swap's modalities.
MODALITIES = ("text", "audio", "image")
PID = "${PID}"

IGNORED_MODEL = {
    "compat": "a websocket through /upstream is a connection like any other",
}
MODEL_KEYS = frozenset(
    {"cmd", "proxy", "checkEndpoint", "ttl", "aliases", "env", "unlisted", "name",
     "description", "macros", "concurrencyLimit", "useModelName", "filters", "release",
     "preset", "min_hold", "yield_within", "vram", "gpu", "arena", "metadata", "capabilities",
     "unloadTimeout", "timeouts", "cmdStop", "sendLoadingState"}
)  # fmt: skip


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
    filters: Filters = field(default_factory=Filters)
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


def find(models: dict[str, Model], name: str) -> Model | None:
    """The model ``name`` names, directly or as an alias."""
    found = models.get(name)
    if found is not None:
        return found
    return next((m for m in models.values() if name in m.aliases), None)


def read_models(
    reader: Reader, node: yaml.Node, ports: dict[str, int], global_ttl: float, loading: bool
) -> dict[str, Model]:
    """The ``models:`` entries (``ports``: the one each model using ${PORT} was given)."""
    models: dict[str, Model] = {}
    names: dict[str, int] = {}  # model names and aliases -> line, for clashes
    for name, key, value in reader.pairs(node, "models"):
        line = key.start_mark.line + 1
        if name in names:
            raise reader.fail(key, f"model {name!r} is already an alias (line {names[name]})")
        names[name] = line
        model = _model(_Entry(reader, name, key, value, ports.get(name)), global_ttl)
        if model.loading_state is None:  # absent: the top level's
            model = replace(model, loading_state=loading)
        for alias in model.aliases:
            if alias in names:
                taken = f"alias {alias!r} is taken (line {names[alias]})"
                raise reader.fail(value, f"model {name!r}: {taken}")
            names[alias] = line
        models[name] = model
    return models


def _model(entry: _Entry, global_ttl: float) -> Model:
    command, upstream, prefix = entry.server()
    run, gpu, arena = entry.run_options()
    filters = entry.filters()
    aliases, alias_names, unlisted = entry.aliases()
    name = entry.name
    return Model(
        name=name,
        line=entry.key.start_mark.line + 1,
        command=command,
        upstream=upstream,
        prefix=prefix,
        check_endpoint=entry.check_endpoint(),
        ttl=entry.ttl(global_ttl),
        aliases=(*aliases, *(n for n in filters.by_name if n != name and n not in aliases)),
        alias_names=alias_names,
        unlisted_aliases=unlisted,
        env=entry.env(),
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
        capabilities=entry.capabilities(),
        **entry.timeouts(),
        loading_state=entry.flag("sendLoadingState")
        if "sendLoadingState" in entry.fields
        else None,
    )


def words(text: str) -> list[str]:
    """Comment lines dropped (a line continued by ``\\`` ends there), then split as a
    shell would (quotes, no expansion), as llama-swap splits ``cmd``. ValueError: an
    unclosed quote."""
    lines = []
    for line in text.splitlines():
        bare = line.strip()
        if not bare.startswith("#"):
            lines.append(bare[:-1] if bare.endswith("\\") else line)
    return shlex.split("\n".join(lines))


def plain_url(url: str) -> bool:
    """No spaces or control characters: nothing that could end a request line."""
    return url.isprintable() and not any(c.isspace() for c in url)


class _Entry:
    """One ``models:`` entry being read: its fields, where errors point."""

    def __init__(
        self, reader: Reader, name: str, key: yaml.Node, node: yaml.Node, port: int | None
    ) -> None:
        self.reader, self.name, self.key, self.port = reader, name, key, port
        self.where = f"model {name!r}"
        self.fields = reader.entries(node, self.where)
        reader.check_keys(self.fields, MODEL_KEYS, IGNORED_MODEL, f"{self.where}: ")

    def node(self, key: str) -> yaml.Node:
        return self.fields[key][1]

    def fail(self, key: str, what: str) -> ConfigError:
        return self.reader.fail(self.node(key), f"{self.where}: {what}")

    def text(self, key: str) -> str | None:
        """The field ``key`` as a string; None when absent."""
        return (
            self.reader.text(self.node(key), f"{self.where}: {key}") if key in self.fields else None
        )

    def server(self) -> tuple[list[str], str, str]:
        """The command, its server's HOST:PORT and path prefix."""
        if "cmd" not in self.fields:
            raise self.reader.fail(self.key, f"{self.where}: no cmd (the command that starts"
                                             " its server)")  # fmt: skip
        try:
            command = words(self.text("cmd") or "")
        except ValueError as err:
            raise self.fail("cmd", f"cmd: {err}") from None
        if any("\0" in word for word in command):
            raise self.fail("cmd", "cmd: a NUL character cannot be passed to a program")
        if not command:
            raise self.fail("cmd", "cmd is empty")
        return command, *self._upstream(self.text("proxy") or "")

    def _upstream(self, url: str) -> tuple[str, str]:
        """(HOST:PORT, path prefix) from ``proxy: http://HOST:PORT[/PATH]``."""
        if not plain_url(url):
            # urlsplit drops CR, LF and tabs, and the prefix goes into each request line.
            raise self.fail("proxy", "proxy must be an http://HOST:PORT URL, without spaces"
                                     f" or control characters, not {url!r}")  # fmt: skip
        try:
            parts = urlsplit(url)
            port = parts.port or 80
        except ValueError as err:
            raise self.fail("proxy", f"bad proxy URL {url!r}: {err}") from None
        if parts.scheme != "http" or not parts.hostname:
            raise self.fail("proxy", f"proxy must be an http://HOST:PORT URL, not {url!r}")
        # llama-swap's default proxy says localhost; servers listen on 127.0.0.1 by default.
        host = "127.0.0.1" if parts.hostname == "localhost" else parts.hostname
        host = f"[{host}]" if ":" in host else host
        return f"{host}:{port}", parts.path.rstrip("/")

    def check_endpoint(self) -> str | None:
        """checkEndpoint: a path, or None for ``none``."""
        check = self.text("checkEndpoint")
        if check is None:
            return DEFAULT_CHECK_ENDPOINT
        if check == "none":
            return None
        if not check.startswith("/") or not check.isprintable() or " " in check:
            path = "/PATH (no spaces or control characters)"
            raise self.fail("checkEndpoint", f"checkEndpoint must be {path} or none")
        return check

    def ttl(self, global_ttl: float) -> float:
        if "ttl" not in self.fields:
            return global_ttl
        ttl = self.reader.number(self.node("ttl"), f"{self.where}: ttl", -1)
        ttl = global_ttl if ttl == -1 else ttl
        if ttl < 0:
            raise self.fail("ttl", "ttl must be 0 or more seconds, or -1")
        return ttl

    def env(self) -> dict[str, str]:
        env: dict[str, str] = {}
        if "env" not in self.fields:
            return env
        for item in self.reader.strings(self.node("env"), f"{self.where}: env"):
            var, eq, value = item.partition("=")
            if not eq or not var or "\0" in item:
                raise self.fail("env", f"env entry {item!r} is not NAME=value")
            env[var] = value
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
                raise self.fail("gpu", str(err)) from None
            run += ["--gpu", gpu]
        if arena is not None:
            arena = os.path.abspath(os.path.join(os.path.dirname(self.reader.path), arena))
            run += ["--arena", arena]
        return run, gpu, arena

    def concurrency(self) -> int:
        """concurrencyLimit: more than 0, else llama-swap's default."""
        if "concurrencyLimit" not in self.fields:
            return DEFAULT_CONCURRENCY
        value = self.reader.value(self.node("concurrencyLimit"))
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise self.fail("concurrencyLimit", "concurrencyLimit must be 0 or more")
        return value or DEFAULT_CONCURRENCY

    def filters(self) -> Filters:
        """useModelName and filters (stripParams, or the older strip_params, setParams,
        setParamsByID, whose names become aliases)."""
        model = self.text("useModelName")
        if "filters" not in self.fields:
            return Filters(model=model)
        where = f"{self.where}: filters"
        return read_filters(self.reader, self.node("filters"), where, model, legacy=True)

    def shown(self, key: str) -> dict[str, Any]:
        """metadata or capabilities: a mapping for /v1/models."""
        if key not in self.fields:
            return {}
        return self.reader.params(self.node(key), f"{self.where}: {key}")

    def capabilities(self) -> dict[str, Any]:
        """capabilities, its modalities (``in``, ``out``) and ``context`` checked as
        llama-swap checks them."""
        shown = self.shown("capabilities")
        for side in ("in", "out"):
            listed = shown.get(side) or []
            if not isinstance(listed, list):
                raise self.fail("capabilities", f"capabilities.{side} must be a list")
            bad = next((m for m in listed if m not in MODALITIES), None)
            if bad is not None:
                raise self.fail("capabilities", f"capabilities.{side}: invalid modality"
                                f" {bad!r}, must be one of: {', '.join(MODALITIES)}")  # fmt: skip
        context = shown.get("context", 0)
        if not isinstance(context, int) or isinstance(context, bool) or context < 0:
            raise self.fail("capabilities", "capabilities.context must be a whole number >= 0")
        return shown

    def release(self) -> str:
        """The release strategy: a model with cmdStop is released by being stopped."""
        release = self.text("release")
        if "cmdStop" in self.fields and release not in (None, "restart"):
            raise self.fail("release", "cmdStop stops the model to release it: release must"
                                       " be restart")  # fmt: skip
        return release or ("restart" if "cmdStop" in self.fields else "auto")

    def stop_command(self) -> str | None:
        """cmdStop as a line for ``sh -c``: its words as cmd's are split, each ${PID} the
        model's command's pid (``$VRAMLOCK_CHILD_PID``)."""
        text = self.text("cmdStop")
        if text is None:
            return None
        pid = '"$VRAMLOCK_CHILD_PID"'
        try:
            parts = [w.split(PID) for w in words(text)]
        except ValueError as err:
            raise self.fail("cmdStop", f"cmdStop: {err}") from None
        if any("\0" in part for split in parts for part in split):
            raise self.fail("cmdStop", "cmdStop: a NUL character cannot be passed to a program")
        if not parts:
            raise self.fail("cmdStop", "cmdStop is empty")
        return " ".join(
            pid.join(shlex.quote(p) if p or len(split) == 1 else "" for p in split)
            for split in parts
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
            raise self.fail("aliases", "aliases must be a list")
        for i, item in enumerate(node.value):
            where = f"{self.where}: aliases[{i}]"
            if isinstance(item, yaml.ScalarNode):
                ids.append(self.reader.text(item, where))
                continue
            if not isinstance(item, yaml.MappingNode):
                raise self.reader.fail(item, f"{where} must be a name or a mapping with an id")
            f = self.reader.entries(item, where)
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
