/*
 * start.c: the layer's set-up, at load: the settings read, and where the layer is to
 * act (VRAMLOCK_SWAP_SOCKET), the engine registered with the control connection and
 * the gate closed until the process joins (its first instance: layer.c). The trace
 * (VRAMLOCK_SWAP_DEBUG=1) goes to stderr.
 */
#include "vklayer.h"

__attribute__((constructor)) static void setup(void)
{
	const char *staging = getenv("VRAMLOCK_VULKAN_STAGING");
	say_prefix = "vramlock-vulkan";
	engine.option = "--release swap-vulkan";
	staging_forced = staging && !strcmp(staging, "1");
	engine.active = control_setup();
	if (engine.active) {
		control_register(&vulkan_engine);
		gate_unjoined();
	}
}
