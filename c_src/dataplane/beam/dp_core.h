/* dp_core: the NIF side of the same-host data plane without erl_nif:
 * geometry, request records, reply records, draining reply rings, and the
 * attach handshake (c_src/ring/ap_seg.h is the contract). Everything the
 * pool node can write is read here, so it is tested alone (test_dp_core)
 * and fuzzed (fuzz_dp_reply) under ASan+UBSan.
 *
 * Errors: negative errno values, as in ap_ring.h.
 */
#ifndef DP_CORE_H
#define DP_CORE_H

#include <stddef.h>
#include <stdint.h>

#include "ap_seg.h"

/* Records drained from one reply ring per pass: the reply thread goes
 * round every ring, so one busy ring cannot starve the others, and a pass
 * is bounded whatever the peer writes. */
#define DP_DRAIN_BATCH 256u
/* The longest pool name (ap_seg.h: 1..1020 bytes of UTF-8). */
#define DP_MAX_DEST_NAME 1020u
/* A pid as an external term without the 131 byte: a node name atom of up
 * to 255 characters (each up to 4 bytes in UTF-8) and three words. */
#define DP_MAX_DEST_PID 1040u

/* Checks a geometry asked for by the caller: 0, or -EINVAL. *size is the
 * segment's bytes. */
int dp_geom(uint32_t n_req, uint64_t req_cap, uint32_t n_rep, uint64_t rep_cap, size_t *size);

/* The payload bytes of a request record with these parts. */
static inline size_t dp_req_len(size_t dest_len, size_t msg_len)
{
	return sizeof(struct ap_dp_req) + dest_len + msg_len;
}

/* Writes a request record's payload at p (dp_req_len bytes). The message
 * is msg_pre (pre_len bytes: the 109+length prefix of a binary, or
 * nothing) then msg (msg_len bytes); fence_ring AP_DP_NO_FENCE for none.
 * p may be shared memory: written with plain stores, published by the
 * caller's ap_ring_publish. */
struct dp_req_parts {
	uint8_t kind, dest_kind;
	const void *dest;
	size_t dest_len;
	const void *msg_pre;
	size_t pre_len;
	const void *msg;
	size_t msg_len;
	uint64_t ask_id;
	uint32_t fence_ring;
	uint64_t fence_pos;
};
int dp_req_check(const struct dp_req_parts *q);
void dp_req_write(void *p, const struct dp_req_parts *q);

/* The 109 + 4-byte big-endian length prefix of a binary's external term
 * (without the 131 byte). */
void dp_binary_prefix(uint8_t out[5], uint32_t len);

/* Parses a reply record's payload, already COPIED out of shared memory
 * (buf, len bytes): the header must say exactly len - 16 bytes of answer
 * and a zero reserved word, and the answer must not be a compressed term
 * (tag 80: it states its own inflated size, up to 4 GiB, which the
 * decoder would allocate; the pool node never compresses). 0 with
 * *ask_id and *term_len set (the answer is buf + sizeof(struct
 * ap_dp_rep)), or -EPROTO. */
int dp_rep_parse(const uint8_t *buf, size_t len, uint64_t *ask_id, size_t *term_len);

/* Called for each valid reply: ask_id, and the answer's external term
 * WITH its 131 byte (term[-1] of the copy is overwritten with 131, so the
 * caller decodes in place): term, term_len bytes, in private memory. */
typedef void (*dp_reply_fn)(void *arg, uint64_t ask_id, const uint8_t *term, size_t term_len);

struct dp_drain_stats {
	uint64_t replies;     /* valid records handed to the callback */
	uint64_t bad_records; /* refused by dp_rep_parse (skipped) */
	int held;             /* dp_drain_upto stopped before a record over max_len */
};

/* Drains up to `max` records of a reply ring (consumer view r): each is
 * copied into buf (buf_cap >= ap_ring_max_payload(r->cap) + 1), parsed,
 * handed to fn; then everything read is released to the producer. The
 * count of records read, or -EPROTO (the ring is broken: the segment is
 * hostile or torn), -EINVAL. */
int dp_drain(struct ap_ring *r, uint8_t *buf, size_t buf_cap, unsigned max, dp_reply_fn fn, void *arg,
	     struct dp_drain_stats *st);

/* As dp_drain, but stops before the first record longer than max_len
 * bytes and leaves it in the ring, unread (st->held set): for a drainer
 * that must not decode large answers where it runs (a scheduler). */
int dp_drain_upto(struct ap_ring *r, uint8_t *buf, size_t buf_cap, unsigned max, size_t max_len, dp_reply_fn fn,
		  void *arg, struct dp_drain_stats *st);

/* ---- attach ----------------------------------------------------------------- */

/* Connects to the pool node's abstract AF_UNIX socket (name: name_len
 * bytes, starting with the 0 byte, at most 108), checks the listener is
 * ours (SO_PEERCRED uid == geteuid(): an abstract name can be bound by
 * anyone), sends the hello (token, node name) and the memfd, and waits
 * for the ack, all before deadline_ms (CLOCK_MONOTONIC, dp_now_ms). The
 * connected socket (close-on-exec, non-blocking) is returned in *sock.
 * 0; a negative errno (-ETIMEDOUT, -ECONNREFUSED, -EPERM: another uid,
 * -EPROTO: a bad ack, -ECONNRESET); or a positive errno: the pool node's
 * refusal (its ack status). *bell_fd is the pool node's bell pipe
 * when its ack carried one (ap_seg.h, attach step 4; checked with
 * dp_is_bell_pipe), else -1; the caller closes it. */
int dp_attach(const void *name, size_t name_len, const uint8_t token[AP_SEG_TOKEN_LEN], const void *node,
	      size_t node_len, int memfd, int64_t deadline_ms, int *sock,
	      int *bell_fd);

/* 1 if the peer closed the socket (EOF, HUP or an error), 0 if not: a
 * poll with no wait. Bytes the peer sends are read and dropped (nothing is
 * expected after the ack), at most a bounded amount per call. */
int dp_peer_gone(int sock);

/* 1 if fd is a pipe that takes RWF_NOWAIT writes (it writes one byte). */
int dp_is_bell_pipe(int fd);

int64_t dp_now_ms(void);

#endif
