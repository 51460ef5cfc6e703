/* ap_shm_int: what the snapshot's three files share and nobody else sees:
 * sizes and limits, the entry and slot arithmetic, and the judging of a
 * segment file that both the writer (taking over its own name) and the
 * sweep (other names) do. */
#ifndef AP_SHM_INT_H
#define AP_SHM_INT_H

#include <stddef.h>
#include <stdint.h>
#include <sys/stat.h>
#include <unistd.h>

#include "ap_shm.h"

#define HALF_HDR ((uint64_t)sizeof(struct ap_shm_half))
#define ENT_HDR ((uint64_t)sizeof(struct ap_shm_entry))
#define SLOT_OFF_MASK 0xffffffffull

/* Segment sizes the writer accepts. A created segment is at least 1 MiB
 * (sparse, so that costs nothing); caller memory (tests, fuzzing) may be
 * as small as two halves with a minimal index and a page of arena. */
#define SEG_MIN_CREATE (1ull << 20)
#define ARENA_MIN 4096ull
#define SEG_MIN_MEM (AP_SHM_HDR_SIZE + 2 * (HALF_HDR + AP_SHM_MIN_CAP * 8ull + ARENA_MIN))
#define SEG_MAX (64ull << 30)

/* The smallest half a reader accepts: its header, a minimal index and the
 * reserved arena word. */
#define HALF_MIN (HALF_HDR + AP_SHM_MIN_CAP * 8ull + 8)

/* posix_fallocate granularity, a multiple of the page size: one call per
 * MiB of growth. */
#define RESERVE_CHUNK (1ull << 20)

_Static_assert(sizeof(struct ap_shm_hdr) <= AP_SHM_HDR_SIZE, "header too big");
/* Readers (and test encoders) rely on these offsets. */
_Static_assert(offsetof(struct ap_shm_hdr, state) == 64 && offsetof(struct ap_shm_hdr, changes) == 72 &&
		       offsetof(struct ap_shm_hdr, hash_seed) == 80 && offsetof(struct ap_shm_hdr, node) == 88 &&
		       offsetof(struct ap_shm_hdr, writer_start) == 344 &&
		       offsetof(struct ap_shm_hdr, writer_pidns) == 352 && sizeof(struct ap_shm_hdr) == 360,
	       "header layout");
/* Layout 3 (no start time) kept the same offsets up to the node name. */
_Static_assert(offsetof(struct ap_shm_hdr, writer_pid) == 48, "writer_pid in every layout");
_Static_assert(sizeof(struct ap_shm_half) == 64, "half header layout");
_Static_assert(sizeof(struct ap_shm_entry) == 16, "entry header layout");
/* off32 counts 8-byte units: every arena offset of a half below 32 GiB fits. */
_Static_assert(SEG_MAX / 2 <= (1ull << 35), "arena offsets must fit off32");

static inline uint64_t pad8(uint64_t n) { return (n + 7) & ~7ull; }

static inline uint64_t ent_size(uint64_t klen, uint64_t vlen) { return ENT_HDR + pad8(klen) + pad8(vlen); }

static inline uint64_t slot_make(uint64_t hash, uint64_t off) { return (hash & ~SLOT_OFF_MASK) | off >> 3; }

static inline uint64_t pow2_at_least(uint64_t n)
{
	uint64_t c = 1;
	while (c < n)
		c <<= 1;
	return c;
}


#define REMOVE_GONE 1
#define REMOVE_UNREADABLE 2 /* also what is no snapshot (under our LOCK_EX) */

/* Our regular file: the only kind anybody here judges or unlinks. */
static inline int ours(const struct stat *st) { return S_ISREG(st->st_mode) && st->st_uid == geteuid(); }

/* fd is open on name in dfd, and st is its fstat (our regular file):
 * judge it under LOCK_EX | LOCK_NB and unlink the name as remove says
 * (ap_shm_sweep.c). */
enum ap_shm_fate shm_judge_at(int dfd, const char *name, int fd, const struct stat *st, int remove,
			      struct ap_shm_swept *s);

#endif
