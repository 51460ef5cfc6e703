/* pool: the life of the pool node's stateless worker pools: start and
 * stop, worker threads, and their replacement after a crash (backoff with
 * jitter, queued jobs moved to the others). How the files of a pool divide
 * the work, and its threads: pool_int.h.
 */
#include "pool.h"

#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <linux/membarrier.h>
#include <sys/random.h>
#include <sys/syscall.h>
#include <sys/signalfd.h>
#include <signal.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "ap_atomset.h"
#include "ap_log.h"
#include "ap_rand.h"
#include "ap_time.h"
#include "handlers.h"
#include "isolate.h"
#include "pool_int.h"

static ap_pool *pools; /* the pool node runs one ap_node */
/* Moves with every start and stop (ap_pool_generation); a pool is freed
 * only after its stop. */
static uint64_t pools_gen = 1;

uint64_t ap_pool_generation(void) { return pools_gen; }

/* max_reply_atoms' default: far more names than any fixed reply
 * vocabulary (ok, error, reasons, record tags) needs, and a thousand pools'
 * worth of it still fits in the BEAM's default atom table (1048576), which
 * never shrinks. */
#define DEFAULT_REPLY_ATOMS 1024

void ap_pool_opts_default(ap_pool_opts *o)
{
	*o = (ap_pool_opts){ .workers = 0, .routing = AP_ROUTE_ROUND_ROBIN, .mailbox_limit = 10000,
			     .backoff_min_ms = 50, .backoff_max_ms = 5000, .jitter = 0.2, .stable_ms = 10000,
			     .stall_ms = AP_POOL_DEFAULT_STALL_MS, .max_reply_atoms = DEFAULT_REPLY_ATOMS };
	ap_sb_opts_default(&o->sandbox);
}

/* ---- worker threads -------------------------------------------------------- */

static int end_of_message(ap_worker *w);

/* The handler's view of j, and w's reply buffer made ready for it. */
static actor_pool_request job_request(ap_worker *w, const ap_job *j)
{
	w->reply.len = 0;
	ap_pool_set_atom_reply(&w->reply, "ok");
	return (actor_pool_request){
		.data = j->data + j->head_len,
		.len = j->msg_len,
		.is_binary = j->is_binary,
		.is_ask = j->is_ask,
		.worker = (uint32_t)w->id,
	};
}

static void count_done(ap_worker *w, actor_pool_status st)
{
	atomic_fetch_add_explicit(&w->processed, 1, memory_order_relaxed);
	if (st != AP_HANDLER_OK)
		atomic_fetch_add_explicit(&w->errors, 1, memory_order_relaxed);
}

/* The inline answer found its route with no room: the worker delivers it
 * (it may wait for room; the loop may not). The answer (w->out: the
 * route's head, then the term) and the route's address go to a new job,
 * and the route's hold with them. */
static void hand_answer_over(ap_worker *w, const ap_job *j)
{
	ap_job *a = ap_job_alloc(&w->mb, &w->job_cache, w->out.len + j->addr_len);
	if (!a) {
		ap_log(AP_LOG_WARNING, "pool %s: an answer was dropped: no memory to queue it", w->pool->name);
		ap_route_drop(&j->route);
		return;
	}
	a->is_ask = 1;
	a->is_binary = 0;
	a->is_answer = 1;
	a->route = j->route;
	a->head_len = j->head_len;
	a->msg_len = (uint32_t)(w->out.len - j->head_len);
	a->addr_len = j->addr_len;
	memcpy(a->data, w->out.data, w->out.len);
	memcpy(a->data + w->out.len, ap_job_addr(j), j->addr_len);
	ap_pool_push(w, a);
}

/* Loop thread: j, on w's state, while w sleeps (ap_pool_can_inline said
 * so); then j goes back to w's job cache. A crash status is the worker's
 * crash: answered, counted, and its thread exits as if it had crashed. */
void ap_pool_run_inline(ap_worker *w, ap_job *j)
{
	ap_pool *p = w->pool;
	actor_pool_request req = job_request(w, j);
	p->inline_runs++;
	/* Asks only (see handler_time in stats.c): two clock reads were
	 * as much as a whole tell costs the loop. */
	int64_t t0 = j->is_ask ? ap_mono_ns() : 0;
	actor_pool_status st = p->h->handle(w->state, &req, &w->reply);
	if (t0)
		ap_hist_add_1w(&p->inline_ns, (uint64_t)(ap_mono_ns() - t0));
	const char *status = st == AP_HANDLER_OK ? "ok" : "error";
	if (st == AP_HANDLER_CRASH) {
		ap_worker_count_crash(w, AP_CRASH_HANDLER);
		ap_pool_set_atom_reply(&w->reply, "worker_crashed");
		atomic_store(&w->crash_pending, 1);
		ap_worker_wake(w, 1, 0);
	} else {
		count_done(w, st);
	}
	if (j->is_ask && ap_answer(w, j, status, &w->reply,
				   AP_ANSWER_NOWAIT | (st == AP_HANDLER_CRASH ? AP_ANSWER_OWN : 0)) == -EAGAIN)
		hand_answer_over(w, j);
	j->free_next = w->job_cache;
	w->job_cache = j;
}

static void *worker_main(void *arg)
{
	ap_worker *w = arg;
	ap_pool *p = w->pool;
	void *state = NULL;
	char tname[16];
	/* Replacements get a suffix: pool/slot.incarnation. */
	snprintf(tname, sizeof tname, "%.7s/%d.%d", p->name, w->id, w->gen);
	pthread_setname_np(pthread_self(), tname);

	w->reply.reserve = ap_pool_reply_reserve;
	int rc = p->h->init ? p->h->init(&state, p->config, p->config_len) : 0;
	if (rc) {
		w->init_rc = rc;
		w->exit_reason = EXIT_INIT_FAILED;
		ap_node_call_on_loop_sure(p->n, ap_pool_worker_exited, w);
		return NULL;
	}
	/* Before the first sleep (ap_pool_can_inline reads it after that). */
	w->state = state;
	ap_node_call_on_loop_sure(p->n, ap_pool_worker_ready, w);

	w->exit_reason = EXIT_STOP;
	uint64_t popped = atomic_load(&w->popped);
	ap_job *j;
	while ((j = ap_worker_next_job(w))) {
		/* After the pop: the loop that sees the count sees the pop. */
		atomic_store_explicit(&w->popped, ++popped, memory_order_release);
		/* Each message leaves the mailbox's depth (ap_mbox_done) and
		 * meets the loop's claim (end_of_message) before its answer is
		 * sent (the job stays valid until the next pop): a caller that
		 * has the answer and asks again must find room again, even with
		 * mailbox_limit 1. */
		if (j->is_answer) {
			/* An inline run's answer that found its route with no room. */
			ap_mbox_done(&w->mb);
			(void)end_of_message(w);
			(void)ap_answer_made(w, j, AP_SEND_WAIT);
			continue;
		}
		if (atomic_load(&w->stop)) {
			/* Stopping: everything still queued is answered, not run. */
			ap_mbox_done(&w->mb);
			(void)end_of_message(w);
			if (j->is_ask)
				ap_answer_error(w, j, "stopped");
			continue;
		}
		actor_pool_request req = job_request(w, j);
		/* Asks only (stats.c, handler_time); every one that returns, one
		 * the watchdog answered too. */
		int64_t t0 = j->is_ask ? ap_mono_ns() : 0;
		actor_pool_status st = p->h->handle(state, &req, &w->reply);
		if (t0)
			ap_hist_add_1w(&w->run_ns, (uint64_t)(ap_mono_ns() - t0));
		ap_mbox_done(&w->mb);
		/* The watchdog answered it (handler_timeout_ms): ours is dropped. */
		int answered = end_of_message(w);
		if (st == AP_HANDLER_CRASH) {
			ap_worker_count_crash(w, AP_CRASH_HANDLER);
			if (j->is_ask && !answered)
				ap_answer_error(w, j, "worker_crashed");
			w->exit_reason = EXIT_CRASH;
			break;
		}
		if (answered)
			continue;
		count_done(w, st);
		if (j->is_ask)
			ap_answer(w, j, st == AP_HANDLER_OK ? "ok" : "error", &w->reply, 0);
	}
	if (atomic_load(&w->crash_pending))
		w->exit_reason = EXIT_CRASH;
	if (p->h->terminate)
		p->h->terminate(state);
	ap_node_call_on_loop_sure(p->n, ap_pool_worker_exited, w);
	return NULL;
}

static int worker_start(ap_worker *w)
{
	atomic_store(&w->stop, 0);
	atomic_store(&w->crash_pending, 0);
	atomic_store(&w->claim, 0);
	/* Whatever the loop took off the mailbox since (a dead worker's
	 * queue): the count goes on from what is done. */
	atomic_store(&w->popped, atomic_load(&w->mb.deq));
	/* Routed to once its init is done (ap_pool_worker_ready): a message
	 * queued behind an init (a plugin's may take seconds) would wait for
	 * it while other workers serve. */
	atomic_store(&w->alive, 0);
	w->started_ms = ap_node_now_ms(w->pool->n);
	if (pthread_create(&w->th, NULL, w->iso ? ap_iso_proxy_main : worker_main, w))
		return -1;
	w->thread_live = 1;
	w->pool->threads++;
	return 0;
}

/* ---- life cycle ------------------------------------------------------------------ */

static void pool_free(ap_pool *p)
{
	ap_pool **pp = &pools;
	while (*pp && *pp != p)
		pp = &(*pp)->next;
	if (*pp)
		*pp = p->next;
	for (int i = 0; i < p->o.workers; i++) {
		ap_worker *w = &p->w[i];
		if (w->mb.head) {
			/* A slot that never got its replacement: answer what waits. */
			ap_job *j;
			while ((j = ap_mbox_pop(&w->mb))) {
				if (j->revoked)
					continue; /* moved, and out of the depth */
				if (j->is_answer) {
					/* Made already: delivered if it fits now. */
					if (ap_answer_made(w, j, AP_SEND_NOWAIT) == -EAGAIN) {
						ap_log(AP_LOG_WARNING, "pool %s: an answer was dropped: its route has no room",
						       p->name);
						ap_route_drop(&j->route);
					}
				} else if (j->is_ask) {
					/* The loop thread: never the worker's path,
					 * which may wait for room. */
					ap_answer_loop_job(p, j, "stopped");
				}
				ap_mbox_done(&w->mb);
			}
			ap_mbox_destroy(&w->mb);
		}
		ap_job_free_list(w->job_cache);
		ap_iso_slot_free(w);
		free(w->reply.data);
		ap_buf_free(&w->out);
		ap_term_strict_free(&w->check);
	}
	if (p->dl)
		ap_plugin_unload(p->dl);
	free(p->atoms);
	free(p->w);
	free(p->wake_list);
	free(p->config);
	free(p->spec);
	ap_buf_free(&p->scratch);
	free(p);
}

static void pool_free_cb(ap_node *n, void *arg)
{
	(void)n;
	pool_free(arg);
}

/* Free once nothing refers to the pool any more; later, from the loop, so
 * no caller up the stack is left holding it. */
static void maybe_free(ap_pool *p)
{
	if (p->stopping && !p->freeing && p->threads == 0 && p->timers == 0) {
		p->freeing = 1;
		if (ap_node_call_on_loop(p->n, pool_free_cb, p))
			p->freeing = 0;
	}
}

static void first_init_reported(ap_pool *p)
{
	if (--p->starting > 0)
		return;
	if (p->stopping) {
		/* stop_pool came while the workers ran their init. Whatever the
		 * inits said (a worker process stopped in its init reads as a
		 * failed one), the pool never served: not a handler's failure. */
		ap_log(AP_LOG_INFO, "pool %s stopped before its workers were up", p->name);
		ap_pool_answer_start(p, 0);
	} else if (p->init_failed) {
		ap_log(AP_LOG_WARNING, "pool %s: handler %s init failed (%d); not started", p->name, p->handler_desc,
		       p->init_failed);
		ap_pool_answer_start(p, 0);
		ap_pool_stop(p->n, p);
	} else {
		ap_log(AP_LOG_INFO, "pool %s started: %d workers, handler %s", p->name, p->o.workers, p->handler_desc);
		ap_pool_answer_start(p, 1);
	}
}

void ap_pool_worker_ready(ap_node *n, void *arg)
{
	(void)n;
	ap_worker *w = arg;
	ap_pool *p = w->pool;
	/* Posted before anything the worker posts after it (its exit): a
	 * worker that is gone again is not taken back. */
	if (w->thread_live && !p->stopping && !atomic_load(&w->stop) && w->wd_state == W_RUNNING)
		atomic_store(&w->alive, 1);
	if (w->gen == 0)
		first_init_reported(p);
}

static void restart(ap_node *n, void *arg)
{
	ap_worker *w = arg;
	ap_pool *p = w->pool;
	p->timers--;
	w->restart_pending = 0;
	if (p->stopping) {
		maybe_free(p);
		return;
	}
	(void)n;
	w->gen++;
	w->restarts++;
	if (worker_start(w))
		ap_log(AP_LOG_ERROR, "pool %s: cannot start a thread for worker %d", p->name, w->id);
}

int ap_pool_move_job(ap_pool *p, ap_worker *from, const ap_job *j)
{
	ap_worker *w = ap_pool_route(p);
	if (!w || w == from) {
		/* Everyone is full: over the limit rather than lost. */
		w = NULL;
		for (int i = 0; i < p->o.workers; i++)
			if (&p->w[i] != from && ap_worker_alive(&p->w[i])) {
				w = &p->w[i];
				break;
			}
	}
	size_t need = (size_t)j->head_len + j->msg_len + j->addr_len;
	ap_job *c = w ? ap_job_alloc(&w->mb, &w->job_cache, need) : NULL;
	if (!c) {
		ap_route_drop(&j->route); /* lost with its job: the route's hold must still go */
		return -1;
	}
	c->is_ask = j->is_ask;
	c->is_binary = j->is_binary;
	c->is_answer = j->is_answer;
	c->route = j->route; /* the hold moves with the job */
	c->head_len = j->head_len;
	c->msg_len = j->msg_len;
	c->addr_len = j->addr_len;
	memcpy(c->data, j->data, need);
	ap_pool_push(w, c);
	return 0;
}

int ap_pool_others_alive(ap_pool *p, ap_worker *w)
{
	int others = 0;
	for (int i = 0; i < p->o.workers; i++)
		others += &p->w[i] != w && ap_worker_alive(&p->w[i]);
	return others;
}

/* Move the jobs of a dead worker to live ones; none is dropped silently. */
static void redistribute(ap_pool *p, ap_worker *dead)
{
	if (!ap_pool_others_alive(p, dead))
		return; /* they wait for the replacement */
	ap_job *j;
	uint64_t moved = 0;
	while (!ap_mbox_empty(&dead->mb)) {
		/* The loop is the consumer now: the worker thread is joined. A
		 * popped job stays the dummy, so copy it before re-queueing. */
		j = ap_mbox_pop(&dead->mb);
		if (j->revoked)
			continue; /* moved already, and out of the depth */
		ap_mbox_done(&dead->mb);
		if (ap_pool_move_job(p, dead, j))
			break;
		moved++;
	}
	ap_pool_wake_pushed(p);
	if (moved)
		ap_log(AP_LOG_INFO, "pool %s: moved %llu queued messages off crashed worker %d", p->name,
		       (unsigned long long)moved, dead->id);
}

/* ---- the watchdog: stalls and handler_timeout_ms ---------------------------
 * A pool with stall_ms or handler_timeout_ms has a timer on the loop that
 * looks at each worker's mailbox counters. A worker whose done count
 * (deq) has not moved while a message was in its mailbox has been on the
 * message at its head since the first look that saw it so: the workers
 * pay nothing per message for it (no clock read, no store), and a busy
 * time is known to the timer's period (a quarter of the shorter limit, 10
 * to 100 ms), late but never early.
 *
 * Past stall_ms the worker is stalled: routing skips it, and what is
 * queued behind that message moves to the other workers (in process mode
 * also what its process was sent and has not started: isolate.c,
 * ap_iso_revoke). It serves again once the message is done. Past
 * handler_timeout_ms the message is answered {error, handler_timeout}: a
 * worker process is killed (isolate.c answers when it is gone), a thread
 * cannot be, so it is marked hung and the loop answers for it.
 *
 * A thread reads its mailbox as it likes: the loop takes it over (claim)
 * only while the worker is inside a message, and the worker meets the
 * claim at the end of that message (end_of_message), before it touches
 * the mailbox again. The worker stores its done count, then loads the
 * claim, with no fence between them; the loop stores the claim, then
 * loads the count after a membarrier(2), which runs a full barrier on
 * every thread of the pool node: either the loop sees the count moved
 * (the worker is out: it lets go) or the worker sees the claim. Where the
 * kernel has no such barrier, each worker fences after each message
 * instead (ap_pool_fence_each). */

/* ap_worker.claim: none; the loop holds the mailbox (the worker waits);
 * the loop moved the queue; ... and answered the message too. */
enum { CLAIM_NONE, CLAIM_ASK, CLAIM_HELD, CLAIM_ANSWERED };

int ap_pool_fence_each = 1; /* until membarrier is known to work (barriers_init) */
static int mb_threads, mb_children;

/* Loop thread, before the first worker starts. */
static void barriers_init(void)
{
	long q = syscall(SYS_membarrier, MEMBARRIER_CMD_QUERY, 0, 0);
	mb_threads = q > 0 && (q & MEMBARRIER_CMD_PRIVATE_EXPEDITED) &&
		     syscall(SYS_membarrier, MEMBARRIER_CMD_REGISTER_PRIVATE_EXPEDITED, 0, 0) == 0;
	mb_children = q > 0 && (q & MEMBARRIER_CMD_GLOBAL_EXPEDITED);
	ap_pool_fence_each = !mb_threads;
	if (!mb_children)
		ap_log(AP_LOG_NOTICE, "no membarrier(2) here: a stalled worker process keeps what it was sent");
}

int ap_pool_barrier_threads(void)
{
	if (mb_threads && syscall(SYS_membarrier, MEMBARRIER_CMD_PRIVATE_EXPEDITED, 0, 0) == 0)
		return 0;
	atomic_thread_fence(memory_order_seq_cst);
	/* The workers fence themselves then; if the kernel failed us only
	 * now, they do not. */
	return ap_pool_fence_each ? 0 : -1;
}

int ap_pool_barrier_children(void)
{
	return mb_children && syscall(SYS_membarrier, MEMBARRIER_CMD_GLOBAL_EXPEDITED, 0, 0) == 0 ? 0 : -1;
}

/* Worker thread: the end of a message (its done count stored), where the
 * loop's claim is met. 1 if the loop answered the message itself (the
 * worker's answer is dropped). */
static int end_of_message(ap_worker *w)
{
	if (ap_pool_fence_each)
		atomic_thread_fence(memory_order_seq_cst);
	else
		atomic_signal_fence(memory_order_seq_cst); /* the barrier is the loop's */
	if (atomic_load_explicit(&w->claim, memory_order_relaxed) == CLAIM_NONE)
		return 0;
	for (;;) {
		int c = atomic_load(&w->claim);
		if (c == CLAIM_ASK) {
			sched_yield(); /* the loop is at the mailbox: microseconds */
			continue;
		}
		if (c == CLAIM_NONE)
			return 0;
		if (atomic_compare_exchange_strong(&w->claim, &c, CLAIM_NONE))
			return c == CLAIM_ANSWERED;
	}
}

/* Thread mode, loop: the mailbox of w, if its worker is still inside the
 * message that was at its head when the watchdog looked (its done count
 * wd_deq, and that message popped): the claim there was (>= 0; it is
 * CLAIM_ASK now, until let_go), or -1 (the worker is out of it, or there
 * is no barrier). A claim held from before only the worker takes back,
 * with a CAS: taking it over needs no barrier. */
static int claim(ap_worker *w)
{
	int c = atomic_load(&w->claim);
	if (c == CLAIM_NONE) {
		atomic_store(&w->claim, CLAIM_ASK);
		if (ap_pool_barrier_threads()) {
			atomic_store(&w->claim, CLAIM_NONE);
			return -1;
		}
	} else if (c == CLAIM_ASK || !atomic_compare_exchange_strong(&w->claim, &c, CLAIM_ASK)) {
		return -1;
	}
	uint64_t d = atomic_load(&w->mb.deq);
	if (d == w->wd_deq && atomic_load(&w->popped) == d + 1)
		return c;
	atomic_store(&w->claim, c); /* the worker, out, may wait for it to change */
	return -1;
}

static void let_go(ap_worker *w, int had, int answered)
{
	atomic_store(&w->claim, answered || had == CLAIM_ANSWERED ? CLAIM_ANSWERED : CLAIM_HELD);
}

static void answer_timeout(ap_pool *p, const ap_job *j)
{
	if (j->is_ask)
		ap_answer_loop_job(p, j, "handler_timeout");
}

/* Thread mode, claimed: the mailbox's head is the job the worker runs;
 * everything after it moves. Counted out of enq (the loop's counter):
 * deq is the worker's. How many moved. */
static uint64_t steal_queue(ap_pool *p, ap_worker *w)
{
	ap_mbox *m = &w->mb;
	ap_job *j = atomic_load_explicit(&m->head->next, memory_order_acquire);
	atomic_store_explicit(&m->head->next, NULL, memory_order_relaxed);
	m->tail = m->head;
	uint64_t moved = 0;
	while (j) {
		ap_job *next = atomic_load_explicit(&j->next, memory_order_relaxed);
		ap_pool_move_job(p, w, j);
		free(j);
		moved++;
		j = next;
	}
	atomic_store_explicit(&m->enq, atomic_load_explicit(&m->enq, memory_order_relaxed) - moved,
			      memory_order_relaxed);
	return moved;
}

/* The jobs queued behind a stalled or hung worker's message, to the other
 * workers, if any serves: how many moved, or -1 when that cannot be done
 * now (tried again on the next look). */
static long long move_queue(ap_pool *p, ap_worker *w)
{
	long long moved = 0;
	w->wd_retry = 0;
	if (ap_mbox_depth(&w->mb) > 1) {
		if (!ap_pool_others_alive(p, w)) {
			moved = -1; /* they wait for it, or for another to serve */
		} else if (w->iso) {
			moved = ap_iso_revoke(w);
		} else {
			int had = claim(w);
			moved = had < 0 ? -1 : (long long)steal_queue(p, w);
			if (had >= 0)
				let_go(w, had, 0);
		}
		ap_pool_wake_pushed(p);
	}
	w->wd_retry = moved < 0;
	w->wd_enq = atomic_load_explicit(&w->mb.enq, memory_order_relaxed);
	return moved;
}

static void stall(ap_pool *p, ap_worker *w, int64_t busy)
{
	long long moved;
	int had = -1;
	/* A thread is claimed first: one that is out of the message after
	 * all is not stalled. */
	if (!w->iso && ap_mbox_depth(&w->mb) > 1 && ap_pool_others_alive(p, w) && (had = claim(w)) < 0)
		return;
	w->wd_state = W_STALLED;
	w->stalls++;
	atomic_store(&w->alive, 0);
	if (had >= 0) {
		moved = (long long)steal_queue(p, w);
		let_go(w, had, 0);
		w->wd_retry = 0;
		w->wd_enq = atomic_load_explicit(&w->mb.enq, memory_order_relaxed);
		ap_pool_wake_pushed(p);
	} else {
		moved = move_queue(p, w);
	}
	ap_log(AP_LOG_WARNING, "pool %s: worker %d has been busy on one message for %lld ms (stall_ms %d): it gets "
	       "no new messages until that one is done; %lld queued behind it moved to the other workers", p->name,
	       w->id, (long long)busy, p->o.stall_ms, moved < 0 ? 0LL : moved);
}

/* Thread mode: the handler is over handler_timeout_ms. */
static void hang(ap_pool *p, ap_worker *w)
{
	int had = claim(w);
	if (had < 0)
		return;
	ap_job *j = w->mb.head;
	if (j->is_answer) {
		/* Not a handler's run: its answer is being delivered. */
		let_go(w, had, 0);
		return;
	}
	ap_worker_count_crash(w, AP_CRASH_TIMEOUT);
	if (w->wd_state == W_RUNNING)
		w->stalls++;
	w->wd_state = W_HUNG;
	atomic_store(&w->alive, 0);
	answer_timeout(p, j);
	uint64_t moved = ap_pool_others_alive(p, w) ? steal_queue(p, w) : 0;
	let_go(w, had, 1);
	w->wd_retry = !moved && ap_mbox_depth(&w->mb) > 1;
	w->wd_enq = atomic_load_explicit(&w->mb.enq, memory_order_relaxed);
	ap_pool_wake_pushed(p);
	ap_log(AP_LOG_WARNING, "pool %s: worker %d's handler ran over %d ms; the worker is skipped until it returns",
	       p->name, w->id, p->o.handler_timeout_ms);
}

/* The message a stalled, hung or killed worker was on is done. */
static void back(ap_pool *p, ap_worker *w, int64_t now)
{
	int was = w->wd_state;
	w->wd_state = W_RUNNING;
	if (was == W_KILLED)
		return; /* its process is gone: the slot is replaced */
	if (!p->stopping && !atomic_load(&w->stop))
		atomic_store(&w->alive, 1);
	ap_log(AP_LOG_INFO, "pool %s: worker %d's message is done after about %lld ms; the worker serves again",
	       p->name, w->id, (long long)(now - w->wd_since));
}

static void watch(ap_pool *p, ap_worker *w, int64_t now)
{
	/* A worker that serves, or that the watchdog holds back: not one in
	 * its init or waiting for its replacement. */
	if (!w->thread_live || (w->wd_state == W_RUNNING && !ap_worker_alive(w))) {
		w->wd_since = 0;
		return;
	}
	uint64_t d = atomic_load_explicit(&w->mb.deq, memory_order_acquire);
	uint64_t e = atomic_load_explicit(&w->mb.enq, memory_order_relaxed);
	if (d != w->wd_deq || e == d) {
		if (w->wd_state != W_RUNNING)
			back(p, w, now);
		w->wd_deq = d;
		w->wd_since = e != d ? now : 0;
		return;
	}
	if (!w->wd_since) {
		w->wd_since = now;
		return;
	}
	int64_t busy = now - w->wd_since;
	int tmo = p->o.handler_timeout_ms;
	if (tmo && busy >= tmo && w->wd_state != W_HUNG && w->wd_state != W_KILLED) {
		if (!w->iso) {
			hang(p, w);
		} else if (ap_iso_timeout(w, d)) {
			/* Its process is killed: answered and counted as it dies. */
			if (w->wd_state == W_RUNNING)
				w->stalls++;
			w->wd_state = W_KILLED;
			atomic_store(&w->alive, 0);
		}
	} else if (p->o.stall_ms && busy >= p->o.stall_ms && w->wd_state == W_RUNNING) {
		stall(p, w, busy);
	} else if (w->wd_state == W_STALLED || w->wd_state == W_HUNG) {
		/* More came behind it (routing queues to it when no worker
		 * serves), or the last move could not be made. */
		if (w->wd_retry || e != w->wd_enq) {
			long long moved = move_queue(p, w);
			if (moved > 0)
				ap_log(AP_LOG_INFO, "pool %s: moved %lld queued messages off stalled worker %d", p->name,
				       moved, w->id);
		}
	}
}

/* The watchdog's period: a quarter of the shorter limit, 10 to 100 ms. */
static int watch_period(const ap_pool *p)
{
	int a = p->o.stall_ms, b = p->o.handler_timeout_ms;
	int m = a && b ? (a < b ? a : b) : a ? a : b;
	m /= 4;
	return m < 10 ? 10 : m > 100 ? 100 : m;
}

static void watchdog(ap_node *n, void *arg)
{
	ap_pool *p = arg;
	p->timers--;
	if (p->stopping) {
		maybe_free(p);
		return;
	}
	int64_t now = ap_mono_ms();
	for (int i = 0; i < p->o.workers; i++)
		watch(p, &p->w[i], now);
	if (ap_node_timer(n, watch_period(p), watchdog, p) == 0)
		p->timers++;
}

static int backoff_ms(ap_pool *p, ap_worker *w)
{
	double d = p->o.backoff_min_ms;
	for (int i = 1; i < w->streak && d < p->o.backoff_max_ms; i++)
		d *= 2;
	if (d > p->o.backoff_max_ms)
		d = p->o.backoff_max_ms;
	double u = (double)(ap_xorshift(&p->rng) >> 11) / (double)(1ULL << 53);
	d *= 1.0 - p->o.jitter * u;
	return d < 1 ? 1 : (int)d;
}

void ap_pool_worker_exited(ap_node *n, void *arg)
{
	ap_worker *w = arg;
	ap_pool *p = w->pool;
	pthread_join(w->th, NULL);
	w->thread_live = 0;
	p->threads--;
	atomic_store(&w->alive, 0);
	/* Whatever the watchdog held it for went with it. */
	w->wd_state = W_RUNNING;
	w->wd_since = 0;
	w->wd_retry = 0;
	/* Before anything reads the mailbox: its child's bare tells join it. */
	if (w->iso)
		ap_iso_rehydrate(w);

	if (w->exit_reason == EXIT_INIT_FAILED && w->gen == 0) {
		if (!p->init_failed) {
			p->init_failed = w->init_rc ? w->init_rc : -1;
			p->init_fail = w->init_fail;
		}
		first_init_reported(p);
		maybe_free(p);
		return;
	}
	if (p->stopping) {
		maybe_free(p);
		return;
	}
	/* A crash (or a replacement whose init failed): replace it later. */
	int64_t now = ap_node_now_ms(n);
	if (now - w->started_ms >= p->o.stable_ms)
		w->streak = 0;
	w->streak++;
	w->next_restart_ms = backoff_ms(p, w);
	ap_log(AP_LOG_WARNING, "pool %s: worker %d %s; replacing it in %d ms (crash %d in a row)", p->name, w->id,
	       w->exit_reason == EXIT_CRASH ? "crashed" : "failed its init", w->next_restart_ms, w->streak);
	redistribute(p, w);
	if (ap_node_timer(n, w->next_restart_ms, restart, w) == 0) {
		p->timers++;
		w->restart_pending = 1;
	}
}

static int online_cpus(void)
{
	long c = sysconf(_SC_NPROCESSORS_ONLN);
	return c > 0 ? (int)(c > MAX_WORKERS ? MAX_WORKERS : c) : 4;
}

int ap_pool_start(ap_node *n, const char *name, const char *handler_desc, const char *spec,
		  const actor_pool_handler *h, void *dl, const uint8_t *config, size_t config_len, const ap_pool_opts *o,
		  ap_pending_reply *reply)
{
	if (ap_proc_whereis(n, name))
		return -EEXIST;
	if (o->isolation == AP_ISO_PROCESS && !spec)
		return -EINVAL;
	ap_pool *p = calloc(1, sizeof *p);
	if (!p)
		return -ENOMEM;
	p->n = n;
	p->o = *o;
	if (p->o.workers <= 0)
		p->o.workers = online_cpus();
	snprintf(p->name, sizeof p->name, "%s", name);
	snprintf(p->handler_desc, sizeof p->handler_desc, "%s", handler_desc);
	/* Aligned as ap_worker asks (its mailbox's lines, alignas(64)). */
	p->w = aligned_alloc(alignof(ap_worker), (size_t)p->o.workers * sizeof *p->w);
	if (p->w)
		memset(p->w, 0, (size_t)p->o.workers * sizeof *p->w);
	p->wake_list = calloc((size_t)p->o.workers, sizeof *p->wake_list);
	if (config_len) {
		p->config = malloc(config_len);
		if (p->config)
			memcpy(p->config, config, config_len);
	}
	p->config_len = config_len;
	if (p->o.isolation == AP_ISO_PROCESS)
		p->spec = strdup(spec);
	p->atoms = ap_atomset_new(p->o.max_reply_atoms);
	if (!p->w || !p->wake_list || (config_len && !p->config) || (p->o.isolation == AP_ISO_PROCESS && !p->spec) ||
	    !p->atoms)
		goto nomem;
	for (int i = 0; i < p->o.workers; i++) {
		ap_worker *w = &p->w[i];
		w->pool = p;
		w->id = i;
		if (ap_mbox_init(&w->mb))
			goto nomem;
		if (p->o.isolation == AP_ISO_PROCESS && ap_iso_slot_init(w))
			goto nomem;
	}
	if (p->o.isolation == AP_ISO_PROCESS)
		ap_sb_warn(p->name, &p->o.sandbox, p->o.max_memory_mb, ap_iso_sb_layers(&p->w[0]));
	p->proc = ap_proc_spawn(n, name, ap_pool_process, p);
	if (!p->proc)
		goto nomem;
	p->pid = p->proc->pid;
	p->h = h;
	p->dl = dl;
	p->inline_ok = p->o.isolation == AP_ISO_THREAD && !p->o.handler_timeout_ms && !dl && ap_handler_may_inline(h);
	/* Each pool its own stream: seeded from the time and the pool's
	 * address, pools started within a second where a stopped one's
	 * memory was reused routed alike, message for message. */
	p->rng = ap_rand_seed(p);
	if (!p->rng)
		p->rng = 1;
	p->started_ms = ap_node_now_ms(n);
	p->start_reply = reply;
	p->starting = p->o.workers;
	/* Append: which_pools lists in start order. */
	ap_pool **pp = &pools;
	while (*pp)
		pp = &(*pp)->next;
	*pp = p;
	pools_gen++;
	for (int i = 0; i < p->o.workers; i++)
		if (worker_start(&p->w[i])) {
			p->init_failed = -EAGAIN;
			first_init_reported(p);
		}
	if ((p->o.stall_ms || p->o.handler_timeout_ms) && ap_node_timer(n, watch_period(p), watchdog, p) == 0)
		p->timers++;
	return 0;
nomem:
	if (p->w)
		for (int i = 0; i < p->o.workers; i++) {
			if (p->w[i].mb.head)
				ap_mbox_destroy(&p->w[i].mb);
			ap_iso_slot_free(&p->w[i]);
		}
	free(p->w);
	free(p->wake_list);
	free(p->config);
	free(p->spec);
	free(p->atoms);
	free(p);
	return -ENOMEM;
}

void ap_pool_stop(ap_node *n, ap_pool *p)
{
	if (p->stopping)
		return;
	p->stopping = 1;
	pools_gen++;
	if (p->proc) {
		ap_proc_exit(n, p->proc, "shutdown");
		p->proc = NULL;
	}
	for (int i = 0; i < p->o.workers; i++) {
		ap_worker *w = &p->w[i];
		atomic_store(&w->stop, 1);
		ap_worker_wake(w, 1, 0);
	}
	ap_log(AP_LOG_INFO, "pool %s stopping", p->name);
	maybe_free(p);
}

ap_pool *ap_pool_find(ap_node *n, const char *name, const erlang_pid *pid)
{
	(void)n;
	for (ap_pool *p = pools; p; p = p->next) {
		if (p->stopping)
			continue;
		if (name && !strcmp(p->name, name))
			return p;
		if (pid && pid->num == p->pid.num && pid->serial == p->pid.serial && pid->creation == p->pid.creation &&
		    !strcmp(pid->node, p->pid.node))
			return p;
	}
	return NULL;
}

int ap_pool_encode_list(ei_x_buff *x)
{
	int count = 0;
	for (ap_pool *p = pools; p; p = p->next)
		count += !p->stopping;
	if (count)
		ei_x_encode_list_header(x, count);
	for (ap_pool *p = pools; p; p = p->next) {
		if (p->stopping)
			continue;
		ei_x_encode_tuple_header(x, 2);
		ei_x_encode_atom(x, p->name);
		ei_x_encode_pid(x, &p->pid);
	}
	return ei_x_encode_empty_list(x);
}

/* ---- worker processes' exits --------------------------------------------- */

static int sigchld_fd = -1;

static void on_sigchld(ap_node *n, void *arg)
{
	(void)n;
	(void)arg;
	struct signalfd_siginfo si;
	/* Coalesced: one read may stand for many exits, so every slot with
	 * a process is asked (waitid on its pidfd, WNOHANG). */
	while (read(sigchld_fd, &si, sizeof si) == (ssize_t)sizeof si)
		;
	for (ap_pool *p = pools; p; p = p->next)
		for (int i = 0; i < p->o.workers; i++)
			if (p->w[i].iso)
				ap_iso_reap(&p->w[i]);
}

int ap_pool_watch_children(ap_node *n)
{
	barriers_init();
	sigset_t m;
	sigemptyset(&m);
	sigaddset(&m, SIGCHLD);
	sigchld_fd = signalfd(-1, &m, SFD_NONBLOCK | SFD_CLOEXEC);
	if (sigchld_fd < 0)
		return -errno;
	int r = ap_node_add_reader(n, sigchld_fd, on_sigchld, NULL);
	if (r) {
		close(sigchld_fd);
		sigchld_fd = -1;
	}
	return r;
}

int ap_pool_iso_take_all(int looks)
{
	int flags = 0;
	/* Where the loop runs, for children that follow it (isolate.h,
	 * loop_cpu), read once per pass and only with such a pool: glibc
	 * reads it from rseq, no syscall. */
	int cpu = -2;
	for (ap_pool *p = pools; p; p = p->next)
		if (p->o.isolation == AP_ISO_PROCESS)
			for (int i = 0; i < p->o.workers; i++)
				if (p->w[i].iso) {
					if (cpu == -2)
						cpu = looks ? sched_getcpu() : -1;
					int f = ap_iso_take_direct(&p->w[i], looks, cpu);
					/* A stalled worker's ask is not worth a wait. */
					if (p->w[i].wd_state != W_RUNNING)
						f &= ~AP_ISO_ASKS_OUT;
					flags |= f;
				}
	return flags;
}

unsigned long long ap_pool_iso_follows(void)
{
	unsigned long long n = 0;
	for (ap_pool *p = pools; p; p = p->next)
		for (int i = 0; i < p->o.workers; i++)
			if (p->w[i].iso)
				n += ap_iso_follows(&p->w[i]);
	return n;
}

void ap_pool_wake_all_pushed(void)
{
	ap_pool_inline_reset();
	for (ap_pool *p = pools; p; p = p->next)
		if (p->nwake)
			ap_pool_wake_pushed(p);
}

void ap_pool_tick(ap_node *n, void *arg)
{
	int64_t now = ap_node_now_ms(n);
	for (ap_pool *p = pools; p; p = p->next)
		ap_pool_stats_tick(p, now);
	ap_node_timer(n, 1000, ap_pool_tick, arg);
}
