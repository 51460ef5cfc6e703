/* isolate: workers in child processes. The design is in isolate.h; this
 * file holds the pool node's side: the channel (one sealed memfd per worker
 * slot), the proxy thread, spawning and reaping. The child's side is
 * isolate_child.c; what both sides share, isolate_int.h.
 *
 * Over 700 lines on purpose: the proxy's loop, its sending and taking of
 * results, a death and a stop all move the same cursor and sequence
 * numbers over the slot's mailbox; split, their invariants would be read
 * in three files.
 */
#include "isolate.h"
#include "isolate_int.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <sched.h>
#include <signal.h>
#include <spawn.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/signalfd.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "ap_log.h"
#include "ap_ring.h"
#include "handlers.h"
#include "pool_int.h"

extern char **environ;

typedef struct ap_iso {
	struct ap_ring_map map;
	struct iso_ctl *ctl;
	/* The layout, kept here: a child may scribble on the shared header,
	 * and the pool node must never take an offset from it. */
	struct iso_ctl layout;
	/* the loop writes these, the proxy reads them */
	_Atomic int pidfd;      /* -1 when no child */
	_Atomic int dead;       /* the child was reaped; status below is set */
	/* What a push is to the sleeping proxy: WANT_NONE (it has jobs it
	 * cannot send yet), WANT_ANY (it has none left), WANT_ASK (it holds
	 * back tells to wake its child for many at once: only an ask is news).
	 * Ours, not in the channel, so a child cannot silence the loop. */
	_Atomic int want_jobs;
	int how, code;          /* waitid's si_code and si_status: the cause */
	/* The send state below is the proxy's while it is awake: it holds
	 * send_mu then, and lets go only asleep in its main loop, with
	 * direct_ok up, when the loop may send an ask (and what is queued
	 * before it) to the child itself (ap_iso_wake): one wake-up of the
	 * proxy fewer per ask; the proxy still takes the results. */
	pthread_mutex_t send_mu;
	_Atomic int direct_ok;
	/* What the pool node took of its children's run-time histograms
	 * (ap_iso_harvest): the values it last read in the channel, under
	 * hist_mu (the loop reads for stats, the proxy before a new child
	 * clears the channel). */
	pthread_mutex_t hist_mu;
	uint64_t hist_seen[AP_HIST_BUCKETS + 1];
	/* proxy thread only (or the loop, under send_mu, see above) */
	struct ap_ring req, rsp;
	ap_job *cursor;     /* the last job sent whole; the mailbox's dummy when none */
	size_t sent_off;    /* bytes of cursor->next already sent */
	uint64_t next_seq;  /* of the next job to send */
	uint64_t front_seq; /* of the oldest job sent and not answered */
	uint64_t ask_seq;   /* of the last ask sent whole; 0 when none */
	/* Tells published and not rung (send_commit), since when. */
	unsigned unrung;
	int64_t unrung_since_us;
	size_t got;         /* bytes of the current result assembled in w->reply */
	/* The loop killed the child for handler_timeout_ms (ap_iso_timeout):
	 * 1 + the mailbox's done count then, which names the message it was
	 * on; 0 if not. */
	_Atomic uint64_t timeout_deq;
	/* What stalls revoked so far of this child's messages (ap_iso_revoke):
	 * rev_from..rev_upto, the verdict now published; rev_upto 0: none. */
	uint64_t rev_from, rev_upto;
	/* Bare tells: tells the loop wrote straight into the request ring
	 * (ap_iso_send_tell), with no job in the mailbox. Their seqs, in
	 * order, and where their records are, for ap_iso_rehydrate: the
	 * record is the pool node's only copy (the child maps the ring's data
	 * read-only). A FIFO of ISO_BARE_MAX; whoever holds send_mu reads
	 * it. bare_unpub: written and not yet published. */
	struct iso_bare {
		uint64_t seq;
		uint32_t rec_off, len; /* the record's offset in the ring's data, the message's bytes */
		int revoked;           /* moved to another worker (ap_iso_revoke), out of the depth */
	} *bare;
	uint64_t bare_head, bare_tail;
	unsigned bare_unpub;
	/* The loop keeps send_mu from its first bare tell of a read to that
	 * read's wake pass (send_direct): a lock and an unlock per tell cost
	 * a fifth of its time. Loop only. */
	int loop_held;
	int killed;         /* we sent SIGKILL */
	int handler_crash;  /* the child reported AP_HANDLER_CRASH and exits on its own */
	/* The slot's sandbox (sandbox.h): its cgroups, made at slot init and
	 * kept, and the layers each of its children must apply. */
	struct ap_sb_cgroup cg;
	uint32_t sb_layers;
} ap_iso;

enum { WANT_NONE, WANT_ANY, WANT_ASK };

static size_t round_up(size_t n, size_t a) { return (n + a - 1) / a * a; }

/* ---- the channel ----------------------------------------------------------- */

int ap_iso_slot_init(ap_worker *w)
{
	ap_pool *p = w->pool;
	size_t spec_len = strlen(p->spec) + 1;
	size_t req = ap_ring_size(ISO_REQ_CAP), rsp = ap_ring_size(ISO_RSP_CAP);
	size_t spec_off = ISO_CTL_SIZE, cfg_off = round_up(spec_off + spec_len, 64);
	size_t sb_off = round_up(cfg_off + p->config_len, 64);
	size_t sb_len = sizeof(struct iso_sandbox) + p->o.sandbox.paths_len;
	/* The request ring's data starts on a page: the child maps it
	 * read-only (ap_iso_child_main). */
	size_t req_off = round_up(sb_off + sb_len + AP_RING_HDR_SIZE, 4096) - AP_RING_HDR_SIZE;
	size_t rsp_off = round_up(req_off + req, 4096);
	size_t size = round_up(rsp_off + rsp, 4096);
	ap_iso *s = calloc(1, sizeof *s);
	if (!s)
		return -ENOMEM;
	s->bare = calloc(ISO_BARE_MAX, sizeof *s->bare);
	if (!s->bare) {
		free(s);
		return -ENOMEM;
	}
	int r = ap_ring_map_create_memfd(&s->map, "actor_pool_worker", size);
	if (r) {
		free(s->bare);
		free(s);
		return r;
	}
	/* Not where the child wants it: a dup2 onto the same number would
	 * keep its close-on-exec flag. */
	if (s->map.fd <= ISO_FD) {
		int fd = fcntl(s->map.fd, F_DUPFD_CLOEXEC, ISO_FD + 1);
		if (fd < 0) {
			r = -errno;
			ap_ring_map_close(&s->map);
			free(s->bare);
			free(s);
			return r;
		}
		close(s->map.fd);
		s->map.fd = fd;
	}
	s->ctl = s->map.mem;
	struct iso_ctl *l = &s->layout;
	l->magic = ISO_MAGIC;
	l->size = (uint32_t)size;
	l->req_off = (uint32_t)req_off;
	l->rsp_off = (uint32_t)rsp_off;
	l->req_size = (uint32_t)req;
	l->rsp_size = (uint32_t)rsp;
	l->spec_off = (uint32_t)spec_off;
	l->spec_len = (uint32_t)spec_len;
	l->cfg_off = (uint32_t)cfg_off;
	l->cfg_len = (uint32_t)p->config_len;
	l->max_memory_mb = p->o.max_memory_mb;
	l->worker = (uint32_t)w->id;
	l->workers = (uint32_t)p->o.workers;
	l->sb_off = (uint32_t)sb_off;
	l->sb_len = (uint32_t)sb_len;
#ifdef ISO_ASAN
	/* ASan's own limits stand in for the worker's (child_env): a memory
	 * cgroup would kill it before they fail an allocation. Its children
	 * (fork => true) have no such limits: for them it stays. */
	ap_sb_cgroup_make(&s->cg, &p->o.sandbox, p->o.sandbox.fork ? p->o.max_memory_mb : 0);
#else
	ap_sb_cgroup_make(&s->cg, &p->o.sandbox, p->o.max_memory_mb);
#endif
	s->sb_layers = ap_sb_layers(&p->o.sandbox, &s->cg);
	atomic_init(&s->pidfd, -1);
	pthread_mutex_init(&s->send_mu, NULL);
	pthread_mutex_init(&s->hist_mu, NULL);
	w->iso = s;
	return 0;
}

void ap_iso_slot_free(ap_worker *w)
{
	ap_iso *s = w->iso;
	if (!s)
		return;
	int fd = atomic_exchange(&s->pidfd, -1);
	if (fd >= 0)
		close(fd);
	ap_ring_map_close(&s->map);
	ap_sb_cgroup_free(&s->cg);
	pthread_mutex_destroy(&s->send_mu);
	pthread_mutex_destroy(&s->hist_mu);
	free(s->bare);
	free(s);
	w->iso = NULL;
}

/* Under hist_mu: what the child added to its histogram since the last
 * look goes into w->run_ns. A plugin runs in the child and may write
 * anything there: only growth is taken (a value that went down is taken
 * as the new base), and added without wrapping, so the pool's histogram
 * only grows, whatever a child writes; it can misstate its own times, as
 * its handler could by sleeping, and nothing else. Only this writes
 * w->run_ns of a process-mode slot. */
static void harvest_locked(ap_worker *w, ap_iso *s)
{
	for (unsigned i = 0; i <= AP_HIST_BUCKETS; i++) {
		_Atomic uint64_t *src = i < AP_HIST_BUCKETS ? &s->ctl->run_ns.n[i] : &s->ctl->run_ns.sum_ns;
		_Atomic uint64_t *dst = i < AP_HIST_BUCKETS ? &w->run_ns.n[i] : &w->run_ns.sum_ns;
		uint64_t v = atomic_load_explicit(src, memory_order_relaxed);
		if (v > s->hist_seen[i]) {
			uint64_t cur = atomic_load_explicit(dst, memory_order_relaxed), d = v - s->hist_seen[i];
			atomic_store_explicit(dst, cur + d < cur ? UINT64_MAX : cur + d, memory_order_relaxed);
		}
		s->hist_seen[i] = v;
	}
}

void ap_iso_harvest(ap_worker *w)
{
	ap_iso *s = w->iso;
	if (!s)
		return;
	pthread_mutex_lock(&s->hist_mu);
	harvest_locked(w, s);
	pthread_mutex_unlock(&s->hist_mu);
}

/* The first slot's layers (every slot of a pool has the same, unless a
 * cgroup could be made for one and not another): stats/1. */
uint32_t ap_iso_sb_layers(ap_worker *w) { return w->iso ? w->iso->sb_layers : 0; }

/* ---- doorbells ------------------------------------------------------------- */

static int send_jobs(ap_worker *w);
static int send_commit(ap_iso *s, int ask, unsigned n);
static size_t next_need(ap_iso *s);
static void ring_held(ap_iso *s);
static int take_done(ap_worker *w, uint64_t upto, int *progress);

/* A result record the proxy must not believe (the child broke its
 * channel): not a result, not for a message sent and unanswered, not the
 * next chunk of the one being taken in, or a status, kind or flag out of
 * range. */
static int result_bad(const ap_iso *s, const struct iso_rec *h, size_t chunk)
{
	return h->kind != REC_RESULT || h->seq < s->front_seq || h->seq >= s->next_seq || h->total > ISO_MAX_MSG ||
	       h->off != s->got || chunk > h->total - h->off || h->a > AP_HANDLER_CRASH || h->b > AP_REPLY_ATOM ||
	       h->c > 1 || (h->c && h->total);
}

/* The oldest message out is a bare tell (no job in the mailbox). */
static int front_bare(const ap_iso *s)
{
	return s->bare_head != s->bare_tail && s->bare[s->bare_head % ISO_BARE_MAX].seq == s->front_seq;
}

/* The bare tell at the front is done with (run, refused, or lost with
 * its child). */
static void take_bare(ap_worker *w)
{
	ap_iso *s = w->iso;
	if (!s->bare[s->bare_head % ISO_BARE_MAX].revoked)
		ap_mbox_done(&w->mb);
	s->bare_head++;
	s->front_seq++;
}

/* The oldest message out was revoked (its copy is another worker's). */
static int front_revoked(const ap_iso *s, ap_worker *w)
{
	if (front_bare(s))
		return s->bare[s->bare_head % ISO_BARE_MAX].revoked;
	ap_job *j = atomic_load_explicit(&w->mb.head->next, memory_order_acquire);
	return j && j->revoked;
}

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
	return take_done(w, done, &progress);
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
		r = send_jobs(w);
	if (r >= 0 && s->bare_unpub) /* this read's bare tells, if send_jobs did not publish them */
		r = send_commit(s, 0, s->bare_unpub) < 0 ? -1 : 1;
	if (r > 0)
		ring_held(s);
	int done = r > 0 && next_need(s) == 0;
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
	if (result_bad(s, &h, chunk) || chunk != h.total || h.a == AP_HANDLER_CRASH || h.c)
		return 0;
	int progress = 0;
	/* The ok tells before it are done. */
	if (h.seq > s->front_seq && take_done(w, h.seq - 1, &progress))
		return 0;
	/* Handed back after a stall: the proxy's. */
	if (front_revoked(s, w))
		return 0;
	if (front_bare(s)) {
		/* A bare tell refused: nothing to answer. */
		take_bare(w);
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
 * has made room); one holding back tells (send_commit) wakes for an ask
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

/* The oldest job is the child's: sent whole, or a part of it (a child
 * can die taking a large one in). */
static int front_out(const ap_iso *s) { return s->front_seq < s->next_seq || s->sent_off > 0; }

/* The proxy is the mailbox's only consumer: its oldest job stays put. */
static int front_is_ask(ap_worker *w)
{
	if (front_bare(w->iso))
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
					 : ready == ready_run && next_need(w->iso) == 0 ? WANT_ANY
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

/* ---- reaping (loop thread) ------------------------------------------------- */

void ap_iso_reap(ap_worker *w)
{
	ap_iso *s = w->iso;
	int fd = atomic_load(&s->pidfd);
	if (fd < 0 || atomic_load(&s->dead))
		return;
	siginfo_t si;
	memset(&si, 0, sizeof si);
	if (waitid(P_PIDFD, (id_t)fd, &si, WEXITED | WNOHANG) != 0 || si.si_pid == 0)
		return;
	s->how = si.si_code;
	s->code = si.si_status;
	/* Whatever it left in its cgroup goes with it (a pid namespace has
	 * taken its descendants already, where there is one). */
	ap_sb_cgroup_kill(&s->cg);
	atomic_store(&s->dead, 1);
	ap_iso_bell(s->ctl, 1);
}

static void reap_cb(ap_node *n, void *arg)
{
	(void)n;
	ap_iso_reap(arg);
}

static void iso_kill(ap_iso *s)
{
	int fd = atomic_load(&s->pidfd);
	if (fd >= 0 && !atomic_load(&s->dead))
		syscall(SYS_pidfd_send_signal, fd, SIGKILL, NULL, 0);
	s->killed = 1;
}

/* ---- starting a child (proxy thread) --------------------------------------- */


/* The environment of a worker process: none of the pool node's (its
 * variables may name files, hold tokens), unless sandbox => off. Under
 * ASan, a crash must stay the crash (not ASan's report and exit 1), and
 * ASan's shadow memory rules out RLIMIT_DATA, so its own limits stand in
 * for max_memory_mb: the soft RSS one, past which malloc returns NULL as it
 * does under RLIMIT_DATA (the hard one exits 1 instead, a different crash
 * from the same handler), and the largest single allocation, which
 * RLIMIT_DATA refuses at once where the RSS limit is only checked now and
 * then. The sanitizers' options pass, and their log directories are
 * writable in the sandbox (sandbox_child.c). */
static char *no_env[] = { NULL };

static char **child_env(ap_worker *w, char *asan, size_t asan_len)
{
	int keep_all = w->pool->o.sandbox.off;
#ifdef ISO_ASAN
	size_t n = 0;
	while (environ[n])
		n++;
	char **env = calloc(n + 2, sizeof *env);
	if (!env)
		return NULL;
	size_t k = 0;
	const char *old = "";
	for (size_t i = 0; i < n; i++) {
		if (!strncmp(environ[i], "ASAN_OPTIONS=", 13))
			old = environ[i] + 13;
		else if (keep_all || !strncmp(environ[i], "UBSAN_OPTIONS=", 14))
			env[k++] = environ[i];
	}
	int mb = w->pool->o.max_memory_mb;
	snprintf(asan, asan_len, "ASAN_OPTIONS=%s%shandle_segv=0:handle_abort=0:handle_sigbus=0:handle_sigfpe=0:"
		 "handle_sigill=0:detect_leaks=0:allocator_may_return_null=1:soft_rss_limit_mb=%d:"
		 "max_allocation_size_mb=%d",
		 old, *old ? ":" : "", mb, mb);
	env[k++] = asan;
	env[k] = NULL;
	return env;
#else
	(void)asan;
	(void)asan_len;
	return keep_all ? environ : no_env;
#endif
}

static int iso_spawn(ap_worker *w)
{
	ap_iso *s = w->iso;
	ap_pool *p = w->pool;
	struct iso_ctl *c = s->ctl, *l = &s->layout;
	uint8_t *mem = s->map.mem;
	/* The previous child is reaped: nobody else is attached. Everything
	 * it could have scribbled on is written again, from our own copies;
	 * what it timed is taken first. */
	pthread_mutex_lock(&s->hist_mu);
	harvest_locked(w, s);
	memset(c, 0, ISO_CTL_SIZE);
	memset(s->hist_seen, 0, sizeof s->hist_seen);
	pthread_mutex_unlock(&s->hist_mu);
	memcpy(c, l, offsetof(struct iso_ctl, init_state));
	atomic_store(&c->loop_cpu, -1);
	memcpy(mem + l->spec_off, p->spec, l->spec_len);
	if (l->cfg_len)
		memcpy(mem + l->cfg_off, p->config, l->cfg_len);
	if (ap_ring_format(mem + l->req_off, l->req_size, ISO_REQ_CAP) ||
	    ap_ring_format(mem + l->rsp_off, l->rsp_size, ISO_RSP_CAP) ||
	    ap_ring_attach_producer(&s->req, mem + l->req_off, l->req_size) ||
	    ap_ring_attach_consumer(&s->rsp, mem + l->rsp_off, l->rsp_size))
		return -EPROTO;
	s->cursor = w->mb.head;
	s->sent_off = 0;
	s->next_seq = s->front_seq = 1;
	s->ask_seq = 0;
	s->unrung = 0;
	s->got = 0;
	atomic_store(&s->timeout_deq, 0);
	s->rev_from = s->rev_upto = 0;
	s->bare_head = s->bare_tail = 0; /* ap_iso_rehydrate made jobs of the last child's */
	s->bare_unpub = 0;
	s->killed = s->handler_crash = 0;
	s->how = s->code = 0;
	atomic_store(&s->dead, 0);
	/* A plugin, opened here for a sandboxed child (sandbox.h,
	 * AP_SB_FD_PLUGIN); if it cannot be, the child tries its path and
	 * says why that fails. */
	int plugin_fd = -1;
	if (!p->o.sandbox.off && !ap_builtin_handler(p->spec))
		plugin_fd = ap_sb_fd_above(open(p->spec, O_RDONLY | O_CLOEXEC));
	if (ap_sb_write(&p->o.sandbox, s->sb_layers, plugin_fd >= 0, (struct iso_sandbox *)(mem + l->sb_off),
			(char *)mem + l->sb_off + sizeof(struct iso_sandbox), l->sb_len - sizeof(struct iso_sandbox))) {
		if (plugin_fd >= 0)
			close(plugin_fd);
		return -EPROTO;
	}

	char ppid[24], asan[1024];
	snprintf(ppid, sizeof ppid, "%d", (int)getpid());
	char *argv[] = { "actor_pool_worker", "--isolated-worker", ppid, NULL };
	posix_spawn_file_actions_t fa;
	posix_spawnattr_t at;
	sigset_t none, def;
	sigemptyset(&none);
	sigemptyset(&def);
	sigaddset(&def, SIGCHLD);
	sigaddset(&def, SIGPIPE);
	sigaddset(&def, SIGTERM);
	sigaddset(&def, SIGINT);
	sigaddset(&def, SIGHUP);
	posix_spawn_file_actions_init(&fa);
	posix_spawn_file_actions_adddup2(&fa, s->map.fd, ISO_FD);
	/* Its cgroups' cgroup.procs: it joins them itself, first thing. */
	if (s->cg.v2_procs >= 0)
		posix_spawn_file_actions_adddup2(&fa, s->cg.v2_procs, AP_SB_FD_CG_V2);
	if (s->cg.v1_procs >= 0)
		posix_spawn_file_actions_adddup2(&fa, s->cg.v1_procs, AP_SB_FD_CG_V1);
	if (plugin_fd >= 0)
		posix_spawn_file_actions_adddup2(&fa, plugin_fd, AP_SB_FD_PLUGIN);
	posix_spawn_file_actions_addopen(&fa, 0, "/dev/null", O_RDONLY, 0);
	/* Our stdout may be the port to the BEAM ({packet, 4}): a plugin's
	 * printf there would corrupt it. Its output goes to our stderr. */
	posix_spawn_file_actions_adddup2(&fa, 2, 1);
	posix_spawnattr_init(&at);
	posix_spawnattr_setsigmask(&at, &none);
	posix_spawnattr_setsigdefault(&at, &def);
	posix_spawnattr_setflags(&at, POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF);
	char **env = child_env(w, asan, sizeof asan);
	pid_t pid = 0;
	int r = env ? posix_spawn(&pid, "/proc/self/exe", &fa, &at, argv, env) : ENOMEM;
	if (env && env != environ && env != no_env)
		free(env);
	posix_spawn_file_actions_destroy(&fa);
	posix_spawnattr_destroy(&at);
	if (plugin_fd >= 0)
		close(plugin_fd);
	if (r)
		return -r;
	/* Nobody reaps it before we hold its pidfd: the loop only waits on
	 * pidfds it finds here. */
	int fd = (int)syscall(SYS_pidfd_open, pid, 0);
	if (fd < 0) {
		r = -errno;
		kill(pid, SIGKILL);
		waitpid(pid, NULL, 0);
		return r;
	}
	atomic_store(&w->os_pid, (int)pid);
	atomic_store(&s->pidfd, fd);
	/* An exit before the pidfd was there left no SIGCHLD for us: look. */
	ap_node_call_on_loop_sure(w->pool->n, reap_cb, w);
	return 0;
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
	if (front_bare(s)) {
		/* A tell: no answer, whatever came of it. */
		int revoked = s->bare[s->bare_head % ISO_BARE_MAX].revoked;
		take_bare(w);
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

/* Tells the child finished with status ok, up to seq `upto` (its
 * done_seq, or the seq of a later result): they have no record, and leave
 * the mailbox here. -1 if one of them is an ask (it must have a record). */
static int take_done(ap_worker *w, uint64_t upto, int *progress)
{
	ap_iso *s = w->iso;
	if (upto < s->front_seq)
		return 0;
	if (upto >= s->next_seq)
		return -1;
	uint64_t n = 0;
	while (s->front_seq <= upto) {
		if (front_bare(s)) {
			n += !s->bare[s->bare_head % ISO_BARE_MAX].revoked;
			take_bare(w);
			continue;
		}
		/* Looked at before it leaves: an ask popped here would go
		 * unanswered (a revoked one is answered elsewhere). */
		ap_job *j = atomic_load_explicit(&w->mb.head->next, memory_order_acquire);
		if (!j || (j->is_ask && !j->revoked))
			return -1;
		(void)ap_mbox_pop(&w->mb);
		s->front_seq++;
		if (j->revoked)
			continue;
		ap_mbox_done(&w->mb);
		n++;
	}
	atomic_fetch_add_explicit(&w->processed, n, memory_order_relaxed);
	*progress = 1;
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
		if (result_bad(s, &h, chunk))
			goto bad;
		/* The ok tells before it are done. */
		if (h.seq > s->front_seq && (s->got || take_done(w, h.seq - 1, progress)))
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
	if (!crash && done >= s->front_seq && (s->got || take_done(w, done, progress)))
		goto bad;
	return crash;
bad:
	ap_ring_release(&s->rsp);
	ap_log(AP_LOG_ERROR, "pool %s: worker %d's process broke its channel; killing it", w->pool->name, w->id);
	return -1;
}

/* ---- the proxy: sending ---------------------------------------------------- */

/* Rings the child for what was published, with the time: the child
 * measures its wake-ups against it (isolate.h, rang_us). */
static int ring_child(ap_iso *s)
{
	atomic_store_explicit(&s->ctl->rang_us, ap_mono_us(), memory_order_relaxed);
	return ap_ring_notify(&s->req);
}

/* Publishes what send_jobs wrote, and wakes a sleeping child for it,
 * except for tells: those are held back (published, not rung) for up to
 * ISO_HOLD_US or until ISO_RING_BATCH of them, and meanwhile the proxy
 * sleeps through pushes of tells (WANT_ASK). So a stream of tells slower
 * than the child costs the child and the proxy a wake-up per batch, not
 * one each per tell: on two cores those wake-ups, not the copies, were
 * the cost of process mode (pool node 1.3-2.3 us of CPU per tell, 0.35-0.5
 * held back). A tell has nobody waiting for it; an ask is rung at once,
 * and with it every tell before it. A child that is awake takes them
 * anyway (it reads what is published). */
static int send_commit(ap_iso *s, int ask, unsigned n)
{
	if (ap_ring_publish(&s->req) < 0)
		return -1;
	s->bare_unpub = 0; /* published with the rest */
	if (!ask) {
		int64_t now = ap_mono_us();
		if (!s->unrung)
			s->unrung_since_us = now;
		s->unrung += n;
		if (s->unrung < ISO_RING_BATCH && now - s->unrung_since_us < ISO_HOLD_US)
			return 0;
	}
	s->unrung = 0;
	return ring_child(s) < 0 ? -1 : 0;
}

/* Rings the child for the tells held back, now. */
static void ring_held(ap_iso *s)
{
	if (s->unrung) {
		s->unrung = 0;
		(void)ring_child(s); /* a broken ring is seen by the next send */
	}
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
	ring_held(s);
	return 0;
}

/* Sends the jobs queued after the cursor while the request ring has room.
 * 1 if anything went. */
static int send_jobs(ap_worker *w)
{
	ap_iso *s = w->iso;
	size_t room = ap_ring_max_payload(ISO_REQ_CAP) - sizeof(struct iso_rec);
	int sent = 0, r = 0, ask = 0;
	unsigned n = 0;
	ap_job *j;
	while ((j = atomic_load_explicit(&s->cursor->next, memory_order_acquire))) {
		ask |= j->is_ask;
		n++;
		size_t total = j->msg_len;
		const uint8_t *msg = j->data + j->head_len;
		do {
			size_t chunk = total - s->sent_off < room ? total - s->sent_off : room;
			void *rec;
			/* Full: later. Anything else (the child broke the
			 * ring, which stays broken): the slot is lost. */
			if ((r = ap_ring_reserve(&s->req, sizeof(struct iso_rec) + chunk, &rec)))
				goto out;
			struct iso_rec h = { .seq = s->next_seq, .total = (uint32_t)total, .off = (uint32_t)s->sent_off,
					     .kind = REC_MSG, .a = j->is_ask, .b = j->is_binary };
			memcpy(rec, &h, sizeof h);
			memcpy((uint8_t *)rec + sizeof h, msg + s->sent_off, chunk);
			s->sent_off += chunk;
			sent = 1;
		} while (s->sent_off < total);
		s->cursor = j;
		s->sent_off = 0;
		if (j->is_ask)
			s->ask_seq = s->next_seq;
		s->next_seq++;
	}
out:
	if (sent && send_commit(s, ask, n) < 0)
		return -1;
	return r && r != -EAGAIN ? -1 : sent;
}

/* ---- the proxy thread ------------------------------------------------------ */

static int ready_init(ap_worker *w)
{
	return atomic_load(&w->iso->ctl->init_state) || atomic_load(&w->iso->dead) || atomic_load(&w->stop);
}

/* The record the next send needs: the rest of the next job, or as much of
 * it as one record holds. 0 when nothing waits. */
static size_t next_need(ap_iso *s)
{
	ap_job *j = atomic_load_explicit(&s->cursor->next, memory_order_acquire);
	if (!j)
		return 0;
	size_t room = ap_ring_max_payload(ISO_REQ_CAP) - sizeof(struct iso_rec), left = j->msg_len - s->sent_off;
	return sizeof(struct iso_rec) + (left < room ? left : room);
}

static int ready_run(ap_worker *w)
{
	ap_iso *s = w->iso;
	size_t need;
	return results_ready(w) || atomic_load(&s->dead) || atomic_load(&w->stop) ||
	       ((need = next_need(s)) && ap_ring_has_room(&s->req, need) != 0);
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
		ap_node_call_on_loop_sure(w->pool->n, reap_cb, w);
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
	int timeout = tdeq && tdeq - 1 == atomic_load(&w->mb.deq) && front_out(s) && !front_revoked(s, w);
	if (s->handler_crash && !s->killed && !timeout)
		return; /* counted with its result */
	enum ap_crash_cause cause = timeout ? AP_CRASH_TIMEOUT
				    : s->how == CLD_EXITED ? AP_CRASH_EXIT : AP_CRASH_SIGNAL;
	ap_worker_count_crash(w, cause);
	/* running_seq is the child's word, so only a hint: a timeout is
	 * ours, and answers the message we timed. */
	if (timeout || (running && running == s->front_seq && front_out(s))) {
		ap_job *j = NULL;
		if (front_bare(s))
			take_bare(w); /* a tell: lost with its child, as a job's would be */
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
	ring_held(s); /* it hands back what it has not started */
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
		int sent = send_jobs(w);
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
		/* A handler's deadline is the loop's (pool.c, the watchdog),
		 * so we may sleep, and the loop may send asks meanwhile
		 * (send_direct). */
		int64_t wait_us = (int64_t)ISO_IDLE_MS * 1000, held = held_left(s);
		if (held && next_need(s)) {
			/* The ring is full: the child must drain it now. */
			ring_held(s);
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
