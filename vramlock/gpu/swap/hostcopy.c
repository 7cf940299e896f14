/*
 * hostcopy.c: each allocation's host copy in page-locked memory, what a release
 * copies into and a restore copies back from: made a chunk at a time (prepare.c
 * calls it ahead of a release, the release finishes it), kept from one release to the
 * next, unlocked around a park and locked again, freed with the allocation.
 *
 * A chunk is touched before it is locked: mapped with transparent huge pages asked
 * for (a 2 MiB page is one fault where 4 KiB pages are 512), then locked
 * (cuMemHostRegister).
 */
#include "swap.h"

#define PREP_CHUNK COPY_CHUNK
#define HUGE_PAGE (2ULL << 20)
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

/* Touches [p, p + n): MADV_POPULATE_WRITE (Linux 5.14), else a write to every page. */
static void populate(char *p, size_t n)
{
	if (!madvise(p, n, MADV_POPULATE_WRITE))
		return;
	long page = sysconf(_SC_PAGESIZE);
	for (size_t off = 0; off < n; off += (size_t)(page > 0 ? page : 4096))
		((volatile char *)p)[off] = 0;
}

/* Locks bytes [off, off + n) of `p`'s host copy, one piece (PREP_CHUNK at most), in
 * `p`'s context: what a release copies into, and the digest kernel reads. */
static CUresult lock_piece(struct phys *p, size_t off, size_t n)
{
	CUresult r = real_cuCtxSetCurrent(p->ctx);
	return r ? r : real_cuMemHostRegister_v2((char *)p->prep_base + off, n,
						 CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP);
}

/* Unlocks every piece of `p`'s host copy that is locked (the context is the caller's). */
static void unlock_pieces(struct phys *p)
{
	for (size_t off = 0; off < p->pinned; off += PREP_CHUNK)
		real_cuMemHostUnregister((char *)p->prep_base + off);
	p->pinned = 0;
}

/* One more chunk of `p`'s host copy: mapped (the first time), touched and locked;
 * once it is whole, it is `p->host`. With `mu` held. */
CUresult prepare_step(struct phys *p)
{
	if (p->host)
		return CUDA_SUCCESS;
	if (!p->prep_base) {
		size_t len = round_up(p->size, HUGE_PAGE);
		void *m = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
		if (m == MAP_FAILED)
			return CUDA_ERROR_OUT_OF_MEMORY;
		madvise(m, len, MADV_HUGEPAGE); /* a hint: 4 KiB pages work too */
		/* A forked child (a data loader's worker) must not share pages the GPU writes
		 * into: copy-on-write would leave the parent's copy behind the driver's back. */
		madvise(m, len, MADV_DONTFORK);
		p->prep_base = m;
		p->prep_len = len;
		p->prep_done = 0;
	}
	size_t n = p->size - p->prep_done < PREP_CHUNK ? p->size - p->prep_done : PREP_CHUNK;
	populate((char *)p->prep_base + p->prep_done, n);
	CUresult r = lock_piece(p, p->prep_done, n);
	if (r)
		return r;
	p->prep_done += n;
	p->pinned = p->prep_done;
	if (p->prep_done == p->size)
		p->host = p->prep_base;
	return CUDA_SUCCESS;
}

/* ---- host copies unlocked while parked ------------------------------------------
 * The driver's checkpoint of a process takes its locked host memory along, and its
 * restore locks it again: on an H100, restoring a context took 0.24 s alone, 0.50 s
 * with 5 GiB of host memory registered and 1.13 s with 16 GiB (bench/park.py), where
 * locking it ourselves takes ~0.02 s a GiB (transparent huge pages, already touched).
 * So before a park the wrapper has the library unlock its host copies (`unpin`: their
 * contents stay, as memory of the process), and they are locked again piece by piece
 * as the restore copies each piece back (copy_span: the locking of one piece overlaps
 * the copy of the one before), or all at once when the wrapper says `pin` (the
 * contexts came back before the token: docs/swap.md). Only while released. */

/* Unlocks `p`'s host copy, where it is ours; the bytes unlocked. With `mu` held,
 * released. */
size_t host_unpin(struct phys *p)
{
	size_t n = p->pinned;
	if (!p->prep_base || !p->pinned || real_cuCtxSetCurrent(p->ctx))
		return 0;
	unlock_pieces(p);
	return n;
}

/* `p`'s host copy locked again through byte `end` (whole pieces, as prepare_step
 * locked them). Where that fails, copies from it still work, only slower. With `mu`. */
void host_pin_to(struct phys *p, size_t end)
{
	CUresult r = CUDA_SUCCESS;
	end = end < p->prep_done ? end : p->prep_done;
	while (p->prep_base && !r && p->pinned < end) {
		size_t n = p->prep_done - p->pinned < PREP_CHUNK ? p->prep_done - p->pinned : PREP_CHUNK;
		if (!(r = lock_piece(p, p->pinned, n)))
			p->pinned += n;
	}
	if (r)
		TRACE("host copy not locked again: %s; copied from unlocked memory", errname(r));
}

/* `p`'s host copy, whole: what prepare_step has not done yet. With `mu` held. */
CUresult prepare_all(struct phys *p)
{
	CUresult r = CUDA_SUCCESS;
	while (!p->host && !r)
		r = prepare_step(p);
	return r;
}

/* Frees `p`'s host copy, whichever way it was made. With `mu` held. */
void host_free(struct phys *p)
{
	if (p->prep_base) {
		unlock_pieces(p);
		munmap(p->prep_base, p->prep_len);
	} else if (p->host) {
		real_cuMemFreeHost(p->host);
	}
	p->host = p->prep_base = NULL;
	p->prep_len = p->prep_done = 0;
}
