/*
 * core/state.c: the process's state and its checked transitions (state.h draws them),
 * and the diagnostics.
 */
#define _GNU_SOURCE
#include "state.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

struct engine engine = {.option = "--release swap"};
pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
int debug_on;
const char *say_prefix = "vramlock";

/* legal[from][to]: the moves state.h draws, and no other. */
static const unsigned char legal[NSTATES][NSTATES] = {
	[STATE_RESIDENT] = {[STATE_RELEASING] = 1},
	[STATE_RELEASING] = {[STATE_RELEASED] = 1, [STATE_RESIDENT] = 1},
	[STATE_RELEASED] = {[STATE_RESTORING] = 1, [STATE_PARKED] = 1},
	[STATE_PARKED] = {[STATE_RELEASED] = 1, [STATE_RESTORING] = 1},
	[STATE_RESTORING] = {[STATE_RESIDENT] = 1, [STATE_RELEASED] = 1},
};

static const char *const names[NSTATES] = {
	[STATE_RESIDENT] = "resident",	 [STATE_RELEASING] = "releasing",
	[STATE_RELEASED] = "released",	 [STATE_PARKED] = "parked",
	[STATE_RESTORING] = "restoring",
};

const char *state_name(enum swap_state s)
{
	return (unsigned)s < NSTATES ? names[s] : "unknown";
}

int transition(enum swap_state from, enum swap_state to)
{
	if (engine.state != from || (unsigned)to >= NSTATES || !legal[from][to]) {
		say("refused a state change from %s to %s: the process is %s", state_name(from),
		    state_name(to), state_name(engine.state));
		return -1;
	}
	TRACE("%s -> %s", names[from], names[to]);
	engine.state = to;
	return 0;
}

int is_released(void)
{
	return engine.state == STATE_RELEASED || engine.state == STATE_PARKED;
}

void state_reset(void)
{
	engine.state = STATE_RESIDENT;
	engine.refused[0] = 0;
}

void refuse(const char *fmt, ...)
{
	va_list ap;
	pthread_mutex_lock(&mu);
	if (!engine.refused[0]) {
		va_start(ap, fmt);
		vsnprintf(engine.refused, sizeof engine.refused, fmt, ap);
		va_end(ap);
		TRACE("cannot be swapped from now on: %s", engine.refused);
	}
	pthread_mutex_unlock(&mu);
}

double now_ms(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

void say(const char *fmt, ...)
{
	char line[512];
	int n = snprintf(line, sizeof line, "%s: pid %d: ", say_prefix, (int)getpid());
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(line + n, sizeof line - (size_t)n - 1, fmt, ap);
	va_end(ap);
	size_t len = strlen(line);
	line[len++] = '\n';
	/* One write: lines of several processes must not interleave. */
	ssize_t w = write(2, line, len);
	(void)w;
}
