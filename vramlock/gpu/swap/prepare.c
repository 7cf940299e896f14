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
 * host copies ready, one PREP_CHUNK at a time: it maps the copy with transparent
 * huge pages asked for (a 2 MiB page is one fault where 4 KiB pages are 512), touches
 * the chunk and locks it (cuMemHostRegister). Each step holds `mu`, so a release
 * never sees a chunk half made, and lasts a few milliseconds; between steps the
 * thread waits for the program to be idle again, so that a resident that works is
 * not slowed down. A release finishes whatever is left of an allocation itself.
 *
 * Host memory is finite: an allocation is made ready only where hostmem.c says the
 * host can spare it, and VRAMLOCK_SWAP_PREPARE=0 in the command's environment turns
 * this off (the first release then pays, as before).
 */
#include "swap.h"

#define PREP_CHUNK COPY_CHUNK
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

/* Touches [p, p + n): MADV_POPULATE_WRITE (Linux 5.14), else a write to every page. */
static void populate(char *p, size_t n)
{
	if (!madvise(p, n, MADV_POPULATE_WRITE))
		return;
	long page = sysconf(_SC_PAGESIZE);
	for (size_t off = 0; off < n; off += (size_t)(page > 0 ? page : 4096))
		((volatile char *)p)[off] = 0;
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
	char *at = (char *)p->prep_base + p->prep_done;
	populate(at, n);
	CUresult r = real_cuCtxSetCurrent(p->ctx);
	if (!r)
		r = real_cuMemHostRegister_v2(at, n, CU_MEMHOSTALLOC_PORTABLE);
	if (r)
		return r;
	p->prep_done += n;
	if (p->prep_done == p->size)
		p->host = p->prep_base;
	return CUDA_SUCCESS;
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
		for (size_t off = 0; off < p->prep_done; off += PREP_CHUNK)
			real_cuMemHostUnregister((char *)p->prep_base + off);
		munmap(p->prep_base, p->prep_len);
	} else if (p->host) {
		real_cuMemFreeHost(p->host);
	}
	p->host = p->prep_base = NULL;
	p->prep_len = p->prep_done = 0;
}

/* The first allocation whose copy is not ready and may be made now, or NULL.
 * With `mu` held. */
static struct phys *next_to_prepare(void)
{
	for (struct phys *p = physes; p; p = p->next)
		if (!p->host && !p->prep_failed && p->real &&
		    (p->prep_base || hostmem_spare(p->size, NULL)))
			return p;
	return NULL;
}

static void *preparer(void *arg)
{
	(void)arg;
	unsigned long seen = atomic_load(&gate_entries);
	double busy_at = now_ms();
	for (;;) {
		int rest = 0;
		struct timespec tick = {0, TICK_NS};
		nanosleep(&tick, NULL);
		unsigned long entries = atomic_load(&gate_entries);
		double now = now_ms();
		if (entries != seen || atomic_load(&inflight) > 0) {
			seen = entries;
			busy_at = now;
			continue;
		}
		if (now - busy_at < IDLE_MS)
			continue;
		pthread_mutex_lock(&mu);
		if (released || refused[0] || atomic_load(&closed) || now - table_changed_ms < QUIET_MS) {
			rest = released || refused[0];
		} else {
			struct phys *p = next_to_prepare();
			if (!p) {
				rest = 1;
			} else {
				CUresult r = prepare_step(p);
				real_cuCtxSetCurrent(NULL);
				if (r) {
					p->prep_failed = 1;
					TRACE("host copy of %zu bytes not made ready: %s", p->size,
					      errname(r));
				} else if (p->host) {
					TRACE("host copy of %zu bytes ready", p->size);
				}
			}
		}
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
	pthread_t t;
	pthread_attr_t attr;
	pthread_attr_init(&attr);
	pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
	if (!pthread_create(&t, &attr, preparer, NULL))
		started = 1;
	pthread_attr_destroy(&attr);
}

/* In a forked child: the thread is its parent's. */
void prepare_forget(void)
{
	started = 0;
}
