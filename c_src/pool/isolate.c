/* isolate: workers in child processes. The design is in isolate.h; the
 * pool node's side of it is in three files over one channel per worker
 * slot (isolate_node.h: its state and what the three share):
 *
 *   isolate.c        the channel (a sealed memfd per slot), what both the
 *                    proxy and the loop do to it (send what is queued, take
 *                    what is done), reaping, and starting a child
 *   isolate_proxy.c  the proxy thread: results, deaths, stops
 *   isolate_loop.c   the loop's own turns at a sleeping proxy's channel,
 *                    stalls and timeouts, bare tells, and the kind's table
 *
 * The child's side is isolate_child.c; what both sides share,
 * isolate_int.h.
 */
#include "isolate.h"
#include "isolate_int.h"
#include "isolate_node.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include "ap_log.h"
#include "ap_ring.h"
#include "handlers.h"
#include "pool_int.h"

extern char **environ;

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

/* ---- what the proxy and the loop share ---------------------------------------- */

/* A result record the proxy must not believe (the child broke its
 * channel): not a result, not for a message sent and unanswered, not the
 * next chunk of the one being taken in, or a status, kind or flag out of
 * range. */
int iso_result_bad(const ap_iso *s, const struct iso_rec *h, size_t chunk)
{
	return h->kind != REC_RESULT || h->seq < s->front_seq || h->seq >= s->next_seq || h->total > ISO_MAX_MSG ||
	       h->off != s->got || chunk > h->total - h->off || h->a > AP_HANDLER_CRASH || h->b > AP_REPLY_ATOM ||
	       h->c > 1 || (h->c && h->total);
}

/* The oldest message out is a bare tell (no job in the mailbox). */
int iso_front_bare(const ap_iso *s)
{
	return s->bare_head != s->bare_tail && s->bare[s->bare_head % ISO_BARE_MAX].seq == s->front_seq;
}

/* The bare tell at the front is done with (run, refused, or lost with
 * its child). */
void iso_take_bare(ap_worker *w)
{
	ap_iso *s = w->iso;
	if (!s->bare[s->bare_head % ISO_BARE_MAX].revoked)
		ap_mbox_done(&w->mb);
	s->bare_head++;
	s->front_seq++;
}

/* The oldest message out was revoked (its copy is another worker's). */
int iso_front_revoked(const ap_iso *s, ap_worker *w)
{
	if (iso_front_bare(s))
		return s->bare[s->bare_head % ISO_BARE_MAX].revoked;
	ap_job *j = atomic_load_explicit(&w->mb.head->next, memory_order_acquire);
	return j && j->revoked;
}

/* Tells the child finished with status ok, up to seq `upto` (its
 * done_seq, or the seq of a later result): they have no record, and leave
 * the mailbox here. -1 if one of them is an ask (it must have a record). */
int iso_take_done(ap_worker *w, uint64_t upto, int *progress)
{
	ap_iso *s = w->iso;
	if (upto < s->front_seq)
		return 0;
	if (upto >= s->next_seq)
		return -1;
	uint64_t n = 0;
	while (s->front_seq <= upto) {
		if (iso_front_bare(s)) {
			n += !s->bare[s->bare_head % ISO_BARE_MAX].revoked;
			iso_take_bare(w);
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

/* Rings the child for what was published, with the time: the child
 * measures its wake-ups against it (isolate.h, rang_us). */
static int ring_child(ap_iso *s)
{
	atomic_store_explicit(&s->ctl->rang_us, ap_mono_us(), memory_order_relaxed);
	return ap_ring_notify(&s->req);
}

/* Publishes what iso_send_jobs wrote, and wakes a sleeping child for it,
 * except for tells: those are held back (published, not rung) for up to
 * ISO_HOLD_US or until ISO_RING_BATCH of them, and meanwhile the proxy
 * sleeps through pushes of tells (WANT_ASK). So a stream of tells slower
 * than the child costs the child and the proxy a wake-up per batch, not
 * one each per tell: on two cores those wake-ups, not the copies, were
 * the cost of process mode (pool node 1.3-2.3 us of CPU per tell, 0.35-0.5
 * held back). A tell has nobody waiting for it; an ask is rung at once,
 * and with it every tell before it. A child that is awake takes them
 * anyway (it reads what is published). */
int iso_send_commit(ap_iso *s, int ask, unsigned n)
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
void iso_ring_held(ap_iso *s)
{
	if (s->unrung) {
		s->unrung = 0;
		(void)ring_child(s); /* a broken ring is seen by the next send */
	}
}

/* Sends the jobs queued after the cursor while the request ring has room.
 * 1 if anything went. */
int iso_send_jobs(ap_worker *w)
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
	if (sent && iso_send_commit(s, ask, n) < 0)
		return -1;
	return r && r != -EAGAIN ? -1 : sent;
}

/* The record the next send needs: the rest of the next job, or as much of
 * it as one record holds. 0 when nothing waits. */
size_t iso_next_need(ap_iso *s)
{
	ap_job *j = atomic_load_explicit(&s->cursor->next, memory_order_acquire);
	if (!j)
		return 0;
	size_t room = ap_ring_max_payload(ISO_REQ_CAP) - sizeof(struct iso_rec), left = j->msg_len - s->sent_off;
	return sizeof(struct iso_rec) + (left < room ? left : room);
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

void iso_reap_cb(ap_node *n, void *arg)
{
	(void)n;
	ap_iso_reap(arg);
}

void iso_kill(ap_iso *s)
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

int iso_spawn(ap_worker *w)
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
	ap_node_call_on_loop_sure(w->pool->n, iso_reap_cb, w);
	return 0;
}
