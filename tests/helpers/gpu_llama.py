"""What the GPU llama-server tests share (tests/test_gpu_llama.py for a CUDA build,
tests/test_gpu_vulkan_llama.py for a Vulkan one): the binary an environment variable
names, the requests both send, and how two answers are compared."""

from __future__ import annotations

import os
from typing import Any

import pytest

# Several hundred tokens each, and different, so a reused prefix is unmistakable.
PROMPT_A = "The quick brown fox jumps over the lazy dog. " * 40
PROMPT_B = "Pack my box with five dozen liquor jugs. " * 40
# Greedy and seeded: the same prompt gives the same answer.
REQUEST = {"n_predict": 8, "temperature": 0, "seed": 42, "cache_prompt": True, "n_probs": 5}
# The same computation on the same KV cache gives the same numbers; far below what a
# changed cache or weights would move a probability by.
TOLERANCE = 1e-4


def binary(variable: str, build: str) -> tuple[str, pytest.MarkDecorator]:
    """The llama-server ``variable`` names (built with ``build``: "CUDA", "Vulkan"), and
    the mark that skips a module without it, saying why."""
    path = os.environ.get(variable, "")
    why = None
    if not path:
        why = f"set {variable} to the path of a llama-server built with {build}"
    elif not (os.path.isfile(path) and os.access(path, os.X_OK)):
        why = f"{variable}={path!r} is not an executable file"
    mark = pytest.mark.skipif(why is not None, reason=f"needs a {build} llama-server: {why}")
    return path, mark


def numbers(value: object) -> list[float]:
    """Every number in a JSON value, in order (token ids, probabilities, bytes)."""
    if isinstance(value, bool):
        return []
    if isinstance(value, (int, float)):
        return [float(value)]
    if isinstance(value, dict):
        return [n for key in sorted(value) for n in numbers(value[key])]
    if isinstance(value, list):
        return [n for item in value for n in numbers(item)]
    return []


def deviation(got: dict[str, Any], ref: dict[str, Any]) -> float:
    """The largest difference between two answers' token probabilities (and ids)."""
    mine = numbers(got["completion_probabilities"])
    theirs = numbers(ref["completion_probabilities"])
    assert mine and len(mine) == len(theirs), (got, ref)
    return max(abs(x - y) for x, y in zip(mine, theirs, strict=True))
