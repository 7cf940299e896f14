/*
 * core/hostmem.c: host memory before a release pins more of it. Pinned pages cannot
 * be swapped or reclaimed, so pinning more than the host has free would wake the kernel's OOM
 * killer, which may take this program (a model) or any other. A release that needs
 * new pinned memory goes ahead only while MemAvailable (/proc/meminfo) stays above a
 * margin afterwards: max(1 GiB, 5 % of MemTotal). Otherwise that release fails, with
 * the reason; the program keeps its GPU memory and runs on, as after any failed
 * release, and the wrapper tries again later.
 *
 * Each allocation's pinned copy is kept from one release to the next, so only the
 * first release of an allocation pins anything: a member released again costs no new
 * host memory, and is never refused here.
 *
 * VRAMLOCK_SWAP_MEMINFO names another file to read instead of /proc/meminfo: a hook
 * for the tests, which cannot make the host short of memory.
 */
#define _GNU_SOURCE
#include "hostmem.h"

#include "proc.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define GIB (1024.0 * 1024 * 1024)
#define MARGIN_MIN (1ULL << 30)
#define MARGIN_PERCENT 5

/* The value of `key` (in kB) in meminfo's text, in bytes; 0 when it is not there. */
static unsigned long long field(const char *text, const char *key)
{
	size_t n = strlen(key);
	for (const char *line = text; line && *line; line = strchr(line, '\n')) {
		if (*line == '\n')
			line++;
		if (!strncmp(line, key, n) && line[n] == ':')
			return strtoull(line + n + 1, NULL, 10) * 1024;
	}
	return 0;
}

static void show(char *out, size_t len, double bytes)
{
	if (bytes >= GIB)
		snprintf(out, len, "%.1f GiB", bytes / GIB);
	else
		snprintf(out, len, "%.0f MiB", bytes / (1024 * 1024));
}

/* Whether `need` more bytes may be pinned; where not, *why (if asked) says so. */
int hostmem_spare(unsigned long long need, const char **why_not)
{
	static char why[200];
	if (!need)
		return 1;
	const char *path = getenv("VRAMLOCK_SWAP_MEMINFO");
	char text[8192];
	if (read_proc(path && *path ? path : "/proc/meminfo", text, sizeof text) <= 0)
		return 1; /* nothing to judge by: as before this check */
	unsigned long long total = field(text, "MemTotal"), avail = field(text, "MemAvailable");
	if (!total || !strstr(text, "MemAvailable:"))
		return 1; /* a kernel before 3.14 (no MemAvailable) */
	unsigned long long margin = total / 100 * MARGIN_PERCENT;
	if (margin < MARGIN_MIN)
		margin = MARGIN_MIN;
	if (avail >= margin && avail - margin >= need)
		return 1;
	char needs[32], has[32], kept[32];
	show(needs, sizeof needs, (double)need);
	show(has, sizeof has, (double)avail);
	show(kept, sizeof kept, (double)margin);
	snprintf(why, sizeof why,
		 "host memory: the release needs %s pinned, MemAvailable is %s (%s is kept free)",
		 needs, has, kept);
	if (why_not)
		*why_not = why;
	return 0;
}
