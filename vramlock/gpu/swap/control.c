/*
 * control.c: the connection to the wrapper (VRAMLOCK_SWAP_SOCKET): `hello <pid>` at
 * cuInit, then a thread of its own answering `release` and `restore`.
 */
#include "swap.h"

/* ---- control ------------------------------------------------------------------ */

static int control_fd = -1;
static int greeted; /* the wrapper said where we stand */
static pthread_cond_t greet_cv = PTHREAD_COND_INITIALIZER;
pthread_once_t connect_once = PTHREAD_ONCE_INIT;

static int send_line(const char *line)
{
	char buf[256];
	int n = snprintf(buf, sizeof buf, "%s\n", line);
	if (n < 0 || (size_t)n >= sizeof buf)
		n = (int)sizeof buf - 1, buf[n - 1] = '\n';
	for (int off = 0; off < n;) {
		ssize_t w = send(control_fd, buf + off, (size_t)(n - off), MSG_NOSIGNAL);
		if (w < 0 && errno == EINTR)
			continue;
		if (w <= 0)
			return -1;
		off += (int)w;
	}
	return 0;
}

/* The wrapper is gone: nobody can tell us the token is ours again. Gone before it
 * said where the command stands, it may have been released: the safe side is the
 * same as released (nothing is on the GPU yet). */
static void orphaned(void)
{
	pthread_mutex_lock(&mu);
	if (!greeted) {
		atomic_store(&closed, 1);
		released = 1;
	}
	greeted = 1;
	pthread_cond_broadcast(&greet_cv);
	if (released) {
		say("vramlock run went away while this process's GPU memory was released:"
		    " its GPU calls stay blocked for good (end it)");
		write_orphan_record();
	}
	pthread_mutex_unlock(&mu);
}

static void handle(const char *word)
{
	char answer[256] = "";
	TRACE("vramlock run says %s", word);
	pthread_mutex_lock(&mu);
	if (!strcmp(word, "release"))
		do_release(answer, sizeof answer);
	else if (!strcmp(word, "restore"))
		do_restore(answer, sizeof answer);
	/* `resident` asks nothing: the first word only says the gate may stay open. */
	greeted = 1;
	pthread_cond_broadcast(&greet_cv);
	pthread_mutex_unlock(&mu);
	if (answer[0] && send_line(answer))
		TRACE("cannot answer %s: %s", word, strerror(errno));
}

static void *control_thread(void *arg)
{
	(void)arg;
	char buf[512];
	size_t have = 0;
	for (;;) {
		ssize_t n = recv(control_fd, buf + have, sizeof buf - 1 - have, 0);
		if (n < 0 && errno == EINTR)
			continue;
		if (n <= 0)
			break;
		have += (size_t)n;
		char *start = buf, *nl;
		while ((nl = memchr(start, '\n', (size_t)(buf + have - start)))) {
			*nl = 0;
			handle(start);
			start = nl + 1;
		}
		have = (size_t)(buf + have - start);
		memmove(buf, start, have);
		if (have == sizeof buf - 1)
			have = 0; /* a line that long is no word of ours */
	}
	orphaned();
	return NULL;
}

/* Connects to the wrapper and waits for its first word. Whatever goes wrong, the
 * process cannot know that its command holds the token: the gate stays closed. */
void connect_control(void)
{
	const char *path = getenv("VRAMLOCK_SWAP_SOCKET");
	struct sockaddr_un addr = {.sun_family = AF_UNIX};
	pthread_t t;
	pthread_attr_t attr;
	const char *why = NULL;
	char hello[64];

	control_fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
	if (strlen(path) >= sizeof addr.sun_path)
		why = "the socket path is too long";
	else if (control_fd < 0)
		why = strerror(errno);
	if (!why) {
		memcpy(addr.sun_path, path, strlen(path) + 1);
		if (connect(control_fd, (struct sockaddr *)&addr, sizeof addr))
			why = strerror(errno);
	}
	snprintf(hello, sizeof hello, "hello %d", (int)getpid());
	if (!why && send_line(hello))
		why = strerror(errno);
	if (!why) {
		pthread_attr_init(&attr);
		pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
		if (pthread_create(&t, &attr, control_thread, NULL))
			why = "cannot start the control thread";
		pthread_attr_destroy(&attr);
	}
	pthread_mutex_lock(&mu);
	if (why) {
		say("cannot reach vramlock run at %s (%s): GPU calls stay blocked", path, why);
		atomic_store(&closed, 1);
		greeted = 1;
	}
	while (!greeted)
		pthread_cond_wait(&greet_cv, &mu);
	pthread_mutex_unlock(&mu);
}

/* A process forked from one that uses CUDA cannot use CUDA itself, and must not
 * answer for its parent. */
void after_fork_child(void)
{
	if (control_fd >= 0)
		close(control_fd);
	control_fd = -1;
	active = 0;
}

