/* registry_int: the registry's structures and the calls its parts make
 * into each other (registry.c says which part is where). Internal to the
 * registry: registry.h is its interface.
 */
#ifndef REGISTRY_INT_H
#define REGISTRY_INT_H

#include "ap_siphash.h"
#include "ptab.h"
#include "registry.h"

#include <stdlib.h>
#include <string.h>

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

struct rgroup {
	uint64_t hash;
	uint32_t id, origin, node;
	uint32_t oprev, onext; /* its origin's other groups (ids; NO_GROUP ends) */
	uint32_t draining; /* its key set is being walked: leave it alone */
	uint64_t nrefs;
	ptab kset; /* the keys holding its refs (rkey*), each with their count of them (v) */
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

static inline void *rmalloc(registry *r, size_t n)
{
	void *p = malloc(n);
	if (p)
		r->mem += n;
	return p;
}

static inline void *rcalloc(registry *r, size_t n, size_t size)
{
	void *p = calloc(n, size);
	if (p)
		r->mem += n * size;
	return p;
}

static inline void rfree(registry *r, void *p, size_t n)
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

/* The encoded size of a list of n pids of vsize bytes. */
static inline size_t list_size(uint32_t n, size_t vsize) { return n ? 5 + vsize + 1 : 1; }

/* ---- the parts' calls ----------------------------------------------------------- */

/* registry_tables.c: nodes, groups and origins, key sets, a key's refs,
 * keys. */
int node_get(registry *r, const char *name, int create);
void node_gc(registry *r, uint32_t id);
void node_unref(registry *r, uint32_t id);
struct rorig *orig_find(const registry *r, uint32_t origin);
struct rgroup *group_get(registry *r, uint32_t origin, uint32_t node, int create);
void group_gc(registry *r, struct rgroup *g);
struct pslot *kset_find(const registry *r, const struct rgroup *g, const struct rkey *k);
void kset_inc(registry *r, struct rgroup *g, struct rkey *k);
void kset_dec(registry *r, struct rgroup *g, struct rkey *k);
void rset_insert(const registry *r, struct rkey *k, uint32_t pos);
long ref_find(const registry *r, struct rkey *k, uint32_t nid, const erlang_pid *p);
int refs_resize(registry *r, struct rkey *k, uint32_t cap);
void rset_remove(const registry *r, struct rkey *k, uint32_t pos);
void refs_settle(registry *r, struct rkey *k, int reindex);
void unref(registry *r, struct rkey *k, const struct rref *x);
struct rkey *key_find(const registry *r, const void *key, size_t klen, uint64_t h);
struct rkey *key_new(registry *r, const void *key, size_t klen, uint64_t h);
void key_gc(registry *r, struct rkey *k);

/* registry_report.c: values and listings, and the reports of changes. */
int scratch_reserve(registry *r, size_t list);
int encode_value(registry *r, struct rkey *k, const uint8_t **val, size_t *vlen);
void encode_head(registry *r, const void *key, size_t klen, size_t vlen, const uint8_t **msg, size_t *mlen);
void send_to(registry *r, const struct rsub *s, const struct rkey *k, const uint8_t *msg, size_t mlen);
void pre_change(registry *r, struct rkey *k);
void changed(registry *r, struct rkey *k);

/* registry.c */
struct rsubn *subn_find(const registry *r, const struct rkey *k, const struct rsub *s);

#endif
