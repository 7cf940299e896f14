/*
 * delta.c: what a release copies out. Weights and most of a server's memory do not
 * change between swaps, and the host copy of an allocation is kept from one release to
 * the next (after a restore the GPU holds what it holds). So at each release a kernel
 * of the library's own (digest.cu, its PTX in digest_ptx.h) digests every allocation in
 * segments of DIGEST_SEGMENT bytes, and only the segments whose digest differs from the
 * one taken at the previous release (which describes the host copy) are copied, runs of
 * them as one copy. The first release of an allocation copies it whole, and so does any
 * release where the kernel cannot run (a driver that cannot load the PTX): a digest
 * never fails a release. Runs with `mu` held, the gate closed and the program's work
 * synchronized (engine.c's copy_out); the kernel's launches are the driver's direct.
 */
#include "swap.h"

#include <sys/random.h>

#include "digest.h"
#include "digest_ptx.h"

/* The keys, drawn once per process (a forked child keeps its parent's: what matters is
 * that they are independent of the data). 0: not drawn yet; -1: cannot be. */
static uint64_t keys[DIGEST_LANES];
static int keyed;

/* The kernel in each context, loaded at its first release; NULL: it cannot be. */
static struct {
	CUcontext ctx;
	CUfunction fn;
} kernels[MAX_CONTEXTS];
static size_t nkernels;

/* Where the kernel writes its digests: pinned host memory it can reach (mapped). */
static uint64_t *scratch;
static size_t scratch_size;

void delta_forget(void)
{
	nkernels = 0;
	scratch = NULL; /* the parent's, not pinned here */
	scratch_size = 0;
}

static size_t segments(size_t len)
{
	return (len + DIGEST_SEGMENT - 1) / DIGEST_SEGMENT;
}

static int draw_keys(void)
{
	for (int l = 0; l < DIGEST_LANES && keyed == 0; l++) {
		do {
			if (getrandom(&keys[l], sizeof keys[l], 0) != sizeof keys[l]) {
				TRACE("digest: getrandom: %s: copying everything", strerror(errno));
				keyed = -1;
				break;
			}
			keys[l] &= DIGEST_P; /* uniform in [0, 2^61): redrawn unless in [1, P) */
		} while (keys[l] == 0 || keys[l] == DIGEST_P);
	}
	if (keyed == 0)
		keyed = 1;
	return keyed > 0;
}

/* The kernel in `ctx` (current), loaded the first time; NULL when it cannot be. */
static CUfunction kernel_in(CUcontext ctx)
{
	for (size_t i = 0; i < nkernels; i++)
		if (kernels[i].ctx == ctx)
			return kernels[i].fn;
	if (nkernels == MAX_CONTEXTS)
		return NULL;
	void *module = NULL;
	CUfunction fn = NULL;
	CUresult r = CUDA_ERROR_NOT_FOUND;
	if (real_cuModuleLoadData && real_cuModuleGetFunction && real_cuLaunchKernel &&
	    real_cuMemHostGetDevicePointer_v2)
		r = real_cuModuleLoadData(&module, digest_ptx);
	if (!r)
		r = real_cuModuleGetFunction(&fn, module, DIGEST_NAME);
	if (r) {
		TRACE("digest: the kernel cannot be loaded (%s): copying everything", errname(r));
		fn = NULL;
	}
	kernels[nkernels].ctx = ctx;
	kernels[nkernels++].fn = fn;
	return fn;
}

/* May the kernel read `p` where it is to be copied from, in its own context? Its device
 * must be the memory's, with access to the mapping (one of ours has it). */
static int readable(struct phys *p)
{
	CUdevice dev;
	if (p->copy_len % 16 || real_cuCtxGetDevice(&dev) || dev != p->prop.location.id)
		return 0;
	if (p->temp_va)
		return 1;
	struct mapping *m = mapping_at(p->copy_va);
	return m && m->va == p->copy_va && device_reads(m, dev);
}

/* Room for `bytes` of digests in the scratch buffer (pinned with `ctx` current). */
static int scratch_for(size_t bytes)
{
	if (bytes <= scratch_size)
		return 1;
	if (scratch)
		real_cuMemFreeHost(scratch);
	scratch = NULL;
	scratch_size = 0;
	CUresult r = real_cuMemHostAlloc((void **)&scratch, bytes,
					 CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP);
	if (r) {
		TRACE("digest: no pinned memory for %zu bytes of digests (%s)", bytes, errname(r));
		scratch = NULL;
		return 0;
	}
	scratch_size = bytes;
	return 1;
}

/* Queues the kernel in `ctx` over `len` bytes at `va` (device memory, or host memory
 * mapped for the device), its digests to the scratch at `at` (values), on the context's
 * first copy stream (in `stream`). */
static CUresult launch_over(CUcontext ctx, CUfunction fn, CUdeviceptr va, size_t len, size_t at,
			    CUstream *stream)
{
	CUstream *streams;
	CUdeviceptr out;
	CUresult r = streams_of(ctx, &streams);
	if (!r)
		r = real_cuCtxSetCurrent(ctx);
	if (!r)
		r = real_cuMemHostGetDevicePointer_v2(&out, scratch + at, 0);
	if (r)
		return r;
	unsigned long long n = len;
	void *params[] = {&va, &n, &out, &keys[0], &keys[1], &keys[2], &keys[3]};
	*stream = streams[0];
	return real_cuLaunchKernel(fn, (unsigned)segments(len), 1, 1, DIGEST_THREADS, 1, 1, 0,
				   streams[0], params, NULL);
}

/* Queues the kernel over `p`, its digests to the scratch at `at` (values). */
static CUresult launch_digest(struct phys *p, CUfunction fn, size_t at)
{
	CUstream stream;
	return launch_over(p->ctx, fn, p->copy_va, p->copy_len, at, &stream);
}

/* Which allocations the kernel can digest: `fresh` set (where their digests will be),
 * in `need` the values there are. */
static void choose(size_t *need)
{
	*need = 0;
	for (struct phys *p = physes; p; p = p->next) {
		p->fresh = 0;
		if (!p->copy_len || real_cuCtxSetCurrent(p->ctx) || !readable(p) || !kernel_in(p->ctx))
			continue;
		p->fresh = *need + 1;
		*need += segments(p->copy_len) * DIGEST_LANES;
	}
}

/* Digests every allocation it can, into the scratch (`fresh` says where); none when
 * anything fails, the release going on without (everything copied). */
static void digest_all(void)
{
	size_t need = 0;
	double t0 = now_ms();
	if (draw_keys())
		choose(&need);
	CUresult r = need && scratch_for(need * sizeof *scratch) ? CUDA_SUCCESS : CUDA_ERROR_NOT_FOUND;
	for (struct phys *p = physes; p && !r; p = p->next)
		if (p->fresh)
			r = launch_digest(p, kernel_in(p->ctx), p->fresh - 1);
	if (!r)
		r = sync_all(1);
	if (r && need)
		TRACE("digest: %s: copying everything", errname(r));
	for (struct phys *p = physes; p && r; p = p->next)
		p->fresh = 0;
	if (!r)
		TRACE("digest: %zu segments in %.1f ms", need / DIGEST_LANES, now_ms() - t0);
}

/* The keys, drawn if need be; NULL when they cannot be (prepare.c). */
const uint64_t *delta_keys(void)
{
	return draw_keys() ? keys : NULL;
}

/* What a first release in `ctx` (current) would make: its copy streams and the
 * kernel, loaded (the PTX compiled) ahead; 0 when the kernel cannot be (prepare.c). */
int delta_warm(CUcontext ctx)
{
	CUstream *streams;
	return !streams_of(ctx, &streams) && !real_cuCtxSetCurrent(ctx) && kernel_in(ctx);
}

/* The digests of `n` bytes (a multiple of 16) of pinned, device-mapped host memory at
 * `host`, its segments counted from `host`, into `out`: the kernel in `ctx` reads them
 * across the bus, and is waited for. They are of what the host memory holds, as
 * digest_words gives them. With `mu` held (prepare.c: a host copy made ahead). */
CUresult delta_digest_host(CUcontext ctx, const void *host, size_t n, uint64_t *out)
{
	CUstream stream;
	CUdeviceptr in;
	CUfunction fn = NULL;
	size_t values = segments(n) * DIGEST_LANES;
	CUresult r = real_cuCtxSetCurrent(ctx);
	if (!r && (n % 16 || !draw_keys() || !(fn = kernel_in(ctx)) ||
		   !scratch_for(values * sizeof *scratch)))
		r = CUDA_ERROR_NOT_FOUND;
	if (!r)
		r = real_cuMemHostGetDevicePointer_v2(&in, (void *)host, 0);
	if (!r)
		r = launch_over(ctx, fn, in, n, 0, &stream);
	if (!r)
		r = real_cuStreamSynchronize(stream);
	if (!r)
		memcpy(out, scratch, values * sizeof *out);
	return r;
}

/* Does `p`'s host copy hold what its digests of the last release say? */
static int known(const struct phys *p)
{
	return p->fresh && p->digest && p->host && p->digest_host == p->host &&
	       p->digest_len == p->copy_len;
}

/* Queues the copy of `p`'s segments whose digest changed, runs of them as one copy. */
static CUresult copy_runs(struct phys *p, size_t *turn, size_t *copied)
{
	const size_t n = segments(p->copy_len), size = DIGEST_LANES * sizeof(uint64_t);
	const uint64_t *now = scratch + p->fresh - 1, *was = p->digest;
	CUresult r = CUDA_SUCCESS;
	for (size_t s = 0; s < n && !r;) {
		if (!memcmp(now + s * DIGEST_LANES, was + s * DIGEST_LANES, size)) {
			s++;
			continue;
		}
		size_t e = s + 1;
		while (e < n && memcmp(now + e * DIGEST_LANES, was + e * DIGEST_LANES, size))
			e++;
		size_t off = s * DIGEST_SEGMENT, end = e * DIGEST_SEGMENT;
		size_t len = (end < p->copy_len ? end : p->copy_len) - off;
		r = copy_span(p, off, len, 1, turn);
		*copied += len;
		s = e;
	}
	return r;
}

/* After the copies: the digests now describe the host copies (`ok`), or nothing does. */
static void keep_digests(int ok)
{
	for (struct phys *p = physes; p; p = p->next) {
		size_t values = segments(p->copy_len) * DIGEST_LANES;
		if (ok && p->fresh && p->digest_len != p->copy_len) {
			free(p->digest);
			p->digest = malloc(values * sizeof *p->digest);
		}
		if (ok && p->fresh && p->digest) {
			memcpy(p->digest, scratch + p->fresh - 1, values * sizeof *p->digest);
			p->digest_len = p->copy_len;
			p->digest_host = p->host;
		} else if (p->copy_len) { /* copied whole, or maybe half: unknown */
			free(p->digest);
			p->digest = NULL;
			p->digest_len = 0;
		}
		p->fresh = 0;
	}
}

CUresult copy_changed(size_t *copied)
{
	digest_all();
	size_t turn = 0;
	CUresult r = CUDA_SUCCESS;
	for (struct phys *p = physes; p && !r; p = p->next) {
		if (!p->copy_len)
			continue;
		if (known(p)) {
			r = copy_runs(p, &turn, copied);
		} else {
			r = copy_span(p, 0, p->copy_len, 1, &turn);
			*copied += p->copy_len;
		}
	}
	if (!r)
		r = sync_all(1);
	keep_digests(!r);
	return r;
}
