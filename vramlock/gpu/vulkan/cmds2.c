/*
 * cmds2.c: the later forms of the commands that name a buffer (Vulkan 1.3's
 * synchronization2 and copy_commands2, their KHR aliases, vkCmdBindVertexBuffers2),
 * pushed descriptors written through an update template, and the calls that can
 * only name a buffer or memory on a device the layer leaves alone (sparse binding,
 * opaque capture addresses): translated like their 1.0 forms (cmds.c), with the
 * same write tracking (writes.c). One entry point of ours serves a command and its
 * alias: it calls down whichever of the two the driver gave.
 */
#include "vklayer.h"

#define PICK(d, core, alias) ((d)->core ? (d)->core : (d)->alias)

#define CMD_PROLOGUE(fn, ...)                              \
	struct vdev *d = dev_of((VkDevice)cb);             \
	if (!is_ours(d)) {                                 \
		fn(__VA_ARGS__);                           \
		return;                                    \
	}                                                  \
	struct cbw *cw = record_names(cb);                 \
	(void)cw

/* ---- copies ------------------------------------------------------------------ */

static VKAPI_ATTR void VKAPI_CALL copy_buffer2(VkCommandBuffer cb, const VkCopyBufferInfo2 *info)
{
	PFN_vkCmdCopyBuffer2 fn = PICK(dev_of((VkDevice)cb), CmdCopyBuffer2, CmdCopyBuffer2KHR);
	CMD_PROLOGUE(fn, cb, info);
	VkCopyBufferInfo2 copy = *info;
	copy.srcBuffer = real_buf(info->srcBuffer);
	copy.dstBuffer = real_buf(info->dstBuffer);
	writes_buffer(cw, info->dstBuffer);
	fn(cb, &copy);
}

static VKAPI_ATTR void VKAPI_CALL copy_to_image2(VkCommandBuffer cb,
						 const VkCopyBufferToImageInfo2 *info)
{
	PFN_vkCmdCopyBufferToImage2 fn =
		PICK(dev_of((VkDevice)cb), CmdCopyBufferToImage2, CmdCopyBufferToImage2KHR);
	CMD_PROLOGUE(fn, cb, info);
	VkCopyBufferToImageInfo2 copy = *info;
	copy.srcBuffer = real_buf(info->srcBuffer);
	fn(cb, &copy);
}

static VKAPI_ATTR void VKAPI_CALL copy_from_image2(VkCommandBuffer cb,
						   const VkCopyImageToBufferInfo2 *info)
{
	PFN_vkCmdCopyImageToBuffer2 fn =
		PICK(dev_of((VkDevice)cb), CmdCopyImageToBuffer2, CmdCopyImageToBuffer2KHR);
	CMD_PROLOGUE(fn, cb, info);
	VkCopyImageToBufferInfo2 copy = *info;
	copy.dstBuffer = real_buf(info->dstBuffer);
	writes_buffer(cw, info->dstBuffer);
	fn(cb, &copy);
}

/* ---- dependencies: every VkBufferMemoryBarrier2 translated ---------------------- */

/* `n` dependency infos naming the driver's buffers, in one block with their barriers
 * (free it), or NULL (refused: out of host memory). */
static VkDependencyInfo *dependencies(uint32_t n, const VkDependencyInfo *in)
{
	size_t total = 0;
	for (uint32_t k = 0; k < n; k++)
		total += in[k].bufferMemoryBarrierCount;
	VkDependencyInfo *out = malloc(sizeof *out * n + sizeof(VkBufferMemoryBarrier2) * total + 1);
	if (!out) {
		refuse("out of host memory for a barrier");
		return NULL;
	}
	VkBufferMemoryBarrier2 *bars = (VkBufferMemoryBarrier2 *)(out + n);
	for (uint32_t k = 0; k < n; k++) {
		out[k] = in[k];
		for (uint32_t i = 0; i < in[k].bufferMemoryBarrierCount; i++) {
			bars[i] = in[k].pBufferMemoryBarriers[i];
			bars[i].buffer = real_buf(bars[i].buffer);
		}
		out[k].pBufferMemoryBarriers = in[k].bufferMemoryBarrierCount ? bars : NULL;
		bars += in[k].bufferMemoryBarrierCount;
	}
	return out;
}

static VKAPI_ATTR void VKAPI_CALL pipeline_barrier2(VkCommandBuffer cb,
						    const VkDependencyInfo *dep)
{
	PFN_vkCmdPipelineBarrier2 fn =
		PICK(dev_of((VkDevice)cb), CmdPipelineBarrier2, CmdPipelineBarrier2KHR);
	CMD_PROLOGUE(fn, cb, dep);
	VkDependencyInfo *copy = dependencies(1, dep);
	if (copy)
		fn(cb, copy);
	free(copy);
}

static VKAPI_ATTR void VKAPI_CALL wait_events2(VkCommandBuffer cb, uint32_t n, const VkEvent *e,
					       const VkDependencyInfo *deps)
{
	PFN_vkCmdWaitEvents2 fn = PICK(dev_of((VkDevice)cb), CmdWaitEvents2, CmdWaitEvents2KHR);
	CMD_PROLOGUE(fn, cb, n, e, deps);
	VkDependencyInfo *copy = dependencies(n, deps);
	if (copy)
		fn(cb, n, e, copy);
	free(copy);
}

static VKAPI_ATTR void VKAPI_CALL set_event2(VkCommandBuffer cb, VkEvent e,
					     const VkDependencyInfo *dep)
{
	PFN_vkCmdSetEvent2 fn = PICK(dev_of((VkDevice)cb), CmdSetEvent2, CmdSetEvent2KHR);
	CMD_PROLOGUE(fn, cb, e, dep);
	VkDependencyInfo *copy = dependencies(1, dep);
	if (copy)
		fn(cb, e, copy);
	free(copy);
}

/* ---- vertex buffers and pushed templates ------------------------------------------ */

static VKAPI_ATTR void VKAPI_CALL bind_vertex2(VkCommandBuffer cb, uint32_t first, uint32_t n,
					       const VkBuffer *bufs, const VkDeviceSize *offsets,
					       const VkDeviceSize *sizes,
					       const VkDeviceSize *strides)
{
	PFN_vkCmdBindVertexBuffers2 fn =
		PICK(dev_of((VkDevice)cb), CmdBindVertexBuffers2, CmdBindVertexBuffers2EXT);
	CMD_PROLOGUE(fn, cb, first, n, bufs, offsets, sizes, strides);
	VkBuffer *copy = malloc(sizeof *copy * (n ? n : 1));
	if (!copy) {
		refuse("out of host memory for a vertex binding");
		return;
	}
	for (uint32_t k = 0; k < n; k++)
		copy[k] = real_buf(bufs[k]);
	fn(cb, first, n, copy, offsets, sizes, strides);
	free(copy);
}

static VKAPI_ATTR void VKAPI_CALL push_template(VkCommandBuffer cb,
						VkDescriptorUpdateTemplate t,
						VkPipelineLayout layout, uint32_t set,
						const void *data)
{
	CMD_PROLOGUE(d->CmdPushDescriptorSetWithTemplateKHR, cb, t, layout, set, data);
	pthread_mutex_lock(&mu);
	void *copy = template_data(t, data, cw, writes_buffer);
	pthread_mutex_unlock(&mu);
	if (copy)
		d->CmdPushDescriptorSetWithTemplateKHR(cb, t, layout, set, copy);
	free(copy);
}

/* ---- what only a device the layer leaves alone can use --------------------------- */

/* Opaque capture addresses need bufferDeviceAddress, which leaves the device alone
 * (layer.c): translated all the same, and the process refused. */
static VKAPI_ATTR uint64_t VKAPI_CALL buffer_capture(VkDevice dev,
						     const VkBufferDeviceAddressInfo *info)
{
	struct vdev *d = dev_of(dev);
	PFN_vkGetBufferOpaqueCaptureAddress fn =
		PICK(d, GetBufferOpaqueCaptureAddress, GetBufferOpaqueCaptureAddressKHR);
	if (!is_ours(d))
		return fn(dev, info);
	refuse("the program uses buffer device addresses, which the layer cannot keep yet");
	VkBufferDeviceAddressInfo copy = *info;
	copy.buffer = real_buf(info->buffer);
	return fn(dev, &copy);
}

static VKAPI_ATTR uint64_t VKAPI_CALL memory_capture(
	VkDevice dev, const VkDeviceMemoryOpaqueCaptureAddressInfo *info)
{
	struct vdev *d = dev_of(dev);
	PFN_vkGetDeviceMemoryOpaqueCaptureAddress fn = PICK(
		d, GetDeviceMemoryOpaqueCaptureAddress, GetDeviceMemoryOpaqueCaptureAddressKHR);
	if (!is_ours(d))
		return fn(dev, info);
	refuse("the program uses buffer device addresses, which the layer cannot keep yet");
	VkDeviceMemoryOpaqueCaptureAddressInfo copy = *info;
	copy.memory = real_mem(info->memory);
	return fn(dev, &copy);
}

/* Sparse binding leaves the device alone (layer.c): on a device of ours a bind names
 * no resource, and only waits on and signals what it names, through the gate as a
 * submit. One that binds memory all the same is refused, never passed down. */
static VKAPI_ATTR VkResult VKAPI_CALL bind_sparse(VkQueue q, uint32_t n, const VkBindSparseInfo *s,
						  VkFence fence)
{
	struct vdev *d = dev_of((VkDevice)q);
	if (!is_ours(d))
		return d->QueueBindSparse(q, n, s, fence);
	for (uint32_t k = 0; k < n; k++)
		if (s[k].bufferBindCount || s[k].imageOpaqueBindCount || s[k].imageBindCount) {
			refuse("the program binds sparse memory without enabling sparse binding");
			return VK_ERROR_FEATURE_NOT_PRESENT;
		}
	gate_enter();
	VkResult r = d->QueueBindSparse(q, n, s, fence);
	gate_leave();
	return r;
}

void cmds2_hook(const char *name, PFN_vkVoidFunction *fn)
{
	static const struct hook hooks[] = {
		HOOK(CmdCopyBuffer2, copy_buffer2),
		HOOK(CmdCopyBuffer2KHR, copy_buffer2),
		HOOK(CmdCopyBufferToImage2, copy_to_image2),
		HOOK(CmdCopyBufferToImage2KHR, copy_to_image2),
		HOOK(CmdCopyImageToBuffer2, copy_from_image2),
		HOOK(CmdCopyImageToBuffer2KHR, copy_from_image2),
		HOOK(CmdPipelineBarrier2, pipeline_barrier2),
		HOOK(CmdPipelineBarrier2KHR, pipeline_barrier2),
		HOOK(CmdWaitEvents2, wait_events2),
		HOOK(CmdWaitEvents2KHR, wait_events2),
		HOOK(CmdSetEvent2, set_event2),
		HOOK(CmdSetEvent2KHR, set_event2),
		HOOK(CmdBindVertexBuffers2, bind_vertex2),
		HOOK(CmdBindVertexBuffers2EXT, bind_vertex2),
		HOOK(CmdPushDescriptorSetWithTemplateKHR, push_template),
		HOOK(GetBufferOpaqueCaptureAddress, buffer_capture),
		HOOK(GetBufferOpaqueCaptureAddressKHR, buffer_capture),
		HOOK(GetDeviceMemoryOpaqueCaptureAddress, memory_capture),
		HOOK(GetDeviceMemoryOpaqueCaptureAddressKHR, memory_capture),
		HOOK(QueueBindSparse, bind_sparse),
	};
	hook_lookup(hooks, sizeof hooks / sizeof *hooks, name, fn);
}
