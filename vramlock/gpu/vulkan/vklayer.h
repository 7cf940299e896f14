/*
 * libvramlock-vulkan's one internal header. The library is a Vulkan layer
 * (VK_LAYER_VRAMLOCK_swap), put in front of an unmodified Vulkan program through the
 * loader (a layer manifest, VK_ADD_LAYER_PATH and VK_INSTANCE_LAYERS) by
 * `vramlock run`. It lets the program give its device memory back while it keeps
 * running, and take it back later under the same handles:
 *
 *  layer.c    the loader's interface: instance and device creation, the dispatch
 *             tables, and which entry points the program gets from us
 *  devices.c  the instances and devices made, found by any handle they dispatch
 *  table.c    the program's device memory and buffers: the handles it holds are ours,
 *             each naming the driver's object of the moment (and what makes a process
 *             impossible to swap: refused)
 *  record.c   descriptor writes that name a buffer: translated, and kept to be
 *             written again after a restore
 *  cmds.c     command buffers: their states, found without a lock while recorded;
 *             the commands that name a buffer, translated; what each command may
 *             write, told to writes.c
 *  cmds2.c    their later forms (synchronization2, copy_commands2), pushed update
 *             templates, and what only a device left alone may use (sparse binds)
 *  engine.c   submits through the gate; swapping out to host memory and back in:
 *             what each word of vramlock run does (core/control.h's engine_ops)
 *  stage.c    host copies, and the copies between them and the device: the
 *             device's own where it has host memory it can copy to
 *  ahead.c    host copies made before the first release needs them, on a thread of
 *             the layer's own while the program is idle
 *  writes.c   which memory the program's GPU work may have written since the last
 *             restore: only that is copied out again
 *  spirv.c    which descriptor bindings a shader module may write
 *  memtypes.c the memory types the program sees: device-local ones it cannot map,
 *             and where that leaves none it can, host ones the layer adds
 *  start.c    set-up: the engine registered with control, the gate closed until the
 *             process joins; in a forked child, what its parent made forgotten
 *
 * and below them the engine's core, the CUDA library's too (../core): the process's
 * state and its checked transitions, the gate that holds GPU work while released, the
 * connection to vramlock run (VRAMLOCK_SWAP_SOCKET), the same conversation as the
 * CUDA library's.
 *
 * Without VRAMLOCK_SWAP_SOCKET the layer stays out of the way: it wraps nothing.
 */
#ifndef VRAMLOCK_VKLAYER_H
#define VRAMLOCK_VKLAYER_H

#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <vulkan/vk_layer.h>
#include <vulkan/vulkan.h>

#include "../core/control.h"
#include "../core/gate.h"
#include "../core/state.h"

#define EXPORT __attribute__((visibility("default")))
#define LAYER_NAME "VK_LAYER_VRAMLOCK_swap"

/* ---- the memory types the program sees (memtypes.c) ---------------------------- */

struct memmap {
	uint32_t count;
	VkMemoryType types[VK_MAX_MEMORY_TYPES];
	uint32_t driver[VK_MAX_MEMORY_TYPES]; /* each one's driver type */
	uint32_t allowance;		      /* the types of the mapped allowance */
};

/* ---- per device: the next layer's entry points we call ------------------------ */

struct vdev {
	VkDevice dev;
	VkPhysicalDevice phys;
	PFN_vkGetDeviceProcAddr gdpa;
	VkPhysicalDeviceMemoryProperties props; /* the driver's */
	struct memmap shown;			/* what the program sees */
	/* The device enables what the layer cannot translate: it wraps nothing
	 * (`passive`, with why), and a release is refused. */
	int passive;
	char why[160];
	/* In a forked child: made by its parent before the fork (start.c's `forget`). The
	 * driver's device is its parent's: the child's calls on it still pass the gate, but
	 * a release neither waits for it nor moves memory of it. */
	int inherited;
	/* For the layer's own copies (stage.c): the first queue the program asked for, and
	 * what makes the layer's own dispatchable objects the loader's. */
	uint32_t family;
	PFN_vkSetDeviceLoaderData set_loader_data;
	struct stage *stage;
	VkDeviceSize allowance_used; /* with `mu`: memory of the mapped allowance's types */
#define DEV_FN(name) PFN_vk##name name;
#include "vkfuncs.h"
#undef DEV_FN
	struct vdev *next;
};

/* ---- the program's memory and buffers (table.c) --------------------------------- */

struct vmem {
	VkDeviceMemory real; /* VK_NULL_HANDLE while released */
	struct vdev *d;
	VkDeviceSize size;
	uint32_t type;	/* the driver's */
	uint32_t shown; /* the type the program allocated (memtypes.c) */
	VkMemoryAllocateFlags flags; /* VkMemoryAllocateFlagsInfo, where given */
	struct vbuf *dedicated;	     /* VkMemoryDedicatedAllocateInfo's buffer */
	/* Stays on the device through a release: mapped by the program, bound to an
	 * image, or made with what the layer cannot make again. */
	int mapped;
	int kept;
	/* Its host copy (stage.c): its contents while released, kept after a restore;
	 * the layer's own host-visible memory (host_mem, mapped at host) or malloc'd. */
	void *host;
	VkDeviceMemory host_mem;
	int written; /* since its host copy was last right (writes.c) */
	int not_ahead; /* its host copy is not to be made ahead (ahead.c): it failed, or
			* the host could not spare it */
	struct vmem *next;
};

struct vbuf {
	VkBuffer real;
	struct vdev *d;
	VkBufferCreateInfo ci; /* pNext dropped, queue families copied */
	uint32_t *families;
	struct vmem *mem;
	VkDeviceSize offset;
	int kept; /* made with what the layer may not make again, or viewed */
	struct vbuf *next;
};

/* Calls from the program: a handle of ours, the driver's now (NULL stays NULL). */
static inline VkDeviceMemory real_mem(VkDeviceMemory m)
{
	return m ? ((struct vmem *)m)->real : VK_NULL_HANDLE;
}

static inline VkBuffer real_buf(VkBuffer b)
{
	return b ? ((struct vbuf *)b)->real : VK_NULL_HANDLE;
}

/* Is this (a handle the program passed) one of ours? */
static inline int is_ours(struct vdev *d)
{
	return engine.active && d && !d->passive;
}

/* devices.c: every instance and device the layer made, found by any handle it
 * dispatches: they share the loader's dispatch key, its first word. */
struct vinst {
	void *key; /* the loader's dispatch key: the first word of every handle it made */
	VkInstance inst;
	PFN_vkGetInstanceProcAddr gipa;
	PFN_vkDestroyInstance DestroyInstance;
	PFN_vkGetPhysicalDeviceMemoryProperties GetPhysicalDeviceMemoryProperties;
	PFN_vkGetPhysicalDeviceMemoryProperties2 GetPhysicalDeviceMemoryProperties2;
	PFN_vkGetPhysicalDeviceMemoryProperties2KHR GetPhysicalDeviceMemoryProperties2KHR;
	PFN_vkGetPhysicalDeviceFeatures2 GetPhysicalDeviceFeatures2;
	PFN_vkGetPhysicalDeviceFeatures2KHR GetPhysicalDeviceFeatures2KHR;
	int without_addresses; /* the program goes on without device addresses */
	struct vinst *next;
};

static inline void *key_of(const void *dispatchable)
{
	return *(void *const *)dispatchable;
}

struct vinst *inst_of(const void *dispatchable);
void inst_add(struct vinst *i);
void inst_remove(struct vinst *i);
/* devices.c's list: it only grows, and a device is complete before it is published
 * (dev_add), so that every call of the program's finds its device here, no lock. Any
 * handle the device made that the loader dispatches (device, queue, command buffer)
 * shares its dispatch key. */
extern struct vdev *devices;
static inline struct vdev *dev_of(VkDevice dev)
{
	void *key = key_of(dev);
	struct vdev *d = __atomic_load_n(&devices, __ATOMIC_ACQUIRE);
	while (d && key_of(d->dev) != key)
		d = d->next;
	return d;
}
struct vdev *dev_list(void);
void dev_add(struct vdev *d);

/* devices.c: the driver's memory properties (2: the core call, or the KHR one). */
void driver_memory_properties(VkPhysicalDevice phys, VkPhysicalDeviceMemoryProperties *p);
void driver_memory_properties2(VkPhysicalDevice phys, VkPhysicalDeviceMemoryProperties2 *p,
			       int khr);

/* memtypes.c: the types shown for the driver's (`map`); a driver's type bits as shown,
 * a shown type's driver type, and may the program map memory of it? */
void memtypes_build(const VkPhysicalDeviceMemoryProperties *driver, struct memmap *map);
uint32_t memtypes_bits(const struct vdev *d, uint32_t driver_bits);
/* A buffer's bits: with the mapped allowance's types while `size` fits in what is left of
 * it (VRAMLOCK_VULKAN_MAPPED, `mapped_allowance` bytes a device); is `shown` one? */
uint32_t memtypes_buffer_bits(struct vdev *d, uint32_t driver_bits, VkDeviceSize size);
int memtypes_allowance(const struct vdev *d, uint32_t shown);
extern VkDeviceSize mapped_allowance;
uint32_t memtypes_driver(const struct vdev *d, uint32_t shown);
int memtypes_mappable(const struct vdev *d, uint32_t shown);
void memtypes_instance_hook(const char *name, PFN_vkVoidFunction *fn);
int memtypes_hook(const char *name, PFN_vkVoidFunction *fn);
/* Is `name` an entry point that translates memory types (the program gets ours on a
 * device the layer otherwise leaves alone)? */
int memtypes_named(const char *name);

/* table.c */
void table_hook(const char *name, PFN_vkVoidFunction *fn);
int table_swappable(struct vmem *m);
/* With `mu`: the host copies of `d`'s memory freed (the device goes). */
void table_device_gone(struct vdev *d);
struct vmem *mem_list(void);
struct vbuf *buf_list(void);
/* With `mu`: is `m` the program's memory still (not freed)? */
int table_has(struct vmem *m);
/* With `mu`: when memory was last made or freed (now_ms). */
extern double table_changed_ms;
/* In a forked child, each part's records of what its parent made forgotten (start.c's
 * `forget`). */
void table_forget(void);
void cmds_forget(void);
void record_forget(void);
void writes_forget(void);
void ahead_forget(void);

/* writes.c's record of what a command buffer's recording writes (cmds.c keeps it). */
struct cbw;

/* record.c */
void sets_hook(const char *name, PFN_vkVoidFunction *fn);
/* With `mu`, after a restore: every kept descriptor write naming a buffer made again. */
void record_rewrite(void);
void record_forget_buffer(struct vbuf *b);
/* With `mu`: the memory of each storage buffer the set names at `binding`
 * (UINT32_MAX: any) counts as written. */
void record_mark_written(VkDescriptorSet set, uint32_t binding);
/* With `mu`: a copy of an update template's raw data naming the driver's buffers (free
 * it), or NULL (refused); `written(cb, buffer)` is told each storage buffer it names
 * (pushed by the command buffer whose record is `cw`: the caller's way to writes.c,
 * which record.c does not call). */
void *template_data(VkDescriptorUpdateTemplate t, const void *data, struct cbw *cw,
		    void (*written)(struct cbw *, VkBuffer));

/* cmds.c */
void record_hook(const char *name, PFN_vkVoidFunction *fn);
/* With `mu`: why a release cannot be made now (a command buffer being recorded, or
 * one recorded over the program's buffers and kept to be submitted again), or NULL. */
const char *record_busy(void);
/* With `mu`: `cb` was submitted (a one-time command buffer is spent). */
void record_submitted(VkCommandBuffer cb);
/* A command that names the program's buffers was recorded into `cb`: the record of
 * what `cb` writes, or NULL (out of host memory). */
struct cbw *record_names(VkCommandBuffer cb);
/* Without `mu`: the record of what `cb` writes, or NULL (out of host memory). */
struct cbw *cb_writes(VkCommandBuffer cb);

/* cmds2.c */
void cmds2_hook(const char *name, PFN_vkVoidFunction *fn);

/* engine.c: submits through the gate (core/gate.h), and the swap itself. */
void engine_hook(const char *name, PFN_vkVoidFunction *fn);
/* What vramlock run's `release` and `restore` do (start.c puts them in the engine's
 * callbacks, core/control.h), with `mu`. */
void engine_release(char *answer, size_t len, int stay_closed);
void engine_restore(char *answer, size_t len);
/* With `mu`: why no release can ever work (refused, or a device left alone), or NULL. */
const char *release_refused(void);

/* stage.c, with `mu`: `m`'s host copy made (if not yet); `m`'s contents to it (out)
 * or back (!out), at once or into the device's batch; every batch submitted and
 * waited for (given the first error so far, which drops them); VK_SUCCESS or the
 * first error. */
VkResult stage_host(struct vmem *m);
/* With `mu`: where `m` has no host copy and would have one of the device's way, that
 * copy's size and memory type, and 1; else 0. Then host memory of `size` bytes of `type`
 * on `d`, mapped at `*at`: VK_SUCCESS, or an error with nothing made; the driver's calls
 * only, made with `mu` or without (ahead.c makes it without). */
int stage_host_kind(struct vmem *m, VkDeviceSize *size, uint32_t *type);
VkResult stage_host_memory(struct vdev *d, uint32_t type, VkDeviceSize size,
			   VkDeviceMemory *mem, void **at);
void stage_host_free(struct vmem *m);
VkResult stage_copy(struct vmem *m, int out);
VkResult stage_send(struct vdev *d); /* what is recorded of d's batch, started */
VkResult stage_flush(VkResult r);
void stage_free(struct vdev *d);
/* VRAMLOCK_VULKAN_STAGING=1 (a test's hook): the device copies, into host copies of
 * any host-visible memory type (lavapipe has no other). */
extern int staging_forced;

/* writes.c: what command buffers write, marked at submit (with `mu` where said). A
 * command buffer's record (struct cbw) is cmds.c's to keep. */
void writes_hook(const char *name, PFN_vkVoidFunction *fn);
void writes_buffer(struct cbw *c, VkBuffer buf); /* a command writes into buf */
void writes_bind_sets(struct cbw *c, VkPipelineBindPoint point, uint32_t first, uint32_t n,
		      const VkDescriptorSet *sets);
void writes_dispatch(struct cbw *c);
void writes_bind_pipeline(struct cbw *c, VkPipeline p); /* bound for compute */
void writes_execute(struct cbw *c, const struct cbw *from); /* executes from's */
struct cbw *writes_new(void);	      /* with `mu`: a record, or NULL (track lost) */
void writes_free(struct cbw *w);      /* with `mu` */
void writes_clear(struct cbw *w);     /* with `mu`: recorded anew, or reset */
void writes_submitted(struct cbw *w); /* with `mu` */
void writes_sweep(void);	      /* with `mu`, none recorded: the dropped freed */
int writes_since(struct vmem *m);     /* with `mu`: must it be copied out? */
void writes_copied(void);	      /* with `mu`: every host copy right */

/* spirv.c: the (set, binding)s a module's code may write; `all` where unsure. */
struct spv_slot {
	uint32_t set, binding;
};
struct spv_writes {
	int all;
	uint32_t n;
	struct spv_slot *slots;
};
void spirv_writes(const uint32_t *code, size_t bytes, struct spv_writes *out);
void spirv_writes_free(struct spv_writes *w);

/* ahead.c: host copies made ahead while the program is idle. `ahead_wanted`: not
 * VRAMLOCK_SWAP_PREPARE=0 (start.c reads it); ahead_start: the thread started, once
 * (at the first device the layer acts on); ahead_wait, with `mu`: returns once no host
 * copy is being made on `d` (it lets go of `mu` meanwhile): the device may go. */
extern int ahead_wanted;
void ahead_start(void);
void ahead_wait(struct vdev *d);

/* start.c: the constructor; core/control.h's control_join at the first instance. */

/* One entry point a part of the layer serves, by the name the program asks for. */
struct hook {
	const char *name;
	PFN_vkVoidFunction fn;
};
#define HOOK(n, f) {"vk" #n, (PFN_vkVoidFunction)f}

/* `*fn` becomes the part's own for `name` where its table `hooks` has one: 1 if so. */
static inline int hook_lookup(const struct hook *hooks, size_t n, const char *name,
			      PFN_vkVoidFunction *fn)
{
	for (size_t k = 0; k < n; k++)
		if (!strcmp(hooks[k].name, name)) {
			*fn = hooks[k].fn;
			return 1;
		}
	return 0;
}

#endif
