/* pool: the life of the pool node's stateless worker pools: start and
 * stop, their workers' threads (of the kind the pool was started with:
 * pool_int.h, worker kinds), and a worker's replacement after a crash
 * (backoff with jitter, queued jobs moved to the others). How the files of
 * a pool divide the work, and its threads: pool_int.h.
 */
#include "pool.h"

#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "ap_atomset.h"
#include "ap_log.h"
#include "ap_rand.h"
#include "ap_time.h"
#include "handlers.h"
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

ap_pool *ap_pool_all(void) { return pools; }

/* ---- a worker's thread (of its kind) ------------------------------------------ */

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
	if (pthread_create(&w->th, NULL, w->ops->main, w))
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
		if (w->ops->slot_free)
			w->ops->slot_free(w);
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

/* ---- the watchdog's timer (watchdog.c) ------------------------------------ */

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
		ap_wd_watch(p, &p->w[i], now);
	if (ap_node_timer(n, ap_wd_period(p), watchdog, p) == 0)
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
	/* Before anything reads the mailbox (worker processes: their
	 * child's bare tells join it). */
	if (w->ops->exited)
		w->ops->exited(w);

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
		  const ap_worker_ops *kind, ap_proc_fn ingress, ap_pending_reply *reply)
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
		w->ops = kind;
		if (ap_mbox_init(&w->mb))
			goto nomem;
		if (kind->slot_init && kind->slot_init(w))
			goto nomem;
	}
	if (p->o.isolation == AP_ISO_PROCESS)
		ap_sb_warn(p->name, &p->o.sandbox, p->o.max_memory_mb, kind->sb_layers(&p->w[0]));
	p->proc = ap_proc_spawn(n, name, ingress, p);
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
	if ((p->o.stall_ms || p->o.handler_timeout_ms) && ap_node_timer(n, ap_wd_period(p), watchdog, p) == 0)
		p->timers++;
	return 0;
nomem:
	if (p->w)
		for (int i = 0; i < p->o.workers; i++) {
			if (p->w[i].mb.head)
				ap_mbox_destroy(&p->w[i].mb);
			if (kind->slot_free)
				kind->slot_free(&p->w[i]);
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
