/*
 * The swap library's digest kernel (its committed PTX) on a real GPU, against the host
 * reference of digest.h, for tests/test_gpu_swap.py:
 *
 *   gpu_digest MIB
 *
 * Fills MIB MiB and 48 bytes (a last, short segment) of device memory with
 * pseudo-random words, digests it on the GPU and on the host, and prints
 * "ok <segments> <GB/s>" (the kernel's rate, of a second run) when every lane of every
 * segment agrees; "MISMATCH ..." and exit 3 when one does not, exit 4 when a driver
 * call fails.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "digest.h"
#include "digest_ptx.h"

typedef int CUresult;
typedef unsigned long long CUdeviceptr;

static void *lib;

static void *get(const char *name)
{
	void *fn = dlsym(lib, name);
	if (!fn) {
		fprintf(stderr, "gpu_digest: no %s\n", name);
		exit(4);
	}
	return fn;
}

#define CALL(name, ...)                                                                   \
	do {                                                                              \
		CUresult r_ = ((CUresult(*)())get(#name))(__VA_ARGS__);                    \
		if (r_) {                                                                 \
			fprintf(stderr, "gpu_digest: %s: error %d\n", #name, r_);        \
			exit(4);                                                          \
		}                                                                         \
	} while (0)

static double now(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

int main(int argc, char **argv)
{
	if (argc < 2 || !(lib = dlopen("libcuda.so.1", RTLD_NOW)))
		return 4;
	size_t bytes = (size_t)atol(argv[1]) << 20 | 48, words = bytes / 4;
	size_t segs = (bytes + DIGEST_SEGMENT - 1) / DIGEST_SEGMENT;
	void *ctx, *module, *fn;
	CUdeviceptr data, out_dev;
	uint64_t *out, key[DIGEST_LANES] = {0x1234567, 0x1fffffffffffffffULL - 2, 987654321987ULL,
					    0x0123456789abcdefULL & DIGEST_P};
	uint32_t *host = malloc(bytes);
	uint64_t x = 88172645463325252ULL;
	for (size_t i = 0; host && i < words; i++) { /* xorshift64 */
		x ^= x << 13, x ^= x >> 7, x ^= x << 17;
		host[i] = (uint32_t)(x >> 11);
	}
	CALL(cuInit, 0);
	CALL(cuDevicePrimaryCtxRetain, &ctx, 0);
	CALL(cuCtxSetCurrent, ctx);
	CALL(cuModuleLoadData, &module, digest_ptx);
	CALL(cuModuleGetFunction, &fn, module, DIGEST_NAME);
	CALL(cuMemAlloc_v2, &data, bytes);
	CALL(cuMemcpyHtoD_v2, data, host, bytes);
	CALL(cuMemHostAlloc, (void **)&out, segs * DIGEST_LANES * 8, 3); /* portable, mapped */
	CALL(cuMemHostGetDevicePointer_v2, &out_dev, out, 0);
	unsigned long long n = bytes;
	void *params[] = {&data, &n, &out_dev, &key[0], &key[1], &key[2], &key[3]};
	double took = 0;
	for (int run = 0; run < 2; run++) {
		double t0 = now();
		CALL(cuLaunchKernel, fn, (unsigned)segs, 1, 1, DIGEST_THREADS, 1, 1, 0, NULL, params,
		     NULL);
		CALL(cuCtxSynchronize);
		took = now() - t0;
	}
	for (size_t s = 0; s < segs; s++) {
		size_t first = s * (DIGEST_SEGMENT / 4), n = words - first;
		uint64_t want[DIGEST_LANES];
		digest_words(host + first, n < DIGEST_SEGMENT / 4 ? n : DIGEST_SEGMENT / 4, key, want);
		for (int l = 0; l < DIGEST_LANES; l++)
			if (out[s * DIGEST_LANES + l] != want[l]) {
				printf("MISMATCH segment %zu lane %d: %llx, not %llx\n", s, l,
				       (unsigned long long)out[s * DIGEST_LANES + l],
				       (unsigned long long)want[l]);
				return 3;
			}
	}
	printf("ok %zu %.1f\n", segs, (double)bytes / took / 1e9);
	return 0;
}
