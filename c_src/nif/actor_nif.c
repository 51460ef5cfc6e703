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
 *
 * Where the parts are (actor_nif_int.h has what they share):
 *   actor_nif.c          mappings (attach, detach, retirement), info, load,
 *                        remove_segment
 *   actor_nif_lookup.c   lookup/1 and the per-thread caches
 * The rule above (never read a retired mapping, never answer from a stale
 * cache entry) spans both: retire() leaves zero pages where a reader may
 * still be, and lookup/1 answers only from a mapping still current after
 * its reads. The segment's format is ap_shm.h's.
 */
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

#include "actor_nif_int.h"
#include "ap_shm.h"

#define RETIRE_KEEP 64u           /* retired regions always kept mapped (as zero pages) */
#define RETIRE_AGE_MS 1000u       /* ... and any retired this recently, */
#define RETIRE_MAX 1024u          /* ... up to this many */

_Atomic(struct mapping *) g_cur;
static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER; /* attach/detach, the lists below, g_refs */
static struct mapping *g_retired, *g_retired_tail;
static struct mapping *g_oldest_region;  /* the oldest retired mapping that still has its region */
static unsigned g_regions;               /* retired mappings that still have their region */
static _Atomic uint64_t g_retired_total;
static uint64_t g_next_id;
static int g_refs;                       /* load + upgrades - unloads of this image */

_Atomic uint64_t g_instance;

#define NIF_ATOM_DEF(name) ERL_NIF_TERM a_##name;
NIF_ATOMS(NIF_ATOM_DEF)
#undef NIF_ATOM_DEF

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
#define ATOM(name) a_##name = enif_make_atom(env, #name);
	NIF_ATOMS(ATOM)
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
