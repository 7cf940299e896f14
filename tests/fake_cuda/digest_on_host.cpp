/*
 * The swap library's digest kernel (vramlock/gpu/swap/digest.cu), its very source, run
 * on the host: each CUDA thread a thread of its own, __syncthreads a barrier, one block
 * at a time. It digests pseudo-random words (SEGMENTS segments and 48 bytes: a short last
 * one) and prints "ok <segments>" when every lane of every segment is what digest.h's
 * host reference gives, "MISMATCH ..." and exit 3 when one is not:
 *
 *   digest_on_host SEGMENTS
 *
 * Compile with -I vramlock/gpu/swap -pthread.
 */
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

struct uint4 {
	unsigned x, y, z, w;
};
static thread_local struct {
	unsigned x;
} threadIdx, blockIdx;
static pthread_barrier_t barrier;

#define __CUDACC__
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __restrict__
#define __shared__ static
#define __launch_bounds__(n)
#define __syncthreads() pthread_barrier_wait(&barrier)
#include "digest.cu"

struct launch {
	unsigned block, thread;
	void **params;
};

static void *run(void *arg)
{
	struct launch *l = (struct launch *)arg;
	void **p = l->params;
	blockIdx.x = l->block;
	threadIdx.x = l->thread;
	vramlock_digest(*(const uint4 **)p[0], *(unsigned long long *)p[1],
			*(unsigned long long **)p[2], *(unsigned long long *)p[3],
			*(unsigned long long *)p[4], *(unsigned long long *)p[5],
			*(unsigned long long *)p[6]);
	return NULL;
}

int main(int argc, char **argv)
{
	if (argc < 2)
		return 2;
	size_t bytes = (size_t)atol(argv[1]) * DIGEST_SEGMENT + 48, words = bytes / 4;
	size_t segs = (bytes + DIGEST_SEGMENT - 1) / DIGEST_SEGMENT;
	uint32_t *data = (uint32_t *)aligned_alloc(16, bytes);
	uint64_t *out = (uint64_t *)calloc(segs * DIGEST_LANES, 8);
	unsigned long long key[DIGEST_LANES] = {3, DIGEST_P - 5, 0x0123456789abcdefULL,
						 0x1000000000000001ULL};
	uint64_t x = 88172645463325252ULL;
	for (size_t i = 0; i < words; i++) { /* xorshift64 */
		x ^= x << 13, x ^= x >> 7, x ^= x << 17;
		data[i] = (uint32_t)(x >> 11);
	}
	unsigned long long n = bytes;
	void *params[] = {&data, &n, &out, &key[0], &key[1], &key[2], &key[3]};
	static pthread_t threads[DIGEST_THREADS];
	static struct launch launches[DIGEST_THREADS];
	pthread_barrier_init(&barrier, NULL, DIGEST_THREADS);
	for (unsigned b = 0; b < segs; b++) {
		for (unsigned t = 0; t < DIGEST_THREADS; t++) {
			launches[t] = (struct launch){b, t, params};
			if (pthread_create(&threads[t], NULL, run, &launches[t]))
				return 4;
		}
		for (unsigned t = 0; t < DIGEST_THREADS; t++)
			pthread_join(threads[t], NULL);
	}
	for (size_t s = 0; s < segs; s++) {
		size_t first = s * (DIGEST_SEGMENT / 4), left = words - first;
		uint64_t want[DIGEST_LANES], k[DIGEST_LANES] = {key[0], key[1], key[2], key[3]};
		digest_words(data + first, left < DIGEST_SEGMENT / 4 ? left : DIGEST_SEGMENT / 4, k, want);
		for (int l = 0; l < DIGEST_LANES; l++)
			if (out[s * DIGEST_LANES + l] != want[l]) {
				printf("MISMATCH segment %zu lane %d: %llx, not %llx\n", s, l,
				       (unsigned long long)out[s * DIGEST_LANES + l],
				       (unsigned long long)want[l]);
				return 3;
			}
	}
	printf("ok %zu\n", segs);
	return 0;
}
