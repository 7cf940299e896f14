/*
 * entry.c: how the program reaches our wrappers. The CUDA runtime finds the driver
 * through dlopen + dlsym and, since CUDA 11.3, through cuGetProcAddress; a program may
 * also link libcuda. So dlsym, cuGetProcAddress(_v2) and the hooked cu* symbols
 * themselves are exported; the real entry points come from libcuda's own handle
 * (driver.c, and hooks.c's table).
 */
#include "hooks.h"

EXPORT CUresult cuGetProcAddress(const char *, void **, int, cuuint64_t);
EXPORT CUresult cuGetProcAddress_v2(const char *, void **, int, cuuint64_t, int *);

/* cuGetProcAddress itself, beside hooks.c's table. */
static void *proc_wrapper(void *fn, const char *name)
{
	if ((fn && fn == (void *)real_cuGetProcAddress) || (name && !strcmp(name, "cuGetProcAddress")))
		return (void *)cuGetProcAddress;
	if ((fn && fn == (void *)real_cuGetProcAddress_v2) ||
	    (name && !strcmp(name, "cuGetProcAddress_v2")))
		return (void *)cuGetProcAddress_v2;
	return NULL;
}

/* Our wrapper for the real entry point `fn`, or NULL. By address: the driver's
 * own versioning (cuMemAlloc at 3020 is cuMemAlloc_v2, _ptsz for per-thread
 * streams, ...) has already chosen the function. */
static void *wrapper_of(void *fn)
{
	for (size_t i = 0; i < nhooks; i++)
		if (*hooks[i].real == fn)
			return hooks[i].wrapper;
	return proc_wrapper(fn, NULL);
}

EXPORT void *dlsym(void *handle, const char *name)
{
	library_setup();
	/* A tail call: glibc's dlsym finds RTLD_NEXT from its caller's address, which
	 * must stay the program's, not ours. */
	if (!engine.active || name[0] != 'c' || name[1] != 'u' || driver_resolving())
		return real_dlsym(handle, name);
	void *fn = real_dlsym(handle, name);
	if (!fn || !(atomic_load_explicit(&is_ready, memory_order_acquire) || hooks_found(handle, 0)))
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
	return proc_wrapper(NULL, name);
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
	if (r != CUDA_SUCCESS || !engine.active || !pfn || !*pfn || !symbol)
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
