/*
 * libslow_init.so: a library whose constructor takes SLOW_INIT_MS milliseconds (a C++
 * library's static initialisers, a big library read from a cold disk). Linked by a
 * program before its driver (swap_prog_linked), it runs before the preloaded swap
 * library's constructor: meanwhile the process has the driver mapped, and the swap
 * library mapped but not yet set up. With SLOW_INIT_UNSETENV=NAME it then takes NAME out
 * of the process's environment (a library that scrubs the environment at start), before
 * the swap library reads it. With SLOW_INIT_FILL_FDS=MS it opens descriptors until it can
 * open no more (the swap library's constructor then cannot make a memfd, nor open
 * anything), and a thread of its own closes them MS milliseconds later.
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <pthread.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

static int fds[1 << 16];
static int nfds;

static void *close_later(void *arg)
{
	long n = (long)arg;
	struct timespec t = {n / 1000, (n % 1000) * 1000000L};
	nanosleep(&t, NULL);
	while (nfds > 0)
		close(fds[--nfds]);
	return NULL;
}

__attribute__((constructor)) static void slow_init(void)
{
	const char *ms = getenv("SLOW_INIT_MS");
	long n = ms ? atol(ms) : 0;
	struct timespec t = {n / 1000, (n % 1000) * 1000000L};
	nanosleep(&t, NULL);
	const char *name = getenv("SLOW_INIT_UNSETENV");
	if (name && *name)
		unsetenv(name);
	const char *fill = getenv("SLOW_INIT_FILL_FDS");
	pthread_t thread;
	if (fill && *fill) {
		/* The thread first: it could not be started with no descriptor left. */
		pthread_create(&thread, NULL, close_later, (void *)atol(fill));
		while (nfds < (int)(sizeof fds / sizeof *fds) &&
		       (fds[nfds] = open("/dev/null", O_RDONLY | O_CLOEXEC)) >= 0)
			nfds++;
	}
}
