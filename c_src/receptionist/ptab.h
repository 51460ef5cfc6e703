/* ptab: the registry's generic containers, which know nothing of keys,
 * refs or pids: a hash table of pointers (ptab) and an allocator of small
 * integer ids (idvec). Every byte they allocate or free is added to or
 * taken from *mem, the owner's count of its heap (registry_mem_bytes).
 *
 * ptab: open addressing with linear probing and backward-shift deletion,
 * so there are no tombstones and a table shrinks back as it empties. Each
 * slot keeps the entry's hash (its low 32 bits: enough for the home slot
 * and to pass over almost every other entry) beside the pointer: a probe
 * compares hashes without touching the entries (cache misses at 100K+
 * keys). The caller hashes (with a keyed hash when users choose the keys)
 * and compares its entries itself while walking a probe run:
 *
 *	for (size_t j = h & (t->cap - 1); t->s[j].e; j = (j + 1) & (t->cap - 1))
 *		if (ptab_hit(&t->s[j], h) && matches(t->s[j].e)) ...
 *
 * (only when t->cap is non-zero: an empty table has no slots). cap is 0 or
 * a power of two; the load stays at most 3/4. A slot also holds a 32-bit
 * value of the owner's beside its entry (a count per entry, say), in the
 * room the hash left: no table needs a slot type of its own.
 *
 * idvec: slot i of v holds the object with id i, or NULL; released ids are
 * reused first, so ids stay dense.
 *
 * Not thread-safe; nothing here calls back.
 */
#ifndef PTAB_H
#define PTAB_H

#include <stddef.h>
#include <stdint.h>

#define PTAB_MIN 16u /* smallest table */

struct pslot {
	void *e;    /* NULL: empty */
	uint32_t h; /* the entry's hash, its low 32 bits */
	uint32_t v; /* the owner's; 0 when put */
};

typedef struct ptab {
	struct pslot *s;
	size_t cap, n;
} ptab;

typedef struct idvec {
	void **v;
	uint32_t *freeids;
	uint32_t n, cap, nfree;
} idvec;

/* Whether slot s may hold the entry under hash h (the caller compares the
 * entry itself then). */
static inline int ptab_hit(const struct pslot *s, uint64_t h) { return s->h == (uint32_t)h; }

/* Grow to cap slots (a power of two, above n / (3/4), at most 2^32: the
 * home slot is taken from the 32 bits kept). 0, or -1 without memory (the
 * table unchanged). */
int ptab_resize(size_t *mem, ptab *t, size_t cap);

/* Room for one more entry at a load of at most 3/4: 0, or -1 without
 * memory. Call before ptab_put. */
static inline int ptab_reserve(size_t *mem, ptab *t)
{
	if ((t->n + 1) * 4 <= t->cap * 3)
		return 0;
	return ptab_resize(mem, t, t->cap ? t->cap * 2 : PTAB_MIN);
}

/* Add e (not NULL, not there yet) under hash h; room must be reserved.
 * Its slot, valid until the table next changes. */
static inline struct pslot *ptab_put(ptab *t, uint64_t h, void *e)
{
	size_t m = t->cap - 1, j = h & m;
	while (t->s[j].e)
		j = (j + 1) & m;
	t->s[j].h = (uint32_t)h;
	t->s[j].v = 0;
	t->s[j].e = e;
	t->n++;
	return &t->s[j];
}

/* Remove e, which is in the table under h. Shrinks a table that is under
 * 1/8 full; without memory for that it just stays larger. */
void ptab_del(size_t *mem, ptab *t, uint64_t h, const void *e);

/* Checks (registry_check): e is in t under h; the slots in use. */
int ptab_has(const ptab *t, uint64_t h, const void *e);
size_t ptab_count(const ptab *t);

/* The slots only, not the entries (the owner frees those first). */
void ptab_free(size_t *mem, ptab *t);

/* A free id in *id (v[*id] is the caller's to set): 0, or -1 without
 * memory. */
int idvec_alloc(size_t *mem, idvec *iv, uint32_t *id);
/* v[id] = NULL and id free again. Never allocates: freeids has room for
 * every id. */
void idvec_release(idvec *iv, uint32_t id);
/* The vectors only, not the objects. */
void idvec_free(size_t *mem, idvec *iv);

#endif
