/*
 * stage.c: each swapped allocation's host copy, and the copies between it and the
 * device. Two ways:
 *
 *  - the device's (a GPU): where the device has host memory it can copy to
 *    (HOST_VISIBLE and not DEVICE_LOCAL, HOST_CACHED preferred), the host copy is an
 *    allocation of the layer's own in it, as large, mapped; the copies are the
 *    device's (vkCmdCopyBuffer), no CPU on the way: buffers of the layer's cover both
 *    sides in pieces of PIECE bytes (under any device's largest buffer), every piece
 *    of every allocation of a batch goes into one command buffer, submitted once per
 *    device and waited for once (stage_flush);
 *  - the CPU's: elsewhere (lavapipe: one memory type with every flag) the host copy
 *    is malloc'd and the program's memory, host-visible, mapped and copied at once.
 *
 * The host copy stays after a restore (it is what lets a release copy only what was
 * written since, writes.c) and goes when the program frees its memory. Per device,
 * made at its first copy the device's way and kept: a command pool, its command buffers
 * and a fence on the first queue family the program asked for. Called with `mu`, the
 * gate closed: no submit of the program's is in flight. Except stage_host_memory: the
 * device's kind of host copy made before the first release, while the program runs
 * (ahead.c), the memory only, never its contents (nothing is submitted).
 *
 * VRAMLOCK_VULKAN_STAGING=1 (a test's hook) takes the device's way with any
 * host-visible memory type, so that it runs on lavapipe.
 */
#include "vklayer.h"

#define PIECE (256ull << 20)

struct stage {
	VkQueue queue;
	VkCommandPool pool;
	VkCommandBuffer *cbs; /* the batch's, one for each part sent (stage_send) */
	size_t ncb, capcb, used;
	VkFence fence;
	int type;	     /* host copies' memory type; -1: none, the CPU's way */
	uint32_t cover;	     /* the memory types a buffer of the layer's can take */
	VkDeviceSize align;  /* and the offsets it needs */
	int recording, sent; /* cbs[used - 1] is being recorded; a part was submitted */
	VkBuffer *made;	     /* the batch's buffers, destroyed after it */
	size_t nmade, capmade;
};

int staging_forced;

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

/* The memory type for host copies among `bits`, or -1. */
static int host_type(struct vdev *d, uint32_t bits)
{
	int best = -1;
	for (uint32_t t = 0; t < d->props.memoryTypeCount; t++) {
		VkMemoryPropertyFlags f = d->props.memoryTypes[t].propertyFlags;
		if (!(bits & (1u << t)) || !(f & VK_MEMORY_PROPERTY_HOST_VISIBLE_BIT) ||
		    (!staging_forced && (f & VK_MEMORY_PROPERTY_DEVICE_LOCAL_BIT)))
			continue;
		if (best < 0 || (f & VK_MEMORY_PROPERTY_HOST_CACHED_BIT))
			best = (int)t;
		if (f & VK_MEMORY_PROPERTY_HOST_CACHED_BIT)
			break;
	}
	return best;
}

static VkResult make_queue(struct vdev *d, struct stage *s)
{
	VkCommandPoolCreateInfo pci = {.sType = VK_STRUCTURE_TYPE_COMMAND_POOL_CREATE_INFO,
				       .flags = VK_COMMAND_POOL_CREATE_RESET_COMMAND_BUFFER_BIT,
				       .queueFamilyIndex = d->family};
	VkFenceCreateInfo fi = {.sType = VK_STRUCTURE_TYPE_FENCE_CREATE_INFO};
	d->GetDeviceQueue(d->dev, d->family, 0, &s->queue);
	VkResult r = d->set_loader_data ? d->set_loader_data(d->dev, s->queue)
					: VK_ERROR_INITIALIZATION_FAILED;
	if (r == VK_SUCCESS)
		r = d->CreateCommandPool(d->dev, &pci, NULL, &s->pool);
	if (r == VK_SUCCESS)
		r = d->CreateFence(d->dev, &fi, NULL, &s->fence);
	return r;
}

/* The array `a` (`*cap` elements of `size` bytes) with room for its element `n`: `a`,
 * or it grown (`*cap` with it), or NULL (no host memory; `a` as it was). */
static void *room(void *a, size_t *cap, size_t n, size_t size)
{
	if (n < *cap)
		return a;
	size_t more = *cap ? 2 * *cap : 16;
	void *grown = realloc(a, size * more);
	if (grown)
		*cap = more;
	return grown;
}

/* The batch's next command buffer, begun (made the first time it is needed). */
static VkResult next_cb(struct vdev *d, struct stage *s)
{
	VkCommandBufferAllocateInfo cai = {.sType = VK_STRUCTURE_TYPE_COMMAND_BUFFER_ALLOCATE_INFO,
					   .commandPool = s->pool,
					   .level = VK_COMMAND_BUFFER_LEVEL_PRIMARY,
					   .commandBufferCount = 1};
	VkCommandBufferBeginInfo bi = {.sType = VK_STRUCTURE_TYPE_COMMAND_BUFFER_BEGIN_INFO,
				       .flags = VK_COMMAND_BUFFER_USAGE_ONE_TIME_SUBMIT_BIT};
	VkResult r = VK_SUCCESS;
	if (s->used == s->ncb) {
		VkCommandBuffer *cbs = room(s->cbs, &s->capcb, s->ncb, sizeof *cbs);
		if (!cbs)
			return VK_ERROR_OUT_OF_HOST_MEMORY;
		s->cbs = cbs;
		r = d->AllocateCommandBuffers(d->dev, &cai, &s->cbs[s->ncb]);
		if (r == VK_SUCCESS)
			r = d->set_loader_data(d->dev, s->cbs[s->ncb]);
		if (r != VK_SUCCESS)
			return r;
		s->ncb++;
	}
	r = d->BeginCommandBuffer(s->cbs[s->used++], &bi);
	s->recording = r == VK_SUCCESS;
	return r;
}

/* The device's copying state freed (the device goes; table_device_gone has freed its
 * memory's host copies). */
void stage_free(struct vdev *d)
{
	struct stage *s = d->stage;
	if (!s)
		return;
	if (s->fence)
		d->DestroyFence(d->dev, s->fence, NULL);
	if (s->pool)
		d->DestroyCommandPool(d->dev, s->pool, NULL);
	free(s->cbs);
	free(s->made);
	free(s);
	d->stage = NULL;
}

/* The device's copying state, made at first (its host type probed). */
static struct stage *stage_of(struct vdev *d)
{
	if (d->stage)
		return d->stage;
	struct stage *s = calloc(1, sizeof *s);
	VkBuffer probe;
	VkMemoryRequirements req;
	if (!s || copy_buffer(d, 1, &probe, &req) != VK_SUCCESS) {
		free(s);
		return NULL;
	}
	d->DestroyBuffer(d->dev, probe, NULL);
	s->cover = req.memoryTypeBits;
	s->align = req.alignment ? req.alignment : 1;
	s->type = host_type(d, s->cover);
	if (s->type >= 0 && make_queue(d, s) != VK_SUCCESS)
		s->type = -1; /* nothing to copy with: the CPU's way where it can */
	return d->stage = s;
}

/* Does `m` go the device's way? Its host copy, once made, decides. */
static int by_device(struct vmem *m)
{
	if (m->host)
		return m->host_mem != VK_NULL_HANDLE;
	struct stage *s = stage_of(m->d);
	return s && s->type >= 0 && (s->cover & (1u << m->type)) && !m->dedicated;
}

static int host_visible(struct vmem *m)
{
	return !!(m->d->props.memoryTypes[m->type].propertyFlags &
		  VK_MEMORY_PROPERTY_HOST_VISIBLE_BIT);
}

/* The host copy's size: whole pieces' buffers fit in it. */
static VkDeviceSize host_size(struct vmem *m)
{
	VkDeviceSize a = m->d->stage->align > 65536 ? m->d->stage->align : 65536;
	return (m->size + a - 1) / a * a;
}

VkResult stage_host_memory(struct vdev *d, uint32_t type, VkDeviceSize size,
			   VkDeviceMemory *mem, void **at)
{
	VkMemoryAllocateInfo ai = {.sType = VK_STRUCTURE_TYPE_MEMORY_ALLOCATE_INFO,
				   .allocationSize = size, .memoryTypeIndex = type};
	*mem = VK_NULL_HANDLE, *at = NULL;
	VkResult r = d->AllocateMemory(d->dev, &ai, NULL, mem);
	if (r == VK_SUCCESS)
		r = d->MapMemory(d->dev, *mem, 0, VK_WHOLE_SIZE, 0, at);
	if (r != VK_SUCCESS) {
		if (*mem)
			d->FreeMemory(d->dev, *mem, NULL);
		*mem = VK_NULL_HANDLE, *at = NULL;
	}
	return r;
}

VkResult stage_host(struct vmem *m)
{
	struct vdev *d = m->d;
	if (m->host)
		return VK_SUCCESS;
	if (!by_device(m)) {
		if (!host_visible(m))
			return VK_ERROR_FEATURE_NOT_PRESENT; /* no way to copy it */
		m->host = malloc(m->size ? m->size : 1);
		return m->host ? VK_SUCCESS : VK_ERROR_OUT_OF_HOST_MEMORY;
	}
	return stage_host_memory(d, (uint32_t)d->stage->type, host_size(m), &m->host_mem,
				 &m->host);
}

int stage_host_kind(struct vmem *m, VkDeviceSize *size, uint32_t *type)
{
	if (m->host || !by_device(m))
		return 0;
	*size = host_size(m);
	*type = (uint32_t)m->d->stage->type;
	return 1;
}

void stage_host_free(struct vmem *m)
{
	if (m->host_mem)
		m->d->FreeMemory(m->d->dev, m->host_mem, NULL); /* unmapped with it */
	else
		free(m->host);
	m->host_mem = VK_NULL_HANDLE, m->host = NULL;
}

/* A buffer of the layer's over `n` bytes of `mem` at `at`, kept for the batch. */
static VkResult cover(struct vdev *d, struct stage *s, VkDeviceMemory mem, VkDeviceSize at,
		      VkDeviceSize n, VkBuffer *b)
{
	VkMemoryRequirements req;
	VkBuffer *made = room(s->made, &s->capmade, s->nmade, sizeof *made);
	if (!made)
		return VK_ERROR_OUT_OF_HOST_MEMORY;
	s->made = made;
	VkResult r = copy_buffer(d, n, b, &req);
	if (r != VK_SUCCESS)
		return r;
	s->made[s->nmade++] = *b;
	if (at % (req.alignment ? req.alignment : 1))
		return VK_ERROR_FEATURE_NOT_PRESENT;
	return d->BindBufferMemory(d->dev, *b, mem, at);
}

/* `m`'s pieces recorded into the device's batch. */
static VkResult record_pieces(struct vmem *m, int out)
{
	struct vdev *d = m->d;
	struct stage *s = d->stage;
	VkResult r = s->recording ? VK_SUCCESS : next_cb(d, s);
	VkCommandBuffer cb = s->recording ? s->cbs[s->used - 1] : VK_NULL_HANDLE;
	for (VkDeviceSize at = 0; r == VK_SUCCESS && at < m->size; at += PIECE) {
		VkDeviceSize n = m->size - at < PIECE ? m->size - at : PIECE;
		VkBuffer dev_side, host_side;
		VkBufferCopy region = {0, 0, n};
		r = cover(d, s, m->real, at, n, &dev_side);
		if (r == VK_SUCCESS)
			r = cover(d, s, m->host_mem, at, n, &host_side);
		if (r == VK_SUCCESS)
			d->CmdCopyBuffer(cb, out ? dev_side : host_side, out ? host_side : dev_side, 1,
					 &region);
	}
	return r;
}

/* The part of `d`'s batch recorded so far submitted, without waiting (the copies
 * start while more are recorded); the batch goes on in another command buffer. */
static VkResult send(struct vdev *d, VkFence fence)
{
	struct stage *s = d->stage;
	VkSubmitInfo si = {.sType = VK_STRUCTURE_TYPE_SUBMIT_INFO};
	VkResult r = VK_SUCCESS;
	if (s->recording) {
		s->recording = 0;
		r = d->EndCommandBuffer(s->cbs[s->used - 1]);
		si.commandBufferCount = 1, si.pCommandBuffers = &s->cbs[s->used - 1];
	}
	if (r == VK_SUCCESS && (si.commandBufferCount || fence))
		r = d->QueueSubmit(s->queue, si.commandBufferCount ? 1 : 0, &si, fence);
	s->sent |= r == VK_SUCCESS;
	return r;
}

VkResult stage_send(struct vdev *d)
{
	return d->stage && d->stage->recording ? send(d, VK_NULL_HANDLE) : VK_SUCCESS;
}

/* `m`'s contents to its host copy (out) or back (!out): at once the CPU's way, into
 * the device's batch the device's (done by stage_flush). */
VkResult stage_copy(struct vmem *m, int out)
{
	void *p;
	if (m->host_mem)
		return record_pieces(m, out);
	VkResult r = m->d->MapMemory(m->d->dev, m->real, 0, VK_WHOLE_SIZE, 0, &p);
	if (r == VK_SUCCESS) {
		memcpy(out ? m->host : p, out ? p : m->host, m->size);
		m->d->UnmapMemory(m->d->dev, m->real);
	}
	return r;
}

/* The batch recorded: waited for where it was submitted, then dropped. */
static VkResult finish(struct vdev *d, struct stage *s)
{
	VkResult r = VK_SUCCESS;
	if (s->sent) {
		r = d->WaitForFences(d->dev, 1, &s->fence, VK_TRUE, UINT64_MAX);
		d->ResetFences(d->dev, 1, &s->fence);
	}
	for (size_t k = 0; k < s->used; k++)
		d->ResetCommandBuffer(s->cbs[k], 0);
	for (size_t k = 0; k < s->nmade; k++)
		d->DestroyBuffer(d->dev, s->made[k], NULL);
	s->nmade = s->used = 0;
	s->recording = s->sent = 0;
	return r;
}

/* Every device's batch submitted (what is left of it, and a fence, which signals once
 * every part sent before it is done: they went to the same queue), then each waited
 * for: VK_SUCCESS or the first error (`r`: an error met while recording; what is left
 * is then not sent, but what was sent is waited for). */
VkResult stage_flush(VkResult r)
{
	for (struct vdev *d = dev_list(); d; d = d->next) {
		struct stage *s = d->stage;
		if (!s || !(s->recording || s->sent))
			continue;
		if (r != VK_SUCCESS && s->recording) {
			s->recording = 0;
			d->EndCommandBuffer(s->cbs[s->used - 1]);
		}
		VkResult e = send(d, s->fence);
		if (e != VK_SUCCESS) /* no fence to wait for: the queue's work, then */
			d->QueueWaitIdle(s->queue), s->sent = 0;
		r = r == VK_SUCCESS ? e : r;
	}
	for (struct vdev *d = dev_list(); d; d = d->next)
		if (d->stage && (d->stage->used || d->stage->nmade)) {
			VkResult e = finish(d, d->stage);
			r = r == VK_SUCCESS ? e : r;
		}
	return r;
}
