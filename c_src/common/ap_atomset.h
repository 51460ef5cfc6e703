/* ap_atomset: a capped set of atom names, by keyed 64-bit hash, that any
 * number of threads add to and look up without a lock.
 *
 * What bounds the atoms a peer's replies can make a BEAM create: the pool
 * node keeps one per pool (the atoms its replies carried, at most
 * max_reply_atoms), the data plane NIF one per segment (the atoms of the
 * replies it decoded unsafely, ERL_NIF_BIN2TERM_SAFE having refused them).
 * Insert-only: a BEAM never frees an atom either.
 *
 * Open addressing over at least twice `cap` slots, so a probe always ends
 * at the name or at an empty slot. A slot holds a name's SipHash-1-3 under
 * a random key (0 marks it empty): without the key nobody can choose names
 * that collide, and a collision would only let one name pass as another.
 * Admitting a name takes a place in `n` before its slot: the slots in use
 * never pass cap, even while threads race for the last place. */
#ifndef AP_ATOMSET_H
#define AP_ATOMSET_H

#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>

#include "ap_rand.h"
#include "ap_siphash.h"

typedef struct ap_atomset {
	uint64_t k0, k1;
	uint32_t cap;       /* names admitted at most */
	uint32_t mask;      /* slots - 1 */
	_Atomic uint32_t n; /* names admitted (and places being taken) */
	_Atomic uint64_t slot[];
} ap_atomset;

/* A set for at most cap names (1..2^30), or NULL (no memory). */
static inline ap_atomset *ap_atomset_new(uint32_t cap)
{
	uint64_t slots = 16;
	while (slots < 2 * (uint64_t)cap)
		slots *= 2;
	ap_atomset *s = calloc(1, sizeof *s + slots * sizeof s->slot[0]);
	if (!s)
		return NULL;
	s->k0 = ap_rand_seed(s);
	s->k1 = ap_rand_seed(&s->k1) ^ 0x9e3779b97f4a7c15ull;
	s->cap = cap;
	s->mask = (uint32_t)(slots - 1);
	return s;
}

/* Names admitted so far. */
static inline uint32_t ap_atomset_count(ap_atomset *s)
{
	uint32_t n = atomic_load_explicit(&s->n, memory_order_relaxed);
	return n < s->cap ? n : s->cap;
}

/* 1: the name is in the set (it was, or is now); 0: it is new and the set
 * is full. Any thread. */
static inline int ap_atomset_admit(ap_atomset *s, const void *name, size_t len)
{
	uint64_t h = ap_siphash13(s->k0, s->k1, name, len);
	int placed = 0; /* a place in n taken, not yet used */
	if (h == 0)
		h = 1;
	for (uint32_t i = (uint32_t)h & s->mask;; i = (i + 1) & s->mask) {
		uint64_t v = atomic_load_explicit(&s->slot[i], memory_order_relaxed);
		if (v == h)
			goto known;
		if (v != 0)
			continue;
		if (!placed) {
			if (atomic_fetch_add_explicit(&s->n, 1, memory_order_relaxed) >= s->cap) {
				atomic_fetch_sub_explicit(&s->n, 1, memory_order_relaxed);
				return 0;
			}
			placed = 1;
		}
		if (atomic_compare_exchange_strong_explicit(&s->slot[i], &v, h, memory_order_relaxed,
							    memory_order_relaxed))
			return 1;
		if (v == h)
			goto known; /* another thread added the same name */
		/* another name took the slot: the place stays ours, on to the next */
	}
known:
	if (placed)
		atomic_fetch_sub_explicit(&s->n, 1, memory_order_relaxed);
	return 1;
}

#endif
