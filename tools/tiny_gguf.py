"""Write a tiny llama-architecture GGUF model with random weights, for tests.

The tokenizer is copied from one of llama.cpp's tokenizer-only ``ggml-vocab-*.gguf``
files (cached by tools/llama_server.py); the weights are seeded random numbers, so the
same inputs give the same file byte for byte. It loads in well under a second on a
CPU and answers ``/completion`` with nonsense, which is all the tests need: the
server's slots, prompt cache and timings behave as with a real model.

``--gib SIZE`` writes a model of about SIZE GiB instead (the shape of a 1B llama with
as many layers as fit), for benchmarks that need a GPU server of realistic size.

    python tools/tiny_gguf.py [--gib SIZE] [OUT]   # default OUT: beside the cached llama-server
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path

import llama_server
import numpy as np
from gguf import GGUFReader, GGUFValueType, GGUFWriter

SEED = 0


@dataclasses.dataclass(frozen=True)
class Shape:
    layers: int
    embd: int
    heads: int
    heads_kv: int  # grouped-query attention, as in current llama models
    ff: int
    ctx: int


# Big enough to have every tensor a llama model has, small enough to be a few MB (the
# 32000-token embedding is most of it).
TINY = Shape(layers=2, embd=64, heads=4, heads_kv=2, ff=128, ctx=4096)
# A 1B llama's layer (TinyLlama's): about 86 MiB of F16 weights each.
LARGE_LAYER = Shape(layers=1, embd=2048, heads=32, heads_kv=4, ff=5632, ctx=8192)


def sized(gib: float, n_vocab: int = 32000) -> Shape:
    """LARGE_LAYER's shape with as many layers as make about ``gib`` GiB of weights."""
    s = LARGE_LAYER
    kv = s.embd // s.heads * s.heads_kv
    per_layer = 2 * (2 * s.embd * s.embd + 2 * s.embd * kv + 3 * s.embd * s.ff)
    layers = round((gib * (1 << 30) - 2 * n_vocab * s.embd) / per_layer)
    return dataclasses.replace(s, layers=max(1, layers))


def cached_model(shape: Shape = TINY) -> Path:
    """The model beside the cached server, written first if missing."""
    path = llama_server.cache_dir() / f"tiny-llama-{shape.layers}x{shape.embd}-s{SEED}.gguf"
    if not path.exists():
        write(path, llama_server.vocab_path(), shape)
    return path


def write(path: Path, vocab: Path, shape: Shape = TINY, seed: int = SEED) -> None:
    """Write the model to ``path`` (atomically: a reader never sees half a file)."""
    s = shape
    rng = np.random.default_rng(seed)
    reader = GGUFReader(vocab)
    n_vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    partial = path.with_name(path.name + f".{os.getpid()}.tmp")
    writer = GGUFWriter(partial, "llama")
    writer.add_name("vramlock tiny random llama")
    writer.add_block_count(s.layers)
    writer.add_context_length(s.ctx)
    writer.add_embedding_length(s.embd)
    writer.add_feed_forward_length(s.ff)
    writer.add_head_count(s.heads)
    writer.add_head_count_kv(s.heads_kv)
    writer.add_rope_dimension_count(s.embd // s.heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(n_vocab)
    writer.add_file_type(1)  # mostly F16
    for key, field in reader.fields.items():
        if key.startswith("tokenizer."):
            kind = field.types[0]
            sub = field.types[-1] if kind == GGUFValueType.ARRAY else None
            writer.add_key_value(key, field.contents(), kind, sub_type=sub)

    def matrix(name: str, rows: int, cols: int) -> None:
        # numpy shape is (rows, cols) = ggml's (ne1, ne0): rows outputs of cols inputs.
        # float32 draws: half the time of float64 ones, which a multi-GiB model notices.
        values = rng.standard_normal((rows, cols), dtype=np.float32) * 0.02
        writer.add_tensor(name, values.astype(np.float16))

    def norm(name: str) -> None:
        writer.add_tensor(name, np.ones(s.embd, dtype=np.float32))

    n_embd_kv = s.embd // s.heads * s.heads_kv
    # No output.weight: llama.cpp then ties the output to token_embd.
    matrix("token_embd.weight", n_vocab, s.embd)
    norm("output_norm.weight")
    for i in range(s.layers):
        norm(f"blk.{i}.attn_norm.weight")
        matrix(f"blk.{i}.attn_q.weight", s.embd, s.embd)
        matrix(f"blk.{i}.attn_k.weight", n_embd_kv, s.embd)
        matrix(f"blk.{i}.attn_v.weight", n_embd_kv, s.embd)
        matrix(f"blk.{i}.attn_output.weight", s.embd, s.embd)
        norm(f"blk.{i}.ffn_norm.weight")
        matrix(f"blk.{i}.ffn_gate.weight", s.ff, s.embd)
        matrix(f"blk.{i}.ffn_up.weight", s.ff, s.embd)
        matrix(f"blk.{i}.ffn_down.weight", s.embd, s.ff)
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", nargs="?", type=Path, help="where to write the model")
    parser.add_argument("--gib", type=float, help="about this many GiB of weights")
    args = parser.parse_args(argv)
    shape = TINY if args.gib is None else sized(args.gib)
    try:
        if args.out:
            write(args.out, llama_server.vocab_path(), shape)
            path = args.out
        else:
            path = cached_model(shape)
    except OSError as e:
        print(f"tiny_gguf: {e}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
