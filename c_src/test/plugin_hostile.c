/* plugin_hostile: a worker-process plugin that attacks its own channel, as
 * a broken plugin in an isolation => process pool could (isolate.h). The
 * pool node must lose that worker only, and never believe the channel.
 *
 *   <<"break_req">>   writes a head past the request ring's tail (the ring
 *                     turns broken for the pool node's proxy), then sleeps
 *                     1 s, replying scribbled
 *   <<"scribble_req">> writes into the request ring's records (where the
 *                     pool node keeps its only copy of some tells): the
 *                     child maps them read-only, so this dies of SIGSEGV;
 *                     replies scribbled if the write went through
 *   <<"spin_hide">>   spins for ever, clearing running_seq all the while
 *                     (hiding from a handler_timeout_ms that trusted it)
 *   <<"lie_done">>    claims done_seq far past what it was sent, then
 *                     sleeps 30 s
 *   <<"done_ask">>    claims its own message (an ask) done with no result
 *                     record, then sleeps 30 s
 *   <<"mute">>        raises loop_looks (the loop's word: "I take your
 *                     results, ring nobody"), replies muted: its answers
 *                     now wake nobody until the loop or the proxy looks
 *   <<"times_high">>  writes 2^62 into each count of its handler-time
 *                     histogram and 3 * 2^62 into its sum, replies lied
 *   <<"times_zero">>  writes zeros over it, replies lied
 *   <<"print">>       writes a line to stdout, replies printed
 *   <<"fds">>         {Stdout, Stderr}: where fds 1 and 2 point
 *                     (readlink of /proc/self/fd/N), as binaries
 *   anything else     a binary: its size; a term: itself
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <ei.h>

#include "actor_pool_handler.h"
#include "ap_ring.h"
#include "isolate.h"

/* The channel: the memfd mapping named after the pool's worker channel. */
static uint8_t *channel(void)
{
	FILE *f = fopen("/proc/self/maps", "r");
	char line[512];
	uint8_t *m = NULL;
	while (f && fgets(line, sizeof line, f))
		if (strstr(line, "memfd:actor_pool_worker")) {
			m = (uint8_t *)(uintptr_t)strtoull(line, NULL, 16);
			break;
		}
	if (f)
		fclose(f);
	return m;
}

static int reply_term(actor_pool_reply *r, const char *t, int len)
{
	return actor_pool_reply_set(r, AP_REPLY_TERM, t, (size_t)len) ? -1 : 0;
}

static int is(const actor_pool_request *rq, const char *s)
{
	return rq->is_binary && rq->len == strlen(s) && !memcmp(rq->data, s, rq->len);
}

static actor_pool_status hostile_handle(void *state, const actor_pool_request *rq, actor_pool_reply *r)
{
	(void)state;
	if (is(rq, "break_req")) {
		uint8_t *m = channel();
		if (!m)
			return AP_HANDLER_CRASH;
		struct iso_ctl *c = (struct iso_ctl *)m;
		struct ap_ring_hdr *h = (struct ap_ring_hdr *)(m + c->req_off);
		__atomic_store_n(&h->head, 1ULL << 40, __ATOMIC_RELEASE);
		struct timespec ts = { 1, 0 };
		nanosleep(&ts, NULL);
		return actor_pool_reply_set(r, AP_REPLY_ATOM, "scribbled", 9) ? AP_HANDLER_CRASH : AP_HANDLER_OK;
	}
	if (is(rq, "scribble_req")) {
		uint8_t *m = channel();
		if (!m)
			return AP_HANDLER_CRASH;
		struct iso_ctl *c = (struct iso_ctl *)m;
		volatile uint8_t *data = m + c->req_off + AP_RING_HDR_SIZE;
		data[0] ^= 0xff;
		return actor_pool_reply_set(r, AP_REPLY_ATOM, "scribbled", 9) ? AP_HANDLER_CRASH : AP_HANDLER_OK;
	}
	if (is(rq, "spin_hide")) {
		uint8_t *m = channel();
		if (!m)
			return AP_HANDLER_CRASH;
		struct iso_ctl *c = (struct iso_ctl *)m;
		for (;;)
			atomic_store(&c->running_seq, 0);
	}
	if (is(rq, "lie_done") || is(rq, "done_ask")) {
		uint8_t *m = channel();
		if (!m)
			return AP_HANDLER_CRASH;
		struct iso_ctl *c = (struct iso_ctl *)m;
		uint64_t v = is(rq, "lie_done") ? 1ULL << 40 : atomic_load(&c->running_seq);
		atomic_store(&c->done_seq, v);
		struct timespec ts = { 30, 0 };
		nanosleep(&ts, NULL);
		return AP_HANDLER_OK;
	}
	if (is(rq, "mute")) {
		uint8_t *m = channel();
		if (!m)
			return AP_HANDLER_CRASH;
		atomic_store(&((struct iso_ctl *)m)->loop_looks, 1);
		return actor_pool_reply_set(r, AP_REPLY_ATOM, "muted", 5) ? AP_HANDLER_CRASH : AP_HANDLER_OK;
	}
	if (is(rq, "times_high") || is(rq, "times_zero")) {
		uint8_t *m = channel();
		if (!m)
			return AP_HANDLER_CRASH;
		struct iso_ctl *c = (struct iso_ctl *)m;
		int high = is(rq, "times_high");
		for (unsigned b = 0; b < AP_HIST_BUCKETS; b++)
			atomic_store(&c->run_ns.n[b], high ? 1ULL << 62 : 0);
		atomic_store(&c->run_ns.sum_ns, high ? 3ULL << 62 : 0);
		return actor_pool_reply_set(r, AP_REPLY_ATOM, "lied", 4) ? AP_HANDLER_CRASH : AP_HANDLER_OK;
	}
	if (is(rq, "print")) {
		printf("a line from a worker process's printf\n");
		fflush(stdout);
		return actor_pool_reply_set(r, AP_REPLY_ATOM, "printed", 7) ? AP_HANDLER_CRASH : AP_HANDLER_OK;
	}
	char t[2 * 4096 + 64];
	int i = 0;
	ei_encode_version(t, &i);
	if (is(rq, "fds")) {
		char a[4096], b[4096];
		ssize_t na = readlink("/proc/self/fd/1", a, sizeof a);
		ssize_t nb = readlink("/proc/self/fd/2", b, sizeof b);
		ei_encode_tuple_header(t, &i, 2);
		ei_encode_binary(t, &i, a, na > 0 ? na : 0);
		ei_encode_binary(t, &i, b, nb > 0 ? nb : 0);
		return reply_term(r, t, i) ? AP_HANDLER_CRASH : AP_HANDLER_OK;
	}
	if (rq->is_binary) {
		ei_encode_ulong(t, &i, (unsigned long)rq->len);
		return reply_term(r, t, i) ? AP_HANDLER_CRASH : AP_HANDLER_OK;
	}
	return actor_pool_reply_set(r, AP_REPLY_TERM, rq->data, rq->len) ? AP_HANDLER_CRASH : AP_HANDLER_OK;
}

static const actor_pool_handler hostile = {
	.abi_version = ACTOR_POOL_HANDLER_ABI,
	.name = "hostile",
	.handle = hostile_handle,
};

__attribute__((visibility("default"))) const actor_pool_handler *actor_pool_handler_get(void) { return &hostile; }
