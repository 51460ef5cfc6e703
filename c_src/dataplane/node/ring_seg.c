/* ring_seg: the pool node's hold on an attached segment (ring_int.h says
 * who holds its references): the references, its detach, and the answers
 * written into its reply rings, from workers (a mutex per ring, a wait
 * for room bounded per stuck episode) and from the loop (never waiting;
 * its inline answers published per read) -- the ring route.
 */
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "ap_log.h"
#include "ap_seg.h"
#include "ap_time.h"
#include "pool_int.h"
#include "ring_int.h"

/* The node's side of the data plane (ring_int.h): here, at the bottom of
 * its files. */
struct dp_node ap_dp = { .lfd = -1, .efd = -1, .bell_fd = -1, .bell_tx = -1,
			 .spin = { .min_rounds = DP_IDLE_SPIN_MIN_ROUNDS, .max_rounds = DP_IDLE_SPIN_MAX_ROUNDS } };

/* ---- references ------------------------------------------------------------ */

void ap_dp_seg_get(struct ap_dp_seg *sg) { atomic_fetch_add_explicit(&sg->refs, 1, memory_order_relaxed); }

void dp_seg_free(struct ap_dp_seg *sg)
{
	if (sg->rep)
		for (uint32_t i = 0; i < sg->s.n_rep; i++)
			pthread_mutex_destroy(&sg->rep[i].mu);
	free(sg->rep);
	free(sg->req);
	free(sg->busy);
	free(sg->seen);
	ap_ring_map_close(&sg->map);
	free(sg);
}

void ap_dp_seg_put(struct ap_dp_seg *sg)
{
	if (atomic_fetch_sub_explicit(&sg->refs, 1, memory_order_acq_rel) == 1) {
		atomic_fetch_sub(&ap_dp.nsegs, 1);
		dp_seg_free(sg);
	}
}

/* ---- replies ----------------------------------------------------------------- */

static void rep_broken(ap_node *n, void *arg)
{
	(void)n;
	struct ap_dp_seg *sg = arg;
	dp_detach(sg, "a reply ring is broken");
	ap_dp_seg_put(sg);
}

/* Writes one reply record into rr (locked by the caller). wait_ms: how
 * long to wait for room. 0, or -ETIMEDOUT / -EPROTO / -EMSGSIZE. */
static int rep_write(struct dp_rep *rr, uint64_t ask_id, const void *term, size_t len, int wait_ms, int publish)
{
	void *p;
	int r = ap_ring_reserve(&rr->r, sizeof(struct ap_dp_rep) + len, &p);
	if (r == -EAGAIN && wait_ms > 0) {
		r = ap_ring_wait_space(&rr->r, sizeof(struct ap_dp_rep) + len, AP_RING_DEFAULT_SPIN, wait_ms);
		if (r == 0)
			r = ap_ring_reserve(&rr->r, sizeof(struct ap_dp_rep) + len, &p);
	}
	if (r == -EAGAIN)
		r = -ETIMEDOUT;
	if (r)
		return r;
	struct ap_dp_rep h = { .ask_id = ask_id, .len = (uint32_t)len };
	memcpy(p, &h, sizeof h);
	memcpy((uint8_t *)p + sizeof h, term, len);
	if (!publish)
		return 0;
	return ap_ring_publish(&rr->r) < 0 ? -EPROTO : 0;
}

/* The slow path of a worker's reply: rr (locked) had no room. Sleeps for
 * room WITHOUT the mutex, so the loop's own answers and other workers'
 * writes never wait behind a BEAM that does not read, against one
 * deadline. prod_waiting is one shared flag: it is cleared only by the
 * last sleeper, and a sleeper woken by a real space bell passes the
 * wake-up on (the BEAM wakes one). Returns as rep_write, or -EPIPE. */
static int rep_write_slow(struct ap_dp_seg *sg, struct dp_rep *rr, uint64_t ask_id, const void *term, size_t len)
{
	int64_t deadline = ap_mono_ms() + DP_REPLY_WAIT_MS;
	/* The loop's answers written but not yet published (see
	 * publish_deferred) may be what fills the ring: the BEAM must see
	 * them to make room. */
	if (rr->r.pos != rr->r.tail) {
		if (ap_ring_publish(&rr->r) < 0)
			return -EPROTO;
		ap_seg_notify(sg->s.hdr, AP_SEG_BELL_REP);
	}
	for (;;) {
		uint32_t *word, exp;
		int s = ap_ring_prepare_sleep(&rr->r, sizeof(struct ap_dp_rep) + len, &word, &exp);
		if (s < 0)
			return s == -EAGAIN ? -ETIMEDOUT : s;
		if (s > 0) {
			int64_t left = deadline - ap_mono_ms();
			if (left <= 0) {
				if (!rr->sleepers)
					ap_ring_end_sleep(&rr->r);
				return -ETIMEDOUT;
			}
			rr->sleepers++;
			pthread_mutex_unlock(&rr->mu);
			ap_ring_futex_wait(word, exp, (int)left);
			pthread_mutex_lock(&rr->mu);
			if (--rr->sleepers == 0)
				ap_ring_end_sleep(&rr->r);
			else if (__atomic_load_n(word, __ATOMIC_ACQUIRE) != exp)
				ap_ring_futex_wake(word, 1);
			if (atomic_load(&sg->dead))
				return -EPIPE;
		}
		int r = rep_write(rr, ask_id, term, len, 0, 1);
		if (r != -ETIMEDOUT || ap_mono_ms() >= deadline)
			return r;
	}
}

/* After a reply record was written (r: rep_write's result): the BEAM
 * is rung, or a broken ring detaches the segment, or a drop is logged. */
static void written(struct ap_dp_seg *sg, int r)
{
	if (r == 0) {
		ap_seg_notify(sg->s.hdr, AP_SEG_BELL_REP);
	} else if (r == -EPROTO) {
		/* Once: every later reply is dropped at once, not logged, while
		 * the loop gets round to the dp_detach. */
		atomic_store_explicit(&sg->dead, 1, memory_order_release);
		if (!atomic_exchange(&sg->rep_broken, 1)) {
			ap_log(AP_LOG_WARNING, "reply ring of %s is broken; detaching it", sg->peer);
			ap_dp_seg_get(sg);
			if (ap_node_call_on_loop(ap_dp.n, rep_broken, sg))
				ap_dp_seg_put(sg);
		}
	} else if (r != -EPIPE) {
		ap_log(AP_LOG_WARNING, "ring reply to %s dropped: %s", sg->peer,
		       r == -ETIMEDOUT ? "its reply ring stayed full" : strerror(-r));
	}
}

/* Answers the loop made itself (inline runs) are written at once but
 * published at the end of the ring read that made them (dp_read_end), or
 * per DP_DEFER_ANSWERS: the BEAM's reply thread then finds them in
 * batches (one wake-up, one hand-over to a deliverer) instead of one at a
 * time. A worker that writes the same ring meanwhile publishes them with
 * its own, which is as good: they are whole. Loop thread only; outside a
 * read (a stopped pool's made answers) they go out at once. */
#define DP_DEFER_ANSWERS 16
#define DP_DEFER_RINGS 8
static struct {
	struct { struct ap_dp_seg *sg; unsigned ring; } at[DP_DEFER_RINGS];
	int n, answers;
	int reading; /* within drain_seg_ref */
} deferred;

static void publish_deferred(void)
{
	for (int i = 0; i < deferred.n; i++) {
		struct ap_dp_seg *sg = deferred.at[i].sg;
		struct dp_rep *rr = &sg->rep[deferred.at[i].ring];
		pthread_mutex_lock(&rr->mu);
		int r = atomic_load(&sg->dead) ? -EPIPE : ap_ring_publish(&rr->r) < 0 ? -EPROTO : 0;
		pthread_mutex_unlock(&rr->mu);
		written(sg, r);
		ap_dp_seg_put(sg);
	}
	deferred.n = deferred.answers = 0;
}

static void defer_publish(struct ap_dp_seg *sg, unsigned ring)
{
	int i = 0;
	while (i < deferred.n && (deferred.at[i].sg != sg || deferred.at[i].ring != ring))
		i++;
	if (i == deferred.n) {
		if (i == DP_DEFER_RINGS) {
			publish_deferred();
			i = 0;
		}
		ap_dp_seg_get(sg);
		deferred.at[i].sg = sg;
		deferred.at[i].ring = ring;
		deferred.n = i + 1;
	}
	if (++deferred.answers >= DP_DEFER_ANSWERS)
		publish_deferred();
}

void dp_read_end(void)
{
	deferred.reading = 0;
	publish_deferred();
}

/* A read begins: the loop's inline answers wait for its end (dp_read_end).
 * Whether one was under way already. */
int dp_read_begin(void)
{
	int was = deferred.reading;
	deferred.reading = 1;
	return was;
}

int dp_reply(struct ap_dp_seg *sg, unsigned ring, uint64_t ask_id, const void *term, size_t len,
		 enum rep_mode mode)
{
	if (atomic_load_explicit(&sg->dead, memory_order_acquire))
		return 0;
	uint32_t n_rep = sg->s.n_rep;
	/* Held briefly by everyone (a worker waiting for room sleeps without
	 * it), so the loop takes it too; the loop itself never waits for room. */
	struct dp_rep *rr = &sg->rep[ring % n_rep];
	pthread_mutex_lock(&rr->mu);
	char big[AP_ERROR_TERM_MAX];
	if (len > ap_ring_max_payload(sg->s.rep_cap) - sizeof(struct ap_dp_rep)) {
		len = ap_enc_error_term(big, "reply_too_large");
		term = big;
	}
	int defer = mode == REP_NOWAIT && deferred.reading;
	int r = atomic_load(&sg->dead) ? -EPIPE : rep_write(rr, ask_id, term, len, 0, !defer);
	/* One wait per stuck episode: a BEAM that stopped reading would
	 * otherwise cost every worker a second per answer, slowing the pool
	 * for every other caller. Until something fits again, answers to it
	 * are dropped at once (its asks time out; it is not reading them). */
	if (r == -ETIMEDOUT && mode == REP_WORKER && !rr->stuck) {
		r = rep_write_slow(sg, rr, ask_id, term, len);
		if (r == -ETIMEDOUT)
			rr->stuck = 1;
	}
	if (r == 0)
		rr->stuck = 0;
	pthread_mutex_unlock(&rr->mu);
	if (r == -ETIMEDOUT && mode == REP_NOWAIT)
		return -EAGAIN;
	if (r == 0 && defer)
		defer_publish(sg, ring % n_rep);
	else
		written(sg, r);
	return 0;
}

/* Loop thread: {error, Reason} to ask_id; never waits (a full ring drops it). */
void ap_dp_reply_error_loop(struct ap_dp_seg *sg, uint64_t ask_id, const char *reason)
{
	char tmp[AP_ERROR_TERM_MAX];
	size_t len = ap_enc_error_term(tmp, reason);
	dp_reply(sg, (unsigned)(ask_id % sg->s.n_rep), ask_id, tmp, len, REP_LOOP);
}

/* ---- the ring route ----------------------------------------------------------
 * An ask's answer is a record in a reply ring of its segment, under its
 * ask id: a worker's in its own ring (ring = the worker's id, so workers
 * rarely share a ring's lock), the loop's own errors in the ask's (ask_id
 * mod the rings). The route holds a reference on the segment (taken by
 * handle before it dispatches), dropped as the ask is answered. An answer
 * over the ring's largest record becomes {error, reply_too_large}. A
 * worker waits up to DP_REPLY_WAIT_MS for room in a full ring, then drops
 * the answer with a log line; the loop running a job itself hears -EAGAIN
 * (its answers are published at the end of the read, or per
 * DP_DEFER_ANSWERS). A detached or broken segment drops answers. */

static int ring_send(const ap_route *r, const char *addr, uint8_t *b, size_t len, unsigned worker,
		     ap_send_mode mode)
{
	(void)addr;
	struct ap_dp_seg *sg = r->ctx;
	if (mode == AP_SEND_LOOP)
		(void)dp_reply(sg, (unsigned)(r->id % sg->s.n_rep), r->id, b, len, REP_LOOP);
	else if (dp_reply(sg, worker, r->id, b, len, mode == AP_SEND_NOWAIT ? REP_NOWAIT : REP_WORKER) == -EAGAIN)
		return -EAGAIN; /* the hold stays with the answer, for its worker to deliver */
	ap_dp_seg_put(sg);
	return 0;
}

static void ring_drop(const ap_route *r) { ap_dp_seg_put(r->ctx); }

/* The node name the segment's BEAM gave when it attached: set before the
 * segment is registered, never changed after. */
static const char *ring_peer(const ap_route *r, const char *addr)
{
	(void)addr;
	return ((const struct ap_dp_seg *)r->ctx)->peer;
}

const ap_route_ops dp_ring_route = { .send = ring_send, .drop = ring_drop, .peer = ring_peer, .batched = 1 };


/* ---- detach (loop thread) -------------------------------------------------------- */

/* Out of the registry, replies dropped, wait cancelled, the socket closed
 * (by the attach thread), the registry's reference dropped. */
void dp_detach(struct ap_dp_seg *sg, const char *why)
{
	if (sg->slot < 0)
		return;
	ap_log(AP_LOG_INFO, "ring segment %u of %s detached: %s (%llu bad records)", sg->id, sg->peer, why,
	       (unsigned long long)sg->bad);
	ap_dp.segs[sg->slot] = NULL;
	ap_dp.n_live--;
	sg->slot = -1;
	while (ap_dp.top > 0 && !ap_dp.segs[ap_dp.top - 1])
		ap_dp.top--;
	atomic_store_explicit(&sg->dead, 1, memory_order_release);
	ap_seg_close(sg->s.hdr, AP_SEG_CLOSED_NODE);
	if (sg->fw_armed && ap_dp.bell_fd < 0)
		ap_node_futex_cancel(ap_dp.n, &sg->fw); /* its completion drops the wait's reference */
	else
		sg->fw_armed = 0;
	atomic_store(&sg->close_req, 1);
	uint64_t one = 1;
	(void)!write(ap_dp.efd, &one, sizeof one);
	ap_dp_seg_put(sg);
}
