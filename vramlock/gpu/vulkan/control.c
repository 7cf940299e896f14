/*
 * control.c: the connection to vramlock run (VRAMLOCK_SWAP_SOCKET), the CUDA
 * library's conversation: `hello <pid>` at the first device, the first word
 * (`resident`, or `release`), then a thread of its own answering `release` and
 * `restore` (`unpin` and `pin` too, with nothing to unlock). The trace
 * (VRAMLOCK_SWAP_DEBUG=1) goes to stderr.
 */
#include "vklayer.h"

#include <signal.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>

int active;
int tracing;
int unreached;
static int control_fd = -1;
static char sock_path[sizeof(((struct sockaddr_un *)0)->sun_path)];
static int greeted;
static pthread_cond_t greet_cv = PTHREAD_COND_INITIALIZER;
static pthread_once_t join_once = PTHREAD_ONCE_INIT;

void say(const char *fmt, ...)
{
	char line[512];
	va_list ap;
	int n = snprintf(line, sizeof line, "vramlock-vulkan[%d]: ", (int)getpid());
	va_start(ap, fmt);
	vsnprintf(line + n, sizeof line - (size_t)n - 1, fmt, ap);
	va_end(ap);
	strcat(line, "\n");
	if (write(STDERR_FILENO, line, strlen(line)) < 0)
		return;
}

static int send_line(const char *line)
{
	char buf[320];
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

static void handle(const char *word)
{
	char answer[300] = "";
	TRACE("vramlock run says %s", word);
	pthread_mutex_lock(&mu);
	if (!strcmp(word, "release"))
		do_release(answer, sizeof answer);
	else if (!strcmp(word, "restore") || !strcmp(word, "resident"))
		do_restore(answer, sizeof answer);
	else if (!strcmp(word, "unpin"))
		snprintf(answer, sizeof answer, released ? "unpinned 0" : "failed not released");
	else if (!strcmp(word, "pin"))
		snprintf(answer, sizeof answer, released ? "pinned" : "failed not released");
	if (!strcmp(word, "resident"))
		answer[0] = 0; /* the first word asks nothing */
	greeted = 1;
	pthread_cond_broadcast(&greet_cv);
	pthread_mutex_unlock(&mu);
	if (answer[0] && send_line(answer))
		TRACE("cannot answer %s: %s", word, strerror(errno));
}

/* The connection is gone: nobody says release or restore again. A process released
 * stays so (its GPU work waits for good: it cannot know that the GPU is its); one
 * resident runs on. */
static void orphaned(void)
{
	pthread_mutex_lock(&mu);
	if (released || !greeted)
		say("the connection to vramlock run is gone while this process's GPU memory was"
		    " released: its GPU work stays blocked for good (end it)");
	greeted = 1;
	pthread_cond_broadcast(&greet_cv);
	pthread_mutex_unlock(&mu);
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

/* The control thread, every signal blocked there (the program's are its own). */
static int start_thread(void)
{
	pthread_t t;
	pthread_attr_t attr;
	sigset_t all, was;
	sigfillset(&all);
	pthread_sigmask(SIG_SETMASK, &all, &was);
	int e = pthread_attr_init(&attr);
	if (!e) {
		pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
		e = pthread_create(&t, &attr, control_thread, NULL);
		pthread_attr_destroy(&attr);
	}
	pthread_sigmask(SIG_SETMASK, &was, NULL);
	return e;
}

/* vramlock run cannot be reached (`err`): under auto (VRAMLOCK_SWAP_UNREACHED=run, as the
 * CUDA library reads it) the process runs without swap, its devices left alone, and
 * says so in a mapping vramlock run reads in /proc/PID/maps whatever this process's
 * user or mount namespace ("vramlock-swap-unreached:<errno>", the CUDA library's name):
 * a release is then refused, never waited for. Elsewhere its GPU work stays blocked. */
static int run_unreached(int err)
{
	const char *setting = getenv("VRAMLOCK_SWAP_UNREACHED");
	char name[64];
	if (!setting || strcmp(setting, "run"))
		return 0;
	snprintf(name, sizeof name, "vramlock-swap-unreached:%d", err);
	int fd = memfd_create(name, MFD_CLOEXEC);
	if (fd >= 0 && !ftruncate(fd, 4096))
		mmap(NULL, 4096, PROT_READ, MAP_SHARED, fd, 0);
	if (fd >= 0)
		close(fd);
	unreached = 1;
	gate_open_locked();
	return 1;
}

static void connect_control(void)
{
	struct sockaddr_un addr = {.sun_family = AF_UNIX};
	const char *why = NULL;
	int err = 0;
	char hello[64];
	control_fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
	if (!sock_path[0])
		why = "the socket path is too long", err = ENAMETOOLONG;
	else if (control_fd < 0)
		why = strerror(err = errno);
	if (!why) {
		memcpy(addr.sun_path, sock_path, sizeof addr.sun_path);
		if (connect(control_fd, (struct sockaddr *)&addr, sizeof addr))
			why = strerror(err = errno);
	}
	snprintf(hello, sizeof hello, "hello %d", (int)getpid());
	if (!why && send_line(hello))
		why = strerror(errno);
	if (!why && start_thread())
		why = "cannot start the control thread";
	pthread_mutex_lock(&mu);
	if (why && err && run_unreached(err)) {
		TRACE("cannot reach vramlock run at %s (%s): this process runs without swap",
		      sock_path, why);
		greeted = 1;
	} else if (why) {
		say("cannot reach vramlock run at %s (%s): GPU work stays blocked", sock_path, why);
		greeted = 1;
	}
	while (!greeted)
		pthread_cond_wait(&greet_cv, &mu);
	pthread_mutex_unlock(&mu);
}

void control_join(void)
{
	pthread_once(&join_once, connect_control);
}

int control_setup(void)
{
	const char *path = getenv("VRAMLOCK_SWAP_SOCKET");
	const char *debug = getenv("VRAMLOCK_SWAP_DEBUG");
	const char *staging = getenv("VRAMLOCK_VULKAN_STAGING");
	tracing = debug && *debug && strcmp(debug, "0");
	staging_forced = staging && !strcmp(staging, "1");
	if (!path || !*path)
		return 0;
	if (strlen(path) < sizeof sock_path)
		memcpy(sock_path, path, strlen(path) + 1);
	return 1;
}

__attribute__((constructor)) static void setup(void)
{
	active = control_setup();
}
