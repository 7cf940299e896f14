/*
 * devices.c: every instance and device the layer made (layer.c adds each), found by
 * any handle of it the loader dispatches. A device destroyed stays in the list, marked
 * gone: the list is read without a lock (a release walks it; every call looks a device
 * up in it).
 */
#include "vklayer.h"

static pthread_mutex_t list_mu = PTHREAD_MUTEX_INITIALIZER;
static struct vinst *instances;
struct vdev *devices;

struct vinst *inst_of(const void *dispatchable)
{
	void *key = key_of(dispatchable);
	pthread_mutex_lock(&list_mu);
	struct vinst *i = instances;
	while (i && i->key != key)
		i = i->next;
	pthread_mutex_unlock(&list_mu);
	return i;
}

void inst_add(struct vinst *i)
{
	pthread_mutex_lock(&list_mu);
	i->next = instances;
	instances = i;
	pthread_mutex_unlock(&list_mu);
}

void inst_remove(struct vinst *i)
{
	pthread_mutex_lock(&list_mu);
	for (struct vinst **p = &instances; *p; p = &(*p)->next)
		if (*p == i) {
			*p = i->next;
			break;
		}
	pthread_mutex_unlock(&list_mu);
}

void driver_memory_properties(VkPhysicalDevice phys, VkPhysicalDeviceMemoryProperties *p)
{
	inst_of(phys)->GetPhysicalDeviceMemoryProperties(phys, p);
}

void driver_memory_properties2(VkPhysicalDevice phys, VkPhysicalDeviceMemoryProperties2 *p,
			       int khr)
{
	struct vinst *i = inst_of(phys);
	(khr ? i->GetPhysicalDeviceMemoryProperties2KHR : i->GetPhysicalDeviceMemoryProperties2)(
		phys, p);
}

struct vdev *dev_list(void)
{
	return __atomic_load_n(&devices, __ATOMIC_ACQUIRE);
}

void dev_add(struct vdev *d)
{
	pthread_mutex_lock(&list_mu);
	d->next = devices;
	__atomic_store_n(&devices, d, __ATOMIC_RELEASE);
	pthread_mutex_unlock(&list_mu);
}
