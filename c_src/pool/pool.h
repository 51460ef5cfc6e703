/* pool: stateless worker pools inside the pool C node. A pool is a C-node
 * process (a pid, and a registered name) that routes each message to one of
 * N workers, each with its own bounded mailbox. Loop thread only, except
 * where noted. Inside (pool_int.h): the files of a pool, and
 * ap_pool_dispatch, the one entry from any ingress to the workers. */
#ifndef AP_POOL_H
#define AP_POOL_H

#include <stdint.h>

#include "actor_pool_handler.h"
#include "ap_node.h"
#include "sandbox.h"

typedef enum { AP_ROUTE_ROUND_ROBIN, AP_ROUTE_SMALLEST_MAILBOX, AP_ROUTE_RANDOM } ap_routing;
/* Where a worker runs its handler: a thread of the pool node, or a child
 * process of it (isolate.h) that a crash takes down alone. */
typedef enum { AP_ISO_THREAD, AP_ISO_PROCESS } ap_isolation;

/* The defaults of stall_ms, and of handler_timeout_ms in process mode
 * (thread mode's is 0: a thread cannot be killed, so a timeout frees no
 * worker). actor_pool_opts fills in the same before it asks. */
#define AP_POOL_DEFAULT_STALL_MS 1000
#define AP_POOL_DEFAULT_PROCESS_TIMEOUT_MS 5000

typedef struct ap_pool_opts {
	int workers;             /* 1..1024; 0 = the host's online CPUs (4 if unknown) */
	ap_routing routing;
	uint32_t mailbox_limit;  /* messages per worker */
	int backoff_min_ms, backoff_max_ms;
	double jitter;           /* 0..1: a restart delay is scaled by U(1 - jitter, 1) */
	int stable_ms;           /* a replacement alive this long resets the backoff */
	ap_isolation isolation;
	int handler_timeout_ms;  /* 0: none; else a message running longer is answered {error, handler_timeout} */
	int stall_ms;            /* 0: off; else a worker busy on one message this long is skipped by routing and
				  * the messages queued behind it move to the others (watchdog.c) */
	int max_memory_mb;       /* process mode: RLIMIT_DATA of each worker process (and its cgroup's limit); 0: none */
	ap_sandbox_opts sandbox; /* process mode: what a worker process may do (sandbox.h) */
	uint32_t max_reply_atoms; /* distinct atoms the pool's replies may carry (reply.c) */
} ap_pool_opts;

typedef struct ap_pool ap_pool;

/* The kinds of workers (pool_int.h, ap_worker_ops): threads of the pool
 * node (worker_thread.c), and worker processes (isolate.h). */
typedef struct ap_worker_ops ap_worker_ops;
extern const ap_worker_ops ap_worker_threads, ap_worker_processes;

/* Where the answer to a start goes once every worker has run its init:
 * a reply head made by ap_encode_reply_head and the caller's node. */
typedef struct ap_pending_reply {
	ap_buf head;
	char node[MAXATOMLEN_UTF8];
} ap_pending_reply;

void ap_pool_opts_default(ap_pool_opts *o);
/* Start a pool. `spec` names the handler for worker processes (process
 * isolation): a built-in's name or a plugin's path, copied; each worker
 * process loads it itself. h/dl/config are owned by the pool from here on (dl may be
 * NULL for built-ins). What the pool node plugs in, so that the pool's
 * core names neither: `kind`, its workers' (as o->isolation says), and
 * `ingress`, its process's function (the distribution ingress,
 * dist_ingress.c's ap_pool_process). On success the answer {ok, Pid} or
 * {error, ...} goes to `reply` (may be NULL) when the workers are up;
 * returns 0. On an immediate failure returns -EEXIST (name taken) or
 * -ENOMEM and frees nothing of h/dl/config. */
int ap_pool_start(ap_node *n, const char *name, const char *handler_desc, const char *spec,
		  const actor_pool_handler *h, void *dl, const uint8_t *config, size_t config_len, const ap_pool_opts *o,
		  const ap_worker_ops *kind, ap_proc_fn ingress, ap_pending_reply *reply);
/* Loop thread, once, before the first pool starts: the watchdog's
 * barriers (membarrier(2), where the kernel has it). */
void ap_pool_barriers_init(void);
/* Stop: the name is free at once; queued asks get {error, stopped}. */
void ap_pool_stop(ap_node *n, ap_pool *p);
ap_pool *ap_pool_find(ap_node *n, const char *name, const erlang_pid *pid);
/* Loop thread: a count that moves whenever a pool starts or stops (never 0),
 * so what ap_pool_find answered may be kept while it stays. */
uint64_t ap_pool_generation(void);
/* Encode [{Name, Pid}] of live pools, in start order. */
int ap_pool_encode_list(ei_x_buff *x);
/* dist_ingress.c: the pool process's function (ap_pool_start's ingress):
 * what a pool receives by distribution, dispatched. */
void ap_pool_process(ap_node *n, ap_proc *self, const ap_msg *m);
/* The node's dead letters (ap_dead_letter_fn): a message to a name or
 * pid with no pool. Its tells are counted (ap_pool_no_pool), the asks of a
 * batch answered {error, noproc}. */
int ap_pool_dead_letter(ap_node *n, ap_proc *self, const ap_msg *m, const char *peer, const char *toname);
/* Loop thread: `tells` tells from `peer` found no pool: to `name` (name_len
 * bytes; logged once per name) or to `pid` (logged, rate-limited; NULL:
 * the caller logs). */
void ap_pool_no_pool(const char *peer, const char *name, size_t name_len, const erlang_pid *pid, uint64_t tells);
/* Tells to a name or pid with no pool so far (node_stats no_pool_tells). */
uint64_t ap_pool_no_pool_tells(void);
/* Once a second: throughput. */
void ap_pool_tick(ap_node *n, void *arg);

#endif
