"""``vramlock serve``: every model of a llama-swap configuration at one address."""

from __future__ import annotations

from .common import parse_duration, warn


def serve(config: str, listen: str) -> int:
    """Serve every model of CONFIG at one address; each model is a member of the arena."""
    from ..serve import serve as serve_models

    return serve_models(config, listen, duration=parse_duration, warn=warn)
