/*
 * engine.c: the swap itself. A release copies every physical allocation out to
 * pinned host memory and releases it; a restore creates new physical memory,
 * maps it at the same addresses and copies back. Both run with `mu` held.
 */
#include "swap.h"

/* ---- swapping --------------------------------------------------------------- */

atomic_int captures;

#define COPY_STREAMS 2

/* Streams of our own in each context the copies go through, made once. */
static struct {
	CUcontext ctx;
	CUstream stream[COPY_STREAMS];
} copy_ctx[MAX_CONTEXTS];
static size_t ncopy_ctx;

/* The contexts whose stack limit a release lowered, and what it was (below). */
int stack_wanted = 1;
static struct {
	CUcontext ctx;
	size_t was;
} lowered[MAX_CONTEXTS];
static size_t nlowered;

/* In a forked child: the streams are its parent's. */
void engine_forget(void)
{
	ncopy_ctx = 0;
	nlowered = 0;
	atomic_store(&captures, 0);
	delta_forget();
}

CUresult streams_of(CUcontext ctx, CUstream **out)
{
	for (size_t i = 0; i < ncopy_ctx; i++)
		if (copy_ctx[i].ctx == ctx) {
			*out = copy_ctx[i].stream;
			return CUDA_SUCCESS;
		}
	if (ncopy_ctx == MAX_CONTEXTS)
		return CUDA_ERROR_INVALID_CONTEXT;
	CUresult r = real_cuCtxSetCurrent(ctx);
	for (int k = 0; !r && k < COPY_STREAMS; k++)
		r = real_cuStreamCreate(&copy_ctx[ncopy_ctx].stream[k], CU_STREAM_NON_BLOCKING);
	if (r)
		return r;
	copy_ctx[ncopy_ctx].ctx = ctx;
	*out = copy_ctx[ncopy_ctx++].stream;
	return CUDA_SUCCESS;
}

/* The contexts that own tracked memory, each once, into `seen`: how many. */
static size_t memory_contexts(CUcontext seen[MAX_CONTEXTS])
{
	size_t n = 0;
	for (struct phys *p = physes; p; p = p->next) {
		size_t k = 0;
		while (k < n && seen[k] != p->ctx)
			k++;
		if (k == n && n < MAX_CONTEXTS)
			seen[n++] = p->ctx;
	}
	return n;
}

/* Syncs every context that owns tracked memory, and every stream of ours. */
CUresult sync_all(int ours_only)
{
	CUresult r = CUDA_SUCCESS;
	if (!ours_only) {
		CUcontext seen[MAX_CONTEXTS];
		size_t n = memory_contexts(seen);
		for (size_t i = 0; i < n && !r; i++) {
			r = real_cuCtxSetCurrent(seen[i]);
			if (!r)
				r = real_cuCtxSynchronize();
		}
	}
	for (size_t i = 0; i < ncopy_ctx && !r; i++) {
		r = real_cuCtxSetCurrent(copy_ctx[i].ctx);
		for (int k = 0; !r && k < COPY_STREAMS; k++)
			r = real_cuStreamSynchronize(copy_ctx[i].stream[k]);
	}
	return r;
}

/* Queues the copy of bytes [off, off + len) of `p` (at its copy place), in chunks on
 * two streams taken in turns (`turn`): one stream alone leaves the link idle between
 * copies. `out`: device to host, else back. */
CUresult copy_span(struct phys *p, size_t off, size_t len, int out, size_t *turn)
{
	CUstream *streams;
	CUresult r = streams_of(p->ctx, &streams);
	if (!r)
		r = real_cuCtxSetCurrent(p->ctx);
	for (size_t end = off + len, n; !r && off < end; off += n) {
		n = COPY_CHUNK - off % COPY_CHUNK; /* up to the next multiple: one locked chunk */
		n = end - off < n ? end - off : n;
		CUstream s = streams[(*turn)++ % COPY_STREAMS];
		char *host = (char *)p->host + off;
		if (p->pinned < off + n && p->host == p->prep_base)
			host_pin_to(p, off + n); /* unlocked while parked: locked again here */
		r = out ? real_cuMemcpyDtoHAsync_v2(host, p->copy_va + off, n, s)
			: real_cuMemcpyHtoDAsync_v2(p->copy_va + off, host, n, s);
	}
	return r;
}

/* Every allocation, whole, queued back from host memory (sync_all(1) waits for it). */
static CUresult queue_all_back(void)
{
	size_t turn = 0;
	for (struct phys *p = physes; p; p = p->next) {
		CUresult r = p->copy_len ? copy_span(p, 0, p->copy_len, 0, &turn) : CUDA_SUCCESS;
		if (r)
			return r;
	}
	return CUDA_SUCCESS;
}

static CUresult copy_all_back(void)
{
	CUresult r = queue_all_back();
	return r ? r : sync_all(1);
}

/* Where to copy each physical allocation from (or to): a mapping of it, or a
 * mapping made for the purpose (a handle the program has not mapped). */
static CUresult find_copy_places(void)
{
	for (struct phys *p = physes; p; p = p->next)
		p->copy_va = p->copy_len = 0;
	for (size_t i = 0; i < nmaps; i++) {
		struct phys *p = maps[i].phys;
		if (!p->copy_len && maps[i].offset == 0) {
			p->copy_va = maps[i].va;
			p->copy_len = maps[i].size < p->size ? maps[i].size : p->size;
		}
	}
	for (struct phys *p = physes; p; p = p->next) {
		if (p->copy_len)
			continue;
		size_t g;
		CUresult r = granularity(p->prop.location.id, &g);
		if (!r)
			r = real_cuMemAddressReserve(&p->temp_va, p->size, g, 0, 0);
		if (r)
			return r;
		p->copy_va = p->temp_va;
		p->copy_len = p->size;
	}
	return CUDA_SUCCESS;
}

static CUresult map_temps(void)
{
	for (struct phys *p = physes; p; p = p->next) {
		if (!p->temp_va)
			continue;
		CUmemAccessDesc access = device_access(p->prop.location.id);
		CUresult r = real_cuMemMap(p->temp_va, p->size, 0, p->real, 0);
		if (!r)
			r = real_cuMemSetAccess(p->temp_va, p->size, &access, 1);
		if (r)
			return r;
	}
	return CUDA_SUCCESS;
}

static void drop_temps(void)
{
	for (struct phys *p = physes; p; p = p->next) {
		if (!p->temp_va)
			continue;
		real_cuMemUnmap(p->temp_va, p->size); /* fails harmlessly if never mapped */
		real_cuMemAddressFree(p->temp_va, p->size);
		p->temp_va = 0;
	}
}

/* Unmaps and releases every physical allocation (contents copied already). */
static CUresult let_go(void)
{
	for (size_t i = 0; i < nmaps; i++) {
		CUresult r = real_cuMemUnmap(maps[i].va, maps[i].size);
		if (r)
			return r;
	}
	for (struct phys *p = physes; p; p = p->next) {
		if (!p->real)
			continue;
		CUresult r = real_cuMemRelease(p->real);
		if (r)
			return r;
		p->real = 0;
	}
	return CUDA_SUCCESS;
}

/* New physical memory at the old addresses, as the program had set its access. */
static CUresult take_back(void)
{
	CUresult r = CUDA_SUCCESS;
	for (struct phys *p = physes; p && !r; p = p->next) {
		if (p->real)
			continue;
		r = real_cuCtxSetCurrent(p->ctx);
		if (!r)
			r = real_cuMemCreate(&p->real, p->size, &p->prop, 0);
		if (r)
			p->real = 0;
	}
	for (size_t i = 0; i < nmaps && !r; i++) {
		struct mapping *m = &maps[i];
		r = real_cuMemMap(m->va, m->size, m->offset, m->phys->real, 0);
		if (!r && m->naccess)
			r = real_cuMemSetAccess(m->va, m->size, m->access, m->naccess);
	}
	return r;
}

/* Back to where we were before a swap that failed half-way: whatever is still
 * mapped stays as it is, whatever was released comes back from its host copy
 * (complete: releasing starts only once every copy is done). */
static CUresult undo_release(void)
{
	CUresult r = CUDA_SUCCESS;
	for (struct phys *p = physes; p && !r; p = p->next) {
		p->lost = !p->real;
		if (p->lost)
			r = real_cuMemCreate(&p->real, p->size, &p->prop, 0);
		if (r)
			p->real = 0;
	}
	for (size_t i = 0; i < nmaps && !r; i++) {
		struct mapping *m = &maps[i];
		/* One still mapped fails here, harmlessly: it is what we want. */
		if (real_cuMemMap(m->va, m->size, m->offset, m->phys->real, 0) == CUDA_SUCCESS &&
		    m->naccess)
			r = real_cuMemSetAccess(m->va, m->size, m->access, m->naccess);
	}
	if (!r)
		r = find_copy_places();
	for (struct phys *p = physes; p; p = p->next)
		if (!p->lost)
			p->copy_len = 0; /* its memory never left */
	if (!r)
		r = map_temps();
	if (!r)
		r = copy_all_back();
	drop_temps();
	return r;
}

/* ---- the stack: most of what a released context keeps ----------------------------
 * Once its memory is out, most of what a context still holds is local memory: the
 * per-thread stack, sized for every thread the GPU can run at once (some 260 MiB on an
 * H100 at the default 1 KiB a thread). A release lowers each context's stack limit to its
 * least, and a restore sets back what it was before the program runs again (the program
 * sees and sets its own: hooks.c gates cuCtxGetLimit and cuCtxSetLimit). A context the
 * driver will not lower keeps its stack: nothing else depends on it. Off with
 * VRAMLOCK_SWAP_STACK=0. */

#define CU_LIMIT_STACK_SIZE 0
#define STACK_LEAST 16

static void stack_lower(void)
{
	CUcontext seen[MAX_CONTEXTS];
	size_t n = stack_wanted && real_cuCtxGetLimit && real_cuCtxSetLimit ? memory_contexts(seen)
									     : 0;
	for (size_t i = 0; i < n; i++) {
		size_t was;
		if (real_cuCtxSetCurrent(seen[i]) || real_cuCtxGetLimit(&was, CU_LIMIT_STACK_SIZE) ||
		    was <= STACK_LEAST || real_cuCtxSetLimit(CU_LIMIT_STACK_SIZE, STACK_LEAST))
			continue;
		lowered[nlowered].ctx = seen[i];
		lowered[nlowered++].was = was;
	}
}

/* Each lowered stack as it was; one that cannot be is left lowered for the next try. */
static CUresult stack_back(void)
{
	while (nlowered) {
		CUresult r = real_cuCtxSetCurrent(lowered[nlowered - 1].ctx);
		if (!r)
			r = real_cuCtxSetLimit(CU_LIMIT_STACK_SIZE, lowered[nlowered - 1].was);
		if (r)
			return r;
		nlowered--;
	}
	return CUDA_SUCCESS;
}

double now_ms(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

unsigned long release_count;

/* The bytes the last release copied (of `bytes`: what changed, delta.c). */
static size_t copied_out;

/* `p`'s pinned host copy, made now where prepare.c has not finished it. */
static CUresult pin(struct phys *p)
{
	if (p->host)
		return CUDA_SUCCESS;
	if (real_cuMemHostRegister_v2 && real_cuMemHostUnregister)
		return prepare_all(p);
	/* Pinning needs a context, even for memory every context may use. */
	CUresult r = real_cuCtxSetCurrent(p->ctx);
	if (!r)
		r = real_cuMemHostAlloc(&p->host, p->size, CU_MEMHOSTALLOC_PORTABLE);
	if (r)
		p->host = NULL;
	return r;
}

/* Copies every allocation to pinned host memory (pinned once, kept): the step it
 * failed at in `step`, the bytes there are in `bytes`. With `mu` and the gate closed. */
static CUresult copy_out(const char **step, size_t *bytes)
{
	*step = "pinning host memory";
	CUresult r = hostmem_check(step); /* before pinning: never past what the host has */
	for (struct phys *p = physes; p && !r; p = p->next) {
		r = pin(p);
		*bytes += p->size;
	}
	if (!r) {
		*step = "cuCtxSynchronize";
		r = sync_all(0);
	}
	if (!r) {
		*step = "finding the allocations";
		r = find_copy_places();
	}
	if (!r) {
		*step = "mapping an unmapped allocation";
		r = map_temps();
	}
	if (!r) {
		*step = "copying out";
		r = copy_changed(&copied_out);
	}
	return r;
}

/* Answers a `release`. With `mu` held. A release that fails opens the gate again,
 * unless `stay_closed`. */
void do_release(char *answer, size_t len, int stay_closed)
{
	if (released) {
		snprintf(answer, len, "released");
		return;
	}
	if (refused[0]) {
		snprintf(answer, len, "refused %s", refused);
		return;
	}
	double t0 = now_ms();
	release_count++;
	gate_close_locked();
	if (atomic_load(&captures) > 0) {
		/* Synchronizing would invalidate the capture: the program's graph would be
		 * lost. Captures are short; the wrapper asks again. */
		if (!stay_closed)
			gate_open_locked();
		snprintf(answer, len, "failed a CUDA graph is being captured");
		return;
	}
	size_t bytes = 0;
	const char *step;
	copied_out = 0;
	CUresult r = copy_out(&step, &bytes);
	double t1 = now_ms();
	drop_temps();
	if (!r) {
		step = "releasing";
		r = let_go();
	}
	if (r) {
		say("release failed while %s: %s; the program keeps its GPU memory", step, errname(r));
		CUresult u = undo_release();
		if (u) {
			say("and could not be put back as it was (%s): GPU calls stay blocked", errname(u));
			released = 1; /* never let the program run on memory that is not there */
		} else if (!stay_closed) {
			gate_open_locked();
		}
		snprintf(answer, len, "failed %s: %s", step, errname(r));
		return;
	}
	released = 1;
	double t2 = now_ms();
	stack_lower();
	real_cuCtxSetCurrent(NULL);
	TRACE("released %zu bytes, copied %zu: copy %.1f ms, release %.1f ms, stack %.1f ms",
	      bytes, copied_out, t1 - t0, t2 - t1, now_ms() - t2);
	snprintf(answer, len, "released");
}

/* Answers a `restore`. With `mu` held and the gate closed. */
void do_restore(char *answer, size_t len)
{
	if (!released) {
		snprintf(answer, len, "restored");
		return;
	}
	double t0 = now_ms();
	const char *step = "creating and mapping";
	CUresult r = take_back();
	if (!r) {
		step = "finding the allocations";
		r = find_copy_places();
	}
	if (!r) {
		step = "mapping an unmapped allocation";
		r = map_temps();
	}
	if (!r) {
		step = "copying back";
		r = queue_all_back();
	}
	if (!r) {
		step = "setting the stack limit back"; /* while the copies run */
		r = stack_back();
	}
	if (!r) {
		step = "copying back";
		r = sync_all(1);
	}
	if (!r)
		host_pin_all(); /* what was not copied back, unlocked while parked */
	else
		sync_all(1); /* no copy of ours left running on what is given back below */
	drop_temps();
	if (r) {
		/* The memory is not all there: the program must not run. Give back what was
		 * taken so a later restore starts clean. */
		say("restore failed while %s: %s; GPU calls stay blocked", step, errname(r));
		for (size_t i = 0; i < nmaps; i++)
			real_cuMemUnmap(maps[i].va, maps[i].size);
		for (struct phys *p = physes; p; p = p->next)
			if (p->real && real_cuMemRelease(p->real) == CUDA_SUCCESS)
				p->real = 0;
		snprintf(answer, len, "failed %s: %s", step, errname(r));
		return;
	}
	real_cuCtxSetCurrent(NULL);
	released = 0;
	gate_open_locked();
	TRACE("restored in %.1f ms", now_ms() - t0);
	snprintf(answer, len, "restored");
}
