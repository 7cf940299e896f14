/*
 * spread.c: the memory of a release freed, and of a restore made again, by several
 * threads at once. A driver may take a while over each allocation made or freed
 * (NVIDIA's clears and maps it: ~20 ms a GiB, as long as copying it back), and makes
 * several at once; a restore records each allocation's copy back as soon as it is made
 * (engine.c), so the copies run while the rest is made.
 *
 * VRAMLOCK_VULKAN_THREADS (start.c): how many threads, the caller's included (4 by
 * default, 1 to SPREAD_MAX). Called with `mu`, the gate closed: the threads call the
 * driver only, never the program or the layer's tables.
 */
#include "vklayer.h"

#include <time.h>

int spread_threads = 4;

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

/* With `mu`: the memories of the job: to make (every one with a host copy, made where
 * it has no memory now), or to free (those with a host copy and memory). */
VkResult spread_collect(struct spread *w, enum spread_job job)
{
	size_t n = 0;
	w->job = job;
	for (struct vmem *m = mem_list(); m; m = m->next)
		n += m->host && (job == SPREAD_MAKE || m->real);
	w->mems = calloc(n ? n : 1, sizeof *w->mems);
	w->res = calloc(n ? n : 1, sizeof *w->res);
	w->done = calloc(n ? n : 1, sizeof *w->done);
	if (!w->mems || !w->res || !w->done) {
		free(w->mems), free(w->res), free(w->done);
		w->mems = NULL, w->res = NULL, w->done = NULL;
		return VK_ERROR_OUT_OF_HOST_MEMORY;
	}
	for (struct vmem *m = mem_list(); m; m = m->next)
		if (m->host && (job == SPREAD_MAKE || m->real))
			w->mems[w->n++] = m;
	atomic_init(&w->next, 0);
	return VK_SUCCESS;
}

static void one(struct spread *w, size_t k)
{
	struct vmem *m = w->mems[k];
	if (w->job == SPREAD_MAKE) {
		w->res[k] = m->real ? VK_SUCCESS : make_memory(m);
	} else {
		m->d->FreeMemory(m->d->dev, m->real, NULL);
		m->real = VK_NULL_HANDLE;
		w->res[k] = VK_SUCCESS;
	}
	atomic_store_explicit(&w->done[k], 1, memory_order_release);
}

/* The next memory nobody took, done here; 0 when none is left. */
static int take_one(struct spread *w)
{
	size_t k = atomic_fetch_add(&w->next, 1);
	if (k >= w->n)
		return 0;
	one(w, k);
	return 1;
}

static void *worker(void *arg)
{
	while (take_one(arg))
		;
	return NULL;
}

void spread_start(struct spread *w)
{
	int want = spread_threads - 1;
	if ((size_t)want > w->n)
		want = (int)w->n;
	for (w->nthreads = 0; w->nthreads < want; w->nthreads++)
		if (pthread_create(&w->threads[w->nthreads], NULL, worker, w))
			break; /* fewer threads: the caller takes up the rest */
}

VkResult spread_wait(struct spread *w, size_t k)
{
	struct timespec tick = {0, 20000};
	while (!atomic_load_explicit(&w->done[k], memory_order_acquire))
		if (!take_one(w))
			nanosleep(&tick, NULL);
	return w->res[k];
}

void spread_run(struct spread *w)
{
	spread_start(w);
	while (take_one(w))
		;
}

void spread_end(struct spread *w)
{
	while (take_one(w)) /* what nobody took yet (after an error, say) */
		;
	for (int t = 0; t < w->nthreads; t++)
		pthread_join(w->threads[t], NULL);
	free(w->mems), free(w->res), free(w->done);
	w->mems = NULL, w->res = NULL, w->done = NULL;
	w->n = 0, w->nthreads = 0;
}
