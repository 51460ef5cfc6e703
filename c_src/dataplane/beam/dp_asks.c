/* dp_asks: the data plane NIF's ask table (an ask registered under mu
 * before its record is published, answered once by whoever takes it out),
 * its round trips, the segment's close and the asks' timeouts (see
 * actor_dp.c for the rules they keep). */
#include <string.h>
#include <sys/socket.h>

#include "actor_dp_int.h"
#include "ap_time.h"

/* ---- round trips ---------------------------------------------------------------- */

/* The histogram shard this thread adds to (actor_dp_int.h, struct dp_hist). */
static _Thread_local int tl_shard = -1;
static atomic_uint g_next_shard;

void hist_observe(struct dp_hist *h, int64_t ns)
{
	if (tl_shard < 0)
		tl_shard = (int)(atomic_fetch_add(&g_next_shard, 1) % DP_HIST_SHARDS);
	ap_hist_add(&h->shard[tl_shard], ns > 0 ? (uint64_t)ns : 0);
}

/* An ask is answered (now: ap_mono_ns): its round trip, once. */
void ask_observe(struct ask *a, int64_t now)
{
	if (a->hist) {
		hist_observe(a->hist, now - a->t0);
		a->hist = NULL;
	}
}

/* ---- asks (caller holds mu) --------------------------------------------------- */

struct ask *ask_new(struct dp *s)
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

void ask_destroy(struct ask *a)
{
	enif_free_env(a->env);
	enif_free(a);
}

void ask_free(struct dp *s, struct ask *a)
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

void ask_put(struct dp *s, struct ask *a)
{
	uint32_t i;

	if (s->n_asks > s->tab_mask && s->tab_mask < (1u << 24))
		tab_grow(s);
	i = slot_of(a->id, s->tab_mask);
	a->next = s->tab[i];
	s->tab[i] = a;
	s->n_asks++;
}

struct ask *ask_find(struct dp *s, uint64_t id)
{
	struct ask *a = s->tab[slot_of(id, s->tab_mask)];

	while (a && a->id != id)
		a = a->next;
	return a;
}

struct ask *ask_take(struct dp *s, uint64_t id)
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
void dp_shut(struct dp *s, ErlNifEnv *caller_env, ERL_NIF_TERM reason, int notify)
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
void dp_unkeep(struct dp *s)
{
	int drop;

	mu_lock(s);
	drop = s->keep;
	s->keep = 0;
	mu_unlock(s);
	if (drop)
		enif_release_resource(s);
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
void expire_asks(struct dp *s, int64_t now)
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
