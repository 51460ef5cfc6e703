/* ap_shm: the receptionist's shared-memory snapshot: one writer, lock-free
 * readers that trust nothing (see ap_shm.h for the layout).
 *
 * Publication protocol, writer side. Readers of gen g read half g & 1, and
 * that half only ever changes in two ways:
 *
 *  - while it is active: an entry is appended past `used` (bytes no slot
 *    points at yet), then its slot is stored with a release store. A reader
 *    that loads the slot (acquire) sees the whole entry; entries a slot
 *    points at never change while their half is active.
 *
 *  - while it is inactive (gen & 1 is the other half): a compaction or a
 *    rebuild rewrites it wholesale, then bumps gen with a release store.
 *    The only readers still in it are ones that loaded an older gen of the
 *    same parity; gen has moved past their g1 before the rewrite starts,
 *    and a release fence sits between that gen store and the first store
 *    of the rewrite. So if such a reader sees any byte of the rewrite, the
 *    fence synchronises with the reader's acquire fence and its second gen
 *    load sees the newer gen: it retries. Readers that see none of the
 *    rewrite read what was there before, which their gen names.
 *
 * Counting. Every change ends with w_count, a release store of
 * `changes` after the change's own release stores (slot, gen, state), so
 * a reader that loads the new count (acquire) sees the whole change. The
 * writer keeps its own copy and never reads the segment's.
 *
 * Data goes in with plain stores (memcpy, memset): the compiler cannot sink
 * them below the release store of a slot or of gen, nor hoist them above
 * the release fence, which is all the protocol needs. Readers copy bytes
 * with plain loads too. Where a reader overlaps a rewrite that is formally
 * a data race, as in every seqlock written in C; the reader discards what
 * it read (gen changed), and it validated every offset and length it used
 * from locals read once, so torn bytes can cost it a retry, never a fault.
 * Slots and the few header/half words are read with atomic loads so that
 * the compiler cannot re-read them after they were checked.
 *
 * Backing. A created segment is sparse (ftruncate only), and on tmpfs a
 * store to a page the filesystem cannot back (it is full: Docker's
 * /dev/shm is 64 MiB by default) raises SIGBUS. So the writer never
 * stores to a byte it has not reserved with posix_fallocate: it keeps the
 * fd, the header page is reserved at create, and each half has a
 * watermark (`committed`, bytes from the half's start) below which it is
 * backed. Every write that goes past it (laying out a half, an append, a
 * compaction's or rebuild's copies) first reserves up to the next
 * RESERVE_CHUNK (capped at the half's end). A reservation that fails
 * writes nothing and fails the operation as -ENOSPC, with the usual
 * consequences (STALE, counted; a later rebuild tries again). Reserved
 * pages stay reserved (tmpfs never takes them back while the object
 * lives), so the watermarks only grow. Writers over caller memory have
 * no fd and reserve nothing.
 */
#include "ap_shm.h"
#include "ap_siphash.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/file.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

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

uint64_t ap_shm_hash(uint64_t seed, const void *key, size_t klen)
{
	return ap_siphash13(seed, seed ^ AP_SHM_SEED_K1, key, klen);
}

/* A fresh segment's seed: getrandom(2) (never blocking: this runs at the
 * receptionist's start), else the time, the pid and an address (ASLR)
 * through splitmix64's finaliser. Unpredictable enough either way for a
 * hash-flooding defence; it need not be secret from the segment's readers. */
static uint64_t w_new_seed(void)
{
	uint64_t seed = 0;
	struct timespec ts = { 0 };

	if (getrandom(&seed, sizeof seed, GRND_NONBLOCK) == (ssize_t)sizeof seed)
		return seed;
	clock_gettime(CLOCK_REALTIME, &ts);
	seed = ((uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec) ^ ((uint64_t)getpid() << 32) ^
	       (uint64_t)(uintptr_t)&seed;
	seed ^= seed >> 30;
	seed *= 0xbf58476d1ce4e5b9ull;
	seed ^= seed >> 27;
	seed *= 0x94d049bb133111ebull;
	seed ^= seed >> 31;
	return seed;
}

/* ---- writer ------------------------------------------------------------- */

/* A half as the writer laid it out: the writer never re-reads layout from
 * the segment, so a stray write there cannot mislead it. */
struct whalf {
	uint8_t *p;
	uint64_t *slots;
	uint8_t *arena;
	uint64_t cap, arena_size;
	uint64_t used;   /* arena bytes in use, the reserved word at 0 included */
	uint64_t nslots; /* slots in use, tombstones included */
};

struct ap_shm_writer {
	uint8_t *base;
	size_t len;
	struct ap_shm_hdr *hdr;
	int created; /* we mapped it: munmap (and maybe unlink) on close */
	int fd;      /* created: the shm object, for posix_fallocate, locked LOCK_SH; else -1 */
	int dfd;     /* created: AP_SHM_DIR, where the name lives; else -1 */
	uint64_t committed[2]; /* per half: bytes from its start known backed (see "Backing") */
	char name[NAME_MAX + 2]; /* as created, with its leading '/' */
	int unlinked;
	uint64_t half_size;
	uint64_t gen;
	uint64_t changes; /* the segment's `changes`, as last stored */
	uint64_t seed;    /* the segment's hash_seed: never re-read from the segment */
	uint32_t state;
	struct whalf act;          /* the active half, gen & 1 */
	uint64_t live, live_bytes; /* keys with a value, and their entries' bytes */
	uint64_t compactions;
};

static uint8_t *w_half_at(const ap_shm_writer *w, uint64_t h)
{
	return w->base + AP_SHM_HDR_SIZE + (h & 1) * w->half_size;
}

/* Make bytes [0, end) of half h backed before anything is stored there
 * (see "Backing" at the top). 0, or -ENOSPC (whatever posix_fallocate
 * said) with nothing reserved beyond the old watermark. */
static int w_reserve(ap_shm_writer *w, uint64_t h, uint64_t end)
{
	uint64_t *c = &w->committed[h & 1], to;

	if (w->fd < 0 || end <= *c)
		return 0;
	if (end > w->half_size)
		return -ENOSPC; /* a caller bug: never past the half */
	to = (end + RESERVE_CHUNK - 1) & ~(RESERVE_CHUNK - 1);
	if (to > w->half_size)
		to = w->half_size;
	/* An error number, not -1/errno. On tmpfs a failed call keeps none
	 * of the pages it allocated. */
	if (posix_fallocate(w->fd, (off_t)(AP_SHM_HDR_SIZE + (h & 1) * w->half_size + *c), (off_t)(to - *c)))
		return -ENOSPC;
	*c = to;
	return 0;
}

/* Which half x is. */
static uint64_t w_half_no(const ap_shm_writer *w, const struct whalf *x) { return x->p == w_half_at(w, 1); }

/* Make x's arena backed up to arena offset end. */
static int w_reserve_arena(ap_shm_writer *w, const struct whalf *x, uint64_t end)
{
	return w_reserve(w, w_half_no(w, x), (uint64_t)(x->arena - x->p) + end);
}

/* Lay out half h: header, cap empty slots, an arena holding only the
 * reserved word. Counters are published with the half (w_publish).
 * -ENOSPC when that cannot be backed: then nothing is written. */
static int w_half_layout(ap_shm_writer *w, uint64_t h, uint64_t cap, struct whalf *x)
{
	uint64_t aoff = HALF_HDR + cap * 8;
	struct ap_shm_half *hh;

	if (w_reserve(w, h, aoff + 8) < 0)
		return -ENOSPC;
	x->p = w_half_at(w, h);
	x->slots = (uint64_t *)(x->p + HALF_HDR);
	x->arena = x->p + aoff;
	x->cap = cap;
	x->arena_size = w->half_size - aoff;
	x->used = 8;
	x->nslots = 0;
	hh = (struct ap_shm_half *)x->p;
	hh->cap = cap;
	hh->arena_off = aoff;
	hh->arena_size = x->arena_size;
	memset(hh->pad, 0, sizeof hh->pad);
	memset(x->slots, 0, cap * 8);
	memset(x->arena, 0, 8);
	return 0;
}

static void w_half_counters(const struct whalf *x)
{
	struct ap_shm_half *hh = (struct ap_shm_half *)x->p;
	__atomic_store_n(&hh->used, x->used, __ATOMIC_RELAXED);
	__atomic_store_n(&hh->nkeys, x->nslots, __ATOMIC_RELAXED);
}

/* Append an entry at the arena's end (the caller checked it fits and
 * reserved it: w_reserve_arena); returns its offset. Padding is written too: a reused half holds old bytes. */
static uint64_t w_append(struct whalf *x, uint64_t hash, const void *key, size_t klen, const void *val,
			 size_t vlen)
{
	uint64_t off = x->used;
	uint8_t *e = x->arena + off;
	struct ap_shm_entry eh = { .hash = hash, .key_len = (uint32_t)klen, .val_len = (uint32_t)vlen };
	uint8_t *k = e + ENT_HDR, *v = k + pad8(klen);

	memcpy(e, &eh, sizeof eh);
	if (klen)
		memcpy(k, key, klen);
	memset(k + klen, 0, pad8(klen) - klen);
	if (vlen)
		memcpy(v, val, vlen);
	memset(v + vlen, 0, pad8(vlen) - vlen);
	x->used += ent_size(klen, vlen);
	return off;
}

/* key's slot in x, or the empty slot that ends its probe (*ep NULL). The
 * writer keeps the load at most 1/2, so an empty slot always comes. */
static uint64_t w_probe(const struct whalf *x, uint64_t hash, const void *key, size_t klen,
			const struct ap_shm_entry **ep)
{
	uint64_t mask = x->cap - 1, i = hash & mask;

	for (;; i = (i + 1) & mask) {
		uint64_t s = x->slots[i];
		const struct ap_shm_entry *e;

		if (!(s & SLOT_OFF_MASK)) {
			*ep = NULL;
			return i;
		}
		if (s >> 32 != hash >> 32)
			continue;
		e = (const struct ap_shm_entry *)(x->arena + ((s & SLOT_OFF_MASK) << 3));
		if (e->hash == hash && e->key_len == klen && (!klen || !memcmp(e + 1, key, klen))) {
			*ep = e;
			return i;
		}
	}
}

/* An index size for n live keys of `bytes` entry bytes: a power of two >=
 * max(MIN_CAP, 4n) when the arena still holds twice the bytes (the next
 * compaction is then ~n puts away: amortised O(1)), else the smallest that
 * keeps the load at 1/2 if the bytes fit at all. */
static int w_plan(uint64_t half_size, uint64_t n, uint64_t bytes, uint64_t *capp)
{
	uint64_t lo = pow2_at_least(n * 2 > AP_SHM_MIN_CAP ? n * 2 : AP_SHM_MIN_CAP);
	uint64_t hi = pow2_at_least(n * 4 > AP_SHM_MIN_CAP ? n * 4 : AP_SHM_MIN_CAP);
	uint64_t maxcap = (half_size - HALF_HDR) / 8;

	for (uint64_t c = hi; c >= lo; c >>= 1)
		if (c <= maxcap && half_size - HALF_HDR - c * 8 >= 8 + 2 * bytes) {
			*capp = c;
			return 0;
		}
	if (lo <= maxcap && half_size - HALF_HDR - lo * 8 >= 8 + bytes) {
		*capp = lo;
		return 0;
	}
	return -ENOSPC;
}

/* Start rewriting the inactive half. See the protocol note at the top: the
 * fence orders the last gen store before every store of the rewrite, for
 * readers still in this half under an older gen. */
static int w_begin(ap_shm_writer *w, uint64_t cap, struct whalf *x)
{
	__atomic_thread_fence(__ATOMIC_RELEASE);
	return w_half_layout(w, w->gen + 1, cap, x);
}

/* Switch readers to x: everything written before is visible to whoever
 * loads the new gen (acquire). */
static void w_publish(ap_shm_writer *w, const struct whalf *x)
{
	w_half_counters(x);
	w->gen++;
	__atomic_store_n(&w->hdr->gen, w->gen, __ATOMIC_RELEASE);
	w->act = *x;
}

/* Count a change, once it is published: see "Changes" in ap_shm.h. */
static void w_count(ap_shm_writer *w)
{
	__atomic_store_n(&w->hdr->changes, ++w->changes, __ATOMIC_RELEASE);
}

/* A state store is a change too: readers that cache by `changes` must not
 * keep answering across STALE (the content misses an update) or CLOSED. */
static void w_set_state(ap_shm_writer *w, uint32_t st)
{
	w->state = st;
	__atomic_store_n(&w->hdr->state, st, __ATOMIC_RELEASE);
	w_count(w);
}

/* A key known not to be in x (compaction copies distinct keys). */
static void w_insert_new(struct whalf *x, uint64_t hash, uint64_t off)
{
	uint64_t mask = x->cap - 1, i = hash & mask;

	while (x->slots[i] & SLOT_OFF_MASK)
		i = (i + 1) & mask;
	x->slots[i] = slot_make(hash, off);
	x->nslots++;
}

/* Rebuild the live entries of the active half into the other one, minus
 * the slot `skip` (the put's key) plus the pending put, and publish. */
static int w_compact(ap_shm_writer *w, uint64_t hash, const void *key, size_t klen, const void *val, size_t vlen,
		     uint64_t skip, uint64_t live, uint64_t live_bytes)
{
	struct whalf nx;
	uint64_t cap;

	/* Nothing published on failure (a reservation that fails may leave
	 * the inactive half part rewritten, which gen does not name): the
	 * active half stays as it was. */
	if (w_plan(w->half_size, live, live_bytes, &cap) < 0 || w_begin(w, cap, &nx) < 0)
		goto full;
	for (uint64_t i = 0; i < w->act.cap; i++) {
		uint64_t s = w->act.slots[i], sz, off;
		const struct ap_shm_entry *e;

		if (!(s & SLOT_OFF_MASK) || i == skip)
			continue;
		e = (const struct ap_shm_entry *)(w->act.arena + ((s & SLOT_OFF_MASK) << 3));
		if (!e->val_len)
			continue; /* a tombstone: dropped here */
		sz = ent_size(e->key_len, e->val_len);
		off = nx.used;
		if (w_reserve_arena(w, &nx, off + sz) < 0)
			goto full;
		memcpy(nx.arena + off, e, sz);
		nx.used += sz;
		w_insert_new(&nx, e->hash, off);
	}
	if (vlen) {
		if (w_reserve_arena(w, &nx, nx.used + ent_size(klen, vlen)) < 0)
			goto full;
		w_insert_new(&nx, hash, w_append(&nx, hash, key, klen, val, vlen));
	}
	w->live = live;
	w->live_bytes = live_bytes;
	w->compactions++;
	w_publish(w, &nx);
	return 0;
full:
	w_set_state(w, AP_SHM_STATE_STALE);
	return -ENOSPC;
}

int ap_shm_put(ap_shm_writer *w, const void *key, size_t klen, const void *val, size_t vlen)
{
	const struct ap_shm_entry *old;
	uint64_t hash, i, esz, old_bytes, live, live_bytes;

	if (klen > AP_SHM_MAX_KEY || vlen > AP_SHM_MAX_VAL)
		return -E2BIG;
	/* STALE: the segment already misses puts; only a rebuild helps. */
	if (w->state != AP_SHM_STATE_LIVE)
		return -ENOSPC;
	hash = ap_shm_hash(w->seed, key, klen);
	i = w_probe(&w->act, hash, key, klen, &old);
	old_bytes = old && old->val_len ? ent_size(old->key_len, old->val_len) : 0;
	if (!old_bytes && !vlen)
		return 0; /* removing what is not there */
	esz = ent_size(klen, vlen);
	live = w->live + (vlen ? 1 : 0) - (old_bytes ? 1 : 0);
	live_bytes = w->live_bytes + (vlen ? esz : 0) - old_bytes;
	if (esz > w->act.arena_size - w->act.used || (!old && w->act.nslots + 1 > w->act.cap / 2)) {
		/* A failed compaction counted its STALE already. */
		int r = w_compact(w, hash, key, klen, val, vlen, old ? i : UINT64_MAX, live, live_bytes);

		if (!r)
			w_count(w);
		return r;
	}

	if (w_reserve_arena(w, &w->act, w->act.used + esz) < 0) {
		/* Nothing written: as a failed compaction. */
		w_set_state(w, AP_SHM_STATE_STALE);
		return -ENOSPC;
	}
	uint64_t off = w_append(&w->act, hash, key, klen, val, vlen);
	__atomic_store_n(&w->act.slots[i], slot_make(hash, off), __ATOMIC_RELEASE);
	if (!old)
		w->act.nslots++;
	w_half_counters(&w->act);
	w->live = live;
	w->live_bytes = live_bytes;
	/* Before we return: the caller replies "registered" only after. */
	w_count(w);
	return 0;
}

/* The iterator's count is unknown until it ends, and the index size
 * depends on it: entries go first right after a minimal index, and once
 * the count is known the arena moves up past the real index (entry offsets
 * are arena-relative, so a move keeps them). */
int ap_shm_rebuild(ap_shm_writer *w, ap_shm_iter_fn next, void *arg)
{
	uint64_t tmp_off = HALF_HDR + AP_SHM_MIN_CAP * 8ull, room = w->half_size - tmp_off;
	struct whalf t = { 0 }, nx;
	uint64_t n = 0, cap, live = 0, live_bytes = 0;
	int err = 0;

	__atomic_thread_fence(__ATOMIC_RELEASE); /* as in w_begin */
	t.p = w_half_at(w, w->gen + 1);
	t.arena = t.p + tmp_off;
	t.used = 8;
	for (;;) {
		const void *k = NULL, *v = NULL;
		size_t kl = 0, vl = 0;
		int r = next(arg, &k, &kl, &v, &vl);

		if (r <= 0) {
			err = r;
			break;
		}
		if (kl > AP_SHM_MAX_KEY || vl > AP_SHM_MAX_VAL) {
			err = -E2BIG;
			break;
		}
		if (!vl)
			continue;
		if (ent_size(kl, vl) > room - t.used || w_reserve_arena(w, &t, t.used + ent_size(kl, vl)) < 0) {
			err = -ENOSPC;
			break;
		}
		w_append(&t, ap_shm_hash(w->seed, k, kl), k, kl, v, vl);
		n++;
	}
	if (!err && w_plan(w->half_size, n, t.used - 8, &cap) < 0)
		err = -ENOSPC;
	/* The moved arena's end: the layout's part comes before it. */
	if (!err && w_reserve(w, w->gen + 1, HALF_HDR + cap * 8 + t.used) < 0)
		err = -ENOSPC;
	if (err) {
		/* The content is not what the caller asked for: readers must
		 * ask the receptionist. gen is unchanged. */
		w_set_state(w, AP_SHM_STATE_STALE);
		return err;
	}
	/* The move first: the new index overlaps where the entries were. */
	memmove(w_half_at(w, w->gen + 1) + HALF_HDR + cap * 8, t.arena, t.used);
	(void)w_half_layout(w, w->gen + 1, cap, &nx); /* reserved just above */
	for (uint64_t off = 8; off < t.used;) {
		const struct ap_shm_entry *e = (const struct ap_shm_entry *)(nx.arena + off), *old;
		uint64_t sz = ent_size(e->key_len, e->val_len);
		uint64_t i = w_probe(&nx, e->hash, e + 1, e->key_len, &old);

		/* A key the iterator yielded twice: the later value wins. */
		if (old) {
			live_bytes -= ent_size(old->key_len, old->val_len);
		} else {
			nx.nslots++;
			live++;
		}
		nx.slots[i] = slot_make(e->hash, off);
		live_bytes += sz;
		off += sz;
	}
	nx.used = t.used;
	w->live = live;
	w->live_bytes = live_bytes;
	w_publish(w, &nx);
	/* After the gen bump: a reader that sees LIVE (acquire) sees the new
	 * gen, never the content from before the failure. Counts the rebuild
	 * too (after both). */
	w_set_state(w, AP_SHM_STATE_LIVE);
	return 0;
}

/* Who writes, for the logs only (see "Writers that are gone"). */
static void w_stamp(struct ap_shm_hdr *hdr)
{
	hdr->writer_pid = (uint64_t)getpid();
	if (ap_proc_stat((long)getpid(), &hdr->writer_start, NULL) < 0)
		hdr->writer_start = 0;
	hdr->writer_pidns = ap_proc_pidns();
}

/* fd: the created object (its header page already reserved), or -1. */
static int w_start(ap_shm_writer **wp, uint8_t *base, size_t len, int fd, const char *node, uint64_t incarnation)
{
	ap_shm_writer *w = calloc(1, sizeof *w);
	struct ap_shm_hdr *hdr = (struct ap_shm_hdr *)base;

	if (!w)
		return -ENOMEM;
	w->fd = fd;
	w->dfd = -1;
	w->base = base;
	w->len = len;
	w->hdr = hdr;
	w->half_size = ((len - AP_SHM_HDR_SIZE) / 2) & ~7ull;
	w->state = AP_SHM_STATE_LIVE;
	w->changes = 1; /* never AP_SHM_NO_CHANGES */
	w->seed = w_new_seed();
	/* Half 0 first, before any header store: a create that cannot back
	 * it fails with the header untouched. */
	if (w_half_layout(w, 0, AP_SHM_MIN_CAP, &w->act) < 0) {
		free(w);
		return -ENOSPC;
	}

	hdr->version = AP_SHM_VERSION;
	hdr->hdr_size = AP_SHM_HDR_SIZE;
	hdr->seg_size = len;
	hdr->half_size = w->half_size;
	hdr->gen = 0;
	hdr->heartbeat_ms = 0;
	w_stamp(hdr);
	hdr->incarnation = incarnation;
	hdr->pad = 0;
	hdr->changes = w->changes;
	hdr->hash_seed = w->seed;
	memset(hdr->node, 0, sizeof hdr->node);
	if (node)
		strncpy(hdr->node, node, sizeof hdr->node - 1);
	w_half_counters(&w->act);
	hdr->state = AP_SHM_STATE_LIVE;
	/* The magic last: a reader that sees it sees everything above. */
	__atomic_store_n(&hdr->magic, AP_SHM_MAGIC, __ATOMIC_RELEASE);
	*wp = w;
	return 0;
}

static enum ap_shm_fate judge_at(int dfd, const char *name, int fd, const struct stat *st, int remove,
				 struct ap_shm_swept *s);
#define REMOVE_GONE 1
#define REMOVE_UNREADABLE 2 /* also what is no snapshot (under our LOCK_EX) */

/* Our regular file: the only kind anybody here judges or unlinks. */
static int ours(const struct stat *st) { return S_ISREG(st->st_mode) && st->st_uid == geteuid(); }

/* The name base (in dfd) is taken by an object: remove it if its writer is
 * gone. -EAGAIN: the name is free now (try again); -EEXIST: a writer holds it;
 * -EPERM: another user's, or not a regular file (never ours to take). */
static int w_take_over(int dfd, const char *base)
{
	struct ap_shm_swept s = { .name = base };
	struct stat st;
	int fd;

	fd = openat(dfd, base, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_NOCTTY | O_CLOEXEC);
	if (fd < 0)
		return errno == ENOENT ? -EAGAIN : errno == ELOOP || errno == ENXIO ? -EPERM : -errno;
	if (fstat(fd, &st) < 0 || !ours(&st)) {
		close(fd);
		return -EPERM;
	}
	/* A file of ours under our name that is no snapshot is replaced,
	 * as it always was: only a writer that may still run keeps it. */
	judge_at(dfd, base, fd, &st, REMOVE_UNREADABLE, &s);
	close(fd);
	if (s.removed || s.err == ENOENT || s.err == ESTALE)
		return -EAGAIN;
	return -EEXIST;
}

/* Our new object, locked: write AP_SHM_MAGIC_CREATING and the stamps at
 * once (so a writer killed from here on leaves an object the sweep can
 * tell), after backing the header page. */
static int w_mark_creating(int fd)
{
	struct ap_shm_hdr h;

	if (posix_fallocate(fd, 0, AP_SHM_HDR_SIZE))
		return -ENOSPC;
	memset(&h, 0, sizeof h);
	h.magic = AP_SHM_MAGIC_CREATING;
	h.version = AP_SHM_VERSION;
	h.hdr_size = AP_SHM_HDR_SIZE;
	w_stamp(&h);
	return pwrite(fd, &h, sizeof h, 0) == (ssize_t)sizeof h ? 0 : -EIO;
}

/* Create base in dfd, locked LOCK_SH, and make sure the name still names
 * it once the lock is ours (a sweeper may have found it empty and
 * unlocked in between, and removed it). Returns the fd, -EAGAIN to try
 * again, or another -errno. */
static int w_create_locked(int dfd, const char *base)
{
	struct stat st, again;
	int fd = openat(dfd, base, O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);

	if (fd < 0)
		return errno == EEXIST ? w_take_over(dfd, base) : -errno;
	/* Blocking: only a sweeper, for the moment it reads a header, can
	 * hold LOCK_EX on an object this fresh. */
	while (flock(fd, LOCK_SH) < 0) {
		if (errno != EINTR) {
			int e = -errno;
			close(fd);
			return e;
		}
	}
	if (fstat(fd, &st) < 0 || fstatat(dfd, base, &again, AT_SYMLINK_NOFOLLOW) < 0 ||
	    again.st_ino != st.st_ino || again.st_dev != st.st_dev) {
		close(fd);
		return -EAGAIN;
	}
	return fd;
}

int ap_shm_writer_create(ap_shm_writer **wp, const char *name, size_t seg_size, const char *node,
			 uint64_t incarnation)
{
	size_t nlen = name ? strnlen(name, NAME_MAX + 1) : 0;
	void *p = MAP_FAILED;
	int dfd, fd = -EAGAIN, err = 0;

	*wp = NULL;
	if (nlen < 2 || nlen > NAME_MAX || name[0] != '/' || strchr(name + 1, '/'))
		return -EINVAL;
	if (seg_size < SEG_MIN_CREATE || seg_size > SEG_MAX)
		return -EINVAL;
	dfd = open(AP_SHM_DIR, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
	if (dfd < 0)
		return -errno;
	/* Bounded: each turn either creates, or finds the name free again
	 * after removing a dead writer's object, or gives up. */
	for (int tries = 0; tries < 8 && fd == -EAGAIN; tries++)
		fd = w_create_locked(dfd, name + 1);
	if (fd < 0) {
		close(dfd);
		return fd == -EAGAIN ? -EEXIST : fd;
	}
	/* 0600 whatever the umask: a umask of 0700 would lock us out too. */
	if (fchmod(fd, 0600) < 0 || ftruncate(fd, (off_t)seg_size) < 0)
		err = -errno;
	/* The header page is backed before it is written (see "Backing"). */
	else if ((err = w_mark_creating(fd)) < 0)
		;
	else if ((p = mmap(NULL, seg_size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)) == MAP_FAILED)
		err = -errno;
	/* The fd stays open: later reservations need it, and it holds the lock. */
	if (!err)
		err = w_start(wp, p, seg_size, fd, node, incarnation);
	if (err) {
		struct stat st, again;
		if (p != MAP_FAILED)
			munmap(p, seg_size);
		/* Still under our lock: the name is ours unless a hand with rm
		 * replaced it. */
		if (fstat(fd, &st) == 0 && fstatat(dfd, name + 1, &again, AT_SYMLINK_NOFOLLOW) == 0 &&
		    again.st_ino == st.st_ino && again.st_dev == st.st_dev)
			unlinkat(dfd, name + 1, 0);
		close(fd);
		close(dfd);
		return err;
	}
	(*wp)->created = 1;
	(*wp)->dfd = dfd;
	memcpy((*wp)->name, name, nlen + 1);
	return 0;
}

int ap_shm_writer_init_mem(ap_shm_writer **wp, void *mem, size_t len, const char *node, uint64_t incarnation)
{
	*wp = NULL;
	if (!mem || ((uintptr_t)mem & 7) || len < SEG_MIN_MEM || len > SEG_MAX)
		return -EINVAL;
	return w_start(wp, mem, len, -1, node, incarnation);
}

void ap_shm_heartbeat(ap_shm_writer *w, uint64_t now_ms)
{
	__atomic_store_n(&w->hdr->heartbeat_ms, now_ms, __ATOMIC_RELAXED);
}

uint32_t ap_shm_state(const ap_shm_writer *w) { return w->state; }

void ap_shm_writer_stats(const ap_shm_writer *w, uint64_t *keys, uint64_t *used, uint64_t *compactions)
{
	if (keys)
		*keys = w->live;
	if (used)
		*used = w->act.used;
	if (compactions)
		*compactions = w->compactions;
}

int ap_shm_writer_unlink(ap_shm_writer *w)
{
	struct stat st, again;

	if (!w->created)
		return -EINVAL;
	if (w->unlinked)
		return -ENOENT;
	/* We hold LOCK_SH: no party that follows the rule unlinks or
	 * replaces our name meanwhile, so this check is not a race. */
	if (fstat(w->fd, &st) < 0 || fstatat(w->dfd, w->name + 1, &again, AT_SYMLINK_NOFOLLOW) < 0)
		return -errno;
	if (again.st_ino != st.st_ino || again.st_dev != st.st_dev)
		return -ESTALE;
	if (unlinkat(w->dfd, w->name + 1, 0) < 0)
		return -errno;
	w->unlinked = 1;
	return 0;
}

void ap_shm_writer_close(ap_shm_writer *w, int unlink_it)
{
	if (!w)
		return;
	/* Unlink before CLOSED: nobody finds our name on a closed object. */
	if (w->created && unlink_it)
		ap_shm_writer_unlink(w);
	w_set_state(w, AP_SHM_STATE_CLOSED);
	if (w->created) {
		munmap(w->base, w->len);
		close(w->fd); /* drops the lock */
		close(w->dfd);
	}
	free(w);
}

/* ---- reader ------------------------------------------------------------- */

/* Every value below is read once into a local and checked before use: the
 * segment may change (or be hostile) between two reads of the same word. */

static inline uint64_t ld64(const uint64_t *p) { return __atomic_load_n(p, __ATOMIC_RELAXED); }

static inline uint32_t ld32(const uint32_t *p) { return __atomic_load_n(p, __ATOMIC_RELAXED); }

/* The header's fixed fields, checked. */
struct rseg {
	const uint8_t *base;
	const struct ap_shm_hdr *hdr;
	uint64_t half_size;
	uint64_t seed; /* hash_seed: a number like any other, read once */
};

/* A half's layout, checked against the half. */
struct rhalf {
	const uint64_t *slots;
	const uint8_t *arena;
	uint64_t cap, arena_size;
};

/* An entry, checked to lie whole inside its arena. */
struct rent {
	uint64_t hash;
	uint32_t klen, vlen;
	const uint8_t *key, *val;
};

static int r_hdr(const void *base, size_t len, struct rseg *s)
{
	const struct ap_shm_hdr *h = base;
	uint64_t seg, half;

	/* Atomic loads need natural alignment; a mapping is page-aligned. */
	if (!base || ((uintptr_t)base & 7) || len < sizeof *h)
		return AP_SHM_EBAD;
	if (__atomic_load_n(&h->magic, __ATOMIC_ACQUIRE) != AP_SHM_MAGIC)
		return AP_SHM_EBAD;
	if (ld32(&h->version) != AP_SHM_VERSION || ld32(&h->hdr_size) != AP_SHM_HDR_SIZE)
		return AP_SHM_EBAD;
	seg = ld64(&h->seg_size);
	half = ld64(&h->half_size);
	if (seg > (uint64_t)len || seg < AP_SHM_HDR_SIZE)
		return AP_SHM_EBAD;
	if ((half & 7) || half < HALF_MIN || half > (seg - AP_SHM_HDR_SIZE) / 2)
		return AP_SHM_EBAD;
	s->base = base;
	s->hdr = h;
	s->half_size = half;
	/* Fixed for the segment's life and stored before the magic; any
	 * value is safe (a wrong one only makes lookups miss). */
	s->seed = ld64(&h->hash_seed);
	return AP_SHM_OK;
}

static int r_live(const struct rseg *s)
{
	return __atomic_load_n(&s->hdr->state, __ATOMIC_ACQUIRE) == AP_SHM_STATE_LIVE ? AP_SHM_OK : AP_SHM_ESTALE;
}

static int r_half(const struct rseg *s, uint64_t gen, struct rhalf *x)
{
	const uint8_t *p = s->base + AP_SHM_HDR_SIZE + (gen & 1) * s->half_size;
	const struct ap_shm_half *hh = (const struct ap_shm_half *)p;
	uint64_t cap = ld64(&hh->cap), aoff = ld64(&hh->arena_off), asz = ld64(&hh->arena_size);

	if (cap < AP_SHM_MIN_CAP || (cap & (cap - 1)) || cap > (s->half_size - HALF_HDR) / 8)
		return AP_SHM_EBAD;
	if ((aoff & 7) || aoff < HALF_HDR + cap * 8 || aoff > s->half_size)
		return AP_SHM_EBAD;
	if ((asz & 7) || asz > s->half_size - aoff)
		return AP_SHM_EBAD;
	x->slots = (const uint64_t *)(p + HALF_HDR);
	x->arena = p + aoff;
	x->cap = cap;
	x->arena_size = asz;
	return AP_SHM_OK;
}

static int r_ent(const struct rhalf *x, uint64_t off, struct rent *e)
{
	const struct ap_shm_entry *eh;
	uint64_t rest, kp, vp;

	if (!off || (off & 7) || x->arena_size < ENT_HDR || off > x->arena_size - ENT_HDR)
		return AP_SHM_EBAD;
	eh = (const struct ap_shm_entry *)(x->arena + off);
	e->hash = ld64(&eh->hash);
	e->klen = ld32(&eh->key_len);
	e->vlen = ld32(&eh->val_len);
	if (e->klen > AP_SHM_MAX_KEY || e->vlen > AP_SHM_MAX_VAL)
		return AP_SHM_EBAD;
	rest = x->arena_size - off - ENT_HDR;
	kp = pad8(e->klen);
	vp = pad8(e->vlen);
	if (kp > rest || vp > rest - kp)
		return AP_SHM_EBAD;
	e->key = (const uint8_t *)(eh + 1);
	e->val = e->key + kp;
	return AP_SHM_OK;
}

/* At most min(cap, AP_SHM_MAX_PROBES) probes; an empty slot ends the
 * chain. A longer chain is hostile (see "Hashing" in ap_shm.h). */
static int r_probe(const struct rhalf *x, uint64_t hash, const void *key, size_t klen, struct rent *e,
		   uint64_t *off)
{
	uint64_t mask = x->cap - 1, i = hash & mask;
	uint64_t max = x->cap < AP_SHM_MAX_PROBES ? x->cap : AP_SHM_MAX_PROBES;

	for (uint64_t n = 0; n < max; n++, i = (i + 1) & mask) {
		uint64_t s = __atomic_load_n(&x->slots[i], __ATOMIC_ACQUIRE);
		uint64_t o = (s & SLOT_OFF_MASK) << 3;
		int r;

		if (!o)
			return AP_SHM_ENOTFOUND;
		if (s >> 32 != hash >> 32)
			continue;
		if ((r = r_ent(x, o, e)))
			return r;
		/* memcmp over bytes a rewrite may race with: see the top. */
		if (e->hash != hash || e->klen != klen || (klen && memcmp(e->key, key, klen)))
			continue;
		*off = o;
		return e->vlen ? AP_SHM_OK : AP_SHM_ENOTFOUND;
	}
	return AP_SHM_EBAD; /* a full index or an overlong chain: the writer keeps it half empty */
}

/* The end of a read section: did gen stay g throughout? */
static int r_stable(const struct rseg *s, uint64_t g)
{
	__atomic_thread_fence(__ATOMIC_ACQUIRE);
	return __atomic_load_n(&s->hdr->gen, __ATOMIC_RELAXED) == g;
}

/* One read section: state, gen, the active half, the probe and, when copy
 * is set, the value. The caller then checks that gen stayed the same. */
static int r_try(const struct rseg *s, uint64_t hash, const void *key, size_t klen, uint64_t *g, uint64_t *off,
		 uint32_t *vlen, int copy, void *out, size_t cap)
{
	struct rhalf x;
	struct rent e;
	int r;

	if ((r = r_live(s)))
		return r;
	*g = __atomic_load_n(&s->hdr->gen, __ATOMIC_ACQUIRE);
	if ((r = r_half(s, *g, &x)))
		return r;
	if ((r = r_probe(&x, hash, key, klen, &e, off)))
		return r;
	*vlen = e.vlen;
	if (copy) {
		if (e.vlen > cap)
			return AP_SHM_ETOOBIG;
		memcpy(out, e.val, e.vlen); /* vlen > 0: a removal is ENOTFOUND */
	}
	return AP_SHM_OK;
}

int ap_shm_check(const void *base, size_t len)
{
	struct rseg s;
	struct rhalf x;
	int r;

	if ((r = r_hdr(base, len, &s)))
		return r;
	if (!memchr(s.hdr->node, 0, sizeof s.hdr->node))
		return AP_SHM_EBAD;
	for (int t = 0; t < AP_SHM_MAX_RETRIES; t++) {
		uint64_t g;

		if ((r = r_live(&s)))
			return r;
		g = __atomic_load_n(&s.hdr->gen, __ATOMIC_ACQUIRE);
		r = r_half(&s, g, &x);
		if (r_stable(&s, g))
			return r;
	}
	return AP_SHM_EBUSY;
}

uint64_t ap_shm_changes(const void *base, size_t len)
{
	const struct ap_shm_hdr *h = base;
	uint64_t c;

	if (!base || ((uintptr_t)base & 7) || len < AP_SHM_HDR_SIZE)
		return AP_SHM_NO_CHANGES;
	if (__atomic_load_n(&h->magic, __ATOMIC_ACQUIRE) != AP_SHM_MAGIC)
		return AP_SHM_NO_CHANGES;
	if (ld32(&h->version) != AP_SHM_VERSION || ld32(&h->hdr_size) != AP_SHM_HDR_SIZE)
		return AP_SHM_NO_CHANGES;
	c = __atomic_load_n(&h->changes, __ATOMIC_ACQUIRE);
	/* The writer counts every state store, so the count alone would do;
	 * the state is checked as well for writers that do not (and costs a
	 * load from the same line). */
	if (__atomic_load_n(&h->state, __ATOMIC_ACQUIRE) != AP_SHM_STATE_LIVE)
		return AP_SHM_NO_CHANGES;
	return c;
}

/* find and lookup: r_try until a gen held still for it (bounded). */
static int r_search(const void *base, size_t len, const void *key, size_t klen, int copy, void *out, size_t cap,
		    uint64_t *gen, uint64_t *off, uint32_t *vlen)
{
	struct rseg s;
	uint64_t hash;
	int r;

	if ((r = r_hdr(base, len, &s)))
		return r;
	hash = ap_shm_hash(s.seed, key, klen);
	for (int t = 0; t < AP_SHM_MAX_RETRIES; t++) {
		uint64_t g = 0, o = 0;
		uint32_t vl = 0;

		r = r_try(&s, hash, key, klen, &g, &o, &vl, copy, out, cap);
		if (r == AP_SHM_ESTALE)
			return r;
		if (!r_stable(&s, g))
			continue;
		if (r == AP_SHM_OK || (copy && r == AP_SHM_ETOOBIG)) {
			*gen = g;
			*off = o;
			*vlen = vl;
		}
		return r;
	}
	return AP_SHM_EBUSY;
}

int ap_shm_find(const void *base, size_t len, const void *key, size_t klen, uint64_t *gen, uint64_t *off,
		uint32_t *vlen)
{
	return r_search(base, len, key, klen, 0, NULL, 0, gen, off, vlen);
}

int ap_shm_read(const void *base, size_t len, uint64_t gen, uint64_t off, void *out, size_t cap, uint32_t *vlen)
{
	struct rseg s;
	struct rhalf x;
	struct rent e;
	int r;

	if ((r = r_hdr(base, len, &s)))
		return r;
	r = r_half(&s, gen, &x);
	if (!r)
		r = r_ent(&x, off, &e);
	if (!r && !e.vlen)
		r = AP_SHM_EBAD; /* find never names a removal */
	if (!r && (e.vlen > cap || !out))
		r = AP_SHM_ETOOBIG;
	if (!r)
		memcpy(out, e.val, e.vlen);
	/* Whatever went wrong may be a rewrite of half gen & 1. */
	if (!r_stable(&s, gen))
		return AP_SHM_EBUSY;
	if (r == AP_SHM_OK || r == AP_SHM_ETOOBIG)
		*vlen = e.vlen;
	return r;
}

int ap_shm_lookup(const void *base, size_t len, const void *key, size_t klen, void *out, size_t cap,
		  uint32_t *vlen)
{
	uint64_t gen, off;

	return r_search(base, len, key, klen, 1, out, out ? cap : 0, &gen, &off, vlen);
}

/* ---- writers that are gone ---------------------------------------------- */

int ap_proc_stat(long pid, uint64_t *start, char *state)
{
	char path[64], buf[2048], *p, *end;
	unsigned long long v;
	ssize_t n;
	int fd, e;

	if (pid <= 0 || pid > INT_MAX)
		return -EINVAL;
	snprintf(path, sizeof path, "/proc/%ld/stat", pid);
	fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		return errno == ENOENT || errno == ESRCH ? -ENOENT : -errno;
	n = read(fd, buf, sizeof buf - 1);
	e = errno;
	close(fd);
	if (n < 0)
		return e == ESRCH ? -ENOENT : -e; /* it exited between open and read */
	buf[n] = 0;
	/* "pid (comm) S f4 ... f22 ...": comm may hold spaces and ')', so
	 * the fields start after the last ')'. */
	p = memrchr(buf, ')', (size_t)n);
	if (!p || p[1] != ' ' || !p[2])
		return -EINVAL;
	p += 2;
	if (state)
		*state = *p;
	for (int f = 3; f < 22; f++) {
		p = strchr(p, ' ');
		if (!p)
			return -EINVAL;
		p++;
	}
	if (*p < '0' || *p > '9')
		return -EINVAL;
	errno = 0;
	v = strtoull(p, &end, 10);
	if (errno || (*end != ' ' && *end != '\n' && *end))
		return -EINVAL;
	if (start)
		*start = v;
	return 0;
}

uint64_t ap_proc_pidns(void)
{
	struct stat st;

	return stat("/proc/self/ns/pid", &st) == 0 ? (uint64_t)st.st_ino : 0;
}

static enum ap_shm_fate v_set(struct ap_shm_verdict *v, enum ap_shm_fate fate, const char *why)
{
	v->fate = fate;
	v->why = why;
	return fate;
}

enum ap_shm_fate ap_shm_judge(const void *buf, size_t len, int held, struct ap_shm_verdict *v)
{
	struct ap_shm_hdr h;

	memset(v, 0, sizeof *v);
	/* A copy: buf may be anyone's bytes, and judging reads them once. */
	memset(&h, 0, sizeof h);
	memcpy(&h, buf, len < sizeof h ? len : sizeof h);
	if (len >= offsetof(struct ap_shm_hdr, incarnation) &&
	    (h.magic == AP_SHM_MAGIC || h.magic == AP_SHM_MAGIC_CREATING)) {
		v->version = h.version;
		v->pid = h.writer_pid;
		if (len >= sizeof h)
			v->start = h.writer_start;
	}
	/* The lock is the only evidence about a layout-4 writer. */
	if (held)
		return v_set(v, AP_SHM_FATE_LIVE, NULL);
	if (len == 0)
		return v_set(v, AP_SHM_FATE_GONE, "empty: its writer died while creating it");
	if (len < sizeof h.magic)
		return v_set(v, AP_SHM_FATE_UNREADABLE, "shorter than a snapshot header");
	if (h.magic == 0)
		return v_set(v, AP_SHM_FATE_GONE, "no magic: its writer died while creating it");
	if (h.magic == AP_SHM_MAGIC_CREATING)
		return v_set(v, AP_SHM_FATE_GONE, "its writer died while creating it");
	if (h.magic != AP_SHM_MAGIC)
		return v_set(v, AP_SHM_FATE_UNREADABLE, "not a snapshot (magic)");
	if (len < offsetof(struct ap_shm_hdr, incarnation))
		return v_set(v, AP_SHM_FATE_UNREADABLE, "shorter than a snapshot header");
	if (h.version == AP_SHM_VERSION)
		return v_set(v, AP_SHM_FATE_GONE, NULL);
	if (h.version != 3 && h.version != 4)
		return v_set(v, AP_SHM_FATE_UNREADABLE, "unknown layout version");
	/* Layouts 3 and 4 predate the lock: gone only if nobody here has
	 * the pid (a stamp is all there is). */
	if (!h.writer_pid || h.writer_pid > INT_MAX)
		return v_set(v, AP_SHM_FATE_UNKNOWN, "an old layout without a writer pid");
	if (kill((pid_t)h.writer_pid, 0) < 0 && errno == ESRCH)
		return v_set(v, AP_SHM_FATE_GONE, NULL);
	return v_set(v, AP_SHM_FATE_UNKNOWN, "an old layout, and a process here has its writer's pid");
}

/* fd is open on name in dfd, and st is its fstat (our regular file).
 * Lock it LOCK_EX | LOCK_NB, read and judge its header and, when GONE (or
 * UNREADABLE, if remove says so), unlink the name while still holding the lock if the name still
 * names that object. The caller closes fd (which drops the lock). Reads
 * the header with pread, never maps it: the object may be truncated under
 * us. */
static enum ap_shm_fate judge_at(int dfd, const char *name, int fd, const struct stat *st, int remove,
				 struct ap_shm_swept *s)
{
	struct ap_shm_hdr h;
	struct stat again;
	ssize_t n;
	int held = 0;

	if (flock(fd, LOCK_EX | LOCK_NB) < 0) {
		if (errno != EWOULDBLOCK) {
			s->err = errno;
			return v_set(&s->v, AP_SHM_FATE_UNREADABLE, "cannot lock it");
		}
		held = 1;
	}
	n = pread(fd, &h, sizeof h, 0);
	if (n < 0) {
		s->err = errno;
		return v_set(&s->v, AP_SHM_FATE_UNREADABLE, "cannot read it");
	}
	ap_shm_judge(&h, (size_t)n, held, &s->v);
	if (!(s->v.fate == AP_SHM_FATE_GONE && remove) &&
	    !(s->v.fate == AP_SHM_FATE_UNREADABLE && !held && remove == REMOVE_UNREADABLE))
		return s->v.fate;
	/* Under LOCK_EX: whoever replaced the object under this name since
	 * we opened it did so before we locked, and the name names theirs. */
	if (fstatat(dfd, name, &again, AT_SYMLINK_NOFOLLOW) < 0)
		s->err = errno;
	else if (again.st_ino != st->st_ino || again.st_dev != st->st_dev)
		s->err = ESTALE;
	else if (unlinkat(dfd, name, 0) < 0)
		s->err = errno;
	else
		s->removed = 1;
	return s->v.fate;
}

/* Open name in dfd for judging: never follows a symlink nor blocks on a
 * FIFO, and must be the object pre (an fstatat of the name, or NULL)
 * described. Returns the fd, or -1 with s->err set. */
static int open_judged(int dfd, const char *name, const struct stat *pre, struct stat *st, struct ap_shm_swept *s)
{
	int fd = openat(dfd, name, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_NOCTTY | O_CLOEXEC);

	if (fd < 0) {
		s->err = errno;
		return -1;
	}
	if (fstat(fd, st) < 0) {
		s->err = errno;
	} else if (!ours(st)) {
		s->err = EPERM;
	} else if (pre && (pre->st_ino != st->st_ino || pre->st_dev != st->st_dev)) {
		s->err = ESTALE;
	} else {
		return fd;
	}
	close(fd);
	return -1;
}

int ap_shm_remove(const char *dir, const char *name, struct ap_shm_verdict *v)
{
	struct ap_shm_swept s = { .name = name };
	struct stat st;
	int dfd, fd, rc;

	if (v)
		memset(v, 0, sizeof *v);
	if (!name || !name[0] || strchr(name, '/') || !strcmp(name, ".") || !strcmp(name, ".."))
		return -EINVAL;
	dfd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
	if (dfd < 0)
		return -errno;
	fd = open_judged(dfd, name, NULL, &st, &s);
	if (fd < 0) {
		close(dfd);
		/* ELOOP: a symlink (O_NOFOLLOW); ENXIO: a FIFO or socket. */
		return s.err == ELOOP || s.err == ENXIO ? -EPERM : -s.err;
	}
	judge_at(dfd, name, fd, &st, REMOVE_GONE, &s);
	close(fd);
	close(dfd);
	if (v)
		*v = s.v;
	if (s.removed)
		return 0;
	switch (s.v.fate) {
	case AP_SHM_FATE_LIVE:
	case AP_SHM_FATE_UNKNOWN:
		return -EBUSY;
	case AP_SHM_FATE_UNREADABLE:
		rc = s.err ? -s.err : -EPROTO;
		return rc;
	default:
		return s.err ? -s.err : -EIO;
	}
}

int ap_shm_sweep(const char *dir, const char *prefix, const char *skip, ap_shm_sweep_fn fn, void *arg,
		 struct ap_shm_sweep_sum *sum)
{
	struct ap_shm_sweep_sum t = { 0 };
	size_t plen = strlen(prefix);
	struct dirent *de;
	DIR *d;

	d = opendir(dir);
	if (!d)
		return -errno;
	while ((de = readdir(d))) {
		struct ap_shm_swept s = { .name = de->d_name };
		struct stat pre, st;
		int fd;

		if (strncmp(de->d_name, prefix, plen) || (skip && !strcmp(de->d_name, skip)))
			continue;
		/* Cheap, and opens nothing: anybody can fill the directory
		 * with FIFOs, symlinks and files of their own, and none of
		 * them may cost us a place under the cap or a log line. */
		if (fstatat(dirfd(d), de->d_name, &pre, AT_SYMLINK_NOFOLLOW) < 0)
			continue; /* gone meanwhile */
		if (!ours(&pre)) {
			t.foreign++;
			continue;
		}
		if (t.judged >= AP_SHM_SWEEP_MAX) {
			t.capped = 1;
			break;
		}
		t.judged++;
		fd = open_judged(dirfd(d), de->d_name, &pre, &st, &s);
		if (fd < 0) {
			if (s.err == ENOENT || s.err == ESTALE)
				continue; /* removed or replaced since the fstatat */
			v_set(&s.v, AP_SHM_FATE_UNREADABLE, "cannot open it");
		} else {
			judge_at(dirfd(d), de->d_name, fd, &st, REMOVE_GONE, &s);
			close(fd);
		}
		t.removed += (unsigned)s.removed;
		t.live += s.v.fate == AP_SHM_FATE_LIVE;
		t.v3_kept += s.v.fate == AP_SHM_FATE_UNKNOWN;
		if (fn)
			fn(arg, &s);
	}
	closedir(d);
	if (sum)
		*sum = t;
	return (int)t.removed;
}
