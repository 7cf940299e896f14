/*
 * digest.h: the arithmetic of the segment digest, one implementation shared by the
 * GPU kernel (digest.cu), the library (delta.c) and the fake driver of the tests.
 *
 * A segment of DIGEST_SEGMENT bytes is read as n little-endian 32-bit words w_0..w_{n-1}.
 * Its digest is DIGEST_LANES values, one per key k (drawn at random, 1 <= k < P):
 *
 *     h_k = w_0 + w_1 k + w_2 k^2 + ... + w_{n-1} k^{n-1}   (mod P = 2^61 - 1)
 *
 * Two different segments of n words make the difference of their h_k a nonzero
 * polynomial in k of degree below n (every w_i < 2^32 < P), which has fewer than n
 * roots: one lane misses a change with probability below n / P, and all of them, with
 * independent keys, below (n / P)^DIGEST_LANES (docs/swap.md gives the figures).
 */
#ifndef VRAMLOCK_DIGEST_H
#define VRAMLOCK_DIGEST_H

#include <stddef.h>
#include <stdint.h>

#ifdef __CUDACC__
#define DIGEST_FN static __host__ __device__ __forceinline__
#else
#define DIGEST_FN static inline
#endif

#define DIGEST_P ((1ULL << 61) - 1)
#define DIGEST_LANES 4
#define DIGEST_SEGMENT (256u << 10)  /* bytes per digest */
#define DIGEST_THREADS 256           /* threads per block: one block per segment */
#define DIGEST_NAME "vramlock_digest" /* the kernel's name in the PTX */

/* (a * b) mod P, for a, b < P. */
DIGEST_FN uint64_t digest_mul(uint64_t a, uint64_t b)
{
	unsigned __int128 x = (unsigned __int128)a * b;
	uint64_t r = ((uint64_t)x & DIGEST_P) + (uint64_t)(x >> 61);
	return r >= DIGEST_P ? r - DIGEST_P : r;
}

/* (a + b) mod P, for a, b < P. */
DIGEST_FN uint64_t digest_add(uint64_t a, uint64_t b)
{
	uint64_t r = a + b;
	return r >= DIGEST_P ? r - DIGEST_P : r;
}

/* k^e mod P. */
DIGEST_FN uint64_t digest_pow(uint64_t k, uint64_t e)
{
	uint64_t r = 1;
	for (; e; e >>= 1, k = digest_mul(k, k))
		if (e & 1)
			r = digest_mul(r, k);
	return r;
}

/* The host's reference: the digest of `n` words (one segment, or its end). */
DIGEST_FN void digest_words(const uint32_t *w, size_t n, const uint64_t key[DIGEST_LANES],
			    uint64_t out[DIGEST_LANES])
{
	for (int l = 0; l < DIGEST_LANES; l++) {
		uint64_t h = 0;
		for (size_t i = n; i-- > 0;)
			h = digest_add(digest_mul(h, key[l]), w[i]);
		out[l] = h;
	}
}

#endif
