/* ap_shm: the receptionist's shared-memory snapshot (one writer, the
 * receptionist C node; lock-free readers, the NIF in the BEAM).
 *
 * Maps a key (bytes) to a value (bytes: the external term format of the
 * key's listing, a list of pids, 131 byte included). Lookups are O(1): an
 * open-addressing index over an append-only arena.
 *
 * Segment layout (native endianness, every field 8-byte aligned):
 *
 *   [header: AP_SHM_HDR_SIZE bytes][half 0: half_size][half 1: half_size]
 *
 *   header   magic, version, sizes, `gen`, writer pid, incarnation, state,
 *            `changes`, `hash_seed`, node name, the writer's start time
 *            and PID namespace (struct ap_shm_hdr; see "Writers that are
 *            gone" below).
 *   half     struct ap_shm_half, then `cap` index slots (uint64 each), then
 *            the arena: `arena_size` bytes starting at `arena_off` (from the
 *            half's start). Arena offset 0 is reserved (means "empty").
 *   slot     (tag32 << 32) | off32: tag32 is the upper 32 bits of the key's
 *            64-bit hash, off32 the entry's arena offset in 8-byte units
 *            (0: an empty slot). Linear probing from hash & (cap - 1).
 *            The hash is ap_shm_hash(hash_seed, key): keyed by the
 *            segment's seed (see "Hashing" below).
 *   entry    struct ap_shm_entry {hash, key_len, val_len}, the key bytes,
 *            zero padding to 8, the value bytes, zero padding to 8.
 *
 * Concurrency. The active half is `gen & 1`. Within a half, entries are
 * append-only and never change once a slot points at them; an update
 * appends a new entry and stores the slot (one 64-bit release store), a
 * removal appends an entry with an empty value (val_len 0). When the arena
 * or the index is full, the writer compacts: it rebuilds the live entries
 * into the other half and then bumps `gen` (release), which switches the
 * active half. A reader loads `gen` (acquire) before and after its reads
 * (acquire fence, then load), seqlock style, and retries if it changed: the
 * half it read may be under rewrite. (gen, off) therefore names immutable
 * bytes for as long as `gen` does not change, which lets readers cache
 * decoded values.
 *
 * Changes. `changes` counts the writer's completed changes. It starts at 1
 * and only ever grows (64 bits: it never wraps, so a value is never seen
 * twice). The writer increments it with a release store
 *
 *  - in ap_shm_put, after a put that changed anything published it (its
 *    slot, or the gen of the compaction it caused), before put returns;
 *  - in ap_shm_rebuild, after the new half's gen and the state LIVE;
 *  - after every store of `state` (STALE, LIVE, CLOSED), failures included.
 *
 * Nothing else changes it: not lookups, not heartbeats, not a put that
 * changed nothing (E2BIG, removing what is not there, any put while STALE).
 * So `changes` names the content: a reader that loads changes == C
 * (acquire) sees everything the writer did before counting C, and if it
 * later loads changes == C again, no put, rebuild or state change was
 * counted in between. The guarantee readers may build on: an answer
 * obtained by a lookup that STARTED after loading C reflects every change
 * counted up to C, hence, while changes still reads C, every put that has
 * returned (the receptionist replies only after put returns); it may be
 * given again without looking. The label of such an answer must be the C
 * loaded BEFORE the lookup: a put racing with the lookup may or may not be
 * in its answer, and is counted only in a later value, which then no
 * longer matches the label. Not promised: that the bytes of the segment
 * are unchanged while changes reads C (puts in flight append entries and
 * store slots before they are counted), or anything at all about a
 * hostile segment's counter: a reader may trust it no further than it
 * trusts the values.
 *
 * Hashing. Keys may come from outside input, so the index must not let
 * anyone pick keys that collide: with an unkeyed hash, keys chosen to share
 * the low bits build linear-probe chains of O(n) slots, walked by every
 * lookup (on a normal BEAM scheduler) and every put. So the hash is keyed:
 * SipHash-1-3 with the 128-bit key (hash_seed, hash_seed ^
 * AP_SHM_SEED_K1), where hash_seed is a random 64-bit number the writer
 * draws when it creates (or inits) the segment (getrandom(2); time ^ pid
 * if that fails) and stores in the header before the magic. It never
 * changes for the segment's life; the writer keeps its own copy and never
 * reads it back. A reader loads it (relaxed) once per call, after the
 * magic and version checks, and treats it as just a number: a wrong seed
 * can only make lookups miss. Without the seed, chosen collisions are as
 * hard as forging SipHash.
 *
 * Writers that are gone. A segment outlives a writer that is killed (its
 * name is unlinked only on a clean exit), so whether its writer still runs
 * is told by a lock, not by the header: the writer takes flock(LOCK_SH) on
 * the object as soon as it has created it and holds it, on an O_CLOEXEC
 * fd, until it exits; the kernel drops it however the writer dies. The
 * writer is gone exactly when flock(LOCK_EX | LOCK_NB) on the object
 * succeeds. That holds whatever PID or time namespace, /proc mount or pid
 * reuse anyone sees. Anybody who unlinks a snapshot's name (the sweep, a
 * create replacing a dead writer's object, the writer's close, the BEAM
 * side owner through the NIF) does it only while holding LOCK_EX on the
 * object it opened (O_NOFOLLOW | O_NONBLOCK, a regular file of our uid)
 * and after checking that the name still names that object (dev and
 * inode): a live writer holds LOCK_SH, so its name can never be unlinked
 * by a party that follows this rule, and a name replaced meanwhile is left
 * alone. A new writer under a held name gets -EEXIST and may retry until
 * the holder is gone. `writer_pid`, `writer_start` (field 22 of
 * /proc/PID/stat) and `writer_pidns` (the inode of its PID namespace) are
 * stored before the magic and never changed: information for logs, never
 * evidence. A create writes AP_SHM_MAGIC_CREATING and the stamps right
 * after sizing the object, so a writer killed while creating leaves an
 * object the sweep can tell and remove. Layout-3 and layout-4 writers
 * predate the lock: such a segment is removed only when no process here
 * has its pid.
 *
 * Readers trust nothing: every offset and length is checked against the
 * mapping before it is dereferenced, probes are bounded by
 * min(`cap`, AP_SHM_MAX_PROBES), retries by AP_SHM_MAX_RETRIES, so a torn
 * or hostile segment yields AP_SHM_EBAD (or AP_SHM_EBUSY), never a fault
 * nor an unbounded walk. The probe bound: the writer keeps every index at
 * most half full and the seed keeps the hash uniform, so an honest chain
 * is a few slots long (a chain of AP_SHM_MAX_PROBES is astronomically
 * unlikely); a chain longer than that is hostile (or torn) and the lookup
 * is AP_SHM_EBAD, so the NIF asks the receptionist instead.
 */
#ifndef AP_SHM_H
#define AP_SHM_H

#include <stddef.h>
#include <stdint.h>

#define AP_SHM_MAGIC 0x31535450435241ULL /* "ARCPTS1" little-endian, plus a 0 byte */
/* A header being created: the stamps are there, nothing else is yet. */
#define AP_SHM_MAGIC_CREATING 0x43535450435241ULL /* "ARCPTSC" */
#define AP_SHM_DIR "/dev/shm" /* where POSIX shm names live (Linux, glibc) */
/* 2: `changes` in the header; 3: `hash_seed`, SipHash-1-3; 4:
 * `writer_start` and `writer_pidns`; 5: the writer holds flock(LOCK_SH) on
 * the object for its life (so a segment whose writer is gone can be told
 * from a live one, ap_shm_sweep). */
#define AP_SHM_VERSION 5u
#define AP_SHM_HDR_SIZE 4096u
#define AP_SHM_MAX_KEY 1024u          /* bytes */
#define AP_SHM_MAX_VAL (16u << 20)    /* bytes: a listing larger than this is not snapshotted */
#define AP_SHM_MAX_RETRIES 16
#define AP_SHM_MAX_PROBES 4096u       /* index slots a reader probes per lookup, at most */
#define AP_SHM_SEED_K1 0x9e3779b97f4a7c15ull /* SipHash key = (hash_seed, hash_seed ^ AP_SHM_SEED_K1) */
#define AP_SHM_MIN_CAP 1024u          /* index slots per half, at least */
#define AP_SHM_NO_CHANGES 0u          /* ap_shm_changes: no label (never a value of `changes`) */

/* Segment states (hdr.state). */
#define AP_SHM_STATE_LIVE 1u     /* the writer keeps it current */
#define AP_SHM_STATE_STALE 2u    /* the writer could not keep it current (full): ask the receptionist */
#define AP_SHM_STATE_CLOSED 3u   /* the writer exited cleanly */

/* Reader results. */
#define AP_SHM_OK 0
#define AP_SHM_ENOTFOUND 1 /* no such key (or a removed one): the listing is [] */
#define AP_SHM_EBUSY 2     /* gen kept changing for AP_SHM_MAX_RETRIES tries */
#define AP_SHM_EBAD 3      /* the segment fails a check: magic, version, a size, an offset */
#define AP_SHM_ESTALE 4    /* state is not LIVE: ask the receptionist */
#define AP_SHM_ETOOBIG 5   /* the value does not fit the caller's buffer; *vlen says how big */

struct ap_shm_hdr {
	uint64_t magic;
	uint32_t version;
	uint32_t hdr_size;     /* AP_SHM_HDR_SIZE */
	uint64_t seg_size;     /* whole segment, bytes */
	uint64_t half_size;    /* bytes per half; hdr_size + 2 * half_size <= seg_size */
	uint64_t gen;          /* atomic: active half = gen & 1 */
	uint64_t heartbeat_ms; /* atomic: writer's CLOCK_MONOTONIC ms, updated at least every second */
	uint64_t writer_pid;
	uint64_t incarnation;  /* the receptionist's creation */
	uint32_t state;        /* atomic: AP_SHM_STATE_* */
	uint32_t pad;
	uint64_t changes;      /* atomic: changes counted so far, >= 1 (see "Changes" above) */
	uint64_t hash_seed;    /* the hash's key, fixed for the segment's life (see "Hashing" above) */
	char node[256];        /* the receptionist node's name, NUL-terminated */
	uint64_t writer_start; /* for logs: /proc/PID/stat field 22 (clock ticks after boot); 0: unknown */
	uint64_t writer_pidns; /* for logs: the inode of the writer's /proc/self/ns/pid; 0: unknown */
};

struct ap_shm_half {
	uint64_t cap;        /* index slots, a power of two >= AP_SHM_MIN_CAP */
	uint64_t arena_off;  /* from the half's start; 8-aligned; after the index */
	uint64_t arena_size; /* bytes; arena_off + arena_size <= half_size */
	uint64_t used;       /* atomic: arena bytes in use (writer's bookkeeping, informational for readers) */
	uint64_t nkeys;      /* atomic: slots in use (informational) */
	uint64_t pad[3];
	/* then uint64_t slots[cap] */
};

struct ap_shm_entry {
	uint64_t hash;
	uint32_t key_len;
	uint32_t val_len;
	/* then key bytes, pad to 8, value bytes, pad to 8 */
};

/* SipHash-1-3 (1 compression round, 3 finalisation rounds; the message
 * read as little-endian 64-bit words, whatever the host's endianness) of
 * the key bytes, with the 128-bit key k0 = seed, k1 = seed ^
 * AP_SHM_SEED_K1. Part of the format: the writer and every reader must use
 * this very function with the segment's hash_seed. */
uint64_t ap_shm_hash(uint64_t seed, const void *key, size_t klen);

/* ---- writer (one thread) ------------------------------------------------ */

typedef struct ap_shm_writer ap_shm_writer;

/* Create the POSIX shm object `name` ("/..."), replacing an object of
 * that name whose writer is gone (see "Writers that are gone": taken under
 * LOCK_EX, unlinked only if the name still names it; a reader still
 * mapping it keeps it). An object whose writer still holds its lock (or a
 * layout-3 one whose pid runs here) is -EEXIST and nothing changes: the
 * caller may retry, bounded, until that writer has gone. Another user's
 * object, or anything but a regular file, under the name is -EPERM.
 * The new object is mode 0600 whatever the umask, sized seg_size (sparse),
 * locked LOCK_SH for the writer's life, mapped read-write.
 * The writer keeps the object's fd and backs pages with posix_fallocate,
 * a chunk at a time, before it first writes to them: it never stores to a
 * page the filesystem could not back (on a full tmpfs that would be
 * SIGBUS); a reservation that fails is -ENOSPC, as a full segment. Returns
 * 0 or a negative errno; -EINVAL unless name is "/" plus 1..254 bytes with
 * no other '/' and seg_size is 1 MiB..64 GiB; -ENOSPC when the header page
 * or half 0's index cannot be backed (nothing is left behind). */
int ap_shm_writer_create(ap_shm_writer **w, const char *name, size_t seg_size, const char *node,
			 uint64_t incarnation);
/* The same over caller memory (tests, fuzz seeds): mem must be 8-aligned,
 * zeroed, len bytes, and outlive the writer. len may be as small as
 * 28800 bytes (two halves of a minimal index and 4 KiB of arena); close
 * neither unmaps nor frees it. */
int ap_shm_writer_init_mem(ap_shm_writer **w, void *mem, size_t len, const char *node, uint64_t incarnation);

/* Set key's value (vlen 0 removes the key). Compacts into the other half
 * when the active one is full. Returns 0; -E2BIG for a key or value over
 * the limits (the segment is unchanged); -ENOSPC when even a compaction
 * cannot fit the live entries, or the filesystem cannot back the bytes the
 * put would write (either way the state becomes STALE: readers must ask
 * the receptionist until ap_shm_rebuild succeeds; gen is unchanged). While
 * STALE every put returns -ENOSPC and changes nothing: the segment already
 * misses an update, only a rebuild can bring it back. Removing a key that
 * has no value is a no-op. A put that changed anything is counted in
 * `changes` before it returns (see "Changes"). */
int ap_shm_put(ap_shm_writer *w, const void *key, size_t klen, const void *val, size_t vlen);

/* Replace the whole content: the callback yields the live keys and values
 * one at a time (return 1 with *key and *val set, 0 at the end); the new
 * content is built in the other half and published with one gen bump, and
 * the state becomes LIVE again if it fits. Empty values are skipped; a key
 * yielded twice keeps its last value. Returns 0 or -ENOSPC / -E2BIG (a key
 * or value over the limits) / the callback's negative return: then nothing
 * is published (gen unchanged) and the state becomes STALE, since the
 * content is not what the caller asked for. -ENOSPC covers bytes the
 * filesystem cannot back too (see ap_shm_writer_create). */
typedef int (*ap_shm_iter_fn)(void *arg, const void **key, size_t *klen, const void **val, size_t *vlen);
int ap_shm_rebuild(ap_shm_writer *w, ap_shm_iter_fn next, void *arg);

void ap_shm_heartbeat(ap_shm_writer *w, uint64_t now_ms);
uint32_t ap_shm_state(const ap_shm_writer *w);
/* Live keys, arena bytes in use in the active half (the reserved word at
 * offset 0 included), and compactions so far (rebuilds not counted). */
void ap_shm_writer_stats(const ap_shm_writer *w, uint64_t *keys, uint64_t *used, uint64_t *compactions);
/* Created segments: unlink the name if it still names this writer's object
 * (nobody else who follows the rule can have unlinked or replaced it while
 * the writer holds its lock, but a hand with rm can). Returns 0, -ESTALE
 * (the name names another object now: left alone), or -errno (-ENOENT: no
 * such name). Safe to call more than once; caller memory: -EINVAL. */
int ap_shm_writer_unlink(ap_shm_writer *w);
/* (Created segments, when unlink_it) ap_shm_writer_unlink first, so that
 * no reader or new writer ever finds our name on a CLOSED object; then
 * mark CLOSED, unmap, and close the fd, which drops the lock. */
void ap_shm_writer_close(ap_shm_writer *w, int unlink_it);

/* ---- reader (any thread, any process; nothing is trusted) -------------- */

/* Every reader call takes base as mapped (8-aligned; anything else is
 * AP_SHM_EBAD) and len, the mapping's length, and reads nothing outside
 * [base, base + len). */

/* Check the header of a mapping of len bytes: magic, version, hdr_size,
 * seg_size <= len, half sizes, a NUL in node, the active half's cap/arena
 * bounds. Returns AP_SHM_OK, AP_SHM_EBAD or AP_SHM_ESTALE, or AP_SHM_EBUSY
 * in the unlikely case that gen kept changing while it looked. */
int ap_shm_check(const void *base, size_t len);

/* The segment's `changes` (acquire), the label of its current content;
 * AP_SHM_NO_CHANGES when the cheap checks fail (base NULL or misaligned,
 * len under a header, magic, version, hdr_size) or the state is not LIVE:
 * a reader may answer from a cache only while the writer keeps the segment
 * current. Reads the header only (its first 80 bytes), checks no sizes. */
uint64_t ap_shm_changes(const void *base, size_t len);

/* Where key's current value is: *gen and *off (the entry's arena offset in
 * bytes, within half gen & 1) identify immutable bytes for as long as gen
 * stays the same; *vlen is the value's length. Returns AP_SHM_OK,
 * AP_SHM_ENOTFOUND (also for a removed key), AP_SHM_EBUSY, AP_SHM_EBAD
 * (also for a probe chain longer than AP_SHM_MAX_PROBES) or
 * AP_SHM_ESTALE. */
int ap_shm_find(const void *base, size_t len, const void *key, size_t klen, uint64_t *gen, uint64_t *off,
		uint32_t *vlen);

/* Copy the value of the entry found by ap_shm_find into out (cap bytes),
 * then confirm gen has not changed. Returns AP_SHM_OK, AP_SHM_ETOOBIG
 * (*vlen set, out untouched), AP_SHM_EBUSY (gen changed: find again) or
 * AP_SHM_EBAD. The state is not looked at again: find did. */
int ap_shm_read(const void *base, size_t len, uint64_t gen, uint64_t off, void *out, size_t cap, uint32_t *vlen);

/* Both in one: find, copy, retry on a gen change (bounded). Returns what
 * find does, or AP_SHM_ETOOBIG with *vlen set (out NULL counts as cap 0). */
int ap_shm_lookup(const void *base, size_t len, const void *key, size_t klen, void *out, size_t cap,
		  uint32_t *vlen);

/* ---- writers that are gone (see "Writers that are gone" above) -------- */

/* Field 22 (starttime, clock ticks after boot) and field 3 (state) of
 * /proc/PID/stat. Returns 0, -ENOENT when no such process (or thread) is
 * visible, -EINVAL when the line does not parse, or another -errno. */
int ap_proc_stat(long pid, uint64_t *start, char *state);

/* The inode of this process's PID namespace, 0 when /proc cannot tell. */
uint64_t ap_proc_pidns(void);

/* What the sweep (or a create, or ap_shm_remove) finds of a segment. */
enum ap_shm_fate {
	AP_SHM_FATE_LIVE,       /* a writer holds its lock: keep */
	AP_SHM_FATE_GONE,       /* nobody holds the lock (layouts 3, 4: nobody has the pid): remove */
	AP_SHM_FATE_UNKNOWN,    /* a layout-3 or -4 segment whose pid some process here has (`why`): keep */
	AP_SHM_FATE_UNREADABLE, /* not a snapshot we can judge (`why`): keep */
};

struct ap_shm_verdict {
	enum ap_shm_fate fate;
	const char *why;     /* UNKNOWN, UNREADABLE: a short reason (static text); GONE: how it died, or NULL */
	uint32_t version;    /* the header's, when its magic is ours */
	uint64_t pid;        /* writer_pid, as stamped (for logs) */
	uint64_t start;      /* writer_start, as stamped (for logs) */
};

/* Judge the header in buf (len bytes: what could be read from the
 * object's start; nothing is trusted, nothing past len is read), given
 * whether someone holds the object's lock (held: flock(LOCK_EX | LOCK_NB)
 * failed with EWOULDBLOCK; 0: the caller holds LOCK_EX). Held is LIVE.
 * Not held: GONE for our magic at this layout, for AP_SHM_MAGIC_CREATING,
 * and for an empty object or a zero magic (a writer killed while
 * creating); layouts 3 and 4 (writers that never locked): GONE only if
 * kill(pid, 0) finds no process, else UNKNOWN; anything else UNREADABLE. Returns v->fate. */
enum ap_shm_fate ap_shm_judge(const void *buf, size_t len, int held, struct ap_shm_verdict *v);

/* Unlink the segment `name` (in dir, no '/') if its writer is gone, by the
 * rule above. Returns 0 (removed), -ENOENT (no such name), -EBUSY (a
 * writer holds it, or a layout-3/4 writer's pid runs), -EPERM (another
 * user's, or not a regular file), -EPROTO (ours, but not a snapshot: left
 * alone), -ESTALE (the name was replaced meanwhile), -EINVAL (a bad name)
 * or another -errno. v (may be NULL) gets the verdict. Never blocks on
 * the object (a FIFO planted under the name included). */
int ap_shm_remove(const char *dir, const char *name, struct ap_shm_verdict *v);

/* One segment the sweep looked at. */
struct ap_shm_swept {
	const char *name;        /* its name in the directory (no leading '/') */
	struct ap_shm_verdict v;
	int removed;             /* 1: unlinked by this sweep */
	int err;                 /* GONE not removed: why (errno; ESTALE: the name now names another
				  * object); UNREADABLE: the open/read/lock error, if any */
};
typedef void (*ap_shm_sweep_fn)(void *arg, const struct ap_shm_swept *s);

/* What a sweep did, in sum (for one log line). */
struct ap_shm_sweep_sum {
	unsigned judged;  /* our regular files looked at (at most AP_SHM_SWEEP_MAX) */
	unsigned removed;
	unsigned live;
	unsigned v3_kept; /* layout-3/4 segments whose pid runs here */
	unsigned foreign; /* entries passed over: another user's, or not regular files */
	int capped;       /* stopped at AP_SHM_SWEEP_MAX of our own files */
};

#define AP_SHM_SWEEP_MAX 4096 /* our own segments a sweep looks at, at most */

/* Look at every entry in dir (the shm directory, AP_SHM_DIR) whose name
 * starts with prefix and is not skip (NULL: none). fstatat
 * (AT_SYMLINK_NOFOLLOW) first: another user's entries and anything but
 * regular files are passed over, only counted in sum->foreign (they cost
 * no open, no callback and no place under the cap). Each of our regular
 * files, AP_SHM_SWEEP_MAX at most: open it (O_NOFOLLOW | O_NONBLOCK, the
 * same inode as stat'ed), take LOCK_EX | LOCK_NB, read its header (at
 * most sizeof(struct ap_shm_hdr) bytes, never mapped), judge it, and when
 * GONE unlink it, still under the lock, if the name still names it. fn
 * (may be NULL) hears about each judged file; sum (may be NULL) gets the
 * totals. Returns the number removed, or -errno when dir cannot be
 * opened. */
int ap_shm_sweep(const char *dir, const char *prefix, const char *skip, ap_shm_sweep_fn fn, void *arg,
		 struct ap_shm_sweep_sum *sum);

#endif
