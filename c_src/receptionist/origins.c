/* origins: interned origin names (see origins.h), on ptab.h's table and
 * id vector. */
#include "origins.h"

#include <ei.h>
#include <stdlib.h>
#include <string.h>

#include "ap_rand.h"
#include "ap_siphash.h"
#include "ptab.h"

struct oname {
	uint64_t h;
	uint32_t id; /* idvec index: the origin id is id + 1 */
	uint32_t len;
	char name[]; /* len bytes and a NUL */
};

struct origins {
	uint64_t k0, k1;
	ptab tab;
	idvec ids;
	uint32_t max;
	uint64_t probes;
	size_t mem;
};

#define ONAME(o, i) ((struct oname *)(o)->ids.v[i])

origins *origins_new(uint32_t max)
{
	origins *o = calloc(1, sizeof *o);
	if (!o)
		return NULL;
	o->k0 = ap_rand_seed(o);
	o->k1 = ap_rand_seed(&o->k1);
	o->max = max;
	return o;
}

void origins_free(origins *o)
{
	if (!o)
		return;
	for (uint32_t i = 0; i < o->ids.n; i++)
		free(ONAME(o, i));
	ptab_free(&o->mem, &o->tab);
	idvec_free(&o->mem, &o->ids);
	free(o);
}

uint32_t origins_get(origins *o, const char *name, int add)
{
	size_t len = strnlen(name, MAXATOMLEN_UTF8);
	if (len >= MAXATOMLEN_UTF8)
		return 0;
	uint64_t h = ap_siphash13(o->k0, o->k1, name, len);
	if (o->tab.cap) {
		size_t m = o->tab.cap - 1;
		for (size_t j = h & m; o->tab.s[j].e; j = (j + 1) & m) {
			struct oname *e = o->tab.s[j].e;
			o->probes++;
			if (ptab_hit(&o->tab.s[j], h) && e->len == len && !memcmp(e->name, name, len))
				return e->id + 1;
		}
	}
	if (!add || origins_count(o) >= o->max || ptab_reserve(&o->mem, &o->tab))
		return 0;
	uint32_t id;
	struct oname *e = malloc(sizeof *e + len + 1);
	if (!e)
		return 0;
	if (idvec_alloc(&o->mem, &o->ids, &id)) {
		free(e);
		return 0;
	}
	o->mem += sizeof *e + len + 1;
	e->h = h;
	e->id = id;
	e->len = (uint32_t)len;
	memcpy(e->name, name, len + 1);
	o->ids.v[id] = e;
	ptab_put(&o->tab, h, e);
	return id + 1;
}

const char *origins_name(const origins *o, uint32_t id)
{
	if (!id || id > o->ids.n || !ONAME(o, id - 1))
		return NULL;
	return ONAME(o, id - 1)->name;
}

void origins_release(origins *o, uint32_t id)
{
	if (!id || id > o->ids.n || !ONAME(o, id - 1))
		return;
	struct oname *e = ONAME(o, id - 1);
	ptab_del(&o->mem, &o->tab, e->h, e);
	idvec_release(&o->ids, id - 1);
	o->mem -= sizeof *e + e->len + 1;
	free(e);
}

uint32_t origins_count(const origins *o)
{
	return o->ids.n - o->ids.nfree;
}

uint64_t origins_probes(const origins *o)
{
	return o->probes;
}

size_t origins_mem_bytes(const origins *o)
{
	return o->mem;
}
