/* isolate_node: the pool node's end of a worker process's channel, what
 * its three files share (isolate.c says how they divide the work): the
 * slot's state, and the steps more than one of them takes. Pool node
 * only; the child's side is isolate_child.c (isolate_int.h).
 *
 * Who touches what: the send state (cursor, sequence numbers, bare tells,
 * the request ring) is the proxy's while it is awake and holds send_mu;
 * asleep in its main loop it lets go of it with direct_ok up, and the
 * loop may take its turn (isolate_loop.c). The results ring is read by
 * whoever holds send_mu, one record at a time; a result half taken in
 * (got) is the proxy's to finish.
 */
#ifndef AP_ISOLATE_NODE_H
#define AP_ISOLATE_NODE_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>

#include "ap_ring.h"
#include "isolate.h"
#include "isolate_int.h"
#include "pool_int.h"
#include "sandbox.h"

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
	/* Tells published and not rung (iso_send_commit), since when. */
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
/* ---- isolate.c -------------------------------------------------------------------- */

/* The slot: its channel made once, before its first start, and freed with
 * its pool (loop); its children's handler times taken in (any thread);
 * its sandbox's layers (stats/1: the first slot's). */
int ap_iso_slot_init(ap_worker *w);
void ap_iso_slot_free(ap_worker *w);
void ap_iso_harvest(ap_worker *w);
uint32_t ap_iso_sb_layers(ap_worker *w);
/* A result record the proxy must not believe (the child broke its
 * channel). */
int iso_result_bad(const ap_iso *s, const struct iso_rec *h, size_t chunk);
/* The oldest message out is a bare tell; ... is done with; the oldest
 * message out was revoked. */
int iso_front_bare(const ap_iso *s);
void iso_take_bare(ap_worker *w);
int iso_front_revoked(const ap_iso *s, ap_worker *w);
/* The ok tells the child finished up to seq upto leave the mailbox; -1 if
 * one of them is an ask. */
int iso_take_done(ap_worker *w, uint64_t upto, int *progress);
/* Sending: what is queued after the cursor, while the request ring has
 * room (1 if anything went, -1 if the ring broke); publishing (and ringing
 * for an ask, or a batch of tells); the tells held back rung now; the
 * record the next send needs (0: nothing waits). */
int iso_send_jobs(ap_worker *w);
int iso_send_commit(ap_iso *s, int ask, unsigned n);
void iso_ring_held(ap_iso *s);
size_t iso_next_need(ap_iso *s);
/* Reaping (loop thread, ap_iso_reap; iso_reap_cb posted to it) and the
 * kill of a slot's child. */
void ap_iso_reap(ap_worker *w);
void iso_reap_cb(ap_node *n, void *arg);
void iso_kill(ap_iso *s);
/* Proxy thread: a new child for the slot (its channel made afresh). 0 or
 * -errno. */
int iso_spawn(ap_worker *w);

/* ---- isolate_loop.c ----------------------------------------------------------------- */

/* Any thread: wake the slot's proxy (jobs were pushed, `ask` among them;
 * stop). */
void ap_iso_wake(ap_worker *w, int always, int ask);
/* Loop thread, for a slot whose mailbox is at its limit: take the ok
 * tells its child has finished off the mailbox, if its proxy sleeps (they
 * wait there for the next send, which a full mailbox holds off). */
void ap_iso_reclaim(ap_worker *w);
/* Loop thread: while `looks` is 1, the loop takes the results of this
 * slot's child itself when its proxy sleeps (answers to asks of batched
 * routes, the rings', published with the loop's own at the end of its
 * read), so neither the child nor the proxy wakes for them; whatever it
 * cannot take without waiting (a crash, a large answer, one by another
 * route, a route with no room) it leaves to the proxy and rings it. With
 * `looks` 0 (the loop is about to sleep) it takes what is there once more
 * after lowering the flag. Its flags (isolate.h): AP_ISO_TOOK if it
 * answered anything, AP_ISO_ASKS_OUT if the child still holds an ask the
 * loop sent it, AP_ISO_PROXY if the proxy is awake or was left something
 * to send. */
int ap_iso_take_direct(ap_worker *w, int looks, int cpu);
/* Loop thread: how often w's live worker process moved to the loop's CPU
 * (isolate_child.c, follow_loop); 0 without one. */
unsigned ap_iso_follows(ap_worker *w);
/* Loop thread: a tell of a batched route straight into w's worker
 * process's request ring, with no job (1), or 0: make a job as before. The
 * caller puts w on its wake list, whose pass publishes it. */
int ap_iso_send_tell(ap_worker *w, const char *msg, int msg_len, int is_binary);
/* Loop thread, w stalled (watchdog.c) and skipped by routing:
 * the jobs queued behind the message its child is on move to the other
 * workers (ap_pool_move_job), and so do those the child was sent and has
 * not started, which it then hands back unrun. How many moved, or -1 when
 * the proxy is awake (try again later). */
long long ap_iso_revoke(ap_worker *w);
/* Loop thread: w's child has been on one message, the one after `deq`
 * done, past handler_timeout_ms: kill it (its proxy answers that message
 * handler_timeout). 1 if a kill was sent. */
int ap_iso_timeout(ap_worker *w, uint64_t deq);
/* Loop thread, once w's proxy has exited: the bare tells its child had not
 * finished become jobs in w's mailbox, in order. */
void ap_iso_rehydrate(ap_worker *w);

/* ---- isolate_proxy.c ---------------------------------------------------------------- */

/* The proxy thread's function (pthread_create). */
void *ap_iso_proxy_main(void *arg);

#endif
