/* ap_shm: the receptionist's shared-memory snapshot: the keyed hash and
 * the lock-free readers, which trust nothing (see ap_shm.h for the layout).
 * The publication protocol that makes them safe is explained at the top of
 * the writer, ap_shm_writer.c; the judging and removal of segments whose
 * writer is gone is ap_shm_sweep.c.
 */
#include "ap_shm.h"
#include "ap_shm_int.h"
#include "ap_siphash.h"

#include <errno.h>
#include <string.h>

uint64_t ap_shm_hash(uint64_t seed, const void *key, size_t klen)
{
	return ap_siphash13(seed, seed ^ AP_SHM_SEED_K1, key, klen);
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

