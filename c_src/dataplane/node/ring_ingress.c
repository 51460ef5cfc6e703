/* ring_ingress: the pool node's side of the same-host data plane
 * (c_src/ring/ap_seg.h is the contract; docs/runtime.md, "Ring ingress").
 *
 *  - An abstract AF_UNIX socket and a random token, both drawn at start
 *    and handed out by the manager (dp_info) over distribution.
 *  - An attach thread: accepts, runs each handshake (SO_PEERCRED, hello,
 *    memfd, ap_seg_parse, ack) without ever blocking on one peer (poll,
 *    a deadline each, at most DP_MAX_ATTACHING at once, at most
 *    DP_MAX_SEGS segments attached), then watches every attached socket
 *    for EOF. It hands segments to the loop with ap_node_call_on_loop.
 *  - The loop thread is the one consumer of every request ring: it drains
 *    them (records validated, fences followed, dispatched through
 *    ap_pool_dispatch), woken by an io_uring FUTEX_WAIT on the segment's
 *    request bell or, on epoll, by the node's bell pipe (the loop reads
 *    it, every BEAM got its write end with the ack and writes a byte
 *    instead of a futex wake; one bell for all segments: a ring drains
 *    every segment); and before
 *    sleeping it spins briefly over its segments when they were busy.
 *  - Replies go into the segment's reply rings, from workers (a mutex per
 *    ring) and from the loop (errors; never waiting).
 *
 * A segment is reference counted (ap_dp_seg_get/put): the registry, the
 * attach thread's socket, an armed wait (uring), each call posted to the
 * loop, and each ring ask's route (handle takes it; the ask's answer, or
 * its drop, releases it: ring_send, ring_drop). Detached (peer EOF, a broken
 * ring, the peer's closed bit) means: out of the registry, no more reads,
 * replies dropped; the memory goes with the last reference, so an armed
 * io_uring wait is cancelled and reaped first.
 */
/* Over 700 lines on purpose: the segment's reference count is taken and
 * dropped by the attach thread, the loop and io_uring waits; every path
 * that holds one is in this file, so the count can be audited in one
 * read. The records' format and checks are ap_seg.c's. */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <sched.h>
#include <string.h>
#include <time.h>
#include <sys/eventfd.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include "ap_log.h"
#include "ap_seg.h"
#include "ap_skip.h"
#include "ap_spin.h"
#include "ap_term.h"
#include "ap_time.h"
#include "isolate.h"
#include "pool_int.h"
#include "ring_ingress.h"

#define DP_MAX_ATTACHING 64  /* handshakes in progress at once */
#define DP_MAX_SEGS 256      /* segments attached at once */
#define DP_WAIT_MS 1000      /* a bell wait's timeout: a hostile peer may never ring */
#define DP_REPLY_WAIT_MS 1000 /* a worker waits this long for room in a full reply ring */
#define DP_IDLE_SPIN_MAX_ROUNDS 200 /* at most this many pause rounds over the segments before the loop sleeps */
#define DP_IDLE_SPIN_HOT_MS 2       /* ... only while records came this recently */
#define DP_IDLE_SPIN_MIN_ROUNDS 8   /* the adaptive spin's first step up (ap_spin.h) */
#define DP_BUDGET 4096       /* records per ring per drain: distribution is not starved */
#define DP_PREFETCH 512      /* bytes of the records ahead fetched while one is handled */
#define DP_ISO_WAIT_US 60    /* how long the loop waits, yielding, for worker processes' answers before a nap */
#define DP_ISO_SKIP_MAX 256  /* after such waits that ran out, at most this many reads wait for none */
#define DP_NAP_MIN 3         /* records waiting for one read that make the traffic dense (dp_idle's nap) */
#define DP_LONE_SKIP_MAX 256 /* after windows that caught nothing, at most this many lone asks open none */
#define DP_LOG_GAP_MS 1000   /* bad-record log lines, at most one per segment per second */
#define DP_DEST_CACHE_MAX 128 /* bytes of a destination that resolve keeps (a pid of a long node name: not) */

struct dp_rep {
	pthread_mutex_t mu;
	struct ap_ring r;
	unsigned sleepers; /* workers waiting for room (under mu, which they do not hold asleep) */
	int stuck;         /* under mu: a wait for room timed out and nothing fit since */
};

struct ap_dp_seg {
	_Atomic int refs;
	_Atomic int dead; /* detached: replies are dropped */
	_Atomic int rep_broken; /* a reply ring broke: the detach is on its way */
	uint32_t id;
	struct ap_ring_map map;
	struct ap_seg s;
	struct ap_ring *req; /* n_req consumer views: loop thread only */
	uint64_t *seen;      /* per request ring: the position released (not the shared head, which the BEAM can write) */
	uint8_t *busy;       /* per request ring: being drained (fences never re-enter it) */
	struct dp_rep *rep;  /* n_rep producer views */
	char peer[AP_SEG_MAX_NAME + 1];
	uint32_t os_pid;
	/* attach thread */
	int sock;
	_Atomic int close_req; /* the loop asks the attach thread to close sock */
	/* loop thread */
	int slot;            /* in the registry; -1 once detached */
	ap_io_futex fw;      /* io_uring: the wait on req_bell */
	int fw_armed;        /* the flag is up and (uring) fw is in flight */
	int64_t last_bad_ms;
	uint64_t bad, dropped_replies;
};

static struct {
	ap_node *n;
	int enabled;
	int uring;
	struct sockaddr_un addr;
	socklen_t addr_len;
	char name[sizeof(((struct sockaddr_un *)0)->sun_path)]; /* abstract: name[0] == 0 */
	size_t name_len;
	uint8_t token[AP_SEG_TOKEN_LEN];
	int lfd, efd;
	int bell_fd, bell_tx; /* epoll: the bell pipe's ends, the loop's and the BEAMs' (ap_seg.h, attach step 4) */
	pthread_t th;
	_Atomic int nsegs; /* attached or being handed over: the cap's count */
	uint32_t next_id;
	/* loop thread */
	struct ap_dp_seg *segs[DP_MAX_SEGS];
	int n_live;
	int top;  /* slots at and above this are empty: the idle spin scans below it */
	struct ap_spin spin; /* the idle spin (dp_idle) */
	int64_t hot_until_ms;
	/* The yield instead of sleep (dp_idle): how long after records, when
	 * the last records came, and the gap before them. */
	int poll_us;
	int64_t found_us, gap_us;
	/* After an ask that was its BEAM's only one waiting (req_lone): the
	 * loop yields until lone_until_us (ring_lone_poll_us; 0: no window).
	 * Windows that end with nothing read make later lone asks open none
	 * (ap_skip.h). */
	int lone_us;
	int64_t lone_until_us;
	struct ap_skip lone_skip;
	unsigned long long lone_windows; /* node_stats (relaxed, any thread may read) */
	/* Whether the worker processes were told that the loop takes their
	 * results (iso_pass). */
	int iso_looking;
	/* iso_await: waits that ran out make later ones skip (a slow
	 * handler's answers come after any wait); how many caught every
	 * answer and how many ran out (node_stats; relaxed). */
	struct ap_skip iso_skip;
	unsigned long long iso_waits, iso_waits_missed;
	/* The nap (dp_idle): its length, that after a read with asks, whether
	 * the last read was dense and had asks, whether the segment's read
	 * under way met an ask, how many naps so far and how many of them
	 * after asks (node_stats; relaxed, any thread may read). */
	int nap_us, ask_nap_us;
	int dense, dense_asks;
	int read_asked;
	unsigned long long naps, ask_naps;
	ap_buf copy; /* a record copied out of shared memory */
	/* The last destination resolved, by its bytes (see resolve). */
	struct {
		uint64_t pools_gen; /* ap_pool_generation() then; 0: empty */
		ap_pool *pool;
		uint32_t len;
		uint8_t kind;
		uint8_t bytes[DP_DEST_CACHE_MAX];
	} last;
} dp = { .lfd = -1, .efd = -1, .bell_fd = -1, .bell_tx = -1,
	  .spin = { .min_rounds = DP_IDLE_SPIN_MIN_ROUNDS, .max_rounds = DP_IDLE_SPIN_MAX_ROUNDS } };

static void detach(struct ap_dp_seg *sg, const char *why);

/* ---- references ------------------------------------------------------------ */

static void ap_dp_seg_get(struct ap_dp_seg *sg) { atomic_fetch_add_explicit(&sg->refs, 1, memory_order_relaxed); }

static void seg_free(struct ap_dp_seg *sg)
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

static void ap_dp_seg_put(struct ap_dp_seg *sg)
{
	if (atomic_fetch_sub_explicit(&sg->refs, 1, memory_order_acq_rel) == 1) {
		atomic_fetch_sub(&dp.nsegs, 1);
		seg_free(sg);
	}
}

/* ---- replies ----------------------------------------------------------------- */

static void rep_broken(ap_node *n, void *arg)
{
	(void)n;
	struct ap_dp_seg *sg = arg;
	detach(sg, "a reply ring is broken");
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
		 * the loop gets round to the detach. */
		atomic_store_explicit(&sg->dead, 1, memory_order_release);
		if (!atomic_exchange(&sg->rep_broken, 1)) {
			ap_log(AP_LOG_WARNING, "reply ring of %s is broken; detaching it", sg->peer);
			ap_dp_seg_get(sg);
			if (ap_node_call_on_loop(dp.n, rep_broken, sg))
				ap_dp_seg_put(sg);
		}
	} else if (r != -EPIPE) {
		ap_log(AP_LOG_WARNING, "ring reply to %s dropped: %s", sg->peer,
		       r == -ETIMEDOUT ? "its reply ring stayed full" : strerror(-r));
	}
}

/* Answers the loop made itself (inline runs) are written at once but
 * published at the end of the ring read that made them (end_read), or
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

static void end_read(void)
{
	deferred.reading = 0;
	publish_deferred();
}

/* The results of worker processes whose proxies sleep, taken by the
 * loop itself (ap_iso_take_direct) while it is busy with ring traffic,
 * their answers published with the loop's own at the end of the read:
 * neither the child nor its proxy wakes for them. looks 0: the loop is
 * about to sleep; the children ring their proxies again from now on
 * (what came before is taken here once more). */
static int iso_pass(int looks)
{
	if (!looks && !dp.iso_looking)
		return 0;
	dp.iso_looking = looks;
	int reading = deferred.reading;
	deferred.reading = 1;
	int flags = ap_iso_take_all(looks);
	if (!reading)
		end_read();
	return flags;
}

/* After a dense read with asks, before its nap: while worker processes
 * hold asks the loop sent them, the loop gives its CPU away and takes
 * their answers as they come, for at most DP_ISO_WAIT_US. Napping at
 * once, the answers of a batch came during the nap: each child rang its
 * proxy, which woke (a run-queue wait of ~20 us on a busy 2-CPU host)
 * and published them apart from the others', and the BEAM's reply
 * thread woke for each part. Yielding, the loop's CPU goes to a woken
 * child at once, the batch's answers go out in a few publishes, and the
 * proxies sleep on (64 callers, process mode, twelve alternating passes:
 * 236-358K asks/s against 200-296K). A slow handler's answer comes after
 * the wait, as before; thread-mode pools never make the loop wait. */
static void iso_await(void)
{
	if (!(iso_pass(1) & AP_ISO_ASKS_OUT) || !ap_skip_wait(&dp.iso_skip))
		return;
	int64_t until = ap_mono_us() + DP_ISO_WAIT_US;
	for (;;) {
		sched_yield();
		int f = iso_pass(1);
		if (!(f & AP_ISO_ASKS_OUT)) {
			/* Ended by a proxy (awake, or left an answer): not
			 * the loop's catch, and no sign of a slow handler. */
			if (!(f & AP_ISO_PROXY)) {
				ap_skip_hit(&dp.iso_skip);
				__atomic_store_n(&dp.iso_waits, dp.iso_waits + 1, __ATOMIC_RELAXED);
			}
			return;
		}
		if (ap_mono_us() >= until) {
			ap_skip_miss(&dp.iso_skip, DP_ISO_SKIP_MAX);
			__atomic_store_n(&dp.iso_waits_missed, dp.iso_waits_missed + 1, __ATOMIC_RELAXED);
			return;
		}
	}
}

/* How a writer meets a full reply ring: a worker waits (once per stuck
 * episode), the loop drops its own error answers, and an inline run
 * (nowait) hears -EAGAIN and hands its answer to the worker. */
enum rep_mode { REP_WORKER, REP_LOOP, REP_NOWAIT };

static int reply(struct ap_dp_seg *sg, unsigned ring, uint64_t ask_id, const void *term, size_t len,
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
static void ap_dp_reply_error_loop(struct ap_dp_seg *sg, uint64_t ask_id, const char *reason)
{
	char tmp[AP_ERROR_TERM_MAX];
	size_t len = ap_enc_error_term(tmp, reason);
	reply(sg, (unsigned)(ask_id % sg->s.n_rep), ask_id, tmp, len, REP_LOOP);
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
		(void)reply(sg, (unsigned)(r->id % sg->s.n_rep), r->id, b, len, REP_LOOP);
	else if (reply(sg, worker, r->id, b, len, mode == AP_SEND_NOWAIT ? REP_NOWAIT : REP_WORKER) == -EAGAIN)
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

static const ap_route_ops ring_route = { .send = ring_send, .drop = ring_drop, .peer = ring_peer, .batched = 1 };

/* ---- the ingress: records -> requests (loop thread) -------------------------- */

static void bad_record(struct ap_dp_seg *sg, uint32_t ring, const char *why)
{
	sg->bad++;
	int64_t now = ap_node_now_ms(dp.n);
	if (now - sg->last_bad_ms >= DP_LOG_GAP_MS || sg->bad == 1) {
		sg->last_bad_ms = now;
		ap_log(AP_LOG_WARNING, "bad ring record from %s (ring %u): %s; skipped (%llu so far)", sg->peer, ring,
		       why, (unsigned long long)sg->bad);
	}
}

static int resolve_bytes(const struct ap_dp_req *h, const char *dest, ap_pool **pool)
{
	*pool = NULL;
	if (h->dest_kind == AP_DP_DEST_NAME) {
		char name[MAXATOMLEN_UTF8];
		if (h->dest_len < 1 || h->dest_len >= sizeof name || memchr(dest, 0, h->dest_len))
			return -1;
		memcpy(name, dest, h->dest_len);
		name[h->dest_len] = 0;
		*pool = ap_pool_find(dp.n, name, NULL);
		return 0;
	}
	erlang_pid pid;
	int i = 0, type, size;
	if (ap_term_end(dest, h->dest_len, 0) != (int)h->dest_len || ei_get_type(dest, &i, &type, &size) ||
	    type != ERL_PID_EXT || ei_decode_pid(dest, &i, &pid))
		return -1;
	*pool = ap_pool_find(dp.n, NULL, &pid);
	return 0;
}

/* The pool a destination names (*pool NULL: nobody by that name or pid),
 * or -1 when the destination is not a name or pid at all (a bad record).
 * Records to one pool come in streams: the bytes of the last destination
 * that resolved are kept with its answer, valid until a pool starts or
 * stops (the answer may change then, and a pool stopped may be freed).
 * Decoding the pid (ei's atom and pid decoding, the walk of the pools with
 * strcmp) was a tenth of the loop's time under a tell flood. Bytes equal
 * to bytes that passed the checks pass them again. */
static int resolve(const struct ap_dp_req *h, const char *dest, ap_pool **pool)
{
	uint64_t gen = ap_pool_generation();
	if (dp.last.pools_gen == gen && dp.last.kind == h->dest_kind && dp.last.len == h->dest_len &&
	    !memcmp(dp.last.bytes, dest, h->dest_len)) {
		*pool = dp.last.pool;
		return 0;
	}
	if (resolve_bytes(h, dest, pool))
		return -1;
	dp.last.pools_gen = 0;
	if (h->dest_len <= sizeof dp.last.bytes) {
		memcpy(dp.last.bytes, dest, h->dest_len);
		dp.last.len = h->dest_len;
		dp.last.kind = h->dest_kind;
		dp.last.pool = *pool;
		dp.last.pools_gen = gen;
	}
	return 0;
}

static int drain_to(struct ap_dp_seg *sg, uint32_t ring, uint64_t upto, int depth);

/* A tell to a destination with no pool (resolve vouched for its bytes). */
static void no_pool_tell(struct ap_dp_seg *sg, const struct ap_dp_req *h, const char *dest)
{
	erlang_pid pid;
	int i = 0;
	if (h->dest_kind == AP_DP_DEST_NAME)
		ap_pool_no_pool(sg->peer, dest, h->dest_len, NULL, 1);
	else
		ap_pool_no_pool(sg->peer, NULL, 0, ei_decode_pid(dest, &i, &pid) ? NULL : &pid, 1);
}

/* One record of request ring `ring`: its payload p (shared memory, len
 * bytes read once and checked by the ring). */
static void handle(struct ap_dp_seg *sg, uint32_t ring, const uint8_t *p, size_t len, int depth)
{
	struct ap_dp_req h;
	if (len < sizeof h) {
		bad_record(sg, ring, "shorter than its header");
		return;
	}
	memcpy(&h, p, sizeof h);
	if (len != sizeof h + (size_t)h.dest_len + h.msg_len) {
		bad_record(sg, ring, "lengths do not add up");
		return;
	}
	if ((h.kind != AP_DP_TELL && h.kind != AP_DP_ASK && h.kind != AP_DP_STATS) ||
	    (h.dest_kind != AP_DP_DEST_NAME && h.dest_kind != AP_DP_DEST_PID)) {
		bad_record(sg, ring, "unknown kind");
		return;
	}
	/* The process's earlier records, in another ring, go first. */
	if (h.fence_ring != AP_DP_NO_FENCE && h.fence_ring != ring && h.fence_ring < sg->s.n_req &&
	    depth < AP_SEG_MAX_FENCE_DEPTH && !sg->busy[h.fence_ring]) {
		if (drain_to(sg, h.fence_ring, h.fence_pos, depth + 1) < 0)
			return; /* that ring broke: the segment is detached */
	}
	/* Copied out first: the peer may still change the bytes while they are
	 * checked and queued. */
	size_t body = len - sizeof h;
	dp.copy.len = 0;
	if (ap_buf_append(&dp.copy, p + sizeof h, body)) {
		if (h.kind != AP_DP_TELL)
			ap_dp_reply_error_loop(sg, h.ask_id, "enomem");
		return;
	}
	const char *dest = (const char *)dp.copy.data, *msg = dest + h.dest_len;
	ap_pool *pool;
	if (resolve(&h, dest, &pool)) {
		bad_record(sg, ring, "the destination is not a name or a pid");
		return;
	}
	if (h.kind != AP_DP_TELL)
		dp.read_asked = 1;
	if (h.kind == AP_DP_STATS) {
		if (!pool) {
			ap_dp_reply_error_loop(sg, h.ask_id, "noproc");
			return;
		}
		ei_x_buff x;
		if (ei_x_new(&x))
			return;
		ap_pool_encode_stats(pool, &x);
		reply(sg, (unsigned)(h.ask_id % sg->s.n_rep), h.ask_id, x.buff, (size_t)x.index, REP_LOOP);
		ei_x_free(&x);
		return;
	}
	if (h.msg_len == 0 || h.msg_len > INT32_MAX || ap_term_end(msg, h.msg_len, 0) != (int)h.msg_len) {
		bad_record(sg, ring, "the message is not one whole term");
		return;
	}
	if (!pool) {
		if (h.kind == AP_DP_ASK)
			ap_dp_reply_error_loop(sg, h.ask_id, "noproc");
		else
			no_pool_tell(sg, &h, dest); /* dropped, as distribution drops it: counted, logged */
		return;
	}
	pool->by_ring++;
	if (h.kind == AP_DP_ASK) {
		ap_dp_seg_get(sg); /* the route's hold: its job's, or the loop's answer's */
		ap_pool_dispatch(pool, &(ap_request){ .kind = AP_REQ_ASK, .route = { &ring_route, sg, h.ask_id },
						      .msg = msg, .msg_len = (int)h.msg_len });
	} else {
		ap_pool_dispatch(pool, &(ap_request){ .kind = AP_REQ_TELL, .route = { &ring_route, NULL, 0 },
						      .msg = msg, .msg_len = (int)h.msg_len });
	}
}

/* Reads ring `ring` while its read position is before upto, at most
 * budget records. The number handled, or -1 if the ring broke (then the
 * segment is detached). *waited (when not NULL): plus the records that
 * were in the ring before the read began (published before `mark`, the
 * tail then), as opposed to those published while it ran. */
static int drain_ring(struct ap_dp_seg *sg, uint32_t ring, uint64_t upto, int budget, int depth, uint64_t mark,
		      int *waited)
{
	struct ap_ring *r = &sg->req[ring];
	int done = 0;
	uintptr_t pf = 0;
	sg->busy[ring] = 1;
	while (done < budget && r->pos < upto && sg->slot >= 0) {
		const void *p;
		size_t len;
		if (waited && r->pos < mark)
			(*waited)++;
		int rc = ap_ring_read(r, &p, &len);
		if (rc == -EAGAIN)
			break;
		if (rc < 0) {
			sg->busy[ring] = 0;
			ap_log(AP_LOG_WARNING, "request ring %u of %s is broken (%s)", ring, sg->peer, strerror(-rc));
			detach(sg, "a request ring is broken");
			return -1;
		}
		/* The records ahead were written on another core: fetch their
		 * lines while this one is handled, not one miss at a time (the
		 * first read of a record's bytes was a third of the loop's time
		 * under a tell flood). A prefetch past the ring never faults;
		 * after a wrap it starts again from here. */
		uintptr_t end = (uintptr_t)p + len;
		if (pf < end || pf > end + 2 * DP_PREFETCH)
			pf = end;
		for (; pf < end + DP_PREFETCH; pf += 64)
			__builtin_prefetch((const void *)pf);
		handle(sg, ring, p, len, depth);
		done++;
	}
	sg->busy[ring] = 0;
	if (sg->slot >= 0) {
		ap_ring_release(r);
		__atomic_store_n(&sg->seen[ring], r->pos, __ATOMIC_RELEASE);
	}
	return sg->slot >= 0 ? done : -1;
}

/* A fence: ring up to upto. Those records were committed before the one
 * carrying the fence, so this never waits; an empty ring ends it (a stale
 * or hostile fence). Bounded: at most cap bytes lie before upto. */
static int drain_to(struct ap_dp_seg *sg, uint32_t ring, uint64_t upto, int depth)
{
	return drain_ring(sg, ring, upto, INT32_MAX, depth, 0, NULL);
}

/* The lone window is open now; one that ran out with nothing read is a
 * miss: its caller asks less often than the window lasts, and the CPU it
 * spent bought nothing. One miss alone (a caller held up once: a garbage
 * collection, a slower call between asks) opens no gap: the asks skipped
 * after it would each pay the wake-up from the deepest sleep, the lone
 * asks' p99 (150 us against 91-98 us without the window, bench). */
static int lone_open(int64_t now)
{
	if (!dp.lone_until_us)
		return 0;
	if (now < dp.lone_until_us)
		return 1;
	dp.lone_until_us = 0;
	ap_skip_miss(&dp.lone_skip, DP_LONE_SKIP_MAX);
	return 0;
}

/* After a read that found records: a window open now caught them (its
 * caller came back in time: the backoff resets), and a lone ask opens the
 * next one unless misses made it skip. The BEAM's hint is in memory it
 * writes: any value other than 1 is 0, and the most it can do is keep the
 * loop yielding, which its records could as well. */
static void lone_read(struct ap_dp_seg *sg, int64_t now)
{
	if (now < dp.lone_until_us) {
		ap_skip_hit(&dp.lone_skip);
		dp.lone_until_us = 0;
	} else {
		(void)lone_open(now); /* a miss if one ran out unnoticed */
	}
	if (!dp.lone_us || __atomic_load_n(&sg->s.hdr->req_lone, __ATOMIC_RELAXED) != 1 ||
	    !ap_skip_wait(&dp.lone_skip))
		return;
	dp.lone_until_us = now + dp.lone_us;
	__atomic_store_n(&dp.lone_windows, dp.lone_windows + 1, __ATOMIC_RELAXED);
}

/* Every request ring of sg once: the records handled, or -1 (detached). */
static int drain_seg_ref(struct ap_dp_seg *sg)
{
	int total = 0;
	if (sg->slot < 0)
		return -1;
	deferred.reading = 1;
	dp.read_asked = 0; /* this read's own, whatever an earlier one left */
	if (ap_seg_closed(sg->s.hdr) & AP_SEG_CLOSED_BEAM) {
		/* The BEAM left in order: what it published before is read. */
		int broken = 0;
		for (uint32_t i = 0; i < sg->s.n_req && !broken; i++)
			broken = drain_ring(sg, i, UINT64_MAX, DP_BUDGET, 0, 0, NULL) < 0;
		end_read();
		ap_pool_wake_all_pushed();
		if (!broken) /* a broken ring detached it already */
			detach(sg, "the BEAM closed it");
		return -1;
	}
	int waited = 0;
	for (uint32_t i = 0; i < sg->s.n_req; i++) {
		/* The tail now: a hint only (the BEAM writes it), for the nap's
		 * count of records that waited for this read. */
		uint64_t mark = __atomic_load_n(&sg->req[i].hdr->tail, __ATOMIC_ACQUIRE);
		int k = drain_ring(sg, i, UINT64_MAX, DP_BUDGET, 0, mark, &waited);
		if (k < 0) {
			end_read();
			ap_pool_wake_all_pushed();
			return -1;
		}
		total += k;
	}
	iso_pass(1);
	end_read();
	ap_pool_wake_all_pushed();
	/* Dense: records queued up while the loop was elsewhere. Those that
	 * came during the read do not count: a lone caller whose next ask
	 * follows each answer at once (the loop answers on itself) would
	 * otherwise look like a crowd, and wait for a nap. */
	if (waited >= DP_NAP_MIN) {
		dp.dense = 1;
		dp.dense_asks |= dp.read_asked;
	}
	if (total) {
		int64_t now = ap_mono_us();
		dp.hot_until_ms = ap_node_now_ms(dp.n) + DP_IDLE_SPIN_HOT_MS;
		dp.gap_us = now - dp.found_us;
		dp.found_us = now;
		lone_read(sg, now);
	}
	return total;
}

/* A detach inside drops the registry's reference while the drain still
 * uses sg: it holds one of its own. */
static int drain_seg(struct ap_dp_seg *sg)
{
	ap_dp_seg_get(sg);
	int r = drain_seg_ref(sg);
	ap_dp_seg_put(sg);
	return r;
}

/* Anything committed and not yet read, by the shared indexes (any thread:
 * no view is touched). */
static int seg_pending(struct ap_dp_seg *sg)
{
	for (uint32_t i = 0; i < sg->s.n_req; i++) {
		struct ap_ring_hdr *h = sg->req[i].hdr;
		/* Our own released position: the shared head is writable by the BEAM. */
		if (__atomic_load_n(&h->tail, __ATOMIC_ACQUIRE) != __atomic_load_n(&sg->seen[i], __ATOMIC_ACQUIRE))
			return 1;
	}
	return 0;
}

/* ---- wake-ups: io_uring ------------------------------------------------------- */

static void fw_done(ap_io_futex *f, int res);

/* Sleep protocol of ap_seg.h: raise the flag, look again, then wait (on
 * epoll, the loop's own wait on bell_fd is the wait).
 * 1 when it gave up with records still coming (not armed): the loop must
 * not block then, or they wait for its next event, up to seconds. */
static int arm(struct ap_dp_seg *sg)
{
	for (int tries = 0; tries < 4 && sg->slot >= 0 && !sg->fw_armed; tries++) {
		uint32_t *word, expected;
		ap_seg_sleep_begin(sg->s.hdr, AP_SEG_BELL_REQ, &word, &expected);
		if (seg_pending(sg)) {
			ap_seg_sleep_end(sg->s.hdr, AP_SEG_BELL_REQ);
			if (drain_seg(sg) < 0)
				return 0;
			continue;
		}
		if (dp.bell_fd >= 0) {
			sg->fw_armed = 1; /* the flag is up: the BEAM writes bell_fd, on_bell reads it */
			break;
		}
		ap_dp_seg_get(sg); /* the armed wait's */
		int r = ap_node_futex_wait(dp.n, &sg->fw, word, expected, DP_WAIT_MS);
		if (r) {
			ap_seg_sleep_end(sg->s.hdr, AP_SEG_BELL_REQ);
			ap_dp_seg_put(sg);
			ap_log(AP_LOG_ERROR, "cannot wait on the bell of %s: %s", sg->peer, strerror(-r));
			return 0;
		}
		sg->fw_armed = 1;
	}
	/* Still busy after a few drains: dp_idle runs again before the loop
	 * blocks (its caller, or our 1), and the drain that finds it empty
	 * arms. */
	return sg->slot >= 0 && !sg->fw_armed;
}

static void fw_done(ap_io_futex *f, int res)
{
	struct ap_dp_seg *sg = f->arg;
	(void)res; /* woken, stale, timed out, cancelled: look again either way */
	sg->fw_armed = 0;
	if (sg->slot >= 0) {
		ap_seg_sleep_end(sg->s.hdr, AP_SEG_BELL_REQ);
		if (drain_seg(sg) >= 0)
			(void)arm(sg); /* dp_idle runs before the loop blocks */
	}
	ap_dp_seg_put(sg);
}

/* ---- wake-ups: epoll (the bell pipe, in the loop's own epoll set) ------------- */

/* Some BEAM rang: every raised flag comes down and every segment is
 * drained (one bell for all; dp_idle raises the flags again before the
 * loop blocks). A bounded read: a BEAM that floods the bell costs loop
 * wake-ups, never an endless read. */
static void on_bell(ap_node *n, void *arg)
{
	(void)n;
	(void)arg;
	char b[256];
	for (int k = 0; k < 64 && read(dp.bell_fd, b, sizeof b) == (ssize_t)sizeof b; k++)
		;
	for (int i = 0; i < dp.top; i++) {
		struct ap_dp_seg *sg = dp.segs[i];
		if (!sg)
			continue;
		if (sg->fw_armed) {
			sg->fw_armed = 0;
			ap_seg_sleep_end(sg->s.hdr, AP_SEG_BELL_REQ);
		}
		drain_seg(sg);
	}
}

/* ---- registry (loop thread) ------------------------------------------------------ */

static void seg_added(ap_node *n, void *arg)
{
	(void)n;
	struct ap_dp_seg *sg = arg; /* carries the registry's reference */
	int slot = -1;
	for (int i = 0; i < DP_MAX_SEGS; i++)
		if (!dp.segs[i]) {
			slot = i;
			break;
		}
	if (slot < 0 || atomic_load(&sg->dead)) {
		atomic_store(&sg->dead, 1);
		atomic_store(&sg->close_req, 1);
		uint64_t one = 1;
		(void)!write(dp.efd, &one, sizeof one);
		ap_dp_seg_put(sg);
		return;
	}
	sg->slot = slot;
	dp.segs[slot] = sg;
	dp.n_live++;
	if (slot >= dp.top)
		dp.top = slot + 1;
	ap_log(AP_LOG_INFO, "ring segment %u attached: %s (os pid %u), %u request rings of %llu bytes, %u reply rings of %llu bytes, wake-ups by %s",
	       sg->id, sg->peer, sg->os_pid, sg->s.n_req, (unsigned long long)sg->s.req_cap, sg->s.n_rep,
	       (unsigned long long)sg->s.rep_cap, dp.uring ? "io_uring futex wait" : "the bell pipe");
	sg->fw.done = fw_done;
	sg->fw.arg = sg;
	(void)arm(sg); /* dp_idle runs before the loop blocks */
}

/* Loop thread: out of the registry, replies dropped, wait cancelled, the
 * socket closed (by the attach thread), the registry's reference dropped. */
static void detach(struct ap_dp_seg *sg, const char *why)
{
	if (sg->slot < 0)
		return;
	ap_log(AP_LOG_INFO, "ring segment %u of %s detached: %s (%llu bad records)", sg->id, sg->peer, why,
	       (unsigned long long)sg->bad);
	dp.segs[sg->slot] = NULL;
	dp.n_live--;
	sg->slot = -1;
	while (dp.top > 0 && !dp.segs[dp.top - 1])
		dp.top--;
	atomic_store_explicit(&sg->dead, 1, memory_order_release);
	ap_seg_close(sg->s.hdr, AP_SEG_CLOSED_NODE);
	if (sg->fw_armed && dp.bell_fd < 0)
		ap_node_futex_cancel(dp.n, &sg->fw); /* its completion drops the wait's reference */
	else
		sg->fw_armed = 0;
	atomic_store(&sg->close_req, 1);
	uint64_t one = 1;
	(void)!write(dp.efd, &one, sizeof one);
	ap_dp_seg_put(sg);
}

static void peer_gone(ap_node *n, void *arg)
{
	(void)n;
	struct ap_dp_seg *sg = arg;
	/* What the BEAM published before it closed the socket (an orderly
	 * close may reach us as EOF before its closed bit) is read first. */
	drain_seg(sg);
	detach(sg, "its socket closed");
	ap_dp_seg_put(sg); /* the attach thread's */
}

/* Every segment with records pending read once: 1 if any were read. */
static int drain_pending(void)
{
	int found = 0;
	for (int i = 0; i < dp.top; i++) {
		struct ap_dp_seg *sg = dp.segs[i];
		if (sg && seg_pending(sg) && drain_seg(sg) > 0)
			found = 1;
	}
	return found;
}

/* Before the loop sleeps: drain what came since, spinning a little while
 * the segments are busy, so a stream of records costs no wake-up each.
 * The spin adapts: it doubles when it found records and halves when it
 * did not. A lone ask's next record is a whole round trip away (tens of
 * microseconds), so its spins find nothing and drop to none; a fixed
 * spin after every dispatch took the CPU the woken worker and the BEAM
 * needed on a 2-core host (41% of the pool node's samples, 45-65 us of
 * its CPU per lone ask). */
static int dp_idle(ap_node *n, void *arg)
{
	(void)arg;
	if (!dp.n_live) {
		iso_pass(0);
		return 0;
	}
	/* DP_NAP_MIN or more records waited for the last read: they come
	 * faster than the loop handles them one by one. Sleep nap_us
	 * with the bell flag down, then read everything that came: the BEAM
	 * rings no bell meanwhile, and the CPU is free for its senders.
	 * Spinning (or yielding) instead kept one of 2 CPUs busy looking at
	 * empty rings (58% of the pool node's samples under a tell flood)
	 * while the BEAM's two schedulers shared the other one. A record
	 * waits at most nap_us more; sparse traffic (a lone ask) never naps.
	 * After a read with asks the nap is ask_nap_us: their callers wait,
	 * and the BEAM, done with their answers, would idle through the rest
	 * of a tell's nap (64 callers: 317-323K asks/s with 100 us, 375-400K
	 * with 5-30 us; tells gain from the longer one, and nobody waits). */
	int nap_us = !dp.dense ? 0 : dp.dense_asks ? dp.ask_nap_us : dp.nap_us, asks = dp.dense_asks;
	dp.dense = dp.dense_asks = 0;
	if (nap_us) {
		struct timespec ts = { .tv_sec = 0, .tv_nsec = (long)nap_us * 1000 };
		__atomic_store_n(&dp.naps, dp.naps + 1, __ATOMIC_RELAXED);
		if (asks) {
			__atomic_store_n(&dp.ask_naps, dp.ask_naps + 1, __ATOMIC_RELAXED);
			iso_await();
		}
		/* Not looking while napping: an answer would wait for it. */
		iso_pass(0);
		nanosleep(&ts, NULL);
		if (drain_pending())
			return 1;
	}
	unsigned spin = ap_node_now_ms(n) < dp.hot_until_ms ? dp.spin.rounds : 0;
	for (unsigned k = 0; k <= spin; k++) {
		if (drain_pending()) {
			if (k > 0)
				ap_spin_found(&dp.spin);
			else
				ap_spin_again(&dp.spin);
			return 1;
		}
		if (k < spin)
			ap_ring_cpu_relax();
	}
	ap_spin_missed(&dp.spin);
	/* Records came within poll_us, and the gap before them was as short:
	 * more are likely soon. Give the CPU away instead of sleeping, so
	 * the BEAM rings no bell for the next record (its futex wake or pipe
	 * write, several microseconds of its scheduler each on this kind of
	 * host, for every sleep the loop tries) and the loop reads it at once.
	 * Traffic with longer gaps sleeps at once, and so costs no CPU while
	 * quiet. The look that follows costs no syscall while nothing else
	 * waits (the backends' run_once with a 0 timeout). */
	int64_t now = ap_mono_us();
	int lone = lone_open(now);
	if (lone || (dp.poll_us && dp.gap_us < dp.poll_us && now - dp.found_us < dp.poll_us)) {
		if (!(iso_pass(1) & AP_ISO_TOOK))
			sched_yield();
		/* Waiting for a lone caller, the sockets are looked at on every
		 * turn: on epoll a look costs a syscall, and a loop busy with
		 * records makes one per 50 us at most; a distribution round
		 * trip waited for that while the loop yielded for a lone
		 * caller (139-143 us against 80-93 us). Between the records of
		 * a flood, the rate holds: looking on every turn there cost
		 * its tells (2.15-2.41M against 2.50-2.84M, epoll). */
		return lone ? 2 : 1;
	}
	iso_pass(0);
	int busy = 0;
	for (int i = 0; i < dp.top; i++)
		if (dp.segs[i] && !dp.segs[i]->fw_armed)
			busy |= arm(dp.segs[i]);
	return busy;
}

/* ---- the attach thread ---------------------------------------------------------- */

struct attaching {
	int fd;
	int64_t deadline_ms;
	int stage; /* 0 hello, 1 name, 2 fd */
	size_t got;
	struct ap_seg_hello hello;
	char name[AP_SEG_MAX_NAME + 1];
};

static int send_ack(int fd, uint32_t status)
{
	struct ap_seg_ack a = { .magic = AP_SEG_HELLO_MAGIC, .status = status };
	return send(fd, &a, sizeof a, MSG_NOSIGNAL | MSG_DONTWAIT) == (ssize_t)sizeof a ? 0 : -1;
}

static void refuse(struct attaching *a, uint32_t status, const char *why)
{
	ap_log(AP_LOG_WARNING, "ring attach%s%s refused: %s", a->stage > 0 ? " of " : "", a->stage > 0 ? a->name : "",
	       why);
	if (status)
		(void)send_ack(a->fd, status);
	close(a->fd);
	a->fd = -1;
}

static int token_ok(const uint8_t *t)
{
	uint8_t d = 0;
	for (int i = 0; i < AP_SEG_TOKEN_LEN; i++)
		d |= (uint8_t)(t[i] ^ dp.token[i]);
	return d == 0;
}

/* Maps and parses the segment in mfd, attaches every ring. 0, or a
 * positive errno for the ack. */
static uint32_t make_seg(struct attaching *a, int mfd, struct ap_dp_seg **out)
{
	struct ap_dp_seg *sg = calloc(1, sizeof *sg);
	if (!sg) {
		close(mfd);
		return ENOMEM;
	}
	sg->map.fd = -1;
	int r = ap_ring_map_open_fd(&sg->map, mfd, AP_SEG_HDR_SIZE);
	if (r) {
		close(mfd);
		free(sg);
		return (uint32_t)-r;
	}
	uint32_t st = EINVAL;
	if (ap_seg_parse(&sg->s, sg->map.mem, sg->map.size))
		goto fail;
	sg->req = calloc(sg->s.n_req, sizeof *sg->req);
	sg->busy = calloc(sg->s.n_req, 1);
	sg->seen = calloc(sg->s.n_req, sizeof *sg->seen);
	sg->rep = calloc(sg->s.n_rep, sizeof *sg->rep);
	if (!sg->req || !sg->busy || !sg->rep || !sg->seen) {
		st = ENOMEM;
		goto fail;
	}
	for (uint32_t i = 0; i < sg->s.n_req; i++) {
		if (ap_ring_attach_consumer(&sg->req[i], ap_seg_req(&sg->s, i), ap_seg_req_size(&sg->s)))
			goto fail;
		sg->seen[i] = sg->req[i].pos;
	}
	for (uint32_t i = 0; i < sg->s.n_rep; i++)
		if (ap_ring_attach_producer(&sg->rep[i].r, ap_seg_rep(&sg->s, i), ap_seg_rep_size(&sg->s)))
			goto fail;
	for (uint32_t i = 0; i < sg->s.n_rep; i++)
		pthread_mutex_init(&sg->rep[i].mu, NULL);
	memcpy(sg->peer, a->name, sizeof sg->peer);
	sg->os_pid = a->hello.os_pid;
	sg->slot = -1;
	sg->id = ++dp.next_id;
	*out = sg;
	return 0;
fail:
	free(sg->req);
	free(sg->busy);
	free(sg->seen);
	free(sg->rep);
	ap_ring_map_close(&sg->map);
	free(sg);
	return st;
}

/* One step of a handshake, when its socket is readable. */
static void step(struct attaching *a, struct ap_dp_seg **attached, int *nattached)
{
	ssize_t k;
	if (a->stage == 0) {
		k = recv(a->fd, (uint8_t *)&a->hello + a->got, sizeof a->hello - a->got, MSG_DONTWAIT);
		if (k <= 0) {
			if (k < 0 && (errno == EAGAIN || errno == EINTR))
				return;
			refuse(a, 0, "closed during the hello");
			return;
		}
		a->got += (size_t)k;
		if (a->got < sizeof a->hello)
			return;
		if (a->hello.magic != AP_SEG_HELLO_MAGIC || a->hello.version != AP_SEG_VERSION) {
			refuse(a, EPROTO, "not a hello of this version");
			return;
		}
		if (!token_ok(a->hello.token)) {
			refuse(a, EACCES, "wrong token");
			return;
		}
		if (a->hello.name_len > AP_SEG_MAX_NAME) {
			refuse(a, EPROTO, "node name too long");
			return;
		}
		a->stage = 1;
		a->got = 0;
	}
	if (a->stage == 1) {
		/* Exactly name_len bytes: the fd rides on the next one. */
		if (a->got < a->hello.name_len) {
			k = recv(a->fd, a->name + a->got, a->hello.name_len - a->got, MSG_DONTWAIT);
			if (k <= 0) {
				if (k < 0 && (errno == EAGAIN || errno == EINTR))
					return;
				refuse(a, 0, "closed during the hello");
				return;
			}
			a->got += (size_t)k;
			if (a->got < a->hello.name_len)
				return;
		}
		a->name[a->hello.name_len] = 0;
		a->stage = 2;
	}
	int mfd;
	int r = ap_ring_recv_fd(a->fd, &mfd);
	if (r == -EAGAIN || r == -EINTR)
		return;
	if (r) {
		refuse(a, EPROTO, r == -ECONNRESET ? "closed before it sent the segment" : "no segment fd");
		return;
	}
	if (atomic_load(&dp.nsegs) >= DP_MAX_SEGS) {
		close(mfd);
		refuse(a, EMFILE, "too many segments attached");
		return;
	}
	struct ap_dp_seg *sg = NULL;
	uint32_t st = make_seg(a, mfd, &sg);
	if (st) {
		refuse(a, st, "the segment is not valid");
		return;
	}
	struct ap_seg_ack ok = { .magic = AP_SEG_HELLO_MAGIC, .status = 0 };
	if (dp.bell_tx >= 0 ? ap_ring_send_with_fd(a->fd, &ok, sizeof ok, dp.bell_tx) : send_ack(a->fd, 0)) {
		refuse(a, 0, "cannot answer");
		seg_free(sg);
		return;
	}
	sg->sock = a->fd;
	a->fd = -1;
	atomic_fetch_add(&dp.nsegs, 1);
	atomic_store(&sg->refs, 2); /* the attach thread's socket, the registry's */
	attached[(*nattached)++] = sg;
	if (ap_node_call_on_loop(dp.n, seg_added, sg)) {
		atomic_store(&sg->dead, 1);
		atomic_store(&sg->close_req, 1);
		uint64_t one = 1;
		(void)!write(dp.efd, &one, sizeof one); /* so the next poll returns */
		ap_dp_seg_put(sg);
	}
}

static void *attach_main(void *arg)
{
	(void)arg;
	pthread_setname_np(pthread_self(), "dp-attach");
	static struct attaching att[DP_MAX_ATTACHING];
	static struct ap_dp_seg *segs[DP_MAX_SEGS];
	static struct pollfd pfd[2 + DP_MAX_ATTACHING + DP_MAX_SEGS];
	int natt = 0, nseg = 0;
	for (;;) {
		int64_t now = ap_mono_ms(), next = -1;
		int np = 0;
		pfd[np++] = (struct pollfd){ .fd = dp.efd, .events = POLLIN };
		pfd[np++] = (struct pollfd){ .fd = natt < DP_MAX_ATTACHING ? dp.lfd : -1, .events = POLLIN };
		for (int i = 0; i < natt; i++) {
			pfd[np++] = (struct pollfd){ .fd = att[i].fd, .events = POLLIN };
			if (next < 0 || att[i].deadline_ms < next)
				next = att[i].deadline_ms;
		}
		for (int i = 0; i < nseg; i++)
			pfd[np++] = (struct pollfd){ .fd = segs[i]->sock, .events = POLLIN | POLLRDHUP };
		int tmo = next < 0 ? -1 : next <= now ? 0 : (int)(next - now);
		int r = poll(pfd, (nfds_t)np, tmo);
		if (r < 0 && errno != EINTR)
			break;
		now = ap_mono_ms();
		if (pfd[0].revents) {
			uint64_t v;
			(void)!read(dp.efd, &v, sizeof v);
		}
		/* Sockets first, in the order polled; the lists change after. */
		int base = 2, polled_segs = nseg; /* step may add segments: not polled yet */
		for (int i = 0; i < natt; i++) {
			if (pfd[base + i].revents)
				step(&att[i], segs, &nseg);
			else if (att[i].fd >= 0 && now >= att[i].deadline_ms)
				refuse(&att[i], ETIMEDOUT, "handshake timed out");
		}
		base += natt;
		for (int i = 0; i < nseg; i++) {
			struct ap_dp_seg *sg = segs[i];
			int gone = atomic_load(&sg->close_req);
			if (i < polled_segs && (pfd[base + i].revents & (POLLIN | POLLRDHUP | POLLHUP | POLLERR))) {
				char junk[256];
				ssize_t k = recv(sg->sock, junk, sizeof junk, MSG_DONTWAIT);
				if (k == 0 || (k < 0 && errno != EAGAIN && errno != EINTR))
					gone = 2; /* EOF or error: the peer is gone */
			}
			if (!gone)
				continue;
			close(sg->sock);
			sg->sock = -1;
			segs[i] = NULL;
			if (gone == 2) {
				if (ap_node_call_on_loop(dp.n, peer_gone, sg))
					ap_dp_seg_put(sg);
			} else {
				ap_dp_seg_put(sg);
			}
		}
		int w = 0;
		for (int i = 0; i < nseg; i++)
			if (segs[i])
				segs[w++] = segs[i];
		nseg = w;
		w = 0;
		for (int i = 0; i < natt; i++)
			if (att[i].fd >= 0)
				att[w++] = att[i];
		natt = w;
		/* New connections last (their slots were not polled). */
		if (pfd[1].revents & POLLIN) {
			while (natt < DP_MAX_ATTACHING) {
				int fd = accept4(dp.lfd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
				if (fd < 0)
					break;
				struct ucred cr;
				socklen_t cl = sizeof cr;
				if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cr, &cl) || cr.uid != geteuid()) {
					ap_log(AP_LOG_WARNING, "ring attach refused: peer of another user");
					(void)send_ack(fd, EPERM);
					close(fd);
					continue;
				}
				att[natt++] = (struct attaching){ .fd = fd, .deadline_ms = now + AP_SEG_ATTACH_TIMEOUT_MS };
			}
		}
	}
	ap_log(AP_LOG_ERROR, "ring attach thread stopped: %s", strerror(errno));
	return NULL;
}

/* ---- start and dp_info -------------------------------------------------------- */

unsigned long long ap_dp_naps(void) { return __atomic_load_n(&dp.naps, __ATOMIC_RELAXED); }
unsigned long long ap_dp_ask_naps(void) { return __atomic_load_n(&dp.ask_naps, __ATOMIC_RELAXED); }
unsigned long long ap_dp_lone_windows(void) { return __atomic_load_n(&dp.lone_windows, __ATOMIC_RELAXED); }
unsigned long long ap_dp_iso_waits(void) { return __atomic_load_n(&dp.iso_waits, __ATOMIC_RELAXED); }
unsigned long long ap_dp_iso_waits_missed(void) { return __atomic_load_n(&dp.iso_waits_missed, __ATOMIC_RELAXED); }

void ap_dp_poll_cancel(void)
{
	dp.found_us = 0;
	dp.gap_us = INT64_MAX;
}

int ap_dp_start(ap_node *n, int enabled, int poll_us, int lone_us, int nap_us, int ask_nap_us)
{
	dp.n = n;
	dp.poll_us = poll_us;
	dp.lone_us = lone_us;
	dp.nap_us = nap_us;
	dp.ask_nap_us = ask_nap_us;
	dp.gap_us = INT64_MAX;
	if (!enabled) {
		ap_log(AP_LOG_INFO, "same-host rings: disabled (--no-fast-path)");
		return 0;
	}
	uint8_t rnd[8];
	if (getrandom(dp.token, sizeof dp.token, 0) != (ssize_t)sizeof dp.token ||
	    getrandom(rnd, sizeof rnd, 0) != (ssize_t)sizeof rnd) {
		ap_log(AP_LOG_ERROR, "same-host rings: no random bytes (%s)", strerror(errno));
		return -1;
	}
	char hex[2 * sizeof rnd + 1];
	for (size_t i = 0; i < sizeof rnd; i++)
		snprintf(hex + 2 * i, 3, "%02x", rnd[i]);
	/* "\0actor_pool.<node>.<os pid>.<hex>"; a long node name is cut so the
	 * pid and the random part always fit. */
	char body[sizeof dp.name];
	int k = snprintf(body, sizeof body, "actor_pool.%.60s.%d.%s", ap_node_name(n), (int)getpid(), hex);
	if (k < 0 || (size_t)k >= sizeof body - 1)
		return -1;
	dp.name[0] = 0;
	memcpy(dp.name + 1, body, (size_t)k);
	dp.name_len = (size_t)k + 1;
	dp.addr.sun_family = AF_UNIX;
	memcpy(dp.addr.sun_path, dp.name, dp.name_len);
	dp.addr_len = (socklen_t)(offsetof(struct sockaddr_un, sun_path) + dp.name_len);
	dp.lfd = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
	dp.efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
	if (dp.lfd < 0 || dp.efd < 0 || bind(dp.lfd, (struct sockaddr *)&dp.addr, dp.addr_len) ||
	    listen(dp.lfd, 128)) {
		ap_log(AP_LOG_ERROR, "same-host rings: cannot listen (%s); distribution only", strerror(errno));
		goto off;
	}
	dp.uring = ap_node_futex_supported(n);
	if (!dp.uring) {
		/* A pipe, not an eventfd: the BEAMs write it with RWF_NOWAIT,
		 * which never blocks whatever anyone does to the shared write
		 * end's flags (an eventfd's write blocks when a peer cleared
		 * O_NONBLOCK and filled it). The read end is ours alone. */
		int sv[2], r = pipe2(sv, O_NONBLOCK | O_CLOEXEC) ? -errno : 0;
		if (!r) {
			dp.bell_fd = sv[0];
			dp.bell_tx = sv[1];
			r = ap_node_add_reader(n, dp.bell_fd, on_bell, NULL);
		}
		if (r) {
			ap_log(AP_LOG_ERROR, "same-host rings: no bell for the epoll loop (%s); distribution only",
			       strerror(-r));
			if (dp.bell_fd >= 0)
				close(dp.bell_fd);
			if (dp.bell_tx >= 0)
				close(dp.bell_tx);
			dp.bell_fd = dp.bell_tx = -1;
			goto off;
		}
	}
	if (pthread_create(&dp.th, NULL, attach_main, NULL)) {
		ap_log(AP_LOG_ERROR, "same-host rings: no attach thread; distribution only");
		goto off;
	}
	pthread_detach(dp.th);
	ap_node_set_idle(n, dp_idle, NULL);
	dp.enabled = 1;
	ap_log(AP_LOG_INFO, "same-host rings: listening on @%s, wake-ups by %s", body,
	       dp.uring ? "io_uring futex waits" : "a bell pipe in the epoll set");
	return 0;
off:
	if (dp.lfd >= 0)
		close(dp.lfd);
	if (dp.efd >= 0)
		close(dp.efd);
	dp.lfd = dp.efd = -1;
	return 0;
}

void ap_dp_encode_info(ei_x_buff *x)
{
	ei_x_encode_tuple_header(x, 2);
	if (!dp.enabled) {
		ei_x_encode_atom(x, "error");
		ei_x_encode_atom(x, "disabled");
		return;
	}
	ei_x_encode_atom(x, "ok");
	ei_x_encode_map_header(x, 2);
	ei_x_encode_atom(x, "socket");
	ei_x_encode_binary(x, dp.name, (long)dp.name_len);
	ei_x_encode_atom(x, "token");
	ei_x_encode_binary(x, dp.token, sizeof dp.token);
}
