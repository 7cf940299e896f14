"""``vramlock serve``: every model of a llama-swap configuration at one address."""

from __future__ import annotations

from ..errors import UsageError
from .common import parse_duration, warn


def serve(config: str | None, config_option: str | None, listen: str, watch: bool = False) -> int:
    """Serve every model of CONFIG (or ``--config FILE``, llama-swap's way) at one
    address; each model is a member of the arena."""
    from ..serve import serve as serve_models

    paths = [p for p in (config, config_option) if p is not None]
    if len(paths) != 1:
        raise UsageError("give the configuration file once: CONFIG or --config FILE")
    return serve_models(paths[0], listen, duration=parse_duration, warn=warn, watch=watch)
