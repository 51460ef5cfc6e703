/* registry_tables: the registry's interned nodes, its groups ((origin,
 * node) pairs) and origins with their key sets, a key's refs and the keys
 * themselves (see registry.c). */
#include "registry_int.h"

#include <errno.h>

/* ---- nodes ------------------------------------------------------------------ */

/* The id of node `name`, interned if create. -ENOENT (not create),
 * -EINVAL (a name ei cannot encode), -ENOMEM. */
int node_get(registry *r, const char *name, int create)
{
	if (r->last_node < r->nodes.n && NODE(r, r->last_node) && !strcmp(NODE_NAME(NODE(r, r->last_node)), name))
		return (int)r->last_node;
	size_t nlen = strnlen(name, MAXATOMLEN_UTF8);
	if (nlen >= MAXATOMLEN_UTF8)
		return -EINVAL;
	uint64_t h = ap_siphash13(r->k1, r->k0, name, nlen);
	if (r->node_tab.cap) {
		size_t m = r->node_tab.cap - 1;
		for (size_t j = h & m; r->node_tab.s[j].e; j = (j + 1) & m) {
			struct rnode *nd = r->node_tab.s[j].e;
			if (ptab_hit(&r->node_tab.s[j], h) && nd->nlen == nlen && !memcmp(NODE_NAME(nd), name, nlen)) {
				r->last_node = nd->id;
				return (int)nd->id;
			}
		}
	}
	if (!create)
		return -ENOENT;
	/* The bytes ei_encode_pid writes before num, serial and creation. */
	erlang_pid pid, *p = &pid;
	char enc[MAXATOMLEN_UTF8 + 32];
	int idx = 0;
	memset(p, 0, sizeof *p);
	memcpy(p->node, name, nlen + 1);
	p->creation = 4;
	if (ei_encode_pid(NULL, &idx, p) || idx <= PID_SUFFIX || idx > (int)sizeof enc)
		return -EINVAL;
	idx = 0;
	if (ei_encode_pid(enc, &idx, p) || enc[0] != 88 /* NEW_PID_EXT */)
		return -EINVAL;
	uint32_t plen = (uint32_t)idx - PID_SUFFIX, id;
	if (ptab_reserve(&r->mem, &r->node_tab))
		return -ENOMEM;
	struct rnode *nd = rmalloc(r, sizeof *nd + plen + nlen + 1);
	if (!nd)
		return -ENOMEM;
	if (idvec_alloc(&r->mem, &r->nodes, &id)) {
		rfree(r, nd, sizeof *nd + plen + nlen + 1);
		return -ENOMEM;
	}
	nd->hash = h;
	nd->id = id;
	nd->refs = 0;
	nd->plen = plen;
	nd->nlen = (uint32_t)nlen;
	memcpy(nd->data, enc, plen);
	memcpy(nd->data + plen, name, nlen + 1);
	r->nodes.v[id] = nd;
	ptab_put(&r->node_tab, h, nd);
	r->last_node = id;
	return (int)id;
}

/* Free node id if nothing names it any more. */
void node_gc(registry *r, uint32_t id)
{
	struct rnode *nd = id < r->nodes.n ? NODE(r, id) : NULL;
	if (!nd || nd->refs)
		return;
	ptab_del(&r->mem, &r->node_tab, nd->hash, nd);
	idvec_release(&r->nodes, id);
	rfree(r, nd, sizeof *nd + nd->plen + nd->nlen + 1);
}

void node_unref(registry *r, uint32_t id)
{
	NODE(r, id)->refs--;
	node_gc(r, id);
}

/* ---- groups ----------------------------------------------------------------- */

static inline uint64_t group_hash(const registry *r, uint32_t origin, uint32_t node)
{
	return mix64(((uint64_t)origin << 32 | node) ^ r->seed ^ 0x5bd1e995u);
}

static inline uint64_t orig_hash(const registry *r, uint32_t origin)
{
	return mix64((uint64_t)origin ^ r->seed ^ 0x9e3779b97f4a7c15ull);
}

struct rorig *orig_find(const registry *r, uint32_t origin)
{
	if (!r->orig_tab.cap)
		return NULL;
	uint64_t h = orig_hash(r, origin);
	size_t m = r->orig_tab.cap - 1;
	for (size_t j = h & m; r->orig_tab.s[j].e; j = (j + 1) & m) {
		struct rorig *o = r->orig_tab.s[j].e;
		if (ptab_hit(&r->orig_tab.s[j], h) && o->origin == origin)
			return o;
	}
	return NULL;
}

/* Origin's entry, made (with no group yet) if need be; NULL without memory. */
static struct rorig *orig_get(registry *r, uint32_t origin)
{
	struct rorig *o = orig_find(r, origin);
	if (o)
		return o;
	if (ptab_reserve(&r->mem, &r->orig_tab) || !(o = rcalloc(r, 1, sizeof *o)))
		return NULL;
	o->hash = orig_hash(r, origin);
	o->origin = origin;
	o->head = NO_GROUP;
	ptab_put(&r->orig_tab, o->hash, o);
	return o;
}

/* Free o if it has no group left. */
static void orig_gc(registry *r, struct rorig *o)
{
	if (o->head != NO_GROUP)
		return;
	ptab_del(&r->mem, &r->orig_tab, o->hash, o);
	rfree(r, o, sizeof *o);
}

struct rgroup *group_get(registry *r, uint32_t origin, uint32_t node, int create)
{
	struct rgroup *g = r->last_group < r->groups.n ? GROUP(r, r->last_group) : NULL;
	if (g && g->origin == origin && g->node == node)
		return g;
	uint64_t h = group_hash(r, origin, node);
	if (r->group_tab.cap) {
		size_t m = r->group_tab.cap - 1;
		for (size_t j = h & m; r->group_tab.s[j].e; j = (j + 1) & m) {
			g = r->group_tab.s[j].e;
			if (ptab_hit(&r->group_tab.s[j], h) && g->origin == origin && g->node == node) {
				r->last_group = g->id;
				return g;
			}
		}
	}
	if (!create || ptab_reserve(&r->mem, &r->group_tab))
		return NULL;
	struct rorig *o = orig_get(r, origin);
	if (!o)
		return NULL;
	uint32_t id;
	g = rcalloc(r, 1, sizeof *g);
	if (!g) {
		orig_gc(r, o);
		return NULL;
	}
	if (idvec_alloc(&r->mem, &r->groups, &id)) {
		rfree(r, g, sizeof *g);
		orig_gc(r, o);
		return NULL;
	}
	g->hash = h;
	g->id = id;
	g->origin = origin;
	g->node = node;
	/* First in its origin's list. */
	g->oprev = NO_GROUP;
	g->onext = o->head;
	if (o->head != NO_GROUP)
		GROUP(r, o->head)->oprev = id;
	o->head = id;
	r->groups.v[id] = g;
	ptab_put(&r->group_tab, h, g);
	NODE(r, node)->refs++;
	r->last_group = id;
	return g;
}

/* Free g if it has no refs left (and is not being drained). */
void group_gc(registry *r, struct rgroup *g)
{
	if (g->nrefs || g->draining)
		return;
	uint32_t node = g->node;
	/* Out of its origin's list. */
	struct rorig *o = orig_find(r, g->origin);
	if (g->oprev != NO_GROUP)
		GROUP(r, g->oprev)->onext = g->onext;
	else
		o->head = g->onext;
	if (g->onext != NO_GROUP)
		GROUP(r, g->onext)->oprev = g->oprev;
	orig_gc(r, o);
	ptab_del(&r->mem, &r->group_tab, g->hash, g);
	idvec_release(&r->groups, g->id);
	ptab_free(&r->mem, &g->kset);
	rfree(r, g, sizeof *g);
	node_unref(r, node);
}

/* A group's keys: rkey* -> refs of the group in that key (the slot's
 * value). */

struct pslot *kset_find(const registry *r, const struct rgroup *g, const struct rkey *k)
{
	if (!g->kset.cap)
		return NULL;
	uint64_t h = ptr_hash(r, k);
	size_t m = g->kset.cap - 1;
	for (size_t j = h & m; g->kset.s[j].e; j = (j + 1) & m)
		if (g->kset.s[j].e == k)
			return &g->kset.s[j];
	return NULL;
}

/* Count one more ref of g in k (room reserved: ptab_reserve). */
void kset_inc(registry *r, struct rgroup *g, struct rkey *k)
{
	struct pslot *s = kset_find(r, g, k);
	if (!s)
		s = ptab_put(&g->kset, ptr_hash(r, k), k);
	s->v++;
}

void kset_dec(registry *r, struct rgroup *g, struct rkey *k)
{
	if (g->draining)
		return;
	struct pslot *s = kset_find(r, g, k);
	if (!s || --s->v)
		return;
	ptab_del(&r->mem, &g->kset, ptr_hash(r, k), k);
}

void rset_insert(const registry *r, struct rkey *k, uint32_t pos)
{
	uint32_t *set = rset_of(k), m = 2 * k->cap - 1;
	size_t j = ref_hash(r, &k->r.many[pos]) & m;
	while (set[j])
		j = (j + 1) & m;
	set[j] = pos + 1;
}

static void rset_build(const registry *r, struct rkey *k)
{
	uint32_t *set = rset_of(k);
	if (!set)
		return;
	memset(set, 0, 2 * (size_t)k->cap * sizeof *set);
	for (uint32_t i = 0; i < k->nrefs; i++)
		rset_insert(r, k, i);
}

/* Where pid (on node nid) is in k's refs, or -1. */
long ref_find(const registry *r, struct rkey *k, uint32_t nid, const erlang_pid *p)
{
	struct rref *v = refs_of(k);
	uint32_t *set = rset_of(k);
	if (!set) {
		for (uint32_t i = 0; i < k->nrefs; i++)
			if (v[i].num == p->num && v[i].serial == p->serial && v[i].creation == p->creation &&
			    ref_node(r, &v[i]) == nid)
				return i;
		return -1;
	}
	uint32_t m = 2 * k->cap - 1;
	for (size_t j = pid_hash(r, nid, p->num, p->serial, p->creation) & m; set[j]; j = (j + 1) & m) {
		struct rref *x = &v[set[j] - 1];
		if (x->num == p->num && x->serial == p->serial && x->creation == p->creation && ref_node(r, x) == nid)
			return set[j] - 1;
	}
	return -1;
}

/* Move k's refs into cap slots (a power of two >= nrefs; 1 is inline). */
int refs_resize(registry *r, struct rkey *k, uint32_t cap)
{
	struct rref *old = refs_of(k);
	if (cap <= 1) {
		struct rref one = k->nrefs ? old[0] : (struct rref){ 0 };
		if (k->cap > 1)
			rfree(r, k->r.many, refs_bytes(k->cap));
		k->r.one = one;
		k->cap = 1;
		return 0;
	}
	struct rref *v = rmalloc(r, refs_bytes(cap));
	if (!v)
		return -1;
	memcpy(v, old, k->nrefs * sizeof *v);
	if (k->cap > 1)
		rfree(r, k->r.many, refs_bytes(k->cap));
	k->r.many = v;
	k->cap = cap;
	rset_build(r, k);
	return 0;
}

/* Take the ref at pos out of k's set (before the refs after it move down
 * one place): O(set size) with no hashing but for the probe run. */
void rset_remove(const registry *r, struct rkey *k, uint32_t pos)
{
	uint32_t *set = rset_of(k), m = 2 * k->cap - 1;
	size_t i = ref_hash(r, &k->r.many[pos]) & m;
	while (set[i] != pos + 1)
		i = (i + 1) & m;
	for (size_t j = i;;) {
		j = (j + 1) & m;
		if (!set[j])
			break;
		size_t home = ref_hash(r, &k->r.many[set[j] - 1]) & m;
		if (((j - home) & m) >= ((j - i) & m)) {
			set[i] = set[j];
			i = j;
		}
	}
	set[i] = 0;
	for (uint32_t j = 0; j <= m; j++)
		if (set[j] > pos + 1)
			set[j]--;
}

/* After removals: shrink when a quarter full; re-index when asked (the set
 * was not kept up to date) and not shrunk (which re-indexes). */
void refs_settle(registry *r, struct rkey *k, int reindex)
{
	uint32_t cap = k->cap;
	if (k->nrefs <= 1)
		cap = 1;
	else
		while (cap > 2 && k->nrefs <= cap / 4)
			cap /= 2;
	if (cap != k->cap && refs_resize(r, k, cap) == 0)
		return;
	if (reindex)
		rset_build(r, k);
}

/* Bookkeeping for one ref x taken out of k (x already out of the array). */
void unref(registry *r, struct rkey *k, const struct rref *x)
{
	struct rgroup *g = GROUP(r, x->grp);
	k->vsize -= NODE(r, g->node)->plen + PID_SUFFIX;
	kset_dec(r, g, k);
	g->nrefs--;
	r->nrefs--;
	group_gc(r, g);
}

/* ---- keys ------------------------------------------------------------------- */

struct rkey *key_find(const registry *r, const void *key, size_t klen, uint64_t h)
{
	if (!r->keys.cap)
		return NULL;
	size_t m = r->keys.cap - 1;
	for (size_t j = h & m; r->keys.s[j].e; j = (j + 1) & m) {
		struct rkey *k = r->keys.s[j].e;
		if (ptab_hit(&r->keys.s[j], h) && k->klen == klen && !memcmp(k->key, key, klen))
			return k;
	}
	return NULL;
}

struct rkey *key_new(registry *r, const void *key, size_t klen, uint64_t h)
{
	if (ptab_reserve(&r->mem, &r->keys))
		return NULL;
	struct rkey *k = rmalloc(r, sizeof *k + klen);
	if (!k)
		return NULL;
	memset(k, 0, sizeof *k);
	k->klen = (uint32_t)klen;
	k->cap = 1;
	memcpy(k->key, key, klen);
	ptab_put(&r->keys, h, k);
	return k;
}

/* Free k if it has neither refs nor subscribers. */
void key_gc(registry *r, struct rkey *k)
{
	if (k->nrefs || k->subs || k->dirty)
		return;
	ptab_del(&r->mem, &r->keys, key_hash(r, k->key, k->klen), k);
	if (k->cap > 1)
		rfree(r, k->r.many, refs_bytes(k->cap));
	rfree(r, k, sizeof *k + k->klen);
}
