"""Wheel build hook: compile the swap library into the wheel where a C compiler exists.

Without one the wheel is still built (pure Python); ``--release swap`` then compiles
the library at first use where a compiler is, and refuses (exit 125) where none is.
"""

from __future__ import annotations

import importlib.util
import sys
import sysconfig
from pathlib import Path
from types import ModuleType
from typing import Any

from hatchling.builders.hooks.plugin.interface import BuildHookInterface


def _cbuild(root: str) -> ModuleType:
    # By path: the package itself (and its dependencies) need not be importable here.
    path = Path(root, "vramlock", "gpu", "cbuild.py")
    spec = importlib.util.spec_from_file_location("_vramlock_cbuild", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    # Registered first: dataclasses looks its module up while making the classes.
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


class SwapLibraryHook(BuildHookInterface):  # type: ignore[type-arg]
    PLUGIN_NAME = "custom"

    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        if version == "editable":
            return  # a checkout builds the libraries into the cache at first use
        cbuild = _cbuild(self.root)
        # The Vulkan layer too, where a compiler and the Vulkan headers are; without
        # them it is compiled at first use, as the swap library is.
        self._build(cbuild, "vulkan", build_data)
        if not self._build(cbuild, "swap", build_data):
            return
        build_data["pure_python"] = False
        # Any Python 3, this platform only: the libraries do not link Python.
        platform = sysconfig.get_platform().replace("-", "_").replace(".", "_")
        build_data["tag"] = f"py3-none-{platform}"

    def _build(self, cbuild: ModuleType, part: str, build_data: dict[str, Any]) -> bool:
        """Compile one library into the wheel; False (and a warning) where it cannot be."""
        library = cbuild.LIBRARIES[part]
        target = Path(self.root, "build", part, library.name)
        try:
            library.build(target)
        except cbuild.BuildError as err:
            self.app.display_warning(f"vramlock: {library.what} is not in this wheel: {err}")
            return False
        build_data["force_include"][str(target)] = f"vramlock/gpu/{part}/{library.name}"
        return True
