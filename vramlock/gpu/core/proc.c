/*
 * core/proc.c: what both front ends ask of the process and its kernel: /proc files,
 * the environment the process started with, and threads of the library's own.
 */
#define _GNU_SOURCE
#include "proc.h"

#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* Reads a small /proc file whole; its length, or -1. */
ssize_t read_proc(const char *path, char *buf, size_t size)
{
	int fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		return -1;
	ssize_t n = read(fd, buf, size - 1);
	close(fd);
	if (n >= 0)
		buf[n] = 0;
	return n;
}

/* The state letter and start time (field 22) of process `pid`: 0, or -1 when gone. */
int proc_stat(int pid, char *state, unsigned long long *start)
{
	char path[64], line[1024];
	snprintf(path, sizeof path, "/proc/%d/stat", pid);
	if (read_proc(path, line, sizeof line) <= 0)
		return -1;
	/* Counting from the state (3), after the command name's closing parenthesis. */
	char *field = strrchr(line, ')');
	if (!field || sscanf(field + 1, " %c", state) != 1)
		return -1;
	for (int k = 2; field && k < 22; k++)
		field = strchr(field + 1, ' ');
	return field && sscanf(field + 1, "%llu", start) == 1 ? 0 : -1;
}

/* `name`'s value in the environment the process was started with, as the wrapper reads
 * it (/proc/PID/environ: the first entry of that name, as getenv takes it), into `out`
 * (`size` bytes, cut short where longer); 0 when it has none or cannot be read. */
static int started_with(const char *name, char *out, size_t size)
{
	char buf[4096];
	size_t len = strlen(name), at = 0, n = 0; /* where in the entry, how much copied */
	int same = 1, found = 0;		  /* the entry so far is "name=..." */
	ssize_t got;
	int fd = open("/proc/self/environ", O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		return 0;
	while (!found && (got = read(fd, buf, sizeof buf)) > 0) {
		for (ssize_t i = 0; i < got && !found; i++, at++) {
			char c = buf[i];
			if (!c && same && at > len) {
				found = 1;
			} else if (!c) {
				at = (size_t)-1, same = 1, n = 0; /* the next entry */
			} else if (at <= len) {
				same = same && c == (at < len ? name[at] : '=');
			} else if (same && n + 1 < size) {
				out[n++] = c;
			}
		}
	}
	close(fd);
	out[n] = '\0';
	return found;
}

/* One of the variables that reach the library: its value, or where the process's own
 * environment has none (or an empty one), the one it was started with, kept in `buf`
 * (`size` bytes). The wrapper reads that environment: a process it names this run's
 * socket to, not set up yet, is one that will join (strategies/swap.py), even where
 * another library's constructor took the name out before ours ran. NULL: none. */
const char *setting(const char *name, char *buf, size_t size)
{
	const char *v = getenv(name);
	if ((!v || !*v) && started_with(name, buf, size))
		v = buf;
	return v;
}

/* Starts `fn` on a detached thread of the library's own, every signal blocked there: the
 * program's signals are the program's threads' (one that blocks a signal to take it with
 * sigwait would otherwise see it taken here, its default action ending the process).
 * 0, or an errno. */
int start_thread(void *(*fn)(void *))
{
	pthread_t t;
	pthread_attr_t attr;
	sigset_t all, was;
	sigfillset(&all);
	pthread_sigmask(SIG_SETMASK, &all, &was);
	int e = pthread_attr_init(&attr);
	if (!e) {
		pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
		e = pthread_create(&t, &attr, fn, NULL);
		pthread_attr_destroy(&attr);
	}
	pthread_sigmask(SIG_SETMASK, &was, NULL);
	return e;
}
