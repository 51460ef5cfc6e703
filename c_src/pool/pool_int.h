/* pool_int.h: what the files of a pool share, inside the pool node only.
 * Each file calls only those listed before it: the core reaches the kinds
 * of workers through their tables (ap_worker_ops) and the ingresses
 * through the routes they give requests (ap_route), never by name.
 *
 *   mailbox.c        the per-worker queue of jobs
 *   reply.c          answers: the handler's checked, sent by each job's route
 *   stats.c          counters and the stats map
 *   no_pool.c        tells that find no pool
 *   dispatch.c       routing, a request's way into a worker's mailbox (or
 *                    onto the loop: inline runs), jobs moved between workers
 *   watchdog.c       stalls and handler timeouts
 *   pool.c           a pool's life: start, stop, its workers' threads, restarts
 *   worker_thread.c  workers that are threads (the default)
 *   isolate*.c       workers that are processes (isolate.h)
 *   dist_ingress.c   the pool process: distribution messages -> requests,
 *                    and the distribution route (answers as frames)
 *   dataplane/node/  the same-host rings: attach, ring -> requests, and the
 *                    ring route (answers into reply rings)
 *   pool_opts.c, pool_node.c  the manager and main
 *
 * The core (all but the two ingresses) never asks which way a message
 * came: an ingress gives each request its route (below), and every answer
 * leaves by it. Nor does it call into a kind of worker: each worker has
 * its kind's functions (ap_worker_ops, below).
 *
 * Threads: the loop thread owns every pool and is the only producer into
 * every mailbox; each worker thread is the only consumer of its own. So a
 * mailbox is a single-producer single-consumer linked queue with no lock,
 * and its depth is two counters the loop can read at any time. Workers
 * answer straight to the asker, by the job's route: a frame they encode
 * themselves and hand to the loop (the one writer of sockets) through
 * ap_node_post, or a record they write into a reply ring themselves.
 * Workers tell the loop about their life (init done, exit) with
 * ap_node_call_on_loop, so all pool state changes on the loop thread.
 */
#ifndef AP_POOL_INT_H
#define AP_POOL_INT_H

#include <pthread.h>
#include <stdalign.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>

#include "ap_hist.h"
#include "ap_term.h"
#include "pool.h"
#include "pool_limits.h"

#define MAX_WORKERS AP_POOL_MAX_WORKERS
#define ROUTE_TRIES 3 /* full mailboxes the router tries past before answering overloaded */

/* ---- routes: an answer's way back -----------------------------------------
 * The ingress that takes a request in gives it its route: the functions
 * that send its answer back the way it came (distribution: a frame to the
 * caller's node, dist_ingress.c; ring: a record in a reply ring of the
 * caller's segment, dataplane/node/ring_seg.c), and what they need. An ask's route
 * may hold something of its ingress (ring: a reference on the segment),
 * taken by the ingress before it dispatches: whoever answers the ask, or
 * drops it unanswered, releases it, once. The core sends every answer
 * through ops->send (reply.c, ap_answer and its siblings), and never asks
 * which route it is. */
typedef struct ap_route ap_route;

/* How a sender meets a route with no room for the answer now: a worker's
 * thread may wait (a while: the route bounds it); the loop running a job
 * itself hears -EAGAIN (the route keeps its hold; the worker delivers the
 * answer later); the loop's own answers (errors) never wait. */
typedef enum { AP_SEND_WAIT, AP_SEND_NOWAIT, AP_SEND_LOOP } ap_send_mode;

typedef struct ap_route_ops {
	/* The answer b[0, len): the route's head bytes (the job's head_len),
	 * then the answer term without its 131 byte; the route may write
	 * into the head (a frame's length). addr: the route's address bytes
	 * (the job's addr_len). worker: the id of the worker answering (the
	 * loop's own answers: any). Releases the route's hold, unless
	 * -EAGAIN (AP_SEND_NOWAIT only); 0 otherwise, sent or dropped (the
	 * route logs what it drops). */
	int (*send)(const ap_route *r, const char *addr, uint8_t *b, size_t len, unsigned worker, ap_send_mode mode);
	/* The route's hold released with no answer. */
	void (*drop)(const ap_route *r);
	/* The node the answer goes to (reply.c checks a handler's term as
	 * that node will take it). */
	const char *(*peer)(const ap_route *r, const char *addr);
	/* Its ingress reads requests in batches and ends each with
	 * ap_pool_wake_all_pushed: the loop may run their messages itself
	 * (inline runs, within a budget per batch), write their tells
	 * straight into a worker process's ring, and answer them with
	 * AP_SEND_NOWAIT (the answers go out with the batch's). */
	int batched;
} ap_route_ops;

struct ap_route {
	const ap_route_ops *ops; /* NULL on a tell's job: nothing to answer */
	void *ctx;               /* the ingress's (distribution: the node; ring: the segment) */
	uint64_t id;             /* the ingress's (ring: the ask's id) */
};

/* An ask's route let go unanswered; nothing for a job with no route. */
static inline void ap_route_drop(const ap_route *r)
{
	if (r->ops)
		r->ops->drop(r);
}

/* ---- mailbox: SPSC intrusive queue (Vyukov) ----------------------------- */

typedef struct ap_job {
	struct ap_job *_Atomic next;
	struct ap_job *free_next;  /* on the recycle stack */
	uint32_t cap;              /* bytes of data[] allocated */
	uint8_t is_ask, is_binary;
	/* An answer made already (ap_pool_run_inline found its route with
	 * no room): data holds the route's head and the answer term, in
	 * head_len + msg_len bytes; the worker only delivers it, waiting
	 * for room as it does for its own. */
	uint8_t is_answer;
	/* Process mode: a job its worker process was sent and will not run
	 * (isolate_loop.c, ap_iso_revoke): its message moved to another worker,
	 * and it only waits in the mailbox, out of the depth, for the child
	 * to hand it back. */
	uint8_t revoked;
	/* An ask's: where its answer goes (it holds the route's hold until
	 * it is answered). A tell's: none. */
	ap_route route;
	uint32_t head_len; /* asks: the route's head bytes (distribution: the reply frame's, ap_encode_reply_head) */
	uint32_t msg_len;  /* the message: a binary's bytes, or 131 + term */
	uint32_t addr_len; /* asks: the route's address bytes (distribution: the caller's node, NUL included) */
	uint8_t data[];    /* head, message, address */
} ap_job;

/* An ask's route address (see ap_route_ops). */
static inline const char *ap_job_addr(const ap_job *j)
{
	return (const char *)j->data + j->head_len + j->msg_len;
}

/* The producer's fields and the consumer's are on cache lines of their
 * own: on one line, every push and every pop took it from the other core
 * (the push was two fifths of the loop's time under a tell flood). */
typedef struct ap_mbox {
	alignas(64) ap_job *tail; /* producer: the last job */
	_Atomic uint64_t enq;
	alignas(64) ap_job *head; /* consumer: the dummy before the first job */
	_Atomic uint64_t deq;
	/* Jobs the consumer is done with go back to the producer, which
	 * reuses them: malloc on one thread and free on another would fight
	 * over the allocator's arena lock on every message. */
	ap_job *_Atomic recycled;
} ap_mbox;

int ap_mbox_init(ap_mbox *m);
void ap_mbox_push(ap_mbox *m, ap_job *j);
ap_job *ap_mbox_pop(ap_mbox *m);
void ap_mbox_done(ap_mbox *m);
void ap_mbox_destroy(ap_mbox *m);
ap_job *ap_job_alloc(ap_mbox *m, ap_job **cache, size_t need);
void ap_job_free_list(ap_job *j);

static inline int ap_mbox_empty(ap_mbox *m) { return atomic_load(&m->head->next) == NULL; }

static inline uint64_t ap_mbox_depth(ap_mbox *m)
{
	uint64_t e = atomic_load_explicit(&m->enq, memory_order_relaxed);
	uint64_t d = atomic_load_explicit(&m->deq, memory_order_relaxed);
	return e > d ? e - d : 0;
}

/* ---- pools and workers --------------------------------------------------- */

enum exit_reason { EXIT_STOP, EXIT_CRASH, EXIT_INIT_FAILED };

/* Why a worker was lost (stats: crash_causes): a worker process killed by
 * a signal or exiting, a handler over handler_timeout_ms (a process-mode
 * worker killed, or a thread-mode one marked hung), a handler that
 * returned AP_HANDLER_CRASH. */
enum ap_crash_cause { AP_CRASH_SIGNAL, AP_CRASH_EXIT, AP_CRASH_TIMEOUT, AP_CRASH_HANDLER, AP_CRASH_CAUSES };

/* The watchdog's verdict on a worker (watchdog.c; ap_worker.wd_state): it
 * serves; stalled (over stall_ms: skipped by routing); hung (thread mode,
 * over handler_timeout_ms: answered by the loop, skipped); killed
 * (process mode, over handler_timeout_ms: its process was killed). */
enum { W_RUNNING, W_STALLED, W_HUNG, W_KILLED };

struct ap_iso;
struct ap_atomset;
typedef struct ap_worker ap_worker;

/* Why a worker process could not serve (sandbox.h, ISO_FAIL_*): the start's
 * error ({plugin_load_failed, Path, Why}, {abi_mismatch, Got, Want},
 * {sandbox_failed, Layer, Why}, else {handler_init_failed, Code}). */
struct ap_init_fail {
	int kind, num;
	char layer[16], why[256];
};

struct ap_worker {
	ap_pool *pool;
	const ap_worker_ops *ops;  /* its kind (below) */
	int id;
	int gen;                   /* incarnation of this slot: names its thread */
	pthread_t th;
	int thread_live;           /* started and not joined */
	ap_mbox mb;
	_Atomic int alive;         /* routing skips a slot waiting for its replacement, in its init, or stalled */
	_Atomic int sleeping;      /* its doorbell (a private futex): 1 while it may sleep */
	_Atomic int stop;
	/* Thread mode: the loop's hold on the mailbox of a worker busy in
	 * its handler (worker_thread.c, the watchdog's claim), CLAIM_*. By stop: the worker
	 * reads it after each message, from a line it reads anyway. */
	_Atomic int claim;
	int wake_pending;          /* loop: jobs pushed since the last wake pass */
	int wake_ask;              /* loop: an ask among them (a coalescing proxy wakes for it) */
	ap_job *job_cache;         /* loop: recycled jobs taken back, not yet reused */
	/* The worker's per-message counters: off the loop's line above. */
	alignas(64) _Atomic uint64_t processed, errors, crashes;
	_Atomic uint64_t crash_by[AP_CRASH_CAUSES];
	/* How long its handler took on asks (stats' handler_time): added by its
	 * worker thread alone (one writer: no locked add); in process mode,
	 * what its worker processes counted, taken from their channel by
	 * ap_iso_harvest (under the slot's lock: one writer too). */
	ap_hist run_ns;
	/* Process mode (isolate.h): the slot's channel to its worker process,
	 * made once on the loop before the first start and kept until
	 * pool_free, so the loop may always ring it; NULL in thread mode. */
	struct ap_iso *iso;
	_Atomic int os_pid;        /* the worker process; 0 when there is none */
	/* Thread mode: how many messages the worker took from its mailbox,
	 * one more than its done count (the mailbox's deq) while it is on
	 * one. Stored after the pop: the loop that sees it sees the pop
	 * (worker_thread.c, claim). */
	_Atomic uint64_t popped;
	enum exit_reason exit_reason;
	int init_rc;
	struct ap_init_fail init_fail; /* process mode: what its process said of a failed start */
	/* loop thread only */
	/* The watchdog (watchdog.c): the done count it saw last, since when
	 * (ap_mono_ms) the worker has been on the message then at its head
	 * (0: idle), its verdict (W_*), the worker's stalls, and the
	 * mailbox's enq after the last move of a stalled worker's queue
	 * (another is tried when more came, or when it could not be made). */
	uint64_t wd_deq, wd_enq;
	int64_t wd_since;
	int wd_state, wd_retry;
	uint64_t stalls;
	uint64_t restarts;
	int streak;                /* crashes since the slot was last stable */
	int64_t started_ms;
	int next_restart_ms;
	int restart_pending;
	/* worker thread only, or the loop while it runs a job inline (below) */
	actor_pool_reply reply;
	ap_buf out;
	void *state;               /* the handler's, from init */
	_Atomic int crash_pending; /* an inline run crashed: the thread exits as if it had */
	/* reply.c's check of the handler's terms (as reply and out); last:
	 * over a kilobyte, touched by term and atom replies only. */
	ap_term_strict check;
};

/* throughput_10s's window, seconds (its name says it). */
#define AP_TP_WINDOW_S 10

struct ap_pool {
	ap_node *n;
	ap_proc *proc;             /* NULL once stopped */
	erlang_pid pid;
	char name[MAXATOMLEN_UTF8];
	char handler_desc[64];
	char *spec;                /* process mode: the built-in's name or the plugin's path */
	const actor_pool_handler *h;
	void *dl;
	uint8_t *config;
	size_t config_len;
	ap_pool_opts o;
	ap_worker *w;
	uint64_t rr, rng;
	uint64_t overloaded, dropped_tells;
	uint64_t by_dist, by_ring;  /* messages received (tells + asks) per ingress */
	int stopping;
	int freeing;
	int threads;               /* worker threads not yet joined */
	int timers;                /* restart timers not yet fired */
	int starting;              /* workers whose first init has not reported */
	int init_failed;           /* the first failing init code, 0 if none */
	struct ap_init_fail init_fail; /* ... and what its worker process said of it */
	ap_pending_reply *start_reply;
	int64_t started_ms;
	/* processed, sampled once a second (ap_pool_tick): the last
	 * AP_TP_WINDOW_S seconds' samples, a ring, for throughput_10s */
	struct {
		uint64_t processed;
		int64_t ms;
	} tp[AP_TP_WINDOW_S + 1];
	unsigned tp_head, tp_n;
	ap_buf scratch;            /* reply heads built by the loop */
	int inline_ok;             /* jobs may run on the loop (ap_pool_run_inline) */
	uint64_t inline_runs;      /* ... and so many did */
	ap_hist inline_ns;         /* ... and how long they took (the loop's alone) */
	int *wake_list;            /* workers with jobs pushed but not yet woken */
	int nwake;
	/* reply.c, any thread that answers: the atoms the pool's replies
	 * carried (max_reply_atoms), the replies refused, whether one was
	 * logged. */
	struct ap_atomset *atoms;
	_Atomic uint64_t bad_replies;
	_Atomic int bad_reply_logged;
	struct ap_pool *next;
};

static inline int ap_worker_alive(ap_worker *w) { return atomic_load_explicit(&w->alive, memory_order_relaxed); }

static inline uint64_t ap_xorshift(uint64_t *s)
{
	uint64_t x = *s;
	x ^= x << 13;
	x ^= x >> 7;
	x ^= x << 17;
	return *s = x;
}

static inline void ap_worker_count_crash(ap_worker *w, enum ap_crash_cause c)
{
	atomic_fetch_add(&w->crashes, 1);
	atomic_fetch_add(&w->crash_by[c], 1);
}

/* pool.c: a worker (thread, or a process-mode proxy) ran its init (ready:
 * routing takes it from then on), or is gone and joinable (exited): on the
 * loop, through ap_node_call_on_loop. */
void ap_pool_worker_ready(ap_node *n, void *arg);
void ap_pool_worker_exited(ap_node *n, void *arg);

/* ---- worker kinds -----------------------------------------------------------
 * Where a slot's handler runs: in a thread of the pool node
 * (ap_worker_threads, worker_thread.c), or in a worker process that a
 * proxy thread drives (ap_worker_processes, isolate*.c). The kind is
 * chosen when the pool starts (pool.h); the rest of the pool reaches a
 * worker only through it, never a kind by name. Loop thread, unless said;
 * NULL where a kind has nothing to do. */
struct ap_worker_ops {
	/* The slot made, once before its first start, and freed with its
	 * pool; the slot's thread (pthread_create's function: it reports
	 * ready and exited through ap_node_call_on_loop); that thread
	 * joined, before anything else reads the mailbox. */
	int (*slot_init)(ap_worker *w);
	void (*slot_free)(ap_worker *w);
	void *(*main)(void *w);
	void (*exited)(ap_worker *w);
	/* The doorbell, any thread: jobs were pushed (`ask`: an ask among
	 * them), or `always` (a stop). A batched route's tell handed to the
	 * worker with no job (1), or 0: a job is made as for any. Room made
	 * in a full mailbox, if the kind can. */
	void (*wake)(ap_worker *w, int always, int ask);
	int (*post_tell)(ap_worker *w, const char *msg, int msg_len, int is_binary);
	void (*reclaim)(ap_worker *w);
	/* The watchdog (watchdog.c): w has been on one message past stall_ms
	 * (it is stalled, ap_wd_stalled, and what is queued behind that
	 * message moves to the others: how many moved, -1 if that must wait,
	 * AP_WD_NOT_STALLED if w is out of it after all); what is queued
	 * behind a stalled or hung worker's message moves (how many, or -1:
	 * not now); w has been on the message after `deq` done past
	 * handler_timeout_ms. */
	long long (*stall)(ap_worker *w);
	long long (*move_queue)(ap_worker *w);
	void (*overtime)(ap_worker *w, uint64_t deq);
	/* Stats, any thread: what the worker counted elsewhere (a worker
	 * process's handler times) taken into w; the sandbox layers its
	 * worker runs in (sandbox.h, AP_SBL_*). */
	void (*harvest)(ap_worker *w);
	uint32_t (*sb_layers)(ap_worker *w);
};

/* worker_thread.c, the thread's doorbell: it sleeps when its mailbox is
 * empty (any push wakes it: ap_worker_wake). */
ap_job *ap_worker_next_job(ap_worker *w);

static inline void ap_worker_wake(ap_worker *w, int always, int ask) { w->ops->wake(w, always, ask); }

/* ---- dispatch.c: the one way from an ingress to a worker -----------------
 * An ingress (distribution: dist_ingress.c; same-host rings:
 * dataplane/node/ring_ingress.c) decodes what it receives into
 * ap_requests, counts them (by_dist, by_ring), passes each to
 * ap_pool_dispatch, and calls
 * ap_pool_wake_pushed once it has dispatched all it holds (a message, a
 * batch, a drained ring), so a worker is woken once per batch, not per
 * job. Loop thread only. Routing, overload (an ask answered
 * {error, overloaded}, a tell counted in dropped_tells) and the copy into
 * the worker's job happen here, the same for every ingress; the answer
 * goes back by the request's route. */
typedef enum { AP_REQ_TELL, AP_REQ_ASK } ap_req_kind;

typedef struct ap_request {
	ap_req_kind kind;
	/* Its ingress's route: ops always (a tell's for batched); an ask's
	 * answer goes by it, with its hold (the job keeps it, or the loop's
	 * answer releases it). */
	ap_route route;
	const char *head;         /* ask: the route's head bytes, copied into the job */
	uint32_t head_len;
	const char *addr;         /* ask: the route's address bytes, copied into the job */
	uint32_t addr_len;
	const char *msg;          /* what the handler gets */
	int msg_len;
} ap_request;
/* msg is an encoded term without the 131 byte, validated whole by the
 * ingress (the ap_term walk) over bytes it bounds: nothing here checks it
 * again. */
void ap_pool_dispatch(ap_pool *p, const ap_request *rq);
/* A message as a handler gets it, from a request's msg (a term without
 * its 131 byte): a binary's own bytes, after its 5-byte head, or 131 and
 * the term. Its length, and the bytes written to d. */
static inline size_t ap_msg_body_len(int msg_len, int is_binary)
{
	return is_binary ? (size_t)msg_len - 5 : (size_t)msg_len + 1;
}

static inline void ap_msg_body_copy(uint8_t *d, const char *msg, int msg_len, int is_binary)
{
	if (is_binary) {
		memcpy(d, msg + 5, (size_t)msg_len - 5);
	} else {
		d[0] = 131;
		memcpy(d + 1, msg, (size_t)msg_len);
	}
}

/* w, on its pool's list for the wake pass at the end of this message or
 * read (ap_pool_wake_pushed); ask: an ask is among what it got. */
void ap_pool_wake_later(ap_worker *w, int ask);
void ap_pool_wake_pushed(ap_pool *p);
/* ap_pool_wake_pushed for every pool with jobs pushed (pool.c). */
void ap_pool_wake_all_pushed(void);
/* pool.c: every pool, in start order (p->next), the stopped ones among
 * them until they are freed. Loop thread. */
ap_pool *ap_pool_all(void);

/* Inline runs (dispatch.c): in thread mode, a built-in handler's message
 * (echo, json_validate: short, never blocking, never crashing the node),
 * routed to a worker that sleeps with an empty mailbox, runs on the loop
 * itself, on that worker's state, counted as that worker's: the worker
 * cannot touch its state until the loop pushes it a job, and the wake-up
 * it would cost is most of a small message's price on a host where a
 * sleep and a wake cost 10 us. Bounded per drain (AP_INLINE_BUDGET_US, the
 * clock read per 4 KiB run) and by size, so the loop's other work never
 * waits long; past that,
 * messages go to the workers as before. */
#define AP_INLINE_MAX_BYTES 16384
#define AP_INLINE_BUDGET_US 200
int ap_pool_can_inline(ap_pool *p, ap_worker *w, int msg_len);
void ap_pool_run_inline(ap_worker *w, ap_job *j);
/* The end of a batched route's batch (ap_pool_wake_all_pushed): the next
 * inline run starts a new budget. */
void ap_pool_inline_reset(void);

/* For moving jobs that are already made (a crashed worker's). */
ap_worker *ap_pool_route(ap_pool *p);
void ap_pool_push(ap_worker *w, ap_job *j);
/* Loop thread: a copy of j in the mailbox of a live worker other than
 * `from` (its route's hold moves with it); 0, or -1 (no memory: j is
 * lost, and its route dropped). */
int ap_pool_move_job(ap_pool *p, ap_worker *from, const ap_job *j);
/* Loop thread: whether a worker other than w serves. */
int ap_pool_others_alive(ap_pool *p, ap_worker *w);

/* ---- watchdog.c ---------------------------------------------------------------
 * The watchdog's barriers: a full memory barrier run on every thread of
 * the pool node (threads), or on every worker process that registered for
 * it (children: isolate_child.c), by membarrier(2). 0, or -1 where the
 * kernel has none: the workers of that kind then fence after each message
 * themselves (threads: ap_pool_fence_each). Their init:
 * ap_pool_barriers_init (pool.h). */
int ap_pool_barrier_threads(void);
int ap_pool_barrier_children(void);
extern int ap_pool_fence_each;
/* Loop thread: one look at w (pool.c's timer, every ap_wd_period ms). */
void ap_wd_watch(ap_pool *p, ap_worker *w, int64_t now);
int ap_wd_period(const ap_pool *p);
/* For the kinds' stall and move_queue: w is stalled (routing skips it
 * until its message is done); what is queued behind its message moves
 * through its kind (ops->move_queue), if another worker serves. */
#define AP_WD_NOT_STALLED (-2LL)
void ap_wd_stalled(ap_worker *w);
long long ap_wd_move_queue(ap_pool *p, ap_worker *w);

/* ---- reply.c: answers ------------------------------------------------------
 * Every answer a pool makes leaves here, by its job's route. */
int ap_pool_reply_reserve(actor_pool_reply *r, size_t more);
void ap_pool_set_atom_reply(actor_pool_reply *r, const char *atom);
/* The answer to the ask j: {Status, r}, from w's thread, or (AP_ANSWER_NOWAIT)
 * from the loop running j itself: -EAGAIN when its route has no room now
 * (the answer is in w->out then, j's hold still held); 0 otherwise, j's
 * hold released. r is the handler's: checked (a reply the receiving node
 * would refuse, or past the pool's atom budget, becomes {error,
 * bad_reply}); with AP_ANSWER_OWN the pool's own, not checked. */
enum { AP_ANSWER_OWN = 1, AP_ANSWER_NOWAIT = 2 };
int ap_answer(ap_worker *w, const ap_job *j, const char *status, actor_pool_reply *r, int how);
/* {error, Reason}, the pool's own, from w's thread. */
void ap_answer_error(ap_worker *w, const ap_job *j, const char *reason);
/* An answer made already (an is_answer job), by w or the loop: as
 * ap_answer's send. */
int ap_answer_made(ap_worker *w, ap_job *j, ap_send_mode mode);
/* Loop thread: {error, Reason} without a worker, never waiting, to a route
 * (its head and address bytes): of a request no job was made for, or of a
 * job. The route's hold is released. */
void ap_answer_loop(ap_pool *p, const ap_route *r, const void *head, size_t head_len, const char *addr,
		    const char *reason);
static inline void ap_answer_loop_job(ap_pool *p, const ap_job *j, const char *reason)
{
	ap_answer_loop(p, &j->route, j->data, j->head_len, ap_job_addr(j), reason);
}
/* Loop thread: answer the start request once every worker ran its init. */
void ap_pool_answer_start(ap_pool *p, int ok);

/* A message as a handler sees it (j's), and w's reply buffer made ready
 * for its answer. */
static inline actor_pool_request ap_job_request(ap_worker *w, const ap_job *j)
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

/* A message the handler ran: processed, and an error if it refused. */
static inline void ap_worker_count_done(ap_worker *w, actor_pool_status st)
{
	atomic_fetch_add_explicit(&w->processed, 1, memory_order_relaxed);
	if (st != AP_HANDLER_OK)
		atomic_fetch_add_explicit(&w->errors, 1, memory_order_relaxed);
}

/* stats.c: the map that '$ap_stats' answers; the throughput sample, once a second. */
void ap_pool_encode_stats(ap_pool *p, ei_x_buff *x);
void ap_pool_stats_tick(ap_pool *p, int64_t now);

#endif
