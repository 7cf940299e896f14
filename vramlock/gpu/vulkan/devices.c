/*
 * devices.c: every device the layer made (layer.c adds each), found by any handle of
 * it the loader dispatches. A device destroyed stays in the list, marked gone: a
 * release walks the list without its lock.
 */
#include "vklayer.h"

static pthread_mutex_t list_mu = PTHREAD_MUTEX_INITIALIZER;
static struct vdev *devices;

static void *key_of(const void *dispatchable)
{
	return *(void *const *)dispatchable;
}

/* Any handle the device made that the loader dispatches (device, queue, command
 * buffer) shares its dispatch key. */
struct vdev *dev_of(VkDevice dev)
{
	void *key = key_of(dev);
	pthread_mutex_lock(&list_mu);
	struct vdev *d = devices;
	while (d && key_of(d->dev) != key)
		d = d->next;
	pthread_mutex_unlock(&list_mu);
	return d;
}

struct vdev *dev_list(void)
{
	pthread_mutex_lock(&list_mu);
	struct vdev *d = devices;
	pthread_mutex_unlock(&list_mu);
	return d;
}

void dev_add(struct vdev *d)
{
	pthread_mutex_lock(&list_mu);
	d->next = devices;
	devices = d;
	pthread_mutex_unlock(&list_mu);
}
