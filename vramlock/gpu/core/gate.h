/*
 * core/gate.h: the gate every GPU call of the program passes, in both front ends.
 *
 * Open: a call increments `inflight`, sees the gate open and goes on, no lock. A
 * release sets `closed`, then waits for `inflight` to reach 0. Both sides use
 * sequentially consistent atomics, so either the caller sees `closed` (and steps back
 * out) or the releaser sees the caller in flight (and waits for it). A call that
 * records work for later (`gate_enter_recording`) also waits while `draining`: a
 * release is waiting for what was recorded to be spent.
 *
 * Until a process joins (the wrapper's first word) the gate is closed, and the first
 * call that finds it so joins (`gate_on_join`).
 */
#ifndef VRAMLOCK_CORE_GATE_H
#define VRAMLOCK_CORE_GATE_H

#include "state.h"

#include <stdatomic.h>

extern atomic_int closed;
extern atomic_int draining;
extern atomic_long inflight;
/* Calls that entered the gate, ever: an idle program is told by it. */
extern atomic_ulong gate_entries;
/* The control thread waits for `mu` (control_lock). */
extern atomic_int control_waits;

/* The name of gate_unjoined's mapping (vramlock/gpu/core/protocol.py looks for it). */
#define UNJOINED "vramlock-swap-unjoined"
/* The name of gate_set_up's mapping: the library has set up in this image (kept until
 * exec; a process without it may still be running other libraries' constructors). */
#define SET_UP "vramlock-swap-set-up"
/* The name of gate_unreached's mapping, ":<errno>" after it: the process could not reach
 * the wrapper and runs without swap (kept until exec; a forked child keeps it too). */
#define UNREACHED "vramlock-swap-unreached"

/* The fast paths are inlined into every hook; what waits is not. */
#define INLINE static inline __attribute__((always_inline))

void wake_releaser(void);
void wait_for_open_gate(int recording);
/* What joins the process: called by the first call that finds it unjoined. */
void gate_on_join(void (*join)(void));
/* With `mu` held: close the gate and wait for every call inside to leave. */
void gate_close_locked(void);
/* The same, for `seconds` at most: 0, or -1 (the gate open again) when not within. */
int gate_close_within(int seconds);
void gate_open_locked(void);
/* With `mu`: new recordings wait from now on, until the gate opens. */
void gate_hold_recordings(void);
void gate_set_up(void);
void gate_unreached(int err);
void gate_unjoined(void);
void gate_joined_locked(int resident);
void gate_break(void);
void gate_after_fork(int join);
/* `mu` for the control thread: it goes before a thread of the front end's that takes
 * `mu` again and again (the swap library's preparer) looks at `control_waits`. */
void control_lock(void);
/* What a thread of the library's own that works only while the program is idle (host
 * copies made ahead: swap/prepare.c, vulkan/ahead.c) keeps between looks: the gate's
 * count of calls when it last looked, and when it last saw the program busy. */
struct idleness {
	unsigned long seen;
	double busy_at;
};
void idleness_start(struct idleness *i);
/* Looked at now: has no call entered the gate, and none been in flight, for `ms`, and is
 * the control thread not waiting for `mu`? */
int idle_for(struct idleness *i, double ms);

INLINE void gate_leave(void)
{
	if (__builtin_expect(atomic_fetch_sub(&inflight, 1) == 1 && atomic_load(&closed), 0))
		wake_releaser();
}

INLINE void gate_enter(void)
{
	atomic_fetch_add_explicit(&gate_entries, 1, memory_order_relaxed);
	for (;;) {
		atomic_fetch_add(&inflight, 1);
		if (__builtin_expect(!atomic_load(&closed), 1))
			return;
		wait_for_open_gate(0);
	}
}

INLINE void gate_enter_recording(void)
{
	atomic_fetch_add_explicit(&gate_entries, 1, memory_order_relaxed);
	for (;;) {
		atomic_fetch_add(&inflight, 1);
		if (__builtin_expect(!atomic_load(&closed) && !atomic_load(&draining), 1))
			return;
		wait_for_open_gate(1);
	}
}

#endif
