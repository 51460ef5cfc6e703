/* isolate: workers in child processes. The design is in isolate.h; this
 * file holds the channel (one sealed memfd per worker slot), the proxy
 * thread (pool node side), the child's main, and the reaping.
 */
#include "isolate.h"

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
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/resource.h>
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

#define ISO_MAGIC 0x314f5349504100ULL /* "\0APISO1" */
#define ISO_CTL_SIZE 4096u
#define ISO_RING_CAP (128u << 10)  /* per direction; larger messages go in chunks */
#define ISO_MAX_MSG (1u << 30)     /* a reply, whole (a message is whatever the pool node took in) */
#define ISO_FD 3                   /* where the child finds the channel */
#define ISO_SPIN 64                /* rounds before a side sleeps (2 cores: keep it short) */
#define ISO_SPIN_INFLIGHT 2000     /* rounds a proxy with work at its child waits before it sleeps */
#define ISO_RING_BATCH 32          /* results a busy child writes between rings of the proxy's bell */
#define ISO_IDLE_MS 1000           /* a sleeping proxy looks again this often, whatever happens */
#define ISO_REAP_MS 5000           /* how long a proxy waits for its child's exit to be reaped */
#define ISO_STOP_GRACE_MS 5000     /* at stop, how long a child may finish what it was handed */

enum { REC_MSG = 1, REC_STOP = 2, REC_RESULT = 3 };

/* Every record: this header, then up to ring payload - header bytes of the
 * message (or reply) from offset `off`. A message over one record goes in
 * several, in order; `total` is its whole length. */
struct iso_rec {
	uint64_t seq;
	uint32_t total, off;
	uint8_t kind, a, b, c; /* MSG: is_ask, is_binary; RESULT: status, reply kind, 1 if not run */
	uint32_t pad;
};

typedef struct ap_iso {
	struct ap_ring_map map;
	struct iso_ctl *ctl;
	/* The layout, kept here: a child may scribble on the shared header,
	 * and the pool node must never take an offset from it. */
	struct iso_ctl layout;
	/* the loop writes these, the proxy reads them */
	_Atomic int pidfd;      /* -1 when no child */
	_Atomic int dead;       /* the child was reaped; status below is set */
	int how, code;          /* waitid's si_code and si_status: the cause */
	/* proxy thread only */
	struct ap_ring req, rsp;
	ap_job *cursor;     /* the last job sent whole; the mailbox's dummy when none */
	size_t sent_off;    /* bytes of cursor->next already sent */
	uint64_t next_seq;  /* of the next job to send */
	uint64_t front_seq; /* of the oldest job sent and not answered */
	int64_t front_since; /* since when the child has been on it, by our clock (handler_timeout_ms) */
	size_t got;         /* bytes of the current result assembled in w->reply */
	uint64_t timed_out_seq;
	int killed;         /* we sent SIGKILL */
	int handler_crash;  /* the child reported AP_HANDLER_CRASH and exits on its own */
} ap_iso;

static int64_t mono_ms(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static size_t round_up(size_t n, size_t a) { return (n + a - 1) / a * a; }

/* ---- the channel ----------------------------------------------------------- */

int ap_iso_slot_init(ap_worker *w)
{
	ap_pool *p = w->pool;
	size_t spec_len = strlen(p->spec) + 1;
	size_t ring = ap_ring_size(ISO_RING_CAP);
	size_t spec_off = ISO_CTL_SIZE, cfg_off = round_up(spec_off + spec_len, 64);
	size_t req_off = round_up(cfg_off + p->config_len, 4096), rsp_off = req_off + ring;
	size_t size = round_up(rsp_off + ring, 4096);
	ap_iso *s = calloc(1, sizeof *s);
	if (!s)
		return -ENOMEM;
	int r = ap_ring_map_create_memfd(&s->map, "actor_pool_worker", size);
	if (r) {
		free(s);
		return r;
	}
	/* Not where the child wants it: a dup2 onto the same number would
	 * keep its close-on-exec flag. */
	if (s->map.fd <= ISO_FD) {
		int fd = fcntl(s->map.fd, F_DUPFD_CLOEXEC, ISO_FD + 1);
		if (fd < 0) {
			ap_ring_map_close(&s->map);
			free(s);
			return -errno;
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
	l->ring_size = (uint32_t)ring;
	l->spec_off = (uint32_t)spec_off;
	l->spec_len = (uint32_t)spec_len;
	l->cfg_off = (uint32_t)cfg_off;
	l->cfg_len = (uint32_t)p->config_len;
	l->max_memory_mb = p->o.max_memory_mb;
	l->layout_timeout = p->o.handler_timeout_ms > 0;
	l->worker = (uint32_t)w->id;
	atomic_init(&s->pidfd, -1);
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
	free(s);
	w->iso = NULL;
}

/* ---- doorbells ------------------------------------------------------------- */

static void bell_ring(struct iso_ctl *c, int always)
{
	atomic_thread_fence(memory_order_seq_cst);
	if (always || (atomic_load(&c->proxy_waiting) && atomic_exchange(&c->proxy_waiting, 0))) {
		atomic_store(&c->proxy_waiting, 0);
		atomic_fetch_add(&c->proxy_bell, 1);
		ap_ring_futex_wake((uint32_t *)&c->proxy_bell, 1);
	}
}

void ap_iso_wake(ap_worker *w, int always) { bell_ring(w->iso->ctl, always); }

/* The oldest job is the child's: sent whole, or a part of it (a child
 * can die taking a large one in). */
static int front_out(const ap_iso *s) { return s->front_seq < s->next_seq || s->sent_off > 0; }

/* The proxy is the mailbox's only consumer: its oldest job stays put. */
static int front_is_ask(ap_worker *w)
{
	ap_job *j = atomic_load_explicit(&w->mb.head->next, memory_order_acquire);
	return j && j->is_ask;
}

/* The proxy sleeps until the bell rings or timeout_ms, unless ready()
 * already holds after it raised its flag (the Dekker pair of bell_ring). */
static void proxy_sleep(ap_worker *w, int timeout_ms, int (*ready)(ap_worker *))
{
	struct iso_ctl *c = w->iso->ctl;
	/* With an ask at the child its answer is microseconds away and a
	 * caller waits for it: a sleep and a wake-up would cost more. A tell's
	 * result only frees its slot, and spinning for it would take a core
	 * from the children (2 cores): sleep soon. */
	int spin = front_out(w->iso) && front_is_ask(w) ? ISO_SPIN_INFLIGHT : ISO_SPIN;
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
	atomic_store(&c->proxy_waiting, 1);
	atomic_thread_fence(memory_order_seq_cst);
	if (!ready(w))
		ap_ring_futex_wait((uint32_t *)&c->proxy_bell, v, timeout_ms);
	atomic_store(&c->proxy_waiting, 0);
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
	atomic_store(&s->dead, 1);
	bell_ring(s->ctl, 1);
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

#if defined(__SANITIZE_ADDRESS__)
#define ISO_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define ISO_ASAN 1
#endif
#endif

/* The environment of a worker process. Under ASan, a crash must stay the
 * crash (not ASan's report and exit 1), and ASan's shadow memory rules out
 * RLIMIT_DATA, so its own RSS limit stands in for max_memory_mb: the soft
 * one, past which malloc returns NULL as it does under RLIMIT_DATA (the hard
 * one exits 1 instead, a different crash from the same handler). */
static char **child_env(ap_worker *w, char *asan, size_t asan_len)
{
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
		else
			env[k++] = environ[i];
	}
	int mb = w->pool->o.max_memory_mb;
	snprintf(asan, asan_len, "ASAN_OPTIONS=%s%shandle_segv=0:handle_abort=0:handle_sigbus=0:handle_sigfpe=0:"
		 "handle_sigill=0:detect_leaks=0:allocator_may_return_null=1:soft_rss_limit_mb=%d",
		 old, *old ? ":" : "", mb);
	env[k++] = asan;
	env[k] = NULL;
	return env;
#else
	(void)w;
	(void)asan;
	(void)asan_len;
	return environ;
#endif
}

static int iso_spawn(ap_worker *w)
{
	ap_iso *s = w->iso;
	ap_pool *p = w->pool;
	struct iso_ctl *c = s->ctl, *l = &s->layout;
	uint8_t *mem = s->map.mem;
	/* The previous child is reaped: nobody else is attached. Everything
	 * it could have scribbled on is written again, from our own copies. */
	memset(c, 0, ISO_CTL_SIZE);
	memcpy(c, l, offsetof(struct iso_ctl, init_state));
	memcpy(mem + l->spec_off, p->spec, l->spec_len);
	if (l->cfg_len)
		memcpy(mem + l->cfg_off, p->config, l->cfg_len);
	if (ap_ring_format(mem + l->req_off, l->ring_size, ISO_RING_CAP) ||
	    ap_ring_format(mem + l->rsp_off, l->ring_size, ISO_RING_CAP) ||
	    ap_ring_attach_producer(&s->req, mem + l->req_off, l->ring_size) ||
	    ap_ring_attach_consumer(&s->rsp, mem + l->rsp_off, l->ring_size))
		return -EPROTO;
	s->cursor = w->mb.head;
	s->sent_off = 0;
	s->next_seq = s->front_seq = 1;
	s->front_since = 0;
	s->got = 0;
	s->timed_out_seq = 0;
	s->killed = s->handler_crash = 0;
	s->how = s->code = 0;
	atomic_store(&s->dead, 0);

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
	if (env && env != environ)
		free(env);
	posix_spawn_file_actions_destroy(&fa);
	posix_spawnattr_destroy(&at);
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
	ap_node_call_on_loop(w->pool->n, reap_cb, w);
	return 0;
}

/* ---- the proxy: results ---------------------------------------------------- */

/* {worker_crashed, Cause} or handler_timeout as the reply, for
 * ap_pool_send_result(..., "error", ...). */
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
	ap_job *j = ap_mbox_pop(&w->mb);
	s->front_seq++;
	s->front_since = mono_ms(); /* the child is on the next one now, if any */
	s->got = 0;
	if (!j)
		return 0; /* cannot be: the seq was checked against what was sent */
	ap_mbox_done(&w->mb);
	if (h->c) {
		if (j->is_ask)
			ap_pool_send_error(w, j, "stopped");
		else if (j->seg)
			ap_dp_seg_put(j->seg);
		return 0;
	}
	if (h->a == AP_HANDLER_CRASH) {
		ap_worker_count_crash(w, AP_CRASH_HANDLER);
		s->handler_crash = 1;
		if (j->is_ask)
			ap_pool_send_error(w, j, "worker_crashed");
		else if (j->seg)
			ap_dp_seg_put(j->seg);
		return 1;
	}
	atomic_fetch_add_explicit(&w->processed, 1, memory_order_relaxed);
	if (h->a != AP_HANDLER_OK)
		atomic_fetch_add_explicit(&w->errors, 1, memory_order_relaxed);
	if (j->is_ask) {
		w->reply.kind = (actor_pool_reply_kind)h->b;
		ap_pool_send_result(w, j, h->a == AP_HANDLER_OK ? "ok" : "error", &w->reply);
	} else if (j->seg) {
		ap_dp_seg_put(j->seg);
	}
	return 0;
}

/* Everything the child has finished. 0, 1 (a handler crash: stop
 * sending, wait for its exit), -1 (the child broke the protocol). */
static int drain_results(ap_worker *w, int *progress)
{
	ap_iso *s = w->iso;
	const void *p;
	size_t len;
	int r, crash = 0, n = 0;
	while ((r = ap_ring_read(&s->rsp, &p, &len)) == 0) {
		struct iso_rec h;
		if (len < sizeof h)
			goto bad;
		memcpy(&h, p, sizeof h);
		size_t chunk = len - sizeof h;
		if (h.kind != REC_RESULT || h.seq != s->front_seq || s->front_seq >= s->next_seq ||
		    h.total > ISO_MAX_MSG || h.off != s->got || chunk > h.total - h.off || h.a > AP_HANDLER_CRASH ||
		    h.b > AP_REPLY_ATOM || h.c > 1 || (h.c && h.total))
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
		if (++n == 64) {
			ap_ring_release(&s->rsp);
			n = 0;
		}
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
	return crash;
bad:
	ap_ring_release(&s->rsp);
	ap_log(AP_LOG_ERROR, "pool %s: worker %d's process broke its channel; killing it", w->pool->name, w->id);
	return -1;
}

/* ---- the proxy: sending ---------------------------------------------------- */

/* Sends the jobs queued after the cursor while the request ring has room.
 * 1 if anything went. */
static int send_jobs(ap_worker *w)
{
	ap_iso *s = w->iso;
	size_t room = ap_ring_max_payload(ISO_RING_CAP) - sizeof(struct iso_rec);
	int sent = 0, r = 0;
	ap_job *j;
	while ((j = atomic_load_explicit(&s->cursor->next, memory_order_acquire))) {
		size_t total = j->msg_len;
		const uint8_t *msg = j->data + j->head_len;
		if (s->front_seq == s->next_seq && s->sent_off == 0)
			s->front_since = mono_ms(); /* an idle child starts on it now */
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
		s->next_seq++;
	}
out:
	if (sent && ap_ring_commit(&s->req) < 0)
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
	size_t room = ap_ring_max_payload(ISO_RING_CAP) - sizeof(struct iso_rec), left = j->msg_len - s->sent_off;
	return sizeof(struct iso_rec) + (left < room ? left : room);
}

static int ready_run(ap_worker *w)
{
	ap_iso *s = w->iso;
	size_t need;
	return ap_ring_readable(&s->rsp) || atomic_load(&s->dead) || atomic_load(&w->stop) ||
	       ((need = next_need(s)) && ap_ring_has_room(&s->req, need) != 0);
}

static int ready_dead(ap_worker *w) { return atomic_load(&w->iso->dead); }

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
	int64_t next_log = mono_ms() + ISO_REAP_MS;
	while (!atomic_load(&s->dead)) {
		proxy_sleep(w, 100, ready_dead);
		if (atomic_load(&s->dead))
			break;
		ap_node_call_on_loop(w->pool->n, reap_cb, w);
		if (mono_ms() >= next_log) {
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
	/* Killed for a timeout, and that message is still unanswered (it may
	 * have finished between our look and the kill). */
	int timeout = s->timed_out_seq && s->timed_out_seq == s->front_seq && front_out(s);
	if (s->handler_crash && !s->killed)
		return; /* counted with its result */
	enum ap_crash_cause cause = timeout ? AP_CRASH_TIMEOUT
				    : s->how == CLD_EXITED ? AP_CRASH_EXIT : AP_CRASH_SIGNAL;
	ap_worker_count_crash(w, cause);
	/* running_seq is the child's word, so only a hint: a timeout is
	 * ours, and answers the message we timed. */
	if (timeout || (running && running == s->front_seq && front_out(s))) {
		ap_job *j = ap_mbox_pop(&w->mb);
		if (j) {
			ap_mbox_done(&w->mb);
			s->front_seq++;
			if (j->is_ask) {
				set_death_reply(w, timeout);
				ap_pool_send_result(w, j, "error", &w->reply);
			} else if (j->seg) {
				ap_dp_seg_put(j->seg);
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
	 * runs after the grace is killed and answered stopped. */
	int64_t grace = mono_ms() + ISO_STOP_GRACE_MS;
	atomic_store(&s->ctl->stopping, 1);
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
		int64_t left = grace - mono_ms();
		if (left <= 0) {
			ap_log(AP_LOG_WARNING, "pool %s: worker %d's process still busy %d ms after stop; killing it",
			       w->pool->name, w->id, ISO_STOP_GRACE_MS);
			wait_reaped(w, 1);
			break;
		}
		proxy_sleep(w, left < 100 ? (int)left : 100, ready_run);
	}
	ap_job *j;
	while ((j = ap_mbox_pop(&w->mb))) {
		if (j->is_ask)
			ap_pool_send_error(w, j, "stopped");
		else if (j->seg)
			ap_dp_seg_put(j->seg);
		ap_mbox_done(&w->mb);
	}
	void *rec;
	struct iso_rec h = { .kind = REC_STOP };
	if (!atomic_load(&s->dead) && ap_ring_reserve(&s->req, sizeof h, &rec) == 0) {
		memcpy(rec, &h, sizeof h);
		ap_ring_commit(&s->req);
	}
	int64_t end = mono_ms() + 1000;
	while (!atomic_load(&s->dead) && mono_ms() < end)
		proxy_sleep(w, 100, ready_dead);
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

	int r = iso_spawn(w);
	if (r) {
		ap_log(AP_LOG_ERROR, "pool %s: cannot start worker %d's process: %s", p->name, w->id, strerror(-r));
		w->init_rc = r;
		goto done;
	}
	while (!ready_init(w))
		proxy_sleep(w, ISO_IDLE_MS, ready_init);
	if (atomic_load(&c->init_state) != 1) {
		w->init_rc = atomic_load(&c->init_state) == 2 ? c->init_rc : -ECHILD;
		if (atomic_load(&s->dead) && atomic_load(&c->init_state) == 0)
			ap_log(AP_LOG_WARNING, "pool %s: worker %d's process died in its init", p->name, w->id);
		wait_reaped(w, 1);
		goto done;
	}
	if (w->gen == 0)
		ap_node_call_on_loop(p->n, ap_pool_worker_ready, w);

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
		int wait = ISO_IDLE_MS;
		int tmo = p->o.handler_timeout_ms;
		/* Our own clock: the child's running_seq and running_since_ms
		 * are its word, and a broken child could hide behind them. The
		 * front job has been the child's since front_since (a little
		 * later, when we take results late: never early). */
		if (tmo && front_out(s) && !s->killed) {
			int64_t left = s->front_since + tmo - mono_ms();
			if (left <= 0) {
				s->timed_out_seq = s->front_seq;
				iso_kill(s);
				continue;
			}
			if (left < wait)
				wait = (int)left + 1;
		}
		proxy_sleep(w, wait, ready_run);
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
	ap_node_call_on_loop(p->n, ap_pool_worker_exited, w);
	return NULL;
}

/* ---- the child ------------------------------------------------------------- */

static struct iso_ctl *cc;

static void child_die(int code) { _exit(code); }

/* Writes one result (the reply in chunks), waiting for room. */
static void child_result(struct ap_ring *rsp, uint64_t seq, int status, const actor_pool_reply *reply, int send_reply,
			 int not_run)
{
	size_t room = ap_ring_max_payload(ISO_RING_CAP) - sizeof(struct iso_rec);
	size_t total = send_reply ? reply->len : 0, off = 0;
	if (total > ISO_MAX_MSG)
		child_die(75);
	do {
		size_t chunk = total - off < room ? total - off : room;
		void *rec;
		while (ap_ring_reserve(rsp, sizeof(struct iso_rec) + chunk, &rec) == -EAGAIN) {
			ap_ring_publish(rsp);
			bell_ring(cc, 0);
			if (ap_ring_wait_space(rsp, sizeof(struct iso_rec) + chunk, ISO_SPIN, -1) &&
			    ap_ring_has_room(rsp, sizeof(struct iso_rec) + chunk) != 1)
				child_die(72);
		}
		struct iso_rec h = { .seq = seq, .total = (uint32_t)total, .off = (uint32_t)off, .kind = REC_RESULT,
				     .a = (uint8_t)status, .b = (uint8_t)(send_reply ? reply->kind : 0),
				     .c = (uint8_t)not_run };
		memcpy(rec, &h, sizeof h);
		if (chunk)
			memcpy((uint8_t *)rec + sizeof h, reply->data + off, chunk);
		off += chunk;
	} while (off < total);
}

int ap_iso_child_main(int argc, char **argv)
{
	/* Die with the proxy thread that started us; if it is gone already,
	 * the parent changed before the flag was set: leave now. */
	prctl(PR_SET_PDEATHSIG, SIGKILL);
	if (argc < 3 || getppid() != (pid_t)atoi(argv[2]))
		_exit(70);
	/* Nothing of the pool node's but the channel (its sockets, epmd's). */
	if (syscall(SYS_close_range, ISO_FD + 1, ~0U, 0)) {
		/* Before Linux 5.9. */
		long max = sysconf(_SC_OPEN_MAX);
		for (int fd = ISO_FD + 1; fd < (max > 0 && max < 65536 ? max : 65536); fd++)
			close(fd);
	}
	struct stat st;
	if (fstat(ISO_FD, &st) || st.st_size < (off_t)ISO_CTL_SIZE)
		_exit(71);
	size_t size = (size_t)st.st_size;
	uint8_t *mem = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, ISO_FD, 0);
	if (mem == MAP_FAILED)
		_exit(71);
	close(ISO_FD);
	cc = (struct iso_ctl *)mem;
	if (cc->magic != ISO_MAGIC || cc->size != size || cc->spec_off + (size_t)cc->spec_len > size ||
	    cc->cfg_off + (size_t)cc->cfg_len > size || cc->req_off + (size_t)cc->ring_size > size ||
	    cc->rsp_off + (size_t)cc->ring_size > size || cc->spec_len == 0 || mem[cc->spec_off + cc->spec_len - 1])
		_exit(71);
	struct ap_ring req, rsp;
	if (ap_ring_attach_consumer(&req, mem + cc->req_off, cc->ring_size) ||
	    ap_ring_attach_producer(&rsp, mem + cc->rsp_off, cc->ring_size))
		_exit(71);
	char tname[16];
	snprintf(tname, sizeof tname, "ap_worker/%u", cc->worker);
	prctl(PR_SET_NAME, tname);
#ifndef ISO_ASAN
	if (cc->max_memory_mb > 0) {
		struct rlimit rl = { .rlim_cur = (rlim_t)cc->max_memory_mb << 20, .rlim_max = (rlim_t)cc->max_memory_mb << 20 };
		setrlimit(RLIMIT_DATA, &rl);
	}
#endif

	const char *spec = (const char *)mem + cc->spec_off;
	const actor_pool_handler *h = ap_builtin_handler(spec);
	void *dl = NULL;
	if (!h) {
		char why[256];
		if (ap_plugin_load(spec, &h, &dl, NULL, why, sizeof why)) {
			ap_log(AP_LOG_ERROR, "worker process: cannot load %s: %s", spec, why);
			cc->init_rc = -1;
			atomic_store(&cc->init_state, 2);
			bell_ring(cc, 1);
			_exit(0);
		}
	}
	void *state = NULL;
	int rc = h->init ? h->init(&state, cc->cfg_len ? mem + cc->cfg_off : NULL, cc->cfg_len) : 0;
	if (rc) {
		cc->init_rc = rc;
		atomic_store(&cc->init_state, 2);
		bell_ring(cc, 1);
		_exit(0);
	}
	atomic_store(&cc->init_state, 1);
	bell_ring(cc, 1);

	actor_pool_reply reply = { .reserve = ap_pool_reply_reserve };
	uint8_t *big = NULL;
	unsigned unrung = 0, unrung_ask = 0;
	size_t big_got = 0;
	uint64_t big_seq = 0;
	for (;;) {
		const void *p;
		size_t len;
		int r = ap_ring_read(&req, &p, &len);
		if (r == -EAGAIN) {
			/* Results not rung yet (tells' only: an ask's rings at
			 * once) wait for the spin: more work may come, and one
			 * wake-up then covers them all. Never for our sleep. */
			if (unrung) {
				for (int k = 0; k < ISO_SPIN && ap_ring_readable(&req) != 1; k++)
					ap_ring_cpu_relax();
				if (ap_ring_readable(&req) == 1)
					continue;
				bell_ring(cc, 0);
				unrung = 0;
			}
			if (ap_ring_wait(&req, ISO_SPIN, -1) && ap_ring_readable(&req) != 1)
				_exit(72);
			continue;
		}
		struct iso_rec m;
		if (r || len < sizeof m)
			_exit(73);
		memcpy(&m, p, sizeof m);
		if (m.kind == REC_STOP) {
			if (h->terminate)
				h->terminate(state);
			_exit(0);
		}
		size_t chunk = len - sizeof m;
		if (m.kind != REC_MSG || chunk > m.total - (size_t)m.off ||
		    (m.off && (m.seq != big_seq || m.off != big_got)))
			_exit(73);
		const uint8_t *data = (const uint8_t *)p + sizeof m;
		if (m.off == 0) {
			/* Ours from its first byte: dying while taking it in
			 * (no memory for it) is dying on it. */
			if (cc->layout_timeout)
				atomic_store(&cc->running_since_ms, mono_ms());
			atomic_store(&cc->running_seq, m.seq);
		}
		if (m.off == 0 && chunk < m.total) {
			free(big);
			big = malloc(m.total);
			if (!big)
				_exit(74);
			big_seq = m.seq;
			big_got = 0;
		}
		if (chunk < m.total) {
			memcpy(big + m.off, data, chunk);
			big_got += chunk;
			ap_ring_release(&req);
			bell_ring(cc, 0); /* room for the proxy's next chunk */
			if (big_got < m.total)
				continue;
			data = big;
		}
		actor_pool_status rs = AP_HANDLER_OK;
		int not_run = atomic_load(&cc->stopping) != 0;
		if (!not_run) {
			actor_pool_request rq = { .data = data, .len = m.total, .is_binary = m.b, .is_ask = m.a,
						  .worker = cc->worker };
			reply.len = 0;
			ap_pool_set_atom_reply(&reply, "ok");
			rs = h->handle(state, &rq, &reply);
			if (rs > AP_HANDLER_CRASH)
				rs = AP_HANDLER_ERROR;
		}
		child_result(&rsp, m.seq, rs, &reply, m.a && !not_run && rs != AP_HANDLER_CRASH, not_run);
		ap_ring_publish(&rsp);
		atomic_store(&cc->running_seq, 0);
		ap_ring_release(&req);
		if (data == big) {
			free(big);
			big = NULL;
		}
		/* The proxy hears of results in batches under load (a wake-up
		 * per message would cost more than an echo), and at once when
		 * we have caught up on an ask: its caller waits for nothing.
		 * Tells' results ring before we sleep (above). */
		unrung_ask |= m.a;
		if (++unrung >= ISO_RING_BATCH || (unrung_ask && ap_ring_readable(&req) != 1)) {
			bell_ring(cc, 0);
			unrung = 0;
			unrung_ask = 0;
		}
		if (rs == AP_HANDLER_CRASH) {
			if (h->terminate)
				h->terminate(state);
			_exit(0);
		}
	}
}
