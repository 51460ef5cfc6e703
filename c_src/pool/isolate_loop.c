/* isolate_loop: what the loop thread does to worker processes' slots
 * (isolate.c says how the files divide the work): its own turns at the
 * channel of a sleeping proxy (sending, taking done tells and results,
 * bare tells), stalls and timeouts, the SIGCHLD watch over every slot, and
 * the kind's table (ap_worker_processes) through which the pool reaches
 * them.
 */
#include "isolate.h"
#include "isolate_int.h"
#include "isolate_node.h"

#include <errno.h>
#include <sched.h>
#include <signal.h>
#include <string.h>
#include <sys/signalfd.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "ap_log.h"
#include "ap_ring.h"
#include "pool_int.h"

/* ---- the loop's turn at a sleeping proxy's channel ---------------------------- */

/* While the proxy sleeps, the loop takes the ok tells the child has
 * finished off the mailbox as it sends the next ones, so that the proxy
 * does not wake for them: a wake-up per batch cost more than the pops.
 * Only with no result record waiting, none half taken in: records are the
 * proxy's to read, and done_seq (read first, published after the records
 * of everything before it) covers a message with a record only if the
 * child lies. -1 on such a lie: the proxy finds it again and kills. */
static int take_done_direct(ap_worker *w)
{
	ap_iso *s = w->iso;
	uint64_t done = atomic_load_explicit(&s->ctl->done_seq, memory_order_acquire);
	int progress = 0;
	if (done < s->front_seq || s->got || ap_ring_readable(&s->rsp) != 0)
		return 0;
	return iso_take_done(w, done, &progress);
}

/* The loop's hold on a sleeping proxy's channel: 1 with its send lock
 * taken (the caller unlocks), 0 if the proxy is awake, not in its main
 * loop's sleep, or its slot is dying or stopping. */
static int hold_channel(ap_worker *w)
{
	ap_iso *s = w->iso;
	if (s->loop_held)
		return 1; /* since this read's first bare tell */
	if (!atomic_load(&s->direct_ok) || pthread_mutex_trylock(&s->send_mu))
		return 0;
	/* Again under the lock: the proxy lowers it only holding it. */
	if (atomic_load(&s->direct_ok) && !atomic_load(&s->dead) && !atomic_load(&w->stop))
		return 1;
	pthread_mutex_unlock(&s->send_mu);
	return 0;
}

/* Lets go of hold_channel's lock, unless a read's bare tells keep it
 * until the wake pass (send_direct). */
static void release_channel(ap_iso *s)
{
	if (!s->loop_held)
		pthread_mutex_unlock(&s->send_mu);
}

/* The loop's turn at a sleeping proxy's channel, if the proxy lets it
 * (direct_ok, raised only while it sleeps in its main loop) and its send
 * lock is free: it takes the ok tells the child has finished, then, with
 * `send`, sends what it pushed, once per wake pass, and rings the child at
 * once (the proxy, asleep, would not ring held-back tells in time, and a
 * pass brings them in batches anyway). 1 if all of it went, so the proxy
 * need not wake for it (the child rings it for the results). */
static int send_direct(ap_worker *w, int send)
{
	ap_iso *s = w->iso;
	if (!hold_channel(w))
		return 0;
	int r = take_done_direct(w);
	if (r == 0 && send)
		r = iso_send_jobs(w);
	if (r >= 0 && s->bare_unpub) /* this read's bare tells, if iso_send_jobs did not publish them */
		r = iso_send_commit(s, 0, s->bare_unpub) < 0 ? -1 : 1;
	if (r > 0)
		iso_ring_held(s);
	int done = r > 0 && iso_next_need(s) == 0;
	s->loop_held = 0;
	pthread_mutex_unlock(&s->send_mu);
	if (r < 0)
		ap_iso_bell(s->ctl, 1); /* the child broke its channel: the proxy kills it now */
	return done;
}

/* One result record the loop answers itself, or 0 to leave it (unread)
 * to the proxy: anything but a whole result to an ask of a batched route
 * (the rings') or a refused tell (a crash, a stop, a large answer in
 * chunks, an answer by another route, a route with no room), and anything
 * the proxy's own checks (drain_results) would refuse: it finds it again
 * and kills. */
static int take_one_direct(ap_worker *w, const void *p, size_t len)
{
	ap_iso *s = w->iso;
	struct iso_rec h;
	if (len < sizeof h)
		return 0;
	memcpy(&h, p, sizeof h);
	size_t chunk = len - sizeof h;
	if (iso_result_bad(s, &h, chunk) || chunk != h.total || h.a == AP_HANDLER_CRASH || h.c)
		return 0;
	int progress = 0;
	/* The ok tells before it are done. */
	if (h.seq > s->front_seq && iso_take_done(w, h.seq - 1, &progress))
		return 0;
	/* Handed back after a stall: the proxy's. */
	if (iso_front_revoked(s, w))
		return 0;
	if (iso_front_bare(s)) {
		/* A bare tell refused: nothing to answer. */
		iso_take_bare(w);
		ap_worker_count_done(w, (actor_pool_status)h.a);
		return 1;
	}
	ap_job *j = atomic_load_explicit(&w->mb.head->next, memory_order_acquire);
	if (!j || (j->is_ask && !j->route.ops->batched))
		return 0;
	if (j->is_ask) {
		w->reply.len = 0;
		if (chunk && ap_pool_reply_reserve(&w->reply, chunk))
			return 0;
		memcpy(w->reply.data, (const uint8_t *)p + sizeof h, chunk);
		w->reply.len = chunk;
		w->reply.kind = (actor_pool_reply_kind)h.b;
		/* Published with the loop's own answers at the end of its read. */
		if (ap_answer(w, j, h.a == AP_HANDLER_OK ? "ok" : "error", &w->reply, AP_ANSWER_NOWAIT) == -EAGAIN)
			return 0;
	}
	(void)ap_mbox_pop(&w->mb);
	ap_mbox_done(&w->mb);
	s->front_seq++;
	ap_worker_count_done(w, (actor_pool_status)h.a);
	return 1;
}

/* Results the loop answered (node_stats `iso_loop_results'); relaxed,
 * any thread may read. */
static unsigned long long loop_results;

unsigned long long ap_iso_loop_results(void) { return __atomic_load_n(&loop_results, __ATOMIC_RELAXED); }

int ap_iso_take_direct(ap_worker *w, int looks, int cpu)
{
	ap_iso *s = w->iso;
	if (looks && atomic_load_explicit(&s->ctl->loop_cpu, memory_order_relaxed) != cpu)
		atomic_store_explicit(&s->ctl->loop_cpu, cpu, memory_order_relaxed);
	/* Read back rather than remembered: a new child's channel starts
	 * at 0 (iso_spawn), and a child that writes the word only makes
	 * itself wait (for our next pass, or its proxy's idle look). */
	if (atomic_load_explicit(&s->ctl->loop_looks, memory_order_relaxed) != (uint32_t)looks) {
		atomic_store(&s->ctl->loop_looks, (uint32_t)looks);
		/* Lowered: the child rings from now on, or we see below what
		 * it published before it read the flag. */
		atomic_thread_fence(memory_order_seq_cst);
	}
	/* Nothing queued, nothing to take: an idle slot costs the loop's
	 * passes two loads. Awake, the proxy takes its results itself before
	 * it sleeps. */
	if (!ap_mbox_depth(&w->mb))
		return 0;
	if (!hold_channel(w))
		return AP_ISO_PROXY;
	int took = 0, leave = 0;
	/* A result half taken in by the proxy is its own to finish. */
	if (!s->got) {
		const void *p;
		size_t len;
		unsigned n = 0;
		for (;;) {
			uint64_t mark = ap_ring_mark(&s->rsp);
			int r = ap_ring_read(&s->rsp, &p, &len);
			if (r == -EAGAIN)
				break;
			if (r || !take_one_direct(w, p, len)) {
				ap_ring_unread(&s->rsp, mark);
				leave = 1;
				break;
			}
			took++;
			ap_iso_release_every(&s->rsp, &n, 64);
		}
		ap_ring_release(&s->rsp);
		if (!leave && take_done_direct(w) < 0)
			leave = 1;
	}
	/* An ask sent and not answered: the child is on it (or on what
	 * was sent before it). */
	int out = !leave && s->ask_seq >= s->front_seq;
	release_channel(s);
	if (leave)
		ap_iso_bell(s->ctl, 0);
	if (took)
		__atomic_store_n(&loop_results, loop_results + (unsigned)took, __ATOMIC_RELAXED);
	return (took > 0 ? AP_ISO_TOOK : 0) | (out ? AP_ISO_ASKS_OUT : 0) | (leave ? AP_ISO_PROXY : 0);
}

unsigned ap_iso_follows(ap_worker *w)
{
	ap_iso *s = w->iso;
	return atomic_load(&s->pidfd) >= 0 ? atomic_load_explicit(&s->ctl->follows, memory_order_relaxed) : 0;
}

void ap_iso_reclaim(ap_worker *w)
{
	(void)send_direct(w, 0);
}

/* A push rings only a proxy that has nothing left to send: one waiting
 * for room in a full request ring would wake, find no room and sleep
 * again, a wake-up per push under a backlog (the child rings it when it
 * has made room); one holding back tells (iso_send_commit) wakes for an ask
 * only. The Dekker pair is proxy_sleep's want_jobs, then its look at the
 * mailbox. */
void ap_iso_wake(ap_worker *w, int always, int ask)
{
	/* Held by this read's bare tells, the channel is ours until
	 * send_direct publishes them and lets it go, whoever is rung. */
	if (!always || w->iso->loop_held) {
		if (send_direct(w, 1) && !always)
			return;
	}
	atomic_thread_fence(memory_order_seq_cst);
	int want = atomic_load(&w->iso->want_jobs);
	if (always || want == WANT_ANY || (want == WANT_ASK && ask))
		ap_iso_bell(w->iso->ctl, always);
}

/* ---- stalls and timeouts (loop thread) -------------------------------------- */

static ap_job *bare_job(ap_worker *w, const struct iso_bare *b);

int ap_iso_timeout(ap_worker *w, uint64_t deq)
{
	ap_iso *s = w->iso;
	/* The loop reaps, and the proxy closes the pidfd only once reaped:
	 * while `dead` is 0 the pidfd is this child's. */
	int fd = atomic_load(&s->pidfd);
	if (fd < 0 || atomic_load(&s->dead))
		return 0;
	atomic_store(&s->timeout_deq, deq + 1);
	return syscall(SYS_pidfd_send_signal, fd, SIGKILL, NULL, 0) == 0;
}

/* A message the child was sent moves: a copy goes to another worker, the
 * original stays in place, revoked, for the child to hand back. */
static long long revoke_job(ap_worker *w, ap_job *j)
{
	(void)ap_pool_move_job(w->pool, w, j); /* the route's hold moves too */
	j->route = (ap_route){ 0 };
	j->revoked = 1;
	return 1;
}

static long long revoke_bare(ap_worker *w, struct iso_bare *b)
{
	ap_job *j = bare_job(w, b);
	b->revoked = 1;
	if (!j)
		return 1; /* its record was changed: lost, as ap_iso_rehydrate would lose it */
	(void)ap_pool_move_job(w->pool, w, j);
	j->free_next = w->job_cache;
	w->job_cache = j;
	return 1;
}

/* The child has been on the front message past stall_ms. What it has not
 * started of what it was sent is revoked, with a handshake: the loop
 * raises revoke_upto (with no verdict yet), runs a barrier on every
 * worker process (membarrier), and reads how far the child got; the child
 * stores running_seq before it reads revoke_upto, without a fence of its
 * own, so either its start of a message was before the barrier (and is
 * seen here) or it sees revoke_upto, waits for the verdict and hands the
 * message back unrun if it lies past what was seen. The jobs queued and
 * not sent are the loop's to take: the proxy sleeps (the loop holds the
 * channel), and only the proxy moves the cursor. */
long long ap_iso_revoke(ap_worker *w)
{
	ap_iso *s = w->iso;
	struct iso_ctl *c = s->ctl;
	ap_mbox *m = &w->mb;
	if (!hold_channel(w))
		return -1;
	long long moved = 0;
	uint64_t out = 0; /* jobs taken out of the depth */
	/* The last message sent, whole or in part, and its job. */
	uint64_t last = s->next_seq - 1 + (s->sent_off ? 1 : 0);
	uint64_t started = last;
	if (last > s->front_seq) {
		atomic_store_explicit(&c->revoke_from, 0, memory_order_relaxed);
		atomic_store_explicit(&c->revoke_upto, last, memory_order_release);
		if (ap_pool_barrier_children() == 0) {
			atomic_thread_fence(memory_order_seq_cst);
			uint64_t r = atomic_load_explicit(&c->running_seq, memory_order_acquire);
			uint64_t d = atomic_load_explicit(&c->done_seq, memory_order_acquire);
			started = r > d ? r : d;
			/* The front stays: it is the message the child is on
			 * (whatever it says). Past the last sent: a lie. */
			if (started < s->front_seq)
				started = s->front_seq;
			if (started > last)
				started = last;
			/* What an earlier stall revoked stays revoked, whatever
			 * the child says of it now: it waits for this verdict
			 * on it, or has handed it back. */
			if (s->rev_upto && started >= s->rev_from && started <= s->rev_upto)
				started = s->rev_from - 1;
			s->rev_from = started + 1;
			s->rev_upto = last;
		} else {
			/* No barrier (the kernel failed us now): nothing more is
			 * revoked, and an earlier verdict stands. The child reads
			 * the bound again after the verdict. */
			started = last;
			atomic_store_explicit(&c->revoke_upto, s->rev_upto, memory_order_relaxed);
		}
		atomic_store_explicit(&c->revoke_from, s->rev_upto ? s->rev_from : last + 1, memory_order_release);
	}
	/* Walk what was sent, in seq order: bare tells and jobs. */
	ap_job *prev = m->head, *partial = NULL;
	uint64_t bi = s->bare_head;
	for (uint64_t seq = s->front_seq; seq <= last; seq++) {
		if (bi != s->bare_tail && s->bare[bi % ISO_BARE_MAX].seq == seq) {
			if (seq > started && !s->bare[bi % ISO_BARE_MAX].revoked) {
				moved += revoke_bare(w, &s->bare[bi % ISO_BARE_MAX]);
				out++;
			}
			bi++;
			continue;
		}
		ap_job *j = atomic_load_explicit(&prev->next, memory_order_acquire);
		if (!j)
			break; /* cannot be: every seq sent has its job or its record */
		if (seq == s->next_seq)
			partial = j;
		if (seq > started && !j->revoked) {
			moved += revoke_job(w, j);
			out++;
		}
		prev = j;
	}
	/* A job sent in part and revoked counts as sent: its other records
	 * are not sent, and the child drops any it has. */
	ap_job *keep = s->cursor;
	if (partial && partial->revoked) {
		s->cursor = partial;
		s->sent_off = 0;
		s->next_seq++;
		keep = partial;
	} else if (partial) {
		keep = partial; /* the child takes it in: the rest of it is still to send */
	}
	if (s->ask_seq > started)
		s->ask_seq = started; /* an ask may be out at most up to there */
	/* What was never sent: off the mailbox, as a thread's queue. */
	ap_job *j = atomic_load_explicit(&keep->next, memory_order_acquire);
	atomic_store_explicit(&keep->next, NULL, memory_order_relaxed);
	m->tail = keep;
	while (j) {
		ap_job *next = atomic_load_explicit(&j->next, memory_order_relaxed);
		(void)ap_pool_move_job(w->pool, w, j);
		free(j);
		moved++;
		out++;
		j = next;
	}
	atomic_store_explicit(&m->enq, atomic_load_explicit(&m->enq, memory_order_relaxed) - out,
			      memory_order_relaxed);
	release_channel(s);
	return moved;
}

/* ---- bare tells (loop thread) ---------------------------------------------- */

/* Bare tells sent (node_stats `iso_bare_tells'), and those made jobs again
 * after their child's death; relaxed, any thread may read. */
static unsigned long long bare_sent, bare_rehydrated;

unsigned long long ap_iso_bare_tells(void) { return __atomic_load_n(&bare_sent, __ATOMIC_RELAXED); }

unsigned long long ap_iso_bare_rehydrated(void) { return __atomic_load_n(&bare_rehydrated, __ATOMIC_RELAXED); }

/* A tell of a batched route (the same-host rings) written straight into
 * the worker process's request ring, with no job: the job's making,
 * queueing, sending and taking back were a fifth of the loop's time under
 * a tell flood. Only while everything queued before it has gone to the
 * child (so the order holds), the proxy sleeps (the loop holds its
 * channel, as send_direct does), and it fits one record in the room there
 * is now; 0 otherwise, and the caller makes a job as before. The record is then the pool node's only copy of the
 * message: the child maps the ring's data read-only, and if it dies
 * first, ap_iso_rehydrate makes jobs of the tells it had not started.
 * Published at the read's wake pass (send_direct), which the caller's
 * ap_pool_push-like wake list brings. */
int ap_iso_send_tell(ap_worker *w, const char *msg, int msg_len, int is_binary)
{
	ap_iso *s = w->iso;
	size_t body = ap_msg_body_len(msg_len, is_binary);
	if (body > ap_ring_max_payload(ISO_REQ_CAP) - sizeof(struct iso_rec) || !hold_channel(w))
		return 0;
	void *rec;
	if (s->bare_tail - s->bare_head >= ISO_BARE_MAX || s->sent_off ||
	    atomic_load_explicit(&s->cursor->next, memory_order_acquire) ||
	    ap_ring_reserve(&s->req, sizeof(struct iso_rec) + body, &rec)) {
		/* Kept if an earlier one of this read holds it: w is on the
		 * wake list already. */
		release_channel(s);
		return 0;
	}
	s->loop_held = 1;
	struct iso_rec h = { .seq = s->next_seq, .total = (uint32_t)body, .kind = REC_MSG, .b = (uint8_t)is_binary };
	memcpy(rec, &h, sizeof h);
	ap_msg_body_copy((uint8_t *)rec + sizeof h, msg, msg_len, is_binary);
	s->bare[s->bare_tail % ISO_BARE_MAX] = (struct iso_bare){
		.seq = s->next_seq, .rec_off = (uint32_t)((uint8_t *)rec - s->req.data), .len = (uint32_t)body
	};
	s->bare_tail++;
	s->next_seq++;
	s->bare_unpub++;
	/* In the depth (routing, mailbox_limit) as a job would be. */
	atomic_store_explicit(&w->mb.enq, atomic_load_explicit(&w->mb.enq, memory_order_relaxed) + 1,
			      memory_order_relaxed);
	__atomic_store_n(&bare_sent, bare_sent + 1, __ATOMIC_RELAXED);
	return 1;
}

/* A job of a bare tell's record, or NULL: the record is not the one sent
 * (a child that broke its read-only mapping could have changed it) or no
 * memory. */
static ap_job *bare_job(ap_worker *w, const struct iso_bare *b)
{
	ap_iso *s = w->iso;
	struct iso_rec h;
	if ((uint64_t)b->rec_off + sizeof h + b->len > s->req.cap)
		return NULL;
	const uint8_t *rec = s->req.data + b->rec_off;
	memcpy(&h, rec, sizeof h);
	if (h.seq != b->seq || h.kind != REC_MSG || h.total != b->len || h.off || h.a || h.b > 1)
		return NULL;
	ap_job *j = ap_job_alloc(&w->mb, &w->job_cache, b->len);
	if (!j)
		return NULL;
	j->is_ask = 0;
	j->is_binary = h.b;
	j->route = (ap_route){ 0 };
	j->head_len = j->addr_len = 0;
	j->msg_len = b->len;
	memcpy(j->data, rec + sizeof h, b->len);
	return j;
}

/* After the proxy has gone (the loop is the mailbox's consumer too): the
 * bare tells its child had not finished become jobs, in their places among
 * the jobs sent, so that they move to live workers, or go to the next
 * child, as any job left in the mailbox. */
void ap_iso_rehydrate(ap_worker *w)
{
	ap_iso *s = w->iso;
	if (!s || s->bare_head == s->bare_tail)
		return;
	ap_mbox *m = &w->mb;
	ap_job *prev = m->head;
	uint64_t made = 0, lost = 0;
	for (uint64_t seq = s->front_seq; seq < s->next_seq && s->bare_head != s->bare_tail; seq++) {
		const struct iso_bare *b = &s->bare[s->bare_head % ISO_BARE_MAX];
		if (b->seq != seq) {
			/* A job's seq: it is the next in the mailbox. */
			ap_job *next = atomic_load_explicit(&prev->next, memory_order_relaxed);
			if (!next)
				break;
			prev = next;
			continue;
		}
		s->bare_head++;
		if (b->revoked)
			continue; /* moved already (ap_iso_revoke), out of the depth */
		ap_job *j = bare_job(w, b);
		if (!j) {
			ap_mbox_done(m); /* out of the depth: it is gone */
			lost++;
			continue;
		}
		atomic_store_explicit(&j->next, atomic_load_explicit(&prev->next, memory_order_relaxed),
				      memory_order_relaxed);
		atomic_store_explicit(&prev->next, j, memory_order_relaxed);
		if (m->tail == prev)
			m->tail = j;
		prev = j;
		made++;
	}
	/* Any left are past what was sent: cannot be. */
	for (; s->bare_head != s->bare_tail; s->bare_head++) {
		ap_mbox_done(m);
		lost++;
	}
	__atomic_store_n(&bare_rehydrated, bare_rehydrated + made, __ATOMIC_RELAXED);
	if (lost)
		ap_log(AP_LOG_ERROR, "pool %s: %llu tells worker %d's process had not run were lost: their records "
		       "in its request ring were changed", w->pool->name, (unsigned long long)lost, w->id);
}

/* ---- every worker process (loop thread) ------------------------------------ */

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
	for (ap_pool *p = ap_pool_all(); p; p = p->next)
		for (int i = 0; i < p->o.workers; i++)
			if (p->w[i].iso)
				ap_iso_reap(&p->w[i]);
}

int ap_iso_watch_children(ap_node *n)
{
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

int ap_iso_take_all(int looks)
{
	int flags = 0;
	/* Where the loop runs, for children that follow it (isolate.h,
	 * loop_cpu), read once per pass and only with such a pool: glibc
	 * reads it from rseq, no syscall. */
	int cpu = -2;
	for (ap_pool *p = ap_pool_all(); p; p = p->next)
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

unsigned long long ap_iso_follows_all(void)
{
	unsigned long long n = 0;
	for (ap_pool *p = ap_pool_all(); p; p = p->next)
		for (int i = 0; i < p->o.workers; i++)
			if (p->w[i].iso)
				n += ap_iso_follows(&p->w[i]);
	return n;
}

/* ---- the kind ------------------------------------------------------------------- */

/* Past stall_ms: the proxy cannot be claimed as a thread is; what the
 * child was sent and has not started is revoked (ap_iso_revoke). */
static long long iso_stall(ap_worker *w)
{
	ap_wd_stalled(w);
	return ap_wd_move_queue(w->pool, w);
}

/* Past handler_timeout_ms: the child is killed, its message answered and
 * counted as it dies (on_death). */
static void iso_overtime(ap_worker *w, uint64_t deq)
{
	if (!ap_iso_timeout(w, deq))
		return;
	if (w->wd_state == W_RUNNING)
		w->stalls++;
	w->wd_state = W_KILLED;
	atomic_store(&w->alive, 0);
}

const ap_worker_ops ap_worker_processes = {
	.slot_init = ap_iso_slot_init,
	.slot_free = ap_iso_slot_free,
	.main = ap_iso_proxy_main,
	.exited = ap_iso_rehydrate,
	.wake = ap_iso_wake,
	.post_tell = ap_iso_send_tell,
	.reclaim = ap_iso_reclaim,
	.stall = iso_stall,
	.move_queue = ap_iso_revoke,
	.overtime = iso_overtime,
	.harvest = ap_iso_harvest,
	.sb_layers = ap_iso_sb_layers,
};
