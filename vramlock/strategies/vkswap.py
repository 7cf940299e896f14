"""``swap-vulkan``: a Vulkan layer moves the command's device memory to host memory.

``prepare`` writes the layer's manifest into the run's private directory, names that
directory to the Vulkan loader (``VK_ADD_LAYER_PATH``) and the layer first among the
instance layers (``VK_INSTANCE_LAYERS``), and listens on the same kind of socket as
``swap`` (``VRAMLOCK_SWAP_SOCKET``): the layer runs the CUDA library's engine core and
speaks its conversation (vramlock/gpu/core/protocol.py), so the release, its answers
and the restore are ``swap``'s own. Where
``swap`` made a hub for the command already, the layer joins it: one socket for both
kinds of process.

``auto`` puts the layer in front of every command where it can be used (a Vulkan loader
here, the layer built or buildable); the layer costs nothing in a process that makes no
Vulkan device. A command of which a Vulkan process (the layer mapped) joined the hub is
released with ``swap-vulkan`` when somebody waits: before the presets, so that a Vulkan
llama-server is swapped rather than restarted; a command of CUDA and Vulkan processes
too (the release tells every process that joined, CUDA ones included).

A release is refused while a process of the command has the Vulkan loader mapped
without the layer, and was not started to load it (``vulkan_unverified``), as ``swap``'s
is for CUDA.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from contextlib import ExitStack

from .. import procfs
from ..gpu import cuda
from ..gpu.core.protocol import ENV_SOCKET, open_hub, prepared_hub
from ..gpu.vulkan import (
    LAYER_NAME,
    VulkanUnavailable,
    built_layer,
    layer_path,
    loader_here,
    write_manifest,
)
from .base import Context, Settings
from .swap import Hub, SwapStrategy, hub_of

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


def vulkan_peers(hub: Hub) -> bool:
    """Is one of the processes connected to ``hub`` a Vulkan one, the layer mapped?"""
    if not hub.joined():
        return False
    pids = hub.connected()
    built = built_layer()  # never compiled here: unbuilt, it is in front of no process
    if built is None:
        return False
    layer = os.path.realpath(built)  # as /proc/PID/maps names it
    return any(layer in (procfs.mapped(pid) or ()) for pid in pids)


def names_layer(env: Mapping[str, str]) -> bool:
    """Does ``env`` put vramlock's layer in front of the program's Vulkan calls?"""
    return LAYER_NAME in env.get(ENV_LAYERS, "").split(":")


def _layered(hub: Hub, pid: int) -> bool:
    """Was ``pid`` started to load the layer and join ``hub`` (its environment at start
    names the hub's socket and the layer)? Then it makes no device before it joins."""
    env = procfs.environ(pid)
    return env.get(ENV_SOCKET) == hub.path and names_layer(env)


def vulkan_loose(hub: Hub, pids: list[int]) -> tuple[list[int], list[int]]:
    """Released: among ``pids``, the Vulkan processes the layer does not hold (the loader
    mapped, not connected, not started to load the layer), and those without the loader
    that would not be held if they loaded it (``Strategy.loose``)."""
    peers = hub.connected()
    loose: list[int] = []
    suspects: list[int] = []
    for pid in pids:
        paths = procfs.mapped(pid)
        if pid in peers or paths is None or _layered(hub, pid):
            continue
        (loose if _vulkan(paths) else suspects).append(pid)
    return loose, suspects


def either(
    a: tuple[list[int], list[int]], b: tuple[list[int], list[int]]
) -> tuple[list[int], list[int]]:
    """Two ``loose`` answers as one: loose in either, and suspected by either."""
    loose = a[0] + [p for p in b[0] if p not in a[0]]
    suspects = [p for p in a[1] + b[1] if p not in loose]
    return loose, list(dict.fromkeys(suspects))


def api_of(pid: int) -> str:
    """What a process found loose uses (``run/strays.py`` says it): Vulkan where it maps
    the loader and not the CUDA driver, else CUDA."""
    paths = procfs.mapped(pid) or set()
    return "Vulkan" if _vulkan(paths) and not cuda.driver_in(paths) else "CUDA"


def vulkan_unverified(hub: Hub, pids: list[int]) -> str | None:
    """Why a release through ``hub`` cannot reach every Vulkan process among ``pids``, or
    None when it can: each that has the loader mapped must be connected, or be one that
    will load the layer and join before it makes a device (its environment at start
    names the hub's socket and the layer). ``hub.unverified`` says it for CUDA."""
    peers = hub.connected()
    for pid in pids:
        paths = procfs.mapped(pid)
        if pid in peers or paths is None or not _vulkan(paths):
            continue
        if _layered(hub, pid):
            continue  # no device before it joins (told release if it does)
        return (
            f"process {pid} of the command uses Vulkan without the vramlock layer (were"
            f" {ENV_LAYERS} or {ENV_SOCKET} changed on the way?)"
        )
    return None


class VulkanSwapStrategy(SwapStrategy):
    """Swap every Vulkan process of the command out to host memory, and back (and every
    CUDA one with them, where the swap library is in front of the command as well)."""

    name = "swap-vulkan"

    @classmethod
    def finds_work(cls, ctx: Context) -> bool:
        """Did a Vulkan process of the command join this run's hub, and does none of its
        processes run Vulkan without the layer, or CUDA without the library? (For
        ``auto``.)"""
        hub = hub_of(ctx)
        pids = ctx.child.processes()
        return (
            hub is not None
            and vulkan_peers(hub)
            and hub.unverified(pids) is None
            and vulkan_unverified(hub, pids) is None
        )

    def _unverified(self, deadline: float | None) -> str | None:
        why = super()._unverified(deadline)
        return why if why is not None else vulkan_unverified(self.hub, self.ctx.child.processes())

    def loose(self, pids: list[int]) -> tuple[list[int], list[int]]:
        return either(super().loose(pids), vulkan_loose(self.hub, pids))

    @classmethod
    def fit(cls, command: list[str], env: Mapping[str, str], settings: Settings) -> None:
        why = usable()
        if why is not None:
            raise VulkanUnavailable(why)

    @classmethod
    def prepare(cls, command: list[str], env: dict[str, str], scratch: ExitStack) -> list[str]:
        library = layer_path()
        if prepared_hub(env) is None:  # no CUDA hub made for the command: one of our own
            open_hub(lambda path: Hub(path, str(library)), env, scratch)
        path = env[ENV_SOCKET]
        write_manifest(os.path.dirname(path), library)
        # Ours first: nearest the program, it sees every handle the program holds.
        for name, value in ((ENV_LAYER_PATH, os.path.dirname(path)), (ENV_LAYERS, LAYER_NAME)):
            theirs = env.get(name, "").strip()
            env[name] = f"{value}:{theirs}" if theirs else value
        return command
