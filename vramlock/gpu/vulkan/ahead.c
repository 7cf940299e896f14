/*
 * ahead.c: the host copies made before the first release needs them.
 *
 * A release copies each allocation it moves into a host copy, kept from one release to
 * the next (stage.c). Where the device copies, that host copy is host-visible memory of
 * the layer's own, and made at the first release it costs the waiter most of a first
 * switch: on an H200, making and mapping 5 GiB of it took 2 to 3.5 s, where a later
 * switch, its host copies there, took 0.3 s.
 *
 * So once the program's allocations have stood still QUIET_MS and it is idle (no call
 * through the gate in flight, none begun for IDLE_MS), a thread of the layer's own makes
 * the host copy of one allocation that has none (make), then looks at the
 * program again before the next. The memory is made without `mu` (a call of the program
 * never waits for it) and attached only where the allocation is still as it was; a
 * release that comes meanwhile makes its own, as before.
 *
 * It never copies anything ahead: what the GPU writes meanwhile is not known, so a host
 * copy made ahead counts as written, and the release copies it all, as it would have.
 * It makes them only while the process is resident and can be swapped, where core/
 * hostmem.c says the host can spare the memory (an allocation it cannot is not tried
 * again), and never with VRAMLOCK_SWAP_PREPARE=0 in the command's environment (the
 * first release then pays, as before). The CUDA library does the same, and more
 * (swap/prepare.c).
 *
 * Started at the first device the layer acts on; a forked child has no thread (threads
 * do not survive a fork) and makes its host copies at its releases.
 */
#include "vklayer.h"

#include "../core/hostmem.h"
#include "../core/proc.h"

#include <time.h>

/* A step cannot be cut short: on an H100 NVIDIA's driver makes 1 GiB of host memory in
 * about a quarter of a second, and the program's work waits for it meanwhile (requests
 * begun at once after a load ran 45 % slower while the copies were made 50 ms into each
 * pause). So a step waits for the program to have been idle a whole second. */
#define IDLE_MS 1000.0
#define QUIET_MS 1000.0
#define TICK_NS 20000000L  /* how often the thread looks, while it has work */
#define REST_NS 200000000L /* and while it has none */

int ahead_wanted = 1;
static pthread_once_t once = PTHREAD_ONCE_INIT;
/* With `mu`: the device a host copy is being made on (its destruction waits), or NULL. */
static struct vdev *making;
static pthread_cond_t made = PTHREAD_COND_INITIALIZER;

/* The first allocation whose host copy may be made ahead, or NULL. With `mu`. */
static struct vmem *next_ahead(void)
{
	for (struct vmem *m = mem_list(); m; m = m->next)
		if (table_swappable(m) && !m->host && !m->not_ahead)
			return m;
	return NULL;
}

/* With `mu`, let go while the memory is made, so that no call of the program waits for
 * it: `m`'s host copy made, the device's way (else VK_ERROR_FEATURE_NOT_PRESENT), its
 * contents not copied (it counts as written). Attached only where `m` is still the
 * program's memory, on the same device, without a host copy, moved by a release, of the
 * same kind, and the process resident; else freed again (VK_NOT_READY: `m` may be
 * gone). */
static VkResult make(struct vmem *m)
{
	struct vdev *d = m->d;
	VkDeviceSize size, now_size;
	uint32_t type, now_type;
	VkDeviceMemory mem;
	void *at;
	if (!stage_host_kind(m, &size, &type))
		return VK_ERROR_FEATURE_NOT_PRESENT;
	pthread_mutex_unlock(&mu);
	VkResult r = stage_host_memory(d, type, size, &mem, &at);
	pthread_mutex_lock(&mu);
	if (r != VK_SUCCESS)
		return r;
	if (!table_has(m) || m->d != d || !table_swappable(m) ||
	    !stage_host_kind(m, &now_size, &now_type) || now_size != size || now_type != type ||
	    engine.state != STATE_RESIDENT) {
		d->FreeMemory(d->dev, mem, NULL);
		return VK_NOT_READY;
	}
	m->host_mem = mem, m->host = at;
	m->written = 1; /* what it holds is nothing yet: the release copies it all */
	return VK_SUCCESS;
}

/* One allocation's host copy made ahead: 1, or 0 when none is left to make. With `mu`,
 * let go while the memory is made. */
static int step(void)
{
	struct vmem *m = next_ahead();
	if (!m)
		return 0;
	unsigned long long size = m->size;
	if (!hostmem_spare(size, NULL)) {
		m->not_ahead = 1;
		TRACE("host copy of %llu bytes not made ahead: the host cannot spare it", size);
		return 1;
	}
	making = m->d;
	double t0 = now_ms();
	VkResult r = make(m);
	making = NULL;
	pthread_cond_broadcast(&made);
	if (r == VK_SUCCESS)
		TRACE("host copy of %llu bytes made ahead in %.1f ms", size, now_ms() - t0);
	else if (r != VK_NOT_READY && table_has(m))
		m->not_ahead = 1; /* the CPU's way (made at a release), or no memory for it */
	return 1;
}

/* May a host copy be made now (resident, and a release may come)? With `mu`. */
static int wanted_now(void)
{
	return engine.state == STATE_RESIDENT && !atomic_load(&closed) && !release_refused();
}

static void *ahead(void *arg)
{
	(void)arg;
	struct idleness idle;
	idleness_start(&idle);
	for (int worked = 0;;) {
		struct timespec tick = {0, TICK_NS}, pause = {0, REST_NS};
		if (!worked) /* after a step, the next at once while the program stays idle */
			nanosleep(&tick, NULL);
		worked = 0;
		if (!idle_for(&idle, IDLE_MS))
			continue;
		pthread_mutex_lock(&mu);
		int quiet = now_ms() - table_changed_ms >= QUIET_MS;
		if (quiet && wanted_now())
			worked = step();
		pthread_mutex_unlock(&mu);
		if (!worked && quiet) /* nothing to make, or not now: a longer pause */
			nanosleep(&pause, NULL);
	}
	return NULL;
}

void ahead_forget(void)
{
	making = NULL;
	pthread_cond_init(&made, NULL);
}

static void start(void)
{
	if (start_thread(ahead))
		TRACE("no thread for host copies made ahead: a first release makes them");
}

void ahead_start(void)
{
	if (ahead_wanted)
		pthread_once(&once, start);
}

void ahead_wait(struct vdev *d)
{
	while (making == d)
		pthread_cond_wait(&made, &mu);
}
