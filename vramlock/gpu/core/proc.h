/*
 * core/proc.h: /proc files, the environment at start, the library's own threads.
 */
#ifndef VRAMLOCK_CORE_PROC_H
#define VRAMLOCK_CORE_PROC_H

#include <pthread.h>
#include <stddef.h>
#include <sys/types.h>

/* Reads a small /proc file whole; its length, or -1. */
ssize_t read_proc(const char *path, char *buf, size_t size);
/* The state letter and start time (field 22) of process `pid`: 0, or -1 when gone. */
int proc_stat(int pid, char *state, unsigned long long *start);
/* A variable that reaches the library: its value, else the one the process started
 * with (kept in `buf`); NULL where it has none. */
const char *setting(const char *name, char *buf, size_t size);
/* Starts `fn` on a detached thread, every signal blocked there: 0, or an errno. */
int start_thread(void *(*fn)(void *));

#endif
