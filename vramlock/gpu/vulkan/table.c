/*
 * table.c: the program's device memory and buffers. The handles it holds are ours
 * (struct vmem, struct vbuf), each naming the driver's object of the moment; a
 * release destroys those, a restore makes them again (engine.c). Also what makes a
 * process impossible to swap: refused (core/state.h).
 */
#include "vklayer.h"

static struct vmem *mems;
static struct vbuf *bufs;
double table_changed_ms; /* when memory was last made or freed (ahead.c), with `mu` */

struct vmem *mem_list(void)
{
	return mems;
}

struct vbuf *buf_list(void)
{
	return bufs;
}

int table_has(struct vmem *m)
{
	for (struct vmem *k = mems; k; k = k->next)
		if (k == m)
			return 1;
	return 0;
}

void table_device_gone(struct vdev *d)
{
	for (struct vmem *m = mems; m; m = m->next)
		if (m->d == d)
			stage_host_free(m);
}

/* In a forked child: its parent's memory and buffers are not its own (forgotten, not
 * freed: the copies of their records stay where they are, unreachable). */
void table_forget(void)
{
	mems = NULL;
	bufs = NULL;
}

/* Does a release move this memory to the host? */
int table_swappable(struct vmem *m)
{
	return !m->kept && !m->mapped && !m->d->passive && !m->d->inherited;
}

/* ---- memory ------------------------------------------------------------------ */

/* What of `info`'s chain the layer can make again: the flags, the dedicated buffer
 * and the priority; anything else keeps the memory on the device. */
static void read_chain(struct vmem *m, const VkMemoryAllocateInfo *info,
		       VkMemoryDedicatedAllocateInfo **dedicated)
{
	for (const VkBaseInStructure *s = info->pNext; s; s = s->pNext) {
		if (s->sType == VK_STRUCTURE_TYPE_MEMORY_ALLOCATE_FLAGS_INFO) {
			m->flags = ((const VkMemoryAllocateFlagsInfo *)s)->flags;
			if (((const VkMemoryAllocateFlagsInfo *)s)->deviceMask > 1)
				m->kept = 1;
		} else if (s->sType == VK_STRUCTURE_TYPE_MEMORY_DEDICATED_ALLOCATE_INFO) {
			*dedicated = (VkMemoryDedicatedAllocateInfo *)s;
			if ((*dedicated)->image)
				m->kept = 1;
			m->dedicated = (struct vbuf *)(*dedicated)->buffer;
		} else if (s->sType != VK_STRUCTURE_TYPE_MEMORY_PRIORITY_ALLOCATE_INFO_EXT) {
			m->kept = 1; /* imported, exported, ...: not ours to make again */
		}
	}
}

static VKAPI_ATTR VkResult VKAPI_CALL allocate_memory(VkDevice dev, const VkMemoryAllocateInfo *info,
						      const VkAllocationCallbacks *alloc,
						      VkDeviceMemory *out)
{
	struct vdev *d = dev_of(dev);
	VkMemoryAllocateInfo driver = *info; /* the type the program saw, the driver's */
	driver.memoryTypeIndex = memtypes_driver(d, info->memoryTypeIndex);
	if (!is_ours(d))
		return d->AllocateMemory(dev, &driver, alloc, out);
	struct vmem *m = calloc(1, sizeof *m);
	if (!m)
		return VK_ERROR_OUT_OF_HOST_MEMORY;
	m->d = d;
	m->size = info->allocationSize;
	m->type = driver.memoryTypeIndex;
	m->shown = info->memoryTypeIndex;
	VkMemoryDedicatedAllocateInfo *dedicated = NULL;
	read_chain(m, info, &dedicated);
	/* Memory the host cannot map is copied through a buffer of the layer's own
	 * (stage.c), which memory dedicated to another cannot take. */
	if (dedicated && !(d->props.memoryTypes[m->type].propertyFlags &
			   VK_MEMORY_PROPERTY_HOST_VISIBLE_BIT))
		m->kept = 1;
	gate_enter();
	VkBuffer theirs = dedicated ? dedicated->buffer : VK_NULL_HANDLE;
	if (dedicated) /* the driver's buffer, for the call only */
		dedicated->buffer = real_buf(theirs);
	VkResult r = d->AllocateMemory(dev, &driver, alloc, &m->real);
	if (dedicated)
		dedicated->buffer = theirs;
	if (r == VK_SUCCESS) {
		pthread_mutex_lock(&mu);
		m->next = mems;
		mems = m;
		table_changed_ms = now_ms();
		if (memtypes_allowance(d, m->shown))
			d->allowance_used += m->size;
		pthread_mutex_unlock(&mu);
		*out = (VkDeviceMemory)m;
	} else {
		free(m);
	}
	gate_leave();
	return r;
}

static VKAPI_ATTR void VKAPI_CALL free_memory(VkDevice dev, VkDeviceMemory mem,
					      const VkAllocationCallbacks *alloc)
{
	struct vdev *d = dev_of(dev);
	if (!is_ours(d) || !mem) {
		d->FreeMemory(dev, mem, alloc);
		return;
	}
	struct vmem *m = (struct vmem *)mem;
	pthread_mutex_lock(&mu);
	for (struct vmem **p = &mems; *p; p = &(*p)->next)
		if (*p == m) {
			*p = m->next;
			break;
		}
	table_changed_ms = now_ms();
	if (m->real)
		d->FreeMemory(dev, m->real, alloc);
	if (memtypes_allowance(d, m->shown))
		d->allowance_used -= m->size;
	pthread_mutex_unlock(&mu);
	stage_host_free(m);
	free(m);
}

/* While mapped, the memory stays on the device: the program's pointer stays valid. */
static VKAPI_ATTR VkResult VKAPI_CALL map_memory(VkDevice dev, VkDeviceMemory mem,
						 VkDeviceSize offset, VkDeviceSize size,
						 VkMemoryMapFlags flags, void **data)
{
	struct vdev *d = dev_of(dev);
	if (!is_ours(d))
		return d->MapMemory(dev, mem, offset, size, flags, data);
	struct vmem *m = (struct vmem *)mem;
	if (!memtypes_mappable(d, m->shown))
		return VK_ERROR_MEMORY_MAP_FAILED; /* shown device-local only (memtypes.c) */
	gate_enter(); /* its contents are on the device only while the gate is open */
	VkResult r = d->MapMemory(dev, m->real, offset, size, flags, data);
	if (r == VK_SUCCESS)
		m->mapped = m->written = 1; /* the host may write it: its host copy is old */
	gate_leave();
	return r;
}

static VKAPI_ATTR void VKAPI_CALL unmap_memory(VkDevice dev, VkDeviceMemory mem)
{
	struct vdev *d = dev_of(dev);
	if (!is_ours(d)) {
		d->UnmapMemory(dev, mem);
		return;
	}
	struct vmem *m = (struct vmem *)mem;
	pthread_mutex_lock(&mu);
	d->UnmapMemory(dev, m->real);
	m->mapped = 0;
	pthread_mutex_unlock(&mu);
}

typedef VkResult (*ranges_fn)(VkDevice, uint32_t, const VkMappedMemoryRange *);

static VkResult ranges(ranges_fn fn, VkDevice dev, uint32_t n, const VkMappedMemoryRange *r)
{
	VkMappedMemoryRange *copy = malloc(sizeof *copy * (n ? n : 1));
	if (!copy)
		return VK_ERROR_OUT_OF_HOST_MEMORY;
	for (uint32_t k = 0; k < n; k++) {
		copy[k] = r[k];
		copy[k].memory = real_mem(r[k].memory);
	}
	VkResult res = fn(dev, n, copy);
	free(copy);
	return res;
}

static VKAPI_ATTR VkResult VKAPI_CALL flush_ranges(VkDevice dev, uint32_t n,
						   const VkMappedMemoryRange *r)
{
	struct vdev *d = dev_of(dev);
	if (!is_ours(d))
		return d->FlushMappedMemoryRanges(dev, n, r);
	return ranges(d->FlushMappedMemoryRanges, dev, n, r);
}

static VKAPI_ATTR VkResult VKAPI_CALL invalidate_ranges(VkDevice dev, uint32_t n,
							const VkMappedMemoryRange *r)
{
	struct vdev *d = dev_of(dev);
	if (!is_ours(d))
		return d->InvalidateMappedMemoryRanges(dev, n, r);
	return ranges(d->InvalidateMappedMemoryRanges, dev, n, r);
}

static VKAPI_ATTR void VKAPI_CALL memory_commitment(VkDevice dev, VkDeviceMemory mem,
						    VkDeviceSize *bytes)
{
	struct vdev *d = dev_of(dev);
	gate_enter();
	d->GetDeviceMemoryCommitment(dev, is_ours(d) ? real_mem(mem) : mem, bytes);
	gate_leave();
}

/* ---- buffers ----------------------------------------------------------------- */

static VKAPI_ATTR VkResult VKAPI_CALL create_buffer(VkDevice dev, const VkBufferCreateInfo *ci,
						    const VkAllocationCallbacks *alloc,
						    VkBuffer *out)
{
	struct vdev *d = dev_of(dev);
	if (!is_ours(d))
		return d->CreateBuffer(dev, ci, alloc, out);
	struct vbuf *b = calloc(1, sizeof *b);
	uint32_t nf = ci->sharingMode == VK_SHARING_MODE_CONCURRENT ? ci->queueFamilyIndexCount : 0;
	if (b && nf)
		b->families = malloc(sizeof *b->families * nf);
	if (!b || (nf && !b->families)) {
		free(b);
		return VK_ERROR_OUT_OF_HOST_MEMORY;
	}
	b->d = d;
	b->ci = *ci;
	b->ci.pNext = NULL;
	if (nf)
		memcpy(b->families, ci->pQueueFamilyIndices, sizeof *b->families * nf);
	b->ci.queueFamilyIndexCount = nf;
	b->ci.pQueueFamilyIndices = b->families;
	if (ci->pNext)
		b->kept = 1; /* made with what the layer may not make again */
	gate_enter();
	VkResult r = d->CreateBuffer(dev, ci, alloc, &b->real);
	if (r == VK_SUCCESS) {
		pthread_mutex_lock(&mu);
		b->next = bufs;
		bufs = b;
		pthread_mutex_unlock(&mu);
		*out = (VkBuffer)b;
	} else {
		free(b->families);
		free(b);
	}
	gate_leave();
	return r;
}

static VKAPI_ATTR void VKAPI_CALL destroy_buffer(VkDevice dev, VkBuffer buf,
						 const VkAllocationCallbacks *alloc)
{
	struct vdev *d = dev_of(dev);
	if (!is_ours(d) || !buf) {
		d->DestroyBuffer(dev, buf, alloc);
		return;
	}
	struct vbuf *b = (struct vbuf *)buf;
	record_forget_buffer(b);
	pthread_mutex_lock(&mu);
	for (struct vbuf **p = &bufs; *p; p = &(*p)->next)
		if (*p == b) {
			*p = b->next;
			break;
		}
	for (struct vmem *m = mems; m; m = m->next)
		if (m->dedicated == b)
			m->dedicated = NULL;
	if (b->real)
		d->DestroyBuffer(dev, b->real, alloc);
	pthread_mutex_unlock(&mu);
	free(b->families);
	free(b);
}

static VKAPI_ATTR void VKAPI_CALL buffer_requirements(VkDevice dev, VkBuffer buf,
						      VkMemoryRequirements *req)
{
	struct vdev *d = dev_of(dev);
	gate_enter();
	d->GetBufferMemoryRequirements(dev, is_ours(d) ? real_buf(buf) : buf, req);
	gate_leave();
	req->memoryTypeBits = memtypes_buffer_bits(d, req->memoryTypeBits, req->size);
}

static void requirements2(PFN_vkGetBufferMemoryRequirements2 fn, VkDevice dev,
			  const VkBufferMemoryRequirementsInfo2 *info, VkMemoryRequirements2 *req)
{
	VkBufferMemoryRequirementsInfo2 copy = *info;
	struct vdev *d = dev_of(dev);
	if (is_ours(d))
		copy.buffer = real_buf(info->buffer);
	gate_enter();
	fn(dev, &copy, req);
	gate_leave();
	req->memoryRequirements.memoryTypeBits = memtypes_buffer_bits(
		d, req->memoryRequirements.memoryTypeBits, req->memoryRequirements.size);
}

static VKAPI_ATTR void VKAPI_CALL buffer_requirements2(VkDevice dev,
						       const VkBufferMemoryRequirementsInfo2 *info,
						       VkMemoryRequirements2 *req)
{
	requirements2(dev_of(dev)->GetBufferMemoryRequirements2, dev, info, req);
}

static VKAPI_ATTR void VKAPI_CALL buffer_requirements2_khr(
	VkDevice dev, const VkBufferMemoryRequirementsInfo2 *info, VkMemoryRequirements2 *req)
{
	requirements2(dev_of(dev)->GetBufferMemoryRequirements2KHR, dev, info, req);
}

static void bound(struct vbuf *b, struct vmem *m, VkDeviceSize offset)
{
	b->mem = m;
	b->offset = offset;
	if (b->kept)
		m->kept = 1;
}

static VKAPI_ATTR VkResult VKAPI_CALL bind_buffer(VkDevice dev, VkBuffer buf, VkDeviceMemory mem,
						  VkDeviceSize offset)
{
	struct vdev *d = dev_of(dev);
	if (!is_ours(d))
		return d->BindBufferMemory(dev, buf, mem, offset);
	gate_enter();
	VkResult r = d->BindBufferMemory(dev, real_buf(buf), real_mem(mem), offset);
	if (r == VK_SUCCESS)
		bound((struct vbuf *)buf, (struct vmem *)mem, offset);
	gate_leave();
	return r;
}

static VkResult bind2(PFN_vkBindBufferMemory2 fn, VkDevice dev, uint32_t n,
		      const VkBindBufferMemoryInfo *infos)
{
	if (!is_ours(dev_of(dev)))
		return fn(dev, n, infos);
	VkBindBufferMemoryInfo *copy = malloc(sizeof *copy * (n ? n : 1));
	if (!copy)
		return VK_ERROR_OUT_OF_HOST_MEMORY;
	for (uint32_t k = 0; k < n; k++) {
		copy[k] = infos[k];
		copy[k].buffer = real_buf(infos[k].buffer);
		copy[k].memory = real_mem(infos[k].memory);
	}
	gate_enter();
	VkResult r = fn(dev, n, copy);
	for (uint32_t k = 0; r == VK_SUCCESS && k < n; k++)
		bound((struct vbuf *)infos[k].buffer, (struct vmem *)infos[k].memory,
		      infos[k].memoryOffset);
	gate_leave();
	free(copy);
	return r;
}

static VKAPI_ATTR VkResult VKAPI_CALL bind_buffer2(VkDevice dev, uint32_t n,
						   const VkBindBufferMemoryInfo *infos)
{
	return bind2(dev_of(dev)->BindBufferMemory2, dev, n, infos);
}

static VKAPI_ATTR VkResult VKAPI_CALL bind_buffer2_khr(VkDevice dev, uint32_t n,
						       const VkBindBufferMemoryInfo *infos)
{
	return bind2(dev_of(dev)->BindBufferMemory2KHR, dev, n, infos);
}

/* Images are not made again: their memory stays on the device. */
static VKAPI_ATTR VkResult VKAPI_CALL bind_image(VkDevice dev, VkImage image, VkDeviceMemory mem,
						 VkDeviceSize offset)
{
	struct vdev *d = dev_of(dev);
	if (!is_ours(d))
		return d->BindImageMemory(dev, image, mem, offset);
	gate_enter();
	((struct vmem *)mem)->kept = 1;
	VkResult r = d->BindImageMemory(dev, image, real_mem(mem), offset);
	gate_leave();
	return r;
}

static VkResult bind_image2(PFN_vkBindImageMemory2 fn, VkDevice dev, uint32_t n,
			    const VkBindImageMemoryInfo *infos)
{
	if (!is_ours(dev_of(dev)))
		return fn(dev, n, infos);
	VkBindImageMemoryInfo *copy = malloc(sizeof *copy * (n ? n : 1));
	if (!copy)
		return VK_ERROR_OUT_OF_HOST_MEMORY;
	gate_enter();
	for (uint32_t k = 0; k < n; k++) {
		copy[k] = infos[k];
		copy[k].memory = real_mem(infos[k].memory);
		if (infos[k].memory)
			((struct vmem *)infos[k].memory)->kept = 1;
	}
	VkResult r = fn(dev, n, copy);
	gate_leave();
	free(copy);
	return r;
}

static VKAPI_ATTR VkResult VKAPI_CALL bind_image2_core(VkDevice dev, uint32_t n,
						       const VkBindImageMemoryInfo *infos)
{
	return bind_image2(dev_of(dev)->BindImageMemory2, dev, n, infos);
}

static VKAPI_ATTR VkResult VKAPI_CALL bind_image2_khr(VkDevice dev, uint32_t n,
						      const VkBindImageMemoryInfo *infos)
{
	return bind_image2(dev_of(dev)->BindImageMemory2KHR, dev, n, infos);
}

/* A device address would change when the buffer is made again. */
static VkDeviceAddress address(PFN_vkGetBufferDeviceAddress fn, VkDevice dev,
			       const VkBufferDeviceAddressInfo *info)
{
	if (!is_ours(dev_of(dev)))
		return fn(dev, info);
	refuse("the program uses buffer device addresses, which the layer cannot keep yet");
	VkBufferDeviceAddressInfo copy = *info;
	copy.buffer = real_buf(info->buffer);
	gate_enter();
	VkDeviceAddress a = fn(dev, &copy);
	gate_leave();
	return a;
}

static VKAPI_ATTR VkDeviceAddress VKAPI_CALL address_core(VkDevice dev,
							 const VkBufferDeviceAddressInfo *info)
{
	return address(dev_of(dev)->GetBufferDeviceAddress, dev, info);
}

static VKAPI_ATTR VkDeviceAddress VKAPI_CALL address_khr(VkDevice dev,
							const VkBufferDeviceAddressInfo *info)
{
	return address(dev_of(dev)->GetBufferDeviceAddressKHR, dev, info);
}

static VKAPI_ATTR VkDeviceAddress VKAPI_CALL address_ext(VkDevice dev,
							const VkBufferDeviceAddressInfo *info)
{
	return address(dev_of(dev)->GetBufferDeviceAddressEXT, dev, info);
}

/* A view names the driver's buffer: the memory under it stays on the device. */
static VKAPI_ATTR VkResult VKAPI_CALL create_view(VkDevice dev, const VkBufferViewCreateInfo *ci,
						  const VkAllocationCallbacks *alloc,
						  VkBufferView *out)
{
	struct vdev *d = dev_of(dev);
	if (!is_ours(d))
		return d->CreateBufferView(dev, ci, alloc, out);
	VkBufferViewCreateInfo copy = *ci;
	struct vbuf *b = (struct vbuf *)ci->buffer;
	gate_enter();
	b->kept = 1;
	if (b->mem)
		b->mem->kept = 1;
	copy.buffer = b->real;
	VkResult r = d->CreateBufferView(dev, &copy, alloc, out);
	gate_leave();
	return r;
}

void table_hook(const char *name, PFN_vkVoidFunction *fn)
{
	static const struct hook hooks[] = {
		HOOK(AllocateMemory, allocate_memory),
		HOOK(FreeMemory, free_memory),
		HOOK(MapMemory, map_memory),
		HOOK(UnmapMemory, unmap_memory),
		HOOK(FlushMappedMemoryRanges, flush_ranges),
		HOOK(InvalidateMappedMemoryRanges, invalidate_ranges),
		HOOK(GetDeviceMemoryCommitment, memory_commitment),
		HOOK(CreateBuffer, create_buffer),
		HOOK(DestroyBuffer, destroy_buffer),
		HOOK(GetBufferMemoryRequirements, buffer_requirements),
		HOOK(GetBufferMemoryRequirements2, buffer_requirements2),
		HOOK(GetBufferMemoryRequirements2KHR, buffer_requirements2_khr),
		HOOK(BindBufferMemory, bind_buffer),
		HOOK(BindBufferMemory2, bind_buffer2),
		HOOK(BindBufferMemory2KHR, bind_buffer2_khr),
		HOOK(BindImageMemory, bind_image),
		HOOK(BindImageMemory2, bind_image2_core),
		HOOK(BindImageMemory2KHR, bind_image2_khr),
		HOOK(GetBufferDeviceAddress, address_core),
		HOOK(GetBufferDeviceAddressKHR, address_khr),
		HOOK(GetBufferDeviceAddressEXT, address_ext),
		HOOK(CreateBufferView, create_view),
	};
	hook_lookup(hooks, sizeof hooks / sizeof *hooks, name, fn);
}
