/* actor_dp: the BEAM's end of the same-host data plane (issue 13). One
 * segment (a resource) per (BEAM, pool node) pair: request rings that
 * submit/6 writes, reply rings that a thread of this library drains and
 * delivers with enif_send. The layout, doorbells, attach handshake and
 * record formats are c_src/ring/ap_seg.h's; parsing and the handshake are
 * in dp_core.c (no erl_nif, tested and fuzzed alone).
 *
 * This code runs inside the VM, where a fault kills the node, so:
 *
 * - The segment is hostile: the pool node (or anything with its uid that
 *   maps the memfd) may write any bytes at any time. The BEAM creates the
 *   segment (a sealed memfd: nobody can shrink it under our mapping), reads
 *   its own geometry from its own arguments, never from shared memory, and
 *   reads the peer's indexes and records only through ap_ring (every index
 *   and length read once and checked; a failed check breaks the ring).
 *   Replies are copied out before they are parsed (dp_drain). A broken
 *   ring or a bad header closes the segment with reason bad_segment.
 *
 * - Bounded work: a submit tries each request ring's lock once; the reply
 *   thread drains at most DP_DRAIN_BATCH records per ring per pass and
 *   waits with a timeout, so it notices the peer's EOF (a socket poll) and
 *   a close within DP_WAIT_MS.
 *
 * - Exactly one answer per ask. An ask is registered (id -> pid, ref)
 *   under `mu` before its record is published. A reply is delivered only
 *   by whoever takes its entry out of the table under `mu`; cancel and
 *   close take entries out under the same lock. So a cancelled ask never
 *   gets a message (cancel -> true), and once cancel answers false the
 *   message is already in the asker's queue (a flush after 0 finds it):
 *   a ring's drainer sends outside the lock, and cancel waits while that
 *   ring's `delivering` names the ask (deliver, deliver_here). close
 *   answers every pending ask at once with {Ref, {error, R}}.
 *
 * - Lifetime. The resource is kept alive by one reference of its own
 *   (`keep`) while it is open; close/2 or the exit of the owner process
 *   (a monitor) drops it. The reply thread never drops a reference, so the
 *   destructor never runs on it; the destructor stops and joins the thread
 *   (it has already exited, or exits within one wait) and then unmaps.
 *
 * Where the parts are (actor_dp_int.h has what they share):
 *   actor_dp.c    the library: load, the resource, open, close, cancel, info
 *   dp_asks.c     the ask table, round trips, the close of a segment, timeouts
 *   dp_submit.c   records into the request rings, tickets, marks
 *   dp_reply.c    the reply rings' drains, an answer's delivery, the reply thread
 *   dp_await.c    answers taken on schedulers: await/2, the deliverer processes
 *   dp_core.c     what needs no erl_nif (parsing, validation, attach), tested
 *                 and fuzzed alone
 * The exactly-one-answer rule holds across them: an ask leaves the table
 * only under `mu` (ask_take and the walks of dp_shut and expire_asks), and
 * only whoever took it answers. */
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include <erl_nif.h>

#include "actor_dp_int.h"
#include "ap_time.h"

#define DP_ATOM_DEF(name) ERL_NIF_TERM a_##name;
DP_ATOMS(DP_ATOM_DEF)
#undef DP_ATOM_DEF
ERL_NIF_TERM a_ext;

ErlNifResourceType *g_dp_type, *g_hist_type;
/* Segments spread over the deliverers: rings i go to deliverer
 * (dlv_base + i) % count. */
static atomic_uint g_dlv_next_base;

/* ---- helpers ------------------------------------------------------------------ */

static ERL_NIF_TERM err_atom(int e)
{
	switch (e) {
	case ECONNREFUSED:
		return a_econnrefused;
	case ENOENT:
		return a_enoent;
	case ETIMEDOUT:
		return a_etimedout;
	case EPERM:
	case EACCES:
		return a_eperm;
	case EPROTO:
		return a_eproto;
	case ECONNRESET:
	case EPIPE:
		return a_econnreset;
	case ENOMEM:
	case ENOSPC:
		return a_enomem;
	case EINVAL:
		return a_einval;
	case EMFILE:
	case ENFILE:
		return a_emfile;
	default:
		return 0;
	}
}

static ERL_NIF_TERM errno_term(ErlNifEnv *env, int e)
{
	ERL_NIF_TERM a = err_atom(e);

	return a ? a : enif_make_tuple2(env, a_errno, enif_make_int(env, e));
}

static uint64_t req_count(struct dp *s, int which)
{
	uint64_t t = 0;

	for (uint32_t i = 0; s->req && i < s->seg.n_req; i++)
		t += atomic_load_explicit(&s->req[i].n[which], memory_order_relaxed);
	return t;
}

static int mu_init(pthread_mutex_t *mu)
{
	pthread_mutexattr_t at;
	int ok;

	if (pthread_mutexattr_init(&at))
		return 0;
	ok = !pthread_mutexattr_settype(&at, PTHREAD_MUTEX_ADAPTIVE_NP) && !pthread_mutex_init(mu, &at);
	pthread_mutexattr_destroy(&at);
	return ok;
}

/* ---- resource ------------------------------------------------------------------- */

static void dp_dtor(ErlNifEnv *env, void *obj)
{
	struct dp *s = obj;

	(void)env;
	atomic_store(&s->stop, 1);
	if (s->thread_started) {
		ap_seg_kick(s->seg.hdr, AP_SEG_BELL_REP);
		enif_thread_join(s->tid, NULL);
	}
	if (s->seg.hdr && !atomic_load(&s->closed))
		ap_seg_close(s->seg.hdr, AP_SEG_CLOSED_BEAM);
	if (s->sock >= 0)
		close(s->sock);
	if (s->bell_fd >= 0)
		close(s->bell_fd);
	free(atomic_load(&s->new_atoms));
	if (s->tab) {
		for (uint32_t i = 0; i <= s->tab_mask; i++) {
			struct ask *a, *next;
			for (a = s->tab[i]; a; a = next) {
				next = a->next;
				ask_destroy(a);
			}
		}
		enif_free(s->tab);
	}
	while (s->spare) {
		struct ask *a = s->spare;
		s->spare = a->next;
		ask_destroy(a);
	}
	if (s->map.mem)
		ap_ring_map_close(&s->map);
	enif_free(s->req);
	enif_free(s->rep);
	enif_free(s->seen);
	if (s->rs) {
		for (uint32_t i = 0; i < s->n_rs; i++) {
			/* None left by a drain (it frees its last): a guard. */
			if (s->rs[i].sent)
				ask_destroy(s->rs[i].sent);
			enif_free(s->rs[i].buf);
			if (s->rs[i].env)
				enif_free_env(s->rs[i].env);
		}
		enif_free(s->rs);
	}
	if (s->tenv)
		enif_free_env(s->tenv);
	if (s->penv)
		enif_free_env(s->penv);
	for (uint32_t i = 0; i < s->n_hists; i++)
		enif_release_resource(s->hists[i]);
	enif_free(s->hists);
	if (s->mu_ok)
		pthread_mutex_destroy(&s->mu);
}

/* The owner exited: nobody will close the segment, so close it now. */
static void dp_owner_down(ErlNifEnv *env, void *obj, ErlNifPid *pid, ErlNifMonitor *mon)
{
	struct dp *s = obj;

	(void)pid;
	(void)mon;
	dp_shut(s, env, a_owner_down, 0);
	dp_unkeep(s);
}

/* ---- open ----------------------------------------------------------------------- */

static int get_u64(ErlNifEnv *env, ERL_NIF_TERM t, uint64_t *v)
{
	ErlNifUInt64 x;

	if (!enif_get_uint64(env, t, &x))
		return 0;
	*v = x;
	return 1;
}

/* open_nif(Socket, Token, NodeName, {NReq, ReqBytes, NRep, RepBytes},
 *          Owner, Node, TimeoutMs, NewAtoms) */
static ERL_NIF_TERM nif_open(ErlNifEnv *env, int argc, const ERL_NIF_TERM argv[])
{
	ErlNifBinary sock_name, token, name;
	const ERL_NIF_TERM *geo;
	int arity, timeout, rc, sock;
	unsigned new_atoms;
	uint64_t n_req, req_cap, n_rep, rep_cap;
	ErlNifPid owner;
	size_t size;
	struct dp *s;
	ERL_NIF_TERM ret;

	(void)argc;
	if (!enif_inspect_binary(env, argv[0], &sock_name) || !enif_inspect_binary(env, argv[1], &token) ||
	    token.size != AP_SEG_TOKEN_LEN || !enif_inspect_binary(env, argv[2], &name) ||
	    !enif_get_tuple(env, argv[3], &arity, &geo) || arity != 4 || !get_u64(env, geo[0], &n_req) ||
	    !get_u64(env, geo[1], &req_cap) || !get_u64(env, geo[2], &n_rep) || !get_u64(env, geo[3], &rep_cap) ||
	    !enif_get_local_pid(env, argv[4], &owner) || !enif_is_atom(env, argv[5]) ||
	    !enif_get_int(env, argv[6], &timeout) || timeout < 0 || n_req > UINT32_MAX || n_rep > UINT32_MAX ||
	    !enif_get_uint(env, argv[7], &new_atoms) || new_atoms < 1 || new_atoms > (1u << 30))
		return enif_make_badarg(env);
	if (dp_geom((uint32_t)n_req, req_cap, (uint32_t)n_rep, rep_cap, &size))
		return error_tuple(env, a_einval);

	s = enif_alloc_resource(g_dp_type, sizeof *s);
	if (!s)
		return error_tuple(env, a_enomem);
	memset(s, 0, sizeof *s);
	s->sock = -1;
	s->bell_fd = -1;
	s->map.fd = -1;
	s->owner = owner;
	s->new_atoms_cap = new_atoms;
	s->mu_ok = mu_init(&s->mu);
	s->tenv = enif_alloc_env();
	s->penv = enif_alloc_env();
	s->tab = enif_alloc(DP_TAB_INIT * sizeof *s->tab);
	s->req = enif_alloc(n_req * sizeof *s->req);
	s->rep = enif_alloc(n_rep * sizeof *s->rep);
	s->seen = enif_alloc(n_rep * sizeof *s->seen);
	s->buf_cap = ap_ring_max_payload(rep_cap) + 1;
	s->rs = enif_alloc(n_rep * sizeof *s->rs);
	if (s->rs) {
		memset(s->rs, 0, n_rep * sizeof *s->rs);
		s->n_rs = (uint32_t)n_rep;
		for (uint32_t i = 0; i < s->n_rs; i++)
			if (!(s->rs[i].buf = enif_alloc(s->buf_cap)) || !(s->rs[i].env = enif_alloc_env()))
				break;
	}
	if (!s->mu_ok || !s->tenv || !s->penv || !s->tab || !s->req || !s->rep || !s->seen || !s->rs ||
	    !s->rs[n_rep - 1].env) {
		ret = error_tuple(env, a_enomem);
		goto out;
	}
	s->dlv_base = atomic_fetch_add(&g_dlv_next_base, 1);
	memset(s->tab, 0, DP_TAB_INIT * sizeof *s->tab);
	memset(s->req, 0, n_req * sizeof *s->req);
	memset(s->seen, 0, n_rep * sizeof *s->seen);
	s->tab_mask = DP_TAB_INIT - 1;
	s->node = enif_make_copy(s->penv, argv[5]);
	atomic_store(&s->next_id, 1);
	atomic_store(&s->next_deadline_ms, INT64_MAX);
	atomic_store(&s->wake_ms, INT64_MAX);

	if ((rc = ap_ring_map_create_memfd(&s->map, "actor_dp", size))) {
		memset(&s->map, 0, sizeof s->map);
		s->map.fd = -1;
		ret = error_tuple(env, errno_term(env, -rc));
		goto out;
	}
	if (ap_seg_format(s->map.mem, s->map.size, (uint32_t)n_req, req_cap, (uint32_t)n_rep, rep_cap) ||
	    ap_seg_parse(&s->seg, s->map.mem, s->map.size)) {
		ret = error_tuple(env, a_einval);
		goto out;
	}
	/* Our views, attached before the peer sees the memory: nothing in
	 * them was written by anyone else yet. */
	for (uint32_t i = 0; i < s->seg.n_req; i++)
		if (ap_ring_attach_producer(&s->req[i].r, ap_seg_req(&s->seg, i), ap_seg_req_size(&s->seg))) {
			ret = error_tuple(env, a_einval);
			goto out;
		}
	for (uint32_t i = 0; i < s->seg.n_rep; i++)
		if (ap_ring_attach_consumer(&s->rep[i], ap_seg_rep(&s->seg, i), ap_seg_rep_size(&s->seg))) {
			ret = error_tuple(env, a_einval);
			goto out;
		}
	rc = dp_attach(sock_name.data, sock_name.size, token.data, name.data, name.size, s->map.fd,
		       dp_now_ms() + timeout, &sock, &s->bell_fd);
	if (rc) {
		ret = rc > 0 ? error_tuple(env, enif_make_tuple2(env, a_refused, errno_term(env, rc)))
			     : error_tuple(env, errno_term(env, -rc));
		goto out;
	}
	s->sock = sock;
	/* The peer has its own fd now; the mapping needs none. */
	close(s->map.fd);
	s->map.fd = -1;
	s->last_poll = dp_now_ms();

	/* The self-reference first: an owner that exits as soon as the monitor
	 * is set closes the segment and drops it (dp_owner_down), which must
	 * find it there, or the segment would stay open with nobody to close
	 * it. */
	enif_keep_resource(s);
	mu_lock(s);
	s->keep = 1;
	mu_unlock(s);
	if (enif_monitor_process(env, s, &owner, NULL)) {
		dp_unkeep(s);
		ret = error_tuple(env, a_noproc);
		goto out;
	}
	if (enif_thread_create("actor_dp_reply", &s->tid, reply_thread, s, NULL)) {
		/* Under the lock, as an owner exiting now would do it too. */
		dp_shut(s, env, a_enomem, 0);
		dp_unkeep(s);
		ret = error_tuple(env, a_enomem);
		goto out;
	}
	s->thread_started = 1;
	ret = enif_make_tuple2(env, a_ok, enif_make_resource(env, s));
out:
	enif_release_resource(s);
	return ret;
}

/* ---- ask round-trip histograms -------------------------------------------------- */

static ERL_NIF_TERM nif_hist_new(ErlNifEnv *env, int argc, const ERL_NIF_TERM argv[])
{
	(void)argc;
	(void)argv;
	struct dp_hist *h = enif_alloc_resource(g_hist_type, sizeof *h);
	if (!h)
		return enif_raise_exception(env, enif_make_atom(env, "enomem"));
	memset(h, 0, sizeof *h);
	ERL_NIF_TERM t = enif_make_resource(env, h);
	enif_release_resource(h);
	return t;
}

static ERL_NIF_TERM nif_hist_add(ErlNifEnv *env, int argc, const ERL_NIF_TERM argv[])
{
	void *h;
	ErlNifUInt64 ns;

	(void)argc;
	if (!enif_get_resource(env, argv[0], g_hist_type, &h) || !enif_get_uint64(env, argv[1], &ns) ||
	    ns > INT64_MAX)
		return enif_make_badarg(env);
	hist_observe(h, (int64_t)ns);
	return a_ok;
}

/* {Counts, SumNs}: per bucket (ap_hist.h's bounds, then one past them),
 * the shards added up. */
static ERL_NIF_TERM nif_hist_read(ErlNifEnv *env, int argc, const ERL_NIF_TERM argv[])
{
	void *p;
	uint64_t sum[AP_HIST_BUCKETS + 1] = { 0 };
	ERL_NIF_TERM c[AP_HIST_BUCKETS];

	(void)argc;
	if (!enif_get_resource(env, argv[0], g_hist_type, &p))
		return enif_make_badarg(env);
	struct dp_hist *h = p;
	for (unsigned k = 0; k < DP_HIST_SHARDS; k++)
		ap_hist_sum_into(sum, &h->shard[k]);
	for (unsigned b = 0; b < AP_HIST_BUCKETS; b++)
		c[b] = enif_make_uint64(env, sum[b]);
	return enif_make_tuple2(env, enif_make_list_from_array(env, c, AP_HIST_BUCKETS),
				enif_make_uint64(env, sum[AP_HIST_BUCKETS]));
}

/* ---- cancel, close, info, scribble ----------------------------------------------- */

static ERL_NIF_TERM nif_cancel(ErlNifEnv *env, int argc, const ERL_NIF_TERM argv[])
{
	struct dp *s;
	ErlNifUInt64 id;
	struct ask *a;

	(void)argc;
	if (!get_dp(env, argv[0], &s) || !enif_get_uint64(env, argv[1], &id))
		return enif_make_badarg(env);
	mu_lock(s);
	a = ask_take(s, id);
	if (a) {
		/* Its caller's own timeout ended it: timed as an answer. */
		ask_observe(a, ap_mono_ns());
		ask_free(s, a);
	}
	mu_unlock(s);
	if (a)
		return a_true;
	/* Taken by a ring's drainer: false once its answer is in our queue
	 * (its send is a decode and an enif_send away; yield the CPU to it,
	 * which on a small host may be ours). */
	for (uint32_t i = 0; i < s->n_rs; i++)
		for (unsigned k = 1; atomic_load_explicit(&s->rs[i].delivering, memory_order_acquire) == id; k++) {
			if (k % 64 == 0)
				sched_yield();
			else
				ap_ring_cpu_relax();
		}
	return a_false;
}


static ERL_NIF_TERM nif_close(ErlNifEnv *env, int argc, const ERL_NIF_TERM argv[])
{
	struct dp *s;

	(void)argc;
	if (!get_dp(env, argv[0], &s))
		return enif_make_badarg(env);
	dp_shut(s, env, argv[1], 0);
	dp_unkeep(s);
	return a_ok;
}

static ERL_NIF_TERM nif_info(ErlNifEnv *env, int argc, const ERL_NIF_TERM argv[])
{
	struct dp *s;
	ERL_NIF_TERM k[26], v[26], map;
	unsigned n = 0;
	uint32_t pending;

	(void)argc;
	if (!get_dp(env, argv[0], &s))
		return enif_make_badarg(env);
	mu_lock(s);
	pending = s->n_asks;
	mu_unlock(s);
#define KV(key, val) (k[n] = (key), v[n++] = (val))
#define C(c) enif_make_uint64(env, atomic_load_explicit(&s->c, memory_order_relaxed))
	KV(a_state, atomic_load(&s->closed) ? a_closed : a_open);
	KV(a_tells, enif_make_uint64(env, req_count(s, RC_TELLS)));
	KV(a_asks, enif_make_uint64(env, req_count(s, RC_ASKS)));
	KV(a_stats, enif_make_uint64(env, req_count(s, RC_STATS)));
	KV(a_replies, C(n_replies));
	KV(a_late, C(n_late));
	KV(a_bad_records, C(n_bad));
	KV(a_full, C(n_full));
	KV(a_too_large, C(n_too_large));
	KV(a_encoded, C(n_encoded));
	KV(a_awaited, C(n_awaited));
	KV(a_await_missed, C(n_await_missed));
	KV(a_passed_on, C(n_passed_on));
	KV(a_sched_delivered, C(n_sched));
	KV(a_timeouts, C(n_timeouts));
	KV(a_unsafe_decodes, C(n_unsafe));
	{
		ap_atomset *set = atomic_load(&s->new_atoms);
		KV(a_new_atoms, enif_make_uint(env, set ? ap_atomset_count(set) : 0));
	}
	KV(a_pending, enif_make_uint(env, pending));
	KV(a_req_rings, enif_make_uint(env, s->seg.n_req));
	KV(a_rep_rings, enif_make_uint(env, s->seg.n_rep));
	KV(a_req_bytes, enif_make_uint64(env, s->seg.req_cap));
	KV(a_rep_bytes, enif_make_uint64(env, s->seg.rep_cap));
	KV(a_size, enif_make_uint64(env, s->map.size));
#undef C
#undef KV
	if (!enif_make_map_from_arrays(env, k, v, n, &map))
		return enif_make_badarg(env);
	return map;
}

/* admit_atoms(Seg, Bin): whether an answer sent as its bytes (a hash map,
 * decoded by its asker) may be decoded with new atoms, as decode_answer
 * lets one; true admits its atoms to the segment's set. */
static ERL_NIF_TERM nif_admit_atoms(ErlNifEnv *env, int argc, const ERL_NIF_TERM argv[])
{
	struct dp *s;
	ErlNifBinary b;

	(void)argc;
	if (!get_dp(env, argv[0], &s) || !enif_inspect_binary(env, argv[1], &b))
		return enif_make_badarg(env);
	if (!admit_atoms(s, env, b.data, b.size))
		return a_false;
	cnt(&s->n_unsafe);
	return a_true;
}

/* A test hook: writes bytes into the live segment, as a hostile or
 * broken pool node could. */
static ERL_NIF_TERM nif_scribble(ErlNifEnv *env, int argc, const ERL_NIF_TERM argv[])
{
	struct dp *s;
	ErlNifUInt64 off;
	ErlNifBinary b;

	(void)argc;
	if (!get_dp(env, argv[0], &s) || !enif_get_uint64(env, argv[1], &off) || !enif_inspect_binary(env, argv[2], &b) ||
	    off > s->map.size || b.size > s->map.size - off)
		return error_tuple(env, a_badarg);
	memcpy((uint8_t *)s->map.mem + off, b.data, b.size);
	return a_ok;
}

static ERL_NIF_TERM nif_loaded(ErlNifEnv *env, int argc, const ERL_NIF_TERM argv[])
{
	(void)env;
	(void)argc;
	(void)argv;
	return a_true;
}

/* ---- load ------------------------------------------------------------------------ */

/* Reply threads run this library's code until their segment's destructor
 * joins them; a taken-over resource type lets ERTS unload an old copy
 * (upgrade, then purge) under them. Pinned: never unmapped. */
static int pin_self(void)
{
	Dl_info di;

	if (!dladdr((void *)&pin_self, &di) || !di.dli_fname)
		return -1;
	return dlopen(di.dli_fname, RTLD_NOW | RTLD_NODELETE) ? 0 : -1;
}

static int load(ErlNifEnv *env, void **priv, ERL_NIF_TERM info)
{
	ErlNifResourceTypeInit init = { .dtor = dp_dtor, .down = dp_owner_down };

	(void)priv;
	(void)info;
	if (pin_self())
		return -1;
	/* Kept across an upgrade, as the library is (pin_self). */
	if (!g_dlv_mu && !(g_dlv_mu = enif_mutex_create("actor_dp_deliverers")))
		return -1;
#define ATOM(name) a_##name = enif_make_atom(env, #name);
	DP_ATOMS(ATOM)
#undef ATOM
	a_ext = enif_make_atom(env, "$actor_dp_ext");
	g_dp_type = enif_open_resource_type_x(env, "actor_dp_seg", &init, ERL_NIF_RT_CREATE | ERL_NIF_RT_TAKEOVER,
					      NULL);
	g_hist_type = enif_open_resource_type(env, NULL, "actor_dp_hist", NULL, ERL_NIF_RT_CREATE | ERL_NIF_RT_TAKEOVER,
					      NULL);
	return g_dp_type && g_hist_type ? 0 : -1;
}

static int upgrade(ErlNifEnv *env, void **priv, void **old_priv, ERL_NIF_TERM info)
{
	(void)old_priv;
	return load(env, priv, info);
}

static ErlNifFunc funcs[] = {
	{"open_nif", 8, nif_open, ERL_NIF_DIRTY_JOB_IO_BOUND},
	/* A walk of up to a reply ring's largest record: not on a scheduler. */
	{"admit_atoms", 2, nif_admit_atoms, ERL_NIF_DIRTY_JOB_CPU_BOUND},
	{"submit", 6, nif_submit, 0},
	{"submit", 7, nif_submit, 0},
	{"submit_encoded", 6, nif_submit_encoded, 0},
	{"await", 2, nif_await, 0},
	{"await", 3, nif_await, 0},
	{"drain", 2, nif_drain, 0},
	{"deliver_for", 2, nif_deliver_for, 0},
	{"cancel", 2, nif_cancel, 0},
	{"mark", 2, nif_mark, 0},
	{"consumed", 2, nif_consumed, 0},
	{"close", 2, nif_close, 0},
	{"info", 1, nif_info, 0},
	{"scribble", 3, nif_scribble, 0},
	{"loaded", 0, nif_loaded, 0},
	{"hist_new", 0, nif_hist_new, 0},
	{"hist_add", 2, nif_hist_add, 0},
	{"hist_read", 1, nif_hist_read, 0},
};

ERL_NIF_INIT(actor_dp, funcs, load, NULL, upgrade, NULL)
