/*
 * A CUDA program as the runtime would drive the driver: it links nothing, dlopen()s
 * libcuda.so.1 and finds every entry point through cuGetProcAddress_v2. It
 * allocates in every way the swap library handles (big and small cuMemAlloc,
 * pitched, stream-ordered, its own VMM pool as llama.cpp's, a VMM chunk whose
 * handle it keeps as PyTorch's expandable segments do), fills each
 * buffer with a pattern, then launches "add one" kernels in a loop for SECONDS,
 * checking one buffer's contents after each round and all of them at the end.
 *
 *   swap_prog SECONDS [managed|ipc|export]
 *
 * The last argument adds what cannot be swapped: a managed allocation, a CUDA IPC
 * handle to a buffer, or an exported VMM handle.
 *
 * Prints "ready" once its memory is filled, "done <rounds>" at the end; exits 3
 * on a wrong byte, 4 when a driver call fails. With SWAP_PROG_START_AFTER=PATH it
 * waits for PATH to exist before it initialises CUDA; with SWAP_PROG_STOP=PATH it
 * ends early once PATH exists; with SWAP_PROG_CAPTURE=PATH it captures a graph
 * while PATH exists (saying "capturing", then "captured"); with SWAP_PROG_THREADS=N,
 * N more threads allocate, fill, launch on, check and free buffers of their own
 * meanwhile, as fast as they can; with SWAP_PROG_BENCH=N it times N launches of an
 * empty kernel first (what a launch costs through whatever is in front of the driver);
 * with SWAP_PROG_SMALL=N it times N live 256-byte cuMemAllocs first (freed again).
 *
 * Ways out of the swap library, each off unless set: SWAP_PROG_FORK=1 forks before
 * anything and runs in the child (the parent waits, never touching CUDA);
 * SWAP_PROG_UNDUMPABLE=1 makes the process non-dumpable (its /proc/PID/maps unreadable
 * to others); SWAP_PROG_CUSERID=1 looks up libc's cuserid before the driver is there;
 * SWAP_PROG_DRIVER=PATH opens the driver by that path, not by name;
 * SWAP_PROG_CLEARENV=1 clears the environment before cuInit; SWAP_PROG_CLOSE_SOCKETS=1
 * closes every socket it has once it is ready (=shutdown: shuts each down first, so that
 * the other end and a thread of its own blocked on it see it end). With SWAP_PROG_IDLE_CHILD=1 it forks a
 * child once it is ready that never uses CUDA (as a worker pool's), ended with it.
 * With SWAP_PROG_SETUID=ID it drops to that user and group id (as root) after it loaded
 * the driver, before cuInit; with SWAP_PROG_FILL_FDS=1 it opens descriptors until it has
 * none left (EMFILE) before cuInit, and closes them after it.
 * With SWAP_PROG_STACK=N it sets its per-thread stack limit to N bytes before it
 * allocates, and checks after each round that the driver says N (else exits 3).
 *
 * With SWAP_PROG_LISTEN=PORT it is a server, idle between requests as an inference
 * server is: on 127.0.0.1:PORT, GET /health answers 200 without touching the GPU, and
 * any other request runs one round (a launch on every buffer, one buffer checked) and
 * answers "round N"; each connection is closed after its answer. It serves until
 * SECONDS have passed or SWAP_PROG_STOP exists. With SWAP_PROG_TERM=1, SIGTERM ends it
 * as SWAP_PROG_STOP does (every buffer checked, "done <rounds>", exit 0), once it has
 * said "terminated <ns>" (CLOCK_MONOTONIC: when its loop saw the signal).
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <dirent.h>
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long Handle;
typedef struct {
	int type, requestedHandleTypes;
	struct {
		int type, id;
	} location;
	void *win32HandleMetaData;
	unsigned char allocFlags[8];
} Prop;
typedef struct {
	struct {
		int type, id;
	} location;
	int flags;
} Access;

typedef CUresult (*gpa_fn)(const char *, void **, int, unsigned long long, int *);
static gpa_fn gpa;

static void *get(const char *name, unsigned long long flags)
{
	void *fn = NULL;
	int status = 0;
	if (gpa(name, &fn, 12080, flags, &status) || !fn) {
		fprintf(stderr, "swap_prog: no %s\n", name);
		exit(4);
	}
	return fn;
}

#define CHECK(call)                                                            \
	do {                                                                   \
		CUresult r_ = (call);                                          \
		if (r_) {                                                      \
			fprintf(stderr, "swap_prog: %s: error %d\n", #call, r_); \
			exit(4);                                               \
		}                                                              \
	} while (0)

static void nothing(void **params)
{
	(void)params;
}

static void add_one(void **params)
{
	int *a = (int *)(uintptr_t) * (CUdeviceptr *)params[0];
	size_t n = *(size_t *)params[1];
	for (size_t i = 0; i < n; i++)
		a[i]++;
}

struct buffer {
	CUdeviceptr ptr;
	size_t count; /* ints */
};

#define MAX_BUFFERS 512
static struct buffer bufs[MAX_BUFFERS];
static size_t nbufs;

static CUresult (*cuMemcpyHtoD)(CUdeviceptr, const void *, size_t);
static CUresult (*cuMemcpyDtoH)(void *, CUdeviceptr, size_t);
static CUresult (*cuMemcpyDtoH_ptds)(void *, CUdeviceptr, size_t);

static void add(CUdeviceptr p, size_t bytes)
{
	bufs[nbufs++] = (struct buffer){p, bytes / sizeof(int)};
}

static int want(size_t b, size_t i, long rounds)
{
	return (int)(i * 7 + b + (size_t)rounds);
}

static void check(size_t b, long rounds, int via_ptds)
{
	size_t n = bufs[b].count;
	int *host = malloc(n * sizeof *host);
	if (!host)
		exit(4);
	CHECK((via_ptds ? cuMemcpyDtoH_ptds : cuMemcpyDtoH)(host, bufs[b].ptr, n * sizeof *host));
	for (size_t i = 0; i < n; i++)
		if (host[i] != want(b, i, rounds)) {
			printf("MISMATCH buffer %zu index %zu: %d, not %d\n", b, i, host[i],
			       want(b, i, rounds));
			exit(3);
		}
	free(host);
}

/* Entry points the worker threads use too. */
static void *ctx;
static CUresult (*cuCtxSetCurrent)(void *);
static CUresult (*cuMemAlloc)(CUdeviceptr *, size_t);
static CUresult (*cuMemFree)(CUdeviceptr);
static CUresult (*launch)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
			  unsigned, void *, void **, void **);
static atomic_int stopping;
static atomic_long worked;

/* Allocations, copies and launches from another thread, racing the releases. */
static void *worker(void *arg)
{
	size_t sizes[] = {3000, 5 << 20, 100000};
	size_t me = (size_t)(uintptr_t)arg;
	CHECK(cuCtxSetCurrent(ctx));
	while (!atomic_load(&stopping)) {
		size_t bytes = sizes[atomic_load(&worked) % 3], n = bytes / sizeof(int);
		int *host = malloc(bytes);
		CUdeviceptr p;
		if (!host)
			exit(4);
		for (size_t i = 0; i < n; i++)
			host[i] = (int)(i + me);
		CHECK(cuMemAlloc(&p, bytes));
		CHECK(cuMemcpyHtoD(p, host, bytes));
		void *params[] = {&p, &n};
		for (int k = 0; k < 3; k++)
			CHECK(launch((void *)add_one, 1, 1, 1, 1, 1, 1, 0, NULL, params, NULL));
		CHECK(cuMemcpyDtoH(host, p, bytes));
		for (size_t i = 0; i < n; i++)
			if (host[i] != (int)(i + me + 3)) {
				printf("MISMATCH thread %zu index %zu: %d\n", me, i, host[i]);
				exit(3);
			}
		CHECK(cuMemFree(p));
		free(host);
		atomic_fetch_add(&worked, 1);
	}
	return NULL;
}

static volatile sig_atomic_t termed;

static void on_term(int signum)
{
	(void)signum;
	termed = 1;
}

static double now(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/* Runs the rest of main in a child forked without exec; the parent only waits. */
static void fork_here(void)
{
	pid_t child = fork();
	if (child < 0)
		exit(4);
	if (child == 0)
		return;
	int status;
	while (waitpid(child, &status, 0) < 0)
		;
	exit(WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status));
}

static void close_sockets(void)
{
	DIR *d = opendir("/proc/self/fd");
	struct dirent *e;
	struct stat st;
	int mine = d ? dirfd(d) : -1;
	while (d && (e = readdir(d))) {
		int fd = atoi(e->d_name);
		if (fd > 2 && fd != mine && !fstat(fd, &st) && S_ISSOCK(st.st_mode)) {
			if (!strcmp(getenv("SWAP_PROG_CLOSE_SOCKETS"), "shutdown"))
				shutdown(fd, SHUT_RDWR); /* what a thread blocked on it sees too */
			close(fd);
		}
	}
	if (d)
		closedir(d);
}

static void time_small_allocs(long n)
{
	CUdeviceptr *small = malloc((size_t)n * sizeof *small);
	if (!small)
		exit(4);
	double t0 = now();
	for (long i = 0; i < n; i++)
		CHECK(cuMemAlloc(&small[i], 256));
	printf("s_small_allocs %.3f\n", now() - t0);
	for (long i = 0; i < n; i++)
		CHECK(cuMemFree(small[i]));
	free(small);
}

static void answer(int conn, const char *body)
{
	char head[160];
	size_t blen = strlen(body);
	int hlen = snprintf(head, sizeof head,
			    "HTTP/1.1 200 OK\r\nContent-Length: %zu\r\nConnection: close\r\n\r\n",
			    blen);
	if (write(conn, head, (size_t)hlen) < 0 || write(conn, body, blen) < 0)
		return;
}

/* A connection's request head read (no body is expected): 1 when it asks for GPU
 * work, 0 when it was /health (answered), -1 when the client went away. */
static int take_request(int conn)
{
	char req[4096];
	size_t got = 0;
	while (!memmem(req, got, "\r\n\r\n", 4)) {
		if (got == sizeof req)
			return -1;
		ssize_t n = read(conn, req + got, sizeof req - got);
		if (n <= 0)
			return -1;
		got += (size_t)n;
	}
	if (got >= 12 && !memcmp(req, "GET /health ", 12)) {
		answer(conn, "ok\n");
		return 0;
	}
	return 1;
}

static int listen_on(int port)
{
	int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0), one = 1;
	struct sockaddr_in at = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
	at.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
	if (fd < 0 || setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one) ||
	    bind(fd, (struct sockaddr *)&at, sizeof at) || listen(fd, 16))
		exit(4);
	return fd;
}

int main(int argc, char **argv)
{
	if (argc < 2)
		return 2;
	/* Read first: SWAP_PROG_CLEARENV clears them all. */
	const char *threads = getenv("SWAP_PROG_THREADS"), *bench = getenv("SWAP_PROG_BENCH");
	const char *stop = getenv("SWAP_PROG_STOP"), *capture = getenv("SWAP_PROG_CAPTURE");
	const char *small = getenv("SWAP_PROG_SMALL"), *idle = getenv("SWAP_PROG_IDLE_CHILD");
	if (getenv("SWAP_PROG_FORK"))
		fork_here();
	if (getenv("SWAP_PROG_UNDUMPABLE") && prctl(PR_SET_DUMPABLE, 0, 0, 0, 0))
		return 4;
	if (getenv("SWAP_PROG_CUSERID") && !dlsym(RTLD_DEFAULT, "cuserid"))
		return 4;
	double seconds = atof(argv[1]);
	const char *unswappable = argc > 2 ? argv[2] : "";
	setvbuf(stdout, NULL, _IOLBF, 0);
	if (getenv("SWAP_PROG_TERM")) {
		struct sigaction sa;
		memset(&sa, 0, sizeof sa);
		sa.sa_handler = on_term; /* no SA_RESTART: the server's poll returns */
		sigaction(SIGTERM, &sa, NULL);
	}
	const char *start_after = getenv("SWAP_PROG_START_AFTER");
	if (start_after) {
		printf("waiting\n");
		struct timespec tick = {0, 5000000};
		while (access(start_after, F_OK))
			nanosleep(&tick, NULL);
	}

	const char *driver = getenv("SWAP_PROG_DRIVER");
	void *lib = dlopen(driver ? driver : "libcuda.so.1", RTLD_NOW);
	if (!lib) {
		fprintf(stderr, "swap_prog: %s\n", dlerror());
		return 4;
	}
	gpa = (gpa_fn)dlsym(lib, "cuGetProcAddress_v2");
	if (!gpa)
		return 4;

	CUresult (*cuInit)(unsigned) = get("cuInit", 0);
	CUresult (*cuDevicePrimaryCtxRetain)(void **, int) = get("cuDevicePrimaryCtxRetain", 0);
	cuCtxSetCurrent = get("cuCtxSetCurrent", 0);
	CUresult (*cuStreamCreate)(void **, unsigned) = get("cuStreamCreate", 0);
	cuMemAlloc = get("cuMemAlloc", 0);
	cuMemFree = get("cuMemFree", 0);
	CUresult (*cuMemAllocPitch)(CUdeviceptr *, size_t *, size_t, size_t, unsigned) =
		get("cuMemAllocPitch", 0);
	CUresult (*cuMemAllocAsync)(CUdeviceptr *, size_t, void *) = get("cuMemAllocAsync", 0);
	CUresult (*cuMemFreeAsync)(CUdeviceptr, void *) = get("cuMemFreeAsync", 0);
	CUresult (*cuMemAllocManaged)(CUdeviceptr *, size_t, unsigned) = get("cuMemAllocManaged", 0);
	CUresult (*cuIpcGetMemHandle)(void *, CUdeviceptr) = get("cuIpcGetMemHandle", 0);
	CUresult (*cuMemExportToShareableHandle)(void *, Handle, int, unsigned long long) =
		get("cuMemExportToShareableHandle", 0);
	CUresult (*cuMemGetAddressRange)(CUdeviceptr *, size_t *, CUdeviceptr) =
		get("cuMemGetAddressRange", 0);
	CUresult (*cuMemGetAllocationGranularity)(size_t *, const Prop *, int) =
		get("cuMemGetAllocationGranularity", 0);
	CUresult (*cuMemAddressReserve)(CUdeviceptr *, size_t, size_t, CUdeviceptr,
					unsigned long long) = get("cuMemAddressReserve", 0);
	CUresult (*cuMemAddressFree)(CUdeviceptr, size_t) = get("cuMemAddressFree", 0);
	CUresult (*cuMemCreate)(Handle *, size_t, const Prop *, unsigned long long) =
		get("cuMemCreate", 0);
	CUresult (*cuMemRelease)(Handle) = get("cuMemRelease", 0);
	CUresult (*cuMemMap)(CUdeviceptr, size_t, size_t, Handle, unsigned long long) =
		get("cuMemMap", 0);
	CUresult (*cuMemUnmap)(CUdeviceptr, size_t) = get("cuMemUnmap", 0);
	CUresult (*cuMemSetAccess)(CUdeviceptr, size_t, const Access *, size_t) =
		get("cuMemSetAccess", 0);
	CUresult (*cuMemRetainAllocationHandle)(Handle *, void *) =
		get("cuMemRetainAllocationHandle", 0);
	CUresult (*cuMemGetAllocationPropertiesFromHandle)(Prop *, Handle) =
		get("cuMemGetAllocationPropertiesFromHandle", 0);
	launch = get("cuLaunchKernel", 0);
	CUresult (*launch_ptsz)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
				unsigned, void *, void **, void **) = get("cuLaunchKernel", 2);
	CUresult (*cuStreamBeginCapture)(void *, int) = get("cuStreamBeginCapture", 0);
	CUresult (*cuStreamEndCapture)(void *, void **) = get("cuStreamEndCapture", 0);
	cuMemcpyHtoD = get("cuMemcpyHtoD", 0);
	cuMemcpyDtoH = get("cuMemcpyDtoH", 0);
	cuMemcpyDtoH_ptds = get("cuMemcpyDtoH", 2);

	void *stream;
	const char *uid = getenv("SWAP_PROG_SETUID");
	if (uid && (setgroups(0, NULL) || setgid((gid_t)atoi(uid)) || setuid((uid_t)atoi(uid))))
		return 4;
	static int filled[4096];
	int nfilled = 0;
	if (getenv("SWAP_PROG_FILL_FDS")) {
		while (nfilled < 4096 && (filled[nfilled] = open("/dev/null", O_RDONLY)) >= 0)
			nfilled++;
		if (nfilled == 4096 || errno != EMFILE)
			return 4;
	}
	if (getenv("SWAP_PROG_CLEARENV"))
		clearenv();
	CHECK(cuInit(0));
	while (nfilled > 0) /* the driver's memory needs some */
		close(filled[--nfilled]);
	CHECK(cuDevicePrimaryCtxRetain(&ctx, 0));
	CHECK(cuCtxSetCurrent(ctx));
	CHECK(cuStreamCreate(&stream, 0));
	const char *stack = getenv("SWAP_PROG_STACK");
	size_t stack_asked = stack ? strtoull(stack, NULL, 10) : 0;
	CUresult (*cuCtxGetLimit)(size_t *, int) = get("cuCtxGetLimit", 0);
	if (stack_asked)
		CHECK(((CUresult(*)(int, size_t))get("cuCtxSetLimit", 0))(0, stack_asked));

	CUdeviceptr p;
	CHECK(cuMemAlloc(&p, 6 << 20));
	add(p, 6 << 20);
	/* Small ones, some freed again: slabs are shared and reused. */
	CUdeviceptr gone[100];
	for (int i = 0; i < 200; i++) {
		CHECK(cuMemAlloc(&p, 1000));
		if (i % 2)
			gone[i / 2] = p;
		else
			add(p, 1000);
	}
	for (int i = 0; i < 100; i++)
		CHECK(cuMemFree(gone[i]));
	CUdeviceptr base;
	size_t size;
	CHECK(cuMemGetAddressRange(&base, &size, bufs[1].ptr + 10));
	if (base != bufs[1].ptr || size != 1000) {
		printf("MISMATCH address range: 0x%llx+%zu for 0x%llx+1000\n", base, size, bufs[1].ptr);
		return 3;
	}
	size_t pitch;
	CHECK(cuMemAllocPitch(&p, &pitch, 1000, 20, 4));
	add(p, pitch * 20);
	CHECK(cuMemAllocAsync(&p, 3 << 20, stream));
	add(p, 3 << 20);
	CHECK(cuMemAllocAsync(&p, 1 << 20, stream));
	CHECK(cuMemFreeAsync(p, stream));

	/* A pool as llama.cpp's: a big reservation, chunks mapped at its end, each
	 * handle released right after mapping. */
	Prop prop;
	memset(&prop, 0, sizeof prop);
	prop.type = 1;
	prop.location.type = 1;
	size_t g;
	CHECK(cuMemGetAllocationGranularity(&g, &prop, 0));
	CUdeviceptr pool;
	size_t pool_max = 64 * g, pool_size = 0;
	CHECK(cuMemAddressReserve(&pool, pool_max, 0, 0, 0));
	for (int i = 0; i < 2; i++) {
		Handle h;
		CHECK(cuMemCreate(&h, g, &prop, 0));
		CHECK(cuMemMap(pool + pool_size, g, 0, h, 0));
		CHECK(cuMemRelease(h));
		Access access = {{1, 0}, 3};
		CHECK(cuMemSetAccess(pool + pool_size, g, &access, 1));
		pool_size += g;
	}
	add(pool, pool_size);
	/* A chunk as PyTorch's expandable segments keep them: the handle is held, and
	 * used again (retained, queried, released) after any number of swaps. */
	CUdeviceptr kept_va;
	Handle kept;
	CHECK(cuMemAddressReserve(&kept_va, g, 0, 0, 0));
	CHECK(cuMemCreate(&kept, g, &prop, 0));
	CHECK(cuMemMap(kept_va, g, 0, kept, 0));
	Access rw = {{1, 0}, 3};
	CHECK(cuMemSetAccess(kept_va, g, &rw, 1));
	add(kept_va, g);

	if (!strcmp(unswappable, "managed")) {
		CHECK(cuMemAllocManaged(&p, 1 << 20, 1));
		add(p, 1 << 20);
	} else if (!strcmp(unswappable, "ipc")) {
		char ipc[64];
		CHECK(cuIpcGetMemHandle(ipc, bufs[0].ptr));
	} else if (!strcmp(unswappable, "export")) {
		int fd;
		CHECK(cuMemExportToShareableHandle(&fd, kept, 1, 0));
	}

	for (size_t b = 0; b < nbufs; b++) {
		int *host = malloc(bufs[b].count * sizeof *host);
		if (!host)
			return 4;
		for (size_t i = 0; i < bufs[b].count; i++)
			host[i] = want(b, i, 0);
		CHECK(cuMemcpyHtoD(bufs[b].ptr, host, bufs[b].count * sizeof *host));
		free(host);
	}
	pthread_t workers[16];
	size_t nworkers = threads ? (size_t)atoi(threads) : 0;
	for (size_t t = 0; t < nworkers && t < 16; t++)
		if (pthread_create(&workers[t], NULL, worker, (void *)(uintptr_t)t))
			return 4;
	if (bench) {
		long n = atol(bench);
		double t0 = now();
		for (long i = 0; i < n; i++)
			CHECK(launch((void *)nothing, 1, 1, 1, 1, 1, 1, 0, stream, NULL, NULL));
		printf("ns_per_launch %.1f\n", (now() - t0) / (double)n * 1e9);
	}
	if (small)
		time_small_allocs(atol(small));
	if (getenv("SWAP_PROG_CLOSE_SOCKETS"))
		close_sockets();
	pid_t idler = idle ? fork() : -1;
	if (idler == 0) {
		prctl(PR_SET_PDEATHSIG, SIGKILL);
		for (;;)
			pause();
	}
	printf("ready\n");

	long rounds = 0;
	double end = now() + seconds;
	int capturing = 0;
	const char *listen_port = getenv("SWAP_PROG_LISTEN");
	int server = listen_port ? listen_on(atoi(listen_port)) : -1;
	while (now() < end && !termed && !(stop && !access(stop, F_OK))) {
		int conn = -1;
		if (server >= 0) {
			struct pollfd pfd = {server, POLLIN, 0};
			if (poll(&pfd, 1, 50) <= 0)
				continue;
			conn = accept4(server, NULL, NULL, SOCK_CLOEXEC);
			if (conn < 0)
				continue;
			if (take_request(conn) <= 0) {
				close(conn);
				continue;
			}
		}
		if (capture && capturing != !access(capture, F_OK)) {
			void *graph;
			if (!capturing)
				CHECK(cuStreamBeginCapture(stream, 0));
			else
				CHECK(cuStreamEndCapture(stream, &graph));
			capturing = !capturing;
			printf(capturing ? "capturing\n" : "captured\n");
		}
		for (size_t b = 0; b < nbufs; b++) {
			void *params[] = {&bufs[b].ptr, &bufs[b].count};
			CHECK((b % 2 ? launch_ptsz : launch)((void *)add_one, 1, 1, 1, 1, 1, 1, 0,
							       stream, params, NULL));
		}
		rounds++;
		check((size_t)rounds % nbufs, rounds, rounds % 2);
		size_t stack_now;
		if (stack_asked && (cuCtxGetLimit(&stack_now, 0) || stack_now != stack_asked)) {
			printf("MISMATCH stack: %zu, not %zu\n", stack_now, stack_asked);
			return 3;
		}
		if (conn >= 0) {
			char body[32];
			snprintf(body, sizeof body, "round %ld\n", rounds);
			answer(conn, body);
			close(conn);
			continue;
		}
		struct timespec pause = {0, 2000000};
		nanosleep(&pause, NULL);
	}
	if (termed) {
		struct timespec ts;
		clock_gettime(CLOCK_MONOTONIC, &ts);
		printf("terminated %lld\n", (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec);
	}
	if (server >= 0)
		close(server);
	atomic_store(&stopping, 1);
	for (size_t t = 0; t < nworkers && t < 16; t++)
		pthread_join(workers[t], NULL);
	for (size_t b = 0; b < nbufs; b++)
		check(b, rounds, 0);
	for (size_t b = 0; b < nbufs; b++)
		if (bufs[b].ptr != pool && bufs[b].ptr != kept_va)
			CHECK(cuMemFree(bufs[b].ptr));
	Handle again;
	Prop asked;
	CHECK(cuMemRetainAllocationHandle(&again, (void *)(uintptr_t)kept_va));
	CHECK(cuMemGetAllocationPropertiesFromHandle(&asked, kept));
	if (again != kept || asked.type != 1) {
		printf("MISMATCH handle: 0x%llx retained as 0x%llx\n", kept, again);
		return 3;
	}
	CHECK(cuMemRelease(again));
	CHECK(cuMemUnmap(kept_va, g));
	CHECK(cuMemRelease(kept));
	CHECK(cuMemAddressFree(kept_va, g));
	CHECK(cuMemUnmap(pool, pool_size));
	CHECK(cuMemAddressFree(pool, pool_max));
	if (idler > 0 && (kill(idler, SIGKILL) || waitpid(idler, NULL, 0) < 0))
		return 4;
	if (nworkers)
		printf("worked %ld\n", atomic_load(&worked));
	printf("done %ld\n", rounds);
	return 0;
}
