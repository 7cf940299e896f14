/*
 * core/control.h: the conversation with the wrapper, for both front ends.
 *
 * Calls run one way: the front end's hooks pass the gate (gate.h) and use their own
 * tables; its engine does the swapping; this file only talks. What a word from the
 * wrapper makes the engine do goes through `struct engine_ops`, which the front end
 * registers at set-up: this file knows that interface, never the engine's code.
 */
#ifndef VRAMLOCK_CORE_CONTROL_H
#define VRAMLOCK_CORE_CONTROL_H

#include "state.h"

#include <stddef.h>

/* The exit status of a process that cannot reach the wrapper under --release swap. */
#define UNREACHED_STATUS 1

/* What the engine does for each word; each is called with `mu` held. */
struct engine_ops {
	/* `release`: copy out and free (answer "released", "refused <why>" or "failed
	 * <why>"). A release that fails opens the gate again, unless `stay_closed`. */
	void (*release)(char *answer, size_t len, int stay_closed);
	/* `restore`: back, and the gate open ("restored", or "failed <why>"). */
	void (*restore)(char *answer, size_t len);
	/* `unpin` and `pin` around a park (NULL: nothing to unlock): the bytes unlocked. */
	size_t (*unpin)(void);
	void (*pin)(void);
	/* After a word, resident and not refused (NULL: nothing to do). */
	void (*resident)(void);
	/* In a forked child: the parent's tables are not its own (forgotten, not freed). */
	void (*forget)(void);
};

void control_register(const struct engine_ops *ops);
/* At start, from the environment: whether the library is to act (1). */
int control_setup(void);
/* Joins (once): `hello`, and the wrapper's first word awaited. */
void control_join(void);
/* fork: `mu` is taken around it; the child joins as its own peer. */
void before_fork(void);
void after_fork_parent(void);
void after_fork_child(void);

#endif
