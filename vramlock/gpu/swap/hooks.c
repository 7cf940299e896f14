/*
 * hooks.c: our wrappers of the driver's entry points. Calls that touch device
 * memory pass the gate; allocations are served by table.c; what cannot be swapped
 * makes a release refused from then on. At the end, the table entry.c hooks by, and
 * how it is filled.
 */
#include "hooks.h"

/* The driver's own entry point behind each wrapper is next_<name> (the library's own
 * calls use driver.c's real_<name>, the same function). */

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
	/* A release lowers the stack limit (engine.c): the program's own waits for it. */ \
	X(cuCtxGetLimit, (size_t * v, int limit), (v, limit))                          \
	X(cuCtxSetLimit, (int limit, size_t v), (limit, v))                            \
	X(cuPointerGetAttribute, (void *data, int attr, CUdeviceptr p), (data, attr, p)) \
	X(cuPointerGetAttributes, (unsigned n, int *attrs, void **data, CUdeviceptr p),  \
	  (n, attrs, data, p))

#define DEFINE_GATED(name, params, args)                     \
	CUresult(*next_##name) params;                       \
	EXPORT CUresult name params                          \
	{                                                    \
		if (!ready() || !next_##name)                \
			return CUDA_ERROR_NOT_FOUND;         \
		gate_enter();                                \
		CUresult r = next_##name args;               \
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
	CUresult(*next_##name) params;                        \
	EXPORT CUresult name params                           \
	{                                                     \
		if (!ready() || !next_##name)                 \
			return CUDA_ERROR_NOT_FOUND;          \
		gate_enter();                                 \
		CUresult r = next_##name args;                \
		gate_leave();                                 \
		if (r == CUDA_SUCCESS && engine.active)              \
			refuse("%s", why);                    \
		else if (engine.active)                              \
			refusing_failed(#name, r);            \
		return r;                                     \
	}
REFUSING(DEFINE_REFUSING)

/* Allocations: ours, through the gate (an allocation while released waits). */

#define REAL_OF(name, params) CUresult(*next_##name) params

REAL_OF(cuMemAlloc_v2, (CUdeviceptr *, size_t));
EXPORT CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t size)
{
	if (!ready())
		return CUDA_ERROR_NOT_INITIALIZED;
	if (!engine.active)
		return next_cuMemAlloc_v2(dptr, size);
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
	if (!engine.active)
		return next_cuMemAllocPitch_v2(dptr, pitch, width, height, elem);
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
	if (!engine.active)
		return next_cuMemFree_v2(ptr);
	gate_enter();
	/* cudaFree waits for the device; a freed range may be handed out again at once.
	 * (A thread without a context has nothing to wait for.) */
	if (ptr)
		real_cuCtxSynchronize();
	CUresult r = own_free(ptr) ? CUDA_SUCCESS : next_cuMemFree_v2(ptr);
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
	if (!is_own(ptr))
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
		if (!ready() || !next_##name)                                     \
			return CUDA_ERROR_NOT_FOUND;                              \
		if (!engine.active)                                                      \
			return next_##name(dptr, size, s);                        \
		gate_enter();                                                     \
		CUresult r = alloc_async(dptr, size, s, next_##name);             \
		gate_leave();                                                     \
		return r;                                                         \
	}
ASYNC_ALLOC(cuMemAllocAsync)
ASYNC_ALLOC(cuMemAllocAsync_ptsz)

#define ASYNC_FREE(name)                                              \
	REAL_OF(name, (CUdeviceptr, CUstream));                       \
	EXPORT CUresult name(CUdeviceptr ptr, CUstream s)             \
	{                                                             \
		if (!ready() || !next_##name)                         \
			return CUDA_ERROR_NOT_FOUND;                  \
		if (!engine.active)                                          \
			return next_##name(ptr, s);                   \
		gate_enter();                                         \
		CUresult r = free_async(ptr, s, next_##name);         \
		gate_leave();                                         \
		return r;                                             \
	}
ASYNC_FREE(cuMemFreeAsync)
ASYNC_FREE(cuMemFreeAsync_ptsz)

#define POOL_ALLOC(name)                                                                     \
	REAL_OF(name, (CUdeviceptr *, size_t, CUmemoryPool, CUstream));                      \
	EXPORT CUresult name(CUdeviceptr *dptr, size_t size, CUmemoryPool pool, CUstream s)  \
	{                                                                                    \
		if (!ready() || !next_##name)                                                \
			return CUDA_ERROR_NOT_FOUND;                                         \
		if (!engine.active)                                                                 \
			return next_##name(dptr, size, pool, s);                             \
		gate_enter();                                                                \
		CUresult r;                                                                  \
		if (capturing(s)) {                                                          \
			r = next_##name(dptr, size, pool, s);                                \
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
	if (engine.active && region_of(p, base, size))
		return CUDA_SUCCESS;
	gate_enter();
	CUresult r = next_cuMemGetAddressRange_v2(base, size, p);
	gate_leave();
	return r;
}

/* The program's own VMM (llama.cpp's pool, PyTorch's expandable segments). */

static unsigned long long next_handle = 0x5a5a000000000001ULL;

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
	if (!engine.active || !h || !prop || prop->location.type != CU_MEM_LOCATION_TYPE_DEVICE)
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
	struct phys *p = engine.active ? phys_by_handle(h) : NULL;
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
	struct phys *p = engine.active ? phys_by_handle(h) : NULL;
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
	if (!ready() || !next_cuMemRetainAllocationHandle)
		return CUDA_ERROR_NOT_FOUND;
	gate_enter();
	pthread_mutex_lock(&mu);
	struct mapping *m = engine.active ? mapping_at((CUdeviceptr)(uintptr_t)addr) : NULL;
	CUresult r = CUDA_SUCCESS;
	if (m && m->phys->handle) {
		m->phys->refs++;
		*h = m->phys->handle;
	} else if (m) {
		r = CUDA_ERROR_INVALID_VALUE; /* a cudaMalloc pointer has no handle to give */
	} else {
		r = next_cuMemRetainAllocationHandle(h, addr);
	}
	pthread_mutex_unlock(&mu);
	gate_leave();
	return r;
}

REAL_OF(cuMemGetAllocationPropertiesFromHandle, (CUmemAllocationProp *, CUmemGenericAllocationHandle));
EXPORT CUresult cuMemGetAllocationPropertiesFromHandle(CUmemAllocationProp *prop,
						       CUmemGenericAllocationHandle h)
{
	if (!ready() || !next_cuMemGetAllocationPropertiesFromHandle)
		return CUDA_ERROR_NOT_FOUND;
	pthread_mutex_lock(&mu);
	struct phys *p = engine.active ? phys_by_handle(h) : NULL;
	if (p && prop)
		*prop = p->prop;
	pthread_mutex_unlock(&mu);
	return p ? CUDA_SUCCESS : next_cuMemGetAllocationPropertiesFromHandle(prop, h);
}

REAL_OF(cuMemExportToShareableHandle, (void *, CUmemGenericAllocationHandle, int, unsigned long long));
EXPORT CUresult cuMemExportToShareableHandle(void *out, CUmemGenericAllocationHandle h, int type,
					     unsigned long long flags)
{
	if (!ready() || !next_cuMemExportToShareableHandle)
		return CUDA_ERROR_NOT_FOUND;
	gate_enter();
	pthread_mutex_lock(&mu);
	struct phys *p = engine.active ? phys_by_handle(h) : NULL;
	CUresult r = next_cuMemExportToShareableHandle(out, p ? p->real : h, type, flags);
	pthread_mutex_unlock(&mu);
	gate_leave();
	if (r == CUDA_SUCCESS && engine.active)
		refuse("it shares GPU memory with another process (exported handle)");
	return r;
}

/* Graph capture: counted, so that a release does not synchronize under it, nor the
 * preparer pin or synchronize (prepare.c): the driver refuses such calls of any thread
 * while a stream captures, and invalidates the capture. Begun under `mu`: never in the
 * middle of a preparer's step. */

#define BEGIN_CAPTURE(name, params, args)                      \
	REAL_OF(name, params);                                 \
	EXPORT CUresult name params                            \
	{                                                      \
		if (!ready() || !next_##name)                  \
			return CUDA_ERROR_NOT_FOUND;           \
		gate_enter();                                  \
		pthread_mutex_lock(&mu);                       \
		CUresult r = next_##name args;                 \
		if (r == CUDA_SUCCESS)                         \
			atomic_fetch_add(&captures, 1);        \
		pthread_mutex_unlock(&mu);                     \
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
		if (!ready() || !next_##name)                            \
			return CUDA_ERROR_NOT_FOUND;                     \
		int was = capturing(s); /* invalidated counts: it ends */ \
		CUresult r = next_##name(s, graph);                      \
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
	if (r == CUDA_SUCCESS && engine.active) {
		control_join();
		gate_enter();
		gate_leave();
	}
	return r;
}


/* ---- the table entry.c finds the driver's entry points by ------------------- */

#define ENTRY_GATED(name, params, args) {#name, (void *)name, (void **)&next_##name},
#define ENTRY_REFUSING(name, why, params, args) {#name, (void *)name, (void **)&next_##name},
#define ENTRY(name, real) {#name, (void *)name, (void **)&real},

struct hook hooks[] = {
	GATED(ENTRY_GATED)
	REFUSING(ENTRY_REFUSING)
	ENTRY(cuMemAlloc_v2, next_cuMemAlloc_v2)
	ENTRY(cuMemAllocPitch_v2, next_cuMemAllocPitch_v2)
	ENTRY(cuMemFree_v2, next_cuMemFree_v2)
	ENTRY(cuMemAllocAsync, next_cuMemAllocAsync)
	ENTRY(cuMemAllocAsync_ptsz, next_cuMemAllocAsync_ptsz)
	ENTRY(cuMemFreeAsync, next_cuMemFreeAsync)
	ENTRY(cuMemFreeAsync_ptsz, next_cuMemFreeAsync_ptsz)
	ENTRY(cuMemAllocFromPoolAsync, next_cuMemAllocFromPoolAsync)
	ENTRY(cuMemAllocFromPoolAsync_ptsz, next_cuMemAllocFromPoolAsync_ptsz)
	ENTRY(cuMemGetAddressRange_v2, next_cuMemGetAddressRange_v2)
	ENTRY(cuMemCreate, real_cuMemCreate)
	ENTRY(cuMemRelease, real_cuMemRelease)
	ENTRY(cuMemMap, real_cuMemMap)
	ENTRY(cuMemUnmap, real_cuMemUnmap)
	ENTRY(cuMemSetAccess, real_cuMemSetAccess)
	ENTRY(cuMemRetainAllocationHandle, next_cuMemRetainAllocationHandle)
	ENTRY(cuMemGetAllocationPropertiesFromHandle, next_cuMemGetAllocationPropertiesFromHandle)
	ENTRY(cuMemExportToShareableHandle, next_cuMemExportToShareableHandle)
	ENTRY(cuStreamBeginCapture, next_cuStreamBeginCapture)
	ENTRY(cuStreamBeginCapture_ptsz, next_cuStreamBeginCapture_ptsz)
	ENTRY(cuStreamBeginCapture_v2, next_cuStreamBeginCapture_v2)
	ENTRY(cuStreamBeginCapture_v2_ptsz, next_cuStreamBeginCapture_v2_ptsz)
	ENTRY(cuStreamBeginCaptureToGraph, next_cuStreamBeginCaptureToGraph)
	ENTRY(cuStreamBeginCaptureToGraph_ptsz, next_cuStreamBeginCaptureToGraph_ptsz)
	ENTRY(cuStreamEndCapture, next_cuStreamEndCapture)
	ENTRY(cuStreamEndCapture_ptsz, next_cuStreamEndCapture_ptsz)
	ENTRY(cuInit, real_cuInit)
};
const size_t nhooks = sizeof hooks / sizeof *hooks;

atomic_int is_ready;
static pthread_once_t fill_once = PTHREAD_ONCE_INIT;
static void *driver;

static void fill(void)
{
	for (size_t i = 0; i < nhooks; i++)
		*hooks[i].real = real_dlsym(driver, hooks[i].name);
}

int hooks_found(void *lib, int load)
{
	void *found = find_driver(lib, load);
	if (!found || driver_resolving())
		return found != NULL;
	driver = found;
	pthread_once(&fill_once, fill);
	atomic_store_explicit(&is_ready, 1, memory_order_release);
	return 1;
}

int get_ready(void)
{
	return hooks_found(NULL, 1);
}
