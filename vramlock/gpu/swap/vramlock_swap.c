/*
 * libvramlock-swap: put in front of an unmodified CUDA program (LD_PRELOAD) by
 * `vramlock run --release swap`, it lets the program give its device memory back
 * while it keeps running, and take it back later at the same addresses.
 *
 * How:
 *  - Interposition. The CUDA runtime finds the driver through dlopen + dlsym and,
 *    since CUDA 11.3, through cuGetProcAddress; a program may also link libcuda.
 *    So dlsym, cuGetProcAddress(_v2) and the hooked cu* symbols themselves are
 *    exported here; the real entry points come from libcuda's own handle.
 *  - Virtual memory management. cuMemAlloc & co. are served with cuMemAddressReserve
 *    + cuMemCreate + cuMemMap: the physical memory can then be released while the
 *    virtual range stays reserved, and new physical memory mapped at the same
 *    address on restore, so every pointer the program holds stays valid. Programs
 *    that use VMM themselves get stable handles: the handle the program holds is
 *    ours, mapped to whatever real handle backs it now.
 *  - A gate. Every call that touches device memory (launches, copies, memsets,
 *    allocations) passes an in-flight counter; a release closes the gate, waits
 *    for the calls inside to leave, synchronizes, copies everything to pinned host
 *    memory and releases the physical memory. Calls arriving meanwhile block.
 *  - Control. At cuInit the process connects to the unix socket named by
 *    VRAMLOCK_SWAP_SOCKET, says `hello <pid>`, and a thread of its own answers
 *    `release` with `released` (or `refused <why>`, `failed <why>`) and `restore`
 *    with `restored`. The first word it gets is `resident` or `release`: until
 *    then the process does not touch the GPU.
 *
 * Without VRAMLOCK_SWAP_SOCKET the library stays out of the way: every hook
 * passes straight to the driver.
 *
 * No CUDA headers are needed: the few driver types used are declared below.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#define EXPORT __attribute__((visibility("default")))

/* ---- the driver's types, as the CUDA headers declare them ------------------ */

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long CUmemGenericAllocationHandle;
typedef unsigned long long cuuint64_t;
typedef unsigned int cuuint32_t;
typedef void *CUcontext;
typedef void *CUstream;
typedef void *CUfunction;
typedef void *CUgraphExec;
typedef void *CUmemoryPool;
typedef void *CUarray;

typedef struct {
	int type; /* CU_MEM_LOCATION_TYPE_DEVICE */
	int id;
} CUmemLocation;

typedef struct {
	int type; /* CU_MEM_ALLOCATION_TYPE_PINNED */
	int requestedHandleTypes;
	CUmemLocation location;
	void *win32HandleMetaData;
	struct {
		unsigned char compressionType;
		unsigned char gpuDirectRDMACapable;
		unsigned short usage;
		unsigned char reserved[4];
	} allocFlags;
} CUmemAllocationProp;

typedef struct {
	CUmemLocation location;
	int flags; /* CU_MEM_ACCESS_FLAGS_PROT_READWRITE */
} CUmemAccessDesc;

typedef struct {
	char reserved[64];
} CUipcMemHandle;

enum {
	CUDA_SUCCESS = 0,
	CUDA_ERROR_INVALID_VALUE = 1,
	CUDA_ERROR_OUT_OF_MEMORY = 2,
	CUDA_ERROR_NOT_INITIALIZED = 3,
	CUDA_ERROR_INVALID_CONTEXT = 201,
	CUDA_ERROR_NOT_FOUND = 500,
	CU_MEM_ALLOCATION_TYPE_PINNED = 1,
	CU_MEM_LOCATION_TYPE_DEVICE = 1,
	CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3,
	CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0,
	CU_MEMHOSTALLOC_PORTABLE = 1,
	CU_STREAM_NON_BLOCKING = 1,
	CU_STREAM_CAPTURE_STATUS_NONE = 0,
	CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM = 2,
};

/* ---- diagnostics: on failure only, or with VRAMLOCK_SWAP_DEBUG=1 ----------- */

static int debug_on;

static void say(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void say(const char *fmt, ...)
{
	char line[512];
	int n = snprintf(line, sizeof line, "vramlock-swap: pid %d: ", (int)getpid());
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(line + n, sizeof line - (size_t)n - 1, fmt, ap);
	va_end(ap);
	size_t len = strlen(line);
	line[len++] = '\n';
	/* One write: lines of several processes must not interleave. */
	ssize_t w = write(2, line, len);
	(void)w;
}

#define TRACE(...)                      \
	do {                            \
		if (debug_on)           \
			say(__VA_ARGS__); \
	} while (0)

/* ---- the real dlsym and libcuda --------------------------------------------- */

typedef void *(*dlsym_fn)(void *, const char *);
static dlsym_fn real_dlsym;

static void find_real_dlsym(void)
{
	/* dlvsym is not ours, so it cannot loop back here. */
	static const char *versions[] = {"GLIBC_2.34", "GLIBC_2.2.5", "GLIBC_2.17"};
	for (size_t i = 0; i < sizeof versions / sizeof *versions && !real_dlsym; i++)
		real_dlsym = (dlsym_fn)dlvsym(RTLD_NEXT, "dlsym", versions[i]);
	if (!real_dlsym) {
		say("cannot find the C library's dlsym; giving up");
		abort();
	}
}

/* Every hooked entry point: the name the driver exports, our wrapper, and where
 * the real one is kept. Filled once libcuda is there (resolve). */
struct hook {
	const char *name;
	void *wrapper;
	void **real;
};

/* Set when the library is to act (VRAMLOCK_SWAP_SOCKET given). */
static int active;
static pthread_once_t resolve_once = PTHREAD_ONCE_INIT;
static __thread int resolving __attribute__((tls_model("initial-exec"))); /* dlopen of libcuda may look names up itself */
static void *libcuda;

/* ---- the gate ----------------------------------------------------------------
 * Open: a call increments `inflight`, sees the gate open and goes on, no lock.
 * A release sets `closed`, then waits for `inflight` to reach 0. Both sides use
 * sequentially consistent atomics, so either the caller sees `closed` (and steps
 * back out) or the releaser sees the caller in flight (and waits for it). */

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER; /* the gate's waits and every table */
static pthread_cond_t gate_cv = PTHREAD_COND_INITIALIZER;  /* the gate opened */
static pthread_cond_t drain_cv = PTHREAD_COND_INITIALIZER; /* the last call left */
static atomic_int closed;
static atomic_long inflight;

/* The fast paths are inlined into every hook; what waits is not. */
#define INLINE static inline __attribute__((always_inline))

static void wake_releaser(void)
{
	pthread_mutex_lock(&mu);
	pthread_cond_broadcast(&drain_cv);
	pthread_mutex_unlock(&mu);
}

INLINE void gate_leave(void)
{
	if (__builtin_expect(atomic_fetch_sub(&inflight, 1) == 1 && atomic_load(&closed), 0))
		wake_releaser();
}

static void wait_for_open_gate(void)
{
	gate_leave();
	pthread_mutex_lock(&mu);
	while (atomic_load(&closed))
		pthread_cond_wait(&gate_cv, &mu);
	pthread_mutex_unlock(&mu);
}

INLINE void gate_enter(void)
{
	for (;;) {
		atomic_fetch_add(&inflight, 1);
		if (__builtin_expect(!atomic_load(&closed), 1))
			return;
		wait_for_open_gate();
	}
}

/* With `mu` held: close the gate and wait for every call inside to leave. */
static void gate_close_locked(void)
{
	atomic_store(&closed, 1);
	while (atomic_load(&inflight) > 0)
		pthread_cond_wait(&drain_cv, &mu);
}

static void gate_open_locked(void)
{
	atomic_store(&closed, 0);
	pthread_cond_broadcast(&gate_cv);
}

/* ---- real driver entry points used by the library itself ------------------- */

#define REAL(ret, name, params) static ret(*real_##name) params
REAL(CUresult, cuInit, (unsigned));
REAL(CUresult, cuCtxGetCurrent, (CUcontext *));
REAL(CUresult, cuCtxSetCurrent, (CUcontext));
REAL(CUresult, cuCtxGetDevice, (CUdevice *));
REAL(CUresult, cuCtxSynchronize, (void));
REAL(CUresult, cuDeviceGetCount, (int *));
REAL(CUresult, cuDeviceCanAccessPeer, (int *, CUdevice, CUdevice));
REAL(CUresult, cuStreamCreate, (CUstream *, unsigned));
REAL(CUresult, cuStreamSynchronize, (CUstream));
REAL(CUresult, cuStreamIsCapturing, (CUstream, int *));
REAL(CUresult, cuMemHostAlloc, (void **, size_t, unsigned));
REAL(CUresult, cuMemFreeHost, (void *));
REAL(CUresult, cuMemAddressReserve, (CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long));
REAL(CUresult, cuMemAddressFree, (CUdeviceptr, size_t));
REAL(CUresult, cuMemGetAllocationGranularity, (size_t *, const CUmemAllocationProp *, int));
REAL(CUresult, cuMemCreate, (CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *, unsigned long long));
REAL(CUresult, cuMemRelease, (CUmemGenericAllocationHandle));
REAL(CUresult, cuMemMap, (CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long));
REAL(CUresult, cuMemUnmap, (CUdeviceptr, size_t));
REAL(CUresult, cuMemSetAccess, (CUdeviceptr, size_t, const CUmemAccessDesc *, size_t));
REAL(CUresult, cuMemcpyDtoHAsync_v2, (void *, CUdeviceptr, size_t, CUstream));
REAL(CUresult, cuMemcpyHtoDAsync_v2, (CUdeviceptr, const void *, size_t, CUstream));
REAL(CUresult, cuGetErrorString, (CUresult, const char **));

static const char *errname(CUresult r)
{
	const char *s = NULL;
	if (real_cuGetErrorString && real_cuGetErrorString(r, &s) == CUDA_SUCCESS && s)
		return s;
	return "unknown error";
}

/* ---- what the library keeps track of ---------------------------------------- */

/* One physical allocation: the unit that is copied out and released. */
struct phys {
	struct phys *next, *prev;
	size_t size;
	CUmemAllocationProp prop;
	CUcontext ctx;                      /* copies go through this context */
	CUmemGenericAllocationHandle real;  /* 0 while swapped out */
	unsigned long long handle;          /* the program's handle (its own VMM), else 0 */
	int refs;                           /* the program's references to `handle` */
	int maps;                           /* mappings of it */
	void *host;                         /* pinned copy, kept from one release to the next */
	CUdeviceptr copy_va;                /* during a swap: where it is (or was) mapped */
	size_t copy_len;
	CUdeviceptr temp_va;                /* a mapping made just for the copy, if any */
	int lost;                           /* released by a swap that then failed */
};

/* A mapping of (part of) a physical allocation at a virtual address. */
struct mapping {
	CUdeviceptr va;
	size_t size, offset;
	struct phys *phys;
	CUmemAccessDesc *access; /* as last set by the program (or by us) */
	size_t naccess;
};

/* A slab: one physical allocation shared by small allocations (256-byte units). */
#define SLAB_UNIT 256
struct slab {
	struct slab *next;
	CUdevice dev;
	CUdeviceptr base;
	size_t size, units, used;
	uint64_t *bits;
	struct phys *phys;
};

/* What cuMemAlloc handed out. */
struct region {
	CUdeviceptr ptr;
	size_t size;
	struct phys *phys; /* NULL for a slab's piece */
	struct slab *slab;
};

static struct phys *physes;
static struct mapping *maps;
static size_t nmaps, capmaps;
static struct region *regions;
static size_t nregions, capregions;
static struct slab *slabs;
static int released;
static char refused[160]; /* why this process cannot be swapped, once known */
static unsigned long long next_handle = 0x5a5a000000000001ULL;

#define MAX_DEVICES 64
static size_t granularity_of[MAX_DEVICES];

/* Streams capturing a CUDA graph now (a capture starts at the gate only). */
static atomic_int captures;

static void refuse(const char *why)
{
	pthread_mutex_lock(&mu);
	if (!refused[0]) {
		snprintf(refused, sizeof refused, "%s", why);
		TRACE("cannot be swapped from now on: %s", why);
	}
	pthread_mutex_unlock(&mu);
}

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
static size_t map_index(CUdeviceptr key)
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

static struct mapping *mapping_at(CUdeviceptr p)
{
	size_t i = map_index(p);
	if (i < nmaps && maps[i].va == p)
		return &maps[i];
	if (i > 0 && p < maps[i - 1].va + maps[i - 1].size)
		return &maps[i - 1];
	return NULL;
}

static int add_mapping(CUdeviceptr va, size_t size, size_t offset, struct phys *p)
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

static int set_access(struct mapping *m, const CUmemAccessDesc *desc, size_t n)
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

static struct phys *phys_by_handle(unsigned long long h)
{
	for (struct phys *p = physes; p; p = p->next)
		if (p->handle == h && h)
			return p;
	return NULL;
}

static struct phys *phys_new(size_t size, const CUmemAllocationProp *prop, CUcontext ctx)
{
	struct phys *p = calloc(1, sizeof *p);
	if (!p)
		return NULL;
	p->size = size;
	p->prop = *prop;
	p->ctx = ctx;
	p->next = physes;
	if (physes)
		physes->prev = p;
	physes = p;
	return p;
}

/* Frees what backs `p`, and `p`. Nothing may map it any more. */
static void phys_destroy(struct phys *p)
{
	if (p->real) {
		CUresult r = real_cuMemRelease(p->real);
		if (r)
			say("cuMemRelease: %s", errname(r));
	}
	if (p->host)
		real_cuMemFreeHost(p->host);
	if (p->prev)
		p->prev->next = p->next;
	else
		physes = p->next;
	if (p->next)
		p->next->prev = p->prev;
	free(p);
}

/* Drops the mappings inside [va, va + size) from the table (not from the driver). */
static void forget_mappings(CUdeviceptr va, size_t size)
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

static CUmemAccessDesc device_access(CUdevice dev)
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

static CUresult granularity(CUdevice dev, size_t *g)
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

static size_t round_up(size_t n, size_t to)
{
	return (n + to - 1) / to * to;
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

static int slab_find(struct slab *s, size_t n, size_t *at)
{
	for (size_t i = 0; i + n <= s->units;) {
		size_t j = i;
		while (j < i + n && !(s->bits[j / 64] >> (j % 64) & 1))
			j++;
		if (j == i + n) {
			*at = i;
			return 1;
		}
		i = j + 1;
	}
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
		s = calloc(1, sizeof *s);
		if (!s)
			return CUDA_ERROR_OUT_OF_MEMORY;
		s->dev = dev;
		s->size = 4 * g;
		s->units = s->size / SLAB_UNIT;
		s->bits = calloc((s->units + 63) / 64, sizeof *s->bits);
		CUresult r = s->bits ? map_new(s->size, dev, ctx, &s->base, &s->phys)
				     : CUDA_ERROR_OUT_OF_MEMORY;
		if (r) {
			free(s->bits);
			free(s);
			return r;
		}
		s->next = slabs;
		slabs = s;
		at = 0;
	}
	*dptr = s->base + at * SLAB_UNIT;
	if (add_region(*dptr, size, NULL, s))
		return CUDA_ERROR_OUT_OF_MEMORY;
	slab_mark(s, at, n, 1);
	return CUDA_SUCCESS;
}

static void slab_free(struct region *reg)
{
	struct slab *s = reg->slab;
	size_t n = (reg->size + SLAB_UNIT - 1) / SLAB_UNIT;
	slab_mark(s, (size_t)(reg->ptr - s->base) / SLAB_UNIT, n, 0);
	drop_region(reg);
	if (s->used)
		return;
	/* Empty: give it back, or a program that frees everything keeps its peak. */
	struct slab **pp = &slabs;
	while (*pp != s)
		pp = &(*pp)->next;
	*pp = s->next;
	unmap_own(s->base, s->phys);
	free(s->bits);
	free(s);
}

/* A cuMemAlloc in the current context. */
static CUresult own_alloc(CUdeviceptr *dptr, size_t size)
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
static int own_free(CUdeviceptr ptr)
{
	pthread_mutex_lock(&mu);
	size_t i = region_index(ptr);
	if (i >= nregions || regions[i].ptr != ptr) {
		pthread_mutex_unlock(&mu);
		return 0;
	}
	struct region *reg = &regions[i];
	if (reg->slab) {
		slab_free(reg);
	} else {
		struct phys *p = reg->phys;
		drop_region(reg);
		unmap_own(ptr, p);
	}
	pthread_mutex_unlock(&mu);
	return 1;
}

/* ---- swapping --------------------------------------------------------------- */

#define COPY_CHUNK (64ULL << 20)
#define COPY_STREAMS 2
#define MAX_CONTEXTS 16

/* Streams of our own in each context the copies go through, made once. */
static struct {
	CUcontext ctx;
	CUstream stream[COPY_STREAMS];
} copy_ctx[MAX_CONTEXTS];
static size_t ncopy_ctx;

static CUresult streams_of(CUcontext ctx, CUstream **out)
{
	for (size_t i = 0; i < ncopy_ctx; i++)
		if (copy_ctx[i].ctx == ctx) {
			*out = copy_ctx[i].stream;
			return CUDA_SUCCESS;
		}
	if (ncopy_ctx == MAX_CONTEXTS)
		return CUDA_ERROR_INVALID_CONTEXT;
	CUresult r = real_cuCtxSetCurrent(ctx);
	for (int k = 0; !r && k < COPY_STREAMS; k++)
		r = real_cuStreamCreate(&copy_ctx[ncopy_ctx].stream[k], CU_STREAM_NON_BLOCKING);
	if (r)
		return r;
	copy_ctx[ncopy_ctx].ctx = ctx;
	*out = copy_ctx[ncopy_ctx++].stream;
	return CUDA_SUCCESS;
}

/* Syncs every context that owns tracked memory, and every stream of ours. */
static CUresult sync_all(int ours_only)
{
	CUresult r = CUDA_SUCCESS;
	if (!ours_only) {
		CUcontext seen[MAX_CONTEXTS];
		size_t n = 0;
		for (struct phys *p = physes; p && !r; p = p->next) {
			size_t k = 0;
			while (k < n && seen[k] != p->ctx)
				k++;
			if (k < n)
				continue;
			if (n < MAX_CONTEXTS)
				seen[n++] = p->ctx;
			r = real_cuCtxSetCurrent(p->ctx);
			if (!r)
				r = real_cuCtxSynchronize();
		}
	}
	for (size_t i = 0; i < ncopy_ctx && !r; i++) {
		r = real_cuCtxSetCurrent(copy_ctx[i].ctx);
		for (int k = 0; !r && k < COPY_STREAMS; k++)
			r = real_cuStreamSynchronize(copy_ctx[i].stream[k]);
	}
	return r;
}

/* Big allocations in chunks on two streams: one stream alone leaves the link idle
 * between copies. `out`: device to host, else back. */
static CUresult copy_all(int out)
{
	size_t turn = 0;
	for (struct phys *p = physes; p; p = p->next) {
		if (!p->copy_len)
			continue;
		CUstream *streams;
		CUresult r = streams_of(p->ctx, &streams);
		if (!r)
			r = real_cuCtxSetCurrent(p->ctx);
		for (size_t off = 0; !r && off < p->copy_len; off += COPY_CHUNK) {
			size_t len = p->copy_len - off < COPY_CHUNK ? p->copy_len - off : COPY_CHUNK;
			CUstream s = streams[turn++ % COPY_STREAMS];
			char *host = (char *)p->host + off;
			r = out ? real_cuMemcpyDtoHAsync_v2(host, p->copy_va + off, len, s)
				: real_cuMemcpyHtoDAsync_v2(p->copy_va + off, host, len, s);
		}
		if (r)
			return r;
	}
	return sync_all(1);
}

/* Where to copy each physical allocation from (or to): a mapping of it, or a
 * mapping made for the purpose (a handle the program has not mapped). */
static CUresult find_copy_places(void)
{
	for (struct phys *p = physes; p; p = p->next)
		p->copy_va = p->copy_len = 0;
	for (size_t i = 0; i < nmaps; i++) {
		struct phys *p = maps[i].phys;
		if (!p->copy_len && maps[i].offset == 0) {
			p->copy_va = maps[i].va;
			p->copy_len = maps[i].size < p->size ? maps[i].size : p->size;
		}
	}
	for (struct phys *p = physes; p; p = p->next) {
		if (p->copy_len)
			continue;
		size_t g;
		CUresult r = granularity(p->prop.location.id, &g);
		if (!r)
			r = real_cuMemAddressReserve(&p->temp_va, p->size, g, 0, 0);
		if (r)
			return r;
		p->copy_va = p->temp_va;
		p->copy_len = p->size;
	}
	return CUDA_SUCCESS;
}

static CUresult map_temps(void)
{
	for (struct phys *p = physes; p; p = p->next) {
		if (!p->temp_va)
			continue;
		CUmemAccessDesc access = device_access(p->prop.location.id);
		CUresult r = real_cuMemMap(p->temp_va, p->size, 0, p->real, 0);
		if (!r)
			r = real_cuMemSetAccess(p->temp_va, p->size, &access, 1);
		if (r)
			return r;
	}
	return CUDA_SUCCESS;
}

static void drop_temps(void)
{
	for (struct phys *p = physes; p; p = p->next) {
		if (!p->temp_va)
			continue;
		real_cuMemUnmap(p->temp_va, p->size); /* fails harmlessly if never mapped */
		real_cuMemAddressFree(p->temp_va, p->size);
		p->temp_va = 0;
	}
}

/* Unmaps and releases every physical allocation (contents copied already). */
static CUresult let_go(void)
{
	for (size_t i = 0; i < nmaps; i++) {
		CUresult r = real_cuMemUnmap(maps[i].va, maps[i].size);
		if (r)
			return r;
	}
	for (struct phys *p = physes; p; p = p->next) {
		if (!p->real)
			continue;
		CUresult r = real_cuMemRelease(p->real);
		if (r)
			return r;
		p->real = 0;
	}
	return CUDA_SUCCESS;
}

/* New physical memory at the old addresses, as the program had set its access. */
static CUresult take_back(void)
{
	CUresult r = CUDA_SUCCESS;
	for (struct phys *p = physes; p && !r; p = p->next) {
		if (p->real)
			continue;
		r = real_cuCtxSetCurrent(p->ctx);
		if (!r)
			r = real_cuMemCreate(&p->real, p->size, &p->prop, 0);
		if (r)
			p->real = 0;
	}
	for (size_t i = 0; i < nmaps && !r; i++) {
		struct mapping *m = &maps[i];
		r = real_cuMemMap(m->va, m->size, m->offset, m->phys->real, 0);
		if (!r && m->naccess)
			r = real_cuMemSetAccess(m->va, m->size, m->access, m->naccess);
	}
	return r;
}

/* Back to where we were before a swap that failed half-way: whatever is still
 * mapped stays as it is, whatever was released comes back from its host copy
 * (complete: releasing starts only once every copy is done). */
static CUresult undo_release(void)
{
	CUresult r = CUDA_SUCCESS;
	for (struct phys *p = physes; p && !r; p = p->next) {
		p->lost = !p->real;
		if (p->lost)
			r = real_cuMemCreate(&p->real, p->size, &p->prop, 0);
		if (r)
			p->real = 0;
	}
	for (size_t i = 0; i < nmaps && !r; i++) {
		struct mapping *m = &maps[i];
		/* One still mapped fails here, harmlessly: it is what we want. */
		if (real_cuMemMap(m->va, m->size, m->offset, m->phys->real, 0) == CUDA_SUCCESS &&
		    m->naccess)
			r = real_cuMemSetAccess(m->va, m->size, m->access, m->naccess);
	}
	if (!r)
		r = find_copy_places();
	for (struct phys *p = physes; p; p = p->next)
		if (!p->lost)
			p->copy_len = 0; /* its memory never left */
	if (!r)
		r = map_temps();
	if (!r)
		r = copy_all(0);
	drop_temps();
	return r;
}

static double now_ms(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

/* Answers a `release`. With `mu` held and the gate open. */
static void do_release(char *answer, size_t len)
{
	if (released) {
		snprintf(answer, len, "released");
		return;
	}
	if (refused[0]) {
		snprintf(answer, len, "refused %s", refused);
		return;
	}
	double t0 = now_ms();
	gate_close_locked();
	if (atomic_load(&captures) > 0) {
		/* Synchronizing would invalidate the capture: the program's graph would be
		 * lost. Captures are short; the wrapper asks again. */
		gate_open_locked();
		snprintf(answer, len, "failed a CUDA graph is being captured");
		return;
	}
	size_t bytes = 0;
	const char *step = "cuMemHostAlloc";
	CUresult r = CUDA_SUCCESS;
	for (struct phys *p = physes; p && !r; p = p->next) {
		/* Pinning needs a context, even for memory every context may use. */
		if (!p->host && !(r = real_cuCtxSetCurrent(p->ctx)))
			r = real_cuMemHostAlloc(&p->host, p->size, CU_MEMHOSTALLOC_PORTABLE);
		if (r)
			p->host = NULL;
		bytes += p->size;
	}
	if (!r) {
		step = "cuCtxSynchronize";
		r = sync_all(0);
	}
	if (!r) {
		step = "finding the allocations";
		r = find_copy_places();
	}
	if (!r) {
		step = "mapping an unmapped allocation";
		r = map_temps();
	}
	if (!r) {
		step = "copying out";
		r = copy_all(1);
	}
	double t1 = now_ms();
	drop_temps();
	if (!r) {
		step = "releasing";
		r = let_go();
	}
	if (r) {
		say("release failed while %s: %s; the program keeps its GPU memory", step, errname(r));
		CUresult u = undo_release();
		if (u) {
			say("and could not be put back as it was (%s): GPU calls stay blocked", errname(u));
			released = 1; /* never let the program run on memory that is not there */
		} else {
			gate_open_locked();
		}
		snprintf(answer, len, "failed %s: %s", step, errname(r));
		return;
	}
	released = 1;
	real_cuCtxSetCurrent(NULL);
	TRACE("released %zu bytes: copy %.1f ms, release %.1f ms", bytes, t1 - t0, now_ms() - t1);
	snprintf(answer, len, "released");
}

/* Answers a `restore`. With `mu` held and the gate closed. */
static void do_restore(char *answer, size_t len)
{
	if (!released) {
		snprintf(answer, len, "restored");
		return;
	}
	double t0 = now_ms();
	const char *step = "creating and mapping";
	CUresult r = take_back();
	if (!r) {
		step = "finding the allocations";
		r = find_copy_places();
	}
	if (!r) {
		step = "mapping an unmapped allocation";
		r = map_temps();
	}
	if (!r) {
		step = "copying back";
		r = copy_all(0);
	}
	drop_temps();
	if (r) {
		/* The memory is not all there: the program must not run. Give back what was
		 * taken so a later restore starts clean. */
		say("restore failed while %s: %s; GPU calls stay blocked", step, errname(r));
		for (size_t i = 0; i < nmaps; i++)
			real_cuMemUnmap(maps[i].va, maps[i].size);
		for (struct phys *p = physes; p; p = p->next)
			if (p->real && real_cuMemRelease(p->real) == CUDA_SUCCESS)
				p->real = 0;
		snprintf(answer, len, "failed %s: %s", step, errname(r));
		return;
	}
	real_cuCtxSetCurrent(NULL);
	released = 0;
	gate_open_locked();
	TRACE("restored in %.1f ms", now_ms() - t0);
	snprintf(answer, len, "restored");
}

/* ---- control ------------------------------------------------------------------ */

static int control_fd = -1;
static int greeted; /* the wrapper said where we stand */
static pthread_cond_t greet_cv = PTHREAD_COND_INITIALIZER;
static pthread_once_t connect_once = PTHREAD_ONCE_INIT;

static int send_line(const char *line)
{
	char buf[256];
	int n = snprintf(buf, sizeof buf, "%s\n", line);
	if (n < 0 || (size_t)n >= sizeof buf)
		n = (int)sizeof buf - 1, buf[n - 1] = '\n';
	for (int off = 0; off < n;) {
		ssize_t w = send(control_fd, buf + off, (size_t)(n - off), MSG_NOSIGNAL);
		if (w < 0 && errno == EINTR)
			continue;
		if (w <= 0)
			return -1;
		off += (int)w;
	}
	return 0;
}

/* Reads a small /proc file whole; its length, or -1. */
static ssize_t read_proc(const char *path, char *buf, size_t size)
{
	int fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		return -1;
	ssize_t n = read(fd, buf, size - 1);
	close(fd);
	if (n >= 0)
		buf[n] = 0;
	return n;
}

/* `s` as a JSON string (bytes >= 0x80 as Latin-1: the record stays valid UTF-8). */
static void json_string(FILE *f, const char *s, size_t len)
{
	fputc('"', f);
	for (size_t i = 0; i < len; i++) {
		unsigned char c = (unsigned char)s[i];
		if (c == '"' || c == '\\')
			fprintf(f, "\\%c", c);
		else if (c < 0x20 || c >= 0x7f)
			fprintf(f, "\\u%04x", c);
		else
			fputc(c, f);
	}
	fputc('"', f);
}

/* A process whose wrapper died while it was released holds no lock, so `vramlock
 * who` would not see it: it writes a member record of its own into the arena
 * (the format vramlock's records use), saying it is released and blocked. */
static void write_orphan_record(void)
{
	const char *arena = getenv("VRAMLOCK_ARENA");
	char stat_line[1024], comm[64], cmdline[4096], name[64], tmp[96];
	ssize_t ncmd;
	unsigned long long start = 0;
	if (!arena || !*arena || read_proc("/proc/self/stat", stat_line, sizeof stat_line) <= 0 ||
	    read_proc("/proc/self/comm", comm, sizeof comm) <= 0 ||
	    (ncmd = read_proc("/proc/self/cmdline", cmdline, sizeof cmdline)) <= 0)
		return;
	/* Field 22, counting from the one after the command name's closing parenthesis (3). */
	char *field = strrchr(stat_line, ')');
	for (int k = 2; field && k < 22; k++)
		field = strchr(field + 1, ' ');
	if (!field || sscanf(field + 1, "%llu", &start) != 1)
		return;
	comm[strcspn(comm, "\n")] = 0;
	int dir = open(arena, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
	int members = dir < 0 ? -1 : openat(dir, "members", O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
	if (dir >= 0)
		close(dir);
	if (members < 0)
		return;
	int pid = (int)getpid();
	snprintf(name, sizeof name, "%d-%llu.json", pid, start);
	snprintf(tmp, sizeof tmp, ".%d-%llu.swap.tmp", pid, start);
	int fd = openat(members, tmp, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
	FILE *f = fd < 0 ? NULL : fdopen(fd, "w");
	if (!f) {
		if (fd >= 0)
			close(fd);
		close(members);
		return;
	}
	struct timespec now;
	clock_gettime(CLOCK_REALTIME, &now);
	fprintf(f, "{\"version\": 1, \"pid\": %d, \"starttime\": %llu, \"uid\": %u, \"name\": ",
		pid, start, (unsigned)geteuid());
	json_string(f, comm, strlen(comm));
	fputs(", \"command\": [", f);
	for (char *arg = cmdline; arg < cmdline + ncmd; arg += strlen(arg) + 1) {
		if (arg > cmdline)
			fputs(", ", f);
		json_string(f, arg, strlen(arg));
	}
	fprintf(f, "], \"strategy\": \"swap\", \"state\": \"released\", \"since\": %.3f, "
		   "\"note\": \"its vramlock run is gone: blocked until ended\"}\n",
		now.tv_sec + now.tv_nsec / 1e9);
	int bad = ferror(f);
	if (fclose(f) || bad || renameat(members, tmp, members, name))
		unlinkat(members, tmp, 0);
	close(members);
}

/* The wrapper is gone: nobody can tell us the token is ours again. Gone before it
 * said where the command stands, it may have been released: the safe side is the
 * same as released (nothing is on the GPU yet). */
static void orphaned(void)
{
	pthread_mutex_lock(&mu);
	if (!greeted) {
		atomic_store(&closed, 1);
		released = 1;
	}
	greeted = 1;
	pthread_cond_broadcast(&greet_cv);
	if (released) {
		say("vramlock run went away while this process's GPU memory was released:"
		    " its GPU calls stay blocked for good (end it)");
		write_orphan_record();
	}
	pthread_mutex_unlock(&mu);
}

static void handle(const char *word)
{
	char answer[256] = "";
	TRACE("vramlock run says %s", word);
	pthread_mutex_lock(&mu);
	if (!strcmp(word, "release"))
		do_release(answer, sizeof answer);
	else if (!strcmp(word, "restore"))
		do_restore(answer, sizeof answer);
	/* `resident` asks nothing: the first word only says the gate may stay open. */
	greeted = 1;
	pthread_cond_broadcast(&greet_cv);
	pthread_mutex_unlock(&mu);
	if (answer[0] && send_line(answer))
		TRACE("cannot answer %s: %s", word, strerror(errno));
}

static void *control_thread(void *arg)
{
	(void)arg;
	char buf[512];
	size_t have = 0;
	for (;;) {
		ssize_t n = recv(control_fd, buf + have, sizeof buf - 1 - have, 0);
		if (n < 0 && errno == EINTR)
			continue;
		if (n <= 0)
			break;
		have += (size_t)n;
		char *start = buf, *nl;
		while ((nl = memchr(start, '\n', (size_t)(buf + have - start)))) {
			*nl = 0;
			handle(start);
			start = nl + 1;
		}
		have = (size_t)(buf + have - start);
		memmove(buf, start, have);
		if (have == sizeof buf - 1)
			have = 0; /* a line that long is no word of ours */
	}
	orphaned();
	return NULL;
}

/* Connects to the wrapper and waits for its first word. Whatever goes wrong, the
 * process cannot know that its command holds the token: the gate stays closed. */
static void connect_control(void)
{
	const char *path = getenv("VRAMLOCK_SWAP_SOCKET");
	struct sockaddr_un addr = {.sun_family = AF_UNIX};
	pthread_t t;
	pthread_attr_t attr;
	const char *why = NULL;
	char hello[64];

	control_fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
	if (strlen(path) >= sizeof addr.sun_path)
		why = "the socket path is too long";
	else if (control_fd < 0)
		why = strerror(errno);
	if (!why) {
		memcpy(addr.sun_path, path, strlen(path) + 1);
		if (connect(control_fd, (struct sockaddr *)&addr, sizeof addr))
			why = strerror(errno);
	}
	snprintf(hello, sizeof hello, "hello %d", (int)getpid());
	if (!why && send_line(hello))
		why = strerror(errno);
	if (!why) {
		pthread_attr_init(&attr);
		pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
		if (pthread_create(&t, &attr, control_thread, NULL))
			why = "cannot start the control thread";
		pthread_attr_destroy(&attr);
	}
	pthread_mutex_lock(&mu);
	if (why) {
		say("cannot reach vramlock run at %s (%s): GPU calls stay blocked", path, why);
		atomic_store(&closed, 1);
		greeted = 1;
	}
	while (!greeted)
		pthread_cond_wait(&greet_cv, &mu);
	pthread_mutex_unlock(&mu);
}

/* A process forked from one that uses CUDA cannot use CUDA itself, and must not
 * answer for its parent. */
static void after_fork_child(void)
{
	if (control_fd >= 0)
		close(control_fd);
	control_fd = -1;
	active = 0;
}

/* Once, from our constructor or from the first hook called, whichever comes first:
 * another library's constructor may look the driver up before ours has run. */
static pthread_once_t setup_once = PTHREAD_ONCE_INIT;

static void setup(void)
{
	const char *dbg = getenv("VRAMLOCK_SWAP_DEBUG");
	const char *sock = getenv("VRAMLOCK_SWAP_SOCKET");
	debug_on = dbg && *dbg && strcmp(dbg, "0");
	active = sock && *sock;
	find_real_dlsym();
	pthread_atfork(NULL, NULL, after_fork_child);
}

__attribute__((constructor)) static void init(void)
{
	pthread_once(&setup_once, setup);
}

/* ---- the hooks ------------------------------------------------------------------ */

static void resolve(void);

/* Every hook asks first: one load once set up (a launch-bound program calls hooks
 * some hundred thousand times a second). */
static atomic_int is_ready;

static int get_ready(void)
{
	pthread_once(&setup_once, setup);
	pthread_once(&resolve_once, resolve);
	if (libcuda)
		atomic_store_explicit(&is_ready, 1, memory_order_release);
	return libcuda != NULL;
}

INLINE int ready(void)
{
	return __builtin_expect(atomic_load_explicit(&is_ready, memory_order_acquire), 1) ||
	       get_ready();
}

/* Calls that touch device memory: through the gate, nothing else. */
#define P_LAUNCH CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz, unsigned sm, CUstream s, void **kp, void **ex
#define A_LAUNCH f, gx, gy, gz, bx, by, bz, sm, s, kp, ex
#define P_COOP CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz, unsigned sm, CUstream s, void **kp
#define A_COOP f, gx, gy, gz, bx, by, bz, sm, s, kp
#define P_LAUNCHEX const void *cfg, CUfunction f, void **kp, void **ex
#define A_LAUNCHEX cfg, f, kp, ex
#define P_GRAPH CUgraphExec g, CUstream s
#define A_GRAPH g, s
#define P_CPY CUdeviceptr d, CUdeviceptr src, size_t n
#define A_CPY d, src, n
#define P_CPYA CUdeviceptr d, CUdeviceptr src, size_t n, CUstream s
#define A_CPYA d, src, n, s
#define P_PEER CUdeviceptr d, CUcontext dc, CUdeviceptr src, CUcontext sc, size_t n
#define A_PEER d, dc, src, sc, n
#define P_PEERA CUdeviceptr d, CUcontext dc, CUdeviceptr src, CUcontext sc, size_t n, CUstream s
#define A_PEERA d, dc, src, sc, n, s
#define P_HTOD CUdeviceptr d, const void *h, size_t n
#define A_HTOD d, h, n
#define P_HTODA CUdeviceptr d, const void *h, size_t n, CUstream s
#define A_HTODA d, h, n, s
#define P_DTOH void *h, CUdeviceptr src, size_t n
#define A_DTOH h, src, n
#define P_DTOHA void *h, CUdeviceptr src, size_t n, CUstream s
#define A_DTOHA h, src, n, s
#define P_DESC const void *desc
#define A_DESC desc
#define P_DESCA const void *desc, CUstream s
#define A_DESCA desc, s
#define P_SET(T) CUdeviceptr d, T v, size_t n
#define A_SET d, v, n
#define P_SETA(T) CUdeviceptr d, T v, size_t n, CUstream s
#define A_SETA d, v, n, s
#define P_SET2(T) CUdeviceptr d, size_t pitch, T v, size_t w, size_t h
#define A_SET2 d, pitch, v, w, h
#define P_SET2A(T) CUdeviceptr d, size_t pitch, T v, size_t w, size_t h, CUstream s
#define A_SET2A d, pitch, v, w, h, s
#define P_VAL(T) CUstream s, CUdeviceptr d, T v, unsigned fl
#define A_VAL s, d, v, fl
#define P_BATCHCPY CUdeviceptr *ds, CUdeviceptr *ss, size_t *ns, size_t count, void *at, size_t *ai, size_t nat
#define A_BATCHCPY ds, ss, ns, count, at, ai, nat
#define P_LIBLOAD(code) void **lib, code, void *jo, void **jv, unsigned nj, void *lo, void **lv, unsigned nl
#define A_LIBLOAD lib, code, jo, jv, nj, lo, lv, nl
#define P_BATCH CUstream s, unsigned count, void *ops, unsigned fl
#define A_BATCH s, count, ops, fl

#define GATED(X)                                                       \
	X(cuLaunchKernel, (P_LAUNCH), (A_LAUNCH))                      \
	X(cuLaunchKernel_ptsz, (P_LAUNCH), (A_LAUNCH))                 \
	X(cuLaunchKernelEx, (P_LAUNCHEX), (A_LAUNCHEX))                \
	X(cuLaunchKernelEx_ptsz, (P_LAUNCHEX), (A_LAUNCHEX))           \
	X(cuLaunchCooperativeKernel, (P_COOP), (A_COOP))               \
	X(cuLaunchCooperativeKernel_ptsz, (P_COOP), (A_COOP))          \
	X(cuLaunchCooperativeKernelMultiDevice,                        \
	  (void *l, unsigned nd, unsigned fl), (l, nd, fl))            \
	X(cuGraphLaunch, (P_GRAPH), (A_GRAPH))                         \
	X(cuGraphLaunch_ptsz, (P_GRAPH), (A_GRAPH))                    \
	X(cuGraphUpload, (P_GRAPH), (A_GRAPH))                         \
	X(cuGraphUpload_ptsz, (P_GRAPH), (A_GRAPH))                    \
	X(cuMemcpy, (P_CPY), (A_CPY))                                  \
	X(cuMemcpy_ptds, (P_CPY), (A_CPY))                             \
	X(cuMemcpyAsync, (P_CPYA), (A_CPYA))                           \
	X(cuMemcpyAsync_ptsz, (P_CPYA), (A_CPYA))                      \
	X(cuMemcpyPeer, (P_PEER), (A_PEER))                            \
	X(cuMemcpyPeer_ptds, (P_PEER), (A_PEER))                       \
	X(cuMemcpyPeerAsync, (P_PEERA), (A_PEERA))                     \
	X(cuMemcpyPeerAsync_ptsz, (P_PEERA), (A_PEERA))                \
	X(cuMemcpyHtoD_v2, (P_HTOD), (A_HTOD))                         \
	X(cuMemcpyHtoD_v2_ptds, (P_HTOD), (A_HTOD))                    \
	X(cuMemcpyDtoH_v2, (P_DTOH), (A_DTOH))                         \
	X(cuMemcpyDtoH_v2_ptds, (P_DTOH), (A_DTOH))                    \
	X(cuMemcpyDtoD_v2, (P_CPY), (A_CPY))                           \
	X(cuMemcpyDtoD_v2_ptds, (P_CPY), (A_CPY))                      \
	X(cuMemcpyHtoDAsync_v2, (P_HTODA), (A_HTODA))                  \
	X(cuMemcpyHtoDAsync_v2_ptsz, (P_HTODA), (A_HTODA))             \
	X(cuMemcpyDtoHAsync_v2, (P_DTOHA), (A_DTOHA))                  \
	X(cuMemcpyDtoHAsync_v2_ptsz, (P_DTOHA), (A_DTOHA))             \
	X(cuMemcpyDtoDAsync_v2, (P_CPYA), (A_CPYA))                    \
	X(cuMemcpyDtoDAsync_v2_ptsz, (P_CPYA), (A_CPYA))               \
	X(cuMemcpy2D_v2, (P_DESC), (A_DESC))                           \
	X(cuMemcpy2D_v2_ptds, (P_DESC), (A_DESC))                      \
	X(cuMemcpy2DUnaligned_v2, (P_DESC), (A_DESC))                  \
	X(cuMemcpy2DUnaligned_v2_ptds, (P_DESC), (A_DESC))             \
	X(cuMemcpy2DAsync_v2, (P_DESCA), (A_DESCA))                    \
	X(cuMemcpy2DAsync_v2_ptsz, (P_DESCA), (A_DESCA))               \
	X(cuMemcpy3D_v2, (P_DESC), (A_DESC))                           \
	X(cuMemcpy3D_v2_ptds, (P_DESC), (A_DESC))                      \
	X(cuMemcpy3DAsync_v2, (P_DESCA), (A_DESCA))                    \
	X(cuMemcpy3DAsync_v2_ptsz, (P_DESCA), (A_DESCA))               \
	X(cuMemcpy3DPeer, (P_DESC), (A_DESC))                          \
	X(cuMemcpy3DPeer_ptds, (P_DESC), (A_DESC))                     \
	X(cuMemcpy3DPeerAsync, (P_DESCA), (A_DESCA))                   \
	X(cuMemcpy3DPeerAsync_ptsz, (P_DESCA), (A_DESCA))              \
	X(cuMemsetD8_v2, (P_SET(unsigned char)), (A_SET))              \
	X(cuMemsetD8_v2_ptds, (P_SET(unsigned char)), (A_SET))         \
	X(cuMemsetD16_v2, (P_SET(unsigned short)), (A_SET))            \
	X(cuMemsetD16_v2_ptds, (P_SET(unsigned short)), (A_SET))       \
	X(cuMemsetD32_v2, (P_SET(unsigned int)), (A_SET))              \
	X(cuMemsetD32_v2_ptds, (P_SET(unsigned int)), (A_SET))         \
	X(cuMemsetD8Async, (P_SETA(unsigned char)), (A_SETA))          \
	X(cuMemsetD8Async_ptsz, (P_SETA(unsigned char)), (A_SETA))     \
	X(cuMemsetD16Async, (P_SETA(unsigned short)), (A_SETA))        \
	X(cuMemsetD16Async_ptsz, (P_SETA(unsigned short)), (A_SETA))   \
	X(cuMemsetD32Async, (P_SETA(unsigned int)), (A_SETA))          \
	X(cuMemsetD32Async_ptsz, (P_SETA(unsigned int)), (A_SETA))     \
	X(cuMemsetD2D8_v2, (P_SET2(unsigned char)), (A_SET2))          \
	X(cuMemsetD2D8_v2_ptds, (P_SET2(unsigned char)), (A_SET2))     \
	X(cuMemsetD2D16_v2, (P_SET2(unsigned short)), (A_SET2))        \
	X(cuMemsetD2D16_v2_ptds, (P_SET2(unsigned short)), (A_SET2))   \
	X(cuMemsetD2D32_v2, (P_SET2(unsigned int)), (A_SET2))          \
	X(cuMemsetD2D32_v2_ptds, (P_SET2(unsigned int)), (A_SET2))     \
	X(cuMemsetD2D8Async, (P_SET2A(unsigned char)), (A_SET2A))      \
	X(cuMemsetD2D8Async_ptsz, (P_SET2A(unsigned char)), (A_SET2A)) \
	X(cuMemsetD2D16Async, (P_SET2A(unsigned short)), (A_SET2A))    \
	X(cuMemsetD2D16Async_ptsz, (P_SET2A(unsigned short)), (A_SET2A)) \
	X(cuMemsetD2D32Async, (P_SET2A(unsigned int)), (A_SET2A))      \
	X(cuMemsetD2D32Async_ptsz, (P_SET2A(unsigned int)), (A_SET2A)) \
	X(cuStreamWriteValue32, (P_VAL(cuuint32_t)), (A_VAL))          \
	X(cuStreamWriteValue32_v2, (P_VAL(cuuint32_t)), (A_VAL))       \
	X(cuStreamWriteValue32_ptsz, (P_VAL(cuuint32_t)), (A_VAL))     \
	X(cuStreamWriteValue32_v2_ptsz, (P_VAL(cuuint32_t)), (A_VAL))  \
	X(cuStreamWriteValue64, (P_VAL(cuuint64_t)), (A_VAL))          \
	X(cuStreamWriteValue64_v2, (P_VAL(cuuint64_t)), (A_VAL))       \
	X(cuStreamWriteValue64_ptsz, (P_VAL(cuuint64_t)), (A_VAL))     \
	X(cuStreamWriteValue64_v2_ptsz, (P_VAL(cuuint64_t)), (A_VAL))  \
	X(cuStreamWaitValue32, (P_VAL(cuuint32_t)), (A_VAL))           \
	X(cuStreamWaitValue32_v2, (P_VAL(cuuint32_t)), (A_VAL))        \
	X(cuStreamWaitValue32_ptsz, (P_VAL(cuuint32_t)), (A_VAL))      \
	X(cuStreamWaitValue32_v2_ptsz, (P_VAL(cuuint32_t)), (A_VAL))   \
	X(cuStreamWaitValue64, (P_VAL(cuuint64_t)), (A_VAL))           \
	X(cuStreamWaitValue64_v2, (P_VAL(cuuint64_t)), (A_VAL))        \
	X(cuStreamWaitValue64_ptsz, (P_VAL(cuuint64_t)), (A_VAL))      \
	X(cuStreamWaitValue64_v2_ptsz, (P_VAL(cuuint64_t)), (A_VAL))   \
	X(cuStreamBatchMemOp, (P_BATCH), (A_BATCH))                    \
	X(cuStreamBatchMemOp_v2, (P_BATCH), (A_BATCH))                 \
	X(cuStreamBatchMemOp_ptsz, (P_BATCH), (A_BATCH))               \
	X(cuStreamBatchMemOp_v2_ptsz, (P_BATCH), (A_BATCH))            \
	X(cuMemcpyBatchAsync, (P_BATCHCPY, size_t *fail, CUstream s),                   \
	  (A_BATCHCPY, fail, s))                                                         \
	X(cuMemcpyBatchAsync_ptsz, (P_BATCHCPY, size_t *fail, CUstream s),              \
	  (A_BATCHCPY, fail, s))                                                         \
	X(cuMemcpyBatchAsync_v2, (P_BATCHCPY, CUstream s), (A_BATCHCPY, s))              \
	X(cuMemcpyBatchAsync_v2_ptsz, (P_BATCHCPY, CUstream s), (A_BATCHCPY, s))         \
	X(cuMemcpy3DBatchAsync, (size_t n, void *ops, size_t *fail, cuuint64_t fl, CUstream s), \
	  (n, ops, fail, fl, s))                                                         \
	X(cuMemcpy3DBatchAsync_ptsz,                                                     \
	  (size_t n, void *ops, size_t *fail, cuuint64_t fl, CUstream s), (n, ops, fail, fl, s)) \
	X(cuMemcpy3DBatchAsync_v2, (size_t n, void *ops, cuuint64_t fl, CUstream s),    \
	  (n, ops, fl, s))                                                               \
	X(cuMemcpy3DBatchAsync_v2_ptsz, (size_t n, void *ops, cuuint64_t fl, CUstream s), \
	  (n, ops, fl, s))                                                               \
	/* A context or a module takes GPU memory: not while another member holds it. */ \
	X(cuDevicePrimaryCtxRetain, (CUcontext * c, CUdevice d), (c, d))                 \
	X(cuCtxCreate_v2, (CUcontext * c, unsigned fl, CUdevice d), (c, fl, d))          \
	X(cuCtxCreate_v3, (CUcontext * c, void *aff, int n, unsigned fl, CUdevice d),    \
	  (c, aff, n, fl, d))                                                            \
	X(cuCtxCreate_v4, (CUcontext * c, void *params, unsigned fl, CUdevice d),        \
	  (c, params, fl, d))                                                            \
	X(cuModuleLoad, (void **m, const char *path), (m, path))                         \
	X(cuModuleLoadData, (void **m, const void *image), (m, image))                   \
	X(cuModuleLoadDataEx, (void **m, const void *image, unsigned n, void *opts, void **vals), \
	  (m, image, n, opts, vals))                                                     \
	X(cuModuleLoadFatBinary, (void **m, const void *fatbin), (m, fatbin))            \
	X(cuLibraryLoadData, (P_LIBLOAD(const void *code)), (A_LIBLOAD))                 \
	X(cuLibraryLoadFromFile, (P_LIBLOAD(const char *code)), (A_LIBLOAD))             \
	X(cuPointerGetAttribute, (void *data, int attr, CUdeviceptr p), (data, attr, p)) \
	X(cuPointerGetAttributes, (unsigned n, int *attrs, void **data, CUdeviceptr p),  \
	  (n, attrs, data, p))

#define DEFINE_GATED(name, params, args)                     \
	static CUresult(*real_##name) params;                \
	EXPORT CUresult name params                          \
	{                                                    \
		if (!ready() || !real_##name)                \
			return CUDA_ERROR_NOT_FOUND;         \
		gate_enter();                                \
		CUresult r = real_##name args;               \
		gate_leave();                                \
		return r;                                    \
	}
GATED(DEFINE_GATED)

/* The legacy IPC API does not take memory the virtual memory management API made,
 * which all of a swapped program's is: the program gets the driver's error, and the
 * user a line saying why and what to do instead. */
static void refusing_failed(const char *name, CUresult r)
{
	if (!strcmp(name, "cuIpcGetMemHandle"))
		say("%s: %s: legacy CUDA IPC cannot share memory that --release swap manages;"
		    " run this command under --release checkpoint (or none) instead",
		    name, errname(r));
}

/* What cannot be moved: the call goes through, and from then on a release is
 * refused (the program keeps the GPU and runs on). */
#define REFUSING(X)                                                                        \
	X(cuMemAllocManaged, "it uses managed memory", (CUdeviceptr * p, size_t n, unsigned fl), \
	  (p, n, fl))                                                                      \
	X(cuIpcGetMemHandle, "it shares GPU memory with another process (CUDA IPC)",        \
	  (CUipcMemHandle * h, CUdeviceptr p), (h, p))                                     \
	X(cuIpcOpenMemHandle, "it maps another process's GPU memory (CUDA IPC)",            \
	  (CUdeviceptr * p, CUipcMemHandle h, unsigned fl), (p, h, fl))                    \
	X(cuIpcOpenMemHandle_v2, "it maps another process's GPU memory (CUDA IPC)",         \
	  (CUdeviceptr * p, CUipcMemHandle h, unsigned fl), (p, h, fl))                    \
	X(cuMemImportFromShareableHandle, "it maps GPU memory shared by another process",    \
	  (CUmemGenericAllocationHandle * h, void *os, int type), (h, os, type))           \
	X(cuMemPoolExportPointer, "it shares GPU memory with another process (memory pool)", \
	  (void *out, CUdeviceptr p), (out, p))                                            \
	X(cuMemPoolImportPointer, "it maps another process's GPU memory (memory pool)",     \
	  (CUdeviceptr * p, CUmemoryPool pool, void *data), (p, pool, data))               \
	X(cuMemPoolExportToShareableHandle, "it shares a memory pool with another process",  \
	  (void *out, CUmemoryPool pool, int type, unsigned long long fl), (out, pool, type, fl)) \
	X(cuMemPoolImportFromShareableHandle, "it maps another process's memory pool",      \
	  (CUmemoryPool * pool, void *h, int type, unsigned long long fl), (pool, h, type, fl)) \
	X(cuArrayCreate_v2, "it uses CUDA arrays", (CUarray * a, const void *d), (a, d))    \
	X(cuArray3DCreate_v2, "it uses CUDA arrays", (CUarray * a, const void *d), (a, d))  \
	X(cuMipmappedArrayCreate, "it uses CUDA arrays",                                    \
	  (void **a, const void *d, unsigned levels), (a, d, levels))                      \
	X(cuGraphAddMemAllocNode, "its CUDA graphs allocate memory",                        \
	  (void **node, void *graph, const void *deps, size_t n, void *params),            \
	  (node, graph, deps, n, params))                                                  \
	X(cuMemMapArrayAsync, "it maps sparse CUDA arrays",                                 \
	  (void *list, unsigned n, CUstream s), (list, n, s))                              \
	X(cuMemMapArrayAsync_ptsz, "it maps sparse CUDA arrays",                            \
	  (void *list, unsigned n, CUstream s), (list, n, s))

#define DEFINE_REFUSING(name, why, params, args)              \
	static CUresult(*real_##name) params;                 \
	EXPORT CUresult name params                           \
	{                                                     \
		if (!ready() || !real_##name)                 \
			return CUDA_ERROR_NOT_FOUND;          \
		gate_enter();                                 \
		CUresult r = real_##name args;                \
		gate_leave();                                 \
		if (r == CUDA_SUCCESS && active)              \
			refuse(why);                          \
		else if (active)                              \
			refusing_failed(#name, r);            \
		return r;                                     \
	}
REFUSING(DEFINE_REFUSING)

/* Allocations: ours, through the gate (an allocation while released waits). */

#define REAL_OF(name, params) static CUresult(*real_##name) params

REAL_OF(cuMemAlloc_v2, (CUdeviceptr *, size_t));
EXPORT CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t size)
{
	if (!ready())
		return CUDA_ERROR_NOT_INITIALIZED;
	if (!active)
		return real_cuMemAlloc_v2(dptr, size);
	gate_enter();
	CUresult r = own_alloc(dptr, size);
	gate_leave();
	return r;
}

REAL_OF(cuMemAllocPitch_v2, (CUdeviceptr *, size_t *, size_t, size_t, unsigned));
EXPORT CUresult cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pitch, size_t width, size_t height,
				   unsigned elem)
{
	if (!ready())
		return CUDA_ERROR_NOT_INITIALIZED;
	if (!active)
		return real_cuMemAllocPitch_v2(dptr, pitch, width, height, elem);
	if (!pitch || !width || !height || (elem != 4 && elem != 8 && elem != 16))
		return CUDA_ERROR_INVALID_VALUE;
	/* The driver pads rows for texture access; 512 is what it uses on current GPUs. */
	*pitch = round_up(width, 512);
	gate_enter();
	CUresult r = own_alloc(dptr, *pitch * height);
	gate_leave();
	return r;
}

REAL_OF(cuMemFree_v2, (CUdeviceptr));
EXPORT CUresult cuMemFree_v2(CUdeviceptr ptr)
{
	if (!ready())
		return CUDA_ERROR_NOT_INITIALIZED;
	if (!active)
		return real_cuMemFree_v2(ptr);
	gate_enter();
	/* cudaFree waits for the device; a freed range may be handed out again at once.
	 * (A thread without a context has nothing to wait for.) */
	if (ptr)
		real_cuCtxSynchronize();
	CUresult r = own_free(ptr) ? CUDA_SUCCESS : real_cuMemFree_v2(ptr);
	gate_leave();
	return r;
}

static int capturing(CUstream s)
{
	int status = CU_STREAM_CAPTURE_STATUS_NONE;
	return real_cuStreamIsCapturing && real_cuStreamIsCapturing(s, &status) == CUDA_SUCCESS &&
	       status != CU_STREAM_CAPTURE_STATUS_NONE;
}

/* Stream-ordered allocations are made at once (valid for the stream from then on);
 * inside graph capture they stay the graph's, and cannot be moved. */
static CUresult alloc_async(CUdeviceptr *dptr, size_t size, CUstream s,
			    CUresult (*real)(CUdeviceptr *, size_t, CUstream))
{
	if (capturing(s)) {
		CUresult r = real(dptr, size, s);
		if (r == CUDA_SUCCESS)
			refuse("its CUDA graphs allocate memory");
		return r;
	}
	return own_alloc(dptr, size);
}

static CUresult free_async(CUdeviceptr ptr, CUstream s, CUresult (*real)(CUdeviceptr, CUstream))
{
	pthread_mutex_lock(&mu);
	size_t i = region_index(ptr);
	int ours = i < nregions && regions[i].ptr == ptr;
	pthread_mutex_unlock(&mu);
	if (!ours)
		return real(ptr, s);
	if (capturing(s)) {
		refuse("its CUDA graphs free memory");
		return CUDA_SUCCESS; /* kept: the graph may free it at any replay */
	}
	CUresult r = real_cuStreamSynchronize(s);
	if (!r)
		own_free(ptr);
	return r;
}

#define ASYNC_ALLOC(name)                                                         \
	REAL_OF(name, (CUdeviceptr *, size_t, CUstream));                         \
	EXPORT CUresult name(CUdeviceptr *dptr, size_t size, CUstream s)          \
	{                                                                         \
		if (!ready() || !real_##name)                                     \
			return CUDA_ERROR_NOT_FOUND;                              \
		if (!active)                                                      \
			return real_##name(dptr, size, s);                        \
		gate_enter();                                                     \
		CUresult r = alloc_async(dptr, size, s, real_##name);             \
		gate_leave();                                                     \
		return r;                                                         \
	}
ASYNC_ALLOC(cuMemAllocAsync)
ASYNC_ALLOC(cuMemAllocAsync_ptsz)

#define ASYNC_FREE(name)                                              \
	REAL_OF(name, (CUdeviceptr, CUstream));                       \
	EXPORT CUresult name(CUdeviceptr ptr, CUstream s)             \
	{                                                             \
		if (!ready() || !real_##name)                         \
			return CUDA_ERROR_NOT_FOUND;                  \
		if (!active)                                          \
			return real_##name(ptr, s);                   \
		gate_enter();                                         \
		CUresult r = free_async(ptr, s, real_##name);         \
		gate_leave();                                         \
		return r;                                             \
	}
ASYNC_FREE(cuMemFreeAsync)
ASYNC_FREE(cuMemFreeAsync_ptsz)

#define POOL_ALLOC(name)                                                                     \
	REAL_OF(name, (CUdeviceptr *, size_t, CUmemoryPool, CUstream));                      \
	EXPORT CUresult name(CUdeviceptr *dptr, size_t size, CUmemoryPool pool, CUstream s)  \
	{                                                                                    \
		if (!ready() || !real_##name)                                                \
			return CUDA_ERROR_NOT_FOUND;                                         \
		if (!active)                                                                 \
			return real_##name(dptr, size, pool, s);                             \
		gate_enter();                                                                \
		CUresult r;                                                                  \
		if (capturing(s)) {                                                          \
			r = real_##name(dptr, size, pool, s);                                \
			if (r == CUDA_SUCCESS)                                               \
				refuse("its CUDA graphs allocate memory");                   \
		} else {                                                                     \
			r = own_alloc(dptr, size);                                           \
		}                                                                            \
		gate_leave();                                                                \
		return r;                                                                    \
	}
POOL_ALLOC(cuMemAllocFromPoolAsync)
POOL_ALLOC(cuMemAllocFromPoolAsync_ptsz)

/* Answered from our table: the driver would name the granule-rounded mapping or
 * the whole slab, not what the program asked for. */
REAL_OF(cuMemGetAddressRange_v2, (CUdeviceptr *, size_t *, CUdeviceptr));
EXPORT CUresult cuMemGetAddressRange_v2(CUdeviceptr *base, size_t *size, CUdeviceptr p)
{
	if (!ready())
		return CUDA_ERROR_NOT_INITIALIZED;
	if (active) {
		pthread_mutex_lock(&mu);
		struct region *reg = region_at(p);
		if (reg) {
			if (base)
				*base = reg->ptr;
			if (size)
				*size = reg->size;
		}
		pthread_mutex_unlock(&mu);
		if (reg)
			return CUDA_SUCCESS;
	}
	gate_enter();
	CUresult r = real_cuMemGetAddressRange_v2(base, size, p);
	gate_leave();
	return r;
}

/* The program's own VMM (llama.cpp's pool, PyTorch's expandable segments). */

/* The context to copy a device's memory through when the program made it with no
 * context current: the device's primary one, retained once. */
static CUresult primary_context(CUdevice dev, CUcontext *ctx)
{
	static CUcontext primary[MAX_DEVICES];
	CUresult r = CUDA_SUCCESS;
	if (dev < 0 || dev >= MAX_DEVICES)
		return CUDA_ERROR_INVALID_VALUE;
	pthread_mutex_lock(&mu);
	if (!primary[dev])
		r = real_cuDevicePrimaryCtxRetain(&primary[dev], dev);
	*ctx = primary[dev];
	pthread_mutex_unlock(&mu);
	return r;
}

EXPORT CUresult cuMemCreate(CUmemGenericAllocationHandle *h, size_t size,
			    const CUmemAllocationProp *prop, unsigned long long flags)
{
	if (!ready())
		return CUDA_ERROR_NOT_INITIALIZED;
	if (!active || !h || !prop || prop->location.type != CU_MEM_LOCATION_TYPE_DEVICE)
		return real_cuMemCreate(h, size, prop, flags);
	gate_enter();
	CUcontext ctx = NULL;
	CUresult r = real_cuCtxGetCurrent(&ctx);
	if (!r && !ctx)
		r = primary_context(prop->location.id, &ctx);
	CUmemGenericAllocationHandle real = 0;
	if (!r)
		r = real_cuMemCreate(&real, size, prop, flags);
	if (!r) {
		pthread_mutex_lock(&mu);
		struct phys *p = phys_new(size, prop, ctx);
		if (p) {
			p->real = real;
			p->refs = 1;
			p->handle = next_handle++;
			*h = p->handle;
		} else {
			real_cuMemRelease(real);
			r = CUDA_ERROR_OUT_OF_MEMORY;
		}
		pthread_mutex_unlock(&mu);
	}
	gate_leave();
	return r;
}

EXPORT CUresult cuMemRelease(CUmemGenericAllocationHandle h)
{
	if (!ready())
		return CUDA_ERROR_NOT_INITIALIZED;
	gate_enter();
	pthread_mutex_lock(&mu);
	struct phys *p = active ? phys_by_handle(h) : NULL;
	CUresult r = CUDA_SUCCESS;
	if (p && p->refs > 0) {
		/* Mapped, it lives on until unmapped, as with the driver. */
		if (!--p->refs && !p->maps)
			phys_destroy(p);
	} else if (!p) {
		r = real_cuMemRelease(h);
	} else {
		r = CUDA_ERROR_INVALID_VALUE;
	}
	pthread_mutex_unlock(&mu);
	gate_leave();
	return r;
}

EXPORT CUresult cuMemMap(CUdeviceptr va, size_t size, size_t offset, CUmemGenericAllocationHandle h,
			 unsigned long long flags)
{
	if (!ready())
		return CUDA_ERROR_NOT_INITIALIZED;
	gate_enter();
	pthread_mutex_lock(&mu);
	struct phys *p = active ? phys_by_handle(h) : NULL;
	CUresult r = real_cuMemMap(va, size, offset, p ? p->real : h, flags);
	if (!r && p && add_mapping(va, size, offset, p)) {
		real_cuMemUnmap(va, size);
		r = CUDA_ERROR_OUT_OF_MEMORY;
	}
	pthread_mutex_unlock(&mu);
	gate_leave();
	return r;
}

EXPORT CUresult cuMemUnmap(CUdeviceptr va, size_t size)
{
	if (!ready())
		return CUDA_ERROR_NOT_INITIALIZED;
	gate_enter();
	pthread_mutex_lock(&mu);
	CUresult r = real_cuMemUnmap(va, size);
	if (!r)
		forget_mappings(va, size);
	pthread_mutex_unlock(&mu);
	gate_leave();
	return r;
}

EXPORT CUresult cuMemSetAccess(CUdeviceptr va, size_t size, const CUmemAccessDesc *desc, size_t n)
{
	if (!ready())
		return CUDA_ERROR_NOT_INITIALIZED;
	gate_enter();
	pthread_mutex_lock(&mu);
	CUresult r = real_cuMemSetAccess(va, size, desc, n);
	/* Remembered per mapping, to be set again on restore. */
	for (size_t i = map_index(va); !r && i < nmaps && maps[i].va < va + size; i++)
		if (set_access(&maps[i], desc, n))
			r = CUDA_ERROR_OUT_OF_MEMORY;
	struct mapping *m = r ? NULL : mapping_at(va);
	if (m && m->va < va && set_access(m, desc, n))
		r = CUDA_ERROR_OUT_OF_MEMORY;
	pthread_mutex_unlock(&mu);
	gate_leave();
	return r;
}

REAL_OF(cuMemRetainAllocationHandle, (CUmemGenericAllocationHandle *, void *));
EXPORT CUresult cuMemRetainAllocationHandle(CUmemGenericAllocationHandle *h, void *addr)
{
	if (!ready() || !real_cuMemRetainAllocationHandle)
		return CUDA_ERROR_NOT_FOUND;
	gate_enter();
	pthread_mutex_lock(&mu);
	struct mapping *m = active ? mapping_at((CUdeviceptr)(uintptr_t)addr) : NULL;
	CUresult r = CUDA_SUCCESS;
	if (m && m->phys->handle) {
		m->phys->refs++;
		*h = m->phys->handle;
	} else if (m) {
		r = CUDA_ERROR_INVALID_VALUE; /* a cudaMalloc pointer has no handle to give */
	} else {
		r = real_cuMemRetainAllocationHandle(h, addr);
	}
	pthread_mutex_unlock(&mu);
	gate_leave();
	return r;
}

REAL_OF(cuMemGetAllocationPropertiesFromHandle, (CUmemAllocationProp *, CUmemGenericAllocationHandle));
EXPORT CUresult cuMemGetAllocationPropertiesFromHandle(CUmemAllocationProp *prop,
						       CUmemGenericAllocationHandle h)
{
	if (!ready() || !real_cuMemGetAllocationPropertiesFromHandle)
		return CUDA_ERROR_NOT_FOUND;
	pthread_mutex_lock(&mu);
	struct phys *p = active ? phys_by_handle(h) : NULL;
	if (p && prop)
		*prop = p->prop;
	pthread_mutex_unlock(&mu);
	return p ? CUDA_SUCCESS : real_cuMemGetAllocationPropertiesFromHandle(prop, h);
}

REAL_OF(cuMemExportToShareableHandle, (void *, CUmemGenericAllocationHandle, int, unsigned long long));
EXPORT CUresult cuMemExportToShareableHandle(void *out, CUmemGenericAllocationHandle h, int type,
					     unsigned long long flags)
{
	if (!ready() || !real_cuMemExportToShareableHandle)
		return CUDA_ERROR_NOT_FOUND;
	gate_enter();
	pthread_mutex_lock(&mu);
	struct phys *p = active ? phys_by_handle(h) : NULL;
	CUresult r = real_cuMemExportToShareableHandle(out, p ? p->real : h, type, flags);
	pthread_mutex_unlock(&mu);
	gate_leave();
	if (r == CUDA_SUCCESS && active)
		refuse("it shares GPU memory with another process (exported handle)");
	return r;
}

/* Graph capture: counted, so that a release does not synchronize under it. */

#define BEGIN_CAPTURE(name, params, args)                      \
	REAL_OF(name, params);                                 \
	EXPORT CUresult name params                            \
	{                                                      \
		if (!ready() || !real_##name)                  \
			return CUDA_ERROR_NOT_FOUND;           \
		gate_enter();                                  \
		CUresult r = real_##name args;                 \
		if (r == CUDA_SUCCESS)                         \
			atomic_fetch_add(&captures, 1);        \
		gate_leave();                                  \
		return r;                                      \
	}
BEGIN_CAPTURE(cuStreamBeginCapture, (CUstream s), (s))
BEGIN_CAPTURE(cuStreamBeginCapture_ptsz, (CUstream s), (s))
BEGIN_CAPTURE(cuStreamBeginCapture_v2, (CUstream s, int mode), (s, mode))
BEGIN_CAPTURE(cuStreamBeginCapture_v2_ptsz, (CUstream s, int mode), (s, mode))
#define P_TOGRAPH CUstream s, void *g, const void *deps, const void *data, size_t n, int mode
BEGIN_CAPTURE(cuStreamBeginCaptureToGraph, (P_TOGRAPH), (s, g, deps, data, n, mode))
BEGIN_CAPTURE(cuStreamBeginCaptureToGraph_ptsz, (P_TOGRAPH), (s, g, deps, data, n, mode))

#define END_CAPTURE(name)                                                \
	REAL_OF(name, (CUstream, void **));                              \
	EXPORT CUresult name(CUstream s, void **graph)                   \
	{                                                                \
		if (!ready() || !real_##name)                            \
			return CUDA_ERROR_NOT_FOUND;                     \
		int was = capturing(s); /* invalidated counts: it ends */ \
		CUresult r = real_##name(s, graph);                      \
		if (was)                                                 \
			atomic_fetch_sub(&captures, 1);                  \
		return r;                                                \
	}
END_CAPTURE(cuStreamEndCapture)
END_CAPTURE(cuStreamEndCapture_ptsz)

/* cuInit: where a process joins. Until the wrapper says where the command stands,
 * it must not touch the GPU. */
EXPORT CUresult cuInit(unsigned flags)
{
	if (!ready())
		return CUDA_ERROR_NOT_INITIALIZED;
	CUresult r = real_cuInit(flags);
	if (r == CUDA_SUCCESS && active) {
		pthread_once(&connect_once, connect_control);
		gate_enter();
		gate_leave();
	}
	return r;
}

/* ---- finding entry points ----------------------------------------------------- */

#define ENTRY_GATED(name, params, args) {#name, (void *)name, (void **)&real_##name},
#define ENTRY_REFUSING(name, why, params, args) {#name, (void *)name, (void **)&real_##name},
#define ENTRY(name, real) {#name, (void *)name, (void **)&real},

EXPORT CUresult cuGetProcAddress(const char *, void **, int, cuuint64_t);
EXPORT CUresult cuGetProcAddress_v2(const char *, void **, int, cuuint64_t, int *);
static CUresult (*real_cuGetProcAddress)(const char *, void **, int, cuuint64_t);
static CUresult (*real_cuGetProcAddress_v2)(const char *, void **, int, cuuint64_t, int *);

static struct hook hooks[] = {
	GATED(ENTRY_GATED)
	REFUSING(ENTRY_REFUSING)
	ENTRY(cuMemAlloc_v2, real_cuMemAlloc_v2)
	ENTRY(cuMemAllocPitch_v2, real_cuMemAllocPitch_v2)
	ENTRY(cuMemFree_v2, real_cuMemFree_v2)
	ENTRY(cuMemAllocAsync, real_cuMemAllocAsync)
	ENTRY(cuMemAllocAsync_ptsz, real_cuMemAllocAsync_ptsz)
	ENTRY(cuMemFreeAsync, real_cuMemFreeAsync)
	ENTRY(cuMemFreeAsync_ptsz, real_cuMemFreeAsync_ptsz)
	ENTRY(cuMemAllocFromPoolAsync, real_cuMemAllocFromPoolAsync)
	ENTRY(cuMemAllocFromPoolAsync_ptsz, real_cuMemAllocFromPoolAsync_ptsz)
	ENTRY(cuMemGetAddressRange_v2, real_cuMemGetAddressRange_v2)
	ENTRY(cuMemCreate, real_cuMemCreate)
	ENTRY(cuMemRelease, real_cuMemRelease)
	ENTRY(cuMemMap, real_cuMemMap)
	ENTRY(cuMemUnmap, real_cuMemUnmap)
	ENTRY(cuMemSetAccess, real_cuMemSetAccess)
	ENTRY(cuMemRetainAllocationHandle, real_cuMemRetainAllocationHandle)
	ENTRY(cuMemGetAllocationPropertiesFromHandle, real_cuMemGetAllocationPropertiesFromHandle)
	ENTRY(cuMemExportToShareableHandle, real_cuMemExportToShareableHandle)
	ENTRY(cuStreamBeginCapture, real_cuStreamBeginCapture)
	ENTRY(cuStreamBeginCapture_ptsz, real_cuStreamBeginCapture_ptsz)
	ENTRY(cuStreamBeginCapture_v2, real_cuStreamBeginCapture_v2)
	ENTRY(cuStreamBeginCapture_v2_ptsz, real_cuStreamBeginCapture_v2_ptsz)
	ENTRY(cuStreamBeginCaptureToGraph, real_cuStreamBeginCaptureToGraph)
	ENTRY(cuStreamBeginCaptureToGraph_ptsz, real_cuStreamBeginCaptureToGraph_ptsz)
	ENTRY(cuStreamEndCapture, real_cuStreamEndCapture)
	ENTRY(cuStreamEndCapture_ptsz, real_cuStreamEndCapture_ptsz)
	ENTRY(cuInit, real_cuInit)
	ENTRY(cuGetProcAddress, real_cuGetProcAddress)
	ENTRY(cuGetProcAddress_v2, real_cuGetProcAddress_v2)
};
#define NHOOKS (sizeof hooks / sizeof *hooks)

/* The driver functions the library calls itself; the hooked ones among them are
 * the same pointers as the hook table's. */
static const struct {
	const char *name;
	void **slot;
	int optional; /* the library works without it, if not as well */
} internal[] = {
	{"cuInit", (void **)&real_cuInit, 0},
	{"cuCtxGetCurrent", (void **)&real_cuCtxGetCurrent, 0},
	{"cuCtxSetCurrent", (void **)&real_cuCtxSetCurrent, 0},
	{"cuCtxGetDevice", (void **)&real_cuCtxGetDevice, 0},
	{"cuCtxSynchronize", (void **)&real_cuCtxSynchronize, 0},
	{"cuDeviceGetCount", (void **)&real_cuDeviceGetCount, 1},
	{"cuDeviceCanAccessPeer", (void **)&real_cuDeviceCanAccessPeer, 1},
	{"cuDevicePrimaryCtxRetain", (void **)&real_cuDevicePrimaryCtxRetain, 0},
	{"cuStreamCreate", (void **)&real_cuStreamCreate, 0},
	{"cuStreamSynchronize", (void **)&real_cuStreamSynchronize, 0},
	{"cuStreamIsCapturing", (void **)&real_cuStreamIsCapturing, 1},
	{"cuMemHostAlloc", (void **)&real_cuMemHostAlloc, 0},
	{"cuMemFreeHost", (void **)&real_cuMemFreeHost, 0},
	{"cuMemAddressReserve", (void **)&real_cuMemAddressReserve, 0},
	{"cuMemAddressFree", (void **)&real_cuMemAddressFree, 0},
	{"cuMemGetAllocationGranularity", (void **)&real_cuMemGetAllocationGranularity, 0},
	{"cuMemCreate", (void **)&real_cuMemCreate, 0},
	{"cuMemRelease", (void **)&real_cuMemRelease, 0},
	{"cuMemMap", (void **)&real_cuMemMap, 0},
	{"cuMemUnmap", (void **)&real_cuMemUnmap, 0},
	{"cuMemSetAccess", (void **)&real_cuMemSetAccess, 0},
	{"cuMemcpyDtoHAsync_v2", (void **)&real_cuMemcpyDtoHAsync_v2, 0},
	{"cuMemcpyHtoDAsync_v2", (void **)&real_cuMemcpyHtoDAsync_v2, 0},
	{"cuGetErrorString", (void **)&real_cuGetErrorString, 0},
};

static void resolve(void)
{
	resolving = 1;
	/* Loaded already by whoever calls us (RTLD_NOLOAD finds it whatever name it was
	 * opened by); else a program calling our exports as its libcuda gets it now. */
	libcuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
	if (!libcuda)
		libcuda = dlopen("libcuda.so.1", RTLD_NOW);
	if (!libcuda) {
		say("cannot load libcuda.so.1: %s", dlerror());
		resolving = 0;
		return;
	}
	for (size_t i = 0; i < NHOOKS; i++)
		*hooks[i].real = real_dlsym(libcuda, hooks[i].name);
	int missing = 0;
	for (size_t i = 0; i < sizeof internal / sizeof *internal; i++) {
		*internal[i].slot = real_dlsym(libcuda, internal[i].name);
		if (!*internal[i].slot && !internal[i].optional) {
			say("the driver has no %s", internal[i].name);
			missing = 1;
		}
	}
	if (missing && active) {
		say("this driver cannot be swapped: GPU calls stay blocked");
		atomic_store(&closed, 1);
	}
	resolving = 0;
}

/* Our wrapper for the real entry point `fn`, or NULL. By address: the driver's
 * own versioning (cuMemAlloc at 3020 is cuMemAlloc_v2, _ptsz for per-thread
 * streams, ...) has already chosen the function. */
static void *wrapper_of(void *fn)
{
	for (size_t i = 0; i < NHOOKS; i++)
		if (*hooks[i].real == fn)
			return hooks[i].wrapper;
	return NULL;
}

EXPORT void *dlsym(void *handle, const char *name)
{
	pthread_once(&setup_once, setup);
	/* A tail call: glibc's dlsym finds RTLD_NEXT from its caller's address, which
	 * must stay the program's, not ours. */
	if (!active || name[0] != 'c' || name[1] != 'u' || resolving)
		return real_dlsym(handle, name);
	void *fn = real_dlsym(handle, name);
	if (!fn || !ready())
		return fn;
	void *w = wrapper_of(fn);
	TRACE("dlsym %s: %s", name, w ? "hooked" : "driver's");
	return w ? w : fn;
}

static void *wrapper_named(const char *name)
{
	for (size_t i = 0; i < NHOOKS; i++)
		if (!strcmp(hooks[i].name, name))
			return hooks[i].wrapper;
	return NULL;
}

/* Should a driver hand out an address that no exported name has (an internal
 * alias), the hook is found by name, versioned as the driver does it: the
 * per-thread-stream variant when asked for, else the _v2 (every hooked _v2 dates
 * from CUDA 3.2 or has its predecessor's signature), else the name itself. */
static void *wrapper_by_name(const char *symbol, cuuint64_t flags)
{
	static const char *per_thread[] = {"_v2_ptds", "_v2_ptsz", "_ptds", "_ptsz"};
	char name[128];
	void *w = NULL;
	for (size_t i = 0; (flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM) && !w && i < 4; i++) {
		snprintf(name, sizeof name, "%s%s", symbol, per_thread[i]);
		w = wrapper_named(name);
	}
	if (!w) {
		snprintf(name, sizeof name, "%s_v2", symbol);
		w = wrapper_named(name);
	}
	return w ? w : wrapper_named(symbol);
}

static void hook_proc(const char *symbol, void **pfn, cuuint64_t flags, CUresult r)
{
	if (r != CUDA_SUCCESS || !active || !pfn || !*pfn || !symbol)
		return;
	void *w = wrapper_of(*pfn);
	const char *how = "hooked";
	if (!w && (w = wrapper_by_name(symbol, flags)))
		how = "hooked by name";
	TRACE("cuGetProcAddress %s (flags %llu): %s", symbol, flags, w ? how : "driver's");
	if (w)
		*pfn = w;
}

EXPORT CUresult cuGetProcAddress(const char *symbol, void **pfn, int version, cuuint64_t flags)
{
	if (!ready() || !real_cuGetProcAddress)
		return CUDA_ERROR_NOT_FOUND;
	CUresult r = real_cuGetProcAddress(symbol, pfn, version, flags);
	hook_proc(symbol, pfn, flags, r);
	return r;
}

EXPORT CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int version, cuuint64_t flags,
				    int *status)
{
	if (!ready() || !real_cuGetProcAddress_v2)
		return CUDA_ERROR_NOT_FOUND;
	CUresult r = real_cuGetProcAddress_v2(symbol, pfn, version, flags, status);
	hook_proc(symbol, pfn, flags, r);
	return r;
}
