/* dp_reply: the data plane NIF's reply rings: their drains (by the reply
 * thread, an asker in await/2 or a deliverer, whoever holds a ring's lock),
 * the delivery of an answer, the atoms an answer may make, and the reply
 * thread itself (see actor_dp.c). */
#include <string.h>

#include "actor_dp_int.h"
#include "ap_spin.h"
#include "ap_term.h"
#include "ap_time.h"

#define DP_REPLY_SPIN_MAX_ROUNDS 100u /* at most this many pause rounds before it sleeps (small: 2-core hosts) */
#define DP_REPLY_SPIN_MIN_ROUNDS 8u   /* the adaptive spin's first step up (ap_spin.h) */

_Thread_local uint32_t tl_ring;

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
int admit_atoms(struct dp *s, ErlNifEnv *env, const uint8_t *term, size_t len)
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
int decode_answer(struct dp *s, ErlNifEnv *e, const uint8_t *term, size_t len, ERL_NIF_TERM *ans)
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
struct ask *take_to_deliver(struct dp *s, uint32_t i, uint64_t id, int mark)
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
void delivered(struct dp *s, uint32_t i, struct ask *a)
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

int rep_pending(struct dp *s, uint32_t i) { return rep_pending_bytes(s, i) != 0; }

int rep_any_pending(struct dp *s)
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
int drain_ring_free(struct dp *s, uint32_t i, unsigned max, size_t max_len, dp_reply_fn fn, void *arg,
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
int drain_all(struct dp *s, size_t max_len, dp_reply_fn fn, void *arg, int *held)
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

void *reply_thread(void *arg)
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
