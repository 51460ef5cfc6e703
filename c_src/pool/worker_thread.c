/* worker_thread: workers that are threads of the pool node (isolation =>
 * thread, the default): each runs its handler on the jobs of its mailbox
 * and sleeps on its doorbell when the mailbox is empty; and the
 * watchdog's hold on a thread busy in its handler (its claim). The rest
 * of the pool reaches them through ap_worker_threads (pool_int.h). */
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "ap_log.h"
#include "ap_ring.h"
#include "ap_time.h"
#include "pool_int.h"

/* ---- the doorbell -------------------------------------------------------------- */

/* The worker's doorbell is its `sleeping` word, a private futex: the
 * loop wakes it with one FUTEX_WAKE and no lock, so the woken worker never
 * blocks again on a mutex the waker still holds (a mutex and condvar cost
 * 5-6 syscalls and two switches per sleep). Before sleeping the worker
 * spins briefly, so a job that follows the last within a few microseconds
 * (64 callers) costs no sleep and no wake; the spin is short because on a
 * 2-core host it takes the CPU the loop needs to bring that job. */
#define AP_WORKER_SPIN 64

static void futex_wait_private(_Atomic int *w, int expected)
{
	(void)syscall(SYS_futex, (int *)w, FUTEX_WAIT_PRIVATE, expected, NULL, NULL, 0);
}

static void futex_wake_private(_Atomic int *w)
{
	(void)syscall(SYS_futex, (int *)w, FUTEX_WAKE_PRIVATE, 1, NULL, NULL, 0);
}

ap_job *ap_worker_next_job(ap_worker *w)
{
	for (;;) {
		if (atomic_load(&w->crash_pending))
			return NULL; /* an inline run crashed on its behalf */
		ap_job *j = ap_mbox_pop(&w->mb);
		if (j || atomic_load(&w->stop))
			return j;
		for (int k = 0; k < AP_WORKER_SPIN && ap_mbox_empty(&w->mb) && !atomic_load(&w->stop); k++)
			ap_ring_cpu_relax();
		if (!ap_mbox_empty(&w->mb))
			continue;
		atomic_store(&w->sleeping, 1);
		/* Checked after the flag (both seq_cst): a push we miss here
		 * sees the flag, takes it down and wakes us; if that happened
		 * already, the wait returns at once (the word is no longer 1). */
		if (ap_mbox_empty(&w->mb) && !atomic_load(&w->stop) && !atomic_load(&w->crash_pending))
			futex_wait_private(&w->sleeping, 1);
		atomic_store(&w->sleeping, 0);
	}
}

static void thread_wake(ap_worker *w, int always, int ask)
{
	(void)ask; /* a thread wakes for any job */
	/* Orders the pushes before (release stores, ap_mbox_push) before
	 * the look at the flag: the Dekker pair of the worker's raising it,
	 * then its look at the mailbox (ap_worker_next_job). */
	atomic_thread_fence(memory_order_seq_cst);
	if (always) {
		atomic_store(&w->sleeping, 0);
		futex_wake_private(&w->sleeping);
	} else if (atomic_load(&w->sleeping) && atomic_exchange(&w->sleeping, 0)) {
		futex_wake_private(&w->sleeping);
	}
}

/* ---- the watchdog's claim ----------------------------------------------------
 * A thread reads its mailbox as it likes: the loop takes it over (claim)
 * only while the worker is inside a message, and the worker meets the
 * claim at the end of that message (end_of_message), before it touches
 * the mailbox again. The worker stores its done count, then loads the
 * claim, with no fence between them; the loop stores the claim, then
 * loads the count after a membarrier(2), which runs a full barrier on
 * every thread of the pool node: either the loop sees the count moved
 * (the worker is out: it lets go) or the worker sees the claim. Where the
 * kernel has no such barrier, each worker fences after each message
 * instead (ap_pool_fence_each, watchdog.c). */

/* ap_worker.claim: none; the loop holds the mailbox (the worker waits);
 * the loop moved the queue; ... and answered the message too. */
enum { CLAIM_NONE, CLAIM_ASK, CLAIM_HELD, CLAIM_ANSWERED };

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

/* ---- the thread ------------------------------------------------------------------ */

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
		actor_pool_request req = ap_job_request(w, j);
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
		ap_worker_count_done(w, st);
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

/* ---- the watchdog's verdicts on a thread ------------------------------------------ */

/* Past stall_ms: what is queued behind the message moves to the other
 * workers. A thread is claimed first: one that is out of the message
 * after all is not stalled. */
static long long thread_stall(ap_worker *w)
{
	ap_pool *p = w->pool;
	long long moved;
	int had = -1;
	if (ap_mbox_depth(&w->mb) > 1 && ap_pool_others_alive(p, w) && (had = claim(w)) < 0)
		return AP_WD_NOT_STALLED;
	ap_wd_stalled(w);
	if (had >= 0) {
		moved = (long long)steal_queue(p, w);
		let_go(w, had, 0);
		w->wd_retry = 0;
		w->wd_enq = atomic_load_explicit(&w->mb.enq, memory_order_relaxed);
		ap_pool_wake_pushed(p);
	} else {
		moved = ap_wd_move_queue(p, w);
	}
	return moved;
}

/* The queue behind a stalled or hung thread's message, if the thread is
 * still inside it (claimed). */
static long long thread_move_queue(ap_worker *w)
{
	int had = claim(w);
	long long moved = had < 0 ? -1 : (long long)steal_queue(w->pool, w);
	if (had >= 0)
		let_go(w, had, 0);
	return moved;
}

static void answer_timeout(ap_pool *p, const ap_job *j)
{
	if (j->is_ask)
		ap_answer_loop_job(p, j, "handler_timeout");
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

static void thread_overtime(ap_worker *w, uint64_t deq)
{
	(void)deq; /* the claim looks at the done count itself */
	hang(w->pool, w);
}

const ap_worker_ops ap_worker_threads = {
	.main = worker_main,
	.wake = thread_wake,
	.stall = thread_stall,
	.move_queue = thread_move_queue,
	.overtime = thread_overtime,
};
