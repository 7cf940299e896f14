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

void wake_releaser(void)
{
	pthread_mutex_lock(&mu);
	pthread_cond_broadcast(&drain_cv);
	pthread_mutex_unlock(&mu);
}

void wait_for_open_gate(void)
{
	gate_leave();
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
