/*
 * raw_exec NAME... -- PROGRAM ARGS: runs PROGRAM without the environment variables
 * NAME..., through the execve system call itself rather than the C library's
 * wrappers, as Go's runtime execs: an exec that a preloaded library cannot see.
 */
#define _GNU_SOURCE
#include <stdio.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

extern char **environ;

int main(int argc, char **argv)
{
	int sep = 1;
	while (sep < argc && strcmp(argv[sep], "--"))
		sep++;
	if (sep + 1 >= argc) {
		fprintf(stderr, "usage: raw_exec NAME... -- PROGRAM ARGS\n");
		return 2;
	}
	static char *env[4096];
	size_t n = 0;
	for (char **e = environ; *e && n + 1 < sizeof env / sizeof *env; e++) {
		int drop = 0;
		for (int i = 1; i < sep; i++) {
			size_t len = strlen(argv[i]);
			if (!strncmp(*e, argv[i], len) && (*e)[len] == '=')
				drop = 1;
		}
		if (!drop)
			env[n++] = *e;
	}
	env[n] = NULL;
	syscall(SYS_execve, argv[sep + 1], argv + sep + 1, env);
	perror("raw_exec");
	return 127;
}
