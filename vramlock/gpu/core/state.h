/*
 * core/state.h: the one structure a swapped process keeps about itself, shared by
 * both front ends (the CUDA library, the Vulkan layer; each has its own copy).
 *
 * A process is in one of five states, and moves between them only by `transition`,
 * which checks the move against the table of legal ones (state.c) and refuses, with a
 * line on stderr, any other:
 *
 *              release                 done
 *   RESIDENT ----------> RELEASING ----------> RELEASED <------+
 *      ^                     |                  |    ^   pin   |
 *      |  failed, undone     |          unpin   v    |         |
 *      +---------------------+                PARKED-+         |
 *      |                                        |              |
 *      |            done                        v restore      | failed
 *      +------------------------------- RESTORING <------------+
 *                                             (restore from RELEASED too)
 *
 * RELEASING and RESTORING last as long as the engine's call, with the front end's
 * lock held: outside it a process is RESIDENT, RELEASED or PARKED.
 *
 * The diagnostics (`say`, TRACE) are here too: every part may speak, on failure only,
 * or with VRAMLOCK_SWAP_DEBUG=1.
 */
#ifndef VRAMLOCK_CORE_STATE_H
#define VRAMLOCK_CORE_STATE_H

#include <pthread.h>

enum swap_state {
	STATE_RESIDENT,	 /* its memory on the device, its GPU work free to run */
	STATE_RELEASING, /* a release is copying it out */
	STATE_RELEASED,	 /* its memory in host memory, its GPU work held */
	STATE_PARKED,	 /* released, and its host copies unlocked (checkpointed) */
	STATE_RESTORING, /* a restore is copying it back */
	NSTATES
};

struct engine {
	/* Where the process stands: changed by `transition` only. */
	enum swap_state state;
	/* The front end is to act (VRAMLOCK_SWAP_SOCKET given, the wrapper reached). */
	int active;
	/* Why this process can never be swapped, once known (empty: it can). */
	char refused[256];
	/* Releases begun so far: what was made ahead of one is stale after it. */
	unsigned long releases;
	/* The option that swaps the process, as messages name it ("--release swap"). */
	const char *option;
};

/* The one per process. */
extern struct engine engine;
/* The front end's lock: the state, the gate's waits and every table of the front end.
 * A transition is made with it held. */
extern pthread_mutex_t mu;

/* Moves from `from` (which must be the state now) to `to`: 0, or -1 where that is
 * not a legal move (said on stderr, the state unchanged). */
int transition(enum swap_state from, enum swap_state to);
/* Is its memory off the device (released or parked)? */
int is_released(void);
const char *state_name(enum swap_state s);
/* A forked child starts over: resident, nothing refused, nothing released yet. */
void state_reset(void);
/* Refused from now on; the first reason is kept. Takes `mu`. */
void refuse(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

/* Milliseconds of the monotonic clock. */
double now_ms(void);

/* ---- diagnostics ------------------------------------------------------------ */

extern int debug_on;
/* Each line begins with `say_prefix`, then the pid (set by the front end). */
extern const char *say_prefix;
void say(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

#define TRACE(...)                      \
	do {                            \
		if (debug_on)           \
			say(__VA_ARGS__); \
	} while (0)

#endif
