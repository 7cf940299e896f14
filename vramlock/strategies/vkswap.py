"""``swap-vulkan``: a Vulkan layer moves the command's device memory to host memory.

``prepare`` writes the layer's manifest into the run's private directory, names that
directory to the Vulkan loader (``VK_ADD_LAYER_PATH``) and the layer first among the
instance layers (``VK_INSTANCE_LAYERS``), and listens on the same kind of socket as
``swap`` (``VRAMLOCK_SWAP_SOCKET``): the layer speaks the CUDA library's conversation
(``hello``, ``release`` / ``released``, ``restore`` / ``restored``, ``refused``,
``failed``), so the release, its answers and the restore are ``swap``'s own. Where
``swap`` made a hub for the command already (``auto`` makes it a ``VulkanHub``), the
layer joins it: one socket for both kinds of process.

``auto`` puts the layer in front of every command where it can be used (a Vulkan loader
here, the layer built or buildable); the layer costs nothing in a process that makes no
Vulkan device. A command whose processes that joined the hub are all Vulkan ones (the
layer mapped) is released with ``swap-vulkan`` when somebody waits: before the presets,
so that a Vulkan llama-server is swapped rather than restarted.

A release is refused while a process of the command has the Vulkan loader mapped
without the layer, and was not started to load it (``VulkanHub.unverified``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from contextlib import ExitStack

from .. import procfs
from ..gpu.vulkan import LAYER_NAME, VulkanUnavailable, layer_path, loader_here, write_manifest
from .base import Context, Settings
from .swap import ENV_SOCKET, Hub, SwapStrategy, hub_of, open_hub, prepared_hub

ENV_LAYERS = "VK_INSTANCE_LAYERS"
ENV_LAYER_PATH = "VK_ADD_LAYER_PATH"
LOADER = "libvulkan.so"


def usable() -> str | None:
    """Why the layer cannot be used here, or None when it can (built first where it has
    to be)."""
    if not loader_here():
        return "there is no Vulkan loader (libvulkan.so.1)"
    try:
        layer_path()
    except VulkanUnavailable as err:
        return err.reason
    return None


def _vulkan(paths: set[str]) -> bool:
    return any(os.path.basename(p).startswith(LOADER) for p in paths)


class VulkanHub(Hub):
    """``swap``'s hub, which also knows the command's Vulkan processes: each that has
    the loader mapped must be a peer, or be one that will load the layer and join
    before it makes a device (its environment at start names this hub's socket and
    the layer)."""

    def __init__(self, path: str, library: str, layer: str) -> None:
        super().__init__(path, library)
        self.layer = os.path.realpath(layer)  # as /proc/PID/maps names it

    @classmethod
    def maker(cls, layer: str) -> Callable[[str, str], Hub]:
        """``swap``'s way to make its hub (``SwapStrategy.prepare``'s ``kind``) as one of
        these, for the layer ``layer``."""
        return lambda path, library: cls(path, library, layer)

    def vulkan_peers(self) -> bool:
        """Are the command's connected processes (one at least) all Vulkan ones, the layer
        mapped? (Those of the CUDA library are ``swap``'s.)"""
        if not self.joined():
            return False
        with self.lock:
            pids = [p.pid for p in self.peers if not p.channel.closed]
        return bool(pids) and all(self.layer in (procfs.mapped(pid) or ()) for pid in pids)

    def unverified(self, pids: list[int]) -> str | None:
        why = super().unverified(pids)
        if why is not None:
            return why
        with self.lock:
            peers = {p.pid for p in self.peers if not p.channel.closed}
        for pid in pids:
            paths = procfs.mapped(pid)
            if pid in peers or paths is None or not _vulkan(paths):
                continue
            env = procfs.environ(pid)
            layers = env.get(ENV_LAYERS, "").split(":")
            if env.get(ENV_SOCKET) == self.path and LAYER_NAME in layers:
                continue  # no device before it joins (told release if it does)
            return (
                f"process {pid} of the command uses Vulkan without the vramlock layer (were"
                f" {ENV_LAYERS} or {ENV_SOCKET} changed on the way?)"
            )
        return None


class VulkanSwapStrategy(SwapStrategy):
    """Swap every Vulkan process of the command out to host memory, and back."""

    name = "swap-vulkan"

    @classmethod
    def finds_work(cls, ctx: Context) -> bool:
        """Did the command's Vulkan processes join this run's hub, the layer in each, and
        does none of them (nor any CUDA one) run without it? (For ``auto``.)"""
        hub = hub_of(ctx)
        return (
            isinstance(hub, VulkanHub)
            and hub.vulkan_peers()
            and hub.unverified(ctx.child.processes()) is None
        )

    @classmethod
    def fit(cls, command: list[str], env: Mapping[str, str], settings: Settings) -> None:
        why = usable()
        if why is not None:
            raise VulkanUnavailable(why)

    @classmethod
    def prepare(
        cls,
        command: list[str],
        env: dict[str, str],
        scratch: ExitStack,
        kind: Callable[[str, str], Hub] | None = None,
    ) -> list[str]:
        """The layer before the command, on the hub made already, or on one of its own
        (a ``VulkanHub`` whatever ``kind`` says)."""
        library = layer_path()
        if prepared_hub(env) is None:  # no CUDA hub made for the command: one of our own
            open_hub(lambda path: VulkanHub(path, str(library), str(library)), env, scratch)
        path = env[ENV_SOCKET]
        write_manifest(os.path.dirname(path), library)
        # Ours first: nearest the program, it sees every handle the program holds.
        for name, value in ((ENV_LAYER_PATH, os.path.dirname(path)), (ENV_LAYERS, LAYER_NAME)):
            theirs = env.get(name, "").strip()
            env[name] = f"{value}:{theirs}" if theirs else value
        return command
