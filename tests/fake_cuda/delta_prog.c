/*
 * A CUDA program whose memory changes only when told, for the swap library's copies of
 * what changed (tests/test_swap_delta.py):
 *
 *   delta_prog MIB
 *
 * Allocates MIB MiB of device memory, fills it with a pattern, keeps a host mirror of
 * it and prints "ready". Then, one line at a time on stdin: "poke OFFSET LENGTH" flips
 * every bit of those bytes (on the GPU, and in the mirror) and says "poked"; "check"
 * copies all of it back and says "ok", or "MISMATCH <offset>" at the first byte that is
 * not the mirror's; "free" frees it (nothing else may follow) and says "freed"; "managed"
 * allocates 1 MiB of managed memory (what cannot be swapped) and says "managed"; "block"
 * blocks SIGTERM in its thread, as a program that takes its signals with sigwait does, and
 * says "blocked"; "sigwait" waits for one and says "sigterm"; "fork" forks a child that
 * only waits to be killed, as a worker pool's, and says "child <pid>". "done" at end of
 * input; exit 4 when a driver call fails.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

typedef int CUresult;
typedef unsigned long long CUdeviceptr;

static void *lib;

static void *get(const char *name)
{
	void *fn = dlsym(lib, name);
	if (!fn) {
		fprintf(stderr, "delta_prog: no %s\n", name);
		exit(4);
	}
	return fn;
}

static void check(CUresult r, const char *what)
{
	if (r) {
		fprintf(stderr, "delta_prog: %s: error %d\n", what, r);
		exit(4);
	}
}

int main(int argc, char **argv)
{
	if (argc < 2 || !(lib = dlopen("libcuda.so.1", RTLD_NOW)))
		return 4;
	setvbuf(stdout, NULL, _IOLBF, 0);
	size_t size = (size_t)atol(argv[1]) << 20;
	CUresult (*init)(unsigned) = get("cuInit");
	CUresult (*retain)(void **, int) = get("cuDevicePrimaryCtxRetain");
	CUresult (*set)(void *) = get("cuCtxSetCurrent");
	CUresult (*alloc)(CUdeviceptr *, size_t) = get("cuMemAlloc_v2");
	CUresult (*htod)(CUdeviceptr, const void *, size_t) = get("cuMemcpyHtoD_v2");
	CUresult (*dtoh)(void *, CUdeviceptr, size_t) = get("cuMemcpyDtoH_v2");
	CUresult (*release)(CUdeviceptr) = get("cuMemFree_v2");
	CUresult (*managed)(CUdeviceptr *, size_t, unsigned) = get("cuMemAllocManaged");
	void *ctx;
	CUdeviceptr dev;
	unsigned char *mirror = malloc(size), *back = malloc(size);
	if (!mirror || !back)
		return 4;
	for (size_t i = 0; i < size / 4; i++)
		((uint32_t *)mirror)[i] = (uint32_t)(i * 2654435761u);
	check(init(0), "cuInit");
	check(retain(&ctx, 0), "cuDevicePrimaryCtxRetain");
	check(set(ctx), "cuCtxSetCurrent");
	check(alloc(&dev, size), "cuMemAlloc");
	check(htod(dev, mirror, size), "cuMemcpyHtoD");
	printf("ready\n");
	char line[128];
	while (fgets(line, sizeof line, stdin)) {
		size_t off, len;
		if (sscanf(line, "poke %zu %zu", &off, &len) == 2 && off + len <= size) {
			for (size_t i = off; i < off + len; i++)
				mirror[i] = (unsigned char)~mirror[i];
			check(htod(dev + off, mirror + off, len), "cuMemcpyHtoD");
			printf("poked\n");
		} else if (!strncmp(line, "check", 5)) {
			check(dtoh(back, dev, size), "cuMemcpyDtoH");
			size_t i = 0;
			while (i < size && back[i] == mirror[i])
				i++;
			if (i < size)
				printf("MISMATCH %zu\n", i);
			else
				printf("ok\n");
		} else if (!strncmp(line, "free", 4)) {
			check(release(dev), "cuMemFree");
			printf("freed\n");
		} else if (!strncmp(line, "managed", 7)) {
			CUdeviceptr m;
			check(managed(&m, 1 << 20, 1), "cuMemAllocManaged");
			printf("managed\n");
		} else if (!strncmp(line, "block", 5) || !strncmp(line, "sigwait", 7)) {
			sigset_t term;
			int sig;
			sigemptyset(&term);
			sigaddset(&term, SIGTERM);
			if (line[0] == 'b' ? pthread_sigmask(SIG_BLOCK, &term, NULL) : sigwait(&term, &sig))
				return 4;
			printf(line[0] == 'b' ? "blocked\n" : "sigterm\n");
		} else if (!strncmp(line, "fork", 4)) {
			pid_t child = fork();
			if (child < 0)
				return 4;
			if (!child)
				for (;;)
					pause();
			printf("child %d\n", (int)child);
		}
	}
	printf("done\n");
	return 0;
}
