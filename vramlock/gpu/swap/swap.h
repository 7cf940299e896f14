/*
 * libvramlock-swap's one internal header: the driver's types (no CUDA headers are
 * needed), the state every part shares, and each part's entry points.
 *
 * The library, put in front of an unmodified CUDA program (LD_PRELOAD) by
 * `vramlock run --release swap`, lets the program give its device memory back
 * while it keeps running, and take it back later at the same addresses:
 *
 * Its parts, from the top (what the program calls) down; each calls only those
 * below it:
 *
 *  entry.c    dlsym and cuGetProcAddress: the program gets our wrappers for the
 *             entry points we care about
 *  exec.c     what the process execs or spawns keeps the library
 *  hooks.c    the wrappers (hooks.h): through the gate, allocations served by table.c,
 *             and what makes a process impossible to swap (refused)
 *  start.c    set-up: the engine registered with control, the driver found
 *  engine.c   swapping out to pinned host memory and back in: what each word of the
 *             wrapper does (core/control.h's engine_ops)
 *  prepare.c  the host copies made ready, and copied, ahead of a release
 *  delta.c    what a release copies: only the segments that changed (digest.h)
 *  copy.c     the copies themselves, on streams of our own
 *  table.c    allocations (virtual memory management, slabs) and their tables
 *  hostcopy.c each allocation's pinned host copy: made, locked, unlocked, freed
 *  driver.c   the driver's entry points the library calls itself
 *
 * and, below them all, the engine's core, the Vulkan layer's too (../core): the
 * process's state and its transitions, the gate, the connection to the wrapper
 * (VRAMLOCK_SWAP_SOCKET), host memory, the member record of an orphan.
 *
 * Without VRAMLOCK_SWAP_SOCKET the library stays out of the way: every hook
 * passes straight to the driver.
 */
#ifndef VRAMLOCK_SWAP_H
#define VRAMLOCK_SWAP_H

#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "../core/control.h"
#include "../core/gate.h"
#include "../core/hostmem.h"
#include "../core/proc.h"
#include "../core/state.h"

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
	CU_MEMHOSTALLOC_DEVICEMAP = 2,
	CU_STREAM_NON_BLOCKING = 1,
	CU_STREAM_CAPTURE_STATUS_NONE = 0,
	CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM = 2,
};

/* ---- driver.c: the driver's entry points ----------------------------------------- */

const char *errname(CUresult r);
/* At set-up: the C library's own dlsym found. */
void driver_setup(void);
/* The C library's dlsym (ours is the program's), from driver_setup on. */
extern void *(*real_dlsym)(void *, const char *);
/* Finds the driver: loaded already, `lib` when it is one, or (`load`) loaded now;
 * its handle, or NULL. */
void *driver_find(void *lib, int load);
/* Whether this thread is finding the driver (dlopen may look names up itself). */
int driver_resolving(void);

/* Real driver entry points the library calls itself (defined in driver.c). Those the
 * program's calls go through are hooks.c's, the same functions: the library's own
 * calls never pass the gate. */
#define DRIVER(X)                                                                                   \
	X(cuInit, (unsigned), 0)                                                                    \
	X(cuCtxGetCurrent, (CUcontext *), 0)                                                        \
	X(cuCtxSetCurrent, (CUcontext), 0)                                                          \
	X(cuCtxGetDevice, (CUdevice *), 0)                                                          \
	X(cuCtxSynchronize, (void), 0)                                                              \
	X(cuDeviceGetCount, (int *), 1)                                                             \
	X(cuDeviceCanAccessPeer, (int *, CUdevice, CUdevice), 1)                                    \
	X(cuDevicePrimaryCtxRetain, (CUcontext *, CUdevice), 0)                                     \
	X(cuStreamCreate, (CUstream *, unsigned), 0)                                                \
	X(cuStreamSynchronize, (CUstream), 0)                                                       \
	X(cuStreamIsCapturing, (CUstream, int *), 1)                                                \
	X(cuMemHostAlloc, (void **, size_t, unsigned), 0)                                           \
	X(cuMemFreeHost, (void *), 0)                                                               \
	X(cuMemHostRegister_v2, (void *, size_t, unsigned), 1)                                      \
	X(cuMemHostUnregister, (void *), 1)                                                         \
	X(cuMemAddressReserve, (CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long), 0) \
	X(cuMemAddressFree, (CUdeviceptr, size_t), 0)                                               \
	X(cuMemGetAllocationGranularity, (size_t *, const CUmemAllocationProp *, int), 0)           \
	X(cuMemCreate,                                                                              \
	  (CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *, unsigned long long), \
	  0)                                                                                        \
	X(cuMemRelease, (CUmemGenericAllocationHandle), 0)                                          \
	X(cuMemMap, (CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long), \
	  0)                                                                                        \
	X(cuMemUnmap, (CUdeviceptr, size_t), 0)                                                     \
	X(cuMemSetAccess, (CUdeviceptr, size_t, const CUmemAccessDesc *, size_t), 0)                \
	X(cuMemcpyDtoHAsync_v2, (void *, CUdeviceptr, size_t, CUstream), 0)                         \
	X(cuMemcpyHtoDAsync_v2, (CUdeviceptr, const void *, size_t, CUstream), 0)                   \
	X(cuGetErrorString, (CUresult, const char **), 0)                                          \
	X(cuModuleGetFunction, (CUfunction *, void *, const char *), 1)                             \
	X(cuMemHostGetDevicePointer_v2, (CUdeviceptr *, void *, unsigned), 1)                       \
	X(cuModuleLoadData, (void **, const void *), 1)                                             \
	X(cuCtxGetLimit, (size_t *, int), 1)                                                        \
	X(cuCtxSetLimit, (int, size_t), 1)                                                          \
	X(cuLaunchKernel, (CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,  \
			   unsigned, CUstream, void **, void **), 1)                                \
	X(cuGetProcAddress, (const char *, void **, int, cuuint64_t), 1)                            \
	X(cuGetProcAddress_v2, (const char *, void **, int, cuuint64_t, int *), 1)

#define DECLARE_DRIVER(name, params, optional) extern CUresult(*real_##name) params;
DRIVER(DECLARE_DRIVER)

/* ---- table.c: what the library keeps track of -------------------------------- */

static inline size_t round_up(size_t n, size_t to)
{
	return (n + to - 1) / to * to;
}

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
	void *prep_base;                    /* host memory of ours (hostcopy.c), else NULL */
	size_t prep_len, prep_done;         /* its length, and the bytes locked so far */
	size_t pinned;                      /* of those, locked now (host_unpin_all undoes it) */
	int prep_failed;                    /* could not be made ready ahead: the release will */
	/* Copied ahead (prepare.c): the host copy's first `pre_done` bytes came from the GPU
	 * while the program was idle, and the first `pre_hashed` are digested (by the kernel
	 * reading the host copy, else on the CPU: `pre_cpu`) into `pre_digest` (for
	 * `pre_len` bytes from offset 0), begun before release number `pre_release` (a
	 * release in between makes them nothing). */
	size_t pre_done, pre_hashed, pre_len;
	uint64_t *pre_digest;
	unsigned long pre_release;
	int pre_failed, pre_cpu;
	double pre_ms;                      /* spent digesting it so far */
	CUdeviceptr copy_va;                /* during a swap: where it is (or was) mapped */
	size_t copy_len;
	CUdeviceptr temp_va;                /* a mapping made just for the copy, if any */
	int lost;                           /* released by a swap that then failed */
	uint64_t *digest;                   /* what `host` holds: one per segment (delta.c) */
	size_t digest_len;                  /* the bytes `digest` describes, from offset 0 */
	void *digest_host;                  /* the `host` it describes */
	size_t fresh;                       /* during a release: its new digests in delta.c's
					       scratch, at fresh - 1; 0: none */
};

/* A mapping of (part of) a physical allocation at a virtual address. */
struct mapping {
	CUdeviceptr va;
	size_t size, offset;
	struct phys *phys;
	CUmemAccessDesc *access; /* as last set by the program (or by us) */
	size_t naccess;
};

#define MAX_DEVICES 64
#define MAX_CONTEXTS 16

extern struct phys *physes;
extern double table_changed_ms; /* when an allocation last came or went (prepare.c) */
extern struct mapping *maps;
extern size_t nmaps;
/* Streams capturing a CUDA graph now (a capture starts at the gate only). */
extern atomic_int captures;

size_t map_index(CUdeviceptr key);
struct mapping *mapping_at(CUdeviceptr p);
int device_reads(const struct mapping *m, CUdevice dev);
int add_mapping(CUdeviceptr va, size_t size, size_t offset, struct phys *p);
void forget_mappings(CUdeviceptr va, size_t size);
int set_access(struct mapping *m, const CUmemAccessDesc *desc, size_t n);
struct phys *phys_by_handle(unsigned long long h);
struct phys *phys_new(size_t size, const CUmemAllocationProp *prop, CUcontext ctx);
void phys_destroy(struct phys *p);
CUmemAccessDesc device_access(CUdevice dev);
CUresult granularity(CUdevice dev, size_t *g);
int region_of(CUdeviceptr p, CUdeviceptr *base, size_t *size);
int is_own(CUdeviceptr ptr);
CUresult own_alloc(CUdeviceptr *dptr, size_t size);
int own_free(CUdeviceptr ptr);
void table_forget(void);

/* ---- hostcopy.c: each allocation's pinned host copy ----------------------------- */

/* The most one copy moves: copies never cross a multiple of it in an allocation, so
 * that each lies in one locked chunk of a host copy. */
#define COPY_CHUNK (32ULL << 20)

CUresult prepare_step(struct phys *p);
CUresult prepare_all(struct phys *p);
void host_free(struct phys *p);
size_t host_unpin(struct phys *p);
void host_pin_to(struct phys *p, size_t end);

/* ---- copy.c: the copies, on streams of our own ---------------------------------- */

CUresult streams_of(CUcontext ctx, CUstream **out);
CUresult sync_all(int ours_only);
CUresult copy_span(struct phys *p, size_t off, size_t len, int out, size_t *turn);
/* The contexts that own tracked memory, each once, into `seen`: how many. */
size_t memory_contexts(CUcontext seen[MAX_CONTEXTS]);
void copy_forget(void);

/* ---- delta.c: what a release copies ---------------------------------------------- */

/* Copies out what changed since the host copy was made (all of it the first time, or
 * when the digest kernel cannot run); the bytes copied in `copied`. */
CUresult copy_changed(size_t *copied);
void delta_forget(void);
const uint64_t *delta_keys(void);
int delta_warm(CUcontext ctx);
CUresult delta_digest_host(CUcontext ctx, const void *host, size_t n, uint64_t *out);

/* ---- prepare.c: host copies made ready, and copied, ahead ------------------------- */

extern int prepare_wanted; /* VRAMLOCK_SWAP_PREPARE is not 0 (read at start) */
void prepare_start(void);
void prepare_forget(void);

/* ---- engine.c: swapping ------------------------------------------------------------ */

extern int stack_wanted; /* VRAMLOCK_SWAP_STACK is not 0 (read at start) */
/* What the wrapper's words do (core/control.h), registered by start.c. */
extern const struct engine_ops cuda_engine;

/* ---- start.c and exec.c ------------------------------------------------------------ */

void library_setup(void); /* start.c: once, before anything else */
/* Set up, and the driver found (`lib`, `load`: driver_find's): its handle, or NULL. */
void *find_driver(void *lib, int load);

#endif
