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
 * host copies ready, a step at a time (hostcopy.c's prepare_step: a chunk mapped,
 * touched and locked). Then it copies the memory into them (below). Each step holds
 * `mu`, so a release never sees a chunk half made, and lasts a few milliseconds; between steps the
 * thread waits for the program to be idle again, so that a resident that works is
 * not slowed down. A release finishes whatever is left of an allocation itself.
 *
 * Host memory is finite: an allocation is made ready only where core/hostmem.c says the
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

int prepare_wanted = 1;
static int started;

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
	if (p->pre_len && p->pre_release != engine.releases)
		ahead_drop(p); /* a release came in between: it made the host copy anew */
	return 1;
}

/* The next AHEAD_CHUNK of `p` (mapped at `va`, `len` bytes) copied into its host copy. */
static CUresult ahead_copy(struct phys *p, CUdeviceptr va, size_t len)
{
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

/* The next AHEAD_CHUNK of `p`'s host copy digested by the kernel: 0, or -1 when the
 * kernel cannot read it (the digests are then made on the CPU, from the start). */
static int ahead_gpu_digest(struct phys *p, size_t len)
{
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
		return 0;
	}
	TRACE("host copy digested on the CPU: the kernel cannot read it (%s)", errname(r));
	p->pre_cpu = 1;
	p->pre_hashed = 0;
	return -1;
}

/* The next HASH_CHUNK of `p`'s host copy digested here, with `keys`. */
static void ahead_cpu_digest(struct phys *p, size_t len, const uint64_t *keys)
{
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
}

/* `p`'s copy made ahead and digested (`len` bytes): its digests are what its host copy
 * holds. */
static void ahead_done(struct phys *p, size_t len)
{
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
		p->pre_release = engine.releases;
	}
	if (p->pre_done < len)
		return ahead_copy(p, va, len);
	if (p->pre_hashed < len && !p->pre_cpu && !ahead_gpu_digest(p, len))
		return CUDA_SUCCESS;
	if (p->pre_hashed < len) {
		ahead_cpu_digest(p, len, keys);
		return CUDA_SUCCESS;
	}
	ahead_done(p, len);
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
	struct idleness idle;
	idleness_start(&idle);
	/* Steps one after the other: each holds `mu` a few ms (a release waits at most that),
	 * and between two the program's calls are looked at again. */
	for (int worked = 0;;) {
		int rest = 0;
		struct timespec tick = {0, TICK_NS};
		if (!worked) /* after a step, the next at once while the program stays idle */
			nanosleep(&tick, NULL);
		worked = 0;
		if (!idle_for(&idle, IDLE_MS))
			continue;
		double now = now_ms();
		struct phys *p;
		pthread_mutex_lock(&mu);
		if (is_released() || atomic_load(&closed) || atomic_load(&captures) > 0 ||
		    (!engine.refused[0] && now - table_changed_ms < QUIET_MS)) {
			rest = is_released();
		} else if (engine.refused[0]) {
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
}
