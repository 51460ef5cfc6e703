/* registry: the receptionist's registry core (see registry.h).
 *
 * Whole although over 700 lines: one structure whose parts (keys and their
 * refs, interned nodes and groups, subscriptions, deferred reports) keep
 * invariants across each other that every operation maintains and
 * registry_check verifies together; split, each part would need the
 * others' structs. Its generic containers are in ptab.c.
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
 *             hold its refs (with a count per key), so dropping an origin or
 *             a node visits only the keys concerned.
 *   origins   per origin (rorig, by origin), the list of its groups: dropping
 *             an origin, or counting its refs, visits its groups only, not
 *             every group (as many as origins, or more).
 *   subs      subscribers (rsub) by pid; subns the (key, subscriber) pairs
 *             (rsubn), each in two lists: its key's and its subscriber's.
 */
#include "ap_buf.h"
#include "ap_rand.h"
#include "registry.h"

#include "ap_siphash.h"
#include "ptab.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>
#include <unistd.h>

#define RSET_MIN 8    /* keys with more ref slots than this get a set */
#define PID_SUFFIX 12 /* NEW_PID_EXT after the node atom: num, serial, creation */
/* The listing message's head: 131, {listing, {service_key, <<Key>>}, ... */
#define HEAD_LEN(klen) (32 + (klen))
/* The scratch buffer holds a head, then from LIST_AT on a list of pids. */
#define LIST_AT (HEAD_LEN(REGISTRY_MAX_KEY) + 8)

struct rref {
	uint32_t grp, num, serial, creation;
};

struct rsubn;

/* A ref as a listing shows it (node, not origin), for telling at a flush
 * whether a key's listing really changed. */
struct lref {
	uint64_t node_hash;
	uint32_t num, serial, creation, zero; /* no padding: compared with memcmp */
};

struct dirty {
	struct rkey *k;
	uint32_t n0;      /* its refs when it was first changed; UINT32_MAX: unknown */
	struct lref *was; /* n0 of them (NULL when n0 is 0 or unknown) */
};

struct rkey {
	uint32_t klen : 31; /* at most REGISTRY_MAX_KEY */
	uint32_t dirty : 1; /* changed while deferring: in r->dirty, kept until reported */
	uint32_t nrefs;
	uint32_t cap;   /* ref slots, a power of two: 1 is the inline one */
	uint32_t vsize; /* sum of the refs' encoded sizes */
	union {
		struct rref one;
		struct rref *many; /* cap refs, then (cap > RSET_MIN) 2 * cap uint32 positions + 1 */
	} r;
	struct rsubn *subs;
	uint8_t key[];
};

struct rnode {
	uint64_t hash;
	uint32_t id;
	uint32_t refs; /* groups and subscribers naming it */
	uint32_t plen; /* prefix bytes: 88, the node atom */
	uint32_t nlen;
	uint8_t data[]; /* prefix, then the name and a NUL */
};
#define NODE_NAME(nd) ((const char *)(nd)->data + (nd)->plen)

struct kslot {
	struct rkey *k;
	uint32_t n; /* refs of the group in k */
};

struct rgroup {
	uint64_t hash;
	uint32_t id, origin, node;
	uint32_t oprev, onext; /* its origin's other groups (ids; NO_GROUP ends) */
	uint32_t draining; /* its key set is being walked: leave it alone */
	uint64_t nrefs;
	struct kslot *ks;
	uint32_t kcap, kn;
};

#define NO_GROUP UINT32_MAX

struct rorig {
	uint64_t hash;
	uint32_t origin;
	uint32_t head; /* its first group (a group of an origin holds refs) */
};

struct rsub {
	uint64_t hash;
	uint32_t node, num, serial, creation;
	struct rsubn *keys;
};

struct rsubn {
	uint64_t hash;
	struct rkey *k;
	struct rsub *s;
	struct rsubn *kprev, *knext; /* in k->subs */
	struct rsubn *sprev, *snext; /* in s->keys */
};

struct registry {
	registry_ops ops;
	void *arg;
	size_t max_value;
	uint64_t k0, k1, seed;
	ptab keys, subs, subns, node_tab, group_tab, orig_tab;
	idvec nodes, groups;
	uint32_t last_node, last_group; /* lookup caches (ids, checked before use) */
	uint8_t *buf;
	size_t bufcap;
	erlang_pid to;
	uint64_t nkeys, nrefs, nsubscriptions, listings;
	size_t mem;
	int defer;            /* registry_defer: report changed keys at the flush */
	struct dirty *dirty;  /* the keys changed meanwhile, each once */
	size_t ndirty, capdirty;
};

#define NODE(r, id) ((struct rnode *)(r)->nodes.v[id])
#define GROUP(r, id) ((struct rgroup *)(r)->groups.v[id])

/* ---- memory, with accounting ---------------------------------------------- */

static void *rmalloc(registry *r, size_t n)
{
	void *p = malloc(n);
	if (p)
		r->mem += n;
	return p;
}

static void *rcalloc(registry *r, size_t n, size_t size)
{
	void *p = calloc(n, size);
	if (p)
		r->mem += n * size;
	return p;
}

static void rfree(registry *r, void *p, size_t n)
{
	if (!p)
		return;
	r->mem -= n;
	free(p);
}

/* ---- hashing -------------------------------------------------------------- */

static inline uint64_t mix64(uint64_t x)
{
	x ^= x >> 33;
	x *= 0xff51afd7ed558ccdULL;
	x ^= x >> 33;
	x *= 0xc4ceb9fe1a85ec53ULL;
	x ^= x >> 33;
	return x;
}

static inline uint64_t key_hash(const registry *r, const void *key, size_t klen)
{
	return ap_siphash13(r->k0, r->k1, key, klen);
}

static inline uint64_t pid_hash(const registry *r, uint32_t nid, uint32_t num, uint32_t serial, uint32_t creation)
{
	return mix64(((uint64_t)nid << 32 | num) ^ r->seed ^ mix64((uint64_t)serial << 32 | creation));
}

static inline uint64_t ptr_hash(const registry *r, const void *p) { return mix64((uintptr_t)p ^ r->seed); }

static inline void put32be(uint8_t *p, uint32_t v)
{
	p[0] = (uint8_t)(v >> 24);
	p[1] = (uint8_t)(v >> 16);
	p[2] = (uint8_t)(v >> 8);
	p[3] = (uint8_t)v;
}

/* ---- nodes ------------------------------------------------------------------ */

/* The id of node `name`, interned if create. -ENOENT (not create),
 * -EINVAL (a name ei cannot encode), -ENOMEM. */
static int node_get(registry *r, const char *name, int create)
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
			if (r->node_tab.s[j].h == h && nd->nlen == nlen && !memcmp(NODE_NAME(nd), name, nlen)) {
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
static void node_gc(registry *r, uint32_t id)
{
	struct rnode *nd = id < r->nodes.n ? NODE(r, id) : NULL;
	if (!nd || nd->refs)
		return;
	ptab_del(&r->mem, &r->node_tab, nd->hash, nd);
	idvec_release(&r->nodes, id);
	rfree(r, nd, sizeof *nd + nd->plen + nd->nlen + 1);
}

static void node_unref(registry *r, uint32_t id)
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

static struct rorig *orig_find(const registry *r, uint32_t origin)
{
	if (!r->orig_tab.cap)
		return NULL;
	uint64_t h = orig_hash(r, origin);
	size_t m = r->orig_tab.cap - 1;
	for (size_t j = h & m; r->orig_tab.s[j].e; j = (j + 1) & m) {
		struct rorig *o = r->orig_tab.s[j].e;
		if (r->orig_tab.s[j].h == h && o->origin == origin)
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

static struct rgroup *group_get(registry *r, uint32_t origin, uint32_t node, int create)
{
	struct rgroup *g = r->last_group < r->groups.n ? GROUP(r, r->last_group) : NULL;
	if (g && g->origin == origin && g->node == node)
		return g;
	uint64_t h = group_hash(r, origin, node);
	if (r->group_tab.cap) {
		size_t m = r->group_tab.cap - 1;
		for (size_t j = h & m; r->group_tab.s[j].e; j = (j + 1) & m) {
			g = r->group_tab.s[j].e;
			if (r->group_tab.s[j].h == h && g->origin == origin && g->node == node) {
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
static void group_gc(registry *r, struct rgroup *g)
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
	rfree(r, g->ks, g->kcap * sizeof *g->ks);
	rfree(r, g, sizeof *g);
	node_unref(r, node);
}

/* A group's keys: rkey* -> refs of the group in that key. */

static int kset_resize(registry *r, struct rgroup *g, uint32_t cap)
{
	struct kslot *s = rcalloc(r, cap, sizeof *s);
	if (!s)
		return -1;
	uint32_t m = cap - 1;
	for (uint32_t i = 0; i < g->kcap; i++) {
		if (!g->ks[i].k)
			continue;
		size_t j = ptr_hash(r, g->ks[i].k) & m;
		while (s[j].k)
			j = (j + 1) & m;
		s[j] = g->ks[i];
	}
	rfree(r, g->ks, g->kcap * sizeof *s);
	g->ks = s;
	g->kcap = cap;
	return 0;
}

static int kset_reserve(registry *r, struct rgroup *g)
{
	if ((uint64_t)(g->kn + 1) * 4 <= (uint64_t)g->kcap * 3)
		return 0;
	return kset_resize(r, g, g->kcap ? g->kcap * 2 : 8);
}

static struct kslot *kset_find(const registry *r, const struct rgroup *g, const struct rkey *k)
{
	if (!g->kcap)
		return NULL;
	uint32_t m = g->kcap - 1;
	for (size_t j = ptr_hash(r, k) & m; g->ks[j].k; j = (j + 1) & m)
		if (g->ks[j].k == k)
			return &g->ks[j];
	return NULL;
}

/* Count one more ref of g in k (room reserved). */
static void kset_inc(registry *r, struct rgroup *g, struct rkey *k)
{
	uint32_t m = g->kcap - 1;
	size_t j = ptr_hash(r, k) & m;
	for (; g->ks[j].k; j = (j + 1) & m)
		if (g->ks[j].k == k) {
			g->ks[j].n++;
			return;
		}
	g->ks[j].k = k;
	g->ks[j].n = 1;
	g->kn++;
}

static void kset_dec(registry *r, struct rgroup *g, struct rkey *k)
{
	if (g->draining)
		return;
	struct kslot *s = kset_find(r, g, k);
	if (!s || --s->n)
		return;
	uint32_t m = g->kcap - 1;
	size_t i = (size_t)(s - g->ks);
	for (size_t j = i;;) {
		j = (j + 1) & m;
		if (!g->ks[j].k)
			break;
		size_t home = ptr_hash(r, g->ks[j].k) & m;
		if (((j - home) & m) >= ((j - i) & m)) {
			g->ks[i] = g->ks[j];
			i = j;
		}
	}
	g->ks[i].k = NULL;
	g->ks[i].n = 0;
	g->kn--;
	if (g->kcap > 8 && g->kn * 8 < g->kcap)
		kset_resize(r, g, g->kcap / 2);
}

/* ---- a key's refs ----------------------------------------------------------- */

static inline struct rref *refs_of(struct rkey *k) { return k->cap <= 1 ? &k->r.one : k->r.many; }

static inline uint32_t *rset_of(struct rkey *k)
{
	return k->cap > RSET_MIN ? (uint32_t *)(k->r.many + k->cap) : NULL;
}

static inline size_t refs_bytes(uint32_t cap)
{
	if (cap <= 1)
		return 0;
	return cap * sizeof(struct rref) + (cap > RSET_MIN ? 2 * (size_t)cap * sizeof(uint32_t) : 0);
}

static inline uint32_t ref_node(const registry *r, const struct rref *x) { return GROUP(r, x->grp)->node; }

static inline uint64_t ref_hash(const registry *r, const struct rref *x)
{
	return pid_hash(r, ref_node(r, x), x->num, x->serial, x->creation);
}

static void rset_insert(const registry *r, struct rkey *k, uint32_t pos)
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
static long ref_find(const registry *r, struct rkey *k, uint32_t nid, const erlang_pid *p)
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
static int refs_resize(registry *r, struct rkey *k, uint32_t cap)
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
static void rset_remove(const registry *r, struct rkey *k, uint32_t pos)
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
static void refs_settle(registry *r, struct rkey *k, int reindex)
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

static inline size_t list_size(uint32_t n, size_t vsize) { return n ? 5 + vsize + 1 : 1; }

/* Bookkeeping for one ref x taken out of k (x already out of the array). */
static void unref(registry *r, struct rkey *k, const struct rref *x)
{
	struct rgroup *g = GROUP(r, x->grp);
	k->vsize -= NODE(r, g->node)->plen + PID_SUFFIX;
	kset_dec(r, g, k);
	g->nrefs--;
	r->nrefs--;
	group_gc(r, g);
}

/* ---- keys ------------------------------------------------------------------- */

static struct rkey *key_find(const registry *r, const void *key, size_t klen, uint64_t h)
{
	if (!r->keys.cap)
		return NULL;
	size_t m = r->keys.cap - 1;
	for (size_t j = h & m; r->keys.s[j].e; j = (j + 1) & m) {
		struct rkey *k = r->keys.s[j].e;
		if (r->keys.s[j].h == h && k->klen == klen && !memcmp(k->key, key, klen))
			return k;
	}
	return NULL;
}

static struct rkey *key_new(registry *r, const void *key, size_t klen, uint64_t h)
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
static void key_gc(registry *r, struct rkey *k)
{
	if (k->nrefs || k->subs || k->dirty)
		return;
	ptab_del(&r->mem, &r->keys, key_hash(r, k->key, k->klen), k);
	if (k->cap > 1)
		rfree(r, k->r.many, refs_bytes(k->cap));
	rfree(r, k, sizeof *k + k->klen);
}

/* ---- encoding ---------------------------------------------------------------- */

static int scratch_reserve(registry *r, size_t list)
{
	size_t before = r->bufcap;
	if (ap_grow(&r->buf, &r->bufcap, LIST_AT + list, 4096, SIZE_MAX))
		return -1;
	r->mem += r->bufcap - before;
	return 0;
}

/* k's value (131 + list) into the scratch buffer; k may be NULL (unknown key). */
static int encode_value(registry *r, struct rkey *k, const uint8_t **val, size_t *vlen)
{
	size_t ls = k ? list_size(k->nrefs, k->vsize) : 1;
	if (scratch_reserve(r, ls))
		return -ENOMEM;
	uint8_t *p = r->buf + LIST_AT;
	if (k && k->nrefs) {
		const struct rref *v = refs_of(k);
		*p++ = 108; /* LIST_EXT */
		put32be(p, k->nrefs);
		p += 4;
		for (uint32_t i = 0; i < k->nrefs; i++) {
			const struct rnode *nd = NODE(r, ref_node(r, &v[i]));
			memcpy(p, nd->data, nd->plen);
			p += nd->plen;
			put32be(p, v[i].num);
			put32be(p + 4, v[i].serial);
			put32be(p + 8, v[i].creation);
			p += PID_SUFFIX;
		}
	}
	*p = 106; /* NIL_EXT */
	r->buf[LIST_AT - 1] = 131;
	*val = r->buf + LIST_AT - 1;
	*vlen = ls + 1;
	return 0;
}

/* The message head in front of the list encode_value left (overwriting its
 * 131): {listing, {service_key, <<Key>>}, List}. */
static void encode_head(registry *r, const void *key, size_t klen, size_t vlen, const uint8_t **msg, size_t *mlen)
{
	uint8_t *p = r->buf + LIST_AT - HEAD_LEN(klen);
	*msg = p;
	*mlen = HEAD_LEN(klen) + vlen - 1;
	static const uint8_t h1[] = { 131, 104, 3, 119, 7, 'l', 'i', 's', 't', 'i', 'n', 'g', 104, 2, 119, 11,
				      's', 'e', 'r', 'v', 'i', 'c', 'e', '_', 'k', 'e', 'y', 109 };
	memcpy(p, h1, sizeof h1);
	p += sizeof h1;
	put32be(p, (uint32_t)klen);
	memcpy(p + 4, key, klen);
}

static void send_to(registry *r, const struct rsub *s, const struct rkey *k, const uint8_t *msg, size_t mlen)
{
	const struct rnode *nd = NODE(r, s->node);
	memcpy(r->to.node, NODE_NAME(nd), nd->nlen + 1);
	r->to.num = s->num;
	r->to.serial = s->serial;
	r->to.creation = s->creation;
	r->listings++;
	if (r->ops.on_listing)
		r->ops.on_listing(r->arg, &r->to, k->key, k->klen, msg, mlen);
}

/* ---- deferred reports (registry_defer) ---------------------------------------- */

static struct lref lref_of(const registry *r, const struct rref *x)
{
	return (struct lref){ NODE(r, GROUP(r, x->grp)->node)->hash, x->num, x->serial, x->creation, 0 };
}

/* Before k's refs change: while deferring, the first time, note them and
 * mark k dirty, so that changed() leaves the report to the flush. Only for
 * keys without subscribers: a subscriber gets a listing per change. If
 * that takes memory there is none of, k is left clean and reported at
 * once. */
static void pre_change(registry *r, struct rkey *k)
{
	if (!r->defer || k->dirty || k->subs || !r->ops.on_change)
		return;
	if (r->ndirty == r->capdirty) {
		size_t cap = r->capdirty ? r->capdirty * 2 : 64;
		struct dirty *grown = realloc(r->dirty, cap * sizeof *grown);
		if (!grown)
			return;
		r->dirty = grown;
		r->capdirty = cap;
	}
	struct dirty *d = &r->dirty[r->ndirty++];
	*d = (struct dirty){ k, k->nrefs, NULL };
	if (k->nrefs) {
		d->was = malloc((size_t)k->nrefs * sizeof *d->was);
		if (d->was) {
			const struct rref *v = refs_of(k);
			for (uint32_t i = 0; i < k->nrefs; i++)
				d->was[i] = lref_of(r, &v[i]);
		} else {
			d->n0 = UINT32_MAX; /* unknown: report it whatever it is */
		}
	}
	k->dirty = 1;
}

/* Whether k's listing differs from the one it had when first changed. */
static int listing_changed(const registry *r, const struct dirty *d)
{
	struct rkey *k = d->k;
	if (d->n0 == UINT32_MAX || d->n0 != k->nrefs)
		return 1;
	const struct rref *v = refs_of(k);
	for (uint32_t i = 0; i < k->nrefs; i++) {
		struct lref now = lref_of(r, &v[i]);
		if (memcmp(&now, &d->was[i], sizeof now))
			return 1;
	}
	return 0;
}

/* k's refs changed: the snapshot hook, then every subscriber. */
static void changed(registry *r, struct rkey *k)
{
	const uint8_t *val, *msg;
	size_t vlen, mlen;
	if (k->dirty)
		return; /* deferred: reported at the flush */
	/* Reported now: the deferred ones first, so that whoever gets this
	 * listing finds every earlier change in the snapshot. */
	if (r->ndirty && (r->ops.on_change || k->subs))
		registry_flush(r);
	if (!r->ops.on_change && !k->subs)
		return;
	if (encode_value(r, k, &val, &vlen)) {
		if (r->ops.on_change)
			r->ops.on_change(r->arg, k->key, k->klen, NULL, 0, k->nrefs);
		return;
	}
	if (r->ops.on_change)
		r->ops.on_change(r->arg, k->key, k->klen, val, vlen, k->nrefs);
	if (!k->subs)
		return;
	encode_head(r, k->key, k->klen, vlen, &msg, &mlen);
	for (const struct rsubn *sn = k->subs; sn; sn = sn->knext)
		send_to(r, sn->s, k, msg, mlen);
}

void registry_defer(registry *r, int on)
{
	if (!on)
		registry_flush(r);
	r->defer = on;
}

int registry_deferring(const registry *r)
{
	return r->defer;
}

void registry_flush(registry *r)
{
	int was_deferring = r->defer;
	r->defer = 0;
	/* Taken off first: changed() below must not flush again. Callbacks do
	 * not call back in and deferring is off, so nothing is added. */
	size_t n = r->ndirty;
	r->ndirty = 0;
	for (size_t i = 0; i < n; i++) {
		struct dirty *d = &r->dirty[i];
		struct rkey *k = d->k;
		int report = listing_changed(r, d);
		free(d->was);
		k->dirty = 0;
		if (report)
			changed(r, k);
		key_gc(r, k);
	}
	r->defer = was_deferring;
}

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
			free(g->ks);
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
	if (kset_reserve(r, g))
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
	if (kset_reserve(r, g)) {
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
	struct kslot *ks = g->ks;
	uint32_t kcap = g->kcap;
	g->ks = NULL;
	g->kcap = g->kn = 0;
	g->draining = 1;
	for (uint32_t i = 0; i < kcap; i++) {
		struct rkey *k = ks[i].k;
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
	rfree(r, ks, kcap * sizeof *ks);
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
			if (r->subs.s[j].h == h && s->node == nid && s->num == p->num && s->serial == p->serial &&
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

static struct rsubn *subn_find(const registry *r, const struct rkey *k, const struct rsub *s)
{
	if (!r->subns.cap)
		return NULL;
	uint64_t h = subn_hash(r, k, s);
	size_t m = r->subns.cap - 1;
	for (size_t j = h & m; r->subns.s[j].e; j = (j + 1) & m) {
		struct rsubn *sn = r->subns.s[j].e;
		if (r->subns.s[j].h == h && sn->k == k && sn->s == s)
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

/* ---- invariants ------------------------------------------------------------------ */

#define CHECK(cond, ...)                                                                           \
	do {                                                                                       \
		if (!(cond)) {                                                                     \
			snprintf(why, cap, __VA_ARGS__);                                           \
			rc = -1;                                                                   \
			goto done;                                                                 \
		}                                                                                  \
	} while (0)

int registry_check(const registry *r, char *why, size_t cap)
{
	int rc = 0;
	uint64_t *gcount = calloc(r->groups.n + 1, sizeof *gcount); /* refs per group, whole registry */
	uint32_t *kcount = calloc(r->groups.n + 1, sizeof *kcount); /* refs per group, one key */
	uint64_t *nrefs = calloc(r->nodes.n + 1, sizeof *nrefs);    /* expected node refcounts */
	uint64_t keys = 0, refs = 0, subns = 0;
	snprintf(why, cap, "ok");
	CHECK(gcount && kcount && nrefs, "out of memory");
	CHECK(ptab_count(&r->keys) == r->keys.n, "key table count");
	CHECK(ptab_count(&r->subs) == r->subs.n, "subscriber table count");
	CHECK(ptab_count(&r->subns) == r->subns.n, "subscription table count");
	CHECK(ptab_count(&r->node_tab) == r->node_tab.n, "node table count");
	CHECK(ptab_count(&r->group_tab) == r->group_tab.n, "group table count");
	for (size_t i = 0; i < r->keys.cap; i++) {
		struct rkey *k = r->keys.s[i].e;
		if (!k)
			continue;
		CHECK(k->klen >= 1 && k->klen <= REGISTRY_MAX_KEY, "key length %u", k->klen);
		CHECK(r->keys.s[i].h == key_hash(r, k->key, k->klen), "key hash");
		CHECK(key_find(r, k->key, k->klen, r->keys.s[i].h) == k, "key not findable");
		CHECK(k->nrefs || k->subs, "empty key kept");
		CHECK(k->cap >= 1 && !(k->cap & (k->cap - 1)) && k->nrefs <= k->cap, "key cap %u nrefs %u", k->cap,
		      k->nrefs);
		CHECK(k->cap == 1 || k->nrefs > k->cap / 8, "key cap %u too big for %u refs", k->cap, k->nrefs);
		keys += k->nrefs > 0;
		refs += k->nrefs;
		struct rref *v = refs_of(k);
		size_t vsize = 0;
		for (uint32_t j = 0; j < k->nrefs; j++) {
			CHECK(v[j].grp < r->groups.n && GROUP(r, v[j].grp), "ref of a dead group");
			const struct rgroup *g = GROUP(r, v[j].grp);
			CHECK(g->node < r->nodes.n && NODE(r, g->node), "group of a dead node");
			vsize += NODE(r, g->node)->plen + PID_SUFFIX;
			gcount[v[j].grp]++;
			kcount[v[j].grp]++;
			erlang_pid p;
			p.num = v[j].num;
			p.serial = v[j].serial;
			p.creation = v[j].creation;
			CHECK(ref_find(r, k, g->node, &p) == (long)j, "ref %u not found at its place (dup or index)", j);
		}
		CHECK(vsize == k->vsize, "vsize %u, refs say %zu", k->vsize, vsize);
		uint32_t *set = rset_of(k);
		if (set) {
			uint32_t used = 0;
			for (uint32_t j = 0; j < 2 * k->cap; j++) {
				CHECK(set[j] <= k->nrefs, "set entry out of range");
				used += set[j] != 0;
			}
			CHECK(used == k->nrefs, "set holds %u of %u refs", used, k->nrefs);
		}
		for (uint32_t j = 0; j < k->nrefs; j++) {
			uint32_t gid = v[j].grp;
			if (!kcount[gid])
				continue; /* already checked */
			const struct kslot *s = kset_find(r, GROUP(r, gid), k);
			CHECK(s && s->n == kcount[gid], "group %u counts %u refs in a key, it has %u", gid, s ? s->n : 0,
			      kcount[gid]);
			kcount[gid] = 0;
		}
		uint32_t nsub = 0;
		for (const struct rsubn *sn = k->subs; sn; sn = sn->knext, nsub++) {
			CHECK(sn->k == k, "subscription in the wrong key list");
			CHECK(!sn->knext || sn->knext->kprev == sn, "key list links");
			CHECK(ptab_has(&r->subns, sn->hash, sn), "subscription not in its table");
			CHECK(subn_find(r, k, sn->s) == sn, "subscription not findable");
			CHECK(nsub <= r->subns.n, "key list loops");
		}
		subns += nsub;
	}
	CHECK(keys == r->nkeys, "nkeys %llu, counted %llu", (unsigned long long)r->nkeys, (unsigned long long)keys);
	CHECK(refs == r->nrefs, "nrefs %llu, counted %llu", (unsigned long long)r->nrefs, (unsigned long long)refs);
	CHECK(subns == r->nsubscriptions && subns == r->subns.n, "subscriptions: %llu counted, %llu, %zu",
	      (unsigned long long)subns, (unsigned long long)r->nsubscriptions, r->subns.n);
	size_t ngroups = 0;
	for (uint32_t id = 0; id < r->groups.n; id++) {
		const struct rgroup *g = GROUP(r, id);
		if (!g)
			continue;
		ngroups++;
		CHECK(g->id == id && ptab_has(&r->group_tab, g->hash, g), "group %u indexing", id);
		CHECK(!g->draining, "group %u left draining", id);
		CHECK(g->nrefs && g->nrefs == gcount[id], "group %u: %llu refs, counted %llu", id,
		      (unsigned long long)g->nrefs, (unsigned long long)gcount[id]);
		uint64_t inks = 0, kn = 0;
		for (uint32_t j = 0; j < g->kcap; j++)
			if (g->ks[j].k) {
				CHECK(ptab_has(&r->keys, key_hash(r, g->ks[j].k->key, g->ks[j].k->klen), g->ks[j].k),
				      "group %u names a dead key", id);
				inks += g->ks[j].n;
				kn++;
			}
		CHECK(kn == g->kn && inks == g->nrefs, "group %u key set: %llu keys (%u), %llu refs", id,
		      (unsigned long long)kn, g->kn, (unsigned long long)inks);
		CHECK(g->node < r->nodes.n && NODE(r, g->node), "group %u of a dead node", id);
		nrefs[g->node]++;
	}
	CHECK(ngroups == r->group_tab.n, "groups: %zu by id, %zu by pair", ngroups, r->group_tab.n);
	/* Each group in its origin's list once, each list of that origin's
	 * groups only, and no origin without a group. */
	CHECK(ptab_count(&r->orig_tab) == r->orig_tab.n, "origin table count");
	size_t listed = 0;
	for (size_t i = 0; i < r->orig_tab.cap; i++) {
		const struct rorig *o = r->orig_tab.s[i].e;
		if (!o)
			continue;
		CHECK(o->head != NO_GROUP && ptab_has(&r->orig_tab, o->hash, o) && orig_find(r, o->origin) == o,
		      "origin %u: empty or badly indexed", o->origin);
		uint32_t prev = NO_GROUP;
		for (uint32_t id = o->head; id != NO_GROUP; id = GROUP(r, id)->onext) {
			CHECK(id < r->groups.n && GROUP(r, id), "origin %u lists a dead group", o->origin);
			CHECK(GROUP(r, id)->origin == o->origin && GROUP(r, id)->oprev == prev,
			      "origin %u: group %u misplaced or badly linked", o->origin, id);
			CHECK(++listed <= ngroups, "origin lists too long");
			prev = id;
		}
	}
	CHECK(listed == ngroups, "origin lists hold %zu of %zu groups", listed, ngroups);
	uint64_t subns2 = 0;
	for (size_t i = 0; i < r->subs.cap; i++) {
		const struct rsub *s = r->subs.s[i].e;
		if (!s)
			continue;
		CHECK(s->keys, "subscriber without subscriptions kept");
		CHECK(s->node < r->nodes.n && NODE(r, s->node), "subscriber on a dead node");
		nrefs[s->node]++;
		for (const struct rsubn *sn = s->keys; sn; sn = sn->snext) {
			CHECK(sn->s == s && (!sn->snext || sn->snext->sprev == sn), "subscriber list links");
			CHECK(++subns2 <= r->subns.n, "subscriber lists too long");
		}
	}
	CHECK(subns2 == r->subns.n, "subscriber lists hold %llu of %zu", (unsigned long long)subns2, r->subns.n);
	size_t nnodes = 0;
	for (uint32_t id = 0; id < r->nodes.n; id++) {
		const struct rnode *nd = NODE(r, id);
		if (!nd)
			continue;
		nnodes++;
		CHECK(nd->id == id && ptab_has(&r->node_tab, nd->hash, nd), "node %u indexing", id);
		CHECK(nd->refs && nd->refs == nrefs[id], "node %u: refs %u, counted %llu", id, nd->refs,
		      (unsigned long long)nrefs[id]);
	}
	CHECK(nnodes == r->node_tab.n, "nodes: %zu by id, %zu by name", nnodes, r->node_tab.n);
done:
	free(gcount);
	free(kcount);
	free(nrefs);
	return rc;
}
