/*
 * witness_layer: the tests' own Vulkan layer (VK_LAYER_VRAMLOCK_TEST_witness), put
 * below vramlock's, next to the driver. It sees what reaches the driver, and writes
 * it where the test looks ($WITNESS_LOG, one line each, monotonic ns):
 *
 *   submit START END   a vkQueueSubmit (or 2) reached the driver at START; the queue was
 *                      idle again at END (the layer waits for it: the work is done)
 *   memory NS BYTES    device memory the program holds at the driver, after a
 *                      vkAllocateMemory or vkFreeMemory
 *   map NS BYTES       a vkMapMemory of an allocation of BYTES
 *   copy NS BYTES      a vkCmdCopyBuffer of BYTES (its regions' sum) recorded
 *
 * It knows nothing of vramlock: a test that reads it learns what the driver saw. It also
 * makes (and keeps, uncounted) a buffer and an allocation of its own before each buffer
 * and allocation that reaches the driver, as large: a driver that puts the next one
 * where one destroyed was (lavapipe's memory is the host's) would hide a descriptor
 * left naming the destroyed one; the next one lands elsewhere.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <vulkan/vk_layer.h>
#include <vulkan/vulkan.h>

#define EXPORT __attribute__((visibility("default")))

static PFN_vkGetInstanceProcAddr next_gipa;
static PFN_vkGetDeviceProcAddr next_gdpa;
static PFN_vkQueueSubmit next_submit;
static PFN_vkQueueSubmit2 next_submit2;
static PFN_vkQueueWaitIdle next_wait;
static PFN_vkAllocateMemory next_alloc;
static PFN_vkFreeMemory next_free;
static PFN_vkCreateBuffer next_create_buffer;
static PFN_vkMapMemory next_map;
static PFN_vkCmdCopyBuffer next_copy;
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static struct held {
	VkDeviceMemory mem;
	VkDeviceSize size;
	struct held *next;
} *helds;
static unsigned long long bytes;

static unsigned long long now(void)
{
	struct timespec t;
	clock_gettime(CLOCK_MONOTONIC, &t);
	return (unsigned long long)t.tv_sec * 1000000000ull + (unsigned long long)t.tv_nsec;
}

static void log_line(const char *kind, unsigned long long a, unsigned long long b)
{
	const char *path = getenv("WITNESS_LOG");
	FILE *f = path ? fopen(path, "a") : NULL;
	if (f) {
		fprintf(f, "%s %llu %llu\n", kind, a, b);
		fclose(f);
	}
}

static VKAPI_ATTR VkResult VKAPI_CALL submit(VkQueue q, uint32_t n, const VkSubmitInfo *s,
					     VkFence fence)
{
	unsigned long long start = now();
	VkResult r = next_submit(q, n, s, fence);
	if (r == VK_SUCCESS)
		r = next_wait(q);
	pthread_mutex_lock(&mu);
	log_line("submit", start, now());
	pthread_mutex_unlock(&mu);
	return r;
}

static VKAPI_ATTR VkResult VKAPI_CALL submit2(VkQueue q, uint32_t n, const VkSubmitInfo2 *s,
					      VkFence fence)
{
	unsigned long long start = now();
	VkResult r = next_submit2(q, n, s, fence);
	if (r == VK_SUCCESS)
		r = next_wait(q);
	pthread_mutex_lock(&mu);
	log_line("submit", start, now());
	pthread_mutex_unlock(&mu);
	return r;
}

static VKAPI_ATTR VkResult VKAPI_CALL alloc(VkDevice dev, const VkMemoryAllocateInfo *info,
					    const VkAllocationCallbacks *cb, VkDeviceMemory *out)
{
	VkDeviceMemory kept;
	VkResult r = next_alloc(dev, info, NULL, &kept);
	if (r == VK_SUCCESS)
		r = next_alloc(dev, info, cb, out);
	struct held *h = r == VK_SUCCESS ? malloc(sizeof *h) : NULL;
	if (h) {
		pthread_mutex_lock(&mu);
		h->mem = *out, h->size = info->allocationSize, h->next = helds, helds = h;
		bytes += info->allocationSize;
		log_line("memory", now(), bytes);
		pthread_mutex_unlock(&mu);
	}
	return r;
}

static VKAPI_ATTR void VKAPI_CALL release(VkDevice dev, VkDeviceMemory mem,
					  const VkAllocationCallbacks *cb)
{
	next_free(dev, mem, cb);
	pthread_mutex_lock(&mu);
	for (struct held **p = &helds; *p; p = &(*p)->next)
		if ((*p)->mem == mem) {
			struct held *h = *p;
			*p = h->next;
			bytes -= h->size;
			free(h);
			log_line("memory", now(), bytes);
			break;
		}
	pthread_mutex_unlock(&mu);
}

static VKAPI_ATTR VkResult VKAPI_CALL map(VkDevice dev, VkDeviceMemory mem, VkDeviceSize offset,
					  VkDeviceSize size, VkMemoryMapFlags flags, void **data)
{
	VkResult r = next_map(dev, mem, offset, size, flags, data);
	pthread_mutex_lock(&mu);
	for (struct held *h = helds; r == VK_SUCCESS && h; h = h->next)
		if (h->mem == mem)
			log_line("map", now(), h->size);
	pthread_mutex_unlock(&mu);
	return r;
}

static VKAPI_ATTR void VKAPI_CALL copy(VkCommandBuffer cb, VkBuffer src, VkBuffer dst, uint32_t n,
				       const VkBufferCopy *regions)
{
	unsigned long long sum = 0;
	for (uint32_t k = 0; k < n; k++)
		sum += regions[k].size;
	next_copy(cb, src, dst, n, regions);
	pthread_mutex_lock(&mu);
	log_line("copy", now(), sum);
	pthread_mutex_unlock(&mu);
}

static VKAPI_ATTR VkResult VKAPI_CALL create_buffer(VkDevice dev, const VkBufferCreateInfo *ci,
						    const VkAllocationCallbacks *cb, VkBuffer *out)
{
	VkBuffer kept;
	VkResult r = next_create_buffer(dev, ci, NULL, &kept);
	return r == VK_SUCCESS ? next_create_buffer(dev, ci, cb, out) : r;
}

static VKAPI_ATTR VkResult VKAPI_CALL create_instance(const VkInstanceCreateInfo *ci,
						      const VkAllocationCallbacks *a, VkInstance *out)
{
	VkLayerInstanceCreateInfo *link = (VkLayerInstanceCreateInfo *)ci->pNext;
	while (link && !(link->sType == VK_STRUCTURE_TYPE_LOADER_INSTANCE_CREATE_INFO &&
			 link->function == VK_LAYER_LINK_INFO))
		link = (VkLayerInstanceCreateInfo *)link->pNext;
	if (!link)
		return VK_ERROR_INITIALIZATION_FAILED;
	next_gipa = link->u.pLayerInfo->pfnNextGetInstanceProcAddr;
	link->u.pLayerInfo = link->u.pLayerInfo->pNext;
	return ((PFN_vkCreateInstance)next_gipa(NULL, "vkCreateInstance"))(ci, a, out);
}

static VKAPI_ATTR VkResult VKAPI_CALL create_device(VkPhysicalDevice phys,
						    const VkDeviceCreateInfo *ci,
						    const VkAllocationCallbacks *a, VkDevice *out)
{
	VkLayerDeviceCreateInfo *link = (VkLayerDeviceCreateInfo *)ci->pNext;
	while (link && !(link->sType == VK_STRUCTURE_TYPE_LOADER_DEVICE_CREATE_INFO &&
			 link->function == VK_LAYER_LINK_INFO))
		link = (VkLayerDeviceCreateInfo *)link->pNext;
	if (!link)
		return VK_ERROR_INITIALIZATION_FAILED;
	PFN_vkGetInstanceProcAddr gipa = link->u.pLayerInfo->pfnNextGetInstanceProcAddr;
	next_gdpa = link->u.pLayerInfo->pfnNextGetDeviceProcAddr;
	link->u.pLayerInfo = link->u.pLayerInfo->pNext;
	VkResult r = ((PFN_vkCreateDevice)gipa(NULL, "vkCreateDevice"))(phys, ci, a, out);
	if (r != VK_SUCCESS)
		return r;
	next_submit = (PFN_vkQueueSubmit)next_gdpa(*out, "vkQueueSubmit");
	next_submit2 = (PFN_vkQueueSubmit2)next_gdpa(*out, "vkQueueSubmit2");
	next_wait = (PFN_vkQueueWaitIdle)next_gdpa(*out, "vkQueueWaitIdle");
	next_alloc = (PFN_vkAllocateMemory)next_gdpa(*out, "vkAllocateMemory");
	next_free = (PFN_vkFreeMemory)next_gdpa(*out, "vkFreeMemory");
	next_create_buffer = (PFN_vkCreateBuffer)next_gdpa(*out, "vkCreateBuffer");
	next_map = (PFN_vkMapMemory)next_gdpa(*out, "vkMapMemory");
	next_copy = (PFN_vkCmdCopyBuffer)next_gdpa(*out, "vkCmdCopyBuffer");
	return r;
}

static PFN_vkVoidFunction ours(const char *name)
{
	if (!strcmp(name, "vkQueueSubmit"))
		return (PFN_vkVoidFunction)submit;
	if (!strcmp(name, "vkQueueSubmit2") && next_submit2)
		return (PFN_vkVoidFunction)submit2;
	if (!strcmp(name, "vkAllocateMemory"))
		return (PFN_vkVoidFunction)alloc;
	if (!strcmp(name, "vkFreeMemory"))
		return (PFN_vkVoidFunction)release;
	if (!strcmp(name, "vkCreateBuffer"))
		return (PFN_vkVoidFunction)create_buffer;
	if (!strcmp(name, "vkCreateDevice"))
		return (PFN_vkVoidFunction)create_device;
	if (!strcmp(name, "vkMapMemory"))
		return (PFN_vkVoidFunction)map;
	if (!strcmp(name, "vkCmdCopyBuffer"))
		return (PFN_vkVoidFunction)copy;
	return NULL;
}

static VKAPI_ATTR PFN_vkVoidFunction VKAPI_CALL device_proc(VkDevice dev, const char *name)
{
	PFN_vkVoidFunction fn = ours(name);
	return fn ? fn : next_gdpa(dev, name);
}

static VKAPI_ATTR PFN_vkVoidFunction VKAPI_CALL instance_proc(VkInstance inst, const char *name)
{
	if (!strcmp(name, "vkCreateInstance"))
		return (PFN_vkVoidFunction)create_instance;
	if (!strcmp(name, "vkGetDeviceProcAddr"))
		return (PFN_vkVoidFunction)device_proc;
	if (!strcmp(name, "vkGetInstanceProcAddr"))
		return (PFN_vkVoidFunction)instance_proc;
	PFN_vkVoidFunction fn = ours(name);
	return fn ? fn : next_gipa(inst, name);
}

EXPORT VKAPI_ATTR VkResult VKAPI_CALL
vkNegotiateLoaderLayerInterfaceVersion(VkNegotiateLayerInterface *v)
{
	if (v->loaderLayerInterfaceVersion > 2)
		v->loaderLayerInterfaceVersion = 2;
	v->pfnGetInstanceProcAddr = instance_proc;
	v->pfnGetDeviceProcAddr = device_proc;
	v->pfnGetPhysicalDeviceProcAddr = NULL;
	return VK_SUCCESS;
}
