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
 * Its parts: this file (the process's state and witnesses, contexts, streams and graph
 * capture, the table of entry points), fake_memory.c (plain allocations, virtual memory
 * management), fake_host.c (host memory, copies, launches and the digest kernel) and
 * fake_checkpoint.c (the checkpoint API), sharing fake_cuda.h. Compile them together.
 *
 * Build with -Wl,-Bsymbolic: the swap library exports the same names, and this
 * library's table of entry points must hold its own functions, not those.
 */
#include "fake_cuda.h"

#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
long long phys_bytes;
__thread void *current;
static int phys_fd = -1, log_fd = -1;
static char the_context;

long long now_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

long long total_bytes(void)
{
	const char *t = getenv("FAKE_CUDA_TOTAL");
	return t ? atoll(t) : 1LL << 30;
}

/* With mu held. */
void phys_add(long long n)
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
void log_line(const char *what, long long a, long long b)
{
	if (log_fd < 0)
		return;
	char line[80];
	int len = snprintf(line, sizeof line, "%s %lld %lld\n", what, a, b);
	if (write(log_fd, line, (size_t)len) != len)
		abort();
}

/* ---- graph capture ------------------------------------------------------------- */

static int capturing_now, capture_broken; /* streams capturing; one of them invalidated */

/* A call the driver does not allow while a stream captures: it fails, and breaks the
 * capture. OK when none is under way. */
CUresult unsafe_in_capture(void)
{
	pthread_mutex_lock(&mu);
	int now = capturing_now;
	capture_broken |= now > 0;
	pthread_mutex_unlock(&mu);
	return now ? CAPTURE_UNSUPPORTED : OK;
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

/* ---- cuGetProcAddress, as the runtime uses it ----------------------------------- */

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
