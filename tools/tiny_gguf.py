"""Write a tiny llama-architecture GGUF model with random weights, for tests.

The tokenizer is copied from one of llama.cpp's tokenizer-only ``ggml-vocab-*.gguf``
files (cached by tools/llama_server.py); the weights are seeded random numbers, so the
same inputs give the same file byte for byte. It loads in well under a second on a
CPU and answers ``/completion`` with nonsense, which is all the tests need: the
server's slots, prompt cache and timings behave as with a real model.

    python tools/tiny_gguf.py [OUT]    # default OUT: beside the cached llama-server
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import llama_server
import numpy as np
from gguf import GGUFReader, GGUFValueType, GGUFWriter

# Shape: big enough to have every tensor a llama model has, small enough to be a few MB
# (the 32000-token embedding is most of it).
N_LAYER = 2
N_EMBD = 64
N_HEAD = 4
N_HEAD_KV = 2  # grouped-query attention, as in current llama models
N_FF = 128
N_CTX = 4096
SEED = 0


def cached_model() -> Path:
    """The model beside the cached server, written first if missing."""
    path = llama_server.cache_dir() / f"tiny-llama-{N_LAYER}x{N_EMBD}-s{SEED}.gguf"
    if not path.exists():
        write(path, llama_server.vocab_path())
    return path


def write(path: Path, vocab: Path, seed: int = SEED) -> None:
    """Write the model to ``path`` (atomically: a reader never sees half a file)."""
    rng = np.random.default_rng(seed)
    reader = GGUFReader(vocab)
    n_vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    partial = path.with_name(path.name + f".{os.getpid()}.tmp")
    writer = GGUFWriter(partial, "llama")
    writer.add_name("vramlock tiny random llama")
    writer.add_block_count(N_LAYER)
    writer.add_context_length(N_CTX)
    writer.add_embedding_length(N_EMBD)
    writer.add_feed_forward_length(N_FF)
    writer.add_head_count(N_HEAD)
    writer.add_head_count_kv(N_HEAD_KV)
    writer.add_rope_dimension_count(N_EMBD // N_HEAD)
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
        writer.add_tensor(name, (rng.standard_normal((rows, cols)) * 0.02).astype(np.float16))

    def norm(name: str) -> None:
        writer.add_tensor(name, np.ones(N_EMBD, dtype=np.float32))

    n_embd_kv = N_EMBD // N_HEAD * N_HEAD_KV
    # No output.weight: llama.cpp then ties the output to token_embd.
    matrix("token_embd.weight", n_vocab, N_EMBD)
    norm("output_norm.weight")
    for i in range(N_LAYER):
        norm(f"blk.{i}.attn_norm.weight")
        matrix(f"blk.{i}.attn_q.weight", N_EMBD, N_EMBD)
        matrix(f"blk.{i}.attn_k.weight", n_embd_kv, N_EMBD)
        matrix(f"blk.{i}.attn_v.weight", n_embd_kv, N_EMBD)
        matrix(f"blk.{i}.attn_output.weight", N_EMBD, N_EMBD)
        norm(f"blk.{i}.ffn_norm.weight")
        matrix(f"blk.{i}.ffn_gate.weight", N_FF, N_EMBD)
        matrix(f"blk.{i}.ffn_up.weight", N_FF, N_EMBD)
        matrix(f"blk.{i}.ffn_down.weight", N_EMBD, N_FF)
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
    args = parser.parse_args(argv)
    try:
        if args.out:
            write(args.out, llama_server.vocab_path())
            path = args.out
        else:
            path = cached_model()
    except OSError as e:
        print(f"tiny_gguf: {e}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
