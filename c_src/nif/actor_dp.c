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
 */
/* Over 700 lines on purpose: the ask table, the reply thread, submit, await,
 * cancel and close all keep the exactly-one-answer rule above under one lock
 * (`mu`) and one resource lifetime; the parts that need no erl_nif are
 * already apart (dp_core.c). Split further, that argument would be spread
 * over files that each look safe alone. */
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

#include "ap_atomset.h"
#include "ap_hist.h"
#include "ap_skip.h"
#include "ap_spin.h"
#include "ap_time.h"
#include "ap_term.h"
#include "dp_core.h"

#define DP_WAIT_MS 50      /* the reply thread's longest sleep: EOF and close are seen within it */
#define DP_REPLY_SPIN_MAX_ROUNDS 100u /* at most this many pause rounds before it sleeps (small: 2-core hosts) */
#define DP_REPLY_SPIN_MIN_ROUNDS 8u   /* the adaptive spin's first step up (ap_spin.h) */
#define DP_FREE_ASKS 1024u /* spare ask entries (each with an env) kept for reuse */
#define DP_TAB_INIT 256u
#define DP_AWAIT_NS 150000 /* an ask alone on its segment waits this long for its reply in await/2 */
#define DP_AWAIT_SKIP_MAX 256u /* after misses, at most this many lone asks go without the wait */
#define DP_CROWD_NS 1000000 /* an ask within this of another process's is not alone */
#define DP_AWAIT_MAX_US 1000u /* await/3's longest wait: a NIF should return within about 1 ms */
#define DP_AWAIT_MAX_LEN 65536u /* larger answers are left to the reply thread: no long decode on a scheduler */
#define DP_MAX_DELIVERERS 64u /* deliverer processes (one per scheduler) the NIF knows of */
#define DP_DELIVER_MAX 512  /* answers a deliverer passes on per poke before it yields */
#define DP_HEAP_BUDGET 65536u /* bytes of others' answers a scheduler decodes on its process's heap per call */
/* A ring goes to its deliverer with at least this many bytes of answers
 * waiting (about two 100-byte answers): for one alone the hand-over costs
 * more than the thread's own send (json cell, 64 callers, 10% slower). */
#define DP_POKE_BYTES 300u

struct dp_hist;

struct ask {
	uint64_t id;
	int crowded; /* the ask before it came from another process, lately */
	int64_t deadline_ms; /* dp_now_ms; 0: none (an infinite or caller-kept timeout) */
	/* Where its round trip goes (the tag's histogram, pinned by the
	 * segment; NULL: not measured), and its submit (ap_mono_ns). */
	struct dp_hist *hist;
	int64_t t0;
	ErlNifPid pid;
	ErlNifEnv *env; /* owns ref */
	ERL_NIF_TERM ref;
	struct ask *next;
};

/* What a submit writes lives with its ring, which one scheduler holds at a
 * time: its records counted here by the holder (a load and a store, no
 * locked add) instead of in counters of the segment that every scheduler
 * wrote on every tell (a cache line bounced between them). */
enum { RC_TELLS, RC_ASKS, RC_STATS, RC_N };

struct req_ring {
	struct ap_ring r;
	atomic_int busy; /* the try-lock: one producer at a time */
	atomic_uint_fast64_t n[RC_N]; /* written by the holder of busy only */
	char pad[64];    /* keep neighbours' locks off this line */
};

/* Answers are passed on from schedulers when they can be: the reply thread
 * sends a deliverer process (actor_dp_deliverer, one per scheduler) one
 * {actor_dp_drain, Seg, Ring} per batch, and the deliverer's drain/2
 * sends each answer from its scheduler. Sent by the reply thread, a
 * thread the BEAM does not manage, every answer cost the BEAM's aux thread
 * a wake-up and the allocator of unmanaged threads a lock (see
 * docs/same-host-transport.md). With no deliverer alive (actor_dp used
 * without the application), or for an answer over DP_AWAIT_MAX_LEN, the
 * reply thread delivers itself, as it always did. */
struct rep_side {
	atomic_int lock;
	/* A deliverer was poked and has not begun its drain: the reply
	 * thread neither pokes again nor drains. Since when: a poke nobody
	 * took up within DP_WAIT_MS (its deliverer died with it) is taken
	 * back. */
	atomic_int poked;
	int64_t poked_ms;
	atomic_int big; /* a deliverer left an answer over DP_AWAIT_MAX_LEN: the thread's */
	/* The ask whose answer this ring's drainer is making and sending,
	 * taken out of the table under mu and sent outside it (0: none); a
	 * cancel that missed its entry waits for it to move on. `sent`: that
	 * entry, back to the spare list under the drainer's next hold of mu.
	 * Both are the holder of `lock`'s. */
	atomic_uint_fast64_t delivering;
	struct ask *sent;
	uint8_t *buf;   /* a copy of one record */
	ErlNifEnv *env; /* others' answers past DP_HEAP_BUDGET, passed on from a scheduler */
	char pad[64];   /* the next ring's lock off this line */
};

struct dp {
	struct ap_ring_map map;
	struct ap_seg seg;
	struct req_ring *req;
	struct ap_ring *rep;
	/* The reply rings' consumers, one side per ring (rs[i] for rep[i]):
	 * the reply thread, an asker in await/2 or a deliverer process,
	 * whichever holds the side's try-lock; the view in rep[i] and the
	 * side's buffer and env are theirs while they hold it. seen[i]: the
	 * position the last drain of ring i released, read by anyone (the
	 * shared head is the pool node's to scribble on: a wait must not
	 * trust it). */
	struct rep_side *rs;
	uint32_t n_rs;
	size_t buf_cap;
	unsigned dlv_base; /* rings i go to deliverer (dlv_base + i) % count: segments spread */
	atomic_int awaiting; /* askers in await/2: the reply thread stands aside */
	atomic_int flag_taken; /* an asker in await/2 took the reply thread's sleep flag down */
	uint64_t *seen;
	atomic_uint_fast64_t drains; /* drain passes that delivered (the reply thread's, deliverers') */
	int sock;
	int bell_fd; /* an epoll pool node's bell pipe (ap_seg.h, attach step 4), or -1 */

	/* The asks, closed, keep, free list. An adaptive mutex (it spins a
	 * little before it sleeps): held for a table operation, tens of
	 * nanoseconds, by every submit of an ask and every delivery, it is
	 * contended under many callers, and a sleep and a wake-up on it cost
	 * two syscalls where the wait would have been shorter than either. */
	pthread_mutex_t mu;
	int mu_ok;
	struct ask **tab;
	uint32_t tab_mask;
	uint32_t n_asks;
	struct ask *spare;
	uint32_t n_spare;
	int keep; /* the resource holds a reference to itself */
	struct ap_skip await_skip; /* under mu: lone asks that go without the wait after misses */
	ErlNifPid last_pid; /* under mu: who submitted the last ask, and when */
	int64_t last_ns; /* ap_mono_ns */
	/* The asks' timeouts, kept here rather than by a timer of each asker
	 * (see expire_asks): no deadline is earlier than next_deadline_ms
	 * (written under mu, read by the reply thread without it), and the
	 * reply thread sleeps until wake_ms at the latest. */
	_Atomic int64_t next_deadline_ms;
	_Atomic int64_t wake_ms;

	atomic_int closed;
	atomic_int stop;
	int thread_started;
	ErlNifTid tid;
	ErlNifEnv *tenv; /* the reply thread's message env */
	ErlNifPid owner;
	ErlNifEnv *penv; /* node, the close reason: terms kept for the segment's life */
	ERL_NIF_TERM node;
	ERL_NIF_TERM reason; /* valid once closed */
	int64_t last_poll;

	/* Written per ask by every scheduler (next_id) and per reply by the
	 * reply thread (its counters): each on lines of its own, away from
	 * what every submit reads above. */
	char pad0[64];
	atomic_uint_fast64_t next_id;
	char pad1[64];
	atomic_uint_fast64_t n_replies, n_late, n_bad, n_full, n_too_large, n_awaited, n_await_missed, n_passed_on;
	atomic_uint_fast64_t n_sched; /* answers deliverer processes sent */
	atomic_uint_fast64_t n_encoded; /* records of submit_encoded/6 */
	atomic_uint_fast64_t n_timeouts; /* asks answered {error, timeout} here */
	/* Answers decoded with new atoms allowed (decode_answer): the names
	 * they may make, at most new_atoms_cap, made on the first need. */
	uint32_t new_atoms_cap;
	ap_atomset *_Atomic new_atoms;
	atomic_uint_fast64_t n_unsafe;
	/* Under mu: the histograms asks named (each kept until the segment
	 * goes, so an ask's pointer is good until its answer), the last one
	 * named (most asks name it again: no walk). */
	struct dp_hist **hists;
	uint32_t n_hists, cap_hists;
	struct dp_hist *last_hist;
};

/* ---- ask round trips (actor_pool_latency) ------------------------------------------
 * A histogram (hist_new/0) that asks name in their tag ({Ref, TimeoutMs,
 * Hist}): the segment times each from its submit (the clock read it makes
 * anyway) to its answer, whichever way that goes (a reply delivered, a
 * timeout, a close, a cancel), with one more clock read and two relaxed
 * adds, no lock. Shards, one per thread that adds (round robin): the
 * reply thread and the schedulers' deliverers add at once without
 * sharing a line. hist_add/2 adds a time measured elsewhere (an ask by
 * distribution). */
#define DP_HIST_SHARDS 8
/* Histograms one segment keeps at most (actor_pool_latency keeps fewer
 * pools); past that, asks naming a new one go unmeasured. */
#define DP_MAX_HISTS 4096

struct dp_hist {
	ap_hist shard[DP_HIST_SHARDS];
};

static ErlNifResourceType *g_hist_type;
static _Thread_local int tl_shard = -1;
static atomic_uint g_next_shard;

static void hist_observe(struct dp_hist *h, int64_t ns)
{
	if (tl_shard < 0)
		tl_shard = (int)(atomic_fetch_add(&g_next_shard, 1) % DP_HIST_SHARDS);
	ap_hist_add(&h->shard[tl_shard], ns > 0 ? (uint64_t)ns : 0);
}

/* An ask is answered (now: ap_mono_ns): its round trip, once. */
static void ask_observe(struct ask *a, int64_t now)
{
	if (a->hist) {
		hist_observe(a->hist, now - a->t0);
		a->hist = NULL;
	}
}

static ErlNifResourceType *g_dp_type;
/* The deliverer processes, by index; written by deliver_for/2 (a
 * deliverer's start) and when a send to one fails (it is gone). */
static ErlNifMutex *g_dlv_mu;
static ErlNifPid g_dlv[DP_MAX_DELIVERERS];
static int g_dlv_alive[DP_MAX_DELIVERERS];
static unsigned g_n_dlv;
static atomic_uint g_dlv_next_base;
/* The ring being drained by this thread (drain_ring): deliver_here's env. */
static _Thread_local uint32_t tl_ring;
static atomic_uint g_next_slot;
static _Thread_local unsigned tl_slot; /* 0: none yet; else the thread's slot + 1 */
/* The last pool pid this thread encoded as a destination, and its bytes
 * (without the version byte): a stream of calls to one pool encodes its
 * pid once per scheduler, not per message (an allocation, an encode and a
 * free were 6% of a tell's BEAM CPU). The env lives as long as the
 * thread (a scheduler's: as long as the VM). */
struct pid_enc {
	ErlNifEnv *env;
	ERL_NIF_TERM pid;
	size_t len;
	uint8_t enc[1100]; /* a pid with a node name of 255 UTF-8 characters */
};
static _Thread_local struct pid_enc tl_pid;

static ERL_NIF_TERM a_ok, a_error, a_true, a_false, a_undefined, a_tell, a_ask, a_stats, a_full, a_too_large,
	a_closed, a_bad_reply, a_bad_segment, a_nodedown, a_actor_dp, a_down, a_badarg, a_owner_down, a_open,
	a_state, a_tells, a_asks, a_replies, a_late, a_bad_records, a_pending, a_req_rings, a_rep_rings,
	a_req_bytes, a_rep_bytes, a_size, a_refused, a_errno, a_econnrefused, a_etimedout, a_eperm, a_eproto,
	a_econnreset, a_enomem, a_einval, a_emfile, a_enoent, a_noproc, a_none, a_reply, a_actor_dp_drain, a_sched_delivered, a_awaited, a_await_missed,
	a_await, a_passed_on, a_ext, a_timeout, a_timeouts, a_new_atoms, a_unsafe_decodes;
static ERL_NIF_TERM a_encode, a_encoded;

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

static ERL_NIF_TERM error_tuple(ErlNifEnv *env, ERL_NIF_TERM reason)
{
	return enif_make_tuple2(env, a_error, reason);
}

static int get_dp(ErlNifEnv *env, ERL_NIF_TERM t, struct dp **s)
{
	return enif_get_resource(env, t, g_dp_type, (void **)s);
}

static uint64_t req_count(struct dp *s, int which)
{
	uint64_t t = 0;

	for (uint32_t i = 0; s->req && i < s->seg.n_req; i++)
		t += atomic_load_explicit(&s->req[i].n[which], memory_order_relaxed);
	return t;
}

static void cnt(atomic_uint_fast64_t *c) { atomic_fetch_add_explicit(c, 1, memory_order_relaxed); }

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

static void mu_lock(struct dp *s) { (void)pthread_mutex_lock(&s->mu); }
static void mu_unlock(struct dp *s) { (void)pthread_mutex_unlock(&s->mu); }

/* ---- asks (caller holds mu) --------------------------------------------------- */

static struct ask *ask_new(struct dp *s)
{
	struct ask *a = s->spare;

	if (a) {
		s->spare = a->next;
		s->n_spare--;
		return a;
	}
	a = enif_alloc(sizeof *a);
	if (!a)
		return NULL;
	a->env = enif_alloc_env();
	if (!a->env) {
		enif_free(a);
		return NULL;
	}
	return a;
}

static void ask_destroy(struct ask *a)
{
	enif_free_env(a->env);
	enif_free(a);
}

static void ask_free(struct dp *s, struct ask *a)
{
	enif_clear_env(a->env);
	if (s->n_spare < DP_FREE_ASKS) {
		a->next = s->spare;
		s->spare = a;
		s->n_spare++;
		return;
	}
	ask_destroy(a);
}

static uint32_t slot_of(uint64_t id, uint32_t mask) { return (uint32_t)((id * 0x9e3779b97f4a7c15ull) >> 32) & mask; }

static void tab_grow(struct dp *s)
{
	uint32_t n = (s->tab_mask + 1) * 2, mask = n - 1;
	struct ask **t = enif_alloc(n * sizeof *t);

	if (!t)
		return; /* chains just get longer */
	memset(t, 0, n * sizeof *t);
	for (uint32_t i = 0; i <= s->tab_mask; i++) {
		struct ask *a = s->tab[i], *next;
		for (; a; a = next) {
			next = a->next;
			a->next = t[slot_of(a->id, mask)];
			t[slot_of(a->id, mask)] = a;
		}
	}
	enif_free(s->tab);
	s->tab = t;
	s->tab_mask = mask;
}

static void ask_put(struct dp *s, struct ask *a)
{
	uint32_t i;

	if (s->n_asks > s->tab_mask && s->tab_mask < (1u << 24))
		tab_grow(s);
	i = slot_of(a->id, s->tab_mask);
	a->next = s->tab[i];
	s->tab[i] = a;
	s->n_asks++;
}

static struct ask *ask_find(struct dp *s, uint64_t id)
{
	struct ask *a = s->tab[slot_of(id, s->tab_mask)];

	while (a && a->id != id)
		a = a->next;
	return a;
}

static struct ask *ask_take(struct dp *s, uint64_t id)
{
	struct ask **pp = &s->tab[slot_of(id, s->tab_mask)];

	for (; *pp; pp = &(*pp)->next) {
		struct ask *a = *pp;
		if (a->id == id) {
			*pp = a->next;
			s->n_asks--;
			return a;
		}
	}
	return NULL;
}

/* ---- closing ------------------------------------------------------------------ */

/* Closes the segment once, from any thread but the destructor: every
 * pending ask gets {Ref, {error, Reason}}, the owner (if notify) gets
 * {actor_dp, Seg, down, Reason}, the pool node sees our closed bit and
 * EOF. caller_env: the calling NIF's env, or NULL on the reply thread. */
static void dp_shut(struct dp *s, ErlNifEnv *caller_env, ERL_NIF_TERM reason, int notify)
{
	ErlNifEnv *m;

	mu_lock(s);
	if (atomic_load(&s->closed)) {
		mu_unlock(s);
		return;
	}
	s->reason = enif_make_copy(s->penv, reason);
	atomic_store(&s->closed, 1);
	m = enif_alloc_env();
	int64_t now_ns = ap_mono_ns();
	for (uint32_t i = 0; i <= s->tab_mask; i++) {
		struct ask *a, *next;
		for (a = s->tab[i]; a; a = next) {
			next = a->next;
			ask_observe(a, now_ns);
			/* Made in the ask's own env, beside its ref: no
			 * allocation that could fail and leave an asker, who
			 * may wait with no timeout of its own, unanswered. The
			 * send invalidates the env; ask_free clears it. */
			ERL_NIF_TERM msg = enif_make_tuple2(a->env, a->ref,
							    error_tuple(a->env, enif_make_copy(a->env, s->reason)));
			(void)enif_send(caller_env, &a->pid, a->env, msg);
			a->next = NULL;
			ask_free(s, a);
		}
		s->tab[i] = NULL;
	}
	s->n_asks = 0;
	/* keep is held here (it is dropped only after a shut), so the
	 * resource cannot be going away while we make a term of it. */
	if (notify && m && s->keep) {
		ERL_NIF_TERM msg = enif_make_tuple4(m, a_actor_dp, enif_make_resource(m, s), a_down,
						    enif_make_copy(m, s->reason));
		(void)enif_send(caller_env, &s->owner, m, msg);
		enif_clear_env(m);
	}
	mu_unlock(s);
	if (m)
		enif_free_env(m);
	ap_seg_close(s->seg.hdr, AP_SEG_CLOSED_BEAM);
	if (s->bell_fd >= 0) /* an epoll pool node hears the closed bit at once */
		ap_seg_ring_pipe(s->bell_fd);
	if (s->sock >= 0)
		shutdown(s->sock, SHUT_RDWR);
}

/* Drops the resource's reference to itself (close/2, the owner's exit);
 * never called on the reply thread. */
static void dp_unkeep(struct dp *s)
{
	int drop;

	mu_lock(s);
	drop = s->keep;
	s->keep = 0;
	mu_unlock(s);
	if (drop)
		enif_release_resource(s);
}

/* ---- the reply thread ----------------------------------------------------------- */

/* ---- atoms in answers ------------------------------------------------------------
 * An answer may carry atoms this VM does not have yet, as one by
 * distribution may; but each new atom is kept for ever, and a VM whose atom
 * table fills up aborts. The pool node refuses replies past its pools'
 * budgets (max_reply_atoms), and this is the bound for a pool node that
 * does not: an answer is decoded with ERL_NIF_BIN2TERM_SAFE (no new atom);
 * when that fails, its atoms are walked (ap_term_check, the pool node's own
 * check) and the unknown ones admitted to the segment's set of at most
 * new_atoms_cap names; only an answer whose atoms all fit is decoded again
 * with new atoms allowed. So one segment makes at most new_atoms_cap atoms,
 * whatever its pool node writes. An atom with a name in ASCII is looked up
 * first (enif_make_existing_atom_len is Latin-1 only on OTP 25): a known
 * one costs nothing; any other counts as new. */

struct admit_ctx {
	struct dp *s;
	ErlNifEnv *env;
};

static ap_atomset *new_atoms_set(struct dp *s)
{
	ap_atomset *set = atomic_load(&s->new_atoms), *mine;

	if (set)
		return set;
	mine = ap_atomset_new(s->new_atoms_cap);
	if (!mine)
		return NULL;
	if (atomic_compare_exchange_strong(&s->new_atoms, &set, mine))
		return mine;
	free(mine); /* another thread made it first */
	return set;
}

static int admit_atom(void *arg, const uint8_t *name, size_t len)
{
	struct admit_ctx *c = arg;
	ERL_NIF_TERM atom;
	ap_atomset *set;
	size_t k;

	for (k = 0; k < len && name[k] < 0x80; k++)
		;
	if (k == len && enif_make_existing_atom_len(c->env, (const char *)name, len, &atom, ERL_NIF_LATIN1))
		return 0;
	set = new_atoms_set(c->s);
	return set && ap_atomset_admit(set, name, len) ? 0 : -1;
}

/* Whether the answer term (with its 131 byte) may be decoded with new
 * atoms: every atom in it known here, or admitted to the segment's set. */
static int admit_atoms(struct dp *s, ErlNifEnv *env, const uint8_t *term, size_t len)
{
	struct admit_ctx c = { s, env };
	ap_term_strict st;
	int idx = 1, ok;

	memset(&st, 0, sizeof st);
	st.atom = admit_atom;
	st.arg = &c;
	ok = len > 1 && ap_term_check((const char *)term, len, &idx, &st) == 0 && (size_t)idx == len;
	ap_term_strict_free(&st);
	return ok;
}

/* The answer term[0, len) (with its 131 byte) decoded in e; 0, or -1. */
static int decode_answer(struct dp *s, ErlNifEnv *e, const uint8_t *term, size_t len, ERL_NIF_TERM *ans)
{
	if (enif_binary_to_term(e, term, len, ans, ERL_NIF_BIN2TERM_SAFE) == len)
		return 0;
	if (!admit_atoms(s, e, term, len))
		return -1;
	cnt(&s->n_unsafe);
	return enif_binary_to_term(e, term, len, ans, 0) == len ? 0 : -1;
}

/* Whether an answer may hold a map of more than 32 keys (a hash map):
 * OTP before 27.3 (and its maintenance fixes, erlang/otp#8208) crashes
 * decoding those on a thread that is no scheduler, such as the reply
 * thread. A term the walk refuses counts as one (the asker's decode, in
 * a process, is safe either way). term: with its 131 byte. */
static int may_hold_hash_map(const uint8_t *term, size_t len)
{
	int idx = 1;
	uint64_t max_map;

	if (len < 2 || ap_term_scan((const char *)term, len, &idx, &max_map))
		return 1;
	return max_map > 32;
}

/* The entry of ring i's last delivery back to the spare list (caller
 * holds mu and ring i's lock). */
static void free_sent(struct dp *s, uint32_t i)
{
	if (s->rs[i].sent) {
		ask_free(s, s->rs[i].sent);
		s->rs[i].sent = NULL;
	}
}

/* Takes ask id's entry out of the table to deliver its answer outside mu:
 * ring i's `delivering` names it until the send is made. NULL when the
 * ask is gone (cancelled, answered by a close): a late answer. */
static struct ask *take_to_deliver(struct dp *s, uint32_t i, uint64_t id, int mark)
{
	struct ask *a;

	mu_lock(s);
	free_sent(s, i);
	a = ask_take(s, id);
	/* Counted before the lock is dropped: a caller that saw the effect
	 * sees the count. */
	cnt(a ? &s->n_replies : &s->n_late);
	if (a && mark)
		atomic_store_explicit(&s->rs[i].delivering, id, memory_order_relaxed);
	mu_unlock(s);
	return a;
}

/* After the send: a cancel waiting on ring i may answer false now. */
static void delivered(struct dp *s, uint32_t i, struct ask *a)
{
	atomic_store_explicit(&s->rs[i].delivering, 0, memory_order_release);
	s->rs[i].sent = a;
}

/* The reply thread's delivery of one answer. The entry is taken out of
 * the table under mu, and the answer made and sent outside it: held
 * across the decode and the send (which may wake a scheduler, a syscall),
 * the lock had the schedulers' submits and this thread sleep on it and
 * wake each other, a fifth of this thread's time under 64 callers. A
 * cancel that misses the entry must still find the answer sent (its
 * caller flushes after it): it waits while `delivering` names its ask,
 * which is set under the same lock as the take and cleared after the
 * send. The entry goes back to the spare list under the next hold of the
 * lock. */
static void deliver(void *arg, uint64_t id, const uint8_t *term, size_t len)
{
	struct dp *s = arg;
	ERL_NIF_TERM ans;
	struct ask *a;
	ErlNifEnv *e;

	a = take_to_deliver(s, tl_ring, id, 1);
	if (!a)
		return;
	/* Made in the ask's own env, beside the ref its asker's scheduler
	 * copied there: the heap fragment that goes with the message is that
	 * scheduler's allocation, which the asker's side frees as its own. Made
	 * here, in an env of this thread, every answer's fragment came from the
	 * allocator instance of unmanaged threads, and each free of one was
	 * handed to the BEAM's aux thread.
	 *
	 * New atoms within the segment's allowance (decode_answer). The whole
	 * copy must be one term. An answer that may hold a hash map goes as
	 * its bytes, decoded by the asker (actor_pool, which asks admit/2
	 * before it allows new atoms), not on this thread (may_hold_hash_map). */
	e = a->env;
	if (may_hold_hash_map(term, len)) {
		ERL_NIF_TERM bin;
		unsigned char *b = enif_make_new_binary(e, len, &bin);
		if (b) {
			memcpy(b, term, len);
			ans = enif_make_tuple2(e, a_ext, bin);
		} else {
			ans = error_tuple(e, a_enomem);
		}
	} else if (decode_answer(s, e, term, len, &ans)) {
		ans = error_tuple(e, a_bad_reply);
	}
	/* Timed before the send: an asker that has its answer finds it in
	 * its histogram. The send takes the env's terms (it is left empty,
	 * ask_free clears nothing more). */
	ask_observe(a, ap_mono_ns());
	(void)enif_send(NULL, &a->pid, e, enif_make_tuple2(e, a->ref, ans));
	delivered(s, tl_ring, a);
}

/* Bytes of ring i that no drain has released (any thread, no view
 * touched). The tail is the pool node's word: a hint (whether to drain,
 * whether to hand the ring over), never a bound. */
static uint64_t rep_pending_bytes(struct dp *s, uint32_t i)
{
	return __atomic_load_n(&s->rep[i].hdr->tail, __ATOMIC_ACQUIRE) - __atomic_load_n(&s->seen[i], __ATOMIC_ACQUIRE);
}

static int rep_pending(struct dp *s, uint32_t i) { return rep_pending_bytes(s, i) != 0; }

static int rep_any_pending(struct dp *s)
{
	for (uint32_t i = 0; i < s->seg.n_rep; i++)
		if (rep_pending(s, i))
			return 1;
	return 0;
}

/* The reply thread's wake-up condition. While an asker waits in await/2
 * it drains the rings itself and the thread sleeps on (were both to
 * drain, the thread, woken by the same reply, would often take the
 * asker's answer and send it, a wake-up of the asker's scheduler, the
 * hop await/2 is there to save); the asker rings when it leaves anything
 * behind. */
static int rep_ready(void *arg)
{
	struct dp *s = arg;

	if (atomic_load(&s->stop) || atomic_load(&s->closed))
		return 1;
	if (atomic_load(&s->awaiting))
		return 0;
	/* A poked ring is its deliverer's (until the poke goes stale: the
	 * thread's sleep is DP_WAIT_MS at most). */
	for (uint32_t i = 0; i < s->seg.n_rep; i++)
		if (rep_pending(s, i) && !atomic_load(&s->rs[i].poked))
			return 1;
	return 0;
}

static int ring_trylock(struct dp *s, uint32_t i)
{
	int expect = 0;
	return atomic_compare_exchange_strong_explicit(&s->rs[i].lock, &expect, 1, memory_order_acquire,
						       memory_order_relaxed);
}

static void ring_unlock(struct dp *s, uint32_t i) { atomic_store_explicit(&s->rs[i].lock, 0, memory_order_release); }

/* Up to max replies of ring i (the caller holds its lock), fn for each of
 * at most max_len bytes: the replies, or < 0 when the ring broke. *held:
 * a longer one was left in the ring, unread. */
static int drain_ring(struct dp *s, uint32_t i, unsigned max, size_t max_len, dp_reply_fn fn, void *arg, int *held)
{
	struct dp_drain_stats st = { 0, 0, 0 };
	int rc;

	tl_ring = i;
	rc = dp_drain_upto(&s->rep[i], s->rs[i].buf, s->buf_cap, max, max_len, fn, arg, &st);
	if (s->rs[i].sent) {
		mu_lock(s);
		free_sent(s, i);
		mu_unlock(s);
	}
	if (st.bad_records)
		atomic_fetch_add_explicit(&s->n_bad, st.bad_records, memory_order_relaxed);
	__atomic_store_n(&s->seen[i], s->rep[i].pos, __ATOMIC_RELEASE);
	if (st.held && held)
		*held = 1;
	return rc;
}

/* drain_ring under ring i's lock, if no other drainer holds it (0 then). */
static int drain_ring_free(struct dp *s, uint32_t i, unsigned max, size_t max_len, dp_reply_fn fn, void *arg,
			   int *held)
{
	int rc;

	if (!ring_trylock(s, i))
		return 0;
	rc = drain_ring(s, i, max, max_len, fn, arg, held);
	ring_unlock(s, i);
	return rc;
}

/* Every reply ring with replies once, those whose lock is free: as
 * drain_ring. */
static int drain_all(struct dp *s, size_t max_len, dp_reply_fn fn, void *arg, int *held)
{
	int total = 0;

	for (uint32_t i = 0; i < s->seg.n_rep; i++) {
		int rc = rep_pending(s, i) ? drain_ring_free(s, i, DP_DRAIN_BATCH, max_len, fn, arg, held) : 0;
		if (rc < 0)
			return rc;
		total += rc;
	}
	return total;
}

/* The deliverer for ring i, if one is alive as far as we know. */
static int deliverer_of(struct dp *s, uint32_t i, ErlNifPid *pid)
{
	int ok = 0;

	enif_mutex_lock(g_dlv_mu);
	if (g_n_dlv) {
		unsigned k = (s->dlv_base + i) % g_n_dlv;
		if (g_dlv_alive[k]) {
			*pid = g_dlv[k];
			ok = 1;
		}
	}
	enif_mutex_unlock(g_dlv_mu);
	return ok;
}

static void deliverer_gone(const ErlNifPid *pid)
{
	enif_mutex_lock(g_dlv_mu);
	for (unsigned k = 0; k < g_n_dlv; k++)
		if (g_dlv_alive[k] && !enif_compare_pids(&g_dlv[k], pid))
			g_dlv_alive[k] = 0;
	enif_mutex_unlock(g_dlv_mu);
}

/* The reply thread hands ring i to its deliverer: 1 if it was sent. */
static int poke(struct dp *s, uint32_t i)
{
	struct rep_side *r = &s->rs[i];
	ErlNifPid pid;
	int sent;

	if (!deliverer_of(s, i, &pid))
		return 0;
	/* Up before the send: the deliverer takes it down as it begins. */
	r->poked_ms = dp_now_ms();
	atomic_store(&r->poked, 1);
	sent = enif_send(NULL, &pid, s->tenv,
			 enif_make_tuple3(s->tenv, a_actor_dp_drain, enif_make_resource(s->tenv, s),
					  enif_make_uint(s->tenv, i)));
	enif_clear_env(s->tenv);
	if (!sent) {
		atomic_store(&r->poked, 0);
		deliverer_gone(&pid);
	}
	return sent;
}

/* The reply thread's pass: each ring with replies goes to its deliverer,
 * or is drained here (no deliverer; an answer too large for a scheduler
 * waiting; a poke gone stale). The replies delivered here, or < 0 when a
 * ring broke. */
static int thread_pass(struct dp *s)
{
	int total = 0;

	for (uint32_t i = 0; i < s->seg.n_rep; i++) {
		struct rep_side *r = &s->rs[i];
		if (!rep_pending(s, i))
			continue;
		if (atomic_load(&r->poked)) {
			if (dp_now_ms() - r->poked_ms < DP_WAIT_MS)
				continue;
			atomic_store(&r->poked, 0);
		} else if (!atomic_load(&r->big) && rep_pending_bytes(s, i) >= DP_POKE_BYTES && poke(s, i)) {
			continue;
		}
		/* Down even if another drainer holds the ring: a deliverer
		 * raises it again at the large answer, an asker rings. */
		atomic_store(&r->big, 0);
		int rc = drain_ring_free(s, i, DP_DRAIN_BATCH, SIZE_MAX, deliver, s, NULL);
		if (rc < 0)
			return rc;
		total += rc;
	}
	return total;
}

static void shut_from_thread(struct dp *s, ERL_NIF_TERM reason_in_tenv)
{
	dp_shut(s, NULL, reason_in_tenv, 1);
	enif_clear_env(s->tenv);
}

/* ---- timeouts ------------------------------------------------------------------- */

/* An ask's timeout kept here: the asker waits in a receive with no
 * `after', and the reply thread answers it {error, timeout} at its
 * deadline, taking its entry out of the table under mu as a delivery
 * does, so exactly one of the two reaches the asker and a reply that comes
 * later is dropped (counted late). A timer of the asker's own cost its
 * scheduler a set and a cancel per ask, the cancel often on another
 * scheduler than the set (the asker moved while it waited): 0.6 us of
 * BEAM CPU per ask under 64 callers, 15% of the ask (same-host-transport.md,
 * "Timeouts kept by the NIF"). The deadlines are few (one per waiting ask) and found by
 * a walk of the table only when the earliest is due. */
static void expire_asks(struct dp *s, int64_t now)
{
	struct ask *a, **pp;
	int64_t next = INT64_MAX, now_ns = ap_mono_ns();

	/* Sent under the lock, as a close sends: a cancel that misses the
	 * entry then finds its answer in the mailbox (cancel/2's promise).
	 * Timeouts are rare; the lock is held for a send each. */
	mu_lock(s);
	for (uint32_t i = 0; i <= s->tab_mask; i++)
		for (pp = &s->tab[i]; (a = *pp);) {
			if (a->deadline_ms && a->deadline_ms <= now) {
				*pp = a->next;
				s->n_asks--;
				/* Counted before the send: a caller that saw the
				 * effect sees the count. */
				cnt(&s->n_timeouts);
				ask_observe(a, now_ns);
				/* Made in the ask's env, beside its ref, as deliver does. */
				ERL_NIF_TERM msg = enif_make_tuple2(a->env, a->ref, error_tuple(a->env, a_timeout));
				(void)enif_send(NULL, &a->pid, a->env, msg);
				a->next = NULL;
				ask_free(s, a);
				continue;
			}
			if (a->deadline_ms && a->deadline_ms < next)
				next = a->deadline_ms;
			pp = &a->next;
		}
	atomic_store(&s->next_deadline_ms, next);
	mu_unlock(s);
}

/* The reply thread's wait ends for a reply, a close, a deadline due, or
 * a deadline sooner than the wake-up it planned (a submit kicked it). */
static int thread_ready(void *arg)
{
	struct dp *s = arg;
	int64_t next = atomic_load(&s->next_deadline_ms);

	if (next < atomic_load(&s->wake_ms) || (next != INT64_MAX && next <= dp_now_ms()))
		return 1;
	return rep_ready(arg);
}

/* The reply thread's spin before it sleeps adapts: it doubles when a
 * reply came during it and halves when none did. Replies of many callers
 * follow each other closely and are taken without a sleep; a lone ask's
 * next reply is a whole round trip away, so its spin drops to none
 * instead of taking, after every delivery, the CPU that the woken asker's
 * scheduler and the pool node need on a small host. 1 if a reply came. */
static int spin_for_reply(struct dp *s, struct ap_spin *spin)
{
	for (unsigned k = 0; k < spin->rounds; k++) {
		if (rep_ready(s) > 0) {
			ap_spin_found(spin);
			return 1;
		}
		ap_ring_cpu_relax();
	}
	ap_spin_missed(spin);
	return 0;
}

static void *reply_thread(void *arg)
{
	struct dp *s = arg;
	struct ap_spin spin = { .rounds = DP_REPLY_SPIN_MAX_ROUNDS, .min_rounds = DP_REPLY_SPIN_MIN_ROUNDS,
				.max_rounds = DP_REPLY_SPIN_MAX_ROUNDS };

	while (!atomic_load(&s->stop) && !atomic_load(&s->closed)) {
		int total, rc;
		int64_t now;

		/* While an asker waits in await/2 (awaiting > 0) it drains
		 * the rings; whatever it leaves behind, it rings for, as a
		 * deliverer does. */
		total = atomic_load(&s->awaiting) ? 0 : thread_pass(s);
		if (total < 0) {
			shut_from_thread(s, a_bad_segment);
			break;
		}
		now = dp_now_ms();
		if (atomic_load_explicit(&s->next_deadline_ms, memory_order_relaxed) <= now)
			expire_asks(s, now);
		if (total)
			atomic_fetch_add_explicit(&s->drains, 1, memory_order_release);
		/* Only the wait's result (a timeout, an error) asks for the
		 * socket poll. */
		rc = 0;
		if (!total && !spin_for_reply(s, &spin)) {
			/* Until the earliest deadline at the latest. The Dekker
			 * pair of a submit's kick: wake_ms stored here, then
			 * the deadline read (thread_ready); a deadline sooner
			 * than the wake-up ends the wait at once. */
			int64_t wake = now + DP_WAIT_MS, next = atomic_load(&s->next_deadline_ms);
			if (next < wake)
				wake = next;
			atomic_store(&s->wake_ms, wake);
			rc = ap_seg_wait(s->seg.hdr, AP_SEG_BELL_REP, thread_ready, s, 0,
					 wake > now ? (int)(wake - now) : 0);
			atomic_store(&s->wake_ms, INT64_MAX);
			/* Woken: the next spin is worth a try again. */
			ap_spin_again(&spin);
		}
		/* The peer's EOF: on every timeout, and at least every
		 * DP_WAIT_MS however busy (or however often a hostile peer
		 * rings). The closed bit is only a hint to look now. */
		now = dp_now_ms();
		if (rc != 0 || now - s->last_poll >= DP_WAIT_MS || (ap_seg_closed(s->seg.hdr) & AP_SEG_CLOSED_NODE)) {
			s->last_poll = now;
			if (dp_peer_gone(s->sock)) {
				shut_from_thread(s, enif_make_tuple2(s->tenv, a_nodedown, s->node));
				break;
			}
		}
	}
	return NULL;
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

/* ---- submit --------------------------------------------------------------------- */

/* The caller's ring: a slot per scheduler thread, handed out in order, so
 * that with one ring per scheduler each has its own. A dirty scheduler
 * (submit_encoded/6 of a large term) takes no slot: it would shift the
 * normal schedulers' slots onto each other's rings; it starts at ring 0
 * and takes the first free one. */
static uint32_t my_ring(const struct dp *s, int dirty)
{
	if (dirty)
		return 0;
	if (!tl_slot)
		tl_slot = atomic_fetch_add(&g_next_slot, 1) + 1;
	return (tl_slot - 1) % s->seg.n_req;
}

/* An atom's text as UTF-8 (names travel as UTF-8; OTP 25's API gives
 * Latin-1). 0 if it is not a Latin-1 atom or too long. */
static size_t atom_utf8(ErlNifEnv *env, ERL_NIF_TERM a, uint8_t *out, size_t cap)
{
	char l1[256];
	int n = enif_get_atom(env, a, l1, sizeof l1, ERL_NIF_LATIN1);
	size_t o = 0;

	if (n <= 1)
		return 0;
	for (int i = 0; i < n - 1; i++) {
		uint8_t c = (uint8_t)l1[i];
		if (o + 2 > cap)
			return 0;
		if (c < 0x80) {
			out[o++] = c;
		} else {
			out[o++] = (uint8_t)(0xc0 | c >> 6);
			out[o++] = (uint8_t)(0x80 | (c & 0x3f));
		}
	}
	return o;
}

/* A non-binary message is encoded inside submit/6 (enif_term_to_binary,
 * which cannot yield) only when a walk of at most DP_ENC_CELLS terms
 * shows it small: at most that many terms and conses, within
 * DP_ENC_BYTES by a bound of its encoded size. That encoding takes tens
 * of microseconds at most. Anything else is answered `encode`: the
 * caller encodes it with term_to_binary/1, which yields, and submits the
 * bytes with submit_encoded/6. Unbounded, the encoding of a 10M-element
 * list held the scheduler for 100 ms and more, only for the message to
 * be refused as too large. */
#define DP_ENC_CELLS 1024u /* also bounds the nesting below AP_TERM_MAX_DEPTH, which the pool node refuses past */
#define DP_ENC_BYTES (64u * 1024)
#define DP_ENC_STACK 256u  /* terms waiting in the walk: more siblings than this go to `encode` */
#define DP_ENC_ID 1100u    /* a bound of a pid, port or reference: a node name of 255 UTF-8 characters */
/* submit/7: the caller's own bound of the encoded size (actor_pool walks
 * every message before it sends it) stands for the walk when it is at
 * most this: such a term has at most twice as many terms as bytes, so its
 * encoding is as short. A caller that lies only holds its own scheduler. */
#define DP_ENC_VOUCHED (16u * 1024)
/* submit_encoded/6 checks the bytes it is given (one whole term, as the
 * pool node will): in the call up to this size, on a dirty CPU scheduler
 * above it (a walk of up to a ring record's size, half a megabyte by
 * default, is milliseconds of work). */
#define DP_ENC_INLINE (64u * 1024)

/* Whether t is small enough to encode here (see DP_ENC_CELLS). Terms a NIF
 * cannot size cheaply (funs, which may carry any environment, integers
 * over 64 bits, bitstrings that are not binaries) are left to the
 * caller. */
static int enc_small(ErlNifEnv *env, ERL_NIF_TERM t)
{
	ERL_NIF_TERM st[DP_ENC_STACK];
	unsigned n = 0, cells = 0;
	size_t bytes = 1;

	st[n++] = t;
	while (n) {
		ERL_NIF_TERM x = st[--n], h, tl, k, v;
		const ERL_NIF_TERM *el;
		ErlNifBinary b;
		ErlNifSInt64 i64;
		ErlNifUInt64 u64;
		ErlNifMapIterator it;
		unsigned len;
		size_t msz;
		int arity;

		if (++cells > DP_ENC_CELLS)
			return 0;
		switch (enif_term_type(env, x)) {
		case ERL_NIF_TERM_TYPE_ATOM:
			/* Latin-1 text becomes at most twice as many UTF-8 bytes. */
			bytes += enif_get_atom_length(env, x, &len, ERL_NIF_LATIN1) ? 3 + 2 * (size_t)len : 3 + 4 * 255;
			break;
		case ERL_NIF_TERM_TYPE_FLOAT:
			bytes += 9;
			break;
		case ERL_NIF_TERM_TYPE_INTEGER:
			if (!enif_get_int64(env, x, &i64) && !enif_get_uint64(env, x, &u64))
				return 0;
			bytes += 11;
			break;
		case ERL_NIF_TERM_TYPE_PID:
		case ERL_NIF_TERM_TYPE_PORT:
		case ERL_NIF_TERM_TYPE_REFERENCE:
			bytes += DP_ENC_ID;
			break;
		case ERL_NIF_TERM_TYPE_BITSTRING:
			if (!enif_inspect_binary(env, x, &b))
				return 0;
			bytes += 6 + b.size;
			break;
		case ERL_NIF_TERM_TYPE_LIST:
			/* One cons: its head waits on top of its tail, so a long
			 * list keeps the stack at one entry for its spine. */
			if (!enif_get_list_cell(env, x, &h, &tl)) {
				bytes += 1;
				break;
			}
			if (n + 2 > DP_ENC_STACK)
				return 0;
			bytes += 5;
			st[n++] = tl;
			st[n++] = h;
			break;
		case ERL_NIF_TERM_TYPE_TUPLE:
			if (!enif_get_tuple(env, x, &arity, &el) || (unsigned)arity > DP_ENC_STACK - n)
				return 0;
			bytes += 5;
			for (int j = arity - 1; j >= 0; j--)
				st[n++] = el[j];
			break;
		case ERL_NIF_TERM_TYPE_MAP:
			if (!enif_get_map_size(env, x, &msz) || msz > (DP_ENC_STACK - n) / 2)
				return 0;
			bytes += 5;
			if (!msz)
				break;
			if (!enif_map_iterator_create(env, x, &it, ERL_NIF_MAP_ITERATOR_FIRST))
				return 0;
			while (enif_map_iterator_get_pair(env, &it, &k, &v)) {
				st[n++] = v;
				st[n++] = k;
				enif_map_iterator_next(env, &it);
			}
			enif_map_iterator_destroy(env, &it);
			break;
		default:
			return 0;
		}
		if (bytes > DP_ENC_BYTES)
			return 0;
	}
	return 1;
}

/* A ticket: the ring a submit's record went to, a small integer the
 * caller keeps per pool node and passes back with its next submit. When
 * that one goes to another ring, its fence is that ring's tail now: the
 * ticket's record was committed before, so it lies before the tail, and
 * the reader reads that ring up to there first (others' records among
 * them, which only come sooner). The caller's ticket so changes only when
 * it moves between rings: no dictionary write per record, no tuple built
 * and nothing deep compared (a {Seg, {Ring, Pos}} kept per record took
 * 7% of a tell's samples, its write and the map update 5% more). A ticket
 * of another segment (a lane replaced) makes a fence at that ring's tail
 * too, one more read the reader would do anyway.
 *
 * A mark: a ticket with the tail it had then (mark/2), for consumed/2,
 * which must wait for a place that does not move: the ring in the low
 * TK_RING_BITS bits, the position's low TK_POS_BITS bits above, its high
 * bits read back from the ring's tail (the mark lies less than 2^49 bytes
 * behind it). */
#define TK_RING_BITS 10
#define TK_POS_BITS 49
#define TK_RING_MASK ((1u << TK_RING_BITS) - 1)
#define TK_POS_MASK ((UINT64_C(1) << TK_POS_BITS) - 1)
_Static_assert(AP_SEG_MAX_REQ <= (1u << TK_RING_BITS), "a ring index fits in a ticket");
_Static_assert(TK_RING_BITS + TK_POS_BITS <= 59, "a mark is a small integer");

/* Ring i's committed tail: our own word, published by its writers; a
 * hostile value only makes a fence or a mark wrong, never memory. */
static uint64_t req_tail(const struct dp *s, uint32_t i)
{
	return __atomic_load_n(&s->req[i].r.hdr->tail, __ATOMIC_ACQUIRE);
}

/* 1 and *ring, *pos from mark t; 0 if t is not one of this segment. */
static int get_mark(ErlNifEnv *env, const struct dp *s, ERL_NIF_TERM t, uint32_t *ring, uint64_t *pos)
{
	ErlNifUInt64 v;

	if (!enif_get_uint64(env, t, &v) || v >> (TK_RING_BITS + TK_POS_BITS) || (v & TK_RING_MASK) >= s->seg.n_req)
		return 0;
	*ring = (uint32_t)(v & TK_RING_MASK);
	uint64_t now = req_tail(s, *ring), p = (now & ~TK_POS_MASK) | (v >> TK_RING_BITS);
	if (p > now) /* the window below the tail; past it: no mark of ours, the tail */
		p = now > TK_POS_MASK ? p - (TK_POS_MASK + 1) : now;
	*pos = p;
	return 1;
}

/* An ask's reference, and its timeout when this library keeps it. */
struct ask_tag {
	ERL_NIF_TERM ref;
	uint32_t timeout_ms; /* 0: none */
	struct dp_hist *hist; /* NULL: none */
};

/* Under mu: h, kept by the segment until it goes (NULL past
 * DP_MAX_HISTS, or without memory: the ask goes unmeasured). */
static struct dp_hist *pin_hist(struct dp *s, struct dp_hist *h)
{
	if (!h || h == s->last_hist)
		return h;
	for (uint32_t i = 0; i < s->n_hists; i++)
		if (s->hists[i] == h) {
			s->last_hist = h;
			return h;
		}
	if (s->n_hists == s->cap_hists) {
		uint32_t cap = s->cap_hists ? 2 * s->cap_hists : 8;
		struct dp_hist **n;
		if (cap > DP_MAX_HISTS || !(n = enif_realloc(s->hists, cap * sizeof *n)))
			return NULL;
		s->hists = n;
		s->cap_hists = cap;
	}
	enif_keep_resource(h);
	s->hists[s->n_hists++] = h;
	s->last_hist = h;
	return h;
}

/* What submit/6 and submit_encoded/6 share: Seg, Kind, Dest, Ref (or
 * {Ref, TimeoutMs}) and Ticket (argv[0..2], [4], [5]) read into *s, *q and
 * *tag. 0, or -1 for a
 * badarg. The destination may be in name[] or in *dest_bin (then
 * *own_dest is set: the caller releases it). */
static int submit_args(ErlNifEnv *env, const ERL_NIF_TERM argv[], struct dp **s, struct dp_req_parts *q,
		       uint8_t name[DP_MAX_DEST_NAME], ErlNifBinary *dest_bin, int *own_dest, struct ask_tag *tag)
{
	ErlNifUInt64 tr;
	const ERL_NIF_TERM *el;
	int arity;
	unsigned t;

	if (!get_dp(env, argv[0], s))
		return -1;
	if (enif_is_identical(argv[1], a_tell))
		q->kind = AP_DP_TELL;
	else if (enif_is_identical(argv[1], a_ask))
		q->kind = AP_DP_ASK;
	else if (enif_is_identical(argv[1], a_stats))
		q->kind = AP_DP_STATS;
	else
		return -1;
	/* An ask's tag: Ref, or {Ref, TimeoutMs} for a timeout kept here,
	 * or {Ref, TimeoutMs, Hist} (TimeoutMs 0: none) to time it into Hist. */
	tag->ref = argv[4];
	tag->timeout_ms = 0;
	tag->hist = NULL;
	if (q->kind != AP_DP_TELL && enif_get_tuple(env, argv[4], &arity, &el)) {
		void *h;
		if (arity == 2 && enif_get_uint(env, el[1], &t) && t > 0) {
			tag->ref = el[0];
			tag->timeout_ms = t;
		} else if (arity == 3 && enif_get_uint(env, el[1], &t) && enif_get_resource(env, el[2], g_hist_type, &h)) {
			tag->ref = el[0];
			tag->timeout_ms = t;
			tag->hist = h;
		}
	}
	if (q->kind != AP_DP_TELL && !enif_is_ref(env, tag->ref))
		return -1;
	if (enif_get_uint64(env, argv[5], &tr)) {
		/* A ticket of another segment's geometry is no fence; the
		 * fence's place is taken when the record's ring is known. */
		if (tr < (*s)->seg.n_req)
			q->fence_ring = (uint32_t)tr;
	} else if (!enif_is_identical(argv[5], a_undefined)) {
		return -1;
	}
	if (enif_is_atom(env, argv[2])) {
		q->dest_kind = AP_DP_DEST_NAME;
		q->dest_len = atom_utf8(env, argv[2], name, DP_MAX_DEST_NAME);
		q->dest = name;
		if (!q->dest_len)
			return -1;
	} else if (enif_is_pid(env, argv[2])) {
		struct pid_enc *pc = &tl_pid;
		q->dest_kind = AP_DP_DEST_PID;
		if (pc->env && enif_is_identical(argv[2], pc->pid)) {
			q->dest = pc->enc;
			q->dest_len = pc->len;
			return 0;
		}
		if (!enif_term_to_binary(env, argv[2], dest_bin))
			return -1;
		*own_dest = 1;
		q->dest = dest_bin->data + 1;
		q->dest_len = dest_bin->size - 1;
		if (q->dest_len <= sizeof pc->enc && (pc->env || (pc->env = enif_alloc_env()))) {
			enif_clear_env(pc->env);
			pc->pid = enif_make_copy(pc->env, argv[2]);
			memcpy(pc->enc, q->dest, q->dest_len);
			pc->len = q->dest_len;
		}
	} else {
		return -1;
	}
	return 0;
}

/* Writes the record q into a request ring and answers as submit/6 does.
 * tag: the ask's Ref and timeout (argv[4]); dirty: on a dirty scheduler. *published:
 * whether the record went in. */
static ERL_NIF_TERM submit_record(ErlNifEnv *env, struct dp *s, struct dp_req_parts *q, const struct ask_tag *tag,
				  int dirty, int *published)
{
	uint32_t ring, k;
	struct req_ring *rr = NULL;
	struct ask *a = NULL;
	void *p;
	int rc, lone = 0, solo = 0, kick = 0;

	*published = 0;
	if ((rc = dp_req_check(q)))
		return rc == -EMSGSIZE ? a_too_large : enif_make_badarg(env);
	if (dp_req_len(q->dest_len, q->pre_len + q->msg_len) > ap_ring_max_payload(s->seg.req_cap)) {
		cnt(&s->n_too_large);
		return a_too_large;
	}
	if (atomic_load(&s->closed))
		return a_closed;
	if (q->kind != AP_DP_TELL) {
		/* Registered before the record is visible: the reply may come
		 * back before we return. */
		mu_lock(s);
		if (atomic_load(&s->closed) || !(a = ask_new(s))) {
			mu_unlock(s);
			return a_closed; /* or no memory for the entry: the caller falls back */
		}
		a->id = atomic_fetch_add(&s->next_id, 1);
		a->ref = enif_make_copy(a->env, tag->ref);
		enif_self(env, &a->pid);
		a->crowded = 0;
		a->deadline_ms = 0;
		a->hist = q->kind == AP_DP_ASK ? pin_hist(s, tag->hist) : NULL;
		/* One clock read for both uses (a read was 0.7% of the
		 * schedulers' samples under 64 callers). */
		int64_t now = q->kind == AP_DP_ASK || tag->timeout_ms ? ap_mono_ns() : 0;
		if (tag->timeout_ms) {
			/* +1: the clock's milliseconds are truncated, and a
			 * timeout is never early (as `after' is not). */
			a->deadline_ms = now / 1000000 + tag->timeout_ms + 1;
			if (a->deadline_ms < atomic_load_explicit(&s->next_deadline_ms, memory_order_relaxed)) {
				atomic_store(&s->next_deadline_ms, a->deadline_ms);
				/* Sooner than the reply thread's wake-up: wake it
				 * (a short timeout while it sleeps its longest). */
				kick = a->deadline_ms < atomic_load(&s->wake_ms);
			}
		}
		a->t0 = now;
		if (q->kind == AP_DP_ASK) {
			a->crowded = s->last_ns && now - s->last_ns < DP_CROWD_NS &&
				     enif_compare_pids(&s->last_pid, &a->pid) != 0;
			s->last_pid = a->pid;
			s->last_ns = now;
		}
		ask_put(s, a);
		/* Worth an await/2 (decided here, under the lock we hold
		 * anyway: the other asks never make that call). */
		if (q->kind == AP_DP_ASK && s->n_asks == 1 && !a->crowded) {
			solo = 1;
			lone = ap_skip_wait(&s->await_skip);
		}
		/* Read under the lock: once it is dropped the entry may be
		 * answered (a timeout, a close), freed and reused by another
		 * submit. */
		q->ask_id = a->id;
		mu_unlock(s);
		if (kick)
			ap_seg_kick(s->seg.hdr, AP_SEG_BELL_REP);
	}
	/* The loop's hint (ap_seg.h), before the record shows: it reads it
	 * with the record. Its line is the bell's, which the notify below
	 * reads anyway; written only when it changes. */
	if (__atomic_load_n(&s->seg.hdr->req_lone, __ATOMIC_RELAXED) != (uint32_t)solo)
		__atomic_store_n(&s->seg.hdr->req_lone, (uint32_t)solo, __ATOMIC_RELAXED);
	/* Our scheduler's ring, or the next free one: another thread may share
	 * it (dirty schedulers, more schedulers than rings). */
	ring = my_ring(s, dirty);
	for (k = 0; k < s->seg.n_req; k++) {
		uint32_t i = (ring + k) % s->seg.n_req;
		int expect = 0;
		if (atomic_compare_exchange_strong_explicit(&s->req[i].busy, &expect, 1, memory_order_acquire,
							    memory_order_relaxed)) {
			rr = &s->req[i];
			ring = i;
			break;
		}
	}
	rc = -EAGAIN;
	if (rr) {
		rc = ap_ring_reserve(&rr->r, dp_req_len(q->dest_len, q->pre_len + q->msg_len), &p);
		if (rc == 0) {
			if (q->fence_ring == ring)
				q->fence_ring = AP_DP_NO_FENCE;
			else if (q->fence_ring != AP_DP_NO_FENCE)
				q->fence_pos = req_tail(s, q->fence_ring);
			dp_req_write(p, q);
			rc = ap_ring_publish(&rr->r);
			if (rc == 0) {
				atomic_uint_fast64_t *c =
					&rr->n[q->kind == AP_DP_TELL ? RC_TELLS : q->kind == AP_DP_ASK ? RC_ASKS : RC_STATS];
				atomic_store_explicit(c, atomic_load_explicit(c, memory_order_relaxed) + 1,
						      memory_order_relaxed);
			}
		} else {
			ap_ring_abort(&rr->r);
		}
		atomic_store_explicit(&rr->busy, 0, memory_order_release);
	}
	if (rc == 0) {
		*published = 1;
		ap_seg_notify_fd(s->seg.hdr, AP_SEG_BELL_REQ, s->bell_fd);
	} else if (rc == -EPROTO) {
		/* The pool node moved our ring's head where it cannot be. */
		dp_shut(s, env, a_bad_segment, 1);
	} else {
		cnt(&s->n_full);
	}
	if (rc && a) {
		struct ask *back;
		mu_lock(s);
		back = ask_take(s, q->ask_id);
		if (back)
			ask_free(s, back); /* unanswered: it goes by distribution, timed there */
		mu_unlock(s);
		/* A close answered the ask meanwhile ({Ref, {error, R}} is on
		 * its way): the caller must wait for it as for any answer. */
		if (!back)
			return enif_make_tuple3(env, a_ok,
						enif_make_uint(env, ring),
						enif_make_uint64(env, q->ask_id));
	}
	if (rc == -EPROTO)
		return a_closed;
	if (rc)
		return a_full;
	if (q->kind == AP_DP_TELL)
		return enif_make_tuple2(env, a_ok,
					enif_make_uint(env, ring));
	if (lone)
		return enif_make_tuple4(env, a_ok,
					enif_make_uint(env, ring),
					enif_make_uint64(env, q->ask_id), a_await);
	return enif_make_tuple3(env, a_ok, enif_make_uint(env, ring),
				enif_make_uint64(env, q->ask_id));
}

/* submit(Seg, Kind, Dest, Msg, Ref, Ticket), and submit/7 with the
 * caller's Bound of Msg's encoded size. */
static ERL_NIF_TERM nif_submit(ErlNifEnv *env, int argc, const ERL_NIF_TERM argv[])
{
	struct dp *s;
	struct dp_req_parts q = { .fence_ring = AP_DP_NO_FENCE };
	uint8_t name[DP_MAX_DEST_NAME], prefix[5];
	ErlNifBinary dest_bin = { 0 }, msg_bin = { 0 }, mbin;
	int own_dest = 0, own_msg = 0, published;
	ErlNifUInt64 bound = UINT64_MAX;
	struct ask_tag tag;
	ERL_NIF_TERM ret;

	if ((argc == 7 && !enif_get_uint64(env, argv[6], &bound)) ||
	    submit_args(env, argv, &s, &q, name, &dest_bin, &own_dest, &tag)) {
		ret = enif_make_badarg(env);
		goto done;
	}
	if (q.kind != AP_DP_STATS) {
		if (enif_inspect_binary(env, argv[3], &mbin)) {
			/* Refused by its size alone: a binary is never encoded. */
			if (mbin.size > UINT32_MAX - 64) {
				ret = a_too_large;
				goto done;
			}
			dp_binary_prefix(prefix, (uint32_t)mbin.size);
			q.msg_pre = prefix;
			q.pre_len = sizeof prefix;
			q.msg = mbin.data;
			q.msg_len = mbin.size;
		} else {
			if (bound > DP_ENC_VOUCHED && !enc_small(env, argv[3])) {
				ret = a_encode;
				goto done;
			}
			if (!enif_term_to_binary(env, argv[3], &msg_bin)) {
				ret = enif_make_badarg(env);
				goto done;
			}
			own_msg = 1;
			q.msg = msg_bin.data + 1;
			q.msg_len = msg_bin.size - 1;
		}
	}
	ret = submit_record(env, s, &q, &tag, 0, &published);
done:
	if (own_dest)
		enif_release_binary(&dest_bin);
	if (own_msg)
		enif_release_binary(&msg_bin);
	return ret;
}

/* submit_encoded(Seg, Kind, Dest, Bin, Ref, Ticket): as submit/6 with Msg
 * already encoded (Bin: term_to_binary/1's bytes). Bytes that are not one
 * whole external term (as the pool node checks each message) are a
 * badarg: written, they would be skipped by the pool node, an ask never
 * answered. The size is checked first, so a Bin too large for a record
 * is too_large however its bytes look. */
static ERL_NIF_TERM submit_encoded(ErlNifEnv *env, const ERL_NIF_TERM argv[], int dirty)
{
	struct dp *s;
	struct dp_req_parts q = { .fence_ring = AP_DP_NO_FENCE };
	uint8_t name[DP_MAX_DEST_NAME];
	ErlNifBinary dest_bin = { 0 }, mbin;
	int own_dest = 0, published;
	ERL_NIF_TERM ret;
	struct ask_tag tag;

	if (submit_args(env, argv, &s, &q, name, &dest_bin, &own_dest, &tag) || q.kind == AP_DP_STATS ||
	    !enif_inspect_binary(env, argv[3], &mbin) || mbin.size < 2 || mbin.data[0] != 131) {
		ret = enif_make_badarg(env);
		goto done;
	}
	q.msg = mbin.data + 1;
	q.msg_len = mbin.size - 1;
	if (dp_req_len(q.dest_len, q.msg_len) > ap_ring_max_payload(s->seg.req_cap)) {
		cnt(&s->n_too_large);
		ret = a_too_large;
		goto done;
	}
	if (ap_term_validate_msg((const char *)mbin.data, mbin.size)) {
		ret = enif_make_badarg(env);
		goto done;
	}
	ret = submit_record(env, s, &q, &tag, dirty, &published);
	if (published)
		cnt(&s->n_encoded);
done:
	if (own_dest)
		enif_release_binary(&dest_bin);
	return ret;
}

static ERL_NIF_TERM nif_submit_encoded_dirty(ErlNifEnv *env, int argc, const ERL_NIF_TERM argv[])
{
	(void)argc;
	return submit_encoded(env, argv, 1);
}

static ERL_NIF_TERM nif_submit_encoded(ErlNifEnv *env, int argc, const ERL_NIF_TERM argv[])
{
	ErlNifBinary b;

	struct dp *s;

	/* One that cannot fit is refused in the call, on its size. */
	if (enif_inspect_binary(env, argv[3], &b) && b.size > DP_ENC_INLINE && get_dp(env, argv[0], &s) &&
	    b.size - 1 <= ap_ring_max_payload(s->seg.req_cap))
		return enif_schedule_nif(env, "submit_encoded", ERL_NIF_DIRTY_JOB_CPU_BOUND, nif_submit_encoded_dirty,
					 argc, argv);
	return submit_encoded(env, argv, 0);
}

/* ---- await ---------------------------------------------------------------------- */

/* An ask alone on its segment takes its own reply: its scheduler spins
 * here, holding the reply rings' lock for one pass when there is
 * something to read, instead of the reply thread being woken and waking
 * the asker's scheduler in turn. On a small virtual host each of those
 * wake-ups of a sleeping CPU costs 10-20 us (docs/same-host-transport.md,
 * "Where an ask's time goes"). Only when the ask is the segment's only
 * one (with many askers the rings are busy, the reply thread awake, and a
 * spinning scheduler would keep the others' processes waiting), for at
 * most DP_AWAIT_NS, and with a growing gap of asks without the wait after
 * misses (a handler slower than the wait). */
struct await_ctx {
	struct dp *s;
	ErlNifEnv *env;
	uint64_t mine;
	ERL_NIF_TERM ans;
	int got;
	size_t on_heap; /* bytes of others' answers decoded on this process's heap */
	atomic_uint_fast64_t *count; /* others' answers sent: n_passed_on, or n_sched for a deliverer */
};

/* dp_reply_fn on a scheduler (await/2, a deliverer's drain/2): the
 * asker's own reply is kept (decoded on its heap: it is the NIF's answer).
 * The others are decoded on this process's heap too and sent with no
 * message env: the send copies each onto its asker's heap when it can take
 * the asker's lock (the asker waits in receive, so it mostly can), as a
 * send between processes does. Sent with a message env, every answer was
 * a heap fragment that stayed on its asker until its next garbage
 * collection copied and freed it: erts_cleanup_messages alone was 5.5% of
 * the schedulers' samples under 64 callers, the thread-preferred
 * allocator's alloc and free 3.3% (1.1% now). What this heap keeps is
 * young garbage, dropped by a minor collection without a copy; past
 * DP_HEAP_BUDGET bytes of answers in one call (a decoded term can be ten
 * times its bytes) the rest go through the ring's env, cleared after each
 * send. An answer nobody waits for is not decoded at all. The entry is
 * taken out under mu and the answer made and sent outside it, as deliver
 * does: sent under the lock (a wake-up of the asker's scheduler, a
 * syscall, held across), mu was the schedulers' most contended lock under
 * 64 callers, submits and deliverers sleeping on it and waking each other. */
static void deliver_here(void *arg, uint64_t id, const uint8_t *term, size_t len)
{
	struct await_ctx *c = arg;
	struct dp *s = c->s;
	uint32_t i = tl_ring;
	int mine = c->mine && id == c->mine;
	int here = mine || c->on_heap + len <= DP_HEAP_BUDGET;
	ErlNifEnv *e = here ? c->env : s->rs[i].env;
	ERL_NIF_TERM ans;
	/* Our own needs no mark: we are the only one who could cancel it. */
	struct ask *a = take_to_deliver(s, i, id, !mine);

	if (!a)
		return;
	if (decode_answer(s, e, term, len, &ans))
		ans = error_tuple(e, a_bad_reply);
	ask_observe(a, ap_mono_ns()); /* before the send, as deliver does */
	if (mine) {
		c->ans = ans;
		c->got = 1;
	} else {
		cnt(c->count);
		(void)enif_send(c->env, &a->pid, here ? NULL : e, enif_make_tuple2(e, enif_make_copy(e, a->ref), ans));
		if (here)
			c->on_heap += len;
		else
			enif_clear_env(e);
	}
	delivered(s, i, a);
}

/* Whether ask id is still waiting for its reply (none came, no close
 * answered it); with whether it is alone: the only ask waiting, and the
 * one before it came from the same process or long ago. With many
 * callers the pool answers faster than the schedulers take the answers,
 * so the waiting asks are few while most callers sit in the run queues:
 * the count alone would have their scheduler spin while they wait (11%
 * of the BEAM's samples under 64 callers). */
static int ask_waiting(struct dp *s, uint64_t id, int *alone, int crowd_ok, const ErlNifPid *self)
{
	struct ask *a;

	mu_lock(s);
	a = ask_find(s, id);
	/* Only the asker may take the answer: anyone else would leave it
	 * waiting for a message that never comes. */
	if (alone)
		*alone = a && s->n_asks == 1 && (crowd_ok || !a->crowded) && !enif_compare_pids(&a->pid, self);
	mu_unlock(s);
	return a != NULL;
}

/* await(Seg, AskId) -> {reply, Answer} | none, for an ask whose submit
 * answered {ok, Ticket, Id, await} (submit keeps the gap after misses).
 * none: the answer comes as a message, as without this call.
 * await(Seg, AskId, Us): a wait of Us microseconds (at most
 * DP_AWAIT_MAX_US) that does not count towards the gap (tests, tuning). */
static ERL_NIF_TERM nif_await(ErlNifEnv *env, int argc, const ERL_NIF_TERM argv[])
{
	struct dp *s;
	ErlNifUInt64 id;
	int alone, pct;
	uint64_t gen;
	ErlNifTime t0, now, spent, budget = DP_AWAIT_NS;
	unsigned us;
	ErlNifPid me;
	struct await_ctx c;

	if (!get_dp(env, argv[0], &s) || !enif_get_uint64(env, argv[1], &id))
		return enif_make_badarg(env);
	if (argc == 3) {
		if (!enif_get_uint(env, argv[2], &us) || us > DP_AWAIT_MAX_US)
			return enif_make_badarg(env);
		budget = (ErlNifTime)us * 1000;
	}
	if (!enif_self(env, &me))
		return enif_make_badarg(env);
	/* Before the check: a delivery by the reply thread after it shows.
	 * await/3 takes the count alone (tests make many askers meet). */
	gen = atomic_load_explicit(&s->drains, memory_order_acquire);
	if (atomic_load(&s->closed) || !ask_waiting(s, id, &alone, argc == 3, &me) || !alone)
		return a_none;
	c = (struct await_ctx){ .s = s, .env = env, .mine = id, .got = 0, .count = &s->n_passed_on };
	atomic_fetch_add(&s->awaiting, 1);
	/* The reply thread, asleep, would be rung by the reply we wait for
	 * only to stand aside again: a syscall in the worker and a wake-up
	 * that may take this very CPU from us. Its flag stays down while we
	 * wait and goes up again when the last asker leaves (below). */
	if (ap_seg_flag_take(s->seg.hdr, AP_SEG_BELL_REP))
		atomic_store(&s->flag_taken, 1);
	t0 = enif_monotonic_time(ERL_NIF_NSEC);
	now = t0;
	for (unsigned k = 1;; k++) {
		int passed = 0;
		if (rep_any_pending(s)) {
			int held = 0, rc = drain_all(s, DP_AWAIT_MAX_LEN, deliver_here, &c, &held);
			if (rc < 0) {
				/* Every waiting ask, ours included, gets {error, bad_segment}. */
				dp_shut(s, env, a_bad_segment, 1);
				break;
			}
			/* A large answer (ours or not) is the reply thread's. */
			if (c.got || held)
				break;
			passed = rc > 0;
		}
		if (atomic_load(&s->closed))
			break;
		if (passed || !(k & 15)) {
			uint64_t g = atomic_load_explicit(&s->drains, memory_order_acquire);
			/* The reply thread delivered meanwhile: perhaps ours. */
			if (g != gen) {
				gen = g;
				if (!ask_waiting(s, id, NULL, 0, &me))
					break;
			}
			now = enif_monotonic_time(ERL_NIF_NSEC);
			if (now - t0 >= budget)
				break;
		}
		ap_ring_cpu_relax();
	}
	/* Anything left (others' replies that came after our last pass, a
	 * large one) is the reply thread's. The fence orders our decrement
	 * before the tails we read, as its own check of awaiting is ordered
	 * after raising its sleep flag. */
	if (atomic_fetch_sub(&s->awaiting, 1) == 1) {
		if (atomic_exchange(&s->flag_taken, 0))
			ap_seg_flag_raise(s->seg.hdr, AP_SEG_BELL_REP);
		atomic_thread_fence(memory_order_seq_cst);
		if (rep_any_pending(s))
			ap_seg_kick(s->seg.hdr, AP_SEG_BELL_REP);
	}
	spent = enif_monotonic_time(ERL_NIF_NSEC) - t0;
	pct = 1 + (int)(spent / 10000); /* 1% of a timeslice per 10 us */
	(void)enif_consume_timeslice(env, pct > 100 ? 100 : pct);
	mu_lock(s);
	/* Two misses in a row: the handler is slower than the wait (one
	 * alone is a preempted thread, as on a busy host: no gap for it). */
	if (c.got)
		ap_skip_hit(&s->await_skip);
	else if (argc == 2 && now - t0 >= budget)
		ap_skip_miss(&s->await_skip, DP_AWAIT_SKIP_MAX);
	mu_unlock(s);
	if (!c.got) {
		cnt(&s->n_await_missed);
		return a_none;
	}
	cnt(&s->n_awaited);
	return enif_make_tuple2(env, a_reply, c.ans);
}

/* ---- deliverers ------------------------------------------------------------------ */

/* drain(Seg, Ring) -> ok, in a deliverer process on {actor_dp_drain, Seg,
 * Ring}: the answers waiting in the ring (up to DP_DELIVER_MAX), sent from
 * this scheduler. A larger answer, or what another drainer holds, is left
 * to the reply thread, which is rung for it. */
static ERL_NIF_TERM nif_drain(ErlNifEnv *env, int argc, const ERL_NIF_TERM argv[])
{
	struct dp *s;
	struct await_ctx c;
	unsigned i;
	int n = 0, held = 0, rc = 0;

	(void)argc;
	if (!get_dp(env, argv[0], &s) || !enif_get_uint(env, argv[1], &i) || i >= s->seg.n_rep)
		return enif_make_badarg(env);
	c = (struct await_ctx){ .s = s, .env = env, .mine = 0, .got = 0, .count = &s->n_sched };
	/* Down first: replies that come during the drain get a poke of their
	 * own if this drain misses them. */
	atomic_store(&s->rs[i].poked, 0);
	while (n < DP_DELIVER_MAX && !held && rep_pending(s, i)) {
		rc = drain_ring_free(s, i, DP_DRAIN_BATCH, DP_AWAIT_MAX_LEN, deliver_here, &c, &held);
		if (rc <= 0)
			break;
		n += rc;
	}
	if (rc < 0) {
		dp_shut(s, env, a_bad_segment, 1);
		return a_ok;
	}
	if (n)
		atomic_fetch_add_explicit(&s->drains, 1, memory_order_release);
	if (held)
		atomic_store(&s->rs[i].big, 1);
	/* Whatever is left is the reply thread's to look at: it sleeps with
	 * this ring poked. The fence orders the poke's end before the tail
	 * read, as the thread raises its flag before it looks. */
	atomic_thread_fence(memory_order_seq_cst);
	if (rep_pending(s, i))
		ap_seg_kick(s->seg.hdr, AP_SEG_BELL_REP);
	(void)enif_consume_timeslice(env, 1 + n / 8 > 100 ? 100 : 1 + n / 8);
	return a_ok;
}

/* deliver_for(Index, Count) -> ok: the calling process is deliverer Index
 * of Count (actor_dp_deliverer's start). */
static ERL_NIF_TERM nif_deliver_for(ErlNifEnv *env, int argc, const ERL_NIF_TERM argv[])
{
	unsigned idx, count;
	ErlNifPid self;

	(void)argc;
	if (!enif_get_uint(env, argv[0], &idx) || !enif_get_uint(env, argv[1], &count) || count == 0 ||
	    count > DP_MAX_DELIVERERS || idx >= count || !enif_self(env, &self))
		return enif_make_badarg(env);
	enif_mutex_lock(g_dlv_mu);
	if (count != g_n_dlv) {
		/* Another count (schedulers online changed, a restart): the
		 * others register again as they start. */
		memset(g_dlv_alive, 0, sizeof g_dlv_alive);
		g_n_dlv = count;
	}
	g_dlv[idx] = self;
	g_dlv_alive[idx] = 1;
	enif_mutex_unlock(g_dlv_mu);
	return a_ok;
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

/* ---- cancel, consumed, close, info, scribble ------------------------------------- */

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

static ERL_NIF_TERM nif_consumed(ErlNifEnv *env, int argc, const ERL_NIF_TERM argv[])
{
	struct dp *s;
	uint32_t ring;
	uint64_t pos, head;

	(void)argc;
	if (!get_dp(env, argv[0], &s) || !get_mark(env, s, argv[1], &ring, &pos))
		return enif_make_badarg(env);
	if (atomic_load(&s->closed))
		return a_closed;
	/* The peer's head, read once; a hostile value only makes the answer
	 * wrong, which costs the caller ordering, never memory. */
	head = __atomic_load_n(&s->req[ring].r.hdr->head, __ATOMIC_ACQUIRE);
	return head >= pos ? a_true : a_false;
}

/* mark(Seg, Ticket): where the ticket's ring ends now, for consumed/2. */
static ERL_NIF_TERM nif_mark(ErlNifEnv *env, int argc, const ERL_NIF_TERM argv[])
{
	struct dp *s;
	unsigned ring;

	(void)argc;
	if (!get_dp(env, argv[0], &s) || !enif_get_uint(env, argv[1], &ring) || ring >= s->seg.n_req)
		return enif_make_badarg(env);
	if (atomic_load(&s->closed))
		return a_closed;
	return enif_make_uint64(env, ((req_tail(s, ring) & TK_POS_MASK) << TK_RING_BITS) | ring);
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
#define ATOM(name) a_##name = enif_make_atom(env, #name)
	ATOM(ok);
	ATOM(none);
	ATOM(await);
	ATOM(passed_on);
	a_ext = enif_make_atom(env, "$actor_dp_ext");
	a_new_atoms = enif_make_atom(env, "new_atoms");
	a_unsafe_decodes = enif_make_atom(env, "unsafe_decodes");
	ATOM(timeout);
	ATOM(timeouts);
	ATOM(reply);
	ATOM(awaited);
	ATOM(await_missed);
	ATOM(error);
	ATOM(true);
	ATOM(false);
	ATOM(undefined);
	ATOM(tell);
	ATOM(ask);
	ATOM(stats);
	ATOM(full);
	ATOM(too_large);
	ATOM(closed);
	ATOM(bad_reply);
	ATOM(bad_segment);
	ATOM(nodedown);
	ATOM(actor_dp);
	ATOM(down);
	ATOM(badarg);
	ATOM(owner_down);
	ATOM(open);
	ATOM(state);
	ATOM(tells);
	ATOM(asks);
	ATOM(replies);
	ATOM(late);
	ATOM(bad_records);
	ATOM(pending);
	ATOM(req_rings);
	ATOM(rep_rings);
	ATOM(req_bytes);
	ATOM(rep_bytes);
	ATOM(size);
	ATOM(refused);
	ATOM(errno);
	ATOM(econnrefused);
	ATOM(etimedout);
	ATOM(eperm);
	ATOM(eproto);
	ATOM(econnreset);
	ATOM(enomem);
	ATOM(einval);
	ATOM(emfile);
	ATOM(enoent);
	ATOM(noproc);
	ATOM(encode);
	ATOM(encoded);
	ATOM(actor_dp_drain);
	ATOM(sched_delivered);
#undef ATOM
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
