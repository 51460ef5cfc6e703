/* ring_int: what the pool node's side of the data plane shares among its
 * files (ring_ingress.c says how they divide the work): the segment as the
 * node holds it, the node-wide state, and the steps more than one file
 * takes. Pool node only.
 *
 * A segment is reference counted (ap_dp_seg_get/put), and the last
 * reference unmaps it. Who holds one, and where it is taken and dropped:
 *  - the registry's: set at attach (ring_attach.c, step: refs = 2),
 *    carried to the loop by dp_seg_added, dropped by dp_detach;
 *  - the attach thread's socket's: set at attach, dropped when the
 *    thread closes the socket, or carried to the loop by dp_peer_gone;
 *  - an armed io_uring wait's: taken by arm, dropped by fw_done (a
 *    detach cancels the wait first; ring_ingress.c);
 *  - a drain's own, while it runs (drain_seg: a detach inside it drops
 *    the registry's);
 *  - a posted detach's (ring_seg.c: written -> rep_broken) and a deferred
 *    publish's (defer_publish -> publish_deferred);
 *  - each ring ask's route: taken by handle (ring_ingress.c) before it
 *    dispatches the ask, dropped as the ask is answered or dropped
 *    (ring_seg.c: ring_send, ring_drop), on whatever thread answers.
 */
#ifndef AP_RING_INT_H
#define AP_RING_INT_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <sys/un.h>

#include "ap_ring.h"
#include "ap_seg.h"
#include "ap_skip.h"
#include "ap_spin.h"
#include "pool_int.h"

#define DP_MAX_ATTACHING 64  /* handshakes in progress at once */
#define DP_MAX_SEGS 256      /* segments attached at once */
#define DP_WAIT_MS 1000      /* a bell wait's timeout: a hostile peer may never ring */
#define DP_REPLY_WAIT_MS 1000 /* a worker waits this long for room in a full reply ring */
#define DP_IDLE_SPIN_MAX_ROUNDS 200 /* at most this many pause rounds over the segments before the loop sleeps */
#define DP_IDLE_SPIN_HOT_MS 2       /* ... only while records came this recently */
#define DP_IDLE_SPIN_MIN_ROUNDS 8   /* the adaptive spin's first step up (ap_spin.h) */
#define DP_BUDGET 4096       /* records per ring per drain: distribution is not starved */
#define DP_PREFETCH 512      /* bytes of the records ahead fetched while one is handled */
#define DP_ISO_WAIT_US 60    /* how long the loop waits, yielding, for worker processes' answers before a nap */
#define DP_ISO_SKIP_MAX 256  /* after such waits that ran out, at most this many reads wait for none */
#define DP_NAP_MIN 3         /* records waiting for one read that make the traffic dense (dp_idle's nap) */
#define DP_LONE_SKIP_MAX 256 /* after windows that caught nothing, at most this many lone asks open none */
#define DP_LOG_GAP_MS 1000   /* bad-record log lines, at most one per segment per second */
#define DP_DEST_CACHE_MAX 128 /* bytes of a destination that resolve keeps (a pid of a long node name: not) */

struct dp_rep {
	pthread_mutex_t mu;
	struct ap_ring r;
	unsigned sleepers; /* workers waiting for room (under mu, which they do not hold asleep) */
	int stuck;         /* under mu: a wait for room timed out and nothing fit since */
};

struct ap_dp_seg {
	_Atomic int refs;
	_Atomic int dead; /* detached: replies are dropped */
	_Atomic int rep_broken; /* a reply ring broke: the detach is on its way */
	uint32_t id;
	struct ap_ring_map map;
	struct ap_seg s;
	struct ap_ring *req; /* n_req consumer views: loop thread only */
	uint64_t *seen;      /* per request ring: the position released (not the shared head, which the BEAM can write) */
	uint8_t *busy;       /* per request ring: being drained (fences never re-enter it) */
	struct dp_rep *rep;  /* n_rep producer views */
	char peer[AP_SEG_MAX_NAME + 1];
	uint32_t os_pid;
	/* attach thread */
	int sock;
	_Atomic int close_req; /* the loop asks the attach thread to close sock */
	/* loop thread */
	int slot;            /* in the registry; -1 once detached */
	ap_io_futex fw;      /* io_uring: the wait on req_bell */
	int fw_armed;        /* the flag is up and (uring) fw is in flight */
	int64_t last_bad_ms;
	uint64_t bad, dropped_replies;
};

/* The node's side of the data plane: one per pool node. */
struct dp_node {
	ap_node *n;
	int enabled;
	int uring;
	struct sockaddr_un addr;
	socklen_t addr_len;
	char name[sizeof(((struct sockaddr_un *)0)->sun_path)]; /* abstract: name[0] == 0 */
	size_t name_len;
	uint8_t token[AP_SEG_TOKEN_LEN];
	int lfd, efd;
	int bell_fd, bell_tx; /* epoll: the bell pipe's ends, the loop's and the BEAMs' (ap_seg.h, attach step 4) */
	pthread_t th;
	_Atomic int nsegs; /* attached or being handed over: the cap's count */
	uint32_t next_id;
	/* loop thread */
	struct ap_dp_seg *segs[DP_MAX_SEGS];
	int n_live;
	int top;  /* slots at and above this are empty: the idle spin scans below it */
	struct ap_spin spin; /* the idle spin (dp_idle) */
	int64_t hot_until_ms;
	/* The yield instead of sleep (dp_idle): how long after records, when
	 * the last records came, and the gap before them. */
	int poll_us;
	int64_t found_us, gap_us;
	/* After an ask that was its BEAM's only one waiting (req_lone): the
	 * loop yields until lone_until_us (ring_lone_poll_us; 0: no window).
	 * Windows that end with nothing read make later lone asks open none
	 * (ap_skip.h). */
	int lone_us;
	int64_t lone_until_us;
	struct ap_skip lone_skip;
	unsigned long long lone_windows; /* node_stats (relaxed, any thread may read) */
	/* Whether the worker processes were told that the loop takes their
	 * results (iso_pass). */
	int iso_looking;
	/* iso_await: waits that ran out make later ones skip (a slow
	 * handler's answers come after any wait); how many caught every
	 * answer and how many ran out (node_stats; relaxed). */
	struct ap_skip iso_skip;
	unsigned long long iso_waits, iso_waits_missed;
	/* The nap (dp_idle): its length, that after a read with asks, whether
	 * the last read was dense and had asks, whether the segment's read
	 * under way met an ask, how many naps so far and how many of them
	 * after asks (node_stats; relaxed, any thread may read). */
	int nap_us, ask_nap_us;
	int dense, dense_asks;
	int read_asked;
	unsigned long long naps, ask_naps;
	ap_buf copy; /* a record copied out of shared memory */
	/* The last destination resolved, by its bytes (see resolve). */
	struct {
		uint64_t pools_gen; /* ap_pool_generation() then; 0: empty */
		ap_pool *pool;
		uint32_t len;
		uint8_t kind;
		uint8_t bytes[DP_DEST_CACHE_MAX];
	} last;
};
extern struct dp_node ap_dp;

/* ---- ring_seg.c ------------------------------------------------------------------ */

void ap_dp_seg_get(struct ap_dp_seg *sg);
void ap_dp_seg_put(struct ap_dp_seg *sg);
/* Unmaps a segment nobody refers to (or one never registered). */
void dp_seg_free(struct ap_dp_seg *sg);
/* Loop thread: out of the registry, replies dropped, wait cancelled, the
 * socket closed (by the attach thread), the registry's reference dropped. */
void dp_detach(struct ap_dp_seg *sg, const char *why);
/* How a writer meets a full reply ring: a worker waits (once per stuck
 * episode), the loop drops its own error answers, and an inline run
 * (nowait) hears -EAGAIN and hands its answer to the worker. */
enum rep_mode { REP_WORKER, REP_LOOP, REP_NOWAIT };
/* One answer term (no 131) to ask_id into reply ring `ring` (mod the
 * rings); 0, or -EAGAIN (REP_NOWAIT, no room). */
int dp_reply(struct ap_dp_seg *sg, unsigned ring, uint64_t ask_id, const void *term, size_t len,
	     enum rep_mode mode);
/* Loop thread: {error, Reason} to ask_id; never waits (a full ring drops it). */
void ap_dp_reply_error_loop(struct ap_dp_seg *sg, uint64_t ask_id, const char *reason);
/* Loop thread: a read of request rings begins (whether one was under way
 * already) and ends: the answers the loop made meanwhile go out at its
 * end, together. */
int dp_read_begin(void);
void dp_read_end(void);
/* The route a ring ask's answer goes back by (pool_int.h, routes). */
extern const ap_route_ops dp_ring_route;

/* ---- ring_ingress.c (loop thread) ----------------------------------------------- */

/* A segment handed over by the attach thread (it carries the registry's
 * reference); one whose socket closed (it carries the socket's). */
void dp_seg_added(ap_node *n, void *arg);
void dp_peer_gone(ap_node *n, void *arg);
/* epoll: some BEAM wrote the bell pipe. */
void dp_on_bell(ap_node *n, void *arg);
/* The loop's idle hook (ap_node_set_idle). */
int dp_idle(ap_node *n, void *arg);

#endif
