/* actor_nif_lookup: lookup/1 over the current mapping, through the two
 * per-scheduler caches (actor_nif.c says how they stay true). */
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>

#include <erl_nif.h>

#include "actor_nif_int.h"
#include "ap_shm.h"

#define NORMAL_MAX (64u << 10)    /* larger values are copied and decoded on a dirty scheduler */
#define CACHE_MAX (16u << 10)     /* larger values are not cached (memory per thread) */
#define CACHE_SLOTS 256u          /* per scheduler thread, direct-mapped */
#define KEY_SLOTS 256u            /* the key cache, per scheduler thread, direct-mapped */
#define KEY_MAX 64u               /* longer keys skip the key cache */
#define LOCAL_MAX 256u            /* most local pids kept as ErlNifPid in a slot */
#define SWITCH_TRIES 4            /* lookups redone because the mapping changed under them */

/* A cached value. Local pids (the usual listing) are kept as ErlNifPid,
 * which the API lets us keep outside any env: a hit builds the list from
 * them in one allocation. A list with a remote pid is kept as a term in the
 * slot's own env and copied out (enif_make_copy walks it twice). */
struct cslot {
	uint64_t map_id;         /* 0: empty */
	uint64_t gen;
	uint64_t off;
	int local;               /* the value is pids[0..npids) */
	unsigned npids, pcap;
	ErlNifPid *pids;
	ErlNifEnv *env;          /* else: owns term; allocated on first use */
	ERL_NIF_TERM term;
};

/* A key's answer under one `changes` label: [] (found 0), or the value
 * held by slots[slot] while that slot still names (map_id, gen, off). */
struct kslot {
	uint64_t map_id;         /* 0: empty */
	uint64_t label;          /* ap_shm_changes read before the lookup that filled it */
	uint64_t gen;
	uint64_t off;
	uint32_t klen;
	uint16_t slot;           /* in tcache.slots */
	uint16_t found;
	unsigned char key[KEY_MAX];
};

struct tcache {
	struct tcache *next;     /* g_caches */
	unsigned char *buf;      /* private copy of a value, up to NORMAL_MAX */
	size_t cap;
	ErlNifEnv *scratch;      /* decodes land here first */
	struct cslot slots[CACHE_SLOTS];
	struct kslot keys[KEY_SLOTS];
};

/* A thread's cache is used only when inst matches g_instance: after an
 * unload freed the caches, a later load gets a new instance, so a stale
 * thread-local pointer is never followed. */
struct tlocal {
	struct tcache *cache;
	uint64_t inst;
};

static pthread_mutex_t g_cache_mu = PTHREAD_MUTEX_INITIALIZER;
static struct tcache *g_caches;
static _Thread_local struct tlocal tl;

/* ---- the per-thread cache ------------------------------------------------ */

static struct tcache *thread_cache(void)
{
	uint64_t inst = atomic_load_explicit(&g_instance, memory_order_relaxed);
	struct tcache *c;

	if (tl.cache && tl.inst == inst)
		return tl.cache;
	c = enif_alloc(sizeof *c);
	if (!c)
		return NULL;
	memset(c, 0, sizeof *c);
	pthread_mutex_lock(&g_cache_mu);
	c->next = g_caches;
	g_caches = c;
	pthread_mutex_unlock(&g_cache_mu);
	tl.cache = c;
	tl.inst = inst;
	return c;
}

_Static_assert(CACHE_SLOTS == 256, "slot_of takes the top 8 bits");

static unsigned slot_of(uint64_t id, uint64_t gen, uint64_t off)
{
	uint64_t h = ((off >> 3) * 0x9E3779B97F4A7C15ULL) ^ ((gen + (id << 24)) * 0xC2B2AE3D27D4EB4FULL);
	return (unsigned)(h >> 56);
}

_Static_assert(KEY_SLOTS == 256, "key_slot_of takes the top 8 bits");
_Static_assert(CACHE_SLOTS <= 65536, "kslot.slot is 16 bits");

/* Any key up to KEY_MAX bytes, 8 at a time: the bytes only choose a slot,
 * the whole key is compared on a hit. */
static unsigned key_slot_of(const unsigned char *p, size_t n)
{
	uint64_t h = (n + 1) * 0x9E3779B97F4A7C15ULL, w;

	for (; n >= 8; p += 8, n -= 8) {
		memcpy(&w, p, 8);
		h = (h ^ w) * 0xC2B2AE3D27D4EB4FULL;
		h ^= h >> 29;
	}
	if (n) {
		w = 0;
		memcpy(&w, p, n);
		h = (h ^ w) * 0xC2B2AE3D27D4EB4FULL;
	}
	h *= 0x9E3779B97F4A7C15ULL;
	return (unsigned)(h >> 56);
}

/* memcmp(a, b, n) == 0 for n <= KEY_MAX, inline: a call to libc's costs
 * more than comparing the usual few words. */
static int key_eq(const unsigned char *a, const unsigned char *b, size_t n)
{
	uint64_t x, y, d = 0;

	for (; n >= 8; a += 8, b += 8, n -= 8) {
		memcpy(&x, a, 8);
		memcpy(&y, b, 8);
		d |= x ^ y;
	}
	while (n--)
		d |= (uint64_t)(*a++ ^ *b++);
	return !d;
}

/* The thread's copy buffer, at least n (<= NORMAL_MAX) bytes. */
static unsigned char *cache_buf(struct tcache *c, size_t n)
{
	size_t cap = c->cap ? c->cap : 1024;
	unsigned char *b;

	if (n <= c->cap)
		return c->buf;
	while (cap < n)
		cap *= 2;
	b = enif_realloc(c->buf, cap);
	if (!b)
		return NULL;
	c->buf = b;
	c->cap = cap;
	return b;
}

void free_caches(void)
{
	struct tcache *c, *next;
	unsigned i;

	pthread_mutex_lock(&g_cache_mu);
	for (c = g_caches; c; c = next) {
		next = c->next;
		for (i = 0; i < CACHE_SLOTS; i++) {
			if (c->slots[i].env)
				enif_free_env(c->slots[i].env);
			enif_free(c->slots[i].pids);
		}
		if (c->scratch)
			enif_free_env(c->scratch);
		enif_free(c->buf);
		enif_free(c);
	}
	g_caches = NULL;
	pthread_mutex_unlock(&g_cache_mu);
}

/* ---- lookup -------------------------------------------------------------- */

/* A value must be one term, a proper list of pids, and nothing after it.
 * The tag check up front also refuses compressed terms (131, 80): their
 * claimed size would make the decoder allocate and inflate up to 4 GB. */
static int decode_pids(ErlNifEnv *env, const unsigned char *buf, size_t n, ERL_NIF_TERM *out)
{
	ERL_NIF_TERM t, head, tail;

	if (n < 2 || buf[0] != 131 || (buf[1] != 106 && buf[1] != 108))
		return 0;
	if (enif_binary_to_term(env, buf, n, &t, ERL_NIF_BIN2TERM_SAFE) != n)
		return 0;
	tail = t;
	while (enif_get_list_cell(env, tail, &head, &tail))
		if (!enif_is_pid(env, head))
			return 0;
	if (!enif_is_empty_list(env, tail))
		return 0;
	*out = t;
	return 1;
}

/* The thread's scratch env, clear whenever it is not in use. */
static ErlNifEnv *scratch_env(struct tcache *c)
{
	if (!c->scratch)
		c->scratch = enif_alloc_env();
	return c->scratch;
}

/* Moves the decoded list t (in c->scratch) into s; 0 if out of memory. */
static int slot_fill(struct tcache *c, struct cslot *s, ERL_NIF_TERM t)
{
	ErlNifEnv *sc = c->scratch, *old;
	ERL_NIF_TERM head, tail = t;
	unsigned len, n = 0;

	if (enif_get_list_length(sc, t, &len) && len <= LOCAL_MAX) {
		if (s->pcap < len) {
			unsigned cap = (len + 15) & ~15u;
			ErlNifPid *p = enif_realloc(s->pids, cap * sizeof *p);

			if (!p)
				return 0;
			s->pids = p;
			s->pcap = cap;
		}
		while (n < len && enif_get_list_cell(sc, tail, &head, &tail) &&
		       enif_get_local_pid(sc, head, &s->pids[n]))
			n++;
		if (n == len) {
			enif_clear_env(sc);
			if (s->env && !s->local)
				enif_clear_env(s->env);
			s->local = 1;
			s->npids = n;
			return 1;
		}
	}
	/* A remote pid: the scratch env becomes the slot's, and the slot's
	 * old env (cleared) the scratch. */
	old = s->env;
	if (old)
		enif_clear_env(old);
	s->env = sc;
	c->scratch = old;
	s->local = 0;
	s->term = t;
	return 1;
}

/* The cached value, as a term of env. */
static ERL_NIF_TERM slot_term(ErlNifEnv *env, const struct cslot *s)
{
	ERL_NIF_TERM a[LOCAL_MAX];
	unsigned i;

	if (!s->local)
		return enif_make_copy(env, s->term);
	for (i = 0; i < s->npids; i++)
		a[i] = enif_make_pid(env, &s->pids[i]);
	return enif_make_list_from_array(env, a, s->npids);
}

/* Remembers key's answer in m under label: [] when s is NULL, else the
 * value s holds for (gen, off). */
static void key_store(struct kslot *ks, const struct mapping *m, uint64_t label, const ErlNifBinary *key,
		      const struct tcache *c, const struct cslot *s, uint64_t gen, uint64_t off)
{
	if (!ks || label == AP_SHM_NO_CHANGES)
		return;
	ks->map_id = m->id;
	ks->label = label;
	ks->klen = (uint32_t)key->size;
	memcpy(ks->key, key->data, key->size);
	ks->found = s != NULL;
	ks->slot = s ? (uint16_t)(s - c->slots) : 0;
	ks->gen = gen;
	ks->off = off;
}

enum { L_DONE, L_DIRTY, L_RAISED };

/* Looks key up in m. Normal schedulers (dirty == 0) use the thread's caches
 * and copy buffer and hand values over NORMAL_MAX to a dirty scheduler.
 *
 * The key cache answers without ap_shm_find when the segment's `changes`
 * still reads the label an answer was stored under. The label is read
 * BEFORE the lookup that makes the answer, never after, and that is the
 * whole argument (ap_shm.h, "Changes"): the writer counts each put before
 * put returns, and acknowledges a registration only after. So for a put
 * acknowledged before this call, the load of `changes` below returns its
 * count or a later one; if that is the label, the put had been counted
 * when the label was loaded, and the lookup that followed saw its slot
 * (acquire): the answer reflects it. A put racing with that lookup may or
 * may not be in the answer, but it is counted after the label was read,
 * so once it completes the entry can only miss, never answer stale.
 * ap_shm_changes gives no label unless the state is LIVE (and the writer
 * counts state changes too): a STALE or CLOSED segment is never answered
 * from here. The hit reads nothing of the segment but those header words;
 * the value comes from the (gen, off) cache, which owns its bytes. */
static int lookup_in(ErlNifEnv *env, const struct mapping *m, const ErlNifBinary *key, int dirty,
		     ERL_NIF_TERM *out)
{
	struct tcache *c = dirty ? NULL : thread_cache();
	struct kslot *ks = NULL;
	uint64_t label = AP_SHM_NO_CHANGES;
	int i;

	if (c && key->size <= KEY_MAX) {
		label = ap_shm_changes(m->base, m->len);
		ks = &c->keys[key_slot_of(key->data, key->size)];
		if (label != AP_SHM_NO_CHANGES && ks->map_id == m->id && ks->label == label &&
		    ks->klen == key->size && key_eq(ks->key, key->data, key->size)) {
			const struct cslot *s = &c->slots[ks->slot];

			if (!ks->found) {
				*out = enif_make_list(env, 0);
				return L_DONE;
			}
			/* Unless the slot was reused since. */
			if (s->map_id == m->id && s->gen == ks->gen && s->off == ks->off) {
				*out = slot_term(env, s);
				return L_DONE;
			}
		}
	}

	for (i = 0; i < AP_SHM_MAX_RETRIES; i++) {
		uint64_t gen, off;
		uint32_t vlen, n;
		struct cslot *s = NULL;
		unsigned char *buf = NULL, *heap = NULL;
		size_t cap;
		ERL_NIF_TERM t;
		int rc = ap_shm_find(m->base, m->len, key->data, key->size, &gen, &off, &vlen);

		switch (rc) {
		case AP_SHM_OK:
			break;
		case AP_SHM_ENOTFOUND:
			key_store(ks, m, label, key, c, NULL, 0, 0);
			*out = enif_make_list(env, 0);
			return L_DONE;
		case AP_SHM_ESTALE:
			*out = error_tuple(env, a_stale);
			return L_DONE;
		case AP_SHM_EBUSY:
			*out = error_tuple(env, a_busy);
			return L_DONE;
		default:
			*out = error_tuple(env, a_bad_segment);
			return L_DONE;
		}
		if (vlen > AP_SHM_MAX_VAL) {
			*out = error_tuple(env, a_too_big);
			return L_DONE;
		}
		if (!dirty && vlen > NORMAL_MAX)
			return L_DIRTY;
		if (c && vlen <= CACHE_MAX) {
			s = &c->slots[slot_of(m->id, gen, off)];
			if (s->map_id == m->id && s->gen == gen && s->off == off) {
				key_store(ks, m, label, key, c, s, gen, off);
				*out = slot_term(env, s);
				return L_DONE;
			}
		}

		/* Copy out first: the decoder must never see bytes that change. */
		if (c)
			buf = cache_buf(c, vlen);
		if (buf) {
			cap = c->cap;
		} else {
			buf = heap = enif_alloc(vlen ? vlen : 1);
			cap = vlen;
			if (!heap) {
				*out = enif_raise_exception(env, a_enomem);
				return L_RAISED;
			}
		}
		rc = ap_shm_read(m->base, m->len, gen, off, buf, cap, &n);
		if (rc == AP_SHM_EBUSY || rc == AP_SHM_ETOOBIG) {
			/* gen moved on (or the entry changed under it): find again */
			enif_free(heap);
			continue;
		}
		if (rc != AP_SHM_OK) {
			enif_free(heap);
			*out = error_tuple(env, a_bad_segment);
			return L_DONE;
		}

		if (s && scratch_env(c)) {
			ErlNifEnv *sc = c->scratch;

			s->map_id = 0;
			if (!decode_pids(sc, buf, n, &t)) {
				enif_clear_env(sc);
				*out = error_tuple(env, a_bad_segment);
			} else if (!slot_fill(c, s, t)) {
				*out = enif_make_copy(env, t);
				enif_clear_env(sc);
			} else {
				s->gen = gen;
				s->off = off;
				s->map_id = m->id;
				key_store(ks, m, label, key, c, s, gen, off);
				*out = slot_term(env, s);
			}
		} else {
			*out = decode_pids(env, buf, n, &t) ? t : error_tuple(env, a_bad_segment);
		}
		enif_free(heap);
		return L_DONE;
	}
	*out = error_tuple(env, a_busy);
	return L_DONE;
}

static ERL_NIF_TERM nif_lookup_dirty(ErlNifEnv *env, int argc, const ERL_NIF_TERM argv[]);

static ERL_NIF_TERM lookup(ErlNifEnv *env, const ERL_NIF_TERM argv[], int dirty)
{
	ErlNifBinary key;
	ERL_NIF_TERM out;
	int i;

	if (!enif_inspect_binary(env, argv[0], &key) || key.size > AP_SHM_MAX_KEY)
		return enif_make_badarg(env);
	for (i = 0; i < SWITCH_TRIES; i++) {
		struct mapping *m = atomic_load_explicit(&g_cur, memory_order_acquire);

		if (!m)
			return error_tuple(env, a_unmapped);
		switch (lookup_in(env, m, &key, dirty, &out)) {
		case L_DIRTY:
			return enif_schedule_nif(env, "lookup", ERL_NIF_DIRTY_JOB_CPU_BOUND, nif_lookup_dirty,
						 1, argv);
		case L_RAISED:
			return out;
		}
		/* m may have been retired during the reads, which then saw zero
		 * pages: answer only from a mapping still current after them. */
		atomic_thread_fence(memory_order_acquire);
		if (atomic_load_explicit(&g_cur, memory_order_relaxed) == m)
			return out;
	}
	return error_tuple(env, a_busy);
}

ERL_NIF_TERM nif_lookup(ErlNifEnv *env, int argc, const ERL_NIF_TERM argv[])
{
	(void)argc;
	return lookup(env, argv, 0);
}

static ERL_NIF_TERM nif_lookup_dirty(ErlNifEnv *env, int argc, const ERL_NIF_TERM argv[])
{
	(void)argc;
	return lookup(env, argv, 1);
}
