/*
 * exec.c: the library stays in whatever the command execs. A process of the command
 * that execs a program with an environment lacking LD_PRELOAD (`env -u LD_PRELOAD`,
 * `env -i`, a scrubbed environment) would run that program without the gate, free to
 * use the GPU in another member's turn. So each way the C library has to exec or spawn
 * a program passes on LD_PRELOAD with this library in it, and the variables that reach
 * the wrapper, as they were when the process started. A raw execve system call (Go's
 * runtime makes its own) passes by here: the wrapper stops what that lets onto the GPU
 * while the command is released.
 *
 * The child of a fork runs these between fork and exec, where another thread may have
 * held malloc's lock: nothing here allocates on the heap or looks a symbol up.
 */
#include "swap.h"

#include <spawn.h>

extern char **environ;

#define PRELOAD "LD_PRELOAD="
/* The variables that reach the wrapper, "NAME=value" as at start (empty: not set). */
#define NKEPT 6
static const char *const kept_names[NKEPT] = {
	"VRAMLOCK_SWAP_SOCKET",	 "VRAMLOCK_TOKEN_FD",	    "VRAMLOCK_SWAP_PREPARE",
	"VRAMLOCK_SWAP_STACK",	 "VRAMLOCK_SWAP_ABSTRACT", "VRAMLOCK_SWAP_UNREACHED"};
static char kept[NKEPT][320];
static char self_path[4096]; /* this library, as the dynamic linker loaded it */

typedef int (*execve_fn)(const char *, char *const[], char *const[]);
typedef int (*fexecve_fn)(int, char *const[], char *const[]);
typedef int (*execveat_fn)(int, const char *, char *const[], char *const[], int);
typedef int (*spawn_fn)(pid_t *, const char *, const posix_spawn_file_actions_t *,
			const posix_spawnattr_t *, char *const[], char *const[]);
typedef int (*system_fn)(const char *);
typedef FILE *(*popen_fn)(const char *, const char *);
static execve_fn real_execve, real_execvpe;
static fexecve_fn real_fexecve;
static execveat_fn real_execveat;
static spawn_fn real_posix_spawn, real_posix_spawnp;
static system_fn real_system;
static popen_fn real_popen;

/* At set-up, with the real dlsym: what the hooks pass on, and where they go. */
static void exec_setup(void *(*lookup)(void *, const char *))
{
	Dl_info info;
	if (dladdr((void *)exec_setup, &info) && info.dli_fname &&
	    strlen(info.dli_fname) < sizeof self_path)
		memcpy(self_path, info.dli_fname, strlen(info.dli_fname) + 1);
	for (int i = 0; i < NKEPT; i++) {
		char at_start[sizeof kept[i]];
		const char *v = setting(kept_names[i], at_start, sizeof at_start);
		size_t n = strlen(kept_names[i]);
		if (v && n + strlen(v) + 2 <= sizeof kept[i]) {
			memcpy(kept[i], kept_names[i], n);
			kept[i][n] = '=';
			memcpy(kept[i] + n + 1, v, strlen(v) + 1);
		}
	}
	real_execve = (execve_fn)lookup(RTLD_NEXT, "execve");
	real_execvpe = (execve_fn)lookup(RTLD_NEXT, "execvpe");
	real_fexecve = (fexecve_fn)lookup(RTLD_NEXT, "fexecve");
	real_execveat = (execveat_fn)lookup(RTLD_NEXT, "execveat");
	real_posix_spawn = (spawn_fn)lookup(RTLD_NEXT, "posix_spawn");
	real_posix_spawnp = (spawn_fn)lookup(RTLD_NEXT, "posix_spawnp");
	real_system = (system_fn)lookup(RTLD_NEXT, "system");
	real_popen = (popen_fn)lookup(RTLD_NEXT, "popen");
}

static size_t name_len(const char *entry)
{
	const char *eq = strchr(entry, '=');
	return eq ? (size_t)(eq - entry) : strlen(entry);
}

/* Does an LD_PRELOAD value name this library (its list: colons or spaces)? */
static int names_self(const char *value)
{
	size_t n = strlen(self_path);
	for (const char *p = value; *p;) {
		size_t len = strcspn(p, ": ");
		if (len == n && !memcmp(p, self_path, n))
			return 1;
		p += len;
		p += strspn(p, ": ");
	}
	return 0;
}

/* Is `envp` missing anything the library needs passed on? */
static int lacking(char *const envp[])
{
	if (!engine.active || !self_path[0])
		return 0;
	int preload = 0, have[NKEPT] = {0};
	for (char *const *e = envp; e && *e; e++) {
		if (!strncmp(*e, PRELOAD, sizeof PRELOAD - 1))
			preload = names_self(*e + sizeof PRELOAD - 1);
		for (int i = 0; i < NKEPT; i++)
			if (kept[i][0] && !strcmp(*e, kept[i]))
				have[i] = 1;
	}
	for (int i = 0; i < NKEPT; i++)
		if (kept[i][0] && !have[i])
			return 1;
	return !preload;
}

static size_t count(char *const envp[])
{
	size_t n = 0;
	while (envp && envp[n])
		n++;
	return n;
}

/* The length of the LD_PRELOAD entry `fill` makes for `envp`, its NUL included. */
static size_t preload_size(char *const envp[])
{
	size_t size = sizeof PRELOAD + strlen(self_path) + 1;
	for (char *const *e = envp; e && *e; e++)
		if (!strncmp(*e, PRELOAD, sizeof PRELOAD - 1))
			size += strlen(*e);
	return size;
}

/* Appends `s` to the string in `dst` (`size` bytes in all), as much of it as fits. */
static void append(char *dst, size_t size, const char *s)
{
	size_t n = strlen(dst);
	while (*s && n + 1 < size)
		dst[n++] = *s++;
	dst[n] = '\0';
}

/* `out` (room for `slots` entries) becomes `envp` with LD_PRELOAD naming this library
 * first (the program's own preloads after it) and the kept variables as they were at
 * start, in place of any other values of theirs. `preload` (`size` bytes) holds the new
 * LD_PRELOAD entry. What no longer fits (another thread changed `envp` since it was
 * measured) is left out: nothing is written past the room. */
static char *const *fill(char *const envp[], char **out, size_t slots, char *preload,
			 size_t size)
{
	size_t n = 0;
	const char *theirs = NULL;
	for (char *const *e = envp; e && *e; e++) {
		int drop = 0;
		if (!strncmp(*e, PRELOAD, sizeof PRELOAD - 1)) {
			theirs = *e + sizeof PRELOAD - 1;
			drop = 1;
		}
		for (int i = 0; i < NKEPT; i++)
			if (kept[i][0] && name_len(*e) == strlen(kept_names[i]) &&
			    !strncmp(*e, kept_names[i], strlen(kept_names[i])))
				drop = 1;
		if (!drop && n + 1 + NKEPT + 2 <= slots) /* then LD_PRELOAD, the kept, NULL */
			out[n++] = *e;
	}
	preload[0] = '\0';
	append(preload, size, PRELOAD);
	if (theirs && *theirs && names_self(theirs)) {
		append(preload, size, theirs);
	} else {
		append(preload, size, self_path);
		if (theirs && *theirs) {
			append(preload, size, ":");
			append(preload, size, theirs);
		}
	}
	out[n++] = preload;
	for (int i = 0; i < NKEPT; i++)
		if (kept[i][0])
			out[n++] = kept[i];
	out[n] = NULL;
	return out;
}

/* What `fill` needs for `envp`, measured once (another thread may change it meanwhile):
 * its entries and the LD_PRELOAD entry's bytes; none where nothing lacks. */
struct need {
	size_t slots, preload;
};

static struct need measure(char *const envp[])
{
	struct need n = {0, 0};
	if (lacking(envp)) {
		n.slots = count(envp) + NKEPT + 2;
		n.preload = preload_size(envp);
	}
	return n;
}

/* The copy is made on the caller's stack up to this size, in pages mapped for it above
 * (a thread's stack may be small, an environment large): never on the heap. */
#define ON_STACK 16384

static size_t pointers(struct need n)
{
	return n.slots + (n.preload + sizeof(char *) - 1) / sizeof(char *);
}

/* The pointers the caller's stack is to hold for a copy of `n` pointers (1: none). */
static size_t on_stack(size_t n)
{
	return n && n * sizeof(char *) <= ON_STACK ? n : 1;
}

struct copy {
	char *const *envp; /* what the exec gets; NULL: no room could be had (ENOMEM) */
	void *map;	   /* mapped for it: unmapped by done() */
	size_t len;
};

static struct copy with_library(char *const envp[], struct need need, char **stack)
{
	struct copy c = {envp, NULL, 0};
	if (!need.slots)
		return c;
	char **room = stack;
	if (pointers(need) * sizeof(char *) > ON_STACK) {
		c.len = pointers(need) * sizeof(char *);
		c.map = mmap(NULL, c.len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
		if (c.map == MAP_FAILED) {
			c.map = NULL;
			c.envp = NULL;
			return c;
		}
		room = c.map;
	}
	c.envp = fill(envp, room, need.slots, (char *)(room + need.slots), need.preload);
	return c;
}

/* After the exec (it failed) or the spawn: the mapped room goes, errno kept. A vfork
 * child's exec that succeeds leaves it in its parent's memory: only an environment too
 * large for the stack costs that. */
static void done(struct copy *c)
{
	if (c->map) {
		int e = errno;
		munmap(c->map, c->len);
		errno = e;
	}
}

/* `envp` as the exec must see it (`fixed.envp`): the same where nothing lacks, else a
 * copy in the caller's frame (a macro: the array lives there) or mapped. */
#define WITH_LIBRARY(envp, fixed)                                                           \
	const struct need fixed##_need = measure(envp);                                     \
	char *fixed##_stack[on_stack(pointers(fixed##_need))];                              \
	struct copy fixed = with_library(envp, fixed##_need, fixed##_stack)

static pthread_once_t exec_once = PTHREAD_ONCE_INIT;

static void exec_init(void)
{
	library_setup();
	exec_setup(real_dlsym);
}

__attribute__((constructor)) static void init(void)
{
	pthread_once(&exec_once, exec_init);
}

/* Before our constructor (another library's constructor execs): set up first. */
static void ready_to_exec(void)
{
	if (!real_execve)
		pthread_once(&exec_once, exec_init);
}

static int missing(void)
{
	errno = ENOSYS;
	return -1;
}

/* No room for the environment with the library: no exec without it. */
static int no_room(void)
{
	errno = ENOMEM;
	return -1;
}

EXPORT int execve(const char *path, char *const argv[], char *const envp[])
{
	ready_to_exec();
	if (!real_execve)
		return missing();
	WITH_LIBRARY(envp, env);
	if (!env.envp)
		return no_room();
	int r = real_execve(path, argv, env.envp);
	done(&env);
	return r;
}

EXPORT int execvpe(const char *file, char *const argv[], char *const envp[])
{
	ready_to_exec();
	if (!real_execvpe)
		return missing();
	WITH_LIBRARY(envp, env);
	if (!env.envp)
		return no_room();
	int r = real_execvpe(file, argv, env.envp);
	done(&env);
	return r;
}

EXPORT int execv(const char *path, char *const argv[])
{
	return execve(path, argv, environ);
}

EXPORT int execvp(const char *file, char *const argv[])
{
	return execvpe(file, argv, environ);
}

EXPORT int fexecve(int fd, char *const argv[], char *const envp[])
{
	ready_to_exec();
	if (!real_fexecve)
		return missing();
	WITH_LIBRARY(envp, env);
	if (!env.envp)
		return no_room();
	int r = real_fexecve(fd, argv, env.envp);
	done(&env);
	return r;
}

EXPORT int execveat(int dirfd, const char *path, char *const argv[], char *const envp[],
		    int flags)
{
	ready_to_exec();
	if (!real_execveat)
		return missing();
	WITH_LIBRARY(envp, env);
	if (!env.envp)
		return no_room();
	int r = real_execveat(dirfd, path, argv, env.envp, flags);
	done(&env);
	return r;
}

/* execl, execlp, execle: how many arguments follow `first`, up to the NULL. */
static size_t listed(va_list *ap)
{
	size_t n = 0;
	while (va_arg(*ap, char *))
		n++;
	return n;
}

/* `argv` (room for listed + 2) gets `first` and what follows it, up to the NULL. */
static void list(char **argv, const char *first, va_list *ap)
{
	size_t n = 0;
	argv[n++] = (char *)first;
	while ((argv[n++] = va_arg(*ap, char *)))
		;
}

/* In execl, execlp and execle: `argv`, on the caller's stack, holds `arg` and what
 * follows it up to the NULL; `ap` is left just past the NULL, open (va_end it). */
#define LIST_ARGV(arg, ap, argv)                                                            \
	va_start(ap, arg);                                                                  \
	size_t argc_ = listed(&ap) + 1;                                                     \
	va_end(ap);                                                                         \
	char *argv[argc_ + 1];                                                              \
	va_start(ap, arg);                                                                  \
	list(argv, arg, &ap)

EXPORT int execl(const char *path, const char *arg, ...)
{
	va_list ap;
	LIST_ARGV(arg, ap, argv);
	va_end(ap);
	return execve(path, argv, environ);
}

EXPORT int execlp(const char *file, const char *arg, ...)
{
	va_list ap;
	LIST_ARGV(arg, ap, argv);
	va_end(ap);
	return execvpe(file, argv, environ);
}

EXPORT int execle(const char *path, const char *arg, ...)
{
	va_list ap;
	LIST_ARGV(arg, ap, argv);
	char *const *envp = va_arg(ap, char *const *);
	va_end(ap);
	return execve(path, argv, envp);
}

EXPORT int posix_spawn(pid_t *pid, const char *path, const posix_spawn_file_actions_t *actions,
		       const posix_spawnattr_t *attr, char *const argv[], char *const envp[])
{
	ready_to_exec();
	if (!real_posix_spawn)
		return ENOSYS;
	WITH_LIBRARY(envp, env);
	if (!env.envp)
		return ENOMEM;
	int r = real_posix_spawn(pid, path, actions, attr, argv, env.envp);
	done(&env);
	return r;
}

EXPORT int posix_spawnp(pid_t *pid, const char *file, const posix_spawn_file_actions_t *actions,
			const posix_spawnattr_t *attr, char *const argv[], char *const envp[])
{
	ready_to_exec();
	if (!real_posix_spawnp)
		return ENOSYS;
	WITH_LIBRARY(envp, env);
	if (!env.envp)
		return ENOMEM;
	int r = real_posix_spawnp(pid, file, actions, attr, argv, env.envp);
	done(&env);
	return r;
}

/* system and popen run the shell with the process's own environment: where the
 * program took the library's variables out of it, they are put back first. */
static void environ_with_library(void)
{
	if (!lacking(environ))
		return;
	const char *theirs = getenv("LD_PRELOAD");
	if (!theirs || !names_self(theirs)) {
		char value[preload_size(NULL) + (theirs ? strlen(theirs) + 1 : 0)];
		strcpy(value, self_path);
		if (theirs && *theirs) {
			strcat(value, ":");
			strcat(value, theirs);
		}
		setenv("LD_PRELOAD", value, 1);
	}
	for (int i = 0; i < NKEPT; i++)
		if (kept[i][0])
			setenv(kept_names[i], kept[i] + strlen(kept_names[i]) + 1, 1);
}

EXPORT int system(const char *command)
{
	ready_to_exec();
	if (!real_system)
		return missing();
	if (command)
		environ_with_library();
	return real_system(command);
}

EXPORT FILE *popen(const char *command, const char *type)
{
	ready_to_exec();
	if (!real_popen) {
		errno = ENOSYS;
		return NULL;
	}
	environ_with_library();
	return real_popen(command, type);
}
