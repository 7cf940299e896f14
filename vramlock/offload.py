"""Give a PyTorch model's VRAM back and take it again, at pinned-memory speed.

For a program that releases cooperatively (``vramlock run --release signal`` or the
Python API)::

    off = Offloader(model, optimizer)
    ctl.yield_if_asked(release=off.offload, restore=off.restore)   # vramlock.child
    me.yield_if_wanted(release=off.offload, restore=off.restore)   # vramlock.Member

``offload`` copies every CUDA tensor the model and its optimizer own (parameters,
their gradients, buffers, optimizer state) into one page-locked host buffer, then
points the tensors at their host copies and returns the freed blocks to the driver;
``restore`` copies them back into fresh device memory. The tensor objects stay the
same, so the optimizer and any code holding them keep working; their device
addresses change, which invalidates captured CUDA graphs.

The host buffer is allocated and page-locked on the first offload, or ahead of it
by ``prepare()`` (0.25 to 0.65 s per GiB on H200 hosts: 19 to 41 s for 64 GiB),
and reused: it grows only if the model's memory grows. Tensors that share storage
(tied weights, views) still share it after a round trip.

The CUDA context and library workspaces stay on the GPU (866 MiB on an H200), and
so does memory held through references the helper does not know about (activations
kept by the program, another model): check with ``torch.cuda.memory_allocated()``.

torch is imported when an Offloader is made, never by importing vramlock.
"""

from __future__ import annotations

import importlib
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from .errors import VramlockError

# Host offsets are page-aligned: every dtype's alignment, and DMA-friendly.
ALIGN = 4096


class PinError(VramlockError):
    """The host buffer could not be page-locked (too little memory, a driver error)."""

    def __init__(self, nbytes: int, error: str) -> None:
        super().__init__(f"cannot page-lock {nbytes} bytes of host memory: {error}")
        self.nbytes = nbytes
        self.error = error


def _torch() -> Any:
    return importlib.import_module("torch")


@dataclass
class _Storage:
    """One device storage's place in the host buffer, and the tensors that view it."""

    device: Any
    nbytes: int
    offset: int  # bytes into the host buffer
    views: list[tuple[Any, int, tuple[int, ...], tuple[int, ...]]]  # tensor, offset, size, stride


def _unregister(cudart: Any, host: Any) -> None:
    cudart.cudaHostUnregister(host.data_ptr())


class Offloader:
    """Moves ``module``'s (and ``optimizer``'s) CUDA tensors to pinned host memory and back."""

    def __init__(self, module: Any, optimizer: Any = None) -> None:
        self.torch = _torch()
        self.module = module
        self.optimizer = optimizer
        self.offloaded = False
        self._host: Any = None  # one page-locked uint8 tensor
        self._unpin: Callable[[], object] | None = None
        self._storages: list[_Storage] = []

    def _tensors(self) -> Iterator[Any]:
        for p in self.module.parameters():
            yield p
            if p.grad is not None:
                yield p.grad
        yield from self.module.buffers()
        if self.optimizer is not None:
            for state in self.optimizer.state.values():
                yield from (v for v in state.values() if isinstance(v, self.torch.Tensor))

    def _plan(self) -> list[_Storage]:
        """Group the CUDA tensors by storage and lay the storages out in the host buffer."""
        seen: set[int] = set()
        by_ptr: dict[int, _Storage] = {}
        offset = 0
        for t in self._tensors():
            if id(t) in seen or not t.is_cuda or t.numel() == 0:
                continue
            seen.add(id(t))
            storage = t.untyped_storage()
            s = by_ptr.get(storage.data_ptr())
            if s is None:
                s = _Storage(t.device, storage.nbytes(), offset, [])
                by_ptr[storage.data_ptr()] = s
                offset += -(-s.nbytes // ALIGN) * ALIGN
            s.views.append((t, t.storage_offset(), tuple(t.size()), tuple(t.stride())))
        return list(by_ptr.values())

    def _pin(self, nbytes: int) -> None:
        """Make the host buffer at least ``nbytes``: plain memory, page-locked in place.

        Not ``pin_memory=True``: torch's pinned allocator rounds every allocation up
        to a power of two, which can nearly double the host memory taken.
        """
        if self._host is not None and self._host.numel() >= nbytes:
            return
        self.close()
        torch = self.torch
        host = torch.empty(max(nbytes, 1), dtype=torch.uint8)
        cudart = torch.cuda.cudart()
        err = cudart.cudaHostRegister(host.data_ptr(), host.numel(), 0)
        if err != cudart.cudaError.success:
            raise PinError(nbytes, str(err))
        self._host = host
        self._unpin = weakref.finalize(self, _unregister, cudart, host)

    def _view(self, storage: Any, dtype: Any, offset: int, size: Any, stride: Any) -> Any:
        empty = self.torch.empty(0, dtype=dtype, device=storage.device)
        return empty.set_(storage, offset, size, stride)

    def _synchronize(self, storages: list[_Storage]) -> None:
        for device in {s.device for s in storages}:
            self.torch.cuda.synchronize(device)

    @property
    def nbytes(self) -> int:
        """Bytes moved by an offload (as of the last one)."""
        return sum(s.nbytes for s in self._storages)

    def _pinned_plan(self) -> list[_Storage]:
        storages = self._plan()
        self._pin(storages[-1].offset + storages[-1].nbytes if storages else 0)
        return storages

    def prepare(self) -> None:
        """Allocate and page-lock the host buffer now, so that the first offload is as
        fast as the others (pinning costs 0.25 to 0.65 s per GiB)."""
        if not self.offloaded:
            self._pinned_plan()

    def offload(self) -> None:
        """Copy everything to the host buffer, point the tensors there, free the VRAM."""
        if self.offloaded:
            return
        torch = self.torch
        storages = self._pinned_plan()
        host = self._host
        for s in storages:
            source = s.views[0][0].untyped_storage()
            device_bytes = self._view(source, torch.uint8, 0, (s.nbytes,), (1,))
            host[s.offset : s.offset + s.nbytes].copy_(device_bytes, non_blocking=True)
        self._synchronize(storages)  # one wait for all copies, before the device memory goes
        host_storage = host.untyped_storage()
        for s in storages:
            for t, offset, size, stride in s.views:
                first = s.offset // t.element_size() + offset
                t.data = self._view(host_storage, t.dtype, first, size, stride)
        self._storages = storages
        self.offloaded = True
        torch.cuda.empty_cache()  # hand the freed blocks back to the driver

    def restore(self) -> None:
        """Copy everything back into fresh device memory and point the tensors there."""
        if not self.offloaded:
            return
        torch = self.torch
        host = self._host
        for s in self._storages:
            device_bytes = torch.empty(s.nbytes, dtype=torch.uint8, device=s.device)
            device_bytes.copy_(host[s.offset : s.offset + s.nbytes], non_blocking=True)
            storage = device_bytes.untyped_storage()
            for t, offset, size, stride in s.views:
                t.data = self._view(storage, t.dtype, offset, size, stride)
        self._synchronize(self._storages)
        self.offloaded = False

    def close(self) -> None:
        """Unlock and drop the host buffer (restore first, or the offloaded data goes too)."""
        if self._unpin is not None:
            self._unpin()
        self._host = None
        self._unpin = None
