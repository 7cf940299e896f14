/*
 * hooks.h: what the wrappers share with entry.c: the table of every hooked entry
 * point, and the check each hook makes first.
 */
#ifndef VRAMLOCK_SWAP_HOOKS_H
#define VRAMLOCK_SWAP_HOOKS_H

#include "swap.h"

/* Every hooked entry point: the name the driver exports, our wrapper, and where the
 * driver's own is kept for the program's calls (filled once libcuda is there). */
struct hook {
	const char *name;
	void *wrapper;
	void **real;
};
extern struct hook hooks[];
extern const size_t nhooks;

/* Set once the driver is found and the table filled. */
extern atomic_int is_ready;
int get_ready(void);
/* The driver found (in `lib` too; loaded when `load`) and the table filled: 1, or 0. */
int hooks_found(void *lib, int load);

/* Every hook asks first: one load once set up (a launch-bound program calls hooks
 * some hundred thousand times a second). */
static inline __attribute__((always_inline)) int ready(void)
{
	return __builtin_expect(atomic_load_explicit(&is_ready, memory_order_acquire), 1) ||
	       get_ready();
}

#endif
