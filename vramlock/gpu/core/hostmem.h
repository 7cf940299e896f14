/*
 * core/hostmem.h: whether the host can spare memory a release would lock.
 */
#ifndef VRAMLOCK_CORE_HOSTMEM_H
#define VRAMLOCK_CORE_HOSTMEM_H

/* Whether `need` more bytes may be pinned (else why, in *why when not NULL). */
int hostmem_spare(unsigned long long need, const char **why);

#endif
