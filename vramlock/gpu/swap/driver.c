/*
 * driver.c: the driver's entry points the library calls itself, found in libcuda's
 * own handle with the C library's dlsym (ours is the program's: entry.c).
 */
#include "swap.h"

/* Defined here, once; hooks.c keeps its own for the program's calls. */
#define DEFINE_DRIVER(name, params, optional) CUresult(*real_##name) params;
DRIVER(DEFINE_DRIVER)

typedef void *(*dlsym_fn)(void *, const char *);
dlsym_fn real_dlsym;
static pthread_mutex_t resolve_mu = PTHREAD_MUTEX_INITIALIZER;
static __thread int resolving __attribute__((tls_model("initial-exec"))); /* dlopen of libcuda may look names up itself */
static void *libcuda;

void driver_setup(void)
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

int driver_resolving(void)
{
	return resolving;
}

const char *errname(CUresult r)
{
	const char *s = NULL;
	if (real_cuGetErrorString && real_cuGetErrorString(r, &s) == CUDA_SUCCESS && s)
		return s;
	return "unknown error";
}

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
	int missing = 0;
	for (size_t i = 0; i < sizeof internal / sizeof *internal; i++) {
		*internal[i].slot = real_dlsym(lib, internal[i].name);
		if (!*internal[i].slot && !internal[i].optional) {
			say("the driver has no %s", internal[i].name);
			missing = 1;
		}
	}
	if (missing && engine.active) {
		say("this driver cannot be swapped: GPU calls stay blocked");
		gate_break();
	}
	libcuda = lib;
}

/* A library the program looks a driver name up in, if it is a driver (not ours: the
 * library that holds this function exports cuGetProcAddress too). */
static void *driver_in(void *lib)
{
	Dl_info theirs, ours;
	if (lib == RTLD_DEFAULT || lib == RTLD_NEXT)
		return NULL;
	void *gpa = real_dlsym(lib, "cuGetProcAddress");
	if (!gpa)
		return NULL;
	if (dladdr(gpa, &theirs) && dladdr((void *)driver_in, &ours) &&
	    theirs.dli_fbase == ours.dli_fbase)
		return NULL;
	return lib;
}

/* Finds the driver: loaded already (RTLD_NOLOAD finds it by the name it goes by), `lib`
 * when that is one (a driver opened by its path), or, with `load`, loaded now (a
 * program calling our exports as its libcuda). Not found, it is looked for again next
 * time: a program may look up a cu... name (libc's cuserid) long before it loads the
 * driver, which must not then run unhooked. */
void *driver_find(void *lib, int load)
{
	static int said;
	if (resolving)
		return libcuda; /* dlopen of libcuda may look names up itself */
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
	return libcuda;
}
