/* dp_await: answers taken on the schedulers: by an ask alone on its
 * segment in await/2, and by the deliverer processes that the reply thread
 * hands rings to (see actor_dp.c). */
#include <string.h>

#include "actor_dp_int.h"
#include "ap_time.h"

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
ERL_NIF_TERM nif_await(ErlNifEnv *env, int argc, const ERL_NIF_TERM argv[])
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

/* The deliverer processes, by index; written by deliver_for/2 (a
 * deliverer's start) and when a send to one fails (it is gone). */
ErlNifMutex *g_dlv_mu;
static ErlNifPid g_dlv[DP_MAX_DELIVERERS];
static int g_dlv_alive[DP_MAX_DELIVERERS];
static unsigned g_n_dlv;

/* The deliverer for ring i, if one is alive as far as we know. */
int deliverer_of(struct dp *s, uint32_t i, ErlNifPid *pid)
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

void deliverer_gone(const ErlNifPid *pid)
{
	enif_mutex_lock(g_dlv_mu);
	for (unsigned k = 0; k < g_n_dlv; k++)
		if (g_dlv_alive[k] && !enif_compare_pids(&g_dlv[k], pid))
			g_dlv_alive[k] = 0;
	enif_mutex_unlock(g_dlv_mu);
}

/* drain(Seg, Ring) -> ok, in a deliverer process on {actor_dp_drain, Seg,
 * Ring}: the answers waiting in the ring (up to DP_DELIVER_MAX), sent from
 * this scheduler. A larger answer, or what another drainer holds, is left
 * to the reply thread, which is rung for it. */
ERL_NIF_TERM nif_drain(ErlNifEnv *env, int argc, const ERL_NIF_TERM argv[])
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
ERL_NIF_TERM nif_deliver_for(ErlNifEnv *env, int argc, const ERL_NIF_TERM argv[])
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
