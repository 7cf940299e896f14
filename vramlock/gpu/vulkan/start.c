/*
 * start.c: the layer's set-up, at load: the settings read, and where the layer is to
 * act (VRAMLOCK_SWAP_SOCKET), the engine registered with the control connection and
 * the gate closed until the process joins (its first instance: layer.c); a forked
 * child joins as its own peer (core/control.c; `forget`, below). The trace
 * (VRAMLOCK_SWAP_DEBUG=1) goes to stderr. VRAMLOCK_SWAP_PREPARE=0: no host copies made
 * ahead (ahead.c).
 */
#include "vklayer.h"

#include "../core/proc.h"

/* VRAMLOCK_VULKAN_MAPPED (memtypes.c): bytes, or K, M, G of them; anything else, the
 * default. */
static void read_allowance(void)
{
	const char *given = getenv("VRAMLOCK_VULKAN_MAPPED");
	char *end;
	if (!given || !*given)
		return;
	errno = 0;
	unsigned long long n = strtoull(given, &end, 10);
	int shift = !*end ? 0 : strchr("kK", *end) ? 10 : strchr("mM", *end) ? 20
		    : strchr("gG", *end) ? 30 : -1;
	if (end == given || errno || shift < 0 || (*end && end[1]) || *given == '-' ||
	    n > (~0ull >> shift)) {
		say("VRAMLOCK_VULKAN_MAPPED=%s is not a size (bytes, or K, M or G of them): "
		    "%llu MiB taken", given, (unsigned long long)(mapped_allowance >> 20));
		return;
	}
	mapped_allowance = (VkDeviceSize)n << shift;
}

/* In a forked child (core/control.c: it joins as a peer of its own): nothing its parent
 * made is its own. Its parent's devices stay known, so that a call on one (which no
 * driver promises to serve in a child: lavapipe's queue threads, say, are not there)
 * still passes the gate; but its releases wait for, copy, free and make again only what
 * it makes on a device of its own, as a child that uses Vulkan must make. The records
 * are forgotten, not freed: the driver's objects they name are its parent's. */
static void forget(void)
{
	table_forget();
	cmds_forget();
	record_forget();
	writes_forget();
	ahead_forget();
	for (struct vdev *d = dev_list(); d; d = d->next) {
		d->inherited = 1;
		d->stage = NULL;
	}
}

/* What the wrapper's words do (core/control.h): no host copy is locked, so `unpin`
 * and `pin` have nothing to do. */
static const struct engine_ops vulkan_engine = {
	.release = engine_release,
	.restore = engine_restore,
	.forget = forget,
};

__attribute__((constructor)) static void setup(void)
{
	const char *staging = getenv("VRAMLOCK_VULKAN_STAGING");
	say_prefix = "vramlock-vulkan";
	engine.option = "--release swap-vulkan";
	staging_forced = staging && !strcmp(staging, "1");
	engine.active = control_setup();
	if (engine.active) {
		char at_start[16];
		const char *prepare = setting("VRAMLOCK_SWAP_PREPARE", at_start, sizeof at_start);
		ahead_wanted = !prepare || strcmp(prepare, "0");
		read_allowance();
		control_register(&vulkan_engine);
		gate_unjoined();
		pthread_atfork(before_fork, after_fork_parent, after_fork_child);
	}
}
