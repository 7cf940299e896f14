/*
 * engine.c: submits through the gate (core/gate.h: it holds the program's GPU work,
 * submits, recordings, allocations, while released), and the swap: a release copies
 * each allocation the layer can make again to its host copy (only where written since
 * that copy was last right: writes.c) and destroys it with its buffers; a restore
 * makes them again, copies the contents back, binds the buffers and writes again every
 * descriptor that named one. The copies themselves are stage.c's.
 */
#include "vklayer.h"

#include <time.h>

/* How long a release waits for the program's calls in flight to return. */
#define DRAIN_SECONDS 2

/* ---- submits ----------------------------------------------------------------- */

static VKAPI_ATTR VkResult VKAPI_CALL queue_submit(VkQueue q, uint32_t n, const VkSubmitInfo *s,
						   VkFence fence)
{
	struct vdev *d = dev_of((VkDevice)q);
	if (!is_ours(d))
		return d->QueueSubmit(q, n, s, fence);
	gate_enter();
	pthread_mutex_lock(&mu);
	for (uint32_t k = 0; k < n; k++)
		for (uint32_t c = 0; c < s[k].commandBufferCount; c++)
			record_submitted(s[k].pCommandBuffers[c]);
	pthread_mutex_unlock(&mu);
	VkResult r = d->QueueSubmit(q, n, s, fence);
	gate_leave();
	return r;
}

static VkResult submit2(PFN_vkQueueSubmit2 fn, VkQueue q, uint32_t n, const VkSubmitInfo2 *s,
			VkFence fence)
{
	if (!is_ours(dev_of((VkDevice)q)))
		return fn(q, n, s, fence);
	gate_enter();
	pthread_mutex_lock(&mu);
	for (uint32_t k = 0; k < n; k++)
		for (uint32_t c = 0; c < s[k].commandBufferInfoCount; c++)
			record_submitted(s[k].pCommandBufferInfos[c].commandBuffer);
	pthread_mutex_unlock(&mu);
	VkResult r = fn(q, n, s, fence);
	gate_leave();
	return r;
}

static VKAPI_ATTR VkResult VKAPI_CALL queue_submit2(VkQueue q, uint32_t n, const VkSubmitInfo2 *s,
						    VkFence fence)
{
	return submit2(dev_of((VkDevice)q)->QueueSubmit2, q, n, s, fence);
}

static VKAPI_ATTR VkResult VKAPI_CALL queue_submit2_khr(VkQueue q, uint32_t n,
							const VkSubmitInfo2 *s, VkFence fence)
{
	return submit2(dev_of((VkDevice)q)->QueueSubmit2KHR, q, n, s, fence);
}

void engine_hook(const char *name, PFN_vkVoidFunction *fn)
{
	if (!strcmp(name, "vkQueueSubmit"))
		*fn = (PFN_vkVoidFunction)queue_submit;
	else if (!strcmp(name, "vkQueueSubmit2"))
		*fn = (PFN_vkVoidFunction)queue_submit2;
	else if (!strcmp(name, "vkQueueSubmit2KHR"))
		*fn = (PFN_vkVoidFunction)queue_submit2_khr;
}

/* ---- release ----------------------------------------------------------------- */

const char *release_refused(void)
{
	if (engine.refused[0])
		return engine.refused;
	for (struct vdev *d = dev_list(); d; d = d->next)
		if (d->passive && strcmp(d->why, "destroyed"))
			return d->why;
	return NULL;
}

/* With `mu`: the command buffers recorded over the program's buffers spent
 * (submitted and reset), new recordings held meanwhile; NULL, or why not within
 * DRAIN_SECONDS (the gate open again). */
static const char *spent(void)
{
	const char *why;
	gate_hold_recordings();
	for (int ms = 0; (why = record_busy()) && ms < DRAIN_SECONDS * 1000; ms++) {
		struct timespec tick = {0, 1000000};
		pthread_mutex_unlock(&mu);
		nanosleep(&tick, NULL);
		pthread_mutex_lock(&mu);
	}
	if (why)
		gate_open_locked();
	return why;
}

/* With `mu`: the recordings over the program's buffers spent, then the gate closed
 * with no call in flight; NULL, or why not. A recording may have
 * begun just as recordings were held (its vkBeginCommandBuffer past the gate): it is
 * seen once the gate is closed, and the drain is made again, a few times at most; the
 * last time, the gate stays closed (release_failed says whether it opens). */
static const char *drained(void)
{
	for (int tries = 1;; tries++) {
		const char *why = spent();
		if (why)
			return why;
		if (gate_close_within(DRAIN_SECONDS))
			return "its GPU calls did not return";
		if (!(why = record_busy()) || tries == 4)
			return why; /* the gate closed, as after any drain */
		gate_open_locked();
	}
}

/* Every swapped allocation's memory and buffers destroyed (their contents are in
 * host memory, or never made it back there: a restore that failed). */
static void drop_swapped(void)
{
	for (struct vbuf *b = buf_list(); b; b = b->next)
		if (b->mem && b->mem->host && b->real) {
			b->d->DestroyBuffer(b->d->dev, b->real, NULL);
			b->real = VK_NULL_HANDLE;
		}
	for (struct vmem *m = mem_list(); m; m = m->next)
		if (m->host && m->real) {
			m->d->FreeMemory(m->d->dev, m->real, NULL);
			m->real = VK_NULL_HANDLE;
		}
}

/* A release's bytes: what it frees, what it copies out, and the host copies it has to
 * make (those made ahead, ahead.c, not counted). */
struct released {
	size_t freed, copied, made;
};

/* Each swappable allocation's contents to its host copy, where written since that
 * was last right (or it has none), all copies made before any waited for; 0, or -1
 * with `why`; counted in `n`. */
static int copy_out(char *why, size_t len, struct released *n)
{
	VkResult r = VK_SUCCESS;
	for (struct vmem *m = mem_list(); r == VK_SUCCESS && m; m = m->next) {
		if (!table_swappable(m))
			continue;
		n->freed += m->size;
		if (!writes_since(m))
			continue; /* its host copy is right: the memory is freed at once */
		n->made += m->host ? 0 : m->size;
		if ((r = stage_host(m)) != VK_SUCCESS) {
			if (r == VK_ERROR_FEATURE_NOT_PRESENT)
				snprintf(why, len, "the device cannot copy its memory to the host");
			else
				snprintf(why, len, "no host memory for %llu bytes (%d)",
					 (unsigned long long)m->size, (int)r);
			stage_flush(r);
			return -1;
		}
		r = stage_copy(m, 1);
		n->copied += m->size;
	}
	if ((r = stage_flush(r)) != VK_SUCCESS) {
		snprintf(why, len, "its memory could not be copied out (%d)", (int)r);
		return -1;
	}
	writes_copied();
	return 0;
}

/* A release that failed: resident again, the gate open (unless `stay_closed`). */
static void release_failed(char *answer, size_t len, const char *why, int stay_closed)
{
	transition(STATE_RELEASING, STATE_RESIDENT);
	if (!stay_closed)
		gate_open_locked();
	snprintf(answer, len, "failed %s", why);
}

/* With `mu`, from vramlock run's `release`. */
void engine_release(char *answer, size_t len, int stay_closed)
{
	const char *why = release_refused();
	struct released n = {0, 0, 0};
	if (is_released()) {
		snprintf(answer, len, "released");
		return;
	}
	if (why) {
		snprintf(answer, len, "refused %s", why);
		return;
	}
	if (transition(STATE_RESIDENT, STATE_RELEASING)) {
		snprintf(answer, len, "failed the process is %s", state_name(engine.state));
		return;
	}
	engine.releases++;
	double t0 = now_ms();
	if ((why = drained())) {
		release_failed(answer, len, why, stay_closed);
		return;
	}
	double t1 = now_ms();
	for (struct vdev *d = dev_list(); d; d = d->next)
		if (!d->passive && !d->inherited)
			d->DeviceWaitIdle(d->dev);
	double t2 = now_ms();
	char failed[200];
	if (copy_out(failed, sizeof failed, &n)) {
		release_failed(answer, len, failed, stay_closed);
		return;
	}
	for (struct vmem *m = mem_list(); m; m = m->next)
		if (!table_swappable(m) && m->host) /* mapped since: stays */
			stage_host_free(m);
	double t3 = now_ms();
	drop_swapped();
	transition(STATE_RELEASING, STATE_RELEASED);
	TRACE("released %zu bytes, %zu of them copied out, %zu of host copies made; ms: drain %.1f, "
	      "idle %.1f, copy %.1f, free %.1f",
	      n.freed, n.copied, n.made, t1 - t0, t2 - t1, t3 - t2, now_ms() - t3);
	snprintf(answer, len, "released");
}

/* ---- restore ----------------------------------------------------------------- */

static VkResult make_memory(struct vmem *m)
{
	VkMemoryAllocateFlagsInfo flags = {.sType = VK_STRUCTURE_TYPE_MEMORY_ALLOCATE_FLAGS_INFO,
					   .flags = m->flags};
	VkMemoryDedicatedAllocateInfo dedicated = {
		.sType = VK_STRUCTURE_TYPE_MEMORY_DEDICATED_ALLOCATE_INFO,
		.pNext = m->flags ? &flags : NULL,
		.buffer = m->dedicated ? m->dedicated->real : VK_NULL_HANDLE};
	VkMemoryAllocateInfo info = {.sType = VK_STRUCTURE_TYPE_MEMORY_ALLOCATE_INFO,
				     .allocationSize = m->size, .memoryTypeIndex = m->type};
	info.pNext = m->dedicated ? (void *)&dedicated : m->flags ? (void *)&flags : NULL;
	return m->d->AllocateMemory(m->d->dev, &info, NULL, &m->real);
}

/* Each memory made again, its copy back recorded and sent to the device at once: a
 * driver may take as long to make memory as to copy it (NVIDIA's: ~20 ms a GiB), and
 * the copies then run while the rest is made. (Made on several threads, NVIDIA's took
 * as long, and sent the copies only after the last.) */
static VkResult make_and_copy(void)
{
	VkResult r = VK_SUCCESS;
	for (struct vmem *m = mem_list(); r == VK_SUCCESS && m; m = m->next) {
		if (!m->host)
			continue;
		if (!m->real)
			r = make_memory(m);
		if (r == VK_SUCCESS)
			r = stage_copy(m, 0);
		if (r == VK_SUCCESS)
			r = stage_send(m->d);
	}
	return r;
}

/* Buffers, memory, contents and bindings made again; VK_SUCCESS or the first error.
 * `ms`: how long the making (with the copies recorded and sent meanwhile), what was
 * left of the copies, and the bindings took. */
static VkResult remake(double ms[3])
{
	VkResult r = VK_SUCCESS;
	double t0 = now_ms();
	for (struct vbuf *b = buf_list(); r == VK_SUCCESS && b; b = b->next)
		if (b->mem && b->mem->host && !b->real)
			r = b->d->CreateBuffer(b->d->dev, &b->ci, NULL, &b->real);
	if (r == VK_SUCCESS)
		r = make_and_copy();
	double t1 = now_ms();
	r = stage_flush(r); /* every copy in made, then waited for */
	double t2 = now_ms();
	for (struct vbuf *b = buf_list(); r == VK_SUCCESS && b; b = b->next)
		if (b->mem && b->mem->host)
			r = b->d->BindBufferMemory(b->d->dev, b->real, b->mem->real, b->offset);
	ms[0] = t1 - t0, ms[1] = t2 - t1, ms[2] = now_ms() - t2;
	return r;
}

/* With `mu`: what a restore copied in (every host copy of memory made again). */
static size_t restored_bytes(void)
{
	size_t n = 0;
	for (struct vmem *m = mem_list(); m; m = m->next)
		n += m->host && m->real ? m->size : 0;
	return n;
}

/* With `mu`, from vramlock run's `restore`. */
void engine_restore(char *answer, size_t len)
{
	if (!is_released() || transition(engine.state, STATE_RESTORING)) {
		gate_open_locked();
		snprintf(answer, len, "restored");
		return;
	}
	double ms[3];
	VkResult r = remake(ms);
	if (r != VK_SUCCESS) {
		drop_swapped(); /* released as before: the member gives the GPU back */
		transition(STATE_RESTORING, STATE_RELEASED);
		snprintf(answer, len, "failed the device has no memory for it (%d)", (int)r);
		return;
	}
	double t = now_ms();
	record_rewrite();
	transition(STATE_RESTORING, STATE_RESIDENT);
	gate_open_locked();
	TRACE("restored, %zu bytes copied in; ms: make and copy %.1f, copy left %.1f, bind %.1f, "
	      "rewrite %.1f",
	      restored_bytes(), ms[0], ms[1], ms[2], now_ms() - t);
	snprintf(answer, len, "restored");
}
