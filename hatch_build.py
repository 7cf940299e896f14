"""Wheel build hook: compile the swap library into the wheel where a C compiler exists.

Without one the wheel is still built (pure Python); ``--release swap`` then compiles
the library at first use where a compiler is, and refuses (exit 125) where none is.
"""

from __future__ import annotations

import importlib.util
import sysconfig
from pathlib import Path
from types import ModuleType
from typing import Any

from hatchling.builders.hooks.plugin.interface import BuildHookInterface


def _swap_build(root: str, part: str = "swap") -> ModuleType:
    # By path: the package itself (and its dependencies) need not be importable here.
    path = Path(root, "vramlock", "gpu", part, "build.py")
    spec = importlib.util.spec_from_file_location(f"_vramlock_{part}_build", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class SwapLibraryHook(BuildHookInterface):  # type: ignore[type-arg]
    PLUGIN_NAME = "custom"

    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        if version == "editable":
            return  # a checkout builds the library into the cache at first use
        self._vulkan_layer(build_data)
        swap = _swap_build(self.root)
        target = Path(self.root, "build", "swap", swap.LIBRARY)
        try:
            swap.build(target)
        except swap.BuildError as err:
            self.app.display_warning(f"vramlock: no swap library in this wheel: {err}")
            return
        build_data["force_include"][str(target)] = f"vramlock/gpu/swap/{swap.LIBRARY}"
        build_data["pure_python"] = False
        # Any Python 3, this platform only: the library does not link Python.
        platform = sysconfig.get_platform().replace("-", "_").replace(".", "_")
        build_data["tag"] = f"py3-none-{platform}"

    def _vulkan_layer(self, build_data: dict[str, Any]) -> None:
        """The Vulkan layer too, where a compiler and the Vulkan headers are; without
        them it is compiled at first use, as the swap library is."""
        vulkan = _swap_build(self.root, "vulkan")
        target = Path(self.root, "build", "vulkan", vulkan.LIBRARY)
        try:
            vulkan.build(target)
        except vulkan.BuildError as err:
            self.app.display_warning(f"vramlock: no Vulkan layer in this wheel: {err}")
            return
        build_data["force_include"][str(target)] = f"vramlock/gpu/vulkan/{vulkan.LIBRARY}"
