"""``vramlock serve CONFIG``: llama-swap's YAML configuration, read into models.

One module per section, each key read beside where it is declared: ``reader`` (the
file and its YAML), ``macros`` (expanded before anything is read), ``merge``
(``--config-dir``), ``top`` (the top-level keys and ``load``), ``models``, ``filters``,
``timeouts``, ``peers``, ``selectors`` (and profiles), ``routing`` and ``matrix``.

What llama-swap's keys mean here:

- ``models.NAME``: ``cmd`` (required; lines starting with ``#`` dropped, then split as a
  shell would), ``proxy`` (``http://HOST:PORT[/PATH]``, no spaces or control characters;
  default ``http://localhost:${PORT}``, as in llama-swap, which needs ``${PORT}`` in
  ``cmd``), ``checkEndpoint`` (default ``/health``; ``none``), ``ttl`` (seconds; 0 never,
  -1 ``globalTTL``), ``aliases`` (names, or objects of ``id``, ``name`` and
  ``unlisted``), ``env`` (``NAME=value``), ``unlisted``, ``name`` and ``description``
  (shown by ``/v1/models``), ``macros``, ``concurrencyLimit``, ``useModelName``,
  ``filters``, ``metadata``, ``capabilities``, ``unloadTimeout`` and ``timeouts``,
  ``cmdStop`` (its release: ``vramlock run --release restart --on-release``; ``${PID}``
  the cmd's pid);
- top level: ``models``, ``macros``, ``startPort`` (default 5800),
  ``healthCheckTimeout`` (default 120 s), ``globalTTL``, ``hooks.on_startup.preload``
  (the models started with serve; any other starts on its first request), ``apiKeys``,
  ``includeAliasesInList``, ``logLevel``, ``unloadTimeout``, ``routing`` and the older
  ``groups`` and ``matrix``, ``logToStdout``, ``logTimeFormat``, ``sendLoadingState``
  (also per model), ``upstream.ignorePaths``, ``peers``, ``selectors`` and ``profiles``,
  ``metricsMaxInMemory`` and ``captureBuffer``, ``performance.disabled`` and
  ``performance.every``.

vramlock's own keys, per model: ``release``, ``preset``, ``min_hold``, ``yield_within``,
``vram``, ``gpu``, ``arena`` (``vramlock run``'s options of those names; absent: what
``run`` picks).

Keys that mean nothing under vramlock (``store``, ``compat``) are ignored with a
warning that says why; an unknown key is ignored with a warning. Anything else wrong is a
ConfigError: ``FILE:LINE: what is wrong`` (exit status 2).
"""

from __future__ import annotations

from .filters import Filters
from .models import COMFYUI_MODEL, DEFAULT_CHECK_ENDPOINT, DEFAULT_CONCURRENCY, Model
from .peers import Peer
from .reader import MAX_BYTES, ConfigError, Duration, read_config_text
from .selectors import Profile, Selector
from .top import (
    DEFAULT_CAPTURE_MB,
    DEFAULT_EVERY,
    DEFAULT_HEALTH_TIMEOUT,
    DEFAULT_KEEP,
    DEFAULT_START_PORT,
    Config,
    load,
)

__all__ = [
    "COMFYUI_MODEL",
    "DEFAULT_CAPTURE_MB",
    "DEFAULT_CHECK_ENDPOINT",
    "DEFAULT_CONCURRENCY",
    "DEFAULT_EVERY",
    "DEFAULT_HEALTH_TIMEOUT",
    "DEFAULT_KEEP",
    "DEFAULT_START_PORT",
    "MAX_BYTES",
    "Config",
    "ConfigError",
    "Duration",
    "Filters",
    "Model",
    "Peer",
    "Profile",
    "Selector",
    "load",
    "read_config_text",
]
