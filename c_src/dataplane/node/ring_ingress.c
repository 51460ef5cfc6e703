/* ring_ingress: the pool node's side of the same-host data plane
 * (c_src/ring/ap_seg.h is the contract; docs/runtime.md, "Ring ingress"),
 * in three files:
 *
 *  - ring_attach.c: the listen socket, the token, the attach thread (each
 *    handshake, then every attached socket watched for EOF); it hands
 *    segments to the loop with ap_node_call_on_loop.
 *  - here: the loop thread is the one consumer of every request ring: it
 *    drains them (records validated, fences followed, dispatched through
 *    ap_pool_dispatch with the ring route), woken by an io_uring
 *    FUTEX_WAIT on the segment's request bell or, on epoll, by the node's
 *    bell pipe (the loop reads it, every BEAM got its write end with the
 *    ack and writes a byte instead of a futex wake; one bell for all
 *    segments: a ring drains every segment); and before sleeping it spins
 *    briefly over its segments when they were busy (dp_idle).
 *  - ring_seg.c: replies go into the segment's reply rings (the ring
 *    route), from workers (a mutex per ring) and from the loop (errors;
 *    never waiting); a segment's references and its detach.
 *
 * Detached (peer EOF, a broken ring, the peer's closed bit) means: out of
 * the registry, no more reads, replies dropped; the memory goes with the
 * last reference, so an armed io_uring wait is cancelled and reaped first.
 * The records' format and checks are ap_seg.c's.
 */
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
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
#include "ring_int.h"

/* ---- the worker processes' answers, taken by the loop ---------------------------- */

/* The results of worker processes whose proxies sleep, taken by the
 * loop itself (ap_iso_take_direct) while it is busy with ring traffic,
 * their answers published with the loop's own at the end of the read:
 * neither the child nor its proxy wakes for them. looks 0: the loop is
 * about to sleep; the children ring their proxies again from now on
 * (what came before is taken here once more). */
static int iso_pass(int looks)
{
	if (!looks && !ap_dp.iso_looking)
		return 0;
	ap_dp.iso_looking = looks;
	int reading = dp_read_begin();
	int flags = ap_iso_take_all(looks);
	if (!reading)
		dp_read_end();
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
	if (!(iso_pass(1) & AP_ISO_ASKS_OUT) || !ap_skip_wait(&ap_dp.iso_skip))
		return;
	int64_t until = ap_mono_us() + DP_ISO_WAIT_US;
	for (;;) {
		sched_yield();
		int f = iso_pass(1);
		if (!(f & AP_ISO_ASKS_OUT)) {
			/* Ended by a proxy (awake, or left an answer): not
			 * the loop's catch, and no sign of a slow handler. */
			if (!(f & AP_ISO_PROXY)) {
				ap_skip_hit(&ap_dp.iso_skip);
				__atomic_store_n(&ap_dp.iso_waits, ap_dp.iso_waits + 1, __ATOMIC_RELAXED);
			}
			return;
		}
		if (ap_mono_us() >= until) {
			ap_skip_miss(&ap_dp.iso_skip, DP_ISO_SKIP_MAX);
			__atomic_store_n(&ap_dp.iso_waits_missed, ap_dp.iso_waits_missed + 1, __ATOMIC_RELAXED);
			return;
		}
	}
}

/* ---- the ingress: records -> requests (loop thread) -------------------------- */

static void bad_record(struct ap_dp_seg *sg, uint32_t ring, const char *why)
{
	sg->bad++;
	int64_t now = ap_node_now_ms(ap_dp.n);
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
		*pool = ap_pool_find(ap_dp.n, name, NULL);
		return 0;
	}
	erlang_pid pid;
	int i = 0, type, size;
	if (ap_term_end(dest, h->dest_len, 0) != (int)h->dest_len || ei_get_type(dest, &i, &type, &size) ||
	    type != ERL_PID_EXT || ei_decode_pid(dest, &i, &pid))
		return -1;
	*pool = ap_pool_find(ap_dp.n, NULL, &pid);
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
	if (ap_dp.last.pools_gen == gen && ap_dp.last.kind == h->dest_kind && ap_dp.last.len == h->dest_len &&
	    !memcmp(ap_dp.last.bytes, dest, h->dest_len)) {
		*pool = ap_dp.last.pool;
		return 0;
	}
	if (resolve_bytes(h, dest, pool))
		return -1;
	ap_dp.last.pools_gen = 0;
	if (h->dest_len <= sizeof ap_dp.last.bytes) {
		memcpy(ap_dp.last.bytes, dest, h->dest_len);
		ap_dp.last.len = h->dest_len;
		ap_dp.last.kind = h->dest_kind;
		ap_dp.last.pool = *pool;
		ap_dp.last.pools_gen = gen;
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
	ap_dp.copy.len = 0;
	if (ap_buf_append(&ap_dp.copy, p + sizeof h, body)) {
		if (h.kind != AP_DP_TELL)
			ap_dp_reply_error_loop(sg, h.ask_id, "enomem");
		return;
	}
	const char *dest = (const char *)ap_dp.copy.data, *msg = dest + h.dest_len;
	ap_pool *pool;
	if (resolve(&h, dest, &pool)) {
		bad_record(sg, ring, "the destination is not a name or a pid");
		return;
	}
	if (h.kind != AP_DP_TELL)
		ap_dp.read_asked = 1;
	if (h.kind == AP_DP_STATS) {
		if (!pool) {
			ap_dp_reply_error_loop(sg, h.ask_id, "noproc");
			return;
		}
		ei_x_buff x;
		if (ei_x_new(&x))
			return;
		ap_pool_encode_stats(pool, &x);
		dp_reply(sg, (unsigned)(h.ask_id % sg->s.n_rep), h.ask_id, x.buff, (size_t)x.index, REP_LOOP);
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
		ap_pool_dispatch(pool, &(ap_request){ .kind = AP_REQ_ASK, .route = { &dp_ring_route, sg, h.ask_id },
						      .msg = msg, .msg_len = (int)h.msg_len });
	} else {
		ap_pool_dispatch(pool, &(ap_request){ .kind = AP_REQ_TELL, .route = { &dp_ring_route, NULL, 0 },
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
			dp_detach(sg, "a request ring is broken");
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
	if (!ap_dp.lone_until_us)
		return 0;
	if (now < ap_dp.lone_until_us)
		return 1;
	ap_dp.lone_until_us = 0;
	ap_skip_miss(&ap_dp.lone_skip, DP_LONE_SKIP_MAX);
	return 0;
}

/* After a read that found records: a window open now caught them (its
 * caller came back in time: the backoff resets), and a lone ask opens the
 * next one unless misses made it skip. The BEAM's hint is in memory it
 * writes: any value other than 1 is 0, and the most it can do is keep the
 * loop yielding, which its records could as well. */
static void lone_read(struct ap_dp_seg *sg, int64_t now)
{
	if (now < ap_dp.lone_until_us) {
		ap_skip_hit(&ap_dp.lone_skip);
		ap_dp.lone_until_us = 0;
	} else {
		(void)lone_open(now); /* a miss if one ran out unnoticed */
	}
	if (!ap_dp.lone_us || __atomic_load_n(&sg->s.hdr->req_lone, __ATOMIC_RELAXED) != 1 ||
	    !ap_skip_wait(&ap_dp.lone_skip))
		return;
	ap_dp.lone_until_us = now + ap_dp.lone_us;
	__atomic_store_n(&ap_dp.lone_windows, ap_dp.lone_windows + 1, __ATOMIC_RELAXED);
}

/* Every request ring of sg once: the records handled, or -1 (detached). */
static int drain_seg_ref(struct ap_dp_seg *sg)
{
	int total = 0;
	if (sg->slot < 0)
		return -1;
	(void)dp_read_begin();
	ap_dp.read_asked = 0; /* this read's own, whatever an earlier one left */
	if (ap_seg_closed(sg->s.hdr) & AP_SEG_CLOSED_BEAM) {
		/* The BEAM left in order: what it published before is read. */
		int broken = 0;
		for (uint32_t i = 0; i < sg->s.n_req && !broken; i++)
			broken = drain_ring(sg, i, UINT64_MAX, DP_BUDGET, 0, 0, NULL) < 0;
		dp_read_end();
		ap_pool_wake_all_pushed();
		if (!broken) /* a broken ring detached it already */
			dp_detach(sg, "the BEAM closed it");
		return -1;
	}
	int waited = 0;
	for (uint32_t i = 0; i < sg->s.n_req; i++) {
		/* The tail now: a hint only (the BEAM writes it), for the nap's
		 * count of records that waited for this read. */
		uint64_t mark = __atomic_load_n(&sg->req[i].hdr->tail, __ATOMIC_ACQUIRE);
		int k = drain_ring(sg, i, UINT64_MAX, DP_BUDGET, 0, mark, &waited);
		if (k < 0) {
			dp_read_end();
			ap_pool_wake_all_pushed();
			return -1;
		}
		total += k;
	}
	iso_pass(1);
	dp_read_end();
	ap_pool_wake_all_pushed();
	/* Dense: records queued up while the loop was elsewhere. Those that
	 * came during the read do not count: a lone caller whose next ask
	 * follows each answer at once (the loop answers on itself) would
	 * otherwise look like a crowd, and wait for a nap. */
	if (waited >= DP_NAP_MIN) {
		ap_dp.dense = 1;
		ap_dp.dense_asks |= ap_dp.read_asked;
	}
	if (total) {
		int64_t now = ap_mono_us();
		ap_dp.hot_until_ms = ap_node_now_ms(ap_dp.n) + DP_IDLE_SPIN_HOT_MS;
		ap_dp.gap_us = now - ap_dp.found_us;
		ap_dp.found_us = now;
		lone_read(sg, now);
	}
	return total;
}

/* A dp_detach inside drops the registry's reference while the drain still
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
		if (ap_dp.bell_fd >= 0) {
			sg->fw_armed = 1; /* the flag is up: the BEAM writes bell_fd, dp_on_bell reads it */
			break;
		}
		ap_dp_seg_get(sg); /* the armed wait's */
		int r = ap_node_futex_wait(ap_dp.n, &sg->fw, word, expected, DP_WAIT_MS);
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
void dp_on_bell(ap_node *n, void *arg)
{
	(void)n;
	(void)arg;
	char b[256];
	for (int k = 0; k < 64 && read(ap_dp.bell_fd, b, sizeof b) == (ssize_t)sizeof b; k++)
		;
	for (int i = 0; i < ap_dp.top; i++) {
		struct ap_dp_seg *sg = ap_dp.segs[i];
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

void dp_seg_added(ap_node *n, void *arg)
{
	(void)n;
	struct ap_dp_seg *sg = arg; /* carries the registry's reference */
	int slot = -1;
	for (int i = 0; i < DP_MAX_SEGS; i++)
		if (!ap_dp.segs[i]) {
			slot = i;
			break;
		}
	if (slot < 0 || atomic_load(&sg->dead)) {
		atomic_store(&sg->dead, 1);
		atomic_store(&sg->close_req, 1);
		uint64_t one = 1;
		(void)!write(ap_dp.efd, &one, sizeof one);
		ap_dp_seg_put(sg);
		return;
	}
	sg->slot = slot;
	ap_dp.segs[slot] = sg;
	ap_dp.n_live++;
	if (slot >= ap_dp.top)
		ap_dp.top = slot + 1;
	ap_log(AP_LOG_INFO, "ring segment %u attached: %s (os pid %u), %u request rings of %llu bytes, %u reply rings of %llu bytes, wake-ups by %s",
	       sg->id, sg->peer, sg->os_pid, sg->s.n_req, (unsigned long long)sg->s.req_cap, sg->s.n_rep,
	       (unsigned long long)sg->s.rep_cap, ap_dp.uring ? "io_uring futex wait" : "the bell pipe");
	sg->fw.done = fw_done;
	sg->fw.arg = sg;
	(void)arm(sg); /* dp_idle runs before the loop blocks */
}

void dp_peer_gone(ap_node *n, void *arg)
{
	(void)n;
	struct ap_dp_seg *sg = arg;
	/* What the BEAM published before it closed the socket (an orderly
	 * close may reach us as EOF before its closed bit) is read first. */
	drain_seg(sg);
	dp_detach(sg, "its socket closed");
	ap_dp_seg_put(sg); /* the attach thread's */
}

/* Every segment with records pending read once: 1 if any were read. */
static int drain_pending(void)
{
	int found = 0;
	for (int i = 0; i < ap_dp.top; i++) {
		struct ap_dp_seg *sg = ap_dp.segs[i];
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
int dp_idle(ap_node *n, void *arg)
{
	(void)arg;
	if (!ap_dp.n_live) {
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
	int nap_us = !ap_dp.dense ? 0 : ap_dp.dense_asks ? ap_dp.ask_nap_us : ap_dp.nap_us, asks = ap_dp.dense_asks;
	ap_dp.dense = ap_dp.dense_asks = 0;
	if (nap_us) {
		struct timespec ts = { .tv_sec = 0, .tv_nsec = (long)nap_us * 1000 };
		__atomic_store_n(&ap_dp.naps, ap_dp.naps + 1, __ATOMIC_RELAXED);
		if (asks) {
			__atomic_store_n(&ap_dp.ask_naps, ap_dp.ask_naps + 1, __ATOMIC_RELAXED);
			iso_await();
		}
		/* Not looking while napping: an answer would wait for it. */
		iso_pass(0);
		nanosleep(&ts, NULL);
		if (drain_pending())
			return 1;
	}
	unsigned spin = ap_node_now_ms(n) < ap_dp.hot_until_ms ? ap_dp.spin.rounds : 0;
	for (unsigned k = 0; k <= spin; k++) {
		if (drain_pending()) {
			if (k > 0)
				ap_spin_found(&ap_dp.spin);
			else
				ap_spin_again(&ap_dp.spin);
			return 1;
		}
		if (k < spin)
			ap_ring_cpu_relax();
	}
	ap_spin_missed(&ap_dp.spin);
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
	if (lone || (ap_dp.poll_us && ap_dp.gap_us < ap_dp.poll_us && now - ap_dp.found_us < ap_dp.poll_us)) {
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
	for (int i = 0; i < ap_dp.top; i++)
		if (ap_dp.segs[i] && !ap_dp.segs[i]->fw_armed)
			busy |= arm(ap_dp.segs[i]);
	return busy;
}

/* ---- node_stats, and the distribution's word ---------------------------------------- */

unsigned long long ap_dp_naps(void) { return __atomic_load_n(&ap_dp.naps, __ATOMIC_RELAXED); }
unsigned long long ap_dp_ask_naps(void) { return __atomic_load_n(&ap_dp.ask_naps, __ATOMIC_RELAXED); }
unsigned long long ap_dp_lone_windows(void) { return __atomic_load_n(&ap_dp.lone_windows, __ATOMIC_RELAXED); }
unsigned long long ap_dp_iso_waits(void) { return __atomic_load_n(&ap_dp.iso_waits, __ATOMIC_RELAXED); }
unsigned long long ap_dp_iso_waits_missed(void) { return __atomic_load_n(&ap_dp.iso_waits_missed, __ATOMIC_RELAXED); }

void ap_dp_poll_cancel(void)
{
	ap_dp.found_us = 0;
	ap_dp.gap_us = INT64_MAX;
}
