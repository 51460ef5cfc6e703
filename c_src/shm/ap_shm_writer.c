/* ap_shm_writer: the snapshot's one writer (see ap_shm.h for the layout;
 * the readers are ap_shm.c, the sweep of gone writers ap_shm_sweep.c).
 *
 * Whole although over 700 lines: one writer's state (its halves, their
 * watermarks, the counters) that put, compaction, rebuild and create all
 * change under the one publication protocol below; split, each part would
 * need the others' internals.
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
#include "ap_rand.h"
#include "ap_shm.h"
#include "ap_shm_int.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/file.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>


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
	w->seed = ap_rand_seed(w); /* a hash-flooding defence; need not be secret from the readers */
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
	shm_judge_at(dfd, base, fd, &st, REMOVE_UNREADABLE, &s);
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

