/*
 * stage.c: copies of the program's memory that the host cannot map (a discrete GPU's
 * device-local memory), out to its host copy and back in. Per device, made at the
 * first such copy and kept: a staging buffer of STAGE bytes in host-visible memory,
 * mapped; a command pool, a command buffer and a fence on the first queue family the
 * program asked for. A buffer of the layer's own covers the memory for the copy
 * (bound at offset 0, destroyed after it). Called with `mu`, the gate closed: no
 * submit of the program's is in flight on that queue.
 */
#include "vklayer.h"

#define STAGE (64ull << 20)

struct stage {
	VkQueue queue;
	VkCommandPool pool;
	VkCommandBuffer cb;
	VkFence fence;
	VkBuffer buf;
	VkDeviceMemory mem;
	void *host;
};

int staging_forced;

static int host_type(struct vdev *d, uint32_t bits)
{
	VkMemoryPropertyFlags want =
		VK_MEMORY_PROPERTY_HOST_VISIBLE_BIT | VK_MEMORY_PROPERTY_HOST_COHERENT_BIT;
	for (uint32_t t = 0; t < d->props.memoryTypeCount; t++)
		if ((bits & (1u << t)) && (d->props.memoryTypes[t].propertyFlags & want) == want)
			return (int)t;
	return -1;
}

/* A buffer of `size` bytes for copies, with its requirements. */
static VkResult copy_buffer(struct vdev *d, VkDeviceSize size, VkBuffer *b,
			    VkMemoryRequirements *req)
{
	VkBufferCreateInfo ci = {.sType = VK_STRUCTURE_TYPE_BUFFER_CREATE_INFO, .size = size,
				 .usage = VK_BUFFER_USAGE_TRANSFER_SRC_BIT |
					  VK_BUFFER_USAGE_TRANSFER_DST_BIT,
				 .sharingMode = VK_SHARING_MODE_EXCLUSIVE};
	VkResult r = d->CreateBuffer(d->dev, &ci, NULL, b);
	if (r == VK_SUCCESS)
		d->GetBufferMemoryRequirements(d->dev, *b, req);
	return r;
}

static VkResult make_staging(struct vdev *d, struct stage *s)
{
	VkMemoryRequirements req;
	VkResult r = copy_buffer(d, STAGE, &s->buf, &req);
	int type = r == VK_SUCCESS ? host_type(d, req.memoryTypeBits) : -1;
	if (r == VK_SUCCESS && type < 0)
		r = VK_ERROR_FEATURE_NOT_PRESENT;
	VkMemoryAllocateInfo ai = {.sType = VK_STRUCTURE_TYPE_MEMORY_ALLOCATE_INFO,
				   .allocationSize = req.size, .memoryTypeIndex = (uint32_t)type};
	if (r == VK_SUCCESS)
		r = d->AllocateMemory(d->dev, &ai, NULL, &s->mem);
	if (r == VK_SUCCESS)
		r = d->BindBufferMemory(d->dev, s->buf, s->mem, 0);
	if (r == VK_SUCCESS)
		r = d->MapMemory(d->dev, s->mem, 0, VK_WHOLE_SIZE, 0, &s->host);
	return r;
}

static VkResult make_queue(struct vdev *d, struct stage *s)
{
	VkCommandPoolCreateInfo pci = {.sType = VK_STRUCTURE_TYPE_COMMAND_POOL_CREATE_INFO,
				       .flags = VK_COMMAND_POOL_CREATE_RESET_COMMAND_BUFFER_BIT,
				       .queueFamilyIndex = d->family};
	VkCommandBufferAllocateInfo cai = {.sType = VK_STRUCTURE_TYPE_COMMAND_BUFFER_ALLOCATE_INFO,
					   .level = VK_COMMAND_BUFFER_LEVEL_PRIMARY,
					   .commandBufferCount = 1};
	VkFenceCreateInfo fi = {.sType = VK_STRUCTURE_TYPE_FENCE_CREATE_INFO};
	d->GetDeviceQueue(d->dev, d->family, 0, &s->queue);
	VkResult r = d->set_loader_data ? d->set_loader_data(d->dev, s->queue)
					: VK_ERROR_INITIALIZATION_FAILED;
	if (r == VK_SUCCESS)
		r = d->CreateCommandPool(d->dev, &pci, NULL, &s->pool);
	cai.commandPool = s->pool;
	if (r == VK_SUCCESS)
		r = d->AllocateCommandBuffers(d->dev, &cai, &s->cb);
	if (r == VK_SUCCESS)
		r = d->set_loader_data(d->dev, s->cb);
	if (r == VK_SUCCESS)
		r = d->CreateFence(d->dev, &fi, NULL, &s->fence);
	return r;
}

void stage_free(struct vdev *d)
{
	struct stage *s = d->stage;
	if (!s)
		return;
	if (s->fence)
		d->DestroyFence(d->dev, s->fence, NULL);
	if (s->pool)
		d->DestroyCommandPool(d->dev, s->pool, NULL);
	if (s->buf)
		d->DestroyBuffer(d->dev, s->buf, NULL);
	if (s->mem)
		d->FreeMemory(d->dev, s->mem, NULL);
	free(s);
	d->stage = NULL;
}

static struct stage *stage_of(struct vdev *d, VkResult *r)
{
	if (d->stage)
		return d->stage;
	d->stage = calloc(1, sizeof *d->stage);
	*r = d->stage ? make_staging(d, d->stage) : VK_ERROR_OUT_OF_HOST_MEMORY;
	if (*r == VK_SUCCESS)
		*r = make_queue(d, d->stage);
	if (*r != VK_SUCCESS)
		stage_free(d);
	return d->stage;
}

/* One copy of `n` bytes between `b` at `at` and the staging buffer, waited for. */
static VkResult one_copy(struct vdev *d, struct stage *s, VkBuffer b, VkDeviceSize at,
			 VkDeviceSize n, int out)
{
	VkCommandBufferBeginInfo bi = {.sType = VK_STRUCTURE_TYPE_COMMAND_BUFFER_BEGIN_INFO,
				       .flags = VK_COMMAND_BUFFER_USAGE_ONE_TIME_SUBMIT_BIT};
	VkBufferCopy region = {out ? at : 0, out ? 0 : at, n};
	VkSubmitInfo si = {.sType = VK_STRUCTURE_TYPE_SUBMIT_INFO, .commandBufferCount = 1,
			   .pCommandBuffers = &s->cb};
	VkResult r = d->BeginCommandBuffer(s->cb, &bi);
	if (r != VK_SUCCESS)
		return r;
	d->CmdCopyBuffer(s->cb, out ? b : s->buf, out ? s->buf : b, 1, &region);
	r = d->EndCommandBuffer(s->cb);
	if (r == VK_SUCCESS)
		r = d->QueueSubmit(s->queue, 1, &si, s->fence);
	if (r == VK_SUCCESS)
		r = d->WaitForFences(d->dev, 1, &s->fence, VK_TRUE, UINT64_MAX);
	if (r == VK_SUCCESS)
		r = d->ResetFences(d->dev, 1, &s->fence);
	if (r == VK_SUCCESS)
		r = d->ResetCommandBuffer(s->cb, 0);
	return r;
}

VkResult stage_copy(struct vmem *m, int out)
{
	struct vdev *d = m->d;
	VkResult r = VK_SUCCESS;
	struct stage *s = stage_of(d, &r);
	VkBuffer b = VK_NULL_HANDLE;
	VkMemoryRequirements req;
	if (r == VK_SUCCESS)
		r = copy_buffer(d, m->size, &b, &req);
	if (r == VK_SUCCESS && !(req.memoryTypeBits & (1u << m->type)))
		r = VK_ERROR_FEATURE_NOT_PRESENT; /* no buffer can cover it */
	if (r == VK_SUCCESS)
		r = d->BindBufferMemory(d->dev, b, m->real, 0);
	for (VkDeviceSize at = 0; r == VK_SUCCESS && at < m->size; at += STAGE) {
		VkDeviceSize n = m->size - at < STAGE ? m->size - at : STAGE;
		if (!out)
			memcpy(s->host, (char *)m->host + at, n);
		r = one_copy(d, s, b, at, n, out);
		if (r == VK_SUCCESS && out)
			memcpy((char *)m->host + at, s->host, n);
	}
	if (b)
		d->DestroyBuffer(d->dev, b, NULL);
	return r;
}
