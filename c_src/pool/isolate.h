/* isolate: workers in child processes (pool option isolation => process).
 *
 * Each worker slot of a process-mode pool keeps its thread in the pool node
 * (the proxy) and its mailbox, exactly as in thread mode: routing, overload,
 * moving a dead worker's queue and the answers are the same code. What
 * changes is who runs the handler: the proxy forwards each job to a child
 * process (this same executable, started with --isolated-worker) through a
 * pair of rings (c_src/ring/ap_ring.h) in a sealed memfd that belongs to
 * the slot, and turns the child's results into the usual answers.
 *
 *   proxy thread (pool node)                child process
 *   mailbox -> req ring  ----------------->  handler (init, handle, terminate)
 *   answers <- rsp ring  <-----------------
 *
 * Jobs stay in the mailbox until their result arrives (a cursor walks past
 * the ones sent: the proxy's, or the loop's while the proxy sleeps), so
 * when the child dies the job it was running is answered {error,
 * {worker_crashed, Cause}} and every job behind it is still queued: the
 * loop moves them as it does a crashed thread's. A tell that ran ok has
 * no result record: the child's done_seq covers it, and it leaves the
 * mailbox in the proxy's pass or, while the proxy sleeps, in the loop's
 * (take_done_direct: as it sends, or routes to a full mailbox).
 * One exception: a tell of a batched route (a same-host ring's) that finds
 * everything before it already sent, while the proxy sleeps, is written
 * by the loop straight into the request ring with no job (a bare tell,
 * ap_iso_send_tell). Its record is then the only copy, so the child maps
 * the ring's data read-only, and after a death the bare tells it had not
 * started become jobs in the mailbox again (ap_iso_rehydrate) before
 * anything moves them.
 *
 * Deaths are seen by the loop: SIGCHLD is blocked in every thread of the
 * pool node and read from a signalfd (ap_node_add_reader); the loop reaps
 * each slot's child through its pidfd (waitid P_PIDFD), which also makes
 * every signal we send (timeouts, stop) safe from pid reuse. The child
 * dies with its proxy thread (PR_SET_PDEATHSIG), so no worker outlives the
 * pool or the node.
 */
#ifndef AP_ISOLATE_H
#define AP_ISOLATE_H

#include <stdatomic.h>
#include <stdint.h>

#include "ap_hist.h"

/* The head of a slot's channel (4 KiB), then the handler spec and config,
 * then the request ring (proxy -> child) and the result ring. Here rather
 * than in isolate_node.h for the tests' hostile worker (c_src/test/
 * plugin_hostile.c), which scribbles on it as a broken plugin would. */
/* Line-sized groups: the child writes one, the proxy the other. */
struct iso_ctl {
	uint64_t magic;
	uint32_t size, req_off, rsp_off, req_size, rsp_size;
	uint32_t spec_off, spec_len, cfg_off, cfg_len; /* the handler spec (NUL-terminated) and its config */
	int32_t max_memory_mb;
	uint32_t worker;
	uint32_t workers;        /* the pool's worker count (isolate_child.c, follow_loop) */
	uint32_t sb_off, sb_len; /* the sandbox section (sandbox.h, struct iso_sandbox, then its paths) */
	uint8_t pad0[128 - 64];
	/* the child's */
	_Atomic uint32_t init_state; /* 0 starting, 1 ready, 2 init failed */
	int32_t init_rc;
	/* The message being handled (0: none), stored when its first record
	 * is read, before the child looks at revoke_upto. */
	_Atomic uint64_t running_seq;
	_Atomic uint32_t follows;         /* its moves to the loop's CPU (node_stats; the child's word for it) */
	uint8_t pad1[64 - 20];
	/* The last message finished. A tell that ran with status ok writes
	 * no result record: this word says it is done (stored after the
	 * records of every message before it were published). A line of its
	 * own: the proxy reads it while it waits, running_seq is not. */
	_Atomic uint64_t done_seq;
	uint8_t pad2[64 - 8];
	/* the proxy's doorbell: whoever has news for the proxy (the child, the
	 * loop) bumps it and wakes it when `waiting` is up */
	_Atomic uint32_t proxy_bell, proxy_waiting;
	/* the proxy's, at stop: what the child has not started yet it hands
	 * back unrun (a RESULT with c = 1), to be answered stopped as the
	 * queue of a thread is */
	_Atomic uint32_t stopping;
	/* The loop's, when the worker stalls (isolate_loop.c, ap_iso_revoke):
	 * messages up to revoke_upto that the child had not started by the
	 * loop's barrier it hands back unrun (c = 1); they went to other
	 * workers. revoke_from is the verdict: from there on they were not
	 * started (0 while the loop works it out: a child that meets a
	 * message up to revoke_upto waits for it). */
	_Atomic uint64_t revoke_upto, revoke_from;
	/* the loop's: 1 while it looks at this channel's results itself on
	 * each pass (it is busy with ring traffic and the proxy sleeps), so
	 * the child need not wake the proxy for them (isolate_loop.c,
	 * ap_iso_take_direct). Its Dekker pair: the child publishes, fences,
	 * loads this; the loop stores 0, fences, looks at the results. */
	_Atomic uint32_t loop_looks;
	/* When the pool node last rang the child for new messages (the loop
	 * or the proxy; ap_mono_us): the child, woken, measures from it how
	 * long its wake-ups take, and after an ask waits for the next one
	 * awake only while they are slow (isolate_child.c, ask_wait). Only
	 * the child believes it. */
	_Atomic int64_t rang_us;
	/* The CPU the loop last ran on while it looked at our results
	 * (loop_looks), -1 before: a child whose asks are quick moves there
	 * (isolate_child.c, follow_loop). Only the child believes it. */
	_Atomic int32_t loop_cpu;
	/* The child's, before init_state 2: what failed (ISO_FAIL_* of
	 * sandbox.h), a number (init's code, the ABI found), the sandbox
	 * layer, and why, in words. A report only: the pool node bounds it
	 * and believes nothing else of it. */
	uint32_t fail_kind;
	int32_t fail_num;
	char fail_layer[16];
	char fail_why[256];
	/* The child's, one writer: how long its handler took on asks. The
	 * pool node takes only its growth (isolate.c, ap_iso_harvest). */
	ap_hist run_ns;
};


/* ---- what the rest of the pool node sees of worker processes -------------- *
 * The kind's table is ap_worker_processes (pool.h); the rest is the
 * loop's, over every worker process of every pool, and node_stats'. */

/* ap_iso_take_all's flags: it answered something; a child still holds an
 * ask the loop sent it (the loop may wait for it: iso_await in
 * ring_ingress.c); a proxy is awake or was left something to send. */
enum { AP_ISO_TOOK = 1, AP_ISO_ASKS_OUT = 2, AP_ISO_PROXY = 4 };
/* Loop thread, on every ring read (looks 1) and before it sleeps (0): the
 * loop takes the results of worker processes whose proxies sleep itself
 * (isolate_loop.c, ap_iso_take_direct): their flags, or-ed (a stalled
 * worker's asks out not among them). */
int ap_iso_take_all(int looks);
/* The moves of every live worker process to the loop's CPU (node_stats
 * `iso_follows'). Loop thread. */
unsigned long long ap_iso_follows_all(void);
/* Loop thread, once, before the first pool starts: watch for worker
 * processes that exit (a signalfd in the loop, whose reads reap them).
 * SIGCHLD must be blocked in every thread already (main does it). 0 or
 * -errno. */
struct ap_node;
int ap_iso_watch_children(struct ap_node *n);

/* node_stats: results the loop answered; bare tells sent, and made jobs
 * again after a death. */
unsigned long long ap_iso_loop_results(void);
unsigned long long ap_iso_bare_tells(void);
unsigned long long ap_iso_bare_rehydrated(void);
/* main() of the child, before anything else runs: argv[1] is
 * "--isolated-worker". Never returns. */
int ap_iso_child_main(int argc, char **argv);

#endif
