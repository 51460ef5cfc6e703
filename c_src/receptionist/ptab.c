/* ptab: the registry's pointer tables and id vectors (see ptab.h). */
#include "ptab.h"

#include <stdlib.h>
#include <string.h>

static void *mem_malloc(size_t *mem, size_t n)
{
	void *p = malloc(n);
	if (p)
		*mem += n;
	return p;
}

static void *mem_calloc(size_t *mem, size_t n, size_t size)
{
	void *p = calloc(n, size);
	if (p)
		*mem += n * size;
	return p;
}

static void mem_free(size_t *mem, void *p, size_t n)
{
	if (!p)
		return;
	*mem -= n;
	free(p);
}

/* ---- pointer tables ---------------------------------------------------------- */

int ptab_resize(size_t *mem, ptab *t, size_t cap)
{
	if (cap > (size_t)UINT32_MAX + 1)
		return -1;
	struct pslot *s = mem_calloc(mem, cap, sizeof *s);
	if (!s)
		return -1;
	size_t m = cap - 1;
	for (size_t i = 0; i < t->cap; i++) {
		if (!t->s[i].e)
			continue;
		size_t j = t->s[i].h & m;
		while (s[j].e)
			j = (j + 1) & m;
		s[j] = t->s[i];
	}
	mem_free(mem, t->s, t->cap * sizeof *s);
	t->s = s;
	t->cap = cap;
	return 0;
}

void ptab_del(size_t *mem, ptab *t, uint64_t h, const void *e)
{
	size_t m = t->cap - 1, i = h & m;
	while (t->s[i].e != e)
		i = (i + 1) & m;
	/* Backward shift: pull later entries of the run into the hole when
	 * their home slot is not between the hole and where they are. */
	for (size_t j = i;;) {
		j = (j + 1) & m;
		if (!t->s[j].e)
			break;
		size_t home = t->s[j].h & m;
		if (((j - home) & m) >= ((j - i) & m)) {
			t->s[i] = t->s[j];
			i = j;
		}
	}
	t->s[i].e = NULL;
	t->s[i].h = 0;
	t->s[i].v = 0;
	t->n--;
	if (t->cap > PTAB_MIN && t->n * 8 < t->cap)
		ptab_resize(mem, t, t->cap / 2); /* on failure it just stays larger */
}

int ptab_has(const ptab *t, uint64_t h, const void *e)
{
	if (!t->cap)
		return 0;
	size_t m = t->cap - 1;
	for (size_t j = h & m; t->s[j].e; j = (j + 1) & m)
		if (t->s[j].e == e)
			return ptab_hit(&t->s[j], h);
	return 0;
}

size_t ptab_count(const ptab *t)
{
	size_t n = 0;
	for (size_t i = 0; i < t->cap; i++)
		n += t->s[i].e != NULL;
	return n;
}

void ptab_free(size_t *mem, ptab *t)
{
	mem_free(mem, t->s, t->cap * sizeof *t->s);
	t->s = NULL;
	t->cap = t->n = 0;
}

/* ---- ids ----------------------------------------------------------------------- */

int idvec_alloc(size_t *mem, idvec *iv, uint32_t *id)
{
	if (iv->nfree) {
		*id = iv->freeids[--iv->nfree];
		return 0;
	}
	if (iv->n == iv->cap) {
		uint32_t cap = iv->cap ? iv->cap * 2 : 8;
		void **v = mem_calloc(mem, cap, sizeof *v);
		uint32_t *f = mem_malloc(mem, cap * sizeof *f);
		if (!v || !f) {
			mem_free(mem, v, cap * sizeof *v);
			mem_free(mem, f, cap * sizeof *f);
			return -1;
		}
		if (iv->n)
			memcpy(v, iv->v, iv->n * sizeof *v);
		mem_free(mem, iv->v, iv->cap * sizeof *v);
		mem_free(mem, iv->freeids, iv->cap * sizeof *f);
		iv->v = v;
		iv->freeids = f;
		iv->cap = cap;
	}
	*id = iv->n++;
	return 0;
}

void idvec_release(idvec *iv, uint32_t id)
{
	iv->v[id] = NULL;
	iv->freeids[iv->nfree++] = id;
}

void idvec_free(size_t *mem, idvec *iv)
{
	mem_free(mem, iv->v, iv->cap * sizeof *iv->v);
	mem_free(mem, iv->freeids, iv->cap * sizeof *iv->freeids);
	iv->v = NULL;
	iv->freeids = NULL;
	iv->n = iv->cap = iv->nfree = 0;
}
