/*
 * engine.c: the swap itself. A release copies every physical allocation out to
 * pinned host memory and releases it; a restore creates new physical memory,
 * maps it at the same addresses and copies back. Both run with `mu` held.
 */
#include "swap.h"

/* ---- swapping --------------------------------------------------------------- */

/* The contexts whose stack limit a release lowered, and what it was (below). */
int stack_wanted = 1;
static struct {
	CUcontext ctx;
	size_t was;
} lowered[MAX_CONTEXTS];
static size_t nlowered;


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

/* Whether the release may pin what it needs: CUDA_SUCCESS, or CUDA_ERROR_OUT_OF_MEMORY
 * with *step saying why (core/hostmem.c). With `mu` held. */
static CUresult hostmem_check(const char **step)
{
	unsigned long long need = 0;
	for (struct phys *p = physes; p; p = p->next)
		if (!p->host)
			need += p->size - p->prep_done; /* hostcopy.c's chunks are pinned already */
	return hostmem_spare(need, step) ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
}

/* Every host copy locked again (hostcopy.c). With `mu` held. */
static void host_pin_all(void)
{
	for (struct phys *p = physes; p; p = p->next)
		host_pin_to(p, p->prep_done);
	real_cuCtxSetCurrent(NULL);
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

/* A release that failed at `step` (`r`): back as it was, resident, or where that
 * cannot be, released with its GPU calls blocked for good. */
static void release_failed(const char *step, CUresult r, int stay_closed)
{
	say("release failed while %s: %s; the program keeps its GPU memory", step, errname(r));
	CUresult u = undo_release();
	if (u) {
		say("and could not be put back as it was (%s): GPU calls stay blocked", errname(u));
		/* never let the program run on memory that is not there */
		transition(STATE_RELEASING, STATE_RELEASED);
		return;
	}
	transition(STATE_RELEASING, STATE_RESIDENT);
	if (!stay_closed)
		gate_open_locked();
}

/* Answers a `release`. With `mu` held. A release that fails opens the gate again,
 * unless `stay_closed`. */
static void do_release(char *answer, size_t len, int stay_closed)
{
	if (is_released()) {
		snprintf(answer, len, "released");
		return;
	}
	if (engine.refused[0]) {
		snprintf(answer, len, "refused %s", engine.refused);
		return;
	}
	if (transition(STATE_RESIDENT, STATE_RELEASING)) {
		snprintf(answer, len, "failed the process is %s", state_name(engine.state));
		return;
	}
	double t0 = now_ms();
	engine.releases++;
	gate_close_locked();
	if (atomic_load(&captures) > 0) {
		/* Synchronizing would invalidate the capture: the program's graph would be
		 * lost. Captures are short; the wrapper asks again. */
		transition(STATE_RELEASING, STATE_RESIDENT);
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
		release_failed(step, r, stay_closed);
		snprintf(answer, len, "failed %s: %s", step, errname(r));
		return;
	}
	transition(STATE_RELEASING, STATE_RELEASED);
	double t2 = now_ms();
	stack_lower();
	real_cuCtxSetCurrent(NULL);
	TRACE("released %zu bytes, copied %zu: copy %.1f ms, release %.1f ms, stack %.1f ms",
	      bytes, copied_out, t1 - t0, t2 - t1, now_ms() - t2);
	snprintf(answer, len, "released");
}

/* Creates, maps and copies back every allocation: CUDA_SUCCESS, or the error with the
 * step it failed at in `step`. */
static CUresult bring_back(const char **step)
{
	*step = "creating and mapping";
	CUresult r = take_back();
	if (!r) {
		*step = "finding the allocations";
		r = find_copy_places();
	}
	if (!r) {
		*step = "mapping an unmapped allocation";
		r = map_temps();
	}
	if (!r) {
		*step = "copying back";
		r = queue_all_back();
	}
	if (!r) {
		*step = "setting the stack limit back"; /* while the copies run */
		r = stack_back();
	}
	if (!r) {
		*step = "copying back";
		r = sync_all(1);
	}
	if (!r)
		host_pin_all(); /* what was not copied back, unlocked while parked */
	else
		sync_all(1); /* no copy of ours left running on what is given back below */
	drop_temps();
	return r;
}

/* Answers a `restore`. With `mu` held and the gate closed. */
static void do_restore(char *answer, size_t len)
{
	if (!is_released() || transition(engine.state, STATE_RESTORING)) {
		snprintf(answer, len, "restored");
		return;
	}
	double t0 = now_ms();
	const char *step;
	CUresult r = bring_back(&step);
	if (r) {
		/* The memory is not all there: the program must not run. Give back what was
		 * taken so a later restore starts clean. */
		say("restore failed while %s: %s; GPU calls stay blocked", step, errname(r));
		for (size_t i = 0; i < nmaps; i++)
			real_cuMemUnmap(maps[i].va, maps[i].size);
		for (struct phys *p = physes; p; p = p->next)
			if (p->real && real_cuMemRelease(p->real) == CUDA_SUCCESS)
				p->real = 0;
		transition(STATE_RESTORING, STATE_RELEASED);
		snprintf(answer, len, "failed %s: %s", step, errname(r));
		return;
	}
	real_cuCtxSetCurrent(NULL);
	transition(STATE_RESTORING, STATE_RESIDENT);
	gate_open_locked();
	TRACE("restored in %.1f ms", now_ms() - t0);
	snprintf(answer, len, "restored");
}

/* ---- what the wrapper's words do (core/control.h) --------------------------------- */

/* `unpin`: every host copy of ours unlocked (hostcopy.c); the bytes unlocked. */
static size_t unpin_all(void)
{
	size_t n = 0;
	for (struct phys *p = physes; p; p = p->next)
		n += host_unpin(p);
	real_cuCtxSetCurrent(NULL);
	return n;
}

/* In a forked child: the parent's tables, streams and threads are not its own. */
static void forget(void)
{
	table_forget();
	copy_forget();
	nlowered = 0;
	atomic_store(&captures, 0);
	delta_forget();
	prepare_forget();
}

const struct engine_ops cuda_engine = {
	.release = do_release,
	.restore = do_restore,
	.unpin = unpin_all,
	.pin = host_pin_all,
	.resident = prepare_start,
	.forget = forget,
};
