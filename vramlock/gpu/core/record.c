/*
 * core/record.c: the member record a process writes into the arena when its wrapper is
 * gone while it is released. Its fields are those of vramlock/arena/records.py
 * (tests/test_swap_run.py reads one back with that module).
 */
#define _GNU_SOURCE
#include "record.h"

#include "proc.h"

#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

/* `s` as a JSON string (bytes >= 0x80 as Latin-1: the record stays valid UTF-8). */
static void json_string(FILE *f, const char *s, size_t len)
{
	fputc('"', f);
	for (size_t i = 0; i < len; i++) {
		unsigned char c = (unsigned char)s[i];
		if (c == '"' || c == '\\')
			fprintf(f, "\\%c", c);
		else if (c < 0x20 || c >= 0x7f)
			fprintf(f, "\\u%04x", c);
		else
			fputc(c, f);
	}
	fputc('"', f);
}

/* A process whose wrapper died while it was released holds no lock, so `vramlock
 * who` would not see it: it writes a member record of its own into the arena
 * (the format vramlock's records use), saying it is released and blocked. */
void write_orphan_record(void)
{
	const char *arena = getenv("VRAMLOCK_ARENA");
	char comm[64], cmdline[4096], name[64], tmp[96], state;
	ssize_t ncmd;
	unsigned long long start = 0;
	if (!arena || !*arena || proc_stat(getpid(), &state, &start) ||
	    read_proc("/proc/self/comm", comm, sizeof comm) <= 0 ||
	    (ncmd = read_proc("/proc/self/cmdline", cmdline, sizeof cmdline)) <= 0)
		return;
	comm[strcspn(comm, "\n")] = 0;
	int dir = open(arena, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
	int members = dir < 0 ? -1 : openat(dir, "members", O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
	if (dir >= 0)
		close(dir);
	if (members < 0)
		return;
	int pid = (int)getpid();
	snprintf(name, sizeof name, "%d-%llu.json", pid, start);
	snprintf(tmp, sizeof tmp, ".%d-%llu.swap.tmp", pid, start);
	int fd = openat(members, tmp, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
	FILE *f = fd < 0 ? NULL : fdopen(fd, "w");
	if (!f) {
		if (fd >= 0)
			close(fd);
		close(members);
		return;
	}
	struct timespec now;
	clock_gettime(CLOCK_REALTIME, &now);
	fprintf(f, "{\"version\": 1, \"pid\": %d, \"starttime\": %llu, \"uid\": %u, \"name\": ",
		pid, start, (unsigned)geteuid());
	json_string(f, comm, strlen(comm));
	fputs(", \"command\": [", f);
	for (char *arg = cmdline; arg < cmdline + ncmd; arg += strlen(arg) + 1) {
		if (arg > cmdline)
			fputs(", ", f);
		json_string(f, arg, strlen(arg));
	}
	fprintf(f, "], \"strategy\": \"swap\", \"state\": \"released\", \"since\": %.3f, "
		   "\"note\": \"its vramlock run is gone: blocked until ended\"}\n",
		now.tv_sec + now.tv_nsec / 1e9);
	int bad = ferror(f);
	if (fclose(f) || bad || renameat(members, tmp, members, name))
		unlinkat(members, tmp, 0);
	close(members);
}
