"""The Vulkan layer behind ``--release swap-vulkan``: where it is, building it, and the
manifest through which the Vulkan loader finds it.

As for the CUDA library (``vramlock.gpu.swap``): a wheel built where a C compiler and
the Vulkan headers exist carries the layer (``libvramlock-vulkan.so`` beside this
file); anywhere else it is compiled once into the user's cache directory, under a name
that changes with its sources. The loader needs a manifest (JSON) naming the layer and
its library: ``write_manifest`` makes one in a directory the run owns, which
``VK_ADD_LAYER_PATH`` names to the command.
"""

from __future__ import annotations

import ctypes
import json
import os
from pathlib import Path

from ...errors import StrategyError
from ..cbuild import VULKAN, BuildError
from ..swap import cache_dir

__all__ = ["LAYER_NAME", "VulkanUnavailable", "layer_path", "loader_here", "write_manifest"]

LAYER_NAME = "VK_LAYER_VRAMLOCK_swap"  # vklayer.h
MANIFEST = "vramlock_swap_layer.json"


class VulkanUnavailable(StrategyError):
    """The layer is not there and cannot be built here, or no Vulkan loader is."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"--release swap-vulkan cannot be used here: {reason}")
        self.reason = reason


def loader_here() -> bool:
    """Can the Vulkan loader (libvulkan.so.1) be loaded?"""
    try:
        ctypes.CDLL("libvulkan.so.1")
    except OSError:
        return False
    return True


def built_layer() -> Path | None:
    """The layer's library where it is built already, else None (nothing compiled)."""
    return VULKAN.built(cache_dir())


def layer_path() -> Path:
    """The layer's library, built first if needed; VulkanUnavailable when it cannot be."""
    try:
        return VULKAN.path(cache_dir())
    except BuildError as err:
        raise VulkanUnavailable(str(err)) from None


def write_manifest(directory: str, library: Path) -> str:
    """The layer's manifest, written into ``directory``: its path."""
    manifest = {
        "file_format_version": "1.2.0",
        "layer": {
            "name": LAYER_NAME,
            "type": "GLOBAL",
            "library_path": str(library),
            "api_version": "1.3.0",
            "implementation_version": "1",
            "description": "vramlock: swaps the program's device memory to host memory",
        },
    }
    path = os.path.join(directory, MANIFEST)
    with open(path, "w", encoding="utf-8") as out:
        json.dump(manifest, out)
    return path
