/*
 * start.c: set-up, once, from our constructor or from the first hook called,
 * whichever comes first (another library's constructor may look the driver up before
 * ours has run): the settings read, the engine registered with the control
 * connection, the gate closed until the process joins, the driver found.
 */
#include "swap.h"

static pthread_once_t setup_once = PTHREAD_ONCE_INIT;

/* A setting that is on unless "0". */
static int wanted(const char *name)
{
	char at_start[16];
	const char *v = setting(name, at_start, sizeof at_start);
	return !v || strcmp(v, "0");
}

static void setup(void)
{
	say_prefix = "vramlock-swap";
	gate_set_up();
	engine.active = control_setup();
	if (engine.active) {
		prepare_wanted = wanted("VRAMLOCK_SWAP_PREPARE");
		stack_wanted = wanted("VRAMLOCK_SWAP_STACK");
		control_register(&cuda_engine);
		gate_unjoined();
	}
	driver_setup();
	pthread_atfork(before_fork, after_fork_parent, after_fork_child);
}

void library_setup(void)
{
	pthread_once(&setup_once, setup);
}

__attribute__((constructor)) static void init(void)
{
	library_setup();
}

void *find_driver(void *lib, int load)
{
	library_setup();
	return driver_find(lib, load);
}
