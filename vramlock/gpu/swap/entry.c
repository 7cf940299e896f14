/*
 * entry.c: set-up, and how the program reaches our wrappers. The CUDA runtime finds
 * the driver through dlopen + dlsym and, since CUDA 11.3, through cuGetProcAddress; a
 * program may also link libcuda. So dlsym, cuGetProcAddress(_v2) and the hooked
 * cu* symbols themselves are exported; the real entry points come from libcuda's
 * own handle.
 */
#include "swap.h"

/* ---- diagnostics: on failure only, or with VRAMLOCK_SWAP_DEBUG=1 ----------- */

int debug_on;

void say(const char *fmt, ...)
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

/* Set when the library is to act (VRAMLOCK_SWAP_SOCKET given). */
int active;
static pthread_mutex_t resolve_mu = PTHREAD_MUTEX_INITIALIZER;
static __thread int resolving __attribute__((tls_model("initial-exec"))); /* dlopen of libcuda may look names up itself */
static void *libcuda;

const char *errname(CUresult r)
{
	const char *s = NULL;
	if (real_cuGetErrorString && real_cuGetErrorString(r, &s) == CUDA_SUCCESS && s)
		return s;
	return "unknown error";
}

/* Once, from our constructor or from the first hook called, whichever comes first:
 * another library's constructor may look the driver up before ours has run. */
static pthread_once_t setup_once = PTHREAD_ONCE_INIT;
static void resolve(void *lib, int load);

static void setup(void)
{
	const char *dbg = getenv("VRAMLOCK_SWAP_DEBUG");
	debug_on = dbg && *dbg && strcmp(dbg, "0");
	gate_set_up();
	active = control_setup();
	if (active)
		gate_unjoined();
	find_real_dlsym();
	exec_setup(real_dlsym);
	pthread_atfork(before_fork, after_fork_parent, after_fork_child);
}

void library_setup(void)
{
	pthread_once(&setup_once, setup);
}

__attribute__((constructor)) static void init(void)
{
	pthread_once(&setup_once, setup);
}

/* Set once the driver is found: every hook reads it first (ready()). */
atomic_int is_ready;

/* Is the driver there (looked for in `lib` too, loaded when `load`)? */
static int find_driver(void *lib, int load)
{
	pthread_once(&setup_once, setup);
	resolve(lib, load);
	if (libcuda)
		atomic_store_explicit(&is_ready, 1, memory_order_release);
	return libcuda != NULL;
}

int get_ready(void)
{
	return find_driver(NULL, 1);
}

CUresult (*real_cuGetProcAddress)(const char *, void **, int, cuuint64_t);
CUresult (*real_cuGetProcAddress_v2)(const char *, void **, int, cuuint64_t, int *);

/* The driver functions the library calls itself; the hooked ones among them are
 * the same pointers as the hook table's. */
static const struct {
	const char *name;
	void **slot;
	int optional; /* the library works without it, if not as well */
} internal[] = {
#define INTERNAL(name, params, optional) {#name, (void **)&real_##name, optional},
	DRIVER(INTERNAL)
};

/* Takes the driver's entry points from `lib`. With resolve_mu. */
static void resolve_in(void *lib)
{
	for (size_t i = 0; i < nhooks; i++)
		*hooks[i].real = real_dlsym(lib, hooks[i].name);
	int missing = 0;
	for (size_t i = 0; i < sizeof internal / sizeof *internal; i++) {
		*internal[i].slot = real_dlsym(lib, internal[i].name);
		if (!*internal[i].slot && !internal[i].optional) {
			say("the driver has no %s", internal[i].name);
			missing = 1;
		}
	}
	if (missing && active) {
		say("this driver cannot be swapped: GPU calls stay blocked");
		gate_break();
	}
	libcuda = lib;
}

/* A library the program looks a driver name up in, if it is a driver (not ours). */
static void *driver_in(void *lib)
{
	if (lib == RTLD_DEFAULT || lib == RTLD_NEXT)
		return NULL;
	void *gpa = real_dlsym(lib, "cuGetProcAddress");
	return gpa && gpa != (void *)cuGetProcAddress ? lib : NULL;
}

/* Finds the driver: loaded already (RTLD_NOLOAD finds it by the name it goes by), `lib`
 * when that is one (a driver opened by its path), or, with `load`, loaded now (a
 * program calling our exports as its libcuda). Not found, it is looked for again next
 * time: a program may look up a cu... name (libc's cuserid) long before it loads the
 * driver, which must not then run unhooked. */
static void resolve(void *lib, int load)
{
	static int said;
	if (resolving)
		return; /* dlopen of libcuda may look names up itself */
	pthread_mutex_lock(&resolve_mu);
	resolving = 1;
	void *found = libcuda ? NULL : dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
	if (!libcuda && !found)
		found = driver_in(lib);
	if (!libcuda && !found && load && !(found = dlopen("libcuda.so.1", RTLD_NOW)) && !said++)
		say("cannot load libcuda.so.1: %s", dlerror());
	if (!libcuda && found)
		resolve_in(found);
	resolving = 0;
	pthread_mutex_unlock(&resolve_mu);
}

/* Our wrapper for the real entry point `fn`, or NULL. By address: the driver's
 * own versioning (cuMemAlloc at 3020 is cuMemAlloc_v2, _ptsz for per-thread
 * streams, ...) has already chosen the function. */
static void *wrapper_of(void *fn)
{
	for (size_t i = 0; i < nhooks; i++)
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
	if (!fn || !(atomic_load_explicit(&is_ready, memory_order_acquire) || find_driver(handle, 0)))
		return fn;
	void *w = wrapper_of(fn);
	TRACE("dlsym %s: %s", name, w ? "hooked" : "driver's");
	return w ? w : fn;
}

static void *wrapper_named(const char *name)
{
	for (size_t i = 0; i < nhooks; i++)
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
