/*
 * The fake libcuda.so.1's host side (see fake_libcuda.c): pinned and registered host
 * memory, copies, kernel launches (each logged with its times) and the swap library's
 * digest kernel, computed on the host with digest.h's reference.
 */
#include "fake_cuda.h"

#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "digest.h"

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
