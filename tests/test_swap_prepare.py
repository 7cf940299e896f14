"""The swap library makes a program's host copies ready before its first release.

A first release used to pin host memory as large as the program's GPU memory on the
handoff path (0.6 s a GiB on a VM, ten times the copy). The library now does it ahead,
while the program is idle, and the release finds it done. The fake driver is the
witness: it logs each cuMemHostRegister (when, how many bytes) beside every launch,
and keeps the program's physical memory in a file; the program checks its memory's
contents on each request.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from helpers.commands import vramlock
from helpers.net import accepts, free_ports
from helpers.processes import Spawn, wait_until
from helpers.serve import call
from helpers.swap_rig import Rig, ask, read_line, swap_copies, take_turn

from vramlock.procfs import descendants


def registered(rig: Rig) -> int:
    """The bytes the fake driver was asked to lock so far."""
    return sum(n for _, n in rig.launches("register"))


def server(rig: Rig, spawn: Spawn, **env: str) -> int:
    """The program as a server idle between requests, under swap; its port."""
    (port,) = free_ports(1)
    rig.run(spawn, "60", env=dict(rig.env, SWAP_PROG_LISTEN=str(port), **env))
    wait_until(lambda: accepts(port))
    return port


def swapped_once(rig: Rig, spawn: Spawn) -> list[str]:
    """A member of the test's own takes the token: what it saw there (its line)."""
    holder = rig.holder(spawn)
    held = read_line(holder)
    assert holder.stdin is not None
    holder.stdin.close()
    assert read_line(holder)[:1] == ["leaving"]
    return held


def test_an_idle_program_s_host_copies_are_ready_before_its_first_release(
    rig: Rig, spawn: Spawn
) -> None:
    port = server(rig, spawn)
    resident = int(rig.phys.read_text())
    assert resident > 0
    # Idle: every byte it holds gets its host copy, locked, without anybody waiting.
    wait_until(lambda: registered(rig) == resident, timeout=30)
    last = rig.launches("register")[-1][0]
    assert all(end < last for _, end in rig.launches()), "prepared while the program ran"
    before = len(rig.launches("register"))
    held = swapped_once(rig, spawn)
    assert held[:1] == ["held"] and int(held[2]) == 0  # its memory left the "GPU"
    assert len(rig.launches("register")) == before  # the release locked nothing more
    status, _, body = call(port, "POST", "/work", {})
    assert (status, body) == (200, b"round 1\n")  # its contents, checked by the program


def test_with_prepare_off_the_first_release_locks_the_copies_itself(rig: Rig, spawn: Spawn) -> None:
    port = server(rig, spawn, VRAMLOCK_SWAP_PREPARE="0")
    resident = int(rig.phys.read_text())
    status, _, body = call(port, "POST", "/work", {})
    assert (status, body) == (200, b"round 1\n")
    time.sleep(2.5)  # idle for longer than the library waits before it prepares
    assert registered(rig) == 0
    held = swapped_once(rig, spawn)
    assert int(held[2]) == 0
    assert registered(rig) == resident  # the release locked them, on the handoff path
    status, _, body = call(port, "POST", "/work", {})
    assert (status, body) == (200, b"round 2\n")


def test_a_busy_program_is_not_prepared_under(rig: Rig, spawn: Spawn) -> None:
    # The plain program launches kernels without a pause for its whole run: the library
    # must not lock host memory between its launches.
    job = rig.run(spawn, "3")
    assert read_line(job) == ["ready"]
    out, err = job.communicate(timeout=60)
    assert job.returncode == 0, (out, err)
    assert registered(rig) == 0


def copied_out(rig: Rig, since: int = 0) -> int:
    """The bytes copied to the host on a stream (the library's copies) since ``since`` ns."""
    return sum(n for t, n in rig.launches("dtoh") if t >= since)


def test_an_idle_program_s_memory_is_copied_ahead_and_its_first_release_copies_nothing(
    rig: Rig, spawn: Spawn
) -> None:
    # Idle, its memory goes to the host copies ahead (the fake's log of copies out), and
    # is digested there: its first release finds every segment unchanged and copies none
    # of it, where a first release used to copy it all. Its contents come back whole.
    port = server(rig, spawn)
    resident = int(rig.phys.read_text())
    wait_until(lambda: copied_out(rig) >= resident, timeout=30)
    time.sleep(1.0)  # its digests: a few MiB hashed on the host, a few ms
    before = time.monotonic_ns()
    held = swapped_once(rig, spawn)
    assert int(held[2]) == 0  # its memory left the "GPU"
    assert copied_out(rig, before) == 0
    status, _, body = call(port, "POST", "/work", {})
    assert (status, body) == (200, b"round 1\n")


def test_memory_changed_after_it_was_copied_ahead_is_copied_again(rig: Rig, spawn: Spawn) -> None:
    # A request adds one to every buffer after the copy ahead: every segment differs from
    # its digest, so the release copies it all, and the program finds its contents as it
    # left them (it checks them on the next request).
    port = server(rig, spawn)
    resident = int(rig.phys.read_text())
    wait_until(lambda: copied_out(rig) >= resident, timeout=30)
    time.sleep(1.0)
    status, _, body = call(port, "POST", "/work", {})
    assert (status, body) == (200, b"round 1\n")
    before = time.monotonic_ns()
    held = swapped_once(rig, spawn)
    assert int(held[2]) == 0
    assert copied_out(rig, before) > 0
    status, _, body = call(port, "POST", "/work", {})
    assert (status, body) == (200, b"round 2\n")


def test_a_host_short_of_memory_prepares_nothing_until_it_has_it(
    rig: Rig, spawn: Spawn, tmp_path: Path
) -> None:
    # Pinned memory cannot be reclaimed: nothing is locked ahead past what the host can
    # spare (MemAvailable above max(1 GiB, 5 % of MemTotal) once locked), asked at each
    # step, so that several programs preparing at once stop at the margin.
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal: 16777216 kB\nMemAvailable: 524288 kB\n")
    server(rig, spawn, VRAMLOCK_SWAP_MEMINFO=str(meminfo))
    resident = int(rig.phys.read_text())
    time.sleep(2.5)  # idle for longer than the library waits before it prepares
    assert registered(rig) == 0
    meminfo.write_text("MemTotal: 16777216 kB\nMemAvailable: 8388608 kB\n")
    wait_until(lambda: registered(rig) == resident, timeout=30)


def test_a_release_waits_for_one_step_of_the_copy_ahead_not_for_all_of_it(
    rig: Rig, spawn: Spawn
) -> None:
    # Over a slow link (each copy out 100 ms) a step of the copy ahead holds the table lock
    # most of a second, and the thread takes the next at once while the program is idle.
    # A release asked for meanwhile gets the lock once the step in progress is over, not
    # once the copy ahead is done: it makes that nothing and copies everything itself.
    size = 256 << 20
    err_file = rig.tmp / "stderr"
    env = dict(rig.env, VRAMLOCK_SWAP_DEBUG="1", FAKE_CUDA_DTOH_MS="100")
    with err_file.open("w") as err:
        job, _ = delta_job(rig, spawn, size, env=env, stderr=err)
    wait_until(lambda: copied_out(rig) > 0, timeout=30)  # the copy ahead has begun
    take_turn(rig, spawn)
    assert job.stdin is not None
    assert ask(job, "check") == ["ok"]
    job.stdin.close()
    assert read_line(job) == ["done"]
    assert job.wait(30) == 0
    trace = err_file.read_text()
    assert swap_copies(trace)[:1] == [(size, size)], trace
    assert "made ahead" not in trace.split("released")[0], trace


def test_nothing_is_prepared_while_the_program_captures_a_cuda_graph(
    rig: Rig, spawn: Spawn, tmp_path: Path
) -> None:
    # A program idle with a capture open (begun on one request, ended on the next): pinning
    # or synchronizing from the library's thread meanwhile would make the driver refuse
    # the call and invalidate the program's graph, whose capture then fails at its end
    # (as the fake driver does). Its copies are made once the capture is over.
    capture = tmp_path / "capture"
    capture.touch()
    port = server(rig, spawn, SWAP_PROG_CAPTURE=str(capture))
    resident = int(rig.phys.read_text())
    status, _, body = call(port, "POST", "/work", {})
    assert (status, body) == (200, b"round 1\n")  # capturing from now on
    time.sleep(2.5)  # idle for longer than the library waits before it prepares
    assert registered(rig) == 0
    capture.unlink()
    status, _, body = call(port, "POST", "/work", {})
    assert (status, body) == (200, b"round 2\n")  # captured: its graph was not broken
    wait_until(lambda: registered(rig) == resident, timeout=30)


def delta_job(
    rig: Rig, spawn: Spawn, size: int, env: dict[str, str] | None = None, **kw: object
) -> tuple[subprocess.Popen[str], int]:
    """``vramlock run --release swap -- delta_prog SIZE`` (bytes, in whole MiB), told on
    its stdin, once the program says it is ready: the run and the program's pid."""
    argv = vramlock("run", "--arena", str(rig.arena), "--min-hold", "0", "--release", "swap",
                    "--", str(rig.fakes.delta_program), str(size >> 20))  # fmt: skip
    job = spawn(argv, env=rig.env if env is None else env, stdin=subprocess.PIPE, **kw)
    assert read_line(job) == ["ready"]
    (program,) = descendants(job.pid)
    return job, program


def host_copies(pid: int, size: int) -> int:
    """How many anonymous mappings ``size`` bytes long ``pid`` has (a host copy made ahead
    is one: its pages are advised apart, so the kernel merges it with no neighbour)."""
    count = 0
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        fields = line.split()
        start, end = (int(x, 16) for x in fields[0].split("-"))
        count += len(fields) == 5 and end - start == size
    return count


def test_an_allocation_freed_after_its_copy_was_made_gives_the_copy_back(
    rig: Rig, spawn: Spawn
) -> None:
    # Its host copy made and locked ahead, the program frees the allocation: every chunk
    # locked is unlocked again (the fake driver logs both, and refuses to unlock a range it
    # did not lock) and the copy is unmapped; nothing is prepared for it any more.
    size = 64 << 20
    job, program = delta_job(rig, spawn, size)
    wait_until(lambda: registered(rig) == size, timeout=30)
    wait_until(lambda: copied_out(rig) == size, timeout=30)  # and copied ahead
    assert host_copies(program, size) == 1
    assert job.stdin is not None
    assert ask(job, "free") == ["freed"]
    unlocked = rig.launches("unregister")
    assert len(unlocked) == len(rig.launches("register")) == size // (32 << 20)
    assert sum(n for _, n in unlocked) == size
    assert host_copies(program, size) == 0
    time.sleep(1.5)  # longer than the library waits once allocations stand still
    assert registered(rig) == size
    job.stdin.close()
    assert read_line(job) == ["done"]
    assert job.wait(30) == 0


def test_a_program_that_cannot_be_swapped_any_more_gives_its_copies_back(
    rig: Rig, spawn: Spawn
) -> None:
    # Prepared, the program then uses what cannot be swapped (managed memory here; CUDA
    # IPC or an exported handle, as NCCL's first collective may, the same): no release
    # will ever use its host copies, and they are page-locked host memory as large as its
    # GPU memory, which nothing else may use. They go back.
    size = 64 << 20
    job, program = delta_job(rig, spawn, size)
    wait_until(lambda: copied_out(rig) == size, timeout=30)  # made and copied ahead
    assert job.stdin is not None
    assert ask(job, "managed") == ["managed"]
    wait_until(lambda: sum(n for _, n in rig.launches("unregister")) == size, timeout=10)
    assert host_copies(program, size) == 0
    assert ask(job, "check") == ["ok"]
    job.stdin.close()
    assert read_line(job) == ["done"]
    assert job.wait(30) == 0


def test_a_write_during_the_copy_ahead_is_copied_at_the_release(rig: Rig, spawn: Spawn) -> None:
    # The program writes one byte of a chunk the copy ahead has already copied, while that
    # copy is still under way (its writes take no lock of the library's): the digests made
    # ahead describe the host copy, not the GPU, so the release finds that one segment
    # changed and copies it, and only it; the program finds its byte after the restore.
    size, segment = 64 << 20, 256 << 10
    err_file = rig.tmp / "stderr"
    env = dict(rig.env, VRAMLOCK_SWAP_DEBUG="1", FAKE_CUDA_DTOH_MS="300")
    with err_file.open("w") as err:
        job, _ = delta_job(rig, spawn, size, env=env, stderr=err)
    assert job.stdin is not None
    wait_until(lambda: copied_out(rig) > 0, timeout=30)  # its first chunk is copied
    assert ask(job, "poke 100 1") == ["poked"]  # in that chunk, while the second is being copied
    assert copied_out(rig) < size  # the copy ahead was still under way
    wait_until(lambda: "made ahead" in err_file.read_text(), timeout=30)
    take_turn(rig, spawn)
    assert ask(job, "check") == ["ok"]
    job.stdin.close()
    assert read_line(job) == ["done"]
    assert job.wait(30) == 0
    assert swap_copies(err_file.read_text()) == [(size, segment)]


def released_after_copies_made_ahead(
    rig: Rig, spawn: Spawn, size: int, **env: str
) -> tuple[str, list[tuple[int, int]]]:
    """A program of ``size`` bytes, idle until its copies are made ahead, then released
    and restored, its contents checked: the library's trace, and the fake's digest
    launches before the release."""
    err_file = rig.tmp / "stderr"
    with err_file.open("w") as err:
        job, _ = delta_job(rig, spawn, size, env=dict(rig.env, VRAMLOCK_SWAP_DEBUG="1", **env),
                           stderr=err)  # fmt: skip
    assert job.stdin is not None
    wait_until(lambda: "made ahead" in err_file.read_text(), timeout=30)
    before = rig.launches("digest")
    take_turn(rig, spawn)
    assert ask(job, "check") == ["ok"]
    job.stdin.close()
    assert read_line(job) == ["done"]
    assert job.wait(30) == 0
    return err_file.read_text(), before


def test_the_copies_made_ahead_are_digested_by_the_kernel_reading_them(
    rig: Rig, spawn: Spawn
) -> None:
    # The CPU digests about 1 GB/s: a 5 GiB server's copies were not digested in the 8 s
    # it sat idle, and its first release copied 4 GiB. The kernel reads the host copy
    # instead (registered device-mapped), one registered piece of 32 MiB at a launch: the
    # fake's log shows those launches before the release, which copies nothing.
    size = 96 << 20
    trace, before = released_after_copies_made_ahead(rig, spawn, size)
    assert len(before) >= size // (32 << 20), before
    assert "on the CPU" not in trace
    assert swap_copies(trace) == [(size, 0)]


def test_where_the_kernel_cannot_read_the_host_copy_the_cpu_digests_it(
    rig: Rig, spawn: Spawn
) -> None:
    # A driver that gives registered memory no device address: the library says so once
    # and digests on the CPU, as before; the first release still copies nothing.
    size = 64 << 20
    trace, before = released_after_copies_made_ahead(rig, spawn, size, FAKE_CUDA_NO_HOST_MAP="1")
    assert before == []
    assert trace.count("host copy digested on the CPU: the kernel cannot read it") == 1, trace
    assert swap_copies(trace) == [(size, 0)]


def test_a_child_forked_after_the_copies_were_made_does_not_share_them(
    rig: Rig, spawn: Spawn
) -> None:
    # The host copies are mapped MADV_DONTFORK: a child forked afterwards (a worker pool's)
    # does not have them, so nothing of it shares pages the GPU writes into, and the
    # parent's release and restore go on as before.
    size = 64 << 20
    job, program = delta_job(rig, spawn, size)
    wait_until(lambda: copied_out(rig) == size, timeout=30)
    assert job.stdin is not None
    words = ask(job, "fork")
    assert words[:1] == ["child"]
    child = int(words[1])
    try:
        assert host_copies(program, size) == 1 and host_copies(child, size) == 0
        assert ask(job, f"poke {size // 2} 1") == ["poked"]
        take_turn(rig, spawn)
        assert ask(job, "check") == ["ok"]
    finally:
        os.kill(child, signal.SIGKILL)
    job.stdin.close()
    assert read_line(job) == ["done"]
    assert job.wait(30) == 0
