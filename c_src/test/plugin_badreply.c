/* plugin_badreply: a test plugin that replies whatever bytes it is told to,
 * as a hostile or broken plugin could: the pool node must keep every reply
 * the BEAM would refuse (or that would grow its atom table without bound)
 * from reaching it, and answer that asker alone {error, bad_reply}.
 *
 *   <<"term:", Bytes>>   AP_REPLY_TERM with Bytes (an encoded term, with or
 *                        without its 131 byte), unchecked
 *   <<"atom:", Name>>    AP_REPLY_ATOM with Name (an atom's text), unchecked
 *   <<"padded:", N:32, Bytes>>  AP_REPLY_TERM {Term, <<0:N/unit:8>>}, Term
 *                        being Bytes (no 131): a large reply from a small
 *                        request
 *   <<"sleep:", Ms>>     sleeps Ms (decimal) milliseconds, replies <<"slept">>
 *   anything else        echoed: a binary as a binary, a term as itself
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "actor_pool_handler.h"

static int prefixed(const actor_pool_request *rq, const char *p)
{
	size_t n = strlen(p);
	return rq->is_binary && rq->len >= n && !memcmp(rq->data, p, n);
}

static actor_pool_status reply(actor_pool_reply *r, actor_pool_reply_kind kind, const void *p, size_t n)
{
	return actor_pool_reply_set(r, kind, p, n) ? AP_HANDLER_CRASH : AP_HANDLER_OK;
}

static actor_pool_status badreply_handle(void *state, const actor_pool_request *rq, actor_pool_reply *r)
{
	(void)state;
	if (prefixed(rq, "term:"))
		return reply(r, AP_REPLY_TERM, rq->data + 5, rq->len - 5);
	if (prefixed(rq, "atom:"))
		return reply(r, AP_REPLY_ATOM, rq->data + 5, rq->len - 5);
	if (prefixed(rq, "padded:") && rq->len >= 11) {
		const uint8_t *q = rq->data + 7;
		size_t pad = (size_t)q[0] << 24 | (size_t)q[1] << 16 | (size_t)q[2] << 8 | q[3];
		size_t tl = rq->len - 11;
		r->kind = AP_REPLY_TERM;
		r->len = 0;
		if (pad > (64u << 20) || r->reserve(r, 2 + tl + 5 + pad))
			return AP_HANDLER_CRASH;
		uint8_t *d = r->data;
		d[0] = 104;
		d[1] = 2;
		memcpy(d + 2, q + 4, tl);
		d[2 + tl] = 109;
		for (int k = 0; k < 4; k++)
			d[3 + tl + k] = (uint8_t)(pad >> (24 - 8 * k));
		memset(d + 7 + tl, 0, pad);
		r->len = 7 + tl + pad;
		return AP_HANDLER_OK;
	}
	if (prefixed(rq, "sleep:")) {
		char ms[16] = { 0 };
		memcpy(ms, rq->data + 6, rq->len - 6 < sizeof ms - 1 ? rq->len - 6 : sizeof ms - 1);
		long v = strtol(ms, NULL, 10);
		struct timespec ts = { .tv_sec = v / 1000, .tv_nsec = (v % 1000) * 1000000L };
		while (nanosleep(&ts, &ts) && errno == EINTR)
			;
		return reply(r, AP_REPLY_BINARY, "slept", 5);
	}
	return reply(r, rq->is_binary ? AP_REPLY_BINARY : AP_REPLY_TERM, rq->data, rq->len);
}

static const actor_pool_handler badreply = {
	.abi_version = ACTOR_POOL_HANDLER_ABI,
	.name = "badreply",
	.handle = badreply_handle,
};

__attribute__((visibility("default"))) const actor_pool_handler *actor_pool_handler_get(void) { return &badreply; }
