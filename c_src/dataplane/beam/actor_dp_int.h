/* actor_dp_int: what the parts of the data plane NIF share (actor_dp.c
 * says how they fit together and why): the segment's resource with its ask
 * table and reply rings, the atoms, and each part's calls into the others.
 * Internal to actor_dp.so. */
#ifndef ACTOR_DP_INT_H
#define ACTOR_DP_INT_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>

#include <erl_nif.h>

#include "ap_atomset.h"
#include "ap_hist.h"
#include "ap_skip.h"
#include "dp_core.h"

#define DP_WAIT_MS 50      /* the reply thread's longest sleep: EOF and close are seen within it */
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

/* The atoms the NIFs answer with, made at load (actor_dp.c). */
#define DP_ATOMS(X)                                                                                              \
	X(ok) X(error) X(true) X(false) X(undefined) X(tell) X(ask) X(stats) X(full) X(too_large) X(closed)     \
	X(bad_reply) X(bad_segment) X(nodedown) X(actor_dp) X(down) X(badarg) X(owner_down) X(open) X(state)   \
	X(tells) X(asks) X(replies) X(late) X(bad_records) X(pending) X(req_rings) X(rep_rings) X(req_bytes)   \
	X(rep_bytes) X(size) X(refused) X(errno) X(econnrefused) X(etimedout) X(eperm) X(eproto)               \
	X(econnreset) X(enomem) X(einval) X(emfile) X(enoent) X(noproc) X(none) X(reply) X(actor_dp_drain)     \
	X(sched_delivered) X(awaited) X(await_missed) X(await) X(passed_on) X(timeout) X(timeouts)             \
	X(new_atoms) X(unsafe_decodes) X(encode) X(encoded)
#define DP_ATOM_DECL(name) extern ERL_NIF_TERM a_##name;
DP_ATOMS(DP_ATOM_DECL)
#undef DP_ATOM_DECL
extern ERL_NIF_TERM a_ext; /* '$actor_dp_ext' */

extern ErlNifResourceType *g_dp_type, *g_hist_type;
/* The deliverer processes' registry (dp_await.c). */
extern ErlNifMutex *g_dlv_mu;
/* The reply ring being drained by this thread (drain_ring): the env of
 * deliver_here. */
extern _Thread_local uint32_t tl_ring;

static inline ERL_NIF_TERM error_tuple(ErlNifEnv *env, ERL_NIF_TERM reason)
{
	return enif_make_tuple2(env, a_error, reason);
}

static inline int get_dp(ErlNifEnv *env, ERL_NIF_TERM t, struct dp **s)
{
	return enif_get_resource(env, t, g_dp_type, (void **)s);
}

static inline void cnt(atomic_uint_fast64_t *c) { atomic_fetch_add_explicit(c, 1, memory_order_relaxed); }

static inline void mu_lock(struct dp *s) { (void)pthread_mutex_lock(&s->mu); }
static inline void mu_unlock(struct dp *s) { (void)pthread_mutex_unlock(&s->mu); }

/* dp_asks.c: the ask table (caller holds mu), round trips, closing,
 * timeouts. */
void hist_observe(struct dp_hist *h, int64_t ns);
void ask_observe(struct ask *a, int64_t now);
struct ask *ask_new(struct dp *s);
void ask_destroy(struct ask *a);
void ask_free(struct dp *s, struct ask *a);
void ask_put(struct dp *s, struct ask *a);
struct ask *ask_find(struct dp *s, uint64_t id);
struct ask *ask_take(struct dp *s, uint64_t id);
void dp_shut(struct dp *s, ErlNifEnv *caller_env, ERL_NIF_TERM reason, int notify);
void dp_unkeep(struct dp *s);
void expire_asks(struct dp *s, int64_t now);

/* dp_reply.c: the reply rings' drains and the reply thread. */
int admit_atoms(struct dp *s, ErlNifEnv *env, const uint8_t *term, size_t len);
int decode_answer(struct dp *s, ErlNifEnv *e, const uint8_t *term, size_t len, ERL_NIF_TERM *ans);
struct ask *take_to_deliver(struct dp *s, uint32_t i, uint64_t id, int mark);
void delivered(struct dp *s, uint32_t i, struct ask *a);
int rep_pending(struct dp *s, uint32_t i);
int rep_any_pending(struct dp *s);
int drain_ring_free(struct dp *s, uint32_t i, unsigned max, size_t max_len, dp_reply_fn fn, void *arg, int *held);
int drain_all(struct dp *s, size_t max_len, dp_reply_fn fn, void *arg, int *held);
void *reply_thread(void *arg);

/* dp_await.c: answers taken on schedulers (await/2, the deliverers). */
int deliverer_of(struct dp *s, uint32_t i, ErlNifPid *pid);
void deliverer_gone(const ErlNifPid *pid);
ERL_NIF_TERM nif_await(ErlNifEnv *env, int argc, const ERL_NIF_TERM argv[]);
ERL_NIF_TERM nif_drain(ErlNifEnv *env, int argc, const ERL_NIF_TERM argv[]);
ERL_NIF_TERM nif_deliver_for(ErlNifEnv *env, int argc, const ERL_NIF_TERM argv[]);

/* dp_submit.c: records into the request rings, tickets and marks. */
ERL_NIF_TERM nif_submit(ErlNifEnv *env, int argc, const ERL_NIF_TERM argv[]);
ERL_NIF_TERM nif_submit_encoded(ErlNifEnv *env, int argc, const ERL_NIF_TERM argv[]);
ERL_NIF_TERM nif_consumed(ErlNifEnv *env, int argc, const ERL_NIF_TERM argv[]);
ERL_NIF_TERM nif_mark(ErlNifEnv *env, int argc, const ERL_NIF_TERM argv[]);

#endif
