/*
 * libvramlock-swap's one internal header: the driver's types (no CUDA headers are
 * needed), the state every part shares, and each part's entry points.
 *
 * The library, put in front of an unmodified CUDA program (LD_PRELOAD) by
 * `vramlock run --release swap`, lets the program give its device memory back
 * while it keeps running, and take it back later at the same addresses:
 *
 *  entry.c   set-up, finding the driver, dlsym and cuGetProcAddress: the program
 *            gets our wrappers for the entry points we care about
 *  hooks.c   the wrappers: through the gate, allocations served by table.c, and
 *            what makes a process impossible to swap (refused)
 *  gate.c    the in-flight counter that blocks GPU work while released
 *  table.c   allocations (virtual memory management, slabs) and their tables
 *  engine.c  swapping out to pinned host memory and back in
 *  delta.c   what a release copies: only the segments that changed (digest.h)
 *  hostmem.c whether the host has the memory a release would pin
 *  prepare.c the host copies made ready ahead of the first release
 *  exec.c    what the process execs or spawns keeps the library
 *  control.c the connection to the wrapper (VRAMLOCK_SWAP_SOCKET)
 *  record.c  the member record a process writes when its wrapper is gone
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

/* ---- diagnostics: on failure only, or with VRAMLOCK_SWAP_DEBUG=1 ----------- */

extern int debug_on;
void say(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

#define TRACE(...)                      \
	do {                            \
		if (debug_on)           \
			say(__VA_ARGS__); \
	} while (0)

/* ---- entry.c: finding the driver ---------------------------------------------- */

/* Every hooked entry point: the name the driver exports, our wrapper, and where
 * the real one is kept (hooks.c's table). Filled once libcuda is there. */
struct hook {
	const char *name;
	void *wrapper;
	void **real;
};
extern struct hook hooks[];
extern const size_t nhooks;

/* Set when the library is to act (VRAMLOCK_SWAP_SOCKET given). */
extern int active;
const char *errname(CUresult r);
int get_ready(void);
extern atomic_int is_ready;
EXPORT CUresult cuGetProcAddress(const char *, void **, int, cuuint64_t);
EXPORT CUresult cuGetProcAddress_v2(const char *, void **, int, cuuint64_t, int *);
extern CUresult (*real_cuGetProcAddress)(const char *, void **, int, cuuint64_t);
extern CUresult (*real_cuGetProcAddress_v2)(const char *, void **, int, cuuint64_t, int *);

/* Every hook asks first: one load once set up (a launch-bound program calls hooks
 * some hundred thousand times a second). */
static inline __attribute__((always_inline)) int ready(void)
{
	return __builtin_expect(atomic_load_explicit(&is_ready, memory_order_acquire), 1) ||
	       get_ready();
}

/* Real driver entry points the library calls itself; the hooked ones among them
 * are the same pointers as the hook table's (defined in hooks.c). */
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
	X(cuMemHostGetDevicePointer_v2, (CUdeviceptr *, void *, unsigned), 1)

#define DECLARE_DRIVER(name, params, optional) extern CUresult(*real_##name) params;
DRIVER(DECLARE_DRIVER)

/* Hooked (hooks.c's GATED): the library's own calls of these go to the driver direct. */
extern CUresult (*real_cuModuleLoadData)(void **, const void *);
extern CUresult (*real_cuCtxGetLimit)(size_t *, int);
extern CUresult (*real_cuCtxSetLimit)(int, size_t);
extern CUresult (*real_cuLaunchKernel)(CUfunction, unsigned, unsigned, unsigned, unsigned,
				       unsigned, unsigned, unsigned, CUstream, void **, void **);

/* ---- gate.c ------------------------------------------------------------------
 * Open: a call increments `inflight`, sees the gate open and goes on, no lock.
 * A release sets `closed`, then waits for `inflight` to reach 0. Both sides use
 * sequentially consistent atomics, so either the caller sees `closed` (and steps
 * back out) or the releaser sees the caller in flight (and waits for it). */

extern pthread_mutex_t mu; /* the gate's waits and every table */
extern atomic_int closed;
extern atomic_long inflight;
/* Calls that entered the gate, ever: prepare.c tells an idle program by it. */
extern atomic_ulong gate_entries;

/* The fast paths are inlined into every hook; what waits is not. */
#define INLINE static inline __attribute__((always_inline))

void wake_releaser(void);
void wait_for_open_gate(void);
void gate_close_locked(void);
void gate_open_locked(void);
/* The name of gate_unjoined's mapping (vramlock/strategies/swap.py looks for it). */
#define UNJOINED "vramlock-swap-unjoined"
/* The name of gate_set_up's mapping: the library has set up in this image (kept until
 * exec; a process without it may still be running other libraries' constructors). */
#define SET_UP "vramlock-swap-set-up"
/* The name of gate_unreached's mapping, ":<errno>" after it: the process could not reach
 * the wrapper and runs without swap (kept until exec; a forked child keeps it too). */
#define UNREACHED "vramlock-swap-unreached"
/* The exit status of a process that cannot reach the wrapper under --release swap. */
#define UNREACHED_STATUS 1
void gate_set_up(void);
void gate_unreached(int err);
void gate_unjoined(void);
void gate_joined_locked(int resident);
void gate_break(void);
void gate_after_fork(int join);

INLINE void gate_leave(void)
{
	if (__builtin_expect(atomic_fetch_sub(&inflight, 1) == 1 && atomic_load(&closed), 0))
		wake_releaser();
}

INLINE void gate_enter(void)
{
	atomic_fetch_add_explicit(&gate_entries, 1, memory_order_relaxed);
	for (;;) {
		atomic_fetch_add(&inflight, 1);
		if (__builtin_expect(!atomic_load(&closed), 1))
			return;
		wait_for_open_gate();
	}
}

/* ---- table.c: what the library keeps track of -------------------------------- */

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
	void *prep_base;                    /* host memory of ours (prepare.c), else NULL */
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
extern int released;
extern char refused[160]; /* why this process cannot be swapped, once known */

void refuse(const char *why);
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
size_t round_up(size_t n, size_t to);
int region_of(CUdeviceptr p, CUdeviceptr *base, size_t *size);
int is_own(CUdeviceptr ptr);
CUresult own_alloc(CUdeviceptr *dptr, size_t size);
int own_free(CUdeviceptr ptr);
void table_forget(void);

/* ---- engine.c: swapping ------------------------------------------------------- */

/* The most one copy moves: copies never cross a multiple of it in an allocation, so
 * that each lies in one locked chunk of a host copy (prepare.c). */
#define COPY_CHUNK (32ULL << 20)

/* Streams capturing a CUDA graph now (a capture starts at the gate only). */
extern atomic_int captures;

extern int stack_wanted; /* VRAMLOCK_SWAP_STACK is not 0 (read at start) */
void do_release(char *answer, size_t len, int stay_closed);
void engine_forget(void);
void do_restore(char *answer, size_t len);
CUresult streams_of(CUcontext ctx, CUstream **out);
CUresult sync_all(int ours_only);
CUresult copy_span(struct phys *p, size_t off, size_t len, int out, size_t *turn);
double now_ms(void);

/* delta.c: copies out what changed since the host copy was made (all of it the first
 * time, or when the digest kernel cannot run); the bytes copied in `copied`. */
CUresult copy_changed(size_t *copied);
void delta_forget(void);
const uint64_t *delta_keys(void);
int delta_warm(CUcontext ctx);
CUresult delta_digest_host(CUcontext ctx, const void *host, size_t n, uint64_t *out);
/* Releases begun so far (engine.c): what was made ahead of one is stale after it. */
extern unsigned long release_count;

/* ---- hostmem.c: host memory before pinning ------------------------------------- */

/* CUDA_SUCCESS when the release may pin the host memory it needs (allocations without
 * a pinned copy yet), else CUDA_ERROR_OUT_OF_MEMORY with *step saying why. */
CUresult hostmem_check(const char **step);
/* Whether `need` more bytes may be pinned (else why, in *why when not NULL). */
int hostmem_spare(unsigned long long need, const char **why);

/* ---- prepare.c: host copies made ready ahead ----------------------------------- */

extern int prepare_wanted; /* VRAMLOCK_SWAP_PREPARE is not 0 (read at start) */
CUresult prepare_step(struct phys *p);
CUresult prepare_all(struct phys *p);
void host_free(struct phys *p);
size_t host_unpin_all(void);
void host_pin_to(struct phys *p, size_t end);
void host_pin_all(void);
void prepare_start(void);
void prepare_forget(void);
/* `mu` for the control thread: it goes before the preparer's next step. */
void control_lock(void);

/* ---- exec.c: the library kept across exec ------------------------------------- */

void library_setup(void); /* entry.c: once, before anything else */
void exec_setup(void *(*lookup)(void *, const char *));

/* ---- control.c and record.c ---------------------------------------------------- */

extern pthread_once_t connect_once;
int control_setup(void);
const char *setting(const char *name, char *buf, size_t size);
void connect_control(void);
int start_thread(void *(*fn)(void *));
void join_now(void);
void before_fork(void);
void after_fork_parent(void);
void after_fork_child(void);
void write_orphan_record(void);
ssize_t read_proc(const char *path, char *buf, size_t size);
int proc_stat(int pid, char *state, unsigned long long *start);

#endif
