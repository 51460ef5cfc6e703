/* registry: the receptionist's registry core (see registry.h).
 *
 * Structures (the tables are ptab.h's: open addressing with linear probing
 * and backward-shift deletion, so there are no tombstones and tables
 * shrink back; ids come from its idvec):
 *
 *   keys      rkey* by key bytes (SipHash-1-3 with a random key: key bytes
 *             come from users, so collisions must not be choosable).
 *   rkey      the key bytes, its refs in order (one inline, else a heap
 *             array), and for more than RSET_MIN ref slots a set of
 *             positions in the same allocation, for O(1) duplicate checks.
 *   nodes     interned node names (rnode: name, and the bytes ei_encode_pid
 *             writes before num/serial/creation), by id and by name.
 *   groups    interned (origin, node) pairs (rgroup), by id and by pair;
 *             each ref names its group. A group keeps the set of keys that
 *             hold its refs (a ptab, with its count of refs in each key as
 *             the slot's value), so dropping an origin or a node visits only
 *             the keys concerned.
 *   origins   per origin (rorig, by origin), the list of its groups: dropping
 *             an origin, or counting its refs, visits its groups only, not
 *             every group (as many as origins, or more).
 *   subs      subscribers (rsub) by pid; subns the (key, subscriber) pairs
 *             (rsubn), each in two lists: its key's and its subscriber's.
 *
 * Where the parts are (registry_int.h has what they share):
 *   registry.c          life cycle, registrations, subscriptions, reading
 *   registry_tables.c   nodes, groups and origins, key sets, refs, keys
 *   registry_report.c   values and listings, reports of changes (deferred)
 *   registry_check.c    the invariants, checked together (registry_check)
 *   ptab.c              the generic tables and id vectors
 */
#include "registry_int.h"

#include "ap_rand.h"

#include <errno.h>

/* ---- life cycle --------------------------------------------------------------- */

registry *registry_new(const registry_ops *ops, void *arg, size_t max_value)
{
	registry *r = calloc(1, sizeof *r);
	if (!r)
		return NULL;
	if (ops)
		r->ops = *ops;
	r->arg = arg;
	r->max_value = max_value ? max_value : REGISTRY_DEFAULT_MAX_VAL;
	if (r->max_value > UINT32_MAX / 2)
		r->max_value = UINT32_MAX / 2; /* vsize is 32 bits */
	/* Three draws, each salted apart (their fallbacks differ then too). */
	r->k0 = ap_rand_seed(r);
	r->k1 = ap_rand_seed(&r->k1);
	r->seed = ap_rand_seed(&r->seed);
	r->last_node = r->last_group = UINT32_MAX;
	if (scratch_reserve(r, 4096)) {
		free(r);
		return NULL;
	}
	return r;
}

void registry_free(registry *r)
{
	if (!r)
		return;
	for (size_t i = 0; i < r->subns.cap; i++)
		free(r->subns.s[i].e);
	for (size_t i = 0; i < r->subs.cap; i++)
		free(r->subs.s[i].e);
	for (size_t i = 0; i < r->keys.cap; i++) {
		struct rkey *k = r->keys.s[i].e;
		if (k && k->cap > 1)
			free(k->r.many);
		free(k);
	}
	for (uint32_t i = 0; i < r->groups.n; i++) {
		struct rgroup *g = r->groups.v[i];
		if (g)
			free(g->kset.s);
		free(g);
	}
	for (uint32_t i = 0; i < r->nodes.n; i++)
		free(r->nodes.v[i]);
	idvec_free(&r->mem, &r->nodes);
	idvec_free(&r->mem, &r->groups);
	ptab_free(&r->mem, &r->keys);
	ptab_free(&r->mem, &r->subs);
	ptab_free(&r->mem, &r->subns);
	ptab_free(&r->mem, &r->node_tab);
	ptab_free(&r->mem, &r->group_tab);
	for (size_t i = 0; i < r->orig_tab.cap; i++)
		free(r->orig_tab.s[i].e);
	ptab_free(&r->mem, &r->orig_tab);
	for (size_t i = 0; i < r->ndirty; i++)
		free(r->dirty[i].was);
	free(r->dirty);
	free(r->buf);
	free(r);
}

/* ---- registrations -------------------------------------------------------------- */

int registry_register(registry *r, const void *key, size_t klen, const erlang_pid *ref, uint32_t origin)
{
	if (!klen || klen > REGISTRY_MAX_KEY)
		return -EINVAL;
	int nid = node_get(r, ref->node, 1);
	if (nid < 0)
		return nid;
	struct rgroup *g = group_get(r, origin, (uint32_t)nid, 1);
	if (!g) {
		node_gc(r, (uint32_t)nid);
		return -ENOMEM;
	}
	uint64_t h = key_hash(r, key, klen);
	struct rkey *k = key_find(r, key, klen, h);
	int rc = -ENOMEM;
	if (k && ref_find(r, k, (uint32_t)nid, ref) >= 0) {
		rc = 0;
		goto out;
	}
	size_t esz = NODE(r, nid)->plen + PID_SUFFIX;
	size_t vsize = (k ? k->vsize : 0) + esz;
	uint32_t n = (k ? k->nrefs : 0) + 1;
	if (1 + list_size(n, vsize) > r->max_value) {
		rc = -E2BIG;
		goto out;
	}
	/* Everything that can fail first: the commit below cannot. */
	if (scratch_reserve(r, list_size(n, vsize)))
		goto out;
	if (!k && !(k = key_new(r, key, klen, h)))
		goto out;
	if (k->nrefs == k->cap && refs_resize(r, k, k->cap * 2))
		goto out_key;
	if (ptab_reserve(&r->mem, &g->kset))
		goto out_key;

	pre_change(r, k);
	struct rref *v = refs_of(k);
	v[k->nrefs] = (struct rref){ g->id, ref->num, ref->serial, ref->creation };
	if (rset_of(k))
		rset_insert(r, k, k->nrefs);
	if (k->nrefs++ == 0)
		r->nkeys++;
	k->vsize = (uint32_t)vsize;
	kset_inc(r, g, k);
	g->nrefs++;
	r->nrefs++;
	changed(r, k);
	return 1;
out_key:
	key_gc(r, k);
out:
	group_gc(r, g);
	node_gc(r, (uint32_t)nid);
	return rc;
}

/* Where ref sits under key: 1 (*kp, *ip set), 0 not there, -EINVAL. */
static int ref_locate(registry *r, const void *key, size_t klen, const erlang_pid *ref, struct rkey **kp, long *ip)
{
	if (!klen || klen > REGISTRY_MAX_KEY)
		return -EINVAL;
	int nid = node_get(r, ref->node, 0);
	if (nid < 0)
		return 0;
	struct rkey *k = key_find(r, key, klen, key_hash(r, key, klen));
	if (!k)
		return 0;
	long i = ref_find(r, k, (uint32_t)nid, ref);
	if (i < 0)
		return 0;
	*kp = k;
	*ip = i;
	return 1;
}

int registry_deregister(registry *r, const void *key, size_t klen, const erlang_pid *ref)
{
	struct rkey *k;
	long i;
	int rc = ref_locate(r, key, klen, ref, &k, &i);
	if (rc <= 0)
		return rc;
	pre_change(r, k);
	struct rref *v = refs_of(k), x = v[i];
	if (rset_of(k))
		rset_remove(r, k, (uint32_t)i);
	memmove(v + i, v + i + 1, (k->nrefs - (size_t)i - 1) * sizeof *v);
	if (--k->nrefs == 0)
		r->nkeys--;
	unref(r, k, &x);
	refs_settle(r, k, 0);
	changed(r, k);
	key_gc(r, k);
	return 1;
}

int registry_set_origin(registry *r, const void *key, size_t klen, const erlang_pid *ref, uint32_t origin)
{
	struct rkey *k;
	long i;
	int rc = ref_locate(r, key, klen, ref, &k, &i);
	if (rc <= 0)
		return rc;
	struct rref *v = refs_of(k);
	struct rgroup *old = GROUP(r, v[i].grp);
	if (old->origin == origin)
		return 0;
	if (old->draining)
		return -EBUSY; /* cannot happen: callbacks may not call back in */
	struct rgroup *g = group_get(r, origin, old->node, 1); /* the same node */
	if (!g)
		return -ENOMEM;
	if (ptab_reserve(&r->mem, &g->kset)) {
		group_gc(r, g);
		return -ENOMEM;
	}
	/* The same node, so the encoded listing does not change: no report. */
	kset_inc(r, g, k);
	g->nrefs++;
	v[i].grp = g->id;
	kset_dec(r, old, k);
	old->nrefs--;
	group_gc(r, old);
	return 1;
}

/* Walk g's keys and take out every ref matching (by_node, what): all of
 * g's refs match, and maybe refs of other groups. */
static size_t drain(registry *r, struct rgroup *g, int by_node, uint32_t what)
{
	size_t total = 0;
	ptab ks = g->kset;
	g->kset = (ptab){ 0 };
	g->draining = 1;
	for (size_t i = 0; i < ks.cap; i++) {
		struct rkey *k = ks.s[i].e;
		if (!k)
			continue;
		pre_change(r, k);
		struct rref *v = refs_of(k);
		uint32_t w = 0, n = k->nrefs;
		for (uint32_t j = 0; j < n; j++) {
			struct rref x = v[j];
			const struct rgroup *xg = GROUP(r, x.grp);
			if ((by_node ? xg->node : xg->origin) != what) {
				v[w++] = x;
				continue;
			}
			unref(r, k, &x);
		}
		if (w == n)
			continue;
		k->nrefs = w;
		if (!w)
			r->nkeys--;
		total += n - w;
		refs_settle(r, k, 1);
		changed(r, k);
		key_gc(r, k);
	}
	ptab_free(&r->mem, &ks);
	g->draining = 0;
	group_gc(r, g);
	return total;
}

size_t registry_drop_origin(registry *r, uint32_t origin)
{
	size_t total = 0;
	/* Each drain takes its group out of the list (and maybe others of the
	 * origin with it): drain the first until none is left. */
	for (struct rorig *o; (o = orig_find(r, origin));) {
		uint32_t first = o->head;
		total += drain(r, GROUP(r, first), 0, origin);
		if ((o = orig_find(r, origin)) && o->head == first)
			break; /* cannot be: a drained group has no ref left */
	}
	return total;
}

size_t registry_origin_refs(const registry *r, uint32_t origin)
{
	size_t total = 0;
	const struct rorig *o = orig_find(r, origin);
	for (uint32_t id = o ? o->head : NO_GROUP; id != NO_GROUP; id = GROUP(r, id)->onext)
		total += GROUP(r, id)->nrefs;
	return total;
}

size_t registry_drop_node(registry *r, const char *node)
{
	int nid = node_get(r, node, 0);
	if (nid < 0)
		return 0;
	size_t total = 0;
	for (uint32_t id = 0; id < r->groups.n; id++) {
		struct rgroup *g = GROUP(r, id);
		if (g && g->node == (uint32_t)nid)
			total += drain(r, g, 1, (uint32_t)nid);
	}
	return total;
}

/* ---- subscriptions ------------------------------------------------------------- */

static struct rsub *sub_get(registry *r, uint32_t nid, const erlang_pid *p, int create)
{
	uint64_t h = pid_hash(r, nid, p->num, p->serial, p->creation);
	if (r->subs.cap) {
		size_t m = r->subs.cap - 1;
		for (size_t j = h & m; r->subs.s[j].e; j = (j + 1) & m) {
			struct rsub *s = r->subs.s[j].e;
			if (ptab_hit(&r->subs.s[j], h) && s->node == nid && s->num == p->num && s->serial == p->serial &&
			    s->creation == p->creation)
				return s;
		}
	}
	if (!create || ptab_reserve(&r->mem, &r->subs))
		return NULL;
	struct rsub *s = rcalloc(r, 1, sizeof *s);
	if (!s)
		return NULL;
	s->hash = h;
	s->node = nid;
	s->num = p->num;
	s->serial = p->serial;
	s->creation = p->creation;
	ptab_put(&r->subs, h, s);
	NODE(r, nid)->refs++;
	return s;
}

static void sub_gc(registry *r, struct rsub *s)
{
	if (s->keys)
		return;
	uint32_t nid = s->node;
	ptab_del(&r->mem, &r->subs, s->hash, s);
	rfree(r, s, sizeof *s);
	node_unref(r, nid);
}

static inline uint64_t subn_hash(const registry *r, const struct rkey *k, const struct rsub *s)
{
	return mix64((uintptr_t)k ^ mix64((uintptr_t)s ^ r->seed));
}

struct rsubn *subn_find(const registry *r, const struct rkey *k, const struct rsub *s)
{
	if (!r->subns.cap)
		return NULL;
	uint64_t h = subn_hash(r, k, s);
	size_t m = r->subns.cap - 1;
	for (size_t j = h & m; r->subns.s[j].e; j = (j + 1) & m) {
		struct rsubn *sn = r->subns.s[j].e;
		if (ptab_hit(&r->subns.s[j], h) && sn->k == k && sn->s == s)
			return sn;
	}
	return NULL;
}

/* Unlink and free one subscription (its key and subscriber stay). */
static void subn_free(registry *r, struct rsubn *sn)
{
	if (sn->kprev)
		sn->kprev->knext = sn->knext;
	else
		sn->k->subs = sn->knext;
	if (sn->knext)
		sn->knext->kprev = sn->kprev;
	if (sn->sprev)
		sn->sprev->snext = sn->snext;
	else
		sn->s->keys = sn->snext;
	if (sn->snext)
		sn->snext->sprev = sn->sprev;
	ptab_del(&r->mem, &r->subns, sn->hash, sn);
	rfree(r, sn, sizeof *sn);
	r->nsubscriptions--;
}

int registry_subscribe(registry *r, const void *key, size_t klen, const erlang_pid *sub)
{
	if (!klen || klen > REGISTRY_MAX_KEY)
		return -EINVAL;
	int nid = node_get(r, sub->node, 1);
	if (nid < 0)
		return nid;
	struct rsub *s = sub_get(r, (uint32_t)nid, sub, 1);
	if (!s) {
		node_gc(r, (uint32_t)nid);
		return -ENOMEM;
	}
	uint64_t h = key_hash(r, key, klen);
	struct rkey *k = key_find(r, key, klen, h);
	if (!k && !(k = key_new(r, key, klen, h))) {
		sub_gc(r, s);
		return -ENOMEM;
	}
	/* Its first listing must not come before the snapshot has its refs,
	 * and its next changes must be reported to it: report it now. */
	if (k->dirty)
		registry_flush(r);
	struct rsubn *sn = subn_find(r, k, s);
	int rc = 0;
	if (!sn) {
		if (ptab_reserve(&r->mem, &r->subns) || !(sn = rmalloc(r, sizeof *sn))) {
			key_gc(r, k);
			sub_gc(r, s);
			return -ENOMEM;
		}
		sn->hash = subn_hash(r, k, s);
		sn->k = k;
		sn->s = s;
		sn->kprev = sn->sprev = NULL;
		sn->knext = k->subs;
		if (k->subs)
			k->subs->kprev = sn;
		k->subs = sn;
		sn->snext = s->keys;
		if (s->keys)
			s->keys->sprev = sn;
		s->keys = sn;
		ptab_put(&r->subns, sn->hash, sn);
		r->nsubscriptions++;
		rc = 1;
	}
	const uint8_t *val, *msg;
	size_t vlen, mlen;
	if (encode_value(r, k, &val, &vlen))
		return -ENOMEM; /* subscribed, but the first listing is owed */
	encode_head(r, k->key, k->klen, vlen, &msg, &mlen);
	send_to(r, s, k, msg, mlen);
	return rc;
}

int registry_unsubscribe(registry *r, const void *key, size_t klen, const erlang_pid *sub)
{
	if (!klen || klen > REGISTRY_MAX_KEY)
		return -EINVAL;
	int nid = node_get(r, sub->node, 0);
	if (nid < 0)
		return 0;
	struct rsub *s = sub_get(r, (uint32_t)nid, sub, 0);
	struct rkey *k = s ? key_find(r, key, klen, key_hash(r, key, klen)) : NULL;
	struct rsubn *sn = k ? subn_find(r, k, s) : NULL;
	if (!sn)
		return 0;
	subn_free(r, sn);
	key_gc(r, k);
	sub_gc(r, s);
	return 1;
}

size_t registry_unsubscribe_all(registry *r, const erlang_pid *sub)
{
	int nid = node_get(r, sub->node, 0);
	if (nid < 0)
		return 0;
	struct rsub *s = sub_get(r, (uint32_t)nid, sub, 0);
	if (!s)
		return 0;
	size_t n = 0;
	while (s->keys) {
		struct rsubn *sn = s->keys;
		struct rkey *k = sn->k;
		subn_free(r, sn);
		key_gc(r, k);
		n++;
	}
	sub_gc(r, s);
	return n;
}

/* ---- reading ------------------------------------------------------------------- */

size_t registry_count(const registry *r, const void *key, size_t klen)
{
	if (!klen || klen > REGISTRY_MAX_KEY)
		return 0;
	const struct rkey *k = key_find(r, key, klen, key_hash(r, key, klen));
	return k ? k->nrefs : 0;
}

int registry_value(registry *r, const void *key, size_t klen, const uint8_t **val, size_t *vlen)
{
	if (!klen || klen > REGISTRY_MAX_KEY)
		return -EINVAL;
	return encode_value(r, key_find(r, key, klen, key_hash(r, key, klen)), val, vlen);
}

int registry_listing(registry *r, const void *key, size_t klen, const uint8_t **msg, size_t *mlen)
{
	const uint8_t *val;
	size_t vlen;
	int rc = registry_value(r, key, klen, &val, &vlen);
	if (rc)
		return rc;
	encode_head(r, key, klen, vlen, msg, mlen);
	return 0;
}

int registry_next(registry *r, size_t *cursor, const uint8_t **key, size_t *klen, const uint8_t **val,
		  size_t *vlen)
{
	for (size_t j = *cursor; j < r->keys.cap; j++) {
		struct rkey *k = r->keys.s[j].e;
		if (!k || !k->nrefs)
			continue;
		if (encode_value(r, k, val, vlen))
			return -ENOMEM;
		*key = k->key;
		*klen = k->klen;
		*cursor = j + 1;
		return 1;
	}
	*cursor = r->keys.cap;
	return 0;
}

void registry_get_stats(const registry *r, registry_stats *s)
{
	s->keys = r->nkeys;
	s->entries = r->keys.n;
	s->refs = r->nrefs;
	s->subscriptions = r->nsubscriptions;
	s->subscribers = r->subs.n;
	s->listings_sent = r->listings;
	s->nodes = r->node_tab.n;
	s->groups = r->group_tab.n;
}

size_t registry_mem_bytes(const registry *r) { return r->mem + sizeof *r; }
