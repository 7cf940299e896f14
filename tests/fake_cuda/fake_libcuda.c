/*
 * A fake libcuda.so.1 for testing the swap library without a GPU.
 *
 * "Device" memory is host memory at the same address: cuMemAddressReserve is an
 * inaccessible mapping, cuMemCreate a memfd, cuMemMap maps it there (inaccessible
 * until cuMemSetAccess, as on a GPU), cuMemUnmap puts the inaccessible mapping
 * back. Copies are memcpy. A "kernel" is a host function, `void f(void **params)`,
 * passed as the CUfunction; each launch is appended to the file named by
 * FAKE_CUDA_LAUNCH_LOG as "launch <start ns> <end ns>" (CLOCK_MONOTONIC).
 * The physical memory held (memfds and plain allocations) is written to the file
 * named by FAKE_CUDA_PHYS at every change: the tests' witness that a released
 * program holds none. With FAKE_CUDA_ALIASES set, cuGetProcAddress hands out
 * cuLaunchKernel under an address no exported name has; while the file named by
 * FAKE_CUDA_FULL exists, cuMemCreate finds no memory, and while the file named by
 * FAKE_CUDA_HOST_FULL exists, cuMemHostAlloc finds none; while the file named by
 * FAKE_CUDA_STACK_FULL exists, the stack limit cannot be raised. While a stream captures a graph,
 * a call of any thread that would synchronize or pin (cuCtxSynchronize, cuStreamSynchronize,
 * cuMemHostRegister, cuModuleLoadData) fails with CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED and
 * invalidates the capture, whose end then fails, as on a GPU.
 *
 * The swap library's digest kernel is emulated: cuModuleLoadData takes a PTX image that
 * has its entry (unless FAKE_CUDA_NO_MODULE is set: then no image loads, as on a driver
 * too old for the PTX), cuModuleGetFunction gives a host function computing the digest
 * with digest.h's reference, and its launches are logged as "digest <start> <end>", not
 * as the program's "launch" lines. Compile with -I vramlock/gpu/swap.
 *
 * Built with -DFAKE_CHECKPOINT it has the driver's checkpoint API too (without it, the
 * names are missing, as on a driver older than 570), working across processes through
 * a state file per process in the directory named by FAKE_CUDA_CKPT_DIR: a process
 * that makes a context writes <dir>/<pid> ("0" running, "1" locked, "2" checkpointed),
 * and cuCheckpointProcess* called in another process change it, each logged as
 * "<call> <ns> <pid>" (lock, checkpoint, restore, unlock). While its state is not
 * running, the process's launches, allocations, mappings and copies block, as on the
 * driver; a call that waited is logged as "blocked <start ns> <end ns>". A lock waits
 * for the calls in flight (timeoutMs, then CUDA_ERROR_NOT_READY); a pid that does not
 * exist gets CUDA_ERROR_OPERATING_SYSTEM, one without a context
 * CUDA_ERROR_NOT_INITIALIZED, a call that does not fit the state CUDA_ERROR_ILLEGAL_STATE.
 *
 * Build with -Wl,-Bsymbolic: the swap library exports the same names, and this
 * library's table of entry points must hold its own functions, not those.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "digest.h"

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long Handle;

typedef struct {
	int type;
	int requestedHandleTypes;
	struct {
		int type;
		int id;
	} location;
	void *win32HandleMetaData;
	unsigned char allocFlags[8];
} Prop;

typedef struct {
	struct {
		int type;
		int id;
	} location;
	int flags;
} Access;

#define OK 0
#define INVALID 1
#define OOM 2
#define NOT_FOUND 500
#define GRANULE (2ULL << 20)

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static long long phys_bytes;
static int phys_fd = -1, log_fd = -1;
static char the_context;

static long long now_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static long long total_bytes(void)
{
	const char *t = getenv("FAKE_CUDA_TOTAL");
	return t ? atoll(t) : 1LL << 30;
}

/* With mu held. */
static void phys_add(long long n)
{
	phys_bytes += n;
	if (phys_fd >= 0) {
		char buf[32];
		int len = snprintf(buf, sizeof buf, "%-20lld\n", phys_bytes);
		if (pwrite(phys_fd, buf, (size_t)len, 0) != len)
			abort();
	}
}

__attribute__((constructor)) static void init(void)
{
	const char *p = getenv("FAKE_CUDA_PHYS");
	const char *l = getenv("FAKE_CUDA_LAUNCH_LOG");
	if (p && *p)
		phys_fd = open(p, O_WRONLY | O_CREAT | O_CLOEXEC, 0600);
	if (l && *l)
		log_fd = open(l, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0600);
	pthread_mutex_lock(&mu);
	phys_add(0);
	pthread_mutex_unlock(&mu);
}

/* With mu not held. */
static void log_line(const char *what, long long a, long long b)
{
	if (log_fd < 0)
		return;
	char line[80];
	int len = snprintf(line, sizeof line, "%s %lld %lld\n", what, a, b);
	if (write(log_fd, line, (size_t)len) != len)
		abort();
}

/* ---- the checkpoint API's gate in the process it is used on -------------------- */

#ifdef FAKE_CHECKPOINT
enum { RUNNING, LOCKED, CHECKPOINTED };
static pthread_mutex_t ckpt_mu = PTHREAD_MUTEX_INITIALIZER;
static int ckpt_fd = -1;   /* this process's state file, once it has a context */
static int ckpt_inflight;  /* its driver calls under way (they share the file's lock) */

static int state_of(int fd)
{
	char c;
	return pread(fd, &c, 1, 0) == 1 ? c - '0' : -1;
}

static void set_state(int fd, int state)
{
	char buf[2] = {(char)('0' + state), '\n'};
	if (pwrite(fd, buf, 2, 0) != 2)
		abort();
}

/* A context: this process is one the checkpoint API can be used on. */
static void ckpt_context(void)
{
	const char *dir = getenv("FAKE_CUDA_CKPT_DIR");
	char path[4096];
	pthread_mutex_lock(&ckpt_mu);
	if (ckpt_fd < 0 && dir && *dir) {
		snprintf(path, sizeof path, "%s/%d", dir, (int)getpid());
		ckpt_fd = open(path, O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
		if (ckpt_fd < 0)
			abort();
		set_state(ckpt_fd, RUNNING);
	}
	pthread_mutex_unlock(&ckpt_mu);
}

/* Before a driver call: wait while this process is locked or checkpointed. The file's
 * shared lock is held while any call is under way; a lock takes it exclusively. 1: the
 * call is counted under way (ckpt_leave after it). */
static int ckpt_enter(void)
{
	long long since = 0;
	pthread_mutex_lock(&ckpt_mu);
	if (ckpt_fd < 0) {
		pthread_mutex_unlock(&ckpt_mu);
		return 0;
	}
	for (;;) {
		if (!ckpt_inflight && flock(ckpt_fd, LOCK_SH))
			abort();
		if (state_of(ckpt_fd) == RUNNING)
			break;
		if (!ckpt_inflight)
			flock(ckpt_fd, LOCK_UN);
		pthread_mutex_unlock(&ckpt_mu);
		if (!since)
			since = now_ns();
		struct timespec tick = {0, 1000000};
		nanosleep(&tick, NULL);
		pthread_mutex_lock(&ckpt_mu);
	}
	ckpt_inflight++;
	pthread_mutex_unlock(&ckpt_mu);
	if (since)
		log_line("blocked", since, now_ns());
	return 1;
}

static void ckpt_leave(int counted)
{
	pthread_mutex_lock(&ckpt_mu);
	if (counted && !--ckpt_inflight)
		flock(ckpt_fd, LOCK_UN);
	pthread_mutex_unlock(&ckpt_mu);
}
#else
static void ckpt_context(void) {}
static int ckpt_enter(void) { return 0; }
static void ckpt_leave(int counted) { (void)counted; }
#endif

/* A driver call that the checkpoint API's lock holds back. */
#define GATED(call)                          \
	do {                                 \
		int counted_ = ckpt_enter(); \
		CUresult gated_ = (call);    \
		ckpt_leave(counted_);        \
		return gated_;               \
	} while (0)

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

/* ---- graph capture ------------------------------------------------------------- */

#define CAPTURE_UNSUPPORTED 900
#define CAPTURE_INVALIDATED 901
static int capturing_now, capture_broken; /* streams capturing; one of them invalidated */

/* A call the driver does not allow while a stream captures: it fails, and breaks the
 * capture. OK when none is under way. */
static CUresult unsafe_in_capture(void)
{
	pthread_mutex_lock(&mu);
	int now = capturing_now;
	capture_broken |= now > 0;
	pthread_mutex_unlock(&mu);
	return now ? CAPTURE_UNSUPPORTED : OK;
}

/* ---- host memory, copies, launches -------------------------------------------- */

static __thread void *current;
#define NO_CONTEXT 201

CUresult cuMemHostAlloc(void **p, size_t n, unsigned fl)
{
	(void)fl;
	if (!current)
		return NO_CONTEXT; /* as the driver: pinning needs a context */
	const char *full = getenv("FAKE_CUDA_HOST_FULL");
	if (full && !access(full, F_OK))
		return OOM;
	*p = malloc(n);
	return *p ? OK : OOM;
}
CUresult cuMemFreeHost(void *p) { free(p); return OK; }

/* What is registered now, as the driver keeps it: a range is unregistered by its start. */
struct registered {
	void *p;
	size_t n;
	unsigned fl;
	struct registered *next;
};
static struct registered *registered;

/* Locking host memory the caller mapped: logged as "register <monotonic ns> <bytes>"
 * (FAKE_CUDA_LAUNCH_LOG), so that a test sees when it happens and how much; undone by
 * cuMemHostUnregister, logged as "unregister <monotonic ns> <bytes>". */
static CUresult cuMemHostRegister_v2_now(void *p, size_t n, unsigned fl)
{
	if (!current)
		return NO_CONTEXT;
	const char *full = getenv("FAKE_CUDA_HOST_FULL");
	if (full && !access(full, F_OK))
		return OOM;
	if (!p || !n)
		return INVALID;
	if (unsafe_in_capture())
		return CAPTURE_UNSUPPORTED;
	struct registered *r = malloc(sizeof *r);
	if (!r)
		abort();
	pthread_mutex_lock(&mu);
	for (struct registered *o = registered; o; o = o->next)
		if ((char *)p < (char *)o->p + o->n && (char *)o->p < (char *)p + n) {
			pthread_mutex_unlock(&mu);
			free(r);
			return 712; /* CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED */
		}
	*r = (struct registered){p, n, fl, registered};
	registered = r;
	pthread_mutex_unlock(&mu);
	log_line("register", now_ns(), (long long)n);
	return OK;
}

CUresult cuMemHostRegister_v2(void *p, size_t n, unsigned fl) { GATED(cuMemHostRegister_v2_now(p, n, fl)); }

CUresult cuMemHostUnregister(void *p)
{
	pthread_mutex_lock(&mu);
	for (struct registered **pp = &registered; *pp; pp = &(*pp)->next) {
		struct registered *r = *pp;
		if (r->p != p)
			continue;
		*pp = r->next;
		pthread_mutex_unlock(&mu);
		log_line("unregister", now_ns(), (long long)r->n);
		free(r);
		return OK;
	}
	pthread_mutex_unlock(&mu);
	return 713; /* CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED */
}

#define PTR(d) ((void *)(uintptr_t)(d))
CUresult cuMemcpyHtoD_v2(CUdeviceptr d, const void *h, size_t n) { GATED((memcpy(PTR(d), h, n), OK)); }
CUresult cuMemcpyHtoD_v2_ptds(CUdeviceptr d, const void *h, size_t n) { return cuMemcpyHtoD_v2(d, h, n); }
CUresult cuMemcpyDtoH_v2(void *h, CUdeviceptr d, size_t n) { GATED((memcpy(h, PTR(d), n), OK)); }
CUresult cuMemcpyDtoH_v2_ptds(void *h, CUdeviceptr d, size_t n) { return cuMemcpyDtoH_v2(h, d, n); }
CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr d, const void *h, size_t n, void *s) { (void)s; return current ? cuMemcpyHtoD_v2(d, h, n) : NO_CONTEXT; }
CUresult cuMemcpyHtoDAsync_v2_ptsz(CUdeviceptr d, const void *h, size_t n, void *s) { (void)s; return cuMemcpyHtoD_v2(d, h, n); }
/* Copies to the host on a stream (what the swap library's copies out are) are logged as
 * "dtoh <monotonic ns> <bytes>" (FAKE_CUDA_LAUNCH_LOG); with FAKE_CUDA_DTOH_MS set, each
 * takes that many milliseconds at least, as over a slow link. */
CUresult cuMemcpyDtoHAsync_v2(void *h, CUdeviceptr d, size_t n, void *s)
{
	(void)s;
	if (!current)
		return NO_CONTEXT;
	const char *slow = getenv("FAKE_CUDA_DTOH_MS");
	if (slow && *slow) {
		long ms = atol(slow);
		struct timespec t = {ms / 1000, ms % 1000 * 1000000};
		nanosleep(&t, NULL);
	}
	CUresult r = cuMemcpyDtoH_v2(h, d, n);
	if (!r)
		log_line("dtoh", now_ns(), (long long)n);
	return r;
}
CUresult cuMemcpyDtoHAsync_v2_ptsz(void *h, CUdeviceptr d, size_t n, void *s) { (void)s; return cuMemcpyDtoH_v2(h, d, n); }
CUresult cuMemcpyDtoD_v2(CUdeviceptr d, CUdeviceptr s, size_t n) { GATED((memmove(PTR(d), PTR(s), n), OK)); }
CUresult cuMemcpyAsync(CUdeviceptr d, CUdeviceptr s, size_t n, void *st) { (void)st; return cuMemcpyDtoD_v2(d, s, n); }
CUresult cuMemsetD32_v2(CUdeviceptr d, unsigned v, size_t n)
{
	unsigned *p = PTR(d);
	for (size_t i = 0; i < n; i++)
		p[i] = v;
	return OK;
}
CUresult cuMemsetD8_v2(CUdeviceptr d, unsigned char v, size_t n) { memset(PTR(d), v, n); return OK; }

typedef void (*kernel)(void **);

/* The swap library's kernel (digest.cu), on the host: `blocks` segments of the memory
 * at params[0], params[1] bytes long, their digests to params[2]. */
static void digest_kernel(unsigned blocks, void **params)
{
	const uint32_t *data = PTR(*(CUdeviceptr *)params[0]);
	size_t words = *(unsigned long long *)params[1] / 4, per = DIGEST_SEGMENT / 4;
	uint64_t *out = PTR(*(CUdeviceptr *)params[2]), key[DIGEST_LANES];
	for (int l = 0; l < DIGEST_LANES; l++)
		key[l] = *(unsigned long long *)params[3 + l];
	for (size_t b = 0; b < blocks && b * per < words; b++) {
		size_t n = words - b * per < per ? words - b * per : per;
		digest_words(data + b * per, n, key, out + b * DIGEST_LANES);
	}
}

static CUresult launch_now(void *f, unsigned blocks, void **params)
{
	long long t0 = now_ns();
	if (f == (void *)digest_kernel)
		digest_kernel(blocks, params);
	else
		((kernel)f)(params);
	log_line(f == (void *)digest_kernel ? "digest" : "launch", t0, now_ns());
	return OK;
}

static CUresult launch(void *f, unsigned blocks, void **params) { GATED(launch_now(f, blocks, params)); }

CUresult cuLaunchKernel(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
			unsigned bz, unsigned sm, void *s, void **kp, void **ex)
{
	(void)gy, (void)gz, (void)bx, (void)by, (void)bz, (void)sm, (void)s, (void)ex;
	return launch(f, gx, kp);
}

CUresult cuLaunchKernel_ptsz(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
			     unsigned by, unsigned bz, unsigned sm, void *s, void **kp, void **ex)
{
	return cuLaunchKernel(f, gx, gy, gz, bx, by, bz, sm, s, kp, ex);
}

static char the_module;

CUresult cuModuleLoadData(void **m, const void *image)
{
	if (getenv("FAKE_CUDA_NO_MODULE"))
		return 222; /* CUDA_ERROR_UNSUPPORTED_PTX_VERSION */
	if (!current)
		return NO_CONTEXT;
	if (unsafe_in_capture())
		return CAPTURE_UNSUPPORTED;
	if (!strstr(image, ".entry " DIGEST_NAME "("))
		return 218; /* CUDA_ERROR_INVALID_PTX */
	*m = &the_module;
	return OK;
}

CUresult cuModuleGetFunction(void **f, void *m, const char *name)
{
	if (m != &the_module || strcmp(name, DIGEST_NAME))
		return NOT_FOUND;
	*f = (void *)digest_kernel;
	return OK;
}

/* Pinned memory is the device's too, at the same address (unified addressing); memory
 * registered without CU_MEMHOSTREGISTER_DEVICEMAP (2) has no device address, as the
 * driver documents, and with FAKE_CUDA_NO_HOST_MAP set no registered memory has one. */
CUresult cuMemHostGetDevicePointer_v2(CUdeviceptr *d, void *p, unsigned fl)
{
	(void)fl;
	if (!current)
		return NO_CONTEXT;
	pthread_mutex_lock(&mu);
	for (struct registered *o = registered; o; o = o->next)
		if ((char *)p >= (char *)o->p && (char *)p < (char *)o->p + o->n &&
		    (!(o->fl & 2) || getenv("FAKE_CUDA_NO_HOST_MAP"))) {
			pthread_mutex_unlock(&mu);
			return INVALID;
		}
	pthread_mutex_unlock(&mu);
	*d = (CUdeviceptr)(uintptr_t)p;
	return OK;
}

/* ---- context, streams, init ---------------------------------------------------- */

/* FAKE_CUDA_INIT_MS: the first cuInit takes that long, as a real driver's start does. */
CUresult cuInit(unsigned fl)
{
	static int done;
	const char *ms = getenv("FAKE_CUDA_INIT_MS");
	(void)fl;
	if (!done && ms && *ms) {
		struct timespec t = {atoi(ms) / 1000, (long)(atoi(ms) % 1000) * 1000000L};
		nanosleep(&t, NULL);
	}
	done = 1;
	return OK;
}
CUresult cuDriverGetVersion(int *v) { *v = 13000; return OK; }
CUresult cuDeviceGet(int *d, int i) { *d = i; return i == 0 ? OK : INVALID; }
CUresult cuDeviceGetCount(int *n) { *n = 1; return OK; }
CUresult cuDevicePrimaryCtxRetain(void **c, int d)
{
	(void)d;
	ckpt_context();
	*c = &the_context;
	return OK;
}
CUresult cuCtxSetCurrent(void *c) { current = c; return OK; }
CUresult cuCtxGetCurrent(void **c) { *c = current; return OK; }
CUresult cuCtxGetDevice(int *d) { *d = 0; return current ? OK : 201; }
CUresult cuCtxSynchronize(void) { GATED(!current ? 201 : unsafe_in_capture()); }
/* The per-thread stack limit (CU_LIMIT_STACK_SIZE, 0) is the one limit kept: 1 KiB at
 * first, as on a GPU, every change logged as "stack <ns> <bytes>". */
static size_t stack_limit = 1024;
CUresult cuCtxGetLimit(size_t *v, int limit)
{
	if (!current)
		return 201;
	*v = limit == 0 ? stack_limit : 0;
	return OK;
}
CUresult cuCtxSetLimit(int limit, size_t v)
{
	const char *full = getenv("FAKE_CUDA_STACK_FULL");
	if (!current)
		return 201;
	if (limit == 0 && v > stack_limit && full && !access(full, F_OK))
		return OOM; /* a larger stack is GPU memory */
	if (limit == 0) {
		stack_limit = v;
		log_line("stack", now_ns(), (long long)v);
	}
	return OK;
}
CUresult cuStreamCreate(void **s, unsigned fl) { (void)fl; *s = calloc(1, 1); return current ? OK : NO_CONTEXT; }
CUresult cuStreamDestroy_v2(void *s) { free(s); return OK; }
CUresult cuStreamSynchronize(void *s) { (void)s; GATED(unsafe_in_capture()); }
/* A stream is one byte: whether it is capturing a graph. */
CUresult cuStreamIsCapturing(void *s, int *status) { *status = s ? *(char *)s : 0; return OK; }
CUresult cuStreamBeginCapture_v2(void *s, int mode)
{
	(void)mode;
	pthread_mutex_lock(&mu);
	capturing_now++;
	pthread_mutex_unlock(&mu);
	*(char *)s = 1;
	return OK;
}

CUresult cuStreamEndCapture(void *s, void **graph)
{
	if (!*(char *)s)
		return 401; /* not capturing */
	*(char *)s = 0;
	*graph = NULL;
	pthread_mutex_lock(&mu);
	int broken = capture_broken;
	if (!--capturing_now)
		capture_broken = 0;
	pthread_mutex_unlock(&mu);
	return broken ? CAPTURE_INVALIDATED : OK;
}

CUresult cuGetErrorString(CUresult r, const char **s)
{
	*s = r == OOM ? "out of memory" : r == INVALID ? "invalid argument" : "fake error";
	return OK;
}

CUresult cuGetErrorName(CUresult r, const char **s)
{
	*s = r == OOM ? "CUDA_ERROR_OUT_OF_MEMORY" : r == INVALID ? "CUDA_ERROR_INVALID_VALUE"
								  : "CUDA_ERROR_UNKNOWN";
	return OK;
}

/* ---- the checkpoint API, called on another process ------------------------------ */

#ifdef FAKE_CHECKPOINT
#define NOT_INITIALIZED 3
#define OS_ERROR 304
#define ILLEGAL_STATE 401
#define NOT_READY 600

typedef struct {
	unsigned timeoutMs, reserved0;
	unsigned long long reserved1[7];
} LockArgs;

/* The state file of the process pid, opened: OK, or what the driver answers. */
static CUresult ckpt_open(int pid, int *fd)
{
	const char *dir = getenv("FAKE_CUDA_CKPT_DIR");
	char path[4096];
	if (pid <= 0)
		return INVALID;
	if (kill(pid, 0) && errno == ESRCH)
		return OS_ERROR; /* as the driver answers for a pid that does not exist */
	if (!dir || !*dir)
		return NOT_INITIALIZED;
	snprintf(path, sizeof path, "%s/%d", dir, pid);
	*fd = open(path, O_RDWR | O_CLOEXEC);
	return *fd < 0 ? NOT_INITIALIZED : OK; /* no context there */
}

/* pid's state from `from` to `to`, once no call of its is under way (within timeout_ms,
 * 0: however long that takes); logged as "<what> <ns> <pid>". */
static CUresult ckpt_move(int pid, int from, int to, const char *what, unsigned timeout_ms)
{
	int fd;
	CUresult r = ckpt_open(pid, &fd);
	if (r)
		return r;
	long long until = now_ns() + (long long)timeout_ms * 1000000;
	while (flock(fd, LOCK_EX | LOCK_NB)) {
		if (timeout_ms && now_ns() >= until) {
			close(fd);
			return NOT_READY;
		}
		struct timespec tick = {0, 1000000};
		nanosleep(&tick, NULL);
	}
	if (state_of(fd) != from) {
		r = ILLEGAL_STATE;
	} else {
		set_state(fd, to);
		log_line(what, now_ns(), pid);
	}
	flock(fd, LOCK_UN);
	close(fd);
	return r;
}

CUresult cuCheckpointProcessGetState(int pid, int *state)
{
	int fd;
	CUresult r = ckpt_open(pid, &fd);
	if (r)
		return r;
	*state = state_of(fd);
	close(fd);
	return OK;
}

CUresult cuCheckpointProcessGetRestoreThreadId(int pid, int *tid)
{
	int state;
	CUresult r = cuCheckpointProcessGetState(pid, &state); /* the same checks */
	if (!r)
		*tid = pid;
	return r;
}

/* With FAKE_CUDA_CKPT_LOCK_MS set, a lock takes that long before it looks at the target. */
CUresult cuCheckpointProcessLock(int pid, const LockArgs *args)
{
	const char *slow = getenv("FAKE_CUDA_CKPT_LOCK_MS");
	if (slow && *slow) {
		long ms = atol(slow);
		struct timespec t = {ms / 1000, ms % 1000 * 1000000};
		nanosleep(&t, NULL);
	}
	return ckpt_move(pid, RUNNING, LOCKED, "lock", args ? args->timeoutMs : 0);
}

CUresult cuCheckpointProcessCheckpoint(int pid, const void *args)
{
	(void)args;
	return ckpt_move(pid, LOCKED, CHECKPOINTED, "checkpoint", 0);
}

/* With FAKE_CUDA_CKPT_RESTORE_MS set, a restore takes that long before it acts. */
CUresult cuCheckpointProcessRestore(int pid, const void *args)
{
	const char *slow = getenv("FAKE_CUDA_CKPT_RESTORE_MS");
	(void)args;
	if (slow && *slow) {
		long ms = atol(slow);
		struct timespec t = {ms / 1000, ms % 1000 * 1000000};
		nanosleep(&t, NULL);
	}
	return ckpt_move(pid, CHECKPOINTED, LOCKED, "restore", 0);
}

CUresult cuCheckpointProcessUnlock(int pid, const void *args)
{
	(void)args;
	return ckpt_move(pid, LOCKED, RUNNING, "unlock", 0);
}
#endif

/* ---- cuGetProcAddress, as the runtime uses it ----------------------------------- */

CUresult cuGetProcAddress(const char *sym, void **fn, int version, unsigned long long flags);
CUresult cuGetProcAddress_v2(const char *sym, void **fn, int version, unsigned long long flags,
			     int *status);

#define E(f) {#f, (void *)f}
static const struct {
	const char *name;
	void *fn;
} entries[] = {
	E(cuMemAlloc_v2), E(cuMemAllocManaged), E(cuMemAllocAsync), E(cuMemAllocAsync_ptsz),
	E(cuMemAllocFromPoolAsync), E(cuMemFree_v2), E(cuMemFreeAsync), E(cuMemFreeAsync_ptsz),
	E(cuMemAllocPitch_v2), E(cuMemGetAllocationGranularity), E(cuMemAddressReserve),
	E(cuMemAddressFree), E(cuMemCreate), E(cuMemRelease), E(cuMemMap), E(cuMemUnmap),
	E(cuMemSetAccess), E(cuMemRetainAllocationHandle), E(cuMemGetAllocationPropertiesFromHandle),
	E(cuMemExportToShareableHandle), E(cuMemGetAddressRange_v2), E(cuMemGetInfo_v2),
	E(cuIpcGetMemHandle), E(cuMemHostAlloc), E(cuMemFreeHost), E(cuMemHostRegister_v2), E(cuMemHostUnregister), E(cuMemcpyHtoD_v2),
	E(cuMemcpyHtoD_v2_ptds), E(cuMemcpyDtoH_v2), E(cuMemcpyDtoH_v2_ptds),
	E(cuMemcpyHtoDAsync_v2), E(cuMemcpyHtoDAsync_v2_ptsz), E(cuMemcpyDtoHAsync_v2),
	E(cuMemcpyDtoHAsync_v2_ptsz), E(cuMemcpyDtoD_v2), E(cuMemcpyAsync), E(cuMemsetD32_v2),
	E(cuMemsetD8_v2), E(cuLaunchKernel), E(cuLaunchKernel_ptsz), E(cuModuleLoadData),
	E(cuModuleGetFunction), E(cuMemHostGetDevicePointer_v2), E(cuInit),
	E(cuDriverGetVersion), E(cuDeviceGet), E(cuDeviceGetCount), E(cuDevicePrimaryCtxRetain),
	E(cuCtxSetCurrent), E(cuCtxGetCurrent), E(cuCtxGetDevice), E(cuCtxSynchronize),
	E(cuCtxGetLimit), E(cuCtxSetLimit),
	E(cuStreamCreate), E(cuStreamDestroy_v2), E(cuStreamSynchronize), E(cuStreamIsCapturing), E(cuStreamBeginCapture_v2), E(cuStreamEndCapture),
	E(cuGetErrorString), E(cuGetErrorName), E(cuGetProcAddress), E(cuGetProcAddress_v2),
};

static void *entry(const char *name)
{
	for (size_t i = 0; i < sizeof entries / sizeof *entries; i++)
		if (!strcmp(entries[i].name, name))
			return entries[i].fn;
	return NULL;
}

/* An entry point under no exported name, as a driver may hand out: with
 * FAKE_CUDA_ALIASES set, cuGetProcAddress gives this for cuLaunchKernel. */
static CUresult launch_alias(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
			     unsigned by, unsigned bz, unsigned sm, void *s, void **kp, void **ex)
{
	return cuLaunchKernel(f, gx, gy, gz, bx, by, bz, sm, s, kp, ex);
}

/* As the driver does: the per-thread-stream variant when asked for, the _v2 of a
 * function whose ABI changed at 3.2 for callers that new. */
CUresult cuGetProcAddress_v2(const char *sym, void **fn, int version, unsigned long long flags,
			     int *status)
{
	static const char *ptds[] = {"_v2_ptds", "_v2_ptsz", "_ptds", "_ptsz"};
	char name[128];
	void *found = NULL;
	for (size_t i = 0; (flags & 2) && !found && i < 4; i++) {
		snprintf(name, sizeof name, "%s%s", sym, ptds[i]);
		found = entry(name);
	}
	if (!found && version >= 3020) {
		snprintf(name, sizeof name, "%s_v2", sym);
		found = entry(name);
	}
	if (!found)
		found = entry(sym);
	if (found == (void *)cuLaunchKernel && getenv("FAKE_CUDA_ALIASES"))
		found = (void *)launch_alias;
	if (status)
		*status = found ? 0 : 1;
	*fn = found;
	return found ? OK : NOT_FOUND;
}

CUresult cuGetProcAddress(const char *sym, void **fn, int version, unsigned long long flags)
{
	return cuGetProcAddress_v2(sym, fn, version, flags, NULL);
}
