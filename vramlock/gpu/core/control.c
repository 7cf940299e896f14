/*
 * core/control.c: the connection to the wrapper (VRAMLOCK_SWAP_SOCKET, else its
 * abstract socket VRAMLOCK_SWAP_ABSTRACT), for both front ends: `hello <pid>` when the
 * process joins, then a thread of its own answering `release` and `restore` (and
 * `unpin` and `pin` around a park) by the engine the front end registered
 * (control.h). Where neither socket can be reached, VRAMLOCK_SWAP_UNREACHED says what
 * the process does: `run` without swap (auto), or `exit` before its GPU work (--release
 * swap). The words are those of vramlock/gpu/core/protocol.py.
 */
#define _GNU_SOURCE
#include "control.h"

#include "gate.h"
#include "proc.h"
#include "record.h"

#include <errno.h>
#include <fcntl.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

/* ---- control ------------------------------------------------------------------ */

static int control_fd = -1;
/* Read at start: the program may clear its environment before it uses the GPU. */
static char sock_path[sizeof(((struct sockaddr_un *)0)->sun_path)];
static int token_fd = -1;
static dev_t token_dev;
static ino_t token_ino;
static int wrapper_pid; /* the process listening at sock_path, as the kernel saw it */
static unsigned long long wrapper_start;
static int greeted; /* the wrapper said where we stand */
static pthread_cond_t greet_cv = PTHREAD_COND_INITIALIZER;
static pthread_once_t connect_once = PTHREAD_ONCE_INIT;
/* The engine: what each word runs (control.h). */
static const struct engine_ops *ops;
/* The wrapper's abstract socket's name (no NUL before it here), and the process that
 * must be listening there: its pid and start time, from the name itself. */
static char abstract_name[sizeof sock_path - 1];
static int abstract_pid;
static unsigned long long abstract_start;
static int unreached_runs; /* VRAMLOCK_SWAP_UNREACHED=run */
/* A socket made at set-up, kept for the connection: a program that used up its
 * descriptors before it joins (cuInit, its first Vulkan instance) still reaches the
 * wrapper. Its inode tells whether the descriptor is still ours (the program may have
 * closed it, its number reused). */
static int reserve_fd = -1;
static ino_t reserve_ino;

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

/* Does the token's open file description, the one the command inherited
 * (VRAMLOCK_TOKEN_FD), hold the token now? 1 yes (exclusive, or shared in a budget
 * arena), 0 no, -1 cannot tell (no such descriptor, or not that file any more). The
 * kernel says so in fdinfo, per description: nothing is locked or unlocked here. */
static int token_held(void)
{
	char path[64], info[4096];
	struct stat st;
	if (token_fd < 0 || fstat(token_fd, &st) || st.st_dev != token_dev ||
	    st.st_ino != token_ino)
		return -1;
	snprintf(path, sizeof path, "/proc/self/fdinfo/%d", token_fd);
	if (read_proc(path, info, sizeof info) <= 0)
		return -1;
	return strstr(info, "\nlock:") && strstr(info, " FLOCK ") ? 1 : 0;
}

/* Is the wrapper (the process that listens at the socket) gone, or a zombie? */
static int wrapper_gone(void)
{
	char state;
	unsigned long long start;
	return wrapper_pid > 0 && (proc_stat(wrapper_pid, &state, &start) || start != wrapper_start ||
				   state == 'Z' || state == 'X');
}

/* Is the run's mark there that says a process of the command may be checkpointed
 * (parked, or being brought back)? It lies beside the socket (strategies/swap.py). */
static int parked_mark(void)
{
	char path[sizeof sock_path + 16];
	const char *slash = strrchr(sock_path, '/');
	if (!slash)
		return 0;
	snprintf(path, sizeof path, "%.*s/parked", (int)(slash - sock_path), sock_path);
	return !access(path, F_OK);
}

void control_register(const struct engine_ops *engine_ops)
{
	ops = engine_ops;
}

/* With `mu` and the token: the program runs on, its memory back first. */
static int resume_locked(void)
{
	char answer[256] = "restored";
	if (is_released())
		ops->restore(answer, sizeof answer);
	else
		gate_open_locked();
	return !strcmp(answer, "restored");
}

/* The connection to the wrapper is gone: the wrapper died, or the program closed
 * it. Nobody will say release or restore again, so the token decides: while the
 * description the command inherited holds it, nobody else is resident (the kernel
 * frees it only when every copy is closed) and the program runs on, restored; while
 * it does not, the program's memory stays out and its GPU calls wait until it does.
 * Gone before the first word, the safe side is the same as released (nothing is on
 * the GPU yet). Gone while the command was parked, or while it was brought back from
 * it, a process of the command may be checkpointed: none can run, so none runs on the
 * token, and the token goes back (the command's description is unlocked) rather than
 * leave every other member waiting for a command that cannot run. */
static void orphaned(void)
{
	int said = 0;
	control_lock();
	int was_released = is_released();
	if (!greeted) {
		/* A release with nothing to copy: nothing is on the GPU yet. */
		atomic_store(&closed, 1);
		if (!transition(STATE_RESIDENT, STATE_RELEASING))
			transition(STATE_RELEASING, STATE_RELEASED);
	}
	greeted = 1;
	pthread_cond_broadcast(&greet_cv);
	for (;;) {
		int held = token_held();
		/* Released only: a process running on the token keeps it (a mark left over
		 * cannot take the token from under a program that is on the GPU). */
		if (is_released() && parked_mark()) {
			if (held == 1)
				flock(token_fd, LOCK_UN);
			say("vramlock run went away while the command was parked: this process's GPU"
			    " calls stay blocked for good (end it)%s",
			    held == 1 ? "; the token is given back" : "");
			write_orphan_record();
			break;
		}
		if (held == 1 && resume_locked()) {
			if (said || was_released)
				say("vramlock run is out of reach, and the command holds the token:"
				    " this process's GPU calls go on");
			break;
		}
		if (held < 0 && !is_released())
			break; /* resident, and cannot tell: as before, the next release is refused */
		if (!is_released()) {
			char answer[256];
			ops->release(answer, sizeof answer, 1);
		}
		/* Nobody can hand the token back: the wrapper is gone, or the token cannot
		 * be seen (it may still be exiting: what closed the connection). */
		if (held < 0 || wrapper_gone()) {
			say("vramlock run went away while this process's GPU memory was released:"
			    " its GPU calls stay blocked for good (end it)");
			write_orphan_record();
			break;
		}
		said = 1;
		pthread_mutex_unlock(&mu);
		struct timespec tick = {0, 20000000};
		nanosleep(&tick, NULL);
		control_lock();
	}
	pthread_mutex_unlock(&mu);
}

/* `unpin` (about to be parked) and `pin` (back from a park before the turn): the host
 * copies unlocked and locked again by the engine, only while released. */
static void pin_word(const char *word, char *answer, size_t len)
{
	if (!is_released()) {
		snprintf(answer, len, "failed not released");
	} else if (!strcmp(word, "unpin")) {
		size_t n = ops->unpin ? ops->unpin() : 0;
		if (engine.state == STATE_RELEASED)
			transition(STATE_RELEASED, STATE_PARKED);
		snprintf(answer, len, "unpinned %zu", n);
	} else {
		if (ops->pin)
			ops->pin();
		if (engine.state == STATE_PARKED)
			transition(STATE_PARKED, STATE_RELEASED);
		snprintf(answer, len, "pinned");
	}
}

static void handle(const char *word)
{
	char answer[256] = "";
	TRACE("vramlock run says %s", word);
	control_lock();
	if (!strcmp(word, "release"))
		ops->release(answer, sizeof answer, 0);
	else if (!strcmp(word, "restore"))
		ops->restore(answer, sizeof answer);
	else if (!strcmp(word, "unpin") || !strcmp(word, "pin"))
		pin_word(word, answer, sizeof answer);
	/* `resident` asks nothing: the first word only says the gate may stay open. */
	if (!greeted)
		gate_joined_locked(!strcmp(word, "resident"));
	greeted = 1;
	if (!is_released() && !engine.refused[0] && ops->resident)
		ops->resident(); /* resident: the engine may make ready for the next release */
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

/* Out of the low numbers a program or a shell may expect to be free. */
#define RESERVE_FROM 100

static void make_reserve(void)
{
	struct stat st;
	reserve_fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
	int high = reserve_fd < 0 ? -1 : fcntl(reserve_fd, F_DUPFD_CLOEXEC, RESERVE_FROM);
	if (high >= 0) {
		close(reserve_fd);
		reserve_fd = high;
	}
	if (reserve_fd >= 0 && fstat(reserve_fd, &st)) {
		close(reserve_fd);
		reserve_fd = -1;
	}
	if (reserve_fd >= 0)
		reserve_ino = st.st_ino;
}

/* A socket to connect: the reserve while it is still ours, else a new one. */
static int take_socket(void)
{
	struct stat st;
	int fd = reserve_fd;
	reserve_fd = -1;
	if (fd >= 0 && !fstat(fd, &st) && S_ISSOCK(st.st_mode) && st.st_ino == reserve_ino)
		return fd;
	return socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
}

/* VRAMLOCK_SWAP_ABSTRACT, "vramlock-swap/<pid>/<start time>/<random>": kept where
 * it is whole. */
static void abstract_setup(const char *name)
{
	if (!name || strlen(name) >= sizeof abstract_name ||
	    sscanf(name, "vramlock-swap/%d/%llu/", &abstract_pid, &abstract_start) != 2)
		return;
	memcpy(abstract_name, name, strlen(name) + 1);
}

/* At start, from the environment (`setting`): whether the library is to act (1), where
 * the wrapper listens, and which descriptor holds the command's token. */
int control_setup(void)
{
	char at_start[4][sizeof sock_path + 1]; /* one more: too long a path stays too long */
	const char *path = setting("VRAMLOCK_SWAP_SOCKET", at_start[0], sizeof at_start[0]);
	const char *fd = setting("VRAMLOCK_TOKEN_FD", at_start[1], sizeof at_start[1]);
	const char *name = setting("VRAMLOCK_SWAP_ABSTRACT", at_start[2], sizeof at_start[2]);
	const char *unreached = setting("VRAMLOCK_SWAP_UNREACHED", at_start[3], sizeof at_start[3]);
	const char *debug = getenv("VRAMLOCK_SWAP_DEBUG");
	struct stat st;
	debug_on = debug && *debug && strcmp(debug, "0");
	if (!path || !*path)
		return 0;
	gate_on_join(control_join);
	unreached_runs = unreached && !strcmp(unreached, "run");
	abstract_setup(name);
	make_reserve();
	/* Too long a path stays empty: connect_control then says so. */
	if (strlen(path) < sizeof sock_path)
		memcpy(sock_path, path, strlen(path) + 1);
	if (fd && *fd && sscanf(fd, "%d", &token_fd) == 1 && !fstat(token_fd, &st)) {
		token_dev = st.st_dev;
		token_ino = st.st_ino;
	} else {
		token_fd = -1;
	}
	return 1;
}

/* Connects `fd` to the wrapper's socket at `path`: 0, or an errno. */
static int connect_path(int fd)
{
	struct sockaddr_un addr = {.sun_family = AF_UNIX};
	if (!sock_path[0])
		return ENAMETOOLONG;
	memcpy(addr.sun_path, sock_path, sizeof addr.sun_path);
	return connect(fd, (struct sockaddr *)&addr, sizeof addr) ? errno : 0;
}

/* Connects `fd` to the wrapper's abstract socket (no file: neither this process's
 * user nor its mount namespace matter), and checks that the kernel's peer there is the
 * wrapper the name says: that pid, started then. 0, or why not in `why`. */
static int connect_abstract(int fd, char *why, size_t len)
{
	struct sockaddr_un addr = {.sun_family = AF_UNIX};
	size_t n = strlen(abstract_name);
	struct ucred cred;
	socklen_t clen = sizeof cred;
	unsigned long long start;
	char state;
	if (!n) {
		snprintf(why, len, "none was named");
		return -1;
	}
	memcpy(addr.sun_path + 1, abstract_name, n); /* sun_path[0] stays NUL: abstract */
	socklen_t alen = (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + n);
	if (connect(fd, (struct sockaddr *)&addr, alen)) {
		snprintf(why, len, "%s", strerror(errno));
		return -1;
	}
	if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &clen) || cred.pid != abstract_pid ||
	    proc_stat(cred.pid, &state, &start) || start != abstract_start) {
		snprintf(why, len, "the process listening there is not vramlock run");
		return -1;
	}
	return 0;
}

/* The wrapper cannot be reached (`err`, in words `why`): under auto the process runs
 * without swap once its command holds the token (at once where it cannot tell: the
 * wrapper stops a process that runs on the GPU while its command is released); under
 * --release swap it ends before its GPU work. Never a GPU call blocked for good. */
static void unreached(int err, const char *why)
{
	if (!unreached_runs) {
		say("cannot reach vramlock run (%s): %s cannot release this process, so it ends"
		    " before its GPU work (--release auto would run it without swap)",
		    why, engine.option);
		_exit(UNREACHED_STATUS);
	}
	TRACE("cannot reach vramlock run (%s): this process runs without swap", why);
	while (token_held() == 0) {
		struct timespec tick = {0, 20000000};
		nanosleep(&tick, NULL);
	}
	pthread_mutex_lock(&mu);
	gate_unreached(err);
	greeted = 1;
	pthread_mutex_unlock(&mu);
}

/* Connects to the wrapper, at its socket's path, else at its abstract socket, and
 * waits for its first word; where neither can be reached, `unreached`. */
static void connect_control(void)
{
	char why[256], abstract_why[128] = "", hello[64];
	int err = 0;

	control_fd = take_socket();
	if (control_fd < 0)
		err = errno;
	else if ((err = connect_path(control_fd))) {
		close(control_fd); /* a failed connect leaves a socket unusable */
		control_fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
		if (control_fd < 0)
			snprintf(abstract_why, sizeof abstract_why, "%s", strerror(errno));
		else if (connect_abstract(control_fd, abstract_why, sizeof abstract_why))
			close(control_fd), control_fd = -1;
	}
	if (control_fd >= 0) {
		struct ucred cred;
		socklen_t clen = sizeof cred;
		char state;
		if (!getsockopt(control_fd, SOL_SOCKET, SO_PEERCRED, &cred, &clen) &&
		    !proc_stat(cred.pid, &state, &wrapper_start))
			wrapper_pid = cred.pid;
	}
	if (control_fd < 0) {
		if (err == ENAMETOOLONG)
			snprintf(why, sizeof why, "the socket path is too long");
		else
			snprintf(why, sizeof why, "%s: %s", sock_path, strerror(err));
		if (abstract_why[0])
			snprintf(why + strlen(why), sizeof why - strlen(why),
				 "; its abstract socket: %s", abstract_why);
		unreached(err, why);
		return;
	}
	snprintf(hello, sizeof hello, "hello %d", (int)getpid());
	if ((err = send_line(hello) ? errno : 0) || (err = start_thread(control_thread))) {
		snprintf(why, sizeof why, "%s", strerror(err));
		close(control_fd);
		control_fd = -1;
		unreached(err, why);
		return;
	}
	pthread_mutex_lock(&mu);
	while (!greeted)
		pthread_cond_wait(&greet_cv, &mu);
	pthread_mutex_unlock(&mu);
}

void control_join(void)
{
	pthread_once(&connect_once, connect_control);
}

/* fork: `mu` is taken around it, so that the child's copy of every table is whole. */
void before_fork(void)
{
	pthread_mutex_lock(&mu);
}

void after_fork_parent(void)
{
	pthread_mutex_unlock(&mu);
}

/* A forked child is a process of its own: its parent's connection and memory are
 * not its to answer for (the copies of the tables are forgotten, not freed). It
 * joins as its own peer at its first GPU call, and no GPU call passes before the
 * wrapper has said where the command stands. Only the forking thread lives on. */
void after_fork_child(void)
{
	if (control_fd >= 0)
		close(control_fd);
	control_fd = -1;
	if (reserve_fd >= 0) { /* the parent's, the same socket: this process needs its own */
		close(reserve_fd);
		make_reserve();
	}
	pthread_cond_init(&greet_cv, NULL);
	connect_once = (pthread_once_t)PTHREAD_ONCE_INIT;
	greeted = 0;
	if (engine.active) {
		state_reset();
		if (ops->forget)
			ops->forget();
	}
	gate_after_fork(engine.active);
	pthread_mutex_unlock(&mu);
}
