/*
 * copy.c: the copies a release and a restore make (and prepare.c's copies ahead), on
 * two streams of our own in each context, and the waits for them.
 */
#include "swap.h"

#define COPY_STREAMS 2

/* Streams of our own in each context the copies go through, made once. */
static struct {
	CUcontext ctx;
	CUstream stream[COPY_STREAMS];
} copy_ctx[MAX_CONTEXTS];
static size_t ncopy_ctx;

CUresult streams_of(CUcontext ctx, CUstream **out)
{
	for (size_t i = 0; i < ncopy_ctx; i++)
		if (copy_ctx[i].ctx == ctx) {
			*out = copy_ctx[i].stream;
			return CUDA_SUCCESS;
		}
	if (ncopy_ctx == MAX_CONTEXTS)
		return CUDA_ERROR_INVALID_CONTEXT;
	CUresult r = real_cuCtxSetCurrent(ctx);
	for (int k = 0; !r && k < COPY_STREAMS; k++)
		r = real_cuStreamCreate(&copy_ctx[ncopy_ctx].stream[k], CU_STREAM_NON_BLOCKING);
	if (r)
		return r;
	copy_ctx[ncopy_ctx].ctx = ctx;
	*out = copy_ctx[ncopy_ctx++].stream;
	return CUDA_SUCCESS;
}

/* The contexts that own tracked memory, each once, into `seen`: how many. */
size_t memory_contexts(CUcontext seen[MAX_CONTEXTS])
{
	size_t n = 0;
	for (struct phys *p = physes; p; p = p->next) {
		size_t k = 0;
		while (k < n && seen[k] != p->ctx)
			k++;
		if (k == n && n < MAX_CONTEXTS)
			seen[n++] = p->ctx;
	}
	return n;
}

/* Syncs every context that owns tracked memory, and every stream of ours. */
CUresult sync_all(int ours_only)
{
	CUresult r = CUDA_SUCCESS;
	if (!ours_only) {
		CUcontext seen[MAX_CONTEXTS];
		size_t n = memory_contexts(seen);
		for (size_t i = 0; i < n && !r; i++) {
			r = real_cuCtxSetCurrent(seen[i]);
			if (!r)
				r = real_cuCtxSynchronize();
		}
	}
	for (size_t i = 0; i < ncopy_ctx && !r; i++) {
		r = real_cuCtxSetCurrent(copy_ctx[i].ctx);
		for (int k = 0; !r && k < COPY_STREAMS; k++)
			r = real_cuStreamSynchronize(copy_ctx[i].stream[k]);
	}
	return r;
}

/* Queues the copy of bytes [off, off + len) of `p` (at its copy place), in chunks on
 * two streams taken in turns (`turn`): one stream alone leaves the link idle between
 * copies. `out`: device to host, else back. */
CUresult copy_span(struct phys *p, size_t off, size_t len, int out, size_t *turn)
{
	CUstream *streams;
	CUresult r = streams_of(p->ctx, &streams);
	if (!r)
		r = real_cuCtxSetCurrent(p->ctx);
	for (size_t end = off + len, n; !r && off < end; off += n) {
		n = COPY_CHUNK - off % COPY_CHUNK; /* up to the next multiple: one locked chunk */
		n = end - off < n ? end - off : n;
		CUstream s = streams[(*turn)++ % COPY_STREAMS];
		char *host = (char *)p->host + off;
		if (p->pinned < off + n && p->host == p->prep_base)
			host_pin_to(p, off + n); /* unlocked while parked: locked again here */
		r = out ? real_cuMemcpyDtoHAsync_v2(host, p->copy_va + off, n, s)
			: real_cuMemcpyHtoDAsync_v2(p->copy_va + off, host, n, s);
	}
	return r;
}

/* In a forked child: the streams are its parent's. */
void copy_forget(void)
{
	ncopy_ctx = 0;
}
