/*
 * What the parts of the fake libcuda.so.1 share (fake_libcuda.c says what the fake is):
 * the driver's types and error codes as the fake uses them, its process-wide state, and
 * every entry point of the table cuGetProcAddress hands out, so that each definition is
 * checked against one declaration. Each part includes it first. What lies between the
 * visibility pragmas is internal: no exported name of the library, as the statics of a
 * single file would be.
 */
#ifndef FAKE_CUDA_H
#define FAKE_CUDA_H

#define _GNU_SOURCE
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

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
#define NO_CONTEXT 201
#define CAPTURE_UNSUPPORTED 900
#define CAPTURE_INVALIDATED 901
#define PTR(d) ((void *)(uintptr_t)(d))

#pragma GCC visibility push(hidden)

/* The process's state and witnesses (fake_libcuda.c). */
extern pthread_mutex_t mu;     /* guards phys_bytes and each part's lists */
extern long long phys_bytes;   /* the physical memory held: memfds and plain allocations */
extern __thread void *current; /* the calling thread's context */
long long now_ns(void);
long long total_bytes(void);
/* With mu held: the memory held changes by n bytes (written to FAKE_CUDA_PHYS). */
void phys_add(long long n);
/* With mu not held: "<what> <a> <b>" appended to FAKE_CUDA_LAUNCH_LOG. */
void log_line(const char *what, long long a, long long b);
/* A call the driver does not allow while a stream captures: it fails, and breaks the
 * capture. OK when none is under way. */
CUresult unsafe_in_capture(void);

/* The checkpoint API's gate in the process it is used on (fake_checkpoint.c): without
 * -DFAKE_CHECKPOINT, there is none. */
void ckpt_context(void);
int ckpt_enter(void);
void ckpt_leave(int counted);

#pragma GCC visibility pop

/* A driver call that the checkpoint API's lock holds back. */
#define GATED(call)                          \
	do {                                 \
		int counted_ = ckpt_enter(); \
		CUresult gated_ = (call);    \
		ckpt_leave(counted_);        \
		return gated_;               \
	} while (0)

/* plain allocations and virtual memory management (fake_memory.c) */
CUresult cuMemAlloc_v2(CUdeviceptr *p, size_t n);
CUresult cuMemAllocManaged(CUdeviceptr *p, size_t n, unsigned fl);
CUresult cuMemAllocAsync(CUdeviceptr *p, size_t n, void *s);
CUresult cuMemAllocAsync_ptsz(CUdeviceptr *p, size_t n, void *s);
CUresult cuMemAllocFromPoolAsync(CUdeviceptr *p, size_t n, void *pool, void *s);
CUresult cuMemFree_v2(CUdeviceptr p);
CUresult cuMemFreeAsync(CUdeviceptr p, void *s);
CUresult cuMemFreeAsync_ptsz(CUdeviceptr p, void *s);
CUresult cuMemAllocPitch_v2(CUdeviceptr *p, size_t *pitch, size_t w, size_t h, unsigned e);
CUresult cuMemGetAllocationGranularity(size_t *g, const Prop *prop, int option);
CUresult cuMemAddressReserve(CUdeviceptr *p, size_t size, size_t align, CUdeviceptr addr,
			     unsigned long long flags);
CUresult cuMemAddressFree(CUdeviceptr p, size_t size);
CUresult cuMemCreate(Handle *out, size_t size, const Prop *prop, unsigned long long flags);
CUresult cuMemRelease(Handle hh);
CUresult cuMemMap(CUdeviceptr va, size_t size, size_t offset, Handle hh,
		  unsigned long long flags);
CUresult cuMemUnmap(CUdeviceptr va, size_t size);
CUresult cuMemSetAccess(CUdeviceptr va, size_t size, const Access *desc, size_t n);
CUresult cuMemRetainAllocationHandle(Handle *out, void *addr);
CUresult cuMemGetAllocationPropertiesFromHandle(Prop *prop, Handle hh);
CUresult cuMemExportToShareableHandle(void *out, Handle hh, int type, unsigned long long fl);
CUresult cuMemGetAddressRange_v2(CUdeviceptr *base, size_t *size, CUdeviceptr p);
CUresult cuMemGetInfo_v2(size_t *free_, size_t *total);
CUresult cuIpcGetMemHandle(void *h, CUdeviceptr p);

/* host memory, copies, launches (fake_host.c) */
CUresult cuMemHostAlloc(void **p, size_t n, unsigned fl);
CUresult cuMemFreeHost(void *p);
CUresult cuMemHostRegister_v2(void *p, size_t n, unsigned fl);
CUresult cuMemHostUnregister(void *p);
CUresult cuMemcpyHtoD_v2(CUdeviceptr d, const void *h, size_t n);
CUresult cuMemcpyHtoD_v2_ptds(CUdeviceptr d, const void *h, size_t n);
CUresult cuMemcpyDtoH_v2(void *h, CUdeviceptr d, size_t n);
CUresult cuMemcpyDtoH_v2_ptds(void *h, CUdeviceptr d, size_t n);
CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr d, const void *h, size_t n, void *s);
CUresult cuMemcpyHtoDAsync_v2_ptsz(CUdeviceptr d, const void *h, size_t n, void *s);
CUresult cuMemcpyDtoHAsync_v2(void *h, CUdeviceptr d, size_t n, void *s);
CUresult cuMemcpyDtoHAsync_v2_ptsz(void *h, CUdeviceptr d, size_t n, void *s);
CUresult cuMemcpyDtoD_v2(CUdeviceptr d, CUdeviceptr s, size_t n);
CUresult cuMemcpyAsync(CUdeviceptr d, CUdeviceptr s, size_t n, void *st);
CUresult cuMemsetD32_v2(CUdeviceptr d, unsigned v, size_t n);
CUresult cuMemsetD8_v2(CUdeviceptr d, unsigned char v, size_t n);
CUresult cuLaunchKernel(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
			unsigned bz, unsigned sm, void *s, void **kp, void **ex);
CUresult cuLaunchKernel_ptsz(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
			     unsigned by, unsigned bz, unsigned sm, void *s, void **kp, void **ex);
CUresult cuModuleLoadData(void **m, const void *image);
CUresult cuModuleGetFunction(void **f, void *m, const char *name);
CUresult cuMemHostGetDevicePointer_v2(CUdeviceptr *d, void *p, unsigned fl);

/* contexts, streams, errors, entry points (fake_libcuda.c) */
CUresult cuInit(unsigned fl);
CUresult cuDriverGetVersion(int *v);
CUresult cuDeviceGet(int *d, int i);
CUresult cuDeviceGetCount(int *n);
CUresult cuDevicePrimaryCtxRetain(void **c, int d);
CUresult cuCtxSetCurrent(void *c);
CUresult cuCtxGetCurrent(void **c);
CUresult cuCtxGetDevice(int *d);
CUresult cuCtxSynchronize(void);
CUresult cuCtxGetLimit(size_t *v, int limit);
CUresult cuCtxSetLimit(int limit, size_t v);
CUresult cuStreamCreate(void **s, unsigned fl);
CUresult cuStreamDestroy_v2(void *s);
CUresult cuStreamSynchronize(void *s);
CUresult cuStreamIsCapturing(void *s, int *status);
CUresult cuStreamBeginCapture_v2(void *s, int mode);
CUresult cuStreamEndCapture(void *s, void **graph);
CUresult cuGetErrorString(CUresult r, const char **s);
CUresult cuGetErrorName(CUresult r, const char **s);
CUresult cuGetProcAddress(const char *sym, void **fn, int version, unsigned long long flags);
CUresult cuGetProcAddress_v2(const char *sym, void **fn, int version, unsigned long long flags,
			     int *status);

#endif
