/*
 * table.c: the allocations the library serves (cuMemAlloc & co.) with the driver's
 * virtual memory management, small ones sharing slabs, and the tables of
 * physical allocations, mappings and regions a swap walks. Every table is
 * changed with `mu` held.
 */
#include "swap.h"

/* ---- what the library keeps track of ---------------------------------------- */

/* A slab: one physical allocation shared by small allocations (256-byte units). */
#define SLAB_UNIT 256
struct slab {
	struct slab *next;
	CUdevice dev;
	CUdeviceptr base;
	size_t size, units, used;
	size_t free_from; /* no free unit below it: searches start there */
	uint64_t *bits;
	uint32_t *piece; /* for each unit in use: the unit its piece starts at */
	uint32_t *asked; /* for each piece's first unit: the bytes asked for */
	struct phys *phys;
};

/* What cuMemAlloc handed out, by address: a big allocation, or a whole slab (its
 * pieces are the slab's own: a table of pieces kept sorted would cost a move of the
 * whole table for each of a hundred thousand small allocations). */
struct region {
	CUdeviceptr ptr;
	size_t size;
	struct phys *phys; /* NULL for a slab */
	struct slab *slab;
};

struct phys *physes;
struct mapping *maps;
size_t nmaps;
static size_t capmaps;
static struct region *regions;
static size_t nregions, capregions;
static struct slab *slabs;
atomic_int captures;
double table_changed_ms; /* when an allocation last came or went (prepare.c) */

static size_t granularity_of[MAX_DEVICES];

static int grow(void **array, size_t *cap, size_t need, size_t elem)
{
	if (need <= *cap)
		return 0;
	size_t cap2 = *cap ? *cap * 2 : 64;
	while (cap2 < need)
		cap2 *= 2;
	void *p = realloc(*array, cap2 * elem);
	if (!p)
		return -1;
	*array = p;
	*cap = cap2;
	return 0;
}

/* First index whose va (or ptr) is >= key. */
size_t map_index(CUdeviceptr key)
{
	size_t lo = 0, hi = nmaps;
	while (lo < hi) {
		size_t mid = (lo + hi) / 2;
		if (maps[mid].va < key)
			lo = mid + 1;
		else
			hi = mid;
	}
	return lo;
}

static size_t region_index(CUdeviceptr key)
{
	size_t lo = 0, hi = nregions;
	while (lo < hi) {
		size_t mid = (lo + hi) / 2;
		if (regions[mid].ptr < key)
			lo = mid + 1;
		else
			hi = mid;
	}
	return lo;
}

/* The region containing `p`, or NULL. */
static struct region *region_at(CUdeviceptr p)
{
	size_t i = region_index(p);
	if (i < nregions && regions[i].ptr == p)
		return &regions[i];
	if (i > 0 && p < regions[i - 1].ptr + regions[i - 1].size)
		return &regions[i - 1];
	return NULL;
}

struct mapping *mapping_at(CUdeviceptr p)
{
	size_t i = map_index(p);
	if (i < nmaps && maps[i].va == p)
		return &maps[i];
	if (i > 0 && p < maps[i - 1].va + maps[i - 1].size)
		return &maps[i - 1];
	return NULL;
}

/* May device `dev` read through mapping `m`, as the program set its access? */
int device_reads(const struct mapping *m, CUdevice dev)
{
	for (size_t i = 0; i < m->naccess; i++)
		if (m->access[i].location.type == CU_MEM_LOCATION_TYPE_DEVICE &&
		    m->access[i].location.id == dev && m->access[i].flags & 1)
			return 1;
	return 0;
}

int add_mapping(CUdeviceptr va, size_t size, size_t offset, struct phys *p)
{
	if (grow((void **)&maps, &capmaps, nmaps + 1, sizeof *maps))
		return -1;
	size_t i = map_index(va);
	memmove(&maps[i + 1], &maps[i], (nmaps - i) * sizeof *maps);
	maps[i] = (struct mapping){.va = va, .size = size, .offset = offset, .phys = p};
	nmaps++;
	p->maps++;
	return 0;
}

static int add_region(CUdeviceptr ptr, size_t size, struct phys *p, struct slab *s)
{
	if (grow((void **)&regions, &capregions, nregions + 1, sizeof *regions))
		return -1;
	size_t i = region_index(ptr);
	memmove(&regions[i + 1], &regions[i], (nregions - i) * sizeof *regions);
	regions[i] = (struct region){.ptr = ptr, .size = size, .phys = p, .slab = s};
	nregions++;
	return 0;
}

static void drop_region(struct region *r)
{
	size_t i = (size_t)(r - regions);
	memmove(&regions[i], &regions[i + 1], (nregions - i - 1) * sizeof *regions);
	nregions--;
}

int set_access(struct mapping *m, const CUmemAccessDesc *desc, size_t n)
{
	CUmemAccessDesc *copy = malloc(n * sizeof *copy);
	if (!copy)
		return -1;
	memcpy(copy, desc, n * sizeof *copy);
	free(m->access);
	m->access = copy;
	m->naccess = n;
	return 0;
}

struct phys *phys_by_handle(unsigned long long h)
{
	for (struct phys *p = physes; p; p = p->next)
		if (p->handle == h && h)
			return p;
	return NULL;
}

struct phys *phys_new(size_t size, const CUmemAllocationProp *prop, CUcontext ctx)
{
	struct phys *p = calloc(1, sizeof *p);
	if (!p)
		return NULL;
	p->size = size;
	p->prop = *prop;
	p->ctx = ctx;
	table_changed_ms = now_ms();
	p->next = physes;
	if (physes)
		physes->prev = p;
	physes = p;
	return p;
}

/* Frees what backs `p`, and `p`. Nothing may map it any more. */
void phys_destroy(struct phys *p)
{
	if (p->real) {
		CUresult r = real_cuMemRelease(p->real);
		if (r)
			say("cuMemRelease: %s", errname(r));
	}
	host_free(p);
	table_changed_ms = now_ms();
	free(p->digest);
	free(p->pre_digest);
	if (p->prev)
		p->prev->next = p->next;
	else
		physes = p->next;
	if (p->next)
		p->next->prev = p->prev;
	free(p);
}

/* Drops the mappings inside [va, va + size) from the table (not from the driver). */
void forget_mappings(CUdeviceptr va, size_t size)
{
	size_t i = map_index(va), j = i;
	while (j < nmaps && maps[j].va < va + size) {
		struct phys *p = maps[j].phys;
		free(maps[j].access);
		p->maps--;
		if (!p->maps && !p->refs)
			phys_destroy(p);
		j++;
	}
	memmove(&maps[i], &maps[j], (nmaps - j) * sizeof *maps);
	nmaps -= j - i;
}

static CUmemAllocationProp device_prop(CUdevice dev)
{
	CUmemAllocationProp prop;
	memset(&prop, 0, sizeof prop);
	prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
	prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
	prop.location.id = dev;
	return prop;
}

CUmemAccessDesc device_access(CUdevice dev)
{
	CUmemAccessDesc d = {{CU_MEM_LOCATION_TYPE_DEVICE, dev}, CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
	return d;
}

/* Who may use memory of `dev`: the device, and every device that can reach it
 * directly. Memory from cudaMalloc is usable from a peer once the program enables
 * peer access; VMM memory only from the devices its access list names. With `mu`. */
static CUmemAccessDesc access_of[MAX_DEVICES][MAX_DEVICES];
static size_t naccess_of[MAX_DEVICES];

static size_t device_accesses(CUdevice dev, const CUmemAccessDesc **out)
{
	if (!naccess_of[dev]) {
		int count = 1;
		access_of[dev][naccess_of[dev]++] = device_access(dev);
		if (real_cuDeviceGetCount && real_cuDeviceCanAccessPeer &&
		    real_cuDeviceGetCount(&count) == CUDA_SUCCESS)
			for (int e = 0; e < count && e < MAX_DEVICES; e++) {
				int can = 0;
				if (e != dev && real_cuDeviceCanAccessPeer(&can, e, dev) == CUDA_SUCCESS &&
				    can)
					access_of[dev][naccess_of[dev]++] = device_access(e);
			}
	}
	*out = access_of[dev];
	return naccess_of[dev];
}

CUresult granularity(CUdevice dev, size_t *g)
{
	if (dev < 0 || dev >= MAX_DEVICES)
		return CUDA_ERROR_INVALID_VALUE;
	if (!granularity_of[dev]) {
		CUmemAllocationProp prop = device_prop(dev);
		CUresult r = real_cuMemGetAllocationGranularity(&granularity_of[dev], &prop,
								CU_MEM_ALLOC_GRANULARITY_MINIMUM);
		if (r)
			return r;
	}
	*g = granularity_of[dev];
	return CUDA_SUCCESS;
}

/* Reserves, creates, maps and opens `size` bytes (a multiple of the granularity)
 * on `dev`: the backing of our own allocations and of slabs. With `mu` held. */
static CUresult map_new(size_t size, CUdevice dev, CUcontext ctx, CUdeviceptr *va, struct phys **out)
{
	size_t g;
	CUresult r = granularity(dev, &g);
	if (r)
		return r;
	r = real_cuMemAddressReserve(va, size, g, 0, 0);
	if (r)
		return r;
	CUmemAllocationProp prop = device_prop(dev);
	const CUmemAccessDesc *access;
	size_t naccess = device_accesses(dev, &access);
	struct phys *p = phys_new(size, &prop, ctx);
	if (!p) {
		r = CUDA_ERROR_OUT_OF_MEMORY;
		goto unreserve;
	}
	r = real_cuMemCreate(&p->real, size, &prop, 0);
	if (r) {
		p->real = 0;
		goto destroy;
	}
	r = real_cuMemMap(*va, size, 0, p->real, 0);
	if (r)
		goto destroy;
	r = real_cuMemSetAccess(*va, size, access, naccess);
	if (r)
		goto unmap;
	if (add_mapping(*va, size, 0, p)) {
		r = CUDA_ERROR_OUT_OF_MEMORY;
		goto unmap;
	}
	p->refs = 1; /* the region's */
	if (set_access(&maps[map_index(*va)], access, naccess)) {
		r = CUDA_ERROR_OUT_OF_MEMORY;
		p->refs = 0;
		real_cuMemUnmap(*va, size);
		forget_mappings(*va, size); /* destroys p */
		goto unreserve;
	}
	*out = p;
	return CUDA_SUCCESS;
unmap:
	real_cuMemUnmap(*va, size);
destroy:
	phys_destroy(p);
unreserve:
	real_cuMemAddressFree(*va, size);
	return r;
}

/* Undoes map_new. With `mu` held. */
static void unmap_own(CUdeviceptr va, struct phys *p)
{
	size_t size = p->size;
	CUresult r = real_cuMemUnmap(va, size);
	if (r)
		say("cuMemUnmap: %s", errname(r));
	p->refs = 0;
	forget_mappings(va, size); /* destroys p */
	r = real_cuMemAddressFree(va, size);
	if (r)
		say("cuMemAddressFree: %s", errname(r));
}

/* The first run of `n` free units, from `free_from` on. Every unit the search passes
 * is used, or free in a run too short; `free_from` moves up to the first free one, so
 * that filling a slab one unit at a time costs a step each, not a walk over the
 * units in use (160,000 small allocations once took 80 times the driver's time). */
static int slab_find(struct slab *s, size_t n, size_t *at)
{
	size_t i = s->free_from, first = s->units; /* the first free unit passed */
	while (i + n <= s->units) {
		size_t j = i;
		while (j < i + n && !(s->bits[j / 64] >> (j % 64) & 1))
			j++;
		if (j > i && first == s->units)
			first = i;
		if (j == i + n) {
			*at = i;
			s->free_from = first;
			return 1;
		}
		i = j + 1;
	}
	s->free_from = first < i ? first : i;
	return 0;
}

static void slab_mark(struct slab *s, size_t at, size_t n, int used)
{
	for (size_t i = at; i < at + n; i++) {
		if (used)
			s->bits[i / 64] |= 1ULL << (i % 64);
		else
			s->bits[i / 64] &= ~(1ULL << (i % 64));
	}
	s->used = used ? s->used + n : s->used - n;
	if (!used && at < s->free_from)
		s->free_from = at;
	else if (used && at == s->free_from)
		s->free_from = at + n;
}

static void slab_destroy(struct slab *s)
{
	free(s->bits);
	free(s->piece);
	free(s->asked);
	free(s);
}

/* A new slab on `dev`, first in the list. With `mu` held. */
static CUresult slab_new(CUdevice dev, CUcontext ctx, size_t g, struct slab **out)
{
	struct slab *s = calloc(1, sizeof *s);
	if (!s)
		return CUDA_ERROR_OUT_OF_MEMORY;
	s->dev = dev;
	s->size = 4 * g;
	s->units = s->size / SLAB_UNIT;
	s->bits = calloc((s->units + 63) / 64, sizeof *s->bits);
	s->piece = calloc(s->units, sizeof *s->piece);
	s->asked = calloc(s->units, sizeof *s->asked);
	CUresult r = s->bits && s->piece && s->asked ? map_new(s->size, dev, ctx, &s->base, &s->phys)
						     : CUDA_ERROR_OUT_OF_MEMORY;
	if (!r && add_region(s->base, s->size, NULL, s)) {
		unmap_own(s->base, s->phys);
		r = CUDA_ERROR_OUT_OF_MEMORY;
	}
	if (r) {
		slab_destroy(s);
		return r;
	}
	s->next = slabs;
	slabs = s;
	*out = s;
	return CUDA_SUCCESS;
}

/* Small allocations share slabs of a few granules: a thousand small cudaMallocs must
 * not cost a thousand granules. A slab is swapped as one piece. With `mu` held. */
static CUresult slab_alloc(CUdeviceptr *dptr, size_t size, CUdevice dev, CUcontext ctx, size_t g)
{
	size_t n = (size + SLAB_UNIT - 1) / SLAB_UNIT, at = 0;
	struct slab *s;
	for (s = slabs; s; s = s->next)
		if (s->dev == dev && s->units - s->used >= n && slab_find(s, n, &at))
			break;
	if (!s) {
		CUresult r = slab_new(dev, ctx, g, &s);
		if (r)
			return r;
		at = 0;
	}
	*dptr = s->base + at * SLAB_UNIT;
	slab_mark(s, at, n, 1);
	for (size_t u = at; u < at + n; u++)
		s->piece[u] = (uint32_t)at;
	s->asked[at] = (uint32_t)size;
	return CUDA_SUCCESS;
}

/* Frees the piece of `s` that starts at unit `at`; the slab too once it is empty. */
static void slab_free(struct slab *s, size_t at)
{
	slab_mark(s, at, (s->asked[at] + SLAB_UNIT - 1) / SLAB_UNIT, 0);
	if (s->used)
		return;
	/* Empty: give it back, or a program that frees everything keeps its peak. */
	struct slab **pp = &slabs;
	while (*pp != s)
		pp = &(*pp)->next;
	*pp = s->next;
	drop_region(&regions[region_index(s->base)]);
	unmap_own(s->base, s->phys);
	slab_destroy(s);
}

/* What cuMemAlloc & co. handed out that holds `p`: its start and size, and the
 * region it is (or whose slab it is a piece of). 0 when nothing does. With `mu`. */
static int lookup(CUdeviceptr p, CUdeviceptr *base, size_t *size, struct region **reg)
{
	struct region *r = region_at(p);
	if (!r)
		return 0;
	*reg = r;
	if (!r->slab) {
		*base = r->ptr;
		*size = r->size;
		return 1;
	}
	struct slab *s = r->slab;
	size_t u = (size_t)(p - s->base) / SLAB_UNIT;
	if (!(s->bits[u / 64] >> (u % 64) & 1))
		return 0;
	*base = s->base + (CUdeviceptr)s->piece[u] * SLAB_UNIT;
	*size = s->asked[s->piece[u]];
	return p < *base + *size;
}

/* In a forked child: the tables describe its parent's memory (the child's copies of
 * the structures are left as they are, unreachable). */
void table_forget(void)
{
	physes = NULL;
	maps = NULL;
	nmaps = capmaps = 0;
	regions = NULL;
	nregions = capregions = 0;
	slabs = NULL;
}

/* The allocation holding `p` (its base and size): 1 when there is one. */
int region_of(CUdeviceptr p, CUdeviceptr *base, size_t *size)
{
	CUdeviceptr b;
	size_t n;
	struct region *reg;
	pthread_mutex_lock(&mu);
	int found = lookup(p, &b, &n, &reg);
	pthread_mutex_unlock(&mu);
	if (found && base)
		*base = b;
	if (found && size)
		*size = n;
	return found;
}

/* Did cuMemAlloc & co. hand out `ptr` (the start of an allocation)? */
int is_own(CUdeviceptr ptr)
{
	CUdeviceptr base;
	size_t size;
	struct region *reg;
	pthread_mutex_lock(&mu);
	int ours = lookup(ptr, &base, &size, &reg) && base == ptr;
	pthread_mutex_unlock(&mu);
	return ours;
}

/* A cuMemAlloc in the current context. */
CUresult own_alloc(CUdeviceptr *dptr, size_t size)
{
	if (!dptr)
		return CUDA_ERROR_INVALID_VALUE;
	if (!size)
		return CUDA_ERROR_INVALID_VALUE;
	CUcontext ctx = NULL;
	CUdevice dev;
	CUresult r = real_cuCtxGetCurrent(&ctx);
	if (r)
		return r;
	if (!ctx)
		return CUDA_ERROR_INVALID_CONTEXT;
	r = real_cuCtxGetDevice(&dev);
	if (r)
		return r;
	size_t g;
	struct phys *p;
	pthread_mutex_lock(&mu);
	r = granularity(dev, &g);
	if (!r && size < g) {
		r = slab_alloc(dptr, size, dev, ctx, g);
	} else if (!r && !(r = map_new(round_up(size, g), dev, ctx, dptr, &p)) &&
		   add_region(*dptr, size, p, NULL)) {
		unmap_own(*dptr, p);
		r = CUDA_ERROR_OUT_OF_MEMORY;
	}
	pthread_mutex_unlock(&mu);
	TRACE("alloc %zu bytes at 0x%llx: %d", size, r ? 0ULL : *dptr, r);
	return r;
}

/* 1 when `ptr` was ours (and is freed now), 0 when the driver should have it. */
int own_free(CUdeviceptr ptr)
{
	CUdeviceptr base;
	size_t size;
	struct region *reg;
	pthread_mutex_lock(&mu);
	int ours = lookup(ptr, &base, &size, &reg) && base == ptr;
	if (ours && reg->slab) {
		slab_free(reg->slab, (size_t)(ptr - reg->slab->base) / SLAB_UNIT);
	} else if (ours) {
		struct phys *p = reg->phys;
		drop_region(reg);
		unmap_own(ptr, p);
	}
	pthread_mutex_unlock(&mu);
	return ours;
}
