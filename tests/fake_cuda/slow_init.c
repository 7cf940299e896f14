/*
 * libslow_init.so: a library whose constructor takes SLOW_INIT_MS milliseconds (a C++
 * library's static initialisers, a big library read from a cold disk). Linked by a
 * program before its driver (swap_prog_linked), it runs before the preloaded swap
 * library's constructor: meanwhile the process has the driver mapped, and the swap
 * library mapped but not yet set up. With SLOW_INIT_UNSETENV=NAME it then takes NAME out
 * of the process's environment (a library that scrubs the environment at start), before
 * the swap library reads it.
 */
#define _GNU_SOURCE
#include <stdlib.h>
#include <time.h>

__attribute__((constructor)) static void slow_init(void)
{
	const char *ms = getenv("SLOW_INIT_MS");
	long n = ms ? atol(ms) : 0;
	struct timespec t = {n / 1000, (n % 1000) * 1000000L};
	nanosleep(&t, NULL);
	const char *name = getenv("SLOW_INIT_UNSETENV");
	if (name && *name)
		unsetenv(name);
}
