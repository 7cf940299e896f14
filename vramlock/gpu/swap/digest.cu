/*
 * digest.cu: the segment digest on the GPU (digest.h defines it). One block per
 * segment; thread t reads the 16-byte pieces t, t + T, t + 2T, ... (T threads: the
 * warp's reads are contiguous) and sums their terms with Horner's rule in k^(4T), then
 * scales by k^(4t); the block adds the threads' sums.
 *
 * Compiled to PTX by gen_digest.py (the PTX is committed, in digest_ptx.h): a change
 * here means running it again, which a test checks.
 */
#include "digest.h"

#define PIECES (DIGEST_SEGMENT / 16) /* 16-byte pieces in a segment */

/* The terms of one 16-byte piece: w0 + w1 k + w2 k^2 + w3 k^3. */
__device__ __forceinline__ uint64_t piece(uint4 v, uint64_t k, uint64_t k2, uint64_t k3)
{
	return digest_add(digest_add(v.x, digest_mul(v.y, k)),
			  digest_add(digest_mul(v.z, k2), digest_mul(v.w, k3)));
}

/* `data`: `nbytes` (a multiple of 16) of device memory; `out`: DIGEST_LANES values per
 * segment, written where the host reads them (mapped pinned memory). */
extern "C" __global__ void __launch_bounds__(DIGEST_THREADS)
vramlock_digest(const uint4 *__restrict__ data, unsigned long long nbytes,
		unsigned long long *__restrict__ out, unsigned long long k0,
		unsigned long long k1, unsigned long long k2, unsigned long long k3)
{
	__shared__ unsigned long long part[DIGEST_LANES][DIGEST_THREADS];
	const uint64_t key[DIGEST_LANES] = {k0, k1, k2, k3};
	const unsigned t = threadIdx.x;
	const size_t first = (size_t)blockIdx.x * PIECES, total = nbytes / 16;
	const size_t n = total - first < PIECES ? total - first : PIECES;
	uint64_t sq[DIGEST_LANES], cube[DIGEST_LANES], step[DIGEST_LANES], acc[DIGEST_LANES];
	for (int l = 0; l < DIGEST_LANES; l++) {
		sq[l] = digest_mul(key[l], key[l]);
		cube[l] = digest_mul(sq[l], key[l]);
		step[l] = digest_pow(key[l], 4 * DIGEST_THREADS);
		acc[l] = 0;
	}
	const uint4 *mine = data + first + t;
	for (size_t j = t < n ? (n - 1 - t) / DIGEST_THREADS + 1 : 0; j-- > 0;) {
		uint4 v = mine[j * DIGEST_THREADS];
		for (int l = 0; l < DIGEST_LANES; l++)
			acc[l] = digest_add(digest_mul(acc[l], step[l]), piece(v, key[l], sq[l], cube[l]));
	}
	for (int l = 0; l < DIGEST_LANES; l++)
		part[l][t] = digest_mul(acc[l], digest_pow(key[l], 4ULL * t));
	__syncthreads();
	for (unsigned s = DIGEST_THREADS / 2; s; s >>= 1) {
		if (t < s)
			for (int l = 0; l < DIGEST_LANES; l++)
				part[l][t] = digest_add(part[l][t], part[l][t + s]);
		__syncthreads();
	}
	if (t < DIGEST_LANES)
		out[(size_t)blockIdx.x * DIGEST_LANES + t] = part[t][0];
}
