/*
 * core/record.h: the member record of a process whose wrapper is gone.
 */
#ifndef VRAMLOCK_CORE_RECORD_H
#define VRAMLOCK_CORE_RECORD_H

/* Written into the arena (VRAMLOCK_ARENA): released, blocked until ended. */
void write_orphan_record(void);

#endif
