/* dispatch: routing (round robin, smallest mailbox, random), and a
 * message's way into the mailbox of the worker chosen, or onto the loop
 * itself (inline runs); jobs moved off a worker to another. Workers are
 * reached only through their kind (w->ops). */
#include <errno.h>
#include <string.h>

#include "ap_log.h"
#include "ap_time.h"
#include "pool_int.h"

/* This drain's inline budget: its end (0 before the first inline run, -1
 * once spent), and the bytes run since the clock was last read: read per
 * 4 KiB rather than per message (a tell flood runs ~2M a second). */
static int64_t inline_until_us;
static uint32_t inline_unclocked;

void ap_pool_inline_reset(void) { inline_until_us = 0; }

static int inline_budget_left(int msg_len)
{
	if (inline_until_us < 0)
		return 0;
	if (!inline_until_us) {
		inline_until_us = ap_mono_us() + AP_INLINE_BUDGET_US;
		inline_unclocked = 0;
		return 1;
	}
	inline_unclocked += (uint32_t)msg_len + 64;
	if (inline_unclocked < 4096)
		return 1;
	inline_unclocked = 0;
	if (ap_mono_us() < inline_until_us)
		return 1;
	inline_until_us = -1;
	return 0;
}

int ap_pool_can_inline(ap_pool *p, ap_worker *w, int msg_len)
{
	if (!p->inline_ok || msg_len > AP_INLINE_MAX_BYTES || !ap_worker_alive(w) ||
	    atomic_load_explicit(&w->stop, memory_order_relaxed) || atomic_load(&w->crash_pending))
		return 0;
	/* Idle: every job pushed is done (an acquire of the count the
	 * worker bumps with a release), and then asleep with a flag raised
	 * after the last of them was answered. A flag read before that job
	 * is ruled out: the job's done count is ordered after the worker's
	 * lowering of the flag to take it. */
	uint64_t e = atomic_load_explicit(&w->mb.enq, memory_order_relaxed);
	if (atomic_load_explicit(&w->mb.deq, memory_order_acquire) != e || atomic_load(&w->sleeping) != 1)
		return 0;
	return inline_budget_left(msg_len);
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
	actor_pool_request req = ap_job_request(w, j);
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
		ap_worker_count_done(w, st);
	}
	if (j->is_ask && ap_answer(w, j, status, &w->reply,
				   AP_ANSWER_NOWAIT | (st == AP_HANDLER_CRASH ? AP_ANSWER_OWN : 0)) == -EAGAIN)
		hand_answer_over(w, j);
	j->free_next = w->job_cache;
	w->job_cache = j;
}

/* Room for one more: in process mode, ok tells its child finished may
 * still sit in the mailbox (they leave it when the next message is sent,
 * which a full mailbox holds off), so a full one is looked at again. */
static int has_room(ap_pool *p, ap_worker *w)
{
	if (ap_mbox_depth(&w->mb) < p->o.mailbox_limit)
		return 1;
	if (!w->ops->reclaim)
		return 0;
	w->ops->reclaim(w);
	return ap_mbox_depth(&w->mb) < p->o.mailbox_limit;
}

/* Pick a worker with room, or NULL (overloaded). Round robin walks the
 * slots; random starts anywhere; smallest_mailbox compares two random
 * slots (power of two choices): O(1) per message and no lock, yet it keeps
 * the maximum depth within a small factor of the ideal. Dead slots are
 * skipped; full ones are passed over up to ROUTE_TRIES times. */
ap_worker *ap_pool_route(ap_pool *p)
{
	int nw = p->o.workers;
	uint32_t start;
	switch (p->o.routing) {
	case AP_ROUTE_RANDOM:
		start = (uint32_t)(ap_xorshift(&p->rng) % (uint64_t)nw);
		break;
	case AP_ROUTE_SMALLEST_MAILBOX: {
		uint64_t r = ap_xorshift(&p->rng);
		uint32_t a = (uint32_t)(r % (uint64_t)nw), b = a;
		if (nw > 1) /* two distinct slots: comparing one with itself picks blindly */
			b = (a + 1 + (uint32_t)((r >> 32) % (uint64_t)(nw - 1))) % (uint32_t)nw;
		ap_worker *wa = &p->w[a], *wb = &p->w[b];
		if (!ap_worker_alive(wa) || (ap_worker_alive(wb) && ap_mbox_depth(&wb->mb) < ap_mbox_depth(&wa->mb)))
			a = b;
		start = a;
		break;
	}
	default:
		start = (uint32_t)(p->rr++ % (uint64_t)nw);
		break;
	}
	int tries = 0, any_alive = 0;
	for (int k = 0; k < nw && tries < ROUTE_TRIES; k++) {
		ap_worker *w = &p->w[(start + (uint32_t)k) % (uint32_t)nw];
		if (!ap_worker_alive(w))
			continue;
		any_alive = 1;
		tries++;
		if (has_room(p, w))
			return w;
	}
	if (!any_alive) {
		/* Every slot waits for its replacement: queue for it. */
		ap_worker *w = &p->w[start];
		if (ap_mbox_depth(&w->mb) < p->o.mailbox_limit)
			return w;
	}
	return NULL;
}

/* Wakes are deferred to the end of the message being dispatched (see
 * ap_pool_wake_pushed): a worker woken per job would drain its one job and sleep
 * again while the loop is still unpacking the rest of a batch. */
void ap_pool_wake_later(ap_worker *w, int ask)
{
	w->wake_ask |= ask;
	if (!w->wake_pending) {
		w->wake_pending = 1;
		w->pool->wake_list[w->pool->nwake++] = w->id;
	}
}

void ap_pool_push(ap_worker *w, ap_job *j)
{
	ap_mbox_push(&w->mb, j);
	ap_pool_wake_later(w, j->is_ask);
}

void ap_pool_wake_pushed(ap_pool *p)
{
	for (int k = 0; k < p->nwake; k++) {
		ap_worker *w = &p->w[p->wake_list[k]];
		w->wake_pending = 0;
		ap_worker_wake(w, 0, w->wake_ask);
		w->wake_ask = 0;
	}
	p->nwake = 0;
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

/* Route one message. rq->msg: a term without its 131 byte. An ask's hold
 * on its route goes to its job, or is released by the loop's answer. */
void ap_pool_dispatch(ap_pool *p, const ap_request *rq)
{
	const char *msg = rq->msg;
	int msg_len = rq->msg_len;
	int is_ask = rq->kind == AP_REQ_ASK;
	ap_worker *w = ap_pool_route(p);
	if (!w) {
		if (is_ask) {
			p->overloaded++;
			ap_answer_loop(p, &rq->route, rq->head, rq->head_len, rq->addr, "overloaded");
		} else {
			p->dropped_tells++;
		}
		return;
	}
	int is_binary = msg_len >= 5 && (uint8_t)msg[0] == 109;
	size_t body = ap_msg_body_len(msg_len, is_binary);
	size_t head = is_ask ? rq->head_len : 0;
	size_t addr = is_ask ? rq->addr_len : 0;
	int batched = rq->route.ops->batched;
	/* A batched tell to a worker process may need no job (isolate_loop.c,
	 * bare tells); its wake pass publishes it. */
	if (batched && !is_ask && w->ops->post_tell && w->ops->post_tell(w, msg, msg_len, is_binary)) {
		ap_pool_wake_later(w, 0);
		return;
	}
	/* Batched messages only: the budget is per batch (reset at its end,
	 * ap_pool_wake_all_pushed), and other asks are answered through the
	 * loop's own queue, not from the loop itself. */
	int inline_ok = batched && ap_pool_can_inline(p, w, msg_len);
	ap_job *j = ap_job_alloc(&w->mb, &w->job_cache, head + body + addr);
	if (!j) {
		if (is_ask)
			ap_answer_loop(p, &rq->route, rq->head, rq->head_len, rq->addr, "enomem");
		return;
	}
	j->is_ask = (uint8_t)is_ask;
	j->is_binary = (uint8_t)is_binary;
	j->route = is_ask ? rq->route : (ap_route){ 0 };
	j->head_len = (uint32_t)head;
	j->msg_len = (uint32_t)body;
	j->addr_len = (uint32_t)addr;
	uint8_t *d = j->data;
	if (head)
		memcpy(d, rq->head, head);
	d += head;
	ap_msg_body_copy(d, msg, msg_len, is_binary);
	d += body;
	if (addr)
		memcpy(d, rq->addr, addr);
	if (inline_ok)
		ap_pool_run_inline(w, j);
	else
		ap_pool_push(w, j);
}
