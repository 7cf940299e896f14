/*
 * The fake libcuda.so.1's device memory (see fake_libcuda.c): plain allocations, which
 * the swap library must replace, and the virtual memory management API, whose physical
 * memory is a memfd mapped where the address was reserved.
 */
#include "fake_cuda.h"

#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

/* ---- plain allocations (what the swap library must replace) --------------- */

struct plain {
	CUdeviceptr ptr;
	size_t size;
	struct plain *next;
};
static struct plain *plains;

static CUresult plain_alloc_now(CUdeviceptr *p, size_t n)
{
	if (!p || !n)
		return INVALID;
	pthread_mutex_lock(&mu);
	if (phys_bytes + (long long)n > total_bytes()) {
		pthread_mutex_unlock(&mu);
		return OOM;
	}
	void *m = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	struct plain *pl = malloc(sizeof *pl);
	if (m == MAP_FAILED || !pl)
		abort();
	*pl = (struct plain){(CUdeviceptr)(uintptr_t)m, n, plains};
	plains = pl;
	phys_add((long long)n);
	pthread_mutex_unlock(&mu);
	*p = pl->ptr;
	return OK;
}

static CUresult plain_alloc(CUdeviceptr *p, size_t n) { GATED(plain_alloc_now(p, n)); }

static CUresult plain_free_now(CUdeviceptr p)
{
	pthread_mutex_lock(&mu);
	for (struct plain **pp = &plains; *pp; pp = &(*pp)->next) {
		struct plain *pl = *pp;
		if (pl->ptr != p)
			continue;
		*pp = pl->next;
		munmap((void *)(uintptr_t)pl->ptr, pl->size);
		phys_add(-(long long)pl->size);
		free(pl);
		pthread_mutex_unlock(&mu);
		return OK;
	}
	pthread_mutex_unlock(&mu);
	return INVALID;
}

static CUresult plain_free(CUdeviceptr p) { GATED(plain_free_now(p)); }

CUresult cuMemAlloc_v2(CUdeviceptr *p, size_t n) { return plain_alloc(p, n); }
CUresult cuMemAllocManaged(CUdeviceptr *p, size_t n, unsigned fl) { (void)fl; return plain_alloc(p, n); }
CUresult cuMemAllocAsync(CUdeviceptr *p, size_t n, void *s) { (void)s; return plain_alloc(p, n); }
CUresult cuMemAllocAsync_ptsz(CUdeviceptr *p, size_t n, void *s) { (void)s; return plain_alloc(p, n); }
CUresult cuMemAllocFromPoolAsync(CUdeviceptr *p, size_t n, void *pool, void *s)
{
	(void)pool, (void)s;
	return plain_alloc(p, n);
}
CUresult cuMemFree_v2(CUdeviceptr p) { return plain_free(p); }
CUresult cuMemFreeAsync(CUdeviceptr p, void *s) { (void)s; return plain_free(p); }
CUresult cuMemFreeAsync_ptsz(CUdeviceptr p, void *s) { (void)s; return plain_free(p); }

CUresult cuMemAllocPitch_v2(CUdeviceptr *p, size_t *pitch, size_t w, size_t h, unsigned e)
{
	(void)e;
	*pitch = (w + 511) / 512 * 512;
	return plain_alloc(p, *pitch * h);
}

/* ---- virtual memory management ---------------------------------------------- */

struct handle {
	int fd;
	size_t size;
	Prop prop;
	int refs, maps; /* the handle's references (create, retains) and mappings */
	struct handle *next;
};
static struct handle *handles; /* live ones: a stale handle is an error, as on a GPU */

/* With mu held. */
static struct handle *live(Handle hh)
{
	for (struct handle *h = handles; h; h = h->next)
		if ((Handle)(uintptr_t)h == hh && h->refs)
			return h;
	return NULL;
}

struct vmap {
	CUdeviceptr va;
	size_t size;
	struct handle *h;
	struct vmap *next;
};
static struct vmap *vmaps;

static void handle_drop(struct handle *h)
{
	if (!h->refs && !h->maps) {
		for (struct handle **pp = &handles; *pp; pp = &(*pp)->next)
			if (*pp == h) {
				*pp = h->next;
				break;
			}
		close(h->fd);
		phys_add(-(long long)h->size);
		free(h);
	}
}

CUresult cuMemGetAllocationGranularity(size_t *g, const Prop *prop, int option)
{
	(void)prop, (void)option;
	*g = GRANULE;
	return OK;
}

CUresult cuMemAddressReserve(CUdeviceptr *p, size_t size, size_t align, CUdeviceptr addr,
			     unsigned long long flags)
{
	(void)addr, (void)flags;
	if (!size || size % GRANULE)
		return INVALID;
	if (align < GRANULE)
		align = GRANULE;
	char *m = mmap(NULL, size + align, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
	if (m == MAP_FAILED)
		return OOM;
	uintptr_t start = ((uintptr_t)m + align - 1) / align * align;
	if (start > (uintptr_t)m)
		munmap(m, start - (uintptr_t)m);
	munmap((char *)start + size, (uintptr_t)m + align - start);
	*p = start;
	return OK;
}

CUresult cuMemAddressFree(CUdeviceptr p, size_t size)
{
	return munmap((void *)(uintptr_t)p, size) ? INVALID : OK;
}

static CUresult cuMemCreate_now(Handle *out, size_t size, const Prop *prop, unsigned long long flags)
{
	(void)flags;
	if (!size || size % GRANULE)
		return INVALID;
	const char *full = getenv("FAKE_CUDA_FULL");
	if (full && !access(full, F_OK))
		return OOM; /* another process holds the GPU's memory */
	pthread_mutex_lock(&mu);
	if (phys_bytes + (long long)size > total_bytes()) {
		pthread_mutex_unlock(&mu);
		return OOM;
	}
	struct handle *h = calloc(1, sizeof *h);
	if (!h)
		abort();
	h->fd = memfd_create("fake-vram", MFD_CLOEXEC);
	if (h->fd < 0 || ftruncate(h->fd, (off_t)size))
		abort();
	h->size = size;
	h->prop = *prop;
	h->refs = 1;
	h->next = handles;
	handles = h;
	phys_add((long long)size);
	pthread_mutex_unlock(&mu);
	*out = (Handle)(uintptr_t)h;
	return OK;
}

CUresult cuMemCreate(Handle *out, size_t size, const Prop *prop, unsigned long long flags)
{
	GATED(cuMemCreate_now(out, size, prop, flags));
}

static CUresult cuMemRelease_now(Handle hh)
{
	pthread_mutex_lock(&mu);
	struct handle *h = live(hh);
	if (!h) {
		pthread_mutex_unlock(&mu);
		return INVALID;
	}
	h->refs--;
	handle_drop(h);
	pthread_mutex_unlock(&mu);
	return OK;
}

CUresult cuMemRelease(Handle hh) { GATED(cuMemRelease_now(hh)); }

static CUresult cuMemMap_now(CUdeviceptr va, size_t size, size_t offset, Handle hh, unsigned long long flags)
{
	(void)flags;
	pthread_mutex_lock(&mu);
	struct handle *h = live(hh);
	if (!h || offset + size > h->size) {
		pthread_mutex_unlock(&mu);
		return INVALID;
	}
	for (struct vmap *m = vmaps; m; m = m->next)
		if (va < m->va + m->size && m->va < va + size) {
			pthread_mutex_unlock(&mu);
			return INVALID; /* already mapped there */
		}
	void *m = mmap((void *)(uintptr_t)va, size, PROT_NONE, MAP_SHARED | MAP_FIXED, h->fd, (off_t)offset);
	struct vmap *v = malloc(sizeof *v);
	if (m == MAP_FAILED || !v)
		abort();
	*v = (struct vmap){va, size, h, vmaps};
	vmaps = v;
	h->maps++;
	pthread_mutex_unlock(&mu);
	return OK;
}

CUresult cuMemMap(CUdeviceptr va, size_t size, size_t offset, Handle hh, unsigned long long flags)
{
	GATED(cuMemMap_now(va, size, offset, hh, flags));
}

static CUresult cuMemUnmap_now(CUdeviceptr va, size_t size)
{
	pthread_mutex_lock(&mu);
	int found = 0;
	for (struct vmap **pp = &vmaps; *pp;) {
		struct vmap *v = *pp;
		if (v->va >= va && v->va + v->size <= va + size) {
			*pp = v->next;
			void *m = mmap((void *)(uintptr_t)v->va, v->size, PROT_NONE,
				       MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
			if (m == MAP_FAILED)
				abort();
			v->h->maps--;
			handle_drop(v->h);
			free(v);
			found = 1;
		} else {
			pp = &v->next;
		}
	}
	pthread_mutex_unlock(&mu);
	return found ? OK : INVALID;
}

CUresult cuMemUnmap(CUdeviceptr va, size_t size) { GATED(cuMemUnmap_now(va, size)); }

static CUresult cuMemSetAccess_now(CUdeviceptr va, size_t size, const Access *desc, size_t n)
{
	if (!n || desc[0].flags != 3)
		return INVALID;
	return mprotect((void *)(uintptr_t)va, size, PROT_READ | PROT_WRITE) ? INVALID : OK;
}

CUresult cuMemSetAccess(CUdeviceptr va, size_t size, const Access *desc, size_t n)
{
	GATED(cuMemSetAccess_now(va, size, desc, n));
}

CUresult cuMemRetainAllocationHandle(Handle *out, void *addr)
{
	CUdeviceptr a = (CUdeviceptr)(uintptr_t)addr;
	pthread_mutex_lock(&mu);
	for (struct vmap *v = vmaps; v; v = v->next)
		if (a >= v->va && a < v->va + v->size) {
			v->h->refs++;
			*out = (Handle)(uintptr_t)v->h;
			pthread_mutex_unlock(&mu);
			return OK;
		}
	pthread_mutex_unlock(&mu);
	return INVALID;
}

CUresult cuMemGetAllocationPropertiesFromHandle(Prop *prop, Handle hh)
{
	pthread_mutex_lock(&mu);
	struct handle *h = live(hh);
	if (h)
		*prop = h->prop;
	pthread_mutex_unlock(&mu);
	return h ? OK : INVALID;
}

CUresult cuMemExportToShareableHandle(void *out, Handle hh, int type, unsigned long long fl)
{
	(void)type, (void)fl;
	pthread_mutex_lock(&mu);
	struct handle *h = live(hh);
	if (h)
		*(int *)out = dup(h->fd);
	pthread_mutex_unlock(&mu);
	return h ? OK : INVALID;
}

CUresult cuMemGetAddressRange_v2(CUdeviceptr *base, size_t *size, CUdeviceptr p)
{
	CUresult r = INVALID;
	pthread_mutex_lock(&mu);
	for (struct plain *pl = plains; pl && r; pl = pl->next)
		if (p >= pl->ptr && p < pl->ptr + pl->size)
			*base = pl->ptr, *size = pl->size, r = OK;
	for (struct vmap *v = vmaps; v && r; v = v->next)
		if (p >= v->va && p < v->va + v->size)
			*base = v->va, *size = v->size, r = OK;
	pthread_mutex_unlock(&mu);
	return r;
}

CUresult cuMemGetInfo_v2(size_t *free_, size_t *total)
{
	pthread_mutex_lock(&mu);
	*total = (size_t)total_bytes();
	*free_ = (size_t)(total_bytes() - phys_bytes);
	pthread_mutex_unlock(&mu);
	return OK;
}

/* As on a GPU: legacy IPC shares cuMemAlloc memory, never memory the virtual memory
 * management API mapped. */
CUresult cuIpcGetMemHandle(void *h, CUdeviceptr p)
{
	pthread_mutex_lock(&mu);
	int mapped = 0;
	for (struct vmap *m = vmaps; m; m = m->next)
		mapped |= p >= m->va && p < m->va + m->size;
	pthread_mutex_unlock(&mu);
	if (mapped)
		return INVALID;
	memset(h, 0, 64);
	return OK;
}
