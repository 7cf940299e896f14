/*
 * The fake libcuda.so.1's checkpoint API (see fake_libcuda.c), built with
 * -DFAKE_CHECKPOINT: the gate that holds a process's driver calls while it is locked or
 * checkpointed, and the calls another process makes to move it from state to state,
 * through each process's state file. Without -DFAKE_CHECKPOINT, a gate that lets every
 * call through, and none of the API's names.
 */
#include "fake_cuda.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/file.h>
#include <time.h>
#include <unistd.h>

#ifdef FAKE_CHECKPOINT
/* ---- the gate, in the process the API is used on -------------------------------- */

enum { RUNNING, LOCKED, CHECKPOINTED };
static pthread_mutex_t ckpt_mu = PTHREAD_MUTEX_INITIALIZER;
static int ckpt_fd = -1;   /* this process's state file, once it has a context */
static int ckpt_inflight;  /* its driver calls under way (they share the file's lock) */

static int state_of(int fd)
{
	char c;
	return pread(fd, &c, 1, 0) == 1 ? c - '0' : -1;
}

static void set_state(int fd, int state)
{
	char buf[2] = {(char)('0' + state), '\n'};
	if (pwrite(fd, buf, 2, 0) != 2)
		abort();
}

/* A context: this process is one the checkpoint API can be used on. */
void ckpt_context(void)
{
	const char *dir = getenv("FAKE_CUDA_CKPT_DIR");
	char path[4096];
	pthread_mutex_lock(&ckpt_mu);
	if (ckpt_fd < 0 && dir && *dir) {
		snprintf(path, sizeof path, "%s/%d", dir, (int)getpid());
		ckpt_fd = open(path, O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
		if (ckpt_fd < 0)
			abort();
		set_state(ckpt_fd, RUNNING);
	}
	pthread_mutex_unlock(&ckpt_mu);
}

/* Before a driver call: wait while this process is locked or checkpointed. The file's
 * shared lock is held while any call is under way; a lock takes it exclusively. 1: the
 * call is counted under way (ckpt_leave after it). */
int ckpt_enter(void)
{
	long long since = 0;
	pthread_mutex_lock(&ckpt_mu);
	if (ckpt_fd < 0) {
		pthread_mutex_unlock(&ckpt_mu);
		return 0;
	}
	for (;;) {
		if (!ckpt_inflight && flock(ckpt_fd, LOCK_SH))
			abort();
		if (state_of(ckpt_fd) == RUNNING)
			break;
		if (!ckpt_inflight)
			flock(ckpt_fd, LOCK_UN);
		pthread_mutex_unlock(&ckpt_mu);
		if (!since)
			since = now_ns();
		struct timespec tick = {0, 1000000};
		nanosleep(&tick, NULL);
		pthread_mutex_lock(&ckpt_mu);
	}
	ckpt_inflight++;
	pthread_mutex_unlock(&ckpt_mu);
	if (since)
		log_line("blocked", since, now_ns());
	return 1;
}

void ckpt_leave(int counted)
{
	pthread_mutex_lock(&ckpt_mu);
	if (counted && !--ckpt_inflight)
		flock(ckpt_fd, LOCK_UN);
	pthread_mutex_unlock(&ckpt_mu);
}

/* ---- the API, called on another process ------------------------------------------ */

#define NOT_INITIALIZED 3
#define OS_ERROR 304
#define ILLEGAL_STATE 401
#define NOT_READY 600

typedef struct {
	unsigned timeoutMs, reserved0;
	unsigned long long reserved1[7];
} LockArgs;

/* The state file of the process pid, opened: OK, or what the driver answers. */
static CUresult ckpt_open(int pid, int *fd)
{
	const char *dir = getenv("FAKE_CUDA_CKPT_DIR");
	char path[4096];
	if (pid <= 0)
		return INVALID;
	if (kill(pid, 0) && errno == ESRCH)
		return OS_ERROR; /* as the driver answers for a pid that does not exist */
	if (!dir || !*dir)
		return NOT_INITIALIZED;
	snprintf(path, sizeof path, "%s/%d", dir, pid);
	*fd = open(path, O_RDWR | O_CLOEXEC);
	return *fd < 0 ? NOT_INITIALIZED : OK; /* no context there */
}

/* pid's state from `from` to `to`, once no call of its is under way (within timeout_ms,
 * 0: however long that takes); logged as "<what> <ns> <pid>". */
static CUresult ckpt_move(int pid, int from, int to, const char *what, unsigned timeout_ms)
{
	int fd;
	CUresult r = ckpt_open(pid, &fd);
	if (r)
		return r;
	long long until = now_ns() + (long long)timeout_ms * 1000000;
	while (flock(fd, LOCK_EX | LOCK_NB)) {
		if (timeout_ms && now_ns() >= until) {
			close(fd);
			return NOT_READY;
		}
		struct timespec tick = {0, 1000000};
		nanosleep(&tick, NULL);
	}
	if (state_of(fd) != from) {
		r = ILLEGAL_STATE;
	} else {
		set_state(fd, to);
		log_line(what, now_ns(), pid);
	}
	flock(fd, LOCK_UN);
	close(fd);
	return r;
}

CUresult cuCheckpointProcessGetState(int pid, int *state)
{
	int fd;
	CUresult r = ckpt_open(pid, &fd);
	if (r)
		return r;
	*state = state_of(fd);
	close(fd);
	return OK;
}

CUresult cuCheckpointProcessGetRestoreThreadId(int pid, int *tid)
{
	int state;
	CUresult r = cuCheckpointProcessGetState(pid, &state); /* the same checks */
	if (!r)
		*tid = pid;
	return r;
}

/* With FAKE_CUDA_CKPT_LOCK_MS set, a lock takes that long before it looks at the target. */
CUresult cuCheckpointProcessLock(int pid, const LockArgs *args)
{
	const char *slow = getenv("FAKE_CUDA_CKPT_LOCK_MS");
	if (slow && *slow) {
		long ms = atol(slow);
		struct timespec t = {ms / 1000, ms % 1000 * 1000000};
		nanosleep(&t, NULL);
	}
	return ckpt_move(pid, RUNNING, LOCKED, "lock", args ? args->timeoutMs : 0);
}

CUresult cuCheckpointProcessCheckpoint(int pid, const void *args)
{
	(void)args;
	return ckpt_move(pid, LOCKED, CHECKPOINTED, "checkpoint", 0);
}

/* With FAKE_CUDA_CKPT_RESTORE_MS set, a restore takes that long before it acts. */
CUresult cuCheckpointProcessRestore(int pid, const void *args)
{
	const char *slow = getenv("FAKE_CUDA_CKPT_RESTORE_MS");
	(void)args;
	if (slow && *slow) {
		long ms = atol(slow);
		struct timespec t = {ms / 1000, ms % 1000 * 1000000};
		nanosleep(&t, NULL);
	}
	return ckpt_move(pid, CHECKPOINTED, LOCKED, "restore", 0);
}

CUresult cuCheckpointProcessUnlock(int pid, const void *args)
{
	(void)args;
	return ckpt_move(pid, LOCKED, RUNNING, "unlock", 0);
}
#else
void ckpt_context(void) {}
int ckpt_enter(void) { return 0; }
void ckpt_leave(int counted) { (void)counted; }
#endif
