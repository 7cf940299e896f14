/*
 * core/gate.c: the gate every GPU call passes (gate.h says how it works): what waits
 * for it to open, and what closes and opens it.
 */
#define _GNU_SOURCE
#include "gate.h"

#include <errno.h>
#include <stdio.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

static pthread_cond_t gate_cv = PTHREAD_COND_INITIALIZER;  /* the gate opened */
static pthread_cond_t drain_cv = PTHREAD_COND_INITIALIZER; /* the last call left */
atomic_int closed;
atomic_int draining;
atomic_long inflight;
atomic_ulong gate_entries;
atomic_int control_waits;
/* Not joined yet: the first call through the gate joins, by `join`. */
static atomic_int must_join;
static void (*join)(void);
/* The driver lacks what a swap needs: the gate never opens. */
static int broken;
/* A mapping whose name tells the wrapper, which reads /proc/PID/maps, that this
 * process has not joined yet and cannot touch the GPU before it has. */
static void *marker;

void wake_releaser(void)
{
	pthread_mutex_lock(&mu);
	pthread_cond_broadcast(&drain_cv);
	pthread_mutex_unlock(&mu);
}

void gate_on_join(void (*fn)(void))
{
	join = fn;
}

void wait_for_open_gate(int recording)
{
	gate_leave();
	if (atomic_load(&must_join) && join)
		join();
	pthread_mutex_lock(&mu);
	while (atomic_load(&closed) || (recording && atomic_load(&draining)))
		pthread_cond_wait(&gate_cv, &mu);
	pthread_mutex_unlock(&mu);
}

void gate_close_locked(void)
{
	atomic_store(&closed, 1);
	while (atomic_load(&inflight) > 0)
		pthread_cond_wait(&drain_cv, &mu);
}

int gate_close_within(int seconds)
{
	struct timespec until;
	clock_gettime(CLOCK_REALTIME, &until);
	until.tv_sec += seconds;
	atomic_store(&closed, 1);
	while (atomic_load(&inflight) > 0)
		if (pthread_cond_timedwait(&drain_cv, &mu, &until) == ETIMEDOUT &&
		    atomic_load(&inflight) > 0) {
			gate_open_locked();
			return -1;
		}
	return 0;
}

void gate_open_locked(void)
{
	atomic_store(&closed, 0);
	atomic_store(&draining, 0);
	pthread_cond_broadcast(&gate_cv);
}

void gate_hold_recordings(void)
{
	atomic_store(&draining, 1);
}

/* A mapping named `name`, kept (a page of a memfd); NULL where it cannot be made. */
static void *named_mapping(const char *name)
{
	void *m = NULL;
	int fd = memfd_create(name, MFD_CLOEXEC);
	if (fd >= 0 && !ftruncate(fd, 4096))
		m = mmap(NULL, 4096, PROT_READ, MAP_SHARED, fd, 0);
	if (fd >= 0)
		close(fd);
	return m == MAP_FAILED ? NULL : m;
}

/* At setup, active or not: from now on the wrapper, which reads /proc/PID/maps, knows
 * that this image's library has set up. Before that, the dynamic linker may have mapped
 * the driver and run other libraries' constructors for seconds, and a process given the
 * run's socket is then only starting: its first GPU call sets the library up and joins.
 * A forked child keeps the mapping (it is set up too); an exec drops it. */
void gate_set_up(void)
{
	named_mapping(SET_UP);
}

/* Until it joins, a process runs no GPU call: its first one joins (cuInit, a first
 * Vulkan instance, or any call through the gate), and waits for the wrapper's first
 * word. */
void gate_unjoined(void)
{
	atomic_store(&must_join, 1);
	atomic_store(&closed, 1);
	marker = named_mapping(UNJOINED);
}

/* With `mu`, at a joining process's first word: `resident` opens the gate (any other
 * word is a release, which keeps it closed). */
void gate_joined_locked(int resident)
{
	if (!atomic_exchange(&must_join, 0))
		return;
	if (marker)
		munmap(marker, 4096);
	marker = NULL;
	if (resident && !broken)
		gate_open_locked();
}

/* With `mu`: the process could not reach the wrapper (`err` says why) and runs without
 * swap, its calls straight to the driver from now on. Its mapping tells the wrapper so,
 * and why, where nothing else can: the wrapper reads /proc/PID/maps whatever this
 * process's user, mount namespace or descriptors. */
void gate_unreached(int err)
{
	char name[64];
	snprintf(name, sizeof name, "%s:%d", UNREACHED, err);
	named_mapping(name);
	engine.active = 0;
	gate_joined_locked(1);
	gate_open_locked(); /* a driver that cannot be swapped runs unswapped as well */
}

/* The driver cannot be swapped: GPU calls stay blocked for good. */
void gate_break(void)
{
	broken = 1;
	atomic_store(&closed, 1);
}

/* In a forked child (only the forking thread lives on): no call is in flight, nobody
 * waits, and a child that is to join keeps the gate closed until it has. */
void gate_after_fork(int join_later)
{
	pthread_cond_init(&gate_cv, NULL);
	pthread_cond_init(&drain_cv, NULL);
	atomic_store(&inflight, 0);
	atomic_store(&control_waits, 0);
	if (join_later)
		gate_unjoined();
}

void control_lock(void)
{
	atomic_fetch_add(&control_waits, 1);
	pthread_mutex_lock(&mu);
	atomic_fetch_sub(&control_waits, 1);
}

void idleness_start(struct idleness *i)
{
	i->seen = atomic_load(&gate_entries);
	i->busy_at = now_ms();
}

int idle_for(struct idleness *i, double ms)
{
	unsigned long entries = atomic_load(&gate_entries);
	double now = now_ms();
	if (entries != i->seen || atomic_load(&inflight) > 0) {
		i->seen = entries;
		i->busy_at = now;
		return 0;
	}
	return now - i->busy_at >= ms && !atomic_load(&control_waits);
}
