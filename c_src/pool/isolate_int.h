/* isolate_int: what the two ends of a worker's channel share, the pool
 * node's proxy (isolate*.c) and the child process (isolate_child.c): the
 * channel's constants, its record header, the proxy's doorbell. The head of
 * the channel itself (struct iso_ctl) is in isolate.h.
 */
#ifndef AP_ISOLATE_INT_H
#define AP_ISOLATE_INT_H

#include <stdatomic.h>
#include <stdint.h>
#include <time.h>

#include "ap_ring.h"
#include "ap_time.h"
#include "isolate.h"

#define ISO_MAGIC 0x314f5349504100ULL /* "\0APISO1" */
#define ISO_CTL_SIZE 4096u
/* Per direction; larger messages and results go in chunks. The request
 * ring is the larger: under a flood of tells a full one woke the proxy to
 * send the rest (docs/stateless-workers.md, "A larger request ring").
 * Results are one per ask or refused tell. */
#define ISO_REQ_CAP (512u << 10)
#define ISO_RSP_CAP (128u << 10)
#define ISO_MAX_MSG (1u << 30)     /* a reply, whole (a message is whatever the pool node took in) */
#define ISO_FD 3                   /* where the child finds the channel (its cgroups: sandbox.h) */
#define ISO_SPIN 64                /* rounds before a side sleeps (2 cores: keep it short) */
#define ISO_SPIN_INFLIGHT 2000     /* rounds a proxy with work at its child waits before it sleeps */
#define ISO_RING_BATCH 32          /* tells the proxy holds back from a sleeping child at most */
#define ISO_RESULT_BATCH 256       /* results a busy child writes between rings of the proxy's bell
				    * (an ask's result rings at once when the child has caught up) */
#define ISO_DONE_BATCH 4096        /* ok tells (no record) it finishes between rings: the loop takes
				    * them while it sends (isolate_loop.c, take_done_direct) */
#define ISO_ASK_WAIT_US 20         /* an ask's answer waits at most this long (and the one message
				    * then running) for the batch behind it; none if the ask took it */
#define ISO_RELEASE_BATCH 32       /* messages the child reads before it gives their room back */
#define ISO_BARE_MAX 4096          /* tells in a request ring without a job, at most (isolate_loop.c,
				    * ap_iso_send_tell): about what 512 KiB holds of short ones */
#define ISO_DONE_WAIT_MS 1         /* an idle child rings for ok tells nobody took after this long */
#define ISO_ASK_POLL_US 250        /* after an ask, a child yields this long for the next message before it sleeps */
#define ISO_ASK_POLL_SKIP_MAX 64   /* after windows that found nothing, at most this many waits skip theirs */
#define ISO_WAKE_SLOW_US 40        /* with its wake-ups this late on average, a child waits for asks awake */
#define ISO_WAKE_SAMPLE 32         /* every this many such waits it sleeps, to measure a wake-up */
#define ISO_FOLLOW_WINDOW_US 10000 /* a child weighs its handlers' time over windows this long (follow_loop) */
#define ISO_FOLLOW_MS 10           /* and moves to the loop's CPU at most this often, */
#define ISO_FOLLOW_MAX_MS 1000     /* or this often while the scheduler keeps moving it away */
#define ISO_HOLD_US 100            /* how long the proxy holds back tells (isolate.c, iso_send_commit) */
#define ISO_IDLE_MS 1000           /* a sleeping proxy looks again this often, whatever happens */
#define ISO_REAP_MS 5000           /* how long a proxy waits for its child's exit to be reaped */
#define ISO_STOP_GRACE_MS 500      /* at stop, how long a child may finish the message it runs, */
#define ISO_TERMINATE_MS 500       /* and then run its terminate, before it is killed */

_Static_assert(sizeof(struct iso_ctl) <= ISO_CTL_SIZE, "the channel's head outgrew its page");

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

#if defined(__SANITIZE_ADDRESS__)
#define ISO_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define ISO_ASAN 1
#endif
#endif

/* Gives the room of records read back to the ring's producer every
 * `every` reads (counted in *n), not after each: a release is a fence and
 * a store to the line the producer writes. The caller releases once more
 * when it stops reading. */
static inline void ap_iso_release_every(struct ap_ring *r, unsigned *n, unsigned every)
{
	if (++*n >= every) {
		ap_ring_release(r);
		*n = 0;
	}
}

/* Rung by whoever has news for the proxy (the child, the loop): always, or
 * only when the proxy is about to sleep or sleeping (its Dekker pair is
 * proxy_sleep in isolate_proxy.c). */
static inline void ap_iso_bell(struct iso_ctl *c, int always)
{
	atomic_thread_fence(memory_order_seq_cst);
	if (always || (atomic_load(&c->proxy_waiting) && atomic_exchange(&c->proxy_waiting, 0))) {
		atomic_store(&c->proxy_waiting, 0);
		atomic_fetch_add(&c->proxy_bell, 1);
		ap_ring_futex_wake((uint32_t *)&c->proxy_bell, 1);
	}
}

#endif
