/* isolate_proxy: the proxy thread of a worker process's slot (isolate.c
 * says how the files divide the work): it starts the child, sends it the
 * jobs of the slot's mailbox, turns its results into answers, and answers
 * for it when it dies or the pool stops; it sleeps on its doorbell when
 * there is nothing to do, and the loop may take its turn then
 * (isolate_loop.c).
 */
#include "isolate.h"
#include "isolate_int.h"
#include "isolate_node.h"

#include <errno.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <linux/futex.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include "ap_log.h"
#include "ap_ring.h"
#include "pool_int.h"

/* ---- sleeping ------------------------------------------------------------------ */

/* The oldest job is the child's: sent whole, or a part of it (a child
 * can die taking a large one in). */
static int front_out(const ap_iso *s) { return s->front_seq < s->next_seq || s->sent_off > 0; }

/* The proxy is the mailbox's only consumer: its oldest job stays put. */
static int front_is_ask(ap_worker *w)
{
	if (iso_front_bare(w->iso))
		return 0;
	ap_job *j = atomic_load_explicit(&w->mb.head->next, memory_order_acquire);
	return j && j->is_ask && !j->revoked;
}

static int ready_run(ap_worker *w);
static int ready_held(ap_worker *w);

static void futex_wait_us(_Atomic uint32_t *word, uint32_t expected, int64_t us)
{
	struct timespec ts = { .tv_sec = us / 1000000, .tv_nsec = (long)(us % 1000000) * 1000 };
	(void)syscall(SYS_futex, (uint32_t *)word, FUTEX_WAIT, expected, &ts, NULL, 0);
}

/* The proxy sleeps until the bell rings or timeout_us, unless ready()
 * already holds after it raised its flag (the Dekker pair of bell_ring).
 * direct: the loop may send asks meanwhile (send_direct). */
static void proxy_sleep_d(ap_worker *w, int64_t timeout_us, int (*ready)(ap_worker *), int direct)
{
	struct iso_ctl *c = w->iso->ctl;
	/* With an ask at the child its answer is microseconds away and a
	 * caller waits for it: a sleep and a wake-up would cost more. A tell's
	 * result only frees its slot, and spinning for it would take a core
	 * from the children (2 cores): sleep soon. */
	int spin = ready == ready_held ? 0 : front_out(w->iso) && front_is_ask(w) ? ISO_SPIN_INFLIGHT : ISO_SPIN;
	for (int k = 1; k <= spin; k++) {
		if (ready(w))
			return;
		/* On a core shared with the child (2 cores, more threads),
		 * spinning would hold off the result it waits for. */
		if (k % ISO_SPIN == 0 && k < spin)
			sched_yield();
		else
			ap_ring_cpu_relax();
	}
	uint32_t v = atomic_load(&c->proxy_bell);
	/* The cursor is only ours to read while running (ready_run). */
	atomic_store(&w->iso->want_jobs, ready == ready_held				? WANT_ASK
					 : ready == ready_run && iso_next_need(w->iso) == 0 ? WANT_ANY
											: WANT_NONE);
	atomic_store(&c->proxy_waiting, 1);
	atomic_thread_fence(memory_order_seq_cst);
	if (!ready(w)) {
		ap_iso *s = w->iso;
		if (direct)
			atomic_store(&s->direct_ok, 1);
		pthread_mutex_unlock(&s->send_mu);
		futex_wait_us(&c->proxy_bell, v, timeout_us);
		pthread_mutex_lock(&s->send_mu);
		atomic_store(&s->direct_ok, 0);
	}
	atomic_store(&c->proxy_waiting, 0);
	atomic_store(&w->iso->want_jobs, 0);
}

static void proxy_sleep(ap_worker *w, int64_t timeout_us, int (*ready)(ap_worker *))
{
	proxy_sleep_d(w, timeout_us, ready, 0);
}

/* ---- the proxy: results ---------------------------------------------------- */

/* {worker_crashed, Cause} or handler_timeout as the reply, for
 * ap_answer(..., "error", ..., AP_ANSWER_OWN). */
static void set_death_reply(ap_worker *w, int timeout)
{
	ap_iso *s = w->iso;
	if (timeout) {
		ap_pool_set_atom_reply(&w->reply, "handler_timeout");
		return;
	}
	char t[128];
	int i = 0;
	ei_encode_tuple_header(t, &i, 2);
	ei_encode_atom(t, &i, "worker_crashed");
	if (s->how == CLD_EXITED) {
		ei_encode_tuple_header(t, &i, 2);
		ei_encode_atom(t, &i, "exit");
		ei_encode_long(t, &i, s->code);
	} else {
		const char *abbr = sigabbrev_np(s->code);
		if (abbr) {
			char name[32];
			int n = snprintf(name, sizeof name, "sig%s", abbr);
			for (int k = 3; k < n && k < (int)sizeof name; k++)
				if (name[k] >= 'A' && name[k] <= 'Z')
					name[k] = (char)(name[k] - 'A' + 'a');
			ei_encode_atom(t, &i, name);
		} else {
			ei_encode_long(t, &i, s->code);
		}
	}
	actor_pool_reply_set(&w->reply, AP_REPLY_TERM, t, (size_t)i);
}

/* One whole result: the oldest job sent leaves the mailbox and is
 * answered. Returns 1 when the child said AP_HANDLER_CRASH. */
static int take_result(ap_worker *w, const struct iso_rec *h)
{
	ap_iso *s = w->iso;
	if (iso_front_bare(s)) {
		/* A tell: no answer, whatever came of it. */
		int revoked = s->bare[s->bare_head % ISO_BARE_MAX].revoked;
		iso_take_bare(w);
		s->got = 0;
		if (h->c || revoked)
			return 0;
		if (h->a == AP_HANDLER_CRASH) {
			ap_worker_count_crash(w, AP_CRASH_HANDLER);
			s->handler_crash = 1;
			return 1;
		}
		ap_worker_count_done(w, (actor_pool_status)h->a);
		return 0;
	}
	ap_job *j = ap_mbox_pop(&w->mb);
	s->front_seq++;
	s->got = 0;
	if (!j)
		return 0; /* cannot be: the seq was checked against what was sent */
	if (j->revoked)
		return 0; /* its copy is answered elsewhere; out of the depth already */
	ap_mbox_done(&w->mb);
	if (h->c) {
		if (j->is_ask)
			ap_answer_error(w, j, "stopped");
		return 0;
	}
	if (h->a == AP_HANDLER_CRASH) {
		ap_worker_count_crash(w, AP_CRASH_HANDLER);
		s->handler_crash = 1;
		if (j->is_ask)
			ap_answer_error(w, j, "worker_crashed");
		return 1;
	}
	ap_worker_count_done(w, (actor_pool_status)h->a);
	if (j->is_ask) {
		w->reply.kind = (actor_pool_reply_kind)h->b;
		ap_answer(w, j, h->a == AP_HANDLER_OK ? "ok" : "error", &w->reply, 0);
	}
	return 0;
}


/* Results the child has written, or ok tells it has finished since. An
 * ask at the front always has a record: done_seq is not looked at then
 * (an ask's caller waits; the line is the child's while it works). */
static int results_ready(ap_worker *w)
{
	ap_iso *s = w->iso;
	return ap_ring_readable(&s->rsp) ||
	       (!front_is_ask(w) && atomic_load_explicit(&s->ctl->done_seq, memory_order_relaxed) >= s->front_seq);
}

/* Everything the child has finished. 0, 1 (a handler crash: stop
 * sending, wait for its exit), -1 (the child broke the protocol). */
static int drain_results(ap_worker *w, int *progress)
{
	ap_iso *s = w->iso;
	const void *p;
	size_t len;
	int r, crash = 0;
	unsigned n = 0;
	/* Read before the records: those of every message up to it are
	 * published by now (the child stores it after them). */
	uint64_t done = atomic_load_explicit(&s->ctl->done_seq, memory_order_acquire);
	while ((r = ap_ring_read(&s->rsp, &p, &len)) == 0) {
		struct iso_rec h;
		if (len < sizeof h)
			goto bad;
		memcpy(&h, p, sizeof h);
		size_t chunk = len - sizeof h;
		if (iso_result_bad(s, &h, chunk))
			goto bad;
		/* The ok tells before it are done. */
		if (h.seq > s->front_seq && (s->got || iso_take_done(w, h.seq - 1, progress)))
			goto bad;
		if (h.off == 0)
			w->reply.len = 0;
		/* Grown by what arrives, not by what the child claims. */
		if (chunk && ap_pool_reply_reserve(&w->reply, chunk))
			goto bad;
		if (chunk)
			memcpy(w->reply.data + h.off, (const uint8_t *)p + sizeof h, chunk);
		s->got += chunk;
		w->reply.len = s->got;
		ap_iso_release_every(&s->rsp, &n, 64);
		if (s->got < h.total)
			continue;
		*progress = 1;
		if (take_result(w, &h)) {
			crash = 1;
			break;
		}
	}
	ap_ring_release(&s->rsp);
	if (r != 0 && r != -EAGAIN)
		goto bad;
	/* A result half taken in is the front's: done cannot be past it. */
	if (!crash && done >= s->front_seq && (s->got || iso_take_done(w, done, progress)))
		goto bad;
	return crash;
bad:
	ap_ring_release(&s->rsp);
	ap_log(AP_LOG_ERROR, "pool %s: worker %d's process broke its channel; killing it", w->pool->name, w->id);
	return -1;
}

/* Rings the child for tells held back once their time is up. The
 * microseconds left, or 0 when none are held (any more). */
static int64_t held_left(ap_iso *s)
{
	if (!s->unrung)
		return 0;
	int64_t left = s->unrung_since_us + ISO_HOLD_US - ap_mono_us();
	if (left > 0)
		return left;
	iso_ring_held(s);
	return 0;
}

/* ---- the proxy thread ------------------------------------------------------ */

static int ready_init(ap_worker *w)
{
	return atomic_load(&w->iso->ctl->init_state) || atomic_load(&w->iso->dead) || atomic_load(&w->stop);
}

static int ready_run(ap_worker *w)
{
	ap_iso *s = w->iso;
	size_t need;
	return results_ready(w) || atomic_load(&s->dead) || atomic_load(&w->stop) ||
	       ((need = iso_next_need(s)) && ap_ring_has_room(&s->req, need) != 0);
}

static int ready_dead(ap_worker *w) { return atomic_load(&w->iso->dead); }

/* While tells are held back: results, a death, a stop, an ask to send, or
 * a batch's worth of tells (the walk is bounded by it). */
static int ready_held(ap_worker *w)
{
	ap_iso *s = w->iso;
	if (results_ready(w) || atomic_load(&s->dead) || atomic_load(&w->stop))
		return 1;
	ap_job *j = s->cursor;
	for (unsigned k = s->unrung; k < ISO_RING_BATCH; k++) {
		j = atomic_load_explicit(&j->next, memory_order_acquire);
		if (!j)
			return 0;
		if (j->is_ask)
			return 1;
	}
	return 1;
}

/* Until the loop has reaped the child (it kills it first when told to). */
static void wait_reaped(ap_worker *w, int kill_it)
{
	ap_iso *s = w->iso;
	if (atomic_load(&s->pidfd) < 0)
		return;
	if (kill_it)
		iso_kill(s);
	/* Until it is reaped, however long: its pidfd and channel stay ours
	 * (a child stuck in the kernel, say dumping core to slow storage,
	 * still holds the mapping the next child would get). */
	int64_t next_log = ap_mono_ms() + ISO_REAP_MS;
	while (!atomic_load(&s->dead)) {
		proxy_sleep(w, 100000, ready_dead);
		if (atomic_load(&s->dead))
			break;
		ap_node_call_on_loop_sure(w->pool->n, iso_reap_cb, w);
		if (ap_mono_ms() >= next_log) {
			ap_log(AP_LOG_ERROR, "pool %s: worker %d's process (os pid %d) is not gone yet", w->pool->name,
			       w->id, atomic_load(&w->os_pid));
			next_log += ISO_REAP_MS;
			if (kill_it)
				iso_kill(s);
		}
	}
}

/* The child is gone: answer the message it died on, count why. */
static void on_death(ap_worker *w)
{
	ap_iso *s = w->iso;
	struct iso_ctl *c = s->ctl;
	int progress = 0;
	(void)drain_results(w, &progress); /* what it finished before it died */
	uint64_t running = atomic_load(&c->running_seq);
	/* Killed by the loop for a timeout, and that message is still
	 * unanswered (it may have finished between the loop's look and the
	 * kill): nothing done since. */
	uint64_t tdeq = atomic_load(&s->timeout_deq);
	int timeout = tdeq && tdeq - 1 == atomic_load(&w->mb.deq) && front_out(s) && !iso_front_revoked(s, w);
	if (s->handler_crash && !s->killed && !timeout)
		return; /* counted with its result */
	enum ap_crash_cause cause = timeout ? AP_CRASH_TIMEOUT
				    : s->how == CLD_EXITED ? AP_CRASH_EXIT : AP_CRASH_SIGNAL;
	ap_worker_count_crash(w, cause);
	/* running_seq is the child's word, so only a hint: a timeout is
	 * ours, and answers the message we timed. */
	if (timeout || (running && running == s->front_seq && front_out(s))) {
		ap_job *j = NULL;
		if (iso_front_bare(s))
			iso_take_bare(w); /* a tell: lost with its child, as a job's would be */
		else
			j = ap_mbox_pop(&w->mb);
		if (j) {
			s->front_seq++;
			if (j->revoked)
				j = NULL; /* its copy is another worker's */
			else
				ap_mbox_done(&w->mb);
		}
		if (j) {
			if (j->is_ask) {
				set_death_reply(w, timeout);
				ap_answer(w, j, "error", &w->reply, AP_ANSWER_OWN);
			}
		}
	}
	if (timeout)
		ap_log(AP_LOG_WARNING, "pool %s: worker %d's handler ran over %d ms; its process was killed",
		       w->pool->name, w->id, w->pool->o.handler_timeout_ms);
	else if (s->how == CLD_EXITED)
		ap_log(AP_LOG_WARNING, "pool %s: worker %d's process exited with status %d", w->pool->name, w->id,
		       s->code);
	else
		ap_log(AP_LOG_WARNING, "pool %s: worker %d's process was killed by signal %d (%s)", w->pool->name,
		       w->id, s->code, strsignal(s->code));
}

/* Stop: what the child has is finished, what it has not is answered
 * {error, stopped}, then the child runs terminate and exits. */
static void on_stop(ap_worker *w)
{
	ap_iso *s = w->iso;
	int progress;
	/* A process, unlike a thread, can be made to let go: what it still
	 * runs after the grace is killed and answered stopped. A short grace:
	 * a stop is what a user does to a pool that misbehaves, and a worker
	 * that burns a CPU for seconds after it was meant to go is the bug. */
	int64_t grace = ap_mono_ms() + ISO_STOP_GRACE_MS;
	atomic_store(&s->ctl->stopping, 1);
	iso_ring_held(s); /* it hands back what it has not started */
	while (s->front_seq < s->next_seq) {
		progress = 0;
		if (drain_results(w, &progress))
			break;
		if (progress)
			continue;
		if (atomic_load(&s->dead)) {
			on_death(w); /* what it ran when it died is answered as such */
			break;
		}
		int64_t left = grace - ap_mono_ms();
		if (left <= 0) {
			ap_log(AP_LOG_WARNING, "pool %s: worker %d's process still busy %d ms after stop; killing it",
			       w->pool->name, w->id, ISO_STOP_GRACE_MS);
			wait_reaped(w, 1);
			break;
		}
		proxy_sleep(w, (left < 100 ? left : 100) * 1000, ready_run);
	}
	ap_job *j;
	while ((j = ap_mbox_pop(&w->mb))) {
		if (j->revoked)
			continue;
		if (j->is_ask)
			ap_answer_error(w, j, "stopped");
		ap_mbox_done(&w->mb);
	}
	void *rec;
	struct iso_rec h = { .kind = REC_STOP };
	if (!atomic_load(&s->dead) && ap_ring_reserve(&s->req, sizeof h, &rec) == 0) {
		memcpy(rec, &h, sizeof h);
		ap_ring_commit(&s->req);
	}
	/* Its terminate, then it is killed (by our caller): gone within
	 * ISO_STOP_GRACE_MS + ISO_TERMINATE_MS of the stop. */
	int64_t end = ap_mono_ms() + ISO_TERMINATE_MS;
	while (!atomic_load(&s->dead) && ap_mono_ms() < end)
		proxy_sleep(w, 100000, ready_dead);
}

/* What the child said of its failed start, bounded (a plugin's code may
 * have run: believe it as words only). */
static void take_fail(ap_worker *w, const struct iso_ctl *c)
{
	struct ap_init_fail *f = &w->init_fail;
	f->kind = (int)c->fail_kind;
	f->num = c->fail_num;
	memcpy(f->layer, c->fail_layer, sizeof f->layer);
	f->layer[sizeof f->layer - 1] = 0;
	memcpy(f->why, c->fail_why, sizeof f->why);
	f->why[sizeof f->why - 1] = 0;
	if (f->kind == ISO_FAIL_SANDBOX)
		ap_log(AP_LOG_ERROR, "pool %s: worker %d's process cannot apply its sandbox (%s): %s", w->pool->name,
		       w->id, f->layer, f->why);
	else if (f->kind == ISO_FAIL_LOAD || f->kind == ISO_FAIL_ABI)
		ap_log(AP_LOG_ERROR, "pool %s: worker %d's process cannot load %s: %s", w->pool->name, w->id,
		       w->pool->spec, f->why);
}

void *ap_iso_proxy_main(void *arg)
{
	ap_worker *w = arg;
	ap_pool *p = w->pool;
	ap_iso *s = w->iso;
	struct iso_ctl *c = s->ctl;
	char tname[16];
	snprintf(tname, sizeof tname, "%.7s/%d.%d", p->name, w->id, w->gen);
	pthread_setname_np(pthread_self(), tname);
	w->reply.reserve = ap_pool_reply_reserve;
	w->exit_reason = EXIT_INIT_FAILED;
	pthread_mutex_lock(&s->send_mu); /* ours while awake (proxy_sleep_d) */

	int r = iso_spawn(w);
	if (r) {
		ap_log(AP_LOG_ERROR, "pool %s: cannot start worker %d's process: %s", p->name, w->id, strerror(-r));
		w->init_rc = r;
		goto done;
	}
	while (!ready_init(w))
		proxy_sleep(w, ISO_IDLE_MS * 1000, ready_init);
	if (atomic_load(&c->init_state) != 1) {
		w->init_rc = atomic_load(&c->init_state) == 2 ? c->init_rc : -ECHILD;
		if (atomic_load(&c->init_state) == 2)
			take_fail(w, c);
		if (atomic_load(&s->dead) && atomic_load(&c->init_state) == 0)
			ap_log(AP_LOG_WARNING, "pool %s: worker %d's process died in its init", p->name, w->id);
		wait_reaped(w, 1);
		goto done;
	}
	ap_node_call_on_loop_sure(p->n, ap_pool_worker_ready, w);

	w->exit_reason = EXIT_STOP;
	for (;;) {
		int progress = 0;
		int d = drain_results(w, &progress);
		if (d < 0) {
			iso_kill(s);
			wait_reaped(w, 0);
			on_death(w);
			w->exit_reason = EXIT_CRASH;
			break;
		}
		if (d > 0) {
			/* It exits after its terminate; a second crash cause
			 * is not counted. */
			wait_reaped(w, 0);
			if (!atomic_load(&s->dead))
				wait_reaped(w, 1);
			w->exit_reason = EXIT_CRASH;
			break;
		}
		if (atomic_load(&s->dead)) {
			on_death(w);
			w->exit_reason = EXIT_CRASH;
			break;
		}
		if (atomic_load(&w->stop)) {
			on_stop(w);
			if (!atomic_load(&s->dead))
				wait_reaped(w, 1);
			break;
		}
		int sent = iso_send_jobs(w);
		if (sent < 0) {
			ap_log(AP_LOG_ERROR, "pool %s: worker %d's process broke its request ring; killing it", p->name,
			       w->id);
			iso_kill(s);
			wait_reaped(w, 0);
			on_death(w);
			w->exit_reason = EXIT_CRASH;
			break;
		}
		if (progress || sent)
			continue;
		/* A handler's deadline is the loop's (watchdog.c),
		 * so we may sleep, and the loop may send asks meanwhile
		 * (send_direct). */
		int64_t wait_us = (int64_t)ISO_IDLE_MS * 1000, held = held_left(s);
		if (held && iso_next_need(s)) {
			/* The ring is full: the child must drain it now. */
			iso_ring_held(s);
			held = 0;
		}
		if (held) {
			/* Nothing to send but tells held back: until their
			 * time, unless an ask or a batch comes first. */
			proxy_sleep_d(w, held < wait_us ? held : wait_us, ready_held, 1);
			continue;
		}
		proxy_sleep_d(w, wait_us, ready_run, 1);
	}
done:
	if (atomic_load(&s->pidfd) >= 0 && !atomic_load(&s->dead))
		wait_reaped(w, 1);
	/* Reaped now: the loop looks at a pidfd only while `dead` is 0. */
	int fd = atomic_exchange(&s->pidfd, -1);
	if (fd >= 0)
		close(fd);
	if (w->reply.cap > (1u << 20)) {
		/* One large answer is no reason to keep its buffer. */
		free(w->reply.data);
		w->reply.data = NULL;
		w->reply.cap = w->reply.len = 0;
	}
	atomic_store(&w->os_pid, 0);
	pthread_mutex_unlock(&s->send_mu);
	ap_node_call_on_loop_sure(p->n, ap_pool_worker_exited, w);
	return NULL;
}
