/*
 * cmds.c: command buffers. Their states are followed (initial, recording,
 * executable) with whether a recording names the program's buffers (a buffer of
 * ours, or any descriptor set bound); the commands that name a buffer are
 * translated to the driver's buffer of the moment.
 *
 * A command is recorded with no lock taken: its command buffer's record is found in a
 * table read without `mu` (each record published whole, with a release store; one that
 * goes is unlinked at once but freed only once no command buffer is being recorded,
 * for a reader can be on it until then). What a recording changes in its record is read
 * under `mu` only once it is not being recorded: Vulkan has a command buffer recorded
 * by one thread at a time, and record_busy returns first while any is recorded.
 */
#include "vklayer.h"

enum { INITIAL, RECORDING, EXECUTABLE };

struct vcb {
	VkCommandBuffer cb;
	VkCommandPool pool;
	int state, names, once;
	struct cbw *w; /* what it writes (writes.c) */
	struct vcb *next;
	struct vcb *dead; /* unlinked, to be freed (`graves`) */
};

#define BUCKETS 1024
static struct vcb *cbs[BUCKETS];
static struct vcb *graves; /* unlinked records: freed once none is being recorded */
static int recording;	    /* command buffers being recorded now */

static size_t slot(const void *p)
{
	return (size_t)(((uint64_t)(uintptr_t)p * 0x9E3779B97F4A7C15ull) >> 54);
}

void cmds_forget(void)
{
	memset(cbs, 0, sizeof cbs);
	graves = NULL;
	recording = 0; /* the recording threads were its parent's */
}

/* Without `mu`: `cb`'s record, or NULL. */
static struct vcb *cb_find(VkCommandBuffer cb)
{
	struct vcb *c = __atomic_load_n(&cbs[slot(cb)], __ATOMIC_ACQUIRE);
	while (c && c->cb != cb)
		c = __atomic_load_n(&c->next, __ATOMIC_ACQUIRE);
	return c;
}

/* With `mu`. */
static struct vcb *cb_of(VkCommandBuffer cb, int make)
{
	struct vcb *c = cb_find(cb);
	if (c || !make)
		return c;
	c = calloc(1, sizeof *c);
	if (c && !(c->w = writes_new()))
		free(c), c = NULL;
	if (c) {
		c->cb = cb;
		c->next = cbs[slot(cb)];
		__atomic_store_n(&cbs[slot(cb)], c, __ATOMIC_RELEASE);
	}
	return c;
}

/* With `mu`: the records unlinked meanwhile freed, where no command buffer is being
 * recorded (no reader can be on one). */
static void sweep(void)
{
	if (recording)
		return;
	for (struct vcb *c = graves, *next; c; c = next) {
		next = c->dead;
		writes_free(c->w);
		free(c);
	}
	graves = NULL;
	writes_sweep();
}

static void set_state(struct vcb *c, int state)
{
	int was = c->state;
	if (was == RECORDING)
		recording--;
	if (state == RECORDING)
		recording++;
	c->state = state;
	if (state != EXECUTABLE) /* recorded anew or reset: it writes nothing yet */
		writes_clear(c->w);
	if (was == RECORDING && !recording)
		sweep();
}

/* Without `mu`: `cb`'s record (made where there is none: with `mu` then), or NULL: out
 * of host memory (writes.c knows). */
static struct vcb *cb_now(VkCommandBuffer cb)
{
	struct vcb *c = cb_find(cb);
	if (!c) {
		pthread_mutex_lock(&mu);
		c = cb_of(cb, 1);
		pthread_mutex_unlock(&mu);
	}
	return c;
}

/* Without `mu`: the record of what `cb` writes, or NULL. */
struct cbw *cb_writes(VkCommandBuffer cb)
{
	struct vcb *c = cb_now(cb);
	return c ? c->w : NULL;
}

/* With `mu`. */
const char *record_busy(void)
{
	if (recording)
		return "a command buffer is being recorded";
	for (size_t b = 0; b < BUCKETS; b++)
		for (struct vcb *c = cbs[b]; c; c = c->next)
			if (c->state == EXECUTABLE && c->names && !c->once)
				return "a command buffer recorded over its buffers is kept (not reset)";
	return NULL;
}

/* A command that names the program's buffers was recorded into `cb`: the record of
 * what it writes, or NULL (out of host memory). */
struct cbw *record_names(VkCommandBuffer cb)
{
	struct vcb *c = cb_now(cb);
	if (!c)
		return NULL;
	c->names = 1;
	return c->w;
}

void record_submitted(VkCommandBuffer cb)
{
	struct vcb *c = cb_of(cb, 0);
	if (c)
		writes_submitted(c->w); /* what it writes counts as written from now */
	if (c && c->once)
		set_state(c, INITIAL); /* invalid once it ran: never submitted again */
}

static VKAPI_ATTR VkResult VKAPI_CALL allocate_cbs(VkDevice dev,
						   const VkCommandBufferAllocateInfo *info,
						   VkCommandBuffer *out)
{
	struct vdev *d = dev_of(dev);
	VkResult r = d->AllocateCommandBuffers(dev, info, out);
	if (r != VK_SUCCESS || !is_ours(d))
		return r;
	pthread_mutex_lock(&mu);
	for (uint32_t k = 0; k < info->commandBufferCount; k++) {
		struct vcb *c = cb_of(out[k], 1);
		if (c)
			c->pool = info->commandPool, set_state(c, INITIAL), c->names = 0;
	}
	pthread_mutex_unlock(&mu);
	return r;
}

static void forget(struct vcb *gone)
{
	set_state(gone, INITIAL);
	for (struct vcb **p = &cbs[slot(gone->cb)]; *p; p = &(*p)->next)
		if (*p == gone) {
			__atomic_store_n(p, gone->next, __ATOMIC_RELEASE);
			break;
		}
	gone->dead = graves, graves = gone;
	sweep();
}

static VKAPI_ATTR void VKAPI_CALL free_cbs(VkDevice dev, VkCommandPool pool, uint32_t n,
					   const VkCommandBuffer *cb)
{
	struct vdev *d = dev_of(dev);
	pthread_mutex_lock(&mu);
	for (uint32_t k = 0; is_ours(d) && k < n; k++) {
		struct vcb *c = cb[k] ? cb_of(cb[k], 0) : NULL;
		if (c)
			forget(c);
	}
	pthread_mutex_unlock(&mu);
	d->FreeCommandBuffers(dev, pool, n, cb);
}

/* Every command buffer of `pool` reset (`drop`: forgotten). */
static void pool_done(VkCommandPool pool, int drop)
{
	pthread_mutex_lock(&mu);
	for (size_t b = 0; b < BUCKETS; b++)
		for (struct vcb *c = cbs[b], *next; c; c = next) {
			next = c->next;
			if (c->pool != pool)
				continue;
			if (drop)
				forget(c);
			else
				set_state(c, INITIAL), c->names = 0;
		}
	pthread_mutex_unlock(&mu);
}

static VKAPI_ATTR VkResult VKAPI_CALL reset_cb_pool(VkDevice dev, VkCommandPool pool,
						    VkCommandPoolResetFlags flags)
{
	struct vdev *d = dev_of(dev);
	VkResult r = d->ResetCommandPool(dev, pool, flags);
	if (r == VK_SUCCESS && is_ours(d))
		pool_done(pool, 0);
	return r;
}

static VKAPI_ATTR void VKAPI_CALL destroy_cb_pool(VkDevice dev, VkCommandPool pool,
						  const VkAllocationCallbacks *alloc)
{
	struct vdev *d = dev_of(dev);
	if (is_ours(d) && pool)
		pool_done(pool, 1);
	d->DestroyCommandPool(dev, pool, alloc);
}

/* Recording waits while released: what it records names buffers of now. */
static VKAPI_ATTR VkResult VKAPI_CALL begin_cb(VkCommandBuffer cb,
					       const VkCommandBufferBeginInfo *info)
{
	struct vdev *d = dev_of((VkDevice)cb);
	if (!is_ours(d))
		return d->BeginCommandBuffer(cb, info);
	gate_enter_recording();
	VkResult r = d->BeginCommandBuffer(cb, info);
	pthread_mutex_lock(&mu);
	struct vcb *c = cb_of(cb, 1);
	if (c && r == VK_SUCCESS) {
		set_state(c, RECORDING);
		c->names = 0;
		c->once = !!(info->flags & VK_COMMAND_BUFFER_USAGE_ONE_TIME_SUBMIT_BIT);
	}
	pthread_mutex_unlock(&mu);
	gate_leave();
	return r;
}

static VKAPI_ATTR VkResult VKAPI_CALL end_cb(VkCommandBuffer cb)
{
	struct vdev *d = dev_of((VkDevice)cb);
	VkResult r = d->EndCommandBuffer(cb);
	if (!is_ours(d))
		return r;
	pthread_mutex_lock(&mu);
	struct vcb *c = cb_of(cb, 0);
	if (c)
		set_state(c, r == VK_SUCCESS ? EXECUTABLE : INITIAL);
	pthread_mutex_unlock(&mu);
	return r;
}

static VKAPI_ATTR VkResult VKAPI_CALL reset_cb(VkCommandBuffer cb, VkCommandBufferResetFlags flags)
{
	struct vdev *d = dev_of((VkDevice)cb);
	VkResult r = d->ResetCommandBuffer(cb, flags);
	if (r != VK_SUCCESS || !is_ours(d))
		return r;
	pthread_mutex_lock(&mu);
	struct vcb *c = cb_of(cb, 0);
	if (c)
		set_state(c, INITIAL), c->names = 0;
	pthread_mutex_unlock(&mu);
	return r;
}

/* ---- commands ---------------------------------------------------------------- */

#define CMD_PROLOGUE(fn, ...)                              \
	struct vdev *d = dev_of((VkDevice)cb);             \
	if (!is_ours(d)) {                                 \
		d->fn(cb, __VA_ARGS__);                    \
		return;                                    \
	}                                                  \
	struct cbw *cw = record_names(cb);                 \
	(void)cw

static VKAPI_ATTR void VKAPI_CALL bind_sets(VkCommandBuffer cb, VkPipelineBindPoint point,
					    VkPipelineLayout layout, uint32_t first, uint32_t n,
					    const VkDescriptorSet *sets, uint32_t nd,
					    const uint32_t *dyn)
{
	CMD_PROLOGUE(CmdBindDescriptorSets, point, layout, first, n, sets, nd, dyn);
	writes_bind_sets(cw, point, first, n, sets);
	d->CmdBindDescriptorSets(cb, point, layout, first, n, sets, nd, dyn);
}

static VKAPI_ATTR void VKAPI_CALL push_set(VkCommandBuffer cb, VkPipelineBindPoint point,
					   VkPipelineLayout layout, uint32_t set, uint32_t n,
					   const VkWriteDescriptorSet *w)
{
	CMD_PROLOGUE(CmdPushDescriptorSetKHR, point, layout, set, n, w);
	size_t total = 0;
	for (uint32_t k = 0; k < n; k++)
		total += w[k].pBufferInfo ? w[k].descriptorCount : 0;
	VkWriteDescriptorSet *writes = malloc(sizeof *writes * (n ? n : 1));
	VkDescriptorBufferInfo *infos = malloc(sizeof *infos * (total ? total : 1));
	if (!writes || !infos) {
		free(writes), free(infos);
		refuse("out of host memory for a pushed descriptor set");
		return;
	}
	for (uint32_t k = 0, at = 0; k < n; k++) {
		writes[k] = w[k];
		if (!w[k].pBufferInfo)
			continue;
		for (uint32_t i = 0; i < w[k].descriptorCount; i++) {
			if (w[k].descriptorType == VK_DESCRIPTOR_TYPE_STORAGE_BUFFER)
				writes_buffer(cw, w[k].pBufferInfo[i].buffer);
			infos[at + i] = w[k].pBufferInfo[i];
			infos[at + i].buffer = real_buf(w[k].pBufferInfo[i].buffer);
		}
		writes[k].pBufferInfo = infos + at;
		at += w[k].descriptorCount;
	}
	d->CmdPushDescriptorSetKHR(cb, point, layout, set, n, writes);
	free(writes), free(infos);
}

static VKAPI_ATTR void VKAPI_CALL copy_buffer(VkCommandBuffer cb, VkBuffer src, VkBuffer dst,
					      uint32_t n, const VkBufferCopy *r)
{
	CMD_PROLOGUE(CmdCopyBuffer, src, dst, n, r);
	writes_buffer(cw, dst);
	d->CmdCopyBuffer(cb, real_buf(src), real_buf(dst), n, r);
}

static VKAPI_ATTR void VKAPI_CALL copy_to_image(VkCommandBuffer cb, VkBuffer src, VkImage dst,
						VkImageLayout layout, uint32_t n,
						const VkBufferImageCopy *r)
{
	CMD_PROLOGUE(CmdCopyBufferToImage, src, dst, layout, n, r);
	d->CmdCopyBufferToImage(cb, real_buf(src), dst, layout, n, r);
}

static VKAPI_ATTR void VKAPI_CALL copy_from_image(VkCommandBuffer cb, VkImage src,
						  VkImageLayout layout, VkBuffer dst, uint32_t n,
						  const VkBufferImageCopy *r)
{
	CMD_PROLOGUE(CmdCopyImageToBuffer, src, layout, dst, n, r);
	writes_buffer(cw, dst);
	d->CmdCopyImageToBuffer(cb, src, layout, real_buf(dst), n, r);
}

static VKAPI_ATTR void VKAPI_CALL update_buffer(VkCommandBuffer cb, VkBuffer dst,
						VkDeviceSize offset, VkDeviceSize size,
						const void *data)
{
	CMD_PROLOGUE(CmdUpdateBuffer, dst, offset, size, data);
	writes_buffer(cw, dst);
	d->CmdUpdateBuffer(cb, real_buf(dst), offset, size, data);
}

static VKAPI_ATTR void VKAPI_CALL fill_buffer(VkCommandBuffer cb, VkBuffer dst, VkDeviceSize offset,
					      VkDeviceSize size, uint32_t data)
{
	CMD_PROLOGUE(CmdFillBuffer, dst, offset, size, data);
	writes_buffer(cw, dst);
	d->CmdFillBuffer(cb, real_buf(dst), offset, size, data);
}

/* Buffer barriers, translated into `out` (n long). */
static void barriers(VkBufferMemoryBarrier *out, const VkBufferMemoryBarrier *in, uint32_t n)
{
	for (uint32_t k = 0; k < n; k++) {
		out[k] = in[k];
		out[k].buffer = real_buf(in[k].buffer);
	}
}

static VKAPI_ATTR void VKAPI_CALL pipeline_barrier(
	VkCommandBuffer cb, VkPipelineStageFlags src, VkPipelineStageFlags dst,
	VkDependencyFlags dep, uint32_t nm, const VkMemoryBarrier *m, uint32_t nb,
	const VkBufferMemoryBarrier *b, uint32_t ni, const VkImageMemoryBarrier *i)
{
	if (!nb) { /* names no buffer (llama.cpp's, at every dispatch) */
		dev_of((VkDevice)cb)->CmdPipelineBarrier(cb, src, dst, dep, nm, m, nb, b, ni, i);
		return;
	}
	CMD_PROLOGUE(CmdPipelineBarrier, src, dst, dep, nm, m, nb, b, ni, i);
	VkBufferMemoryBarrier few[16]; /* at every dispatch, in some programs */
	VkBufferMemoryBarrier *copy = nb <= 16 ? few : malloc(sizeof *copy * nb);
	if (!copy) {
		refuse("out of host memory for a barrier");
		return;
	}
	barriers(copy, b, nb);
	d->CmdPipelineBarrier(cb, src, dst, dep, nm, m, nb, copy, ni, i);
	if (copy != few)
		free(copy);
}

static VKAPI_ATTR void VKAPI_CALL wait_events(
	VkCommandBuffer cb, uint32_t ne, const VkEvent *e, VkPipelineStageFlags src,
	VkPipelineStageFlags dst, uint32_t nm, const VkMemoryBarrier *m, uint32_t nb,
	const VkBufferMemoryBarrier *b, uint32_t ni, const VkImageMemoryBarrier *i)
{
	CMD_PROLOGUE(CmdWaitEvents, ne, e, src, dst, nm, m, nb, b, ni, i);
	VkBufferMemoryBarrier few[16]; /* at every dispatch, in some programs */
	VkBufferMemoryBarrier *copy = nb <= 16 ? few : malloc(sizeof *copy * nb);
	if (!copy) {
		refuse("out of host memory for a barrier");
		return;
	}
	barriers(copy, b, nb);
	d->CmdWaitEvents(cb, ne, e, src, dst, nm, m, nb, copy, ni, i);
	if (copy != few)
		free(copy);
}

static VKAPI_ATTR void VKAPI_CALL dispatch_indirect(VkCommandBuffer cb, VkBuffer buf,
						    VkDeviceSize offset)
{
	CMD_PROLOGUE(CmdDispatchIndirect, buf, offset);
	writes_dispatch(cw);
	d->CmdDispatchIndirect(cb, real_buf(buf), offset);
}

static VKAPI_ATTR void VKAPI_CALL bind_index(VkCommandBuffer cb, VkBuffer buf, VkDeviceSize offset,
					     VkIndexType type)
{
	CMD_PROLOGUE(CmdBindIndexBuffer, buf, offset, type);
	d->CmdBindIndexBuffer(cb, real_buf(buf), offset, type);
}

static VKAPI_ATTR void VKAPI_CALL bind_vertex(VkCommandBuffer cb, uint32_t first, uint32_t n,
					      const VkBuffer *bufs, const VkDeviceSize *offsets)
{
	CMD_PROLOGUE(CmdBindVertexBuffers, first, n, bufs, offsets);
	VkBuffer *copy = malloc(sizeof *copy * (n ? n : 1));
	if (!copy) {
		refuse("out of host memory for a vertex binding");
		return;
	}
	for (uint32_t k = 0; k < n; k++)
		copy[k] = real_buf(bufs[k]);
	d->CmdBindVertexBuffers(cb, first, n, copy, offsets);
	free(copy);
}

static VKAPI_ATTR void VKAPI_CALL draw_indirect(VkCommandBuffer cb, VkBuffer buf,
						VkDeviceSize offset, uint32_t n, uint32_t stride)
{
	CMD_PROLOGUE(CmdDrawIndirect, buf, offset, n, stride);
	d->CmdDrawIndirect(cb, real_buf(buf), offset, n, stride);
}

static VKAPI_ATTR void VKAPI_CALL draw_indexed_indirect(VkCommandBuffer cb, VkBuffer buf,
							VkDeviceSize offset, uint32_t n,
							uint32_t stride)
{
	CMD_PROLOGUE(CmdDrawIndexedIndirect, buf, offset, n, stride);
	d->CmdDrawIndexedIndirect(cb, real_buf(buf), offset, n, stride);
}

static VKAPI_ATTR void VKAPI_CALL draw_indirect_count(VkCommandBuffer cb, VkBuffer buf,
						      VkDeviceSize offset, VkBuffer count,
						      VkDeviceSize count_offset, uint32_t most,
						      uint32_t stride)
{
	CMD_PROLOGUE(CmdDrawIndirectCount, buf, offset, count, count_offset, most, stride);
	d->CmdDrawIndirectCount(cb, real_buf(buf), offset, real_buf(count), count_offset, most,
				stride);
}

static VKAPI_ATTR void VKAPI_CALL draw_indexed_indirect_count(VkCommandBuffer cb, VkBuffer buf,
							      VkDeviceSize offset, VkBuffer count,
							      VkDeviceSize count_offset,
							      uint32_t most, uint32_t stride)
{
	CMD_PROLOGUE(CmdDrawIndexedIndirectCount, buf, offset, count, count_offset, most, stride);
	d->CmdDrawIndexedIndirectCount(cb, real_buf(buf), offset, real_buf(count), count_offset,
				       most, stride);
}

static VKAPI_ATTR void VKAPI_CALL copy_queries(VkCommandBuffer cb, VkQueryPool pool,
					       uint32_t first, uint32_t n, VkBuffer dst,
					       VkDeviceSize offset, VkDeviceSize stride,
					       VkQueryResultFlags flags)
{
	CMD_PROLOGUE(CmdCopyQueryPoolResults, pool, first, n, dst, offset, stride, flags);
	writes_buffer(cw, dst);
	d->CmdCopyQueryPoolResults(cb, pool, first, n, real_buf(dst), offset, stride, flags);
}

/* ---- the commands that name no buffer, followed for what they write (writes.c) -- */

static VKAPI_ATTR void VKAPI_CALL bind_pipeline(VkCommandBuffer cb, VkPipelineBindPoint point,
						VkPipeline p)
{
	struct vdev *d = dev_of((VkDevice)cb);
	if (is_ours(d) && point == VK_PIPELINE_BIND_POINT_COMPUTE)
		writes_bind_pipeline(cb_writes(cb), p);
	d->CmdBindPipeline(cb, point, p);
}

static VKAPI_ATTR void VKAPI_CALL dispatch(VkCommandBuffer cb, uint32_t x, uint32_t y, uint32_t z)
{
	struct vdev *d = dev_of((VkDevice)cb);
	if (is_ours(d))
		writes_dispatch(cb_writes(cb));
	d->CmdDispatch(cb, x, y, z);
}

static VKAPI_ATTR void VKAPI_CALL dispatch_base(VkCommandBuffer cb, uint32_t bx, uint32_t by,
						uint32_t bz, uint32_t x, uint32_t y, uint32_t z)
{
	struct vdev *d = dev_of((VkDevice)cb);
	if (is_ours(d))
		writes_dispatch(cb_writes(cb));
	d->CmdDispatchBase(cb, bx, by, bz, x, y, z);
}

/* A primary command buffer that executes secondaries writes what they write (each
 * recorded by this thread, or done: no lock). */
static VKAPI_ATTR void VKAPI_CALL execute(VkCommandBuffer cb, uint32_t n, const VkCommandBuffer *s)
{
	struct vdev *d = dev_of((VkDevice)cb);
	struct cbw *c = is_ours(d) ? cb_writes(cb) : NULL;
	for (uint32_t k = 0; c && k < n; k++)
		writes_execute(c, cb_writes(s[k]));
	d->CmdExecuteCommands(cb, n, s);
}

void record_hook(const char *name, PFN_vkVoidFunction *fn)
{
	static const struct hook hooks[] = {
		HOOK(AllocateCommandBuffers, allocate_cbs),
		HOOK(CmdBindPipeline, bind_pipeline),
		HOOK(CmdDispatch, dispatch),
		HOOK(CmdDispatchBase, dispatch_base),
		HOOK(CmdExecuteCommands, execute),
		HOOK(FreeCommandBuffers, free_cbs),
		HOOK(ResetCommandPool, reset_cb_pool),
		HOOK(DestroyCommandPool, destroy_cb_pool),
		HOOK(BeginCommandBuffer, begin_cb),
		HOOK(EndCommandBuffer, end_cb),
		HOOK(ResetCommandBuffer, reset_cb),
		HOOK(CmdBindDescriptorSets, bind_sets),
		HOOK(CmdPushDescriptorSetKHR, push_set),
		HOOK(CmdCopyBuffer, copy_buffer),
		HOOK(CmdCopyBufferToImage, copy_to_image),
		HOOK(CmdCopyImageToBuffer, copy_from_image),
		HOOK(CmdUpdateBuffer, update_buffer),
		HOOK(CmdFillBuffer, fill_buffer),
		HOOK(CmdPipelineBarrier, pipeline_barrier),
		HOOK(CmdWaitEvents, wait_events),
		HOOK(CmdDispatchIndirect, dispatch_indirect),
		HOOK(CmdBindIndexBuffer, bind_index),
		HOOK(CmdBindVertexBuffers, bind_vertex),
		HOOK(CmdDrawIndirect, draw_indirect),
		HOOK(CmdDrawIndexedIndirect, draw_indexed_indirect),
		HOOK(CmdDrawIndirectCount, draw_indirect_count),
		HOOK(CmdDrawIndexedIndirectCount, draw_indexed_indirect_count),
		HOOK(CmdCopyQueryPoolResults, copy_queries),
	};
	hook_lookup(hooks, sizeof hooks / sizeof *hooks, name, fn);
}
