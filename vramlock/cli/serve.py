"""``vramlock serve``: every model of a llama-swap configuration at one address."""

from __future__ import annotations

from ..errors import UsageError
from .common import parse_duration, warn


def serve(
    config: str | None,
    config_option: str | None,
    listen: str,
    watch: bool = False,
    config_dir: str | None = None,
) -> int:
    """Serve every model of CONFIG (or ``--config FILE``, llama-swap's way; and the
    files of ``--config-dir DIR`` merged in) at one address; each model is a member of
    the arena."""
    from ..serve import serve as serve_models

    paths = [p for p in (config, config_option) if p is not None]
    if len(paths) > 1 or (not paths and config_dir is None):
        raise UsageError(
            "give the configuration once: CONFIG or --config FILE, or --config-dir DIR"
        )
    if watch and config_dir is not None:
        raise UsageError("--watch-config reads one file again: not with --config-dir")
    path = paths[0] if paths else None
    return serve_models(
        path, listen, duration=parse_duration, warn=warn, watch=watch, config_dir=config_dir
    )
