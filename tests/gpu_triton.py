"""The Triton kernels of tests/gpu_frameworks.py's ``triton`` program: module-level, as
``triton.jit`` wants them, and imported only by that program."""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit  # type: ignore[untyped-decorator, unused-ignore]
def _fill(out, n, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    value = (offs.to(tl.int64) * 2654435761) & 0xFFFFFFFF
    tl.store(out + offs, value.to(tl.int32), mask=offs < n)


@triton.jit  # type: ignore[untyped-decorator, unused-ignore]
def _total(data, partial, n, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    word = tl.load(data + offs, mask=offs < n, other=0).to(tl.int64) & 0xFFFFFFFF
    tl.store(partial + tl.program_id(0), tl.sum(word, axis=0))


def program(words: int) -> Any:
    """Fills ``words`` 32-bit words with Triton; the check sums them with Triton."""
    data = torch.empty(words, dtype=torch.int32, device="cuda")
    blocks = triton.cdiv(words, BLOCK)
    partial = torch.empty(blocks, dtype=torch.int64, device="cuda")
    _fill[(blocks,)](data, words, BLOCK=BLOCK)

    def check() -> int:
        _total[(blocks,)](data, partial, words, BLOCK=BLOCK)
        return int(partial.sum().item())

    return check
