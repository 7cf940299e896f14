/*
 * gate.c: the gate every GPU call passes (swap.h says how it works): what waits
 * for it to open, and what closes and opens it.
 */
#include "swap.h"

pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER; /* the gate's waits and every table */
static pthread_cond_t gate_cv = PTHREAD_COND_INITIALIZER;  /* the gate opened */
static pthread_cond_t drain_cv = PTHREAD_COND_INITIALIZER; /* the last call left */
atomic_int closed;
atomic_long inflight;
/* A forked child that has not joined yet: its first call through the gate joins. */
static atomic_int must_join;

void wake_releaser(void)
{
	pthread_mutex_lock(&mu);
	pthread_cond_broadcast(&drain_cv);
	pthread_mutex_unlock(&mu);
}

void wait_for_open_gate(void)
{
	gate_leave();
	if (atomic_load(&must_join))
		join_now();
	pthread_mutex_lock(&mu);
	while (atomic_load(&closed))
		pthread_cond_wait(&gate_cv, &mu);
	pthread_mutex_unlock(&mu);
}

/* With `mu` held: close the gate and wait for every call inside to leave. */
void gate_close_locked(void)
{
	atomic_store(&closed, 1);
	while (atomic_load(&inflight) > 0)
		pthread_cond_wait(&drain_cv, &mu);
}

void gate_open_locked(void)
{
	atomic_store(&closed, 0);
	pthread_cond_broadcast(&gate_cv);
}

/* With `mu`, at a joining process's first word: `resident` opens a gate that was
 * closed for the join (any other word is a release, which keeps it closed). */
void gate_joined_locked(int resident)
{
	if (atomic_exchange(&must_join, 0) && resident)
		gate_open_locked();
}

/* In a forked child (only the forking thread lives on): no call is in flight, nobody
 * waits, and a child that is to join keeps the gate closed until it has. */
void gate_after_fork(int join)
{
	pthread_cond_init(&gate_cv, NULL);
	pthread_cond_init(&drain_cv, NULL);
	atomic_store(&inflight, 0);
	atomic_store(&must_join, join);
	if (join)
		atomic_store(&closed, 1);
}
