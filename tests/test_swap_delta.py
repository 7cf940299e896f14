"""A release copies out only what changed since the host copy was made, against the fake
driver of test_swap.py, whose digest kernel is digest.h's host reference.

The witnesses: the program's own check of every byte after the swaps
(tests/fake_cuda/delta_prog.c keeps a mirror of its memory), the library's trace of what
each release copied (VRAMLOCK_SWAP_DEBUG), and the fake driver's launch log, where the
library's digest launches are told apart from the program's.
"""

from __future__ import annotations

import hashlib
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from helpers.commands import vramlock
from helpers.processes import Spawn
from helpers.swap_rig import (
    FAKES,
    SWAP_SOURCES,
    Rig,
    ask,
    read_line,
    swap_copies,
    swap_marks,
    take_turn,
    turns_then_stop,
)

from vramlock.gpu import swap
from vramlock.gpu.swap import gen_digest

pytestmark = swap_marks()

SEGMENT = 256 << 10  # digest.h's DIGEST_SEGMENT
MIB = 32
SIZE = MIB << 20
P = (1 << 61) - 1


def poke_between_swaps(rig: Rig, spawn: Spawn, pokes: list[tuple[int, int]],
                       **env: str) -> str:  # fmt: skip
    """``delta_prog`` under ``--release swap``: swapped once, its bytes at each (offset,
    length) of ``pokes`` flipped, swapped again; then it checks every byte. Its stderr."""
    err_file = rig.tmp / "stderr"
    argv = vramlock("run", "--arena", str(rig.arena), "--min-hold", "0", "--release", "swap",
                    "--", str(rig.fakes.delta_program), str(MIB))  # fmt: skip
    with err_file.open("w") as err:
        job = spawn(argv, env=dict(rig.env, VRAMLOCK_SWAP_DEBUG="1", **env),
                    stdin=subprocess.PIPE, stderr=err)  # fmt: skip
    assert read_line(job) == ["ready"]
    assert job.stdin is not None
    turns = [take_turn(rig, spawn)]
    for offset, length in pokes:
        assert ask(job, f"poke {offset} {length}") == ["poked"]
    turns.append(take_turn(rig, spawn))
    assert ask(job, "check") == ["ok"]  # every byte as the program last wrote it
    job.stdin.close()
    assert read_line(job) == ["done"]
    assert job.wait(30) == 0
    assert all(t.phys == (0, 0) for t in turns), turns
    return err_file.read_text()


@pytest.mark.parametrize(
    ("pokes", "segments"),
    [
        ([], 0),
        ([(SIZE // 2 + 12345, 1)], 1),  # one byte
        ([(SIZE - 4, 4)], 1),  # the very last 32-bit word
        ([(8 * SEGMENT - 2, 4)], 2),  # across a segment boundary
        ([(0, 1), (SIZE - 1, 1)], 2),  # both ends: two copies
    ],
    ids=["nothing", "one-byte", "last-word", "boundary", "both-ends"],
)
def test_a_release_copies_only_the_segments_that_changed(
    rig: Rig, spawn: Spawn, pokes: list[tuple[int, int]], segments: int
) -> None:
    err = poke_between_swaps(rig, spawn, pokes)
    first, second = swap_copies(err)
    assert first == (SIZE, SIZE)  # the first release copies everything (and digests it)
    assert second == (SIZE, segments * SEGMENT), err
    # Two digests, one a release, both the library's own: not among the program's launches.
    assert len(rig.launches("digest")) == 2
    assert not set(rig.launches("digest")) & set(rig.launches())


def test_without_the_kernel_a_release_copies_everything(rig: Rig, spawn: Spawn) -> None:
    # A driver that cannot load the PTX (older than the PTX ISA it declares, no JIT): the
    # release goes on, copying all of it, and says why in the trace.
    err = poke_between_swaps(rig, spawn, [(SIZE // 3, 1)], FAKE_CUDA_NO_MODULE="1")
    assert swap_copies(err) == [(SIZE, SIZE), (SIZE, SIZE)], err
    assert err.count("digest: the kernel cannot be loaded") == 1, err  # once: not retried
    assert rig.launches("digest") == []


def overlapping(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The intervals of ``a`` that overlap one of ``b``."""
    return [(s, e) for s, e in a if any(s <= end and e >= start for start, end in b)]


def test_the_digest_runs_with_the_program_stopped_and_before_the_turn(
    rig: Rig, spawn: Spawn
) -> None:
    # swap_prog launches kernels all the time: the library's digest launches must fall
    # where the gate holds them all (none of the program's overlaps one), and before the
    # other member holds the token (none during a turn): the library's own GPU work is the
    # command's too.
    stop = rig.tmp / "stop"
    job = rig.run(spawn, "60", env=dict(rig.env, SWAP_PROG_STOP=str(stop)))
    assert read_line(job) == ["ready"]
    turns, _, _ = turns_then_stop(rig, spawn, job, stop, 3)
    digests = rig.launches("digest")
    assert len(digests) >= 3 * 2  # each release, each of the program's allocations
    assert not overlapping(rig.launches(), digests)
    assert not overlapping(digests, [(t.start, t.end) for t in turns])
    assert all(t.phys == (0, 0) for t in turns)


# -- the digest itself


def reference(words: list[int], key: int) -> int:
    """digest.h's definition, in Python's integers: sum of w_i k^i mod 2^61 - 1."""
    return sum(w * pow(key, i, P) for i, w in enumerate(words)) % P


KEYS = (1, 2, P - 1, 0x0123456789ABCDEF)
WORDS = [(i * 2654435761 + 12345) & 0xFFFFFFFF for i in range(SEGMENT // 4)]
# reference(WORDS[:n], key) for each key: the known answers.
KNOWN = {
    SEGMENT // 4: ("0x00007ffef3608000", "0x00b1babe807fd5de", "0x1ffffffe43277fff",
                   "0x0a8f4a771a6ed600"),
    7: ("0x00000002fa8e4d14", "0x00000040c7371a29", "0x1fffffffdaa69d4b",
        "0x061b997aebe0b715"),
}  # fmt: skip

KAT = r"""
#include <stdio.h>
#include "digest.h"
int main(void)
{
    static uint32_t w[%(n)d];
    uint64_t key[DIGEST_LANES] = {%(keys)s}, out[DIGEST_LANES];
    for (size_t i = 0; i < %(n)d; i++)
        w[i] = (uint32_t)(i * 2654435761u + 12345u);
    for (size_t n = %(n)d; n; n = n > 7 ? 7 : 0) {
        digest_words(w, n, key, out);
        for (int l = 0; l < DIGEST_LANES; l++)
            printf("0x%%016llx%%c", (unsigned long long)out[l], l + 1 < DIGEST_LANES ? ' ' : '\n');
    }
    return 0;
}
"""


def test_the_host_reference_digest_gives_the_known_answers(tmp_path: Path) -> None:
    source = tmp_path / "kat.c"
    source.write_text(KAT % {"n": SEGMENT // 4, "keys": ", ".join(f"{k}ULL" for k in KEYS)})
    cc = swap.compiler()
    assert cc is not None
    subprocess.run([cc, "-std=c11", "-O2", "-Wall", "-Wextra", "-Werror", "-I",
                    str(SWAP_SOURCES), "-o", str(tmp_path / "kat"), str(source)],
                   check=True, timeout=120)  # fmt: skip
    out = subprocess.run([str(tmp_path / "kat")], capture_output=True, text=True, check=True)
    lines = [tuple(line.split()) for line in out.stdout.splitlines()]
    assert lines == [KNOWN[SEGMENT // 4], KNOWN[7]]
    # The answers are the definition's, not merely what the C code said once.
    for n, known in KNOWN.items():
        assert [f"0x{reference(WORDS[:n], k):016x}" for k in KEYS] == list(known)


CXX = shutil.which("c++") or shutil.which("g++")


@pytest.mark.skipif(CXX is None, reason="no C++ compiler here")
def test_the_kernels_source_run_on_the_host_gives_the_reference(tmp_path: Path) -> None:
    # digest.cu itself, each CUDA thread a host thread (tests/fake_cuda/digest_on_host.cpp):
    # its split of a segment among threads and blocks adds up to digest.h's definition.
    assert CXX is not None
    prog = tmp_path / "digest_on_host"
    subprocess.run([CXX, "-std=c++17", "-O2", "-Wall", "-Wextra", "-Werror", "-I",
                    str(SWAP_SOURCES), "-pthread", "-o", str(prog),
                    str(FAKES / "digest_on_host.cpp")], check=True, timeout=120)  # fmt: skip
    done = subprocess.run([str(prog), "5"], capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout) == (0, "ok 6\n"), done


def test_the_committed_ptx_is_the_kernels_sources_compiled() -> None:
    header = (SWAP_SOURCES / "digest_ptx.h").read_text()
    recorded = re.search(r'#define DIGEST_SOURCES_SHA256 "([0-9a-f]{64})"', header)
    assert recorded is not None
    # digest.cu or digest.h changed without gen_digest.py run again: the PTX is stale.
    assert recorded[1] == gen_digest.source_hash(), "run vramlock/gpu/swap/gen_digest.py"
    expected = hashlib.sha256()
    for name in ("digest.cu", "digest.h"):
        expected.update(name.encode() + b"\0" + (SWAP_SOURCES / name).read_bytes())
    assert recorded[1] == expected.hexdigest()
    # Loadable by every driver the library runs on (CUDA 10.2: PTX ISA 6.5), on sm_75 on.
    assert '".version 6.5\\n"' in header and '".target sm_75\\n"' in header
    assert '".visible .entry vramlock_digest(\\n"' in header


@pytest.mark.skipif(not (shutil.which("nvcc") and shutil.which("ptxas")), reason="no nvcc here")
def test_the_committed_ptx_is_what_gen_digest_makes() -> None:
    assert gen_digest.header(gen_digest.ptx()) == (SWAP_SOURCES / "digest_ptx.h").read_text()
