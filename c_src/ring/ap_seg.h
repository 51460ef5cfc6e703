/* ap_seg: the same-host data plane's segment, shared by one BEAM (the NIF,
 * priv/actor_dp.so) and one pool node. It holds the rings of ap_ring.h, two
 * segment-wide doorbells, and the record formats both sides agree on.
 *
 * Who does what.
 *  - The NIF creates the segment (a sealed memfd, ap_ring_map_create_memfd),
 *    formats it (ap_seg_format), and passes it to the pool node over an
 *    AF_UNIX socket (see "Attach" below). The BEAM never maps anything the
 *    pool node created: a sealed memfd cannot be shrunk under its mapping.
 *  - Request rings: n_req of them, one per scheduler of the BEAM. The NIF
 *    is each one's single producer (a thread-local index picks the ring;
 *    a per-ring try-lock in NIF memory guards against two threads sharing
 *    one); the pool node's loop is their single consumer.
 *  - Reply rings: n_rep of them. The pool node is each one's single
 *    producer (its workers take a mutex in pool-node memory per ring; a
 *    worker uses ring worker_index % n_rep); the NIF's reply thread is
 *    their single consumer.
 *
 * Layout: the header (AP_SEG_HDR_SIZE bytes), then n_req request rings of
 * ap_ring_size(req_cap) bytes each, then n_rep reply rings of
 * ap_ring_size(rep_cap) each. Everything is derived from the header's
 * geometry, read once by ap_seg_parse and checked against the mapped size.
 *
 * Doorbells. Every ring has its own bell (ap_ring.h), but a consumer of
 * many rings sleeps on one word: the pool node's loop on `req_bell` (rung by
 * the NIF after it publishes into any request ring), the NIF's reply thread
 * on `rep_bell` (rung by a worker after it publishes into any reply ring).
 * Same protocol as a ring's: the sleeper loads the bell, raises its flag,
 * full fence, re-checks every ring, and only then waits; the producer,
 * after its release store of the tail (ap_ring_publish, not
 * ap_ring_commit), calls ap_seg_notify: full fence, and only if the flag
 * is up takes it down, bumps the bell and wakes. A busy segment costs no
 * syscall per message. Either peer may be hostile to the other: every wait
 * has a timeout, every wake is "look again".
 *
 * `closed`: each side ORs in its bit when it leaves in order (and rings
 * both bells), so a peer blocked on a bell learns it at once; a killed side
 * sets nothing, and its peer learns from the socket (EOF) or, in the BEAM,
 * from the distribution link.
 *
 * Attach (the AF_UNIX socket).
 *  1. The BEAM asks the pool node's manager over distribution
 *     (`{call, Pid, Tag, dp_info}` to actor_pool_manager) and gets
 *     `{ok, #{socket => <<0, Name/binary>>, token => <<_:16/binary>>}}`:
 *     an abstract-namespace socket (no file to clean up) and a random token
 *     drawn at the pool node's start. Distribution carries the cookie's
 *     authentication, so holding the token proves the peer could talk to
 *     the pool node.
 *  2. The NIF connects, writes a struct ap_seg_hello (fixed size, then
 *     name_len bytes of the BEAM's node name), then sends the memfd with
 *     ap_ring_send_fd.
 *  3. The pool node checks SO_PEERCRED (same uid), the hello (magic,
 *     version, token, name_len <= AP_SEG_MAX_NAME), receives the fd, maps it
 *     with ap_ring_map_open_fd (sealed, fully allocated), ap_seg_parse, and
 *     attaches: consumer of every request ring, producer of every reply
 *     ring. It answers one struct ap_seg_ack (status 0, or a positive
 *     errno) and keeps the socket open: EOF on it, either way, means the
 *     peer is gone. Every step has a deadline (AP_SEG_ATTACH_TIMEOUT_MS).
 *  4. A pool node whose loop cannot wait on a futex (the epoll backend)
 *     sends its bell with a status-0 ack (SCM_RIGHTS): the write end of a
 *     pipe whose read end is in the loop's epoll set. The NIF then rings
 *     `req_bell` by writing one byte to it with RWF_NOWAIT
 *     (ap_seg_notify_fd) instead of a futex wake: no thread between (one
 *     wake-up per sleep, not two), and a write that cannot block whatever
 *     the peer does to the pipe's flags. The NIF takes the fd only if it
 *     is a pipe that honours RWF_NOWAIT (probed at attach: kernels whose pipes
 *     do not are refused, and that BEAM uses distribution).
 *
 * Ordering (docs/same-host-transport.md). A request record may carry a
 * fence: "read request ring fence_ring up to index fence_pos first". The
 * NIF sets it when a process's previous submit to this segment went to
 * another ring (the process moved to another scheduler): fence_pos is that
 * ring's tail right after the previous record was published, so those
 * records are committed and the consumer never waits for them; it reads
 * that ring until its read position reaches fence_pos (or the ring is
 * empty: then the fence is stale or hostile, and it goes on). A fence to
 * the record's own ring, or to a ring >= n_req, is ignored. Draining for
 * a fence may meet more fences: the consumer follows them to a bounded
 * depth (AP_SEG_MAX_FENCE_DEPTH), then goes on.
 */
#ifndef AP_SEG_H
#define AP_SEG_H

#include <stddef.h>
#include <stdint.h>

#include "ap_ring.h"

#define AP_SEG_MAGIC 0x3147455350444150ULL /* "PADPSEG1" read little-endian */
#define AP_SEG_VERSION 2u /* 2: the ack may carry the bell pipe */
#define AP_SEG_HDR_SIZE (4u * AP_RING_LINE)
#define AP_SEG_MAX_REQ 1024u /* request rings: schedulers, at most 1024 */
#define AP_SEG_MAX_REP 64u
#define AP_SEG_MAX_BYTES (1ULL << 34) /* 16 GiB: anything bigger is hostile */
#define AP_SEG_MAX_NAME 1024u
#define AP_SEG_ATTACH_TIMEOUT_MS 2000
#define AP_SEG_MAX_FENCE_DEPTH 4

#define AP_SEG_CLOSED_BEAM 1u
#define AP_SEG_CLOSED_NODE 2u

struct ap_seg_hdr {
	/* line 0: immutable once formatted (magic written last, release) */
	uint64_t magic;
	uint32_t version;
	uint32_t hdr_size;
	uint64_t total_size; /* bytes of the whole segment */
	uint32_t n_req, n_rep;
	uint64_t req_cap, rep_cap; /* data bytes of each ring (power of two) */
	uint8_t pad0[AP_RING_LINE - 48];
	/* line 1: the request doorbell (the pool node's loop sleeps on it) */
	uint32_t req_bell;
	uint32_t req_sleeping;
	/* 1 while the BEAM's last record was an ask, the only one it waited
	 * for (a hint, written only when it changes: the loop's yield window
	 * after such an ask is ring_lone_poll_us, ring_ingress.c dp_idle). */
	uint32_t req_lone;
	uint8_t pad1[AP_RING_LINE - 12];
	/* line 2: the reply doorbell (the NIF's reply thread sleeps on it) */
	uint32_t rep_bell;
	uint32_t rep_sleeping;
	uint8_t pad2[AP_RING_LINE - 8];
	/* line 3: who left in order (AP_SEG_CLOSED_*) */
	uint32_t closed;
	uint8_t pad3[AP_RING_LINE - 4];
};

/* The geometry of a parsed segment: private to the side that parsed it,
 * never re-read from shared memory. */
struct ap_seg {
	struct ap_seg_hdr *hdr;
	uint8_t *base;
	size_t size;
	uint32_t n_req, n_rep;
	uint64_t req_cap, rep_cap;
};

/* Bytes a segment of this geometry needs; 0 if the geometry is invalid
 * (counts out of 1..MAX, caps not powers of two within ap_ring's limits,
 * total over AP_SEG_MAX_BYTES). */
size_t ap_seg_size(uint32_t n_req, uint64_t req_cap, uint32_t n_rep, uint64_t rep_cap);

/* Formats header and rings at mem (size bytes, page-aligned; nobody
 * attached). 0 or -EINVAL. */
int ap_seg_format(void *mem, size_t size, uint32_t n_req, uint64_t req_cap, uint32_t n_rep, uint64_t rep_cap);

/* Reads the header once and checks it against size (magic, version,
 * geometry, total_size == ap_seg_size(...) <= size). 0 or -EINVAL. The
 * rings are then attached with ap_ring_attach_* on ap_seg_req / _rep,
 * which check each ring's own header. */
int ap_seg_parse(struct ap_seg *s, void *mem, size_t size);

/* Ring i's memory and its size (for ap_ring_attach_*). */
void *ap_seg_req(const struct ap_seg *s, uint32_t i);
void *ap_seg_rep(const struct ap_seg *s, uint32_t i);
static inline size_t ap_seg_req_size(const struct ap_seg *s) { return ap_ring_size(s->req_cap); }
static inline size_t ap_seg_rep_size(const struct ap_seg *s) { return ap_ring_size(s->rep_cap); }

/* ---- the two segment doorbells ----------------------------------------- */

enum ap_seg_bell { AP_SEG_BELL_REQ = 0, AP_SEG_BELL_REP = 1 };

/* Producer side, after ap_ring_publish on a ring of that direction: wakes
 * the sleeper if its flag is up (one wake per sleep). 1 if it woke. */
int ap_seg_notify(struct ap_seg_hdr *h, enum ap_seg_bell b);
/* The same, ringing through bell (one byte written, RWF_NOWAIT) when
 * bell >= 0: the bell pipe of an epoll pool node (attach, step 4). */
int ap_seg_notify_fd(struct ap_seg_hdr *h, enum ap_seg_bell b, int bell);
/* One byte into a bell pipe, never blocking. */
void ap_seg_ring_pipe(int bell);

/* Sleeper side, steps 1-3: loads the bell into *expected, raises the
 * flag, full fence, and sets *word. The caller then re-checks every ring
 * of that direction: if anything is there, ap_seg_sleep_end and no sleep;
 * else wait on *word while it holds *expected (a futex, or io_uring's
 * FUTEX_WAIT with a linked timeout), then ap_seg_sleep_end. */
void ap_seg_sleep_begin(struct ap_seg_hdr *h, enum ap_seg_bell b, uint32_t **word, uint32_t *expected);

/* For a third party that takes the sleeper's work for a while (the NIF's
 * await/2 for the reply thread): take the flag down, so producers ring
 * nobody meanwhile (1 if it was up), and raise it again after; the caller
 * then looks at the rings once more and kicks if anything is left, as the
 * sleeper may still be asleep. */
int ap_seg_flag_take(struct ap_seg_hdr *h, enum ap_seg_bell b);
void ap_seg_flag_raise(struct ap_seg_hdr *h, enum ap_seg_bell b);
void ap_seg_sleep_end(struct ap_seg_hdr *h, enum ap_seg_bell b);

/* The whole wait for a thread that may block: spins `spin` rounds calling
 * ready(arg), then sleeps (begin, ready?, futex wait, end) until ready(arg)
 * returns > 0 ("something to do"), a side closed the segment
 * (ap_seg_close), or timeout_ms passes (< 0: no timeout; a side that
 * reads a hostile peer's segment passes one). 0 (ready, or closed: check
 * ap_seg_closed), -ETIMEDOUT, or a futex error. A wake-up proves nothing:
 * after one that finds nothing ready it sleeps again, against the same
 * deadline. */
int ap_seg_wait(struct ap_seg_hdr *h, enum ap_seg_bell b, int (*ready)(void *), void *arg, unsigned spin,
		int timeout_ms);

/* Bumps the bell and wakes every sleeper whatever the flag says (closing,
 * tests). */
void ap_seg_kick(struct ap_seg_hdr *h, enum ap_seg_bell b);

/* Marks this side gone (bit AP_SEG_CLOSED_*) and kicks both bells. */
void ap_seg_close(struct ap_seg_hdr *h, uint32_t side);
/* The peer's closed bits, read now. */
uint32_t ap_seg_closed(const struct ap_seg_hdr *h);

/* ---- attach, over the AF_UNIX socket --------------------------------------- */

#define AP_SEG_HELLO_MAGIC 0x50445041u /* "APDP" */
#define AP_SEG_TOKEN_LEN 16

struct ap_seg_hello {
	uint32_t magic;
	uint32_t version; /* AP_SEG_VERSION */
	uint8_t token[AP_SEG_TOKEN_LEN];
	uint32_t name_len; /* bytes of the BEAM's node name that follow, <= AP_SEG_MAX_NAME */
	uint32_t os_pid;   /* the BEAM's, for logs and stats */
};

struct ap_seg_ack {
	uint32_t magic;  /* AP_SEG_HELLO_MAGIC */
	uint32_t status; /* 0, or a positive errno: why the pool node refused */
};

/* ---- records ---------------------------------------------------------------- */

/* A request record's payload: this header, then dest_len bytes of the
 * destination, then msg_len bytes of the message. The payload length is
 * exactly sizeof(struct ap_dp_req) + dest_len + msg_len; anything else is
 * a bad record (skipped with a log line, the ring goes on). */
enum ap_dp_kind {
	AP_DP_TELL = 1,  /* the message to one worker, no answer */
	AP_DP_ASK = 2,   /* the message to one worker; the answer to ask_id */
	AP_DP_STATS = 3, /* no message; the pool's stats map to ask_id */
};
enum ap_dp_dest {
	AP_DP_DEST_NAME = 1, /* the pool's registered name, UTF-8 atom text (1..1020 bytes) */
	AP_DP_DEST_PID = 2,  /* the pool's pid, as an external term without the 131 byte */
};
#define AP_DP_NO_FENCE 0xffffffffu

struct ap_dp_req {
	uint8_t kind;      /* enum ap_dp_kind */
	uint8_t dest_kind; /* enum ap_dp_dest */
	uint16_t dest_len;
	uint32_t msg_len;  /* an external term without the 131 byte (a binary: 109, length, bytes) */
	uint64_t ask_id;   /* ASK, STATS: echoed in the reply; TELL: 0 */
	uint32_t fence_ring; /* AP_DP_NO_FENCE, or the request ring to read up to fence_pos first */
	uint32_t reserved;   /* 0 */
	uint64_t fence_pos;
};

/* A reply record's payload: this header, then len bytes of the answer as
 * an external term without the 131 byte: {ok, R} or {error, R} for an
 * ask, the stats map for STATS. The NIF sends {Ref, Answer} to the asker
 * of ask_id, if that ask is still waiting (not timed out and cancelled). */
struct ap_dp_rep {
	uint64_t ask_id;
	uint32_t len;
	uint32_t reserved; /* 0 */
};

_Static_assert(sizeof(struct ap_dp_req) == 32, "request header is 32 bytes");
_Static_assert(sizeof(struct ap_dp_rep) == 16, "reply header is 16 bytes");
_Static_assert(sizeof(struct ap_seg_hdr) == AP_SEG_HDR_SIZE, "segment header is 4 lines");
_Static_assert(sizeof(struct ap_seg_hello) == 32, "hello is 32 bytes");

#endif
