/* watchdog: stalls and handler_timeout_ms.
 *
 * A pool with stall_ms or handler_timeout_ms has a timer on the loop
 * (pool.c) that looks at each worker's mailbox counters. A worker whose
 * done count (deq) has not moved while a message was in its mailbox has
 * been on the message at its head since the first look that saw it so:
 * the workers pay nothing per message for it (no clock read, no store),
 * and a busy time is known to the timer's period (a quarter of the
 * shorter limit, 10 to 100 ms), late but never early.
 *
 * Past stall_ms the worker is stalled: routing skips it, and what is
 * queued behind that message moves to the other workers (in process mode
 * also what its process was sent and has not started: isolate_loop.c,
 * ap_iso_revoke). It serves again once the message is done. Past
 * handler_timeout_ms the message is answered {error, handler_timeout}: a
 * worker process is killed (isolate_proxy.c answers when it is gone), a thread
 * cannot be, so it is marked hung and the loop answers for it
 * (worker_thread.c). What is done to a worker is its kind's (its ops:
 * stall, move_queue, overtime); when, and the states, are this file's. */
#include <linux/membarrier.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "ap_log.h"
#include "pool_int.h"

/* ---- barriers ------------------------------------------------------------------ */

int ap_pool_fence_each = 1; /* until membarrier is known to work (ap_pool_barriers_init) */
static int mb_threads, mb_children;

/* Loop thread, before the first worker starts. */
void ap_pool_barriers_init(void)
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

/* ---- the verdicts ----------------------------------------------------------------- */

void ap_wd_stalled(ap_worker *w)
{
	w->wd_state = W_STALLED;
	w->stalls++;
	atomic_store(&w->alive, 0);
}

/* The jobs queued behind a stalled or hung worker's message, to the other
 * workers, if any serves: how many moved, or -1 when that cannot be done
 * now (tried again on the next look). */
long long ap_wd_move_queue(ap_pool *p, ap_worker *w)
{
	long long moved = 0;
	w->wd_retry = 0;
	if (ap_mbox_depth(&w->mb) > 1) {
		if (!ap_pool_others_alive(p, w)) {
			moved = -1; /* they wait for it, or for another to serve */
		} else {
			moved = w->ops->move_queue(w);
		}
		ap_pool_wake_pushed(p);
	}
	w->wd_retry = moved < 0;
	w->wd_enq = atomic_load_explicit(&w->mb.enq, memory_order_relaxed);
	return moved;
}

static void stall(ap_pool *p, ap_worker *w, int64_t busy)
{
	long long moved = w->ops->stall(w);
	if (moved == AP_WD_NOT_STALLED)
		return;
	ap_log(AP_LOG_WARNING, "pool %s: worker %d has been busy on one message for %lld ms (stall_ms %d): it gets "
	       "no new messages until that one is done; %lld queued behind it moved to the other workers", p->name,
	       w->id, (long long)busy, p->o.stall_ms, moved < 0 ? 0LL : moved);
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

void ap_wd_watch(ap_pool *p, ap_worker *w, int64_t now)
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
		w->ops->overtime(w, d);
	} else if (p->o.stall_ms && busy >= p->o.stall_ms && w->wd_state == W_RUNNING) {
		stall(p, w, busy);
	} else if (w->wd_state == W_STALLED || w->wd_state == W_HUNG) {
		/* More came behind it (routing queues to it when no worker
		 * serves), or the last move could not be made. */
		if (w->wd_retry || e != w->wd_enq) {
			long long moved = ap_wd_move_queue(p, w);
			if (moved > 0)
				ap_log(AP_LOG_INFO, "pool %s: moved %lld queued messages off stalled worker %d", p->name,
				       moved, w->id);
		}
	}
}

/* The watchdog's period: a quarter of the shorter limit, 10 to 100 ms. */
int ap_wd_period(const ap_pool *p)
{
	int a = p->o.stall_ms, b = p->o.handler_timeout_ms;
	int m = a && b ? (a < b ? a : b) : a ? a : b;
	m /= 4;
	return m < 10 ? 10 : m > 100 ? 100 : m;
}
