/*
 * prepare.c: the host copies made ready before the first release needs them.
 *
 * A release copies each allocation into page-locked host memory, kept from one
 * release to the next. Made at the first release, that memory costs the waiter most
 * of a first switch: on a VM, touching fresh memory the first time (the host maps
 * each page) and then locking it cost ~0.6 s a GiB, ten times the copy itself.
 *
 * So once the program's allocations have stood still a while and it is idle (no GPU
 * call in flight, none begun for IDLE_MS), a thread of the library's own makes the
 * host copies ready, a step at a time: it maps each with transparent huge pages asked
 * for (a 2 MiB page is one fault where 4 KiB pages are 512), touches a chunk and locks
 * it (cuMemHostRegister). Then it copies the memory into them (below). Each step holds `mu`, so a release
 * never sees a chunk half made, and lasts a few milliseconds; between steps the
 * thread waits for the program to be idle again, so that a resident that works is
 * not slowed down. A release finishes whatever is left of an allocation itself.
 *
 * Host memory is finite: an allocation is made ready only where hostmem.c says the
 * host can spare it, and VRAMLOCK_SWAP_PREPARE=0 in the command's environment turns
 * this off (the first release then pays, as before).
 */
#include "swap.h"

#include "digest.h"

#define PREP_CHUNK COPY_CHUNK
#define AHEAD_CHUNK (256ULL << 20) /* copied ahead in one step: ~5 ms */
#define HASH_CHUNK (16ULL * DIGEST_SEGMENT) /* digested on the host in one step */
#define IDLE_MS 50.0
#define QUIET_MS 1000.0
#define TICK_NS 20000000L   /* how often the thread looks, while it has work */
#define REST_NS 200000000L  /* and while it has none */
#define HUGE_PAGE (2ULL << 20)
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

atomic_ulong gate_entries;
double table_changed_ms;
int prepare_wanted = 1;
static int started;
/* The control thread waits for `mu` (a release, a restore): the thread takes no step
 * meanwhile. A mutex is not fair: taken again at once after each step, it may go to the
 * thread again and again (a waiter was seen kept out for seconds by steps of 4 ms). */
static atomic_int control_waits;

void control_lock(void)
{
	atomic_fetch_add(&control_waits, 1);
	pthread_mutex_lock(&mu);
	atomic_fetch_sub(&control_waits, 1);
}

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

/* Unlocks every host copy of ours; the bytes unlocked. With `mu` held, released. */
size_t host_unpin_all(void)
{
	size_t n = 0;
	for (struct phys *p = physes; p; p = p->next) {
		if (!p->prep_base || !p->pinned || real_cuCtxSetCurrent(p->ctx))
			continue;
		n += p->pinned;
		unlock_pieces(p);
	}
	real_cuCtxSetCurrent(NULL);
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

/* Every host copy locked again. With `mu` held. */
void host_pin_all(void)
{
	for (struct phys *p = physes; p; p = p->next)
		host_pin_to(p, p->prep_done);
	real_cuCtxSetCurrent(NULL);
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

/* ---- copies made ahead ----------------------------------------------------------
 * Once its host copy is ready, an allocation the program has mapped is copied into it
 * while the program is idle, and that copy is digested segment by segment: by the GPU
 * kernel reading the host copy across the bus (delta_digest_host), or, where the driver
 * gives it no device address, here on the CPU with the same arithmetic (digest.h), which
 * is ~50 times slower. Either way the digests describe what the host copy
 * holds, whatever the GPU did meanwhile: at the first release, a segment whose GPU
 * digest equals them is unchanged and not copied again, as at any later release, and a
 * segment the program changed since (or while it was copied) differs and is copied. */

/* Where `p` is mapped from its start, readable by its own device: its address and the
 * length a release copies (engine.c's find_copy_places); 0 when it is not. */
static CUdeviceptr ahead_place(struct phys *p, size_t *len)
{
	CUdevice dev;
	if (real_cuCtxSetCurrent(p->ctx) || real_cuCtxGetDevice(&dev) || dev != p->prop.location.id)
		return 0;
	for (size_t i = 0; i < nmaps; i++) {
		struct mapping *m = &maps[i];
		if (m->phys != p || m->offset)
			continue;
		*len = m->size < p->size ? m->size : p->size;
		return *len % 16 == 0 && device_reads(m, dev) ? m->va : 0;
	}
	return 0;
}

/* digest_words for the four lanes at once (the same arithmetic, in one pass). */
static void host_digest(const uint32_t *w, size_t n, const uint64_t *k, uint64_t *out)
{
	_Static_assert(DIGEST_LANES == 4, "four lanes");
	uint64_t h0 = 0, h1 = 0, h2 = 0, h3 = 0;
	for (size_t i = n; i-- > 0;) {
		h0 = digest_add(digest_mul(h0, k[0]), w[i]);
		h1 = digest_add(digest_mul(h1, k[1]), w[i]);
		h2 = digest_add(digest_mul(h2, k[2]), w[i]);
		h3 = digest_add(digest_mul(h3, k[3]), w[i]);
	}
	out[0] = h0, out[1] = h1, out[2] = h2, out[3] = h3;
}

static void ahead_drop(struct phys *p)
{
	free(p->pre_digest);
	p->pre_digest = NULL;
	p->pre_done = p->pre_hashed = p->pre_len = 0;
	p->pre_cpu = 0;
	p->pre_ms = 0;
}

/* Does `p` want a step of its copy ahead? (Its host copy is ready, it has no digests
 * yet, and it is mapped where it can be read.) With `mu` held. */
static int ahead_wanted(struct phys *p)
{
	if (!p->host || p->digest || p->pre_failed || !p->real)
		return 0;
	if (p->pre_len && p->pre_release != release_count)
		ahead_drop(p); /* a release came in between: it made the host copy anew */
	return 1;
}

/* One step of `p`'s copy ahead: a piece copied, or a piece digested, or, all done,
 * the digests handed to delta.c as those of the host copy. With `mu` held. */
static CUresult ahead_step(struct phys *p)
{
	const uint64_t *keys = delta_keys();
	size_t len = 0;
	CUdeviceptr va = ahead_place(p, &len);
	if (!keys || !va || !delta_warm(p->ctx))
		return CUDA_ERROR_NOT_FOUND;
	if (!p->pre_len || len != p->pre_len) {
		ahead_drop(p);
		size_t n = (len + DIGEST_SEGMENT - 1) / DIGEST_SEGMENT * DIGEST_LANES;
		if (!(p->pre_digest = malloc(n * sizeof *p->pre_digest)))
			return CUDA_ERROR_OUT_OF_MEMORY;
		p->pre_len = len;
		p->pre_release = release_count;
	}
	if (p->pre_done < len) {
		CUstream *streams;
		size_t n = len - p->pre_done < AHEAD_CHUNK ? len - p->pre_done : AHEAD_CHUNK;
		CUresult r = streams_of(p->ctx, &streams);
		for (size_t off = 0, c; !r && off < n; off += c) {
			c = n - off < COPY_CHUNK ? n - off : COPY_CHUNK;
			r = real_cuMemcpyDtoHAsync_v2((char *)p->host + p->pre_done + off,
						      va + p->pre_done + off, c, streams[0]);
		}
		if (!r)
			r = real_cuStreamSynchronize(streams[0]);
		if (!r)
			p->pre_done += n;
		return r;
	}
	if (p->pre_hashed < len && !p->pre_cpu) {
		/* The kernel digests the host copy, a registered piece (PREP_CHUNK) at a time:
		 * one piece's device address says nothing of the next's. */
		size_t end = p->pre_hashed + AHEAD_CHUNK < len ? p->pre_hashed + AHEAD_CHUNK : len;
		CUresult r = p->host == p->prep_base ? CUDA_SUCCESS : CUDA_ERROR_NOT_FOUND;
		double t0 = now_ms();
		for (size_t off = p->pre_hashed, stop; off < end && !r; off = stop) {
			stop = off / PREP_CHUNK * PREP_CHUNK + PREP_CHUNK;
			stop = stop < end ? stop : end;
			r = delta_digest_host(p->ctx, (char *)p->host + off, stop - off,
					      p->pre_digest + off / DIGEST_SEGMENT * DIGEST_LANES);
		}
		if (!r) {
			p->pre_hashed = end;
			p->pre_ms += now_ms() - t0;
			return CUDA_SUCCESS;
		}
		TRACE("host copy digested on the CPU: the kernel cannot read it (%s)", errname(r));
		p->pre_cpu = 1;
		p->pre_hashed = 0;
	}
	if (p->pre_hashed < len) {
		const uint32_t *w = (const uint32_t *)p->host;
		size_t words = len / 4, end = p->pre_hashed + HASH_CHUNK;
		double t0 = now_ms();
		for (size_t off = p->pre_hashed; off < len && off < end; off += DIGEST_SEGMENT) {
			size_t first = off / 4, left = words - first, seg = DIGEST_SEGMENT / 4;
			host_digest(w + first, left < seg ? left : seg, keys,
				    p->pre_digest + off / DIGEST_SEGMENT * DIGEST_LANES);
		}
		p->pre_hashed = end < len ? end : len;
		p->pre_ms += now_ms() - t0;
		return CUDA_SUCCESS;
	}
	free(p->digest);
	p->digest = p->pre_digest;
	p->digest_len = len;
	p->digest_host = p->host;
	p->pre_digest = NULL;
	TRACE("host copy of %zu bytes made ahead (digested in %.1f ms, %s)", len, p->pre_ms,
	      p->pre_cpu ? "CPU" : "GPU");
	p->pre_done = p->pre_hashed = p->pre_len = 0;
	p->pre_cpu = 0;
	p->pre_ms = 0;
	return CUDA_SUCCESS;
}

/* The first allocation whose copy is not ready and may be made now, or NULL.
 * With `mu` held. */
static struct phys *next_to_prepare(void)
{
	/* Asked again at every step: several programs preparing at once each see what the
	 * others have locked so far, and the one that would go past the margin stops. */
	for (struct phys *p = physes; p; p = p->next)
		if (!p->host && !p->prep_failed && p->real &&
		    hostmem_spare(p->size - p->prep_done, NULL))
			return p;
	return NULL;
}

static struct phys *next_ahead(void)
{
	for (struct phys *p = physes; p; p = p->next)
		if (ahead_wanted(p))
			return p;
	return NULL;
}

/* One allocation's host copy and digests freed, once the process cannot be swapped any
 * more: 1, or 0 when none is left. With `mu` held, never while released. */
static int give_back(void)
{
	for (struct phys *p = physes; p; p = p->next) {
		if (!p->host && !p->prep_base)
			continue;
		real_cuCtxSetCurrent(p->ctx); /* unpinning, as pinning, is done in a context */
		host_free(p);
		ahead_drop(p);
		free(p->digest);
		p->digest = NULL;
		p->digest_len = 0;
		return 1;
	}
	return 0;
}

static void *preparer(void *arg)
{
	(void)arg;
	unsigned long seen = atomic_load(&gate_entries);
	double busy_at = now_ms();
	/* Steps one after the other: each holds `mu` a few ms (a release waits at most that),
	 * and between two the program's calls are looked at again. */
	for (int worked = 0;;) {
		int rest = 0;
		struct timespec tick = {0, TICK_NS};
		if (!worked) /* after a step, the next at once while the program stays idle */
			nanosleep(&tick, NULL);
		worked = 0;
		unsigned long entries = atomic_load(&gate_entries);
		double now = now_ms();
		if (entries != seen || atomic_load(&inflight) > 0) {
			seen = entries;
			busy_at = now;
			continue;
		}
		if (now - busy_at < IDLE_MS || atomic_load(&control_waits))
			continue;
		struct phys *p;
		pthread_mutex_lock(&mu);
		if (released || atomic_load(&closed) || atomic_load(&captures) > 0 ||
		    (!refused[0] && now - table_changed_ms < QUIET_MS)) {
			rest = released;
		} else if (refused[0]) {
			/* No release will use the copies: pinned, they are memory nobody else has. */
			worked = give_back();
			rest = !worked;
		} else if ((p = next_to_prepare())) {
			CUresult r = prepare_step(p);
			worked = !r;
			if (r) {
				p->prep_failed = 1;
				TRACE("host copy of %zu bytes not made ready: %s", p->size, errname(r));
			} else if (p->host) {
				TRACE("host copy of %zu bytes ready", p->size);
			}
		} else if ((p = next_ahead())) {
			CUresult r = ahead_step(p);
			worked = !r;
			if (r) {
				p->pre_failed = 1;
				ahead_drop(p);
				TRACE("host copy of %zu bytes not made ahead: %s", p->size, errname(r));
			}
		} else {
			rest = 1;
		}
		real_cuCtxSetCurrent(NULL);
		pthread_mutex_unlock(&mu);
		if (rest) {
			struct timespec pause = {0, REST_NS};
			nanosleep(&pause, NULL);
		}
	}
	return NULL;
}

/* Starts the thread, once, unless VRAMLOCK_SWAP_PREPARE=0. */
void prepare_start(void)
{
	if (started || !prepare_wanted || !real_cuMemHostRegister_v2 ||
	    !real_cuMemHostUnregister)
		return;
	started = !start_thread(preparer);
}

/* In a forked child: the thread is its parent's. */
void prepare_forget(void)
{
	started = 0;
	atomic_store(&control_waits, 0);
}
