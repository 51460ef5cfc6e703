/* ptab: the registry's generic containers, which know nothing of keys,
 * refs or pids: a hash table of pointers (ptab) and an allocator of small
 * integer ids (idvec). Every byte they allocate or free is added to or
 * taken from *mem, the owner's count of its heap (registry_mem_bytes).
 *
 * ptab: open addressing with linear probing and backward-shift deletion,
 * so there are no tombstones and a table shrinks back as it empties. Each
 * slot keeps the entry's hash beside the pointer: a probe compares hashes
 * without touching the entries (cache misses at 100K+ keys). The caller
 * hashes (with a keyed hash when users choose the keys) and compares its
 * entries itself while walking a probe run:
 *
 *	for (size_t j = h & (t->cap - 1); t->s[j].e; j = (j + 1) & (t->cap - 1))
 *		if (t->s[j].h == h && matches(t->s[j].e)) ...
 *
 * (only when t->cap is non-zero: an empty table has no slots). cap is 0 or
 * a power of two; the load stays at most 3/4.
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
	uint64_t h;
	void *e; /* NULL: empty */
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

/* Grow to cap slots (a power of two, above n / (3/4)). 0, or -1 without
 * memory (the table unchanged). */
int ptab_resize(size_t *mem, ptab *t, size_t cap);

/* Room for one more entry at a load of at most 3/4: 0, or -1 without
 * memory. Call before ptab_put. */
static inline int ptab_reserve(size_t *mem, ptab *t)
{
	if ((t->n + 1) * 4 <= t->cap * 3)
		return 0;
	return ptab_resize(mem, t, t->cap ? t->cap * 2 : PTAB_MIN);
}

/* Add e (not NULL, not there yet) under hash h; room must be reserved. */
static inline void ptab_put(ptab *t, uint64_t h, void *e)
{
	size_t m = t->cap - 1, j = h & m;
	while (t->s[j].e)
		j = (j + 1) & m;
	t->s[j].h = h;
	t->s[j].e = e;
	t->n++;
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
