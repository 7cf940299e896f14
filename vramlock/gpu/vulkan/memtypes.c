/*
 * memtypes.c: the memory types the program sees. Memory a program keeps mapped stays
 * on the device through a release (its pointer must stay valid), and a program that
 * finds device-local memory it may map (resizable BAR on a discrete GPU; every memory
 * of an integrated GPU or a CPU driver) keeps its data there: llama.cpp keeps its
 * weights, its KV cache and its compute buffers in such memory, mapped for good. So
 * while the layer acts:
 *
 *  - every driver type that is device-local is shown device-local only, without
 *    HOST_VISIBLE, HOST_COHERENT or HOST_CACHED, under its own index: the program
 *    cannot map memory of it (vkMapMemory is refused) and copies through its own
 *    staging memory, as without resizable BAR; the layer still maps it itself for its
 *    copies where the driver's type is host-visible;
 *  - where that leaves no host-visible type at all (one type with every flag:
 *    lavapipe, integrated GPUs), one type is added for each device-local,
 *    host-visible driver type: host-visible with the driver type's host flags, not
 *    device-local, backed by that driver type. What the program maps is there: it
 *    stays on the device through a release, but it is the host's memory on such a
 *    device;
 *  - last, each device-local, host-visible driver type is added again as it is, with
 *    every flag: the *mapped allowance*. Buffers are told they may take it only while
 *    they fit in what is left of VRAMLOCK_VULKAN_MAPPED (bytes, K, M or G; 256M by
 *    default, 0 for none) of such memory per device. A program that copies its small
 *    per-step inputs by hand where it can map device-local memory (llama.cpp's compute
 *    buffer: its tokens, positions and masks at every step) keeps doing so, rather than
 *    through a submit and a wait each; its large buffers (weights, KV cache) go
 *    unmappable and are swapped. What the program maps of the allowance stays on the
 *    device through a release.
 *
 * The order keeps each program's first choice: a type asked for by its flags is found
 * among the unmappable device-local ones, or the host ones, before the allowance.
 * Type indices and type bits are translated wherever they cross: the properties
 * (vkGetPhysicalDeviceMemoryProperties, 2, 2KHR), the requirements of buffers and
 * images (memoryTypeBits; images and host pointers never get the allowance), a host
 * pointer's properties, and vkAllocateMemory's index (table.c). Without
 * VRAMLOCK_SWAP_SOCKET (`engine.active` 0) the driver's types are shown as they are.
 */
#include "vklayer.h"

#define HOST_FLAGS                                                                  \
	(VK_MEMORY_PROPERTY_HOST_VISIBLE_BIT | VK_MEMORY_PROPERTY_HOST_COHERENT_BIT | \
	 VK_MEMORY_PROPERTY_HOST_CACHED_BIT)

VkDeviceSize mapped_allowance = 256ull << 20;

static void add(struct memmap *map, VkMemoryType type, uint32_t driver)
{
	if (map->count == VK_MAX_MEMORY_TYPES)
		return;
	map->types[map->count] = type;
	map->driver[map->count++] = driver;
}

static int device_mappable(VkMemoryPropertyFlags f)
{
	return (f & VK_MEMORY_PROPERTY_DEVICE_LOCAL_BIT) &&
	       (f & VK_MEMORY_PROPERTY_HOST_VISIBLE_BIT);
}

void memtypes_build(const VkPhysicalDeviceMemoryProperties *driver, struct memmap *map)
{
	VkMemoryPropertyFlags host = 0;
	map->count = 0;
	map->allowance = 0;
	for (uint32_t t = 0; t < driver->memoryTypeCount; t++) {
		VkMemoryType type = driver->memoryTypes[t];
		if (type.propertyFlags & VK_MEMORY_PROPERTY_DEVICE_LOCAL_BIT)
			type.propertyFlags &= ~(VkMemoryPropertyFlags)HOST_FLAGS;
		add(map, type, t);
		host |= type.propertyFlags & VK_MEMORY_PROPERTY_HOST_VISIBLE_BIT;
	}
	for (uint32_t t = 0; !host && t < driver->memoryTypeCount; t++) {
		VkMemoryType type = driver->memoryTypes[t];
		if (!(type.propertyFlags & VK_MEMORY_PROPERTY_HOST_VISIBLE_BIT))
			continue;
		type.propertyFlags &= HOST_FLAGS;
		add(map, type, t);
	}
	for (uint32_t t = 0; mapped_allowance && t < driver->memoryTypeCount; t++)
		if (device_mappable(driver->memoryTypes[t].propertyFlags) &&
		    map->count < VK_MAX_MEMORY_TYPES) {
			map->allowance |= 1u << map->count;
			add(map, driver->memoryTypes[t], t);
		}
}

/* `p` (the driver's) as the program sees it. */
static void present(VkPhysicalDeviceMemoryProperties *p)
{
	struct memmap map;
	if (!engine.active)
		return;
	memtypes_build(p, &map);
	p->memoryTypeCount = map.count;
	memcpy(p->memoryTypes, map.types, sizeof map.types[0] * map.count);
}

/* Every type shown backed by one of `driver_bits`, the mapped allowance's included. */
static uint32_t shown_bits(const struct vdev *d, uint32_t driver_bits)
{
	uint32_t shown = 0;
	for (uint32_t i = 0; i < d->shown.count; i++)
		if (driver_bits & (1u << d->shown.driver[i]))
			shown |= 1u << i;
	return shown;
}

uint32_t memtypes_bits(const struct vdev *d, uint32_t driver_bits)
{
	if (!engine.active)
		return driver_bits;
	return shown_bits(d, driver_bits) & ~d->shown.allowance;
}

uint32_t memtypes_buffer_bits(struct vdev *d, uint32_t driver_bits, VkDeviceSize size)
{
	if (!engine.active)
		return driver_bits;
	pthread_mutex_lock(&mu);
	int fits = d->allowance_used <= mapped_allowance &&
		   size <= mapped_allowance - d->allowance_used;
	pthread_mutex_unlock(&mu);
	return shown_bits(d, driver_bits) & (fits ? ~0u : ~d->shown.allowance);
}

int memtypes_allowance(const struct vdev *d, uint32_t shown)
{
	return engine.active && shown < d->shown.count && (d->shown.allowance & (1u << shown));
}

uint32_t memtypes_driver(const struct vdev *d, uint32_t shown)
{
	return engine.active && shown < d->shown.count ? d->shown.driver[shown] : shown;
}

int memtypes_mappable(const struct vdev *d, uint32_t shown)
{
	return !engine.active || shown >= d->shown.count ||
	       (d->shown.types[shown].propertyFlags & VK_MEMORY_PROPERTY_HOST_VISIBLE_BIT);
}

/* ---- the physical device's properties ---------------------------------------------- */

static VKAPI_ATTR void VKAPI_CALL properties(VkPhysicalDevice phys,
					     VkPhysicalDeviceMemoryProperties *p)
{
	driver_memory_properties(phys, p);
	present(p);
}

static void properties2(int khr, VkPhysicalDevice phys, VkPhysicalDeviceMemoryProperties2 *p)
{
	driver_memory_properties2(phys, p, khr);
	present(&p->memoryProperties); /* the chain (a budget: heaps) is the driver's */
}

static VKAPI_ATTR void VKAPI_CALL properties2_core(VkPhysicalDevice phys,
						   VkPhysicalDeviceMemoryProperties2 *p)
{
	properties2(0, phys, p);
}

static VKAPI_ATTR void VKAPI_CALL properties2_khr(VkPhysicalDevice phys,
						  VkPhysicalDeviceMemoryProperties2 *p)
{
	properties2(1, phys, p);
}

void memtypes_instance_hook(const char *name, PFN_vkVoidFunction *fn)
{
	if (!strcmp(name, "vkGetPhysicalDeviceMemoryProperties"))
		*fn = (PFN_vkVoidFunction)properties;
	else if (!strcmp(name, "vkGetPhysicalDeviceMemoryProperties2"))
		*fn = (PFN_vkVoidFunction)properties2_core;
	else if (!strcmp(name, "vkGetPhysicalDeviceMemoryProperties2KHR"))
		*fn = (PFN_vkVoidFunction)properties2_khr;
}

/* ---- requirements that name no buffer of ours -------------------------------------- */

static VKAPI_ATTR void VKAPI_CALL image_requirements(VkDevice dev, VkImage image,
						     VkMemoryRequirements *req)
{
	struct vdev *d = dev_of(dev);
	d->GetImageMemoryRequirements(dev, image, req);
	req->memoryTypeBits = memtypes_bits(d, req->memoryTypeBits);
}

static void image_requirements2(PFN_vkGetImageMemoryRequirements2 fn, VkDevice dev,
				const VkImageMemoryRequirementsInfo2 *info,
				VkMemoryRequirements2 *req)
{
	fn(dev, info, req);
	req->memoryRequirements.memoryTypeBits =
		memtypes_bits(dev_of(dev), req->memoryRequirements.memoryTypeBits);
}

static VKAPI_ATTR void VKAPI_CALL image_requirements2_core(
	VkDevice dev, const VkImageMemoryRequirementsInfo2 *info, VkMemoryRequirements2 *req)
{
	image_requirements2(dev_of(dev)->GetImageMemoryRequirements2, dev, info, req);
}

static VKAPI_ATTR void VKAPI_CALL image_requirements2_khr(
	VkDevice dev, const VkImageMemoryRequirementsInfo2 *info, VkMemoryRequirements2 *req)
{
	image_requirements2(dev_of(dev)->GetImageMemoryRequirements2KHR, dev, info, req);
}

/* vkGetDevice{Buffer,Image}MemoryRequirements (Vulkan 1.3, VK_KHR_maintenance4): from a
 * create information, no handle; the driver's answer, in the types the program sees
 * (`bits`: a buffer's may take the mapped allowance, an image's not). */
#define DEVICE_REQUIREMENTS(name, fn, info_type, bits)                                    \
	static VKAPI_ATTR void VKAPI_CALL name(VkDevice dev, const info_type *info,         \
					       VkMemoryRequirements2 *req)                  \
	{                                                                                   \
		struct vdev *d = dev_of(dev);                                               \
		d->fn(dev, info, req);                                                      \
		req->memoryRequirements.memoryTypeBits = bits;                              \
	}
#define BUFFER_BITS                                                          \
	memtypes_buffer_bits(d, req->memoryRequirements.memoryTypeBits, \
			     req->memoryRequirements.size)
#define IMAGE_BITS memtypes_bits(d, req->memoryRequirements.memoryTypeBits)
DEVICE_REQUIREMENTS(device_buffer_requirements, GetDeviceBufferMemoryRequirements,
		    VkDeviceBufferMemoryRequirements, BUFFER_BITS)
DEVICE_REQUIREMENTS(device_buffer_requirements_khr, GetDeviceBufferMemoryRequirementsKHR,
		    VkDeviceBufferMemoryRequirements, BUFFER_BITS)
DEVICE_REQUIREMENTS(device_image_requirements, GetDeviceImageMemoryRequirements,
		    VkDeviceImageMemoryRequirements, IMAGE_BITS)
DEVICE_REQUIREMENTS(device_image_requirements_khr, GetDeviceImageMemoryRequirementsKHR,
		    VkDeviceImageMemoryRequirements, IMAGE_BITS)
#undef BUFFER_BITS
#undef IMAGE_BITS
#undef DEVICE_REQUIREMENTS

/* VK_EXT_external_memory_host: the types a host pointer may be imported as. */
static VKAPI_ATTR VkResult VKAPI_CALL host_pointer_properties(
	VkDevice dev, VkExternalMemoryHandleTypeFlagBits type, const void *ptr,
	VkMemoryHostPointerPropertiesEXT *props)
{
	struct vdev *d = dev_of(dev);
	VkResult r = d->GetMemoryHostPointerPropertiesEXT(dev, type, ptr, props);
	if (r == VK_SUCCESS)
		props->memoryTypeBits = memtypes_bits(d, props->memoryTypeBits);
	return r;
}

/* Entry points that name a memory type or type bits and no handle of ours: also the
 * program's on a device the layer leaves alone (it saw the types shown). */
int memtypes_hook(const char *name, PFN_vkVoidFunction *fn)
{
	static const struct hook hooks[] = {
		HOOK(GetImageMemoryRequirements, image_requirements),
		HOOK(GetImageMemoryRequirements2, image_requirements2_core),
		HOOK(GetImageMemoryRequirements2KHR, image_requirements2_khr),
		HOOK(GetDeviceBufferMemoryRequirements, device_buffer_requirements),
		HOOK(GetDeviceBufferMemoryRequirementsKHR, device_buffer_requirements_khr),
		HOOK(GetDeviceImageMemoryRequirements, device_image_requirements),
		HOOK(GetDeviceImageMemoryRequirementsKHR, device_image_requirements_khr),
		HOOK(GetMemoryHostPointerPropertiesEXT, host_pointer_properties),
	};
	return hook_lookup(hooks, sizeof hooks / sizeof *hooks, name, fn);
}

/* Names table.c hooks that translate a type too, on any device. */
int memtypes_named(const char *name)
{
	static const char *const also[] = {
		"vkAllocateMemory", "vkGetBufferMemoryRequirements",
		"vkGetBufferMemoryRequirements2", "vkGetBufferMemoryRequirements2KHR",
	};
	PFN_vkVoidFunction unused = NULL;
	for (size_t k = 0; k < sizeof also / sizeof *also; k++)
		if (!strcmp(also[k], name))
			return 1;
	return memtypes_hook(name, &unused);
}
