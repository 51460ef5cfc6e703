/* actor_nif: the BEAM's reader of the receptionist's shared-memory snapshot
 * (c_src/shm/ap_shm.h). lookup/1 answers a key's listing, a list of pids,
 * without a message round trip to the receptionist.
 *
 * This code runs inside the VM, where a fault kills the node, so:
 *
 * - The segment is untrusted. Only the reader API touches it, which checks
 *   every offset and bounds every probe and retry; values are copied into
 *   private memory before they are decoded, decoded with
 *   ERL_NIF_BIN2TERM_SAFE (no new atoms), and must be a proper list of pids.
 *
 * - The mapping is replaced (attach/detach) while other schedulers may be
 *   reading it. The current mapping is an atomic pointer, swapped under a
 *   mutex and loaded by readers with acquire. A replaced mapping is never
 *   munmapped right away: its pages are replaced in place by private zero
 *   pages (mmap MAP_FIXED|MAP_ANONYMOUS, one step for the MMU), which frees
 *   the old segment's memory while a reader still inside it reads zeros
 *   instead of faulting. Zeros fail the reader API's checks (or find
 *   nothing); and a reader redoes its lookup whenever the current pointer
 *   changed under it, so a lookup never answers from a retired mapping.
 *   Retired structs are never freed (while the library is loaded). The
 *   oldest zeroed region is munmapped only once more than RETIRE_KEEP
 *   newer ones exist and it was retired RETIRE_AGE_MS ago, or once more
 *   than RETIRE_MAX exist (a bound on address space and VMAs): never
 *   earlier than the plain "more than RETIRE_KEEP" rule. Residual risk: a
 *   reader stalled between loading the pointer and its last access to the
 *   region (a NIF call is not preempted by the VM, only by the OS) for a
 *   second and RETIRE_KEEP re-attaches, or for RETIRE_MAX re-attaches,
 *   faults (or reads whatever got mapped there since). Re-attaches follow
 *   receptionist restarts, seconds apart at the very least.
 *
 * - Bounded work: lookups of values up to NORMAL_MAX bytes run on the
 *   calling (normal) scheduler; larger ones reschedule to a dirty CPU
 *   scheduler; values over AP_SHM_MAX_VAL are refused. attach/detach run on
 *   dirty I/O schedulers (shm_open, mmap, munmap).
 *
 * - Speed: decoding a pid costs atom- and node-table lookups (a 10-pid
 *   listing takes ~3 us to decode), so each normal scheduler thread keeps
 *   recently decoded values in a direct-mapped cache keyed by (mapping,
 *   gen, entry offset): by the header's contract those name immutable
 *   bytes while gen is unchanged, and ap_shm_find confirms gen after its
 *   probe, so a hit reads no value bytes. Local pids are cached as
 *   ErlNifPid and a hit builds the list in one heap allocation; lists with
 *   remote pids are cached as a term and copied out.
 *
 *   In front of that, a second direct-mapped cache keyed by the key bytes
 *   (keys up to KEY_MAX bytes) skips ap_shm_find as well: an entry holds
 *   the mapping, the segment's `changes` label it was found under, and the
 *   (gen, off) of its value in the first cache (or "not found"). A hit
 *   reads two words of the header (ap_shm_changes: `changes` and the
 *   state) and no other shared byte; see lookup_in for why it is never
 *   older than a registration already acknowledged.
 */
/* Over 700 lines on purpose: the mapping's replacement, its retirement and
 * the two per-scheduler caches above share one rule (never read a retired
 * mapping, never answer from a stale cache entry); kept in one file so that
 * rule is checked in one place. The segment's format is ap_shm.h's. */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <erl_nif.h>

#include "ap_shm.h"

#define NORMAL_MAX (64u << 10)    /* larger values are copied and decoded on a dirty scheduler */
#define CACHE_MAX (16u << 10)     /* larger values are not cached (memory per thread) */
#define CACHE_SLOTS 256u          /* per scheduler thread, direct-mapped */
#define KEY_SLOTS 256u            /* the key cache, per scheduler thread, direct-mapped */
#define KEY_MAX 64u               /* longer keys skip the key cache */
#define LOCAL_MAX 256u            /* most local pids kept as ErlNifPid in a slot */
#define RETIRE_KEEP 64u           /* retired regions always kept mapped (as zero pages) */
#define RETIRE_AGE_MS 1000u       /* ... and any retired this recently, */
#define RETIRE_MAX 1024u          /* ... up to this many */
#define SWITCH_TRIES 4            /* lookups redone because the mapping changed under them */
#define NAME_MAX_LEN 255u

struct mapping {
	const unsigned char *base;
	size_t len;
	uint64_t id;             /* never reused while the library is loaded; 0 is no mapping */
	struct mapping *next;    /* the retired list, oldest first */
	int has_region;          /* base..len still mapped by us (shared, or zero pages once retired) */
	uint64_t retired_ms;     /* CLOCK_MONOTONIC */
	size_t path_len, node_len;
	char path[NAME_MAX_LEN + 1];
	char node[sizeof ((struct ap_shm_hdr *)0)->node];
};

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

static _Atomic(struct mapping *) g_cur;
static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER; /* attach/detach, the lists below, g_refs */
static struct mapping *g_retired, *g_retired_tail;
static struct mapping *g_oldest_region;  /* the oldest retired mapping that still has its region */
static unsigned g_regions;               /* retired mappings that still have their region */
static _Atomic uint64_t g_retired_total;
static uint64_t g_next_id;
static int g_refs;                       /* load + upgrades - unloads of this image */

static pthread_mutex_t g_cache_mu = PTHREAD_MUTEX_INITIALIZER;
static struct tcache *g_caches;
static _Atomic uint64_t g_instance;
static _Thread_local struct tlocal tl;

static ERL_NIF_TERM a_ok, a_error, a_true, a_false, a_unmapped, a_stale, a_busy,
	a_bad_segment, a_too_big, a_enoent, a_eacces, a_wrong_node, a_too_small, a_errno, a_enomem,
	a_mapped, a_path, a_node, a_gen, a_state, a_live, a_closed, a_unknown, a_writer_pid,
	a_incarnation, a_heartbeat_ms, a_retired, a_not_ours, a_not_a_snapshot, a_replaced;

static ERL_NIF_TERM error_tuple(ErlNifEnv *env, ERL_NIF_TERM reason)
{
	return enif_make_tuple2(env, a_error, reason);
}

static ERL_NIF_TERM errno_error(ErlNifEnv *env, int e)
{
	if (e == ENOENT)
		return error_tuple(env, a_enoent);
	if (e == EACCES || e == EPERM)
		return error_tuple(env, a_eacces);
	return error_tuple(env, enif_make_tuple2(env, a_errno, enif_make_int(env, e)));
}

static uint64_t load64(const void *p)
{
	return __atomic_load_n((const uint64_t *)p, __ATOMIC_ACQUIRE);
}

static uint32_t load32(const void *p)
{
	return __atomic_load_n((const uint32_t *)p, __ATOMIC_ACQUIRE);
}

/* ---- mappings ------------------------------------------------------------ */

static uint64_t now_ms(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

/* Caller holds g_mu. */
static void retire(struct mapping *m)
{
	uint64_t now = now_ms();

	/* Zero pages over the shared ones, in one step. If this fails early
	 * (the usual case: no VMA could be allocated) the shared pages stay
	 * and readers still see the old segment. Linux may also fail after it
	 * removed the old pages, leaving a hole a reader in flight would fault
	 * on: nothing in this API can undo that. Either way the range is never
	 * munmapped by us (something else may get mapped there). */
	void *p = mmap((void *)m->base, m->len, PROT_READ, MAP_FIXED | MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);

	if (p == MAP_FAILED)
		m->has_region = 0;
	else
		g_regions++;
	m->retired_ms = now;
	m->next = NULL;
	if (g_retired_tail)
		g_retired_tail->next = m;
	else
		g_retired = m;
	g_retired_tail = m;
	if (!g_oldest_region)
		g_oldest_region = m;
	atomic_fetch_add_explicit(&g_retired_total, 1, memory_order_relaxed);
	for (;;) {
		struct mapping *o = g_oldest_region;

		while (o && !o->has_region)
			o = o->next;
		g_oldest_region = o;
		if (!o || !(g_regions > RETIRE_MAX ||
			    (g_regions > RETIRE_KEEP && now - o->retired_ms >= RETIRE_AGE_MS)))
			break;
		munmap((void *)o->base, o->len);
		o->has_region = 0;
		g_regions--;
	}
}

/* Caller holds g_mu. */
static void replace_mapping(struct mapping *m)
{
	struct mapping *old = atomic_exchange_explicit(&g_cur, m, memory_order_acq_rel);
	if (old)
		retire(old);
}

static int valid_name(const ErlNifBinary *b)
{
	return b->size > 0 && b->size <= NAME_MAX_LEN && !memchr(b->data, 0, b->size);
}

/* attach(ShmName, Node): maps the segment read-only and makes it current. */
static ERL_NIF_TERM nif_attach(ErlNifEnv *env, int argc, const ERL_NIF_TERM argv[])
{
	ErlNifBinary name, node;
	struct mapping *m;
	struct stat st;
	char hnode[sizeof m->node];
	void *base;
	size_t len, hlen;
	int fd, rc, e;
	ERL_NIF_TERM err;

	(void)argc;
	if (!enif_inspect_binary(env, argv[0], &name) || !enif_inspect_binary(env, argv[1], &node) ||
	    !valid_name(&name) || !valid_name(&node))
		return enif_make_badarg(env);
	m = enif_alloc(sizeof *m);
	if (!m)
		return enif_raise_exception(env, a_enomem);
	memset(m, 0, sizeof *m);
	memcpy(m->path, name.data, name.size);
	m->path_len = name.size;

	/* O_NONBLOCK: a FIFO planted under the name must not hold a dirty
	 * scheduler (it is then refused as not a regular file). */
	fd = shm_open(m->path, O_RDONLY | O_NONBLOCK | O_CLOEXEC, 0);
	if (fd < 0) {
		err = errno_error(env, errno);
		goto fail;
	}
	if (fstat(fd, &st) < 0) {
		err = errno_error(env, errno);
		close(fd);
		goto fail;
	}
	/* Reading a page past the end of a truncated object raises SIGBUS,
	 * which kills the VM: accept only an object no other user can write
	 * or truncate (the writer creates it 0600, as our user). */
	if (!S_ISREG(st.st_mode) || st.st_uid != geteuid() || (st.st_mode & (S_IWGRP | S_IWOTH))) {
		close(fd);
		err = error_tuple(env, a_eacces);
		goto fail;
	}
	if (st.st_size < (off_t)AP_SHM_HDR_SIZE) {
		close(fd);
		err = error_tuple(env, a_too_small);
		goto fail;
	}
	len = (size_t)st.st_size;
	base = mmap(NULL, len, PROT_READ, MAP_SHARED, fd, 0);
	e = errno;
	close(fd);
	if (base == MAP_FAILED) {
		err = errno_error(env, e);
		goto fail;
	}

	/* STALE (or CLOSED) is fine: lookups answer stale until it is LIVE. */
	rc = ap_shm_check(base, len);
	if (rc != AP_SHM_OK && rc != AP_SHM_ESTALE) {
		err = error_tuple(env, rc == AP_SHM_EBUSY ? a_busy : a_bad_segment);
		goto fail_unmap;
	}
	/* Copy before looking: the writer (or anyone) may change it. */
	memcpy(hnode, ((const struct ap_shm_hdr *)base)->node, sizeof hnode);
	hlen = strnlen(hnode, sizeof hnode);
	if (hlen == sizeof hnode) {
		err = error_tuple(env, a_bad_segment);
		goto fail_unmap;
	}
	if (hlen != node.size || memcmp(hnode, node.data, hlen)) {
		err = error_tuple(env, a_wrong_node);
		goto fail_unmap;
	}
	memcpy(m->node, hnode, hlen + 1);
	m->node_len = hlen;
	m->base = base;
	m->len = len;
	m->has_region = 1;

	pthread_mutex_lock(&g_mu);
	m->id = ++g_next_id;
	replace_mapping(m);
	pthread_mutex_unlock(&g_mu);
	return a_ok;

fail_unmap:
	munmap(base, len);
fail:
	enif_free(m);
	return err;
}

static ERL_NIF_TERM nif_detach(ErlNifEnv *env, int argc, const ERL_NIF_TERM argv[])
{
	(void)env;
	(void)argc;
	(void)argv;
	pthread_mutex_lock(&g_mu);
	replace_mapping(NULL);
	pthread_mutex_unlock(&g_mu);
	return a_ok;
}

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

static void free_caches(void)
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

static ERL_NIF_TERM nif_lookup(ErlNifEnv *env, int argc, const ERL_NIF_TERM argv[])
{
	(void)argc;
	return lookup(env, argv, 0);
}

static ERL_NIF_TERM nif_lookup_dirty(ErlNifEnv *env, int argc, const ERL_NIF_TERM argv[])
{
	(void)argc;
	return lookup(env, argv, 1);
}

/* ---- info ---------------------------------------------------------------- */

static ERL_NIF_TERM make_bin(ErlNifEnv *env, const char *p, size_t n)
{
	ERL_NIF_TERM t;

	memcpy(enif_make_new_binary(env, n, &t), p, n);
	return t;
}

static ERL_NIF_TERM nif_info(ErlNifEnv *env, int argc, const ERL_NIF_TERM argv[])
{
	struct mapping *m = atomic_load_explicit(&g_cur, memory_order_acquire);
	ERL_NIF_TERM k[10], v[10], map;
	unsigned n = 0;

	(void)argc;
	(void)argv;
	k[n] = a_mapped;
	v[n++] = m ? a_true : a_false;
	k[n] = a_retired;
	v[n++] = enif_make_uint64(env, atomic_load_explicit(&g_retired_total, memory_order_relaxed));
	if (m) {
		/* Live header fields; zeros if m is being retired right now. */
		const struct ap_shm_hdr *h = (const void *)m->base;
		ERL_NIF_TERM st;

		switch (load32(&h->state)) {
		case AP_SHM_STATE_LIVE:
			st = a_live;
			break;
		case AP_SHM_STATE_STALE:
			st = a_stale;
			break;
		case AP_SHM_STATE_CLOSED:
			st = a_closed;
			break;
		default:
			st = a_unknown;
		}
		k[n] = a_path;
		v[n++] = make_bin(env, m->path, m->path_len);
		k[n] = a_node;
		v[n++] = make_bin(env, m->node, m->node_len);
		k[n] = a_gen;
		v[n++] = enif_make_uint64(env, load64(&h->gen));
		k[n] = a_state;
		v[n++] = st;
		k[n] = a_writer_pid;
		v[n++] = enif_make_uint64(env, load64(&h->writer_pid));
		k[n] = a_incarnation;
		v[n++] = enif_make_uint64(env, load64(&h->incarnation));
		k[n] = a_heartbeat_ms;
		v[n++] = enif_make_uint64(env, load64(&h->heartbeat_ms));
	}
	if (!enif_make_map_from_arrays(env, k, v, n, &map))
		return enif_make_badarg(env); /* cannot happen: the keys are distinct */
	return map;
}

static ERL_NIF_TERM nif_loaded(ErlNifEnv *env, int argc, const ERL_NIF_TERM argv[])
{
	(void)env;
	(void)argc;
	(void)argv;
	return a_true;
}

/* ---- load, upgrade, unload ----------------------------------------------- */

static void make_atoms(ErlNifEnv *env)
{
#define ATOM(name) a_##name = enif_make_atom(env, #name)
	ATOM(ok);
	ATOM(error);
	ATOM(true);
	ATOM(false);
	ATOM(unmapped);
	ATOM(stale);
	ATOM(busy);
	ATOM(bad_segment);
	ATOM(too_big);
	ATOM(enoent);
	ATOM(eacces);
	ATOM(wrong_node);
	ATOM(too_small);
	ATOM(errno);
	ATOM(enomem);
	ATOM(not_ours);
	ATOM(not_a_snapshot);
	ATOM(replaced);
	ATOM(mapped);
	ATOM(path);
	ATOM(node);
	ATOM(gen);
	ATOM(state);
	ATOM(live);
	ATOM(closed);
	ATOM(unknown);
	ATOM(writer_pid);
	ATOM(incarnation);
	ATOM(heartbeat_ms);
	ATOM(retired);
#undef ATOM
}

/* Reloading the same file (an upgrade of the module) may return the same
 * dlopen handle, and so these very statics: count the instances of the
 * module using this image and free the state with the last one. */
static int load(ErlNifEnv *env, void **priv, ERL_NIF_TERM info)
{
	struct timespec ts;
	uint64_t inst, old;

	(void)priv;
	(void)info;
	make_atoms(env);
	pthread_mutex_lock(&g_mu);
	if (g_refs++ == 0) {
		clock_gettime(CLOCK_MONOTONIC, &ts);
		inst = (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
		old = atomic_load(&g_instance);
		atomic_store(&g_instance, inst > old ? inst : old + 1);
	}
	pthread_mutex_unlock(&g_mu);
	return 0;
}

/* remove_segment(ShmName): unlink the segment of a writer that is gone,
 * by the rule every party follows (ap_shm.h, "Writers that are gone"):
 * under LOCK_EX on the object opened without following a symlink or
 * blocking on a FIFO, and only if the name still names it. */
static ERL_NIF_TERM nif_remove_segment(ErlNifEnv *env, int argc, const ERL_NIF_TERM argv[])
{
	ErlNifBinary name;
	char path[NAME_MAX_LEN + 1];
	int rc;

	(void)argc;
	if (!enif_inspect_binary(env, argv[0], &name) || !valid_name(&name) || name.size < 2 ||
	    name.data[0] != '/' || memchr(name.data + 1, '/', name.size - 1))
		return enif_make_badarg(env);
	memcpy(path, name.data, name.size);
	path[name.size] = 0;
	rc = ap_shm_remove(AP_SHM_DIR, path + 1, NULL);
	switch (rc) {
	case 0:
		return a_ok;
	case -ENOENT:
		return error_tuple(env, a_enoent);
	case -EBUSY:
		return error_tuple(env, a_live);
	case -EPERM:
		return error_tuple(env, a_not_ours);
	case -EPROTO:
		return error_tuple(env, a_not_a_snapshot);
	case -ESTALE:
		return error_tuple(env, a_replaced);
	default:
		return error_tuple(env, enif_make_tuple2(env, a_errno, enif_make_int(env, -rc)));
	}
}

static int upgrade(ErlNifEnv *env, void **priv, void **old_priv, ERL_NIF_TERM info)
{
	(void)old_priv;
	return load(env, priv, info);
}

/* No NIF of this image runs any more: the module's code is being purged. */
static void unload(ErlNifEnv *env, void *priv)
{
	struct mapping *m, *next;

	(void)env;
	(void)priv;
	pthread_mutex_lock(&g_mu);
	if (--g_refs > 0) {
		pthread_mutex_unlock(&g_mu);
		return;
	}
	m = atomic_exchange(&g_cur, NULL);
	if (m) {
		munmap((void *)m->base, m->len);
		enif_free(m);
	}
	for (m = g_retired; m; m = next) {
		next = m->next;
		if (m->has_region)
			munmap((void *)m->base, m->len);
		enif_free(m);
	}
	g_retired = g_retired_tail = g_oldest_region = NULL;
	g_regions = 0;
	pthread_mutex_unlock(&g_mu);
	free_caches();
}

static ErlNifFunc funcs[] = {
	{"attach", 2, nif_attach, ERL_NIF_DIRTY_JOB_IO_BOUND},
	{"detach", 0, nif_detach, ERL_NIF_DIRTY_JOB_IO_BOUND},
	{"lookup", 1, nif_lookup, 0},
	{"info", 0, nif_info, 0},
	{"loaded", 0, nif_loaded, 0},
	{"remove_segment", 1, nif_remove_segment, ERL_NIF_DIRTY_JOB_IO_BOUND},
};

ERL_NIF_INIT(actor_nif, funcs, load, NULL, upgrade, unload)
