/* t_reply: a reply buffer like a worker's, and requests, for calling handlers in tests. */
#ifndef T_REPLY_H
#define T_REPLY_H

#include "t_helpers.h"

#include "actor_pool_handler.h"
#include "t_reserve.h"

static inline int t_reserve_fails(actor_pool_reply *r, size_t more)
{
	(void)r;
	(void)more;
	return -1;
}

/* What the pool does before each call: the atom ok, unless even two bytes
 * cannot be had (a reply whose reserve always fails). */
static inline void t_reply_reset(actor_pool_reply *r)
{
	r->kind = AP_REPLY_ATOM;
	r->len = 0;
	if (r->cap >= 2 || !r->reserve(r, 2)) {
		memcpy(r->data, "ok", 2);
		r->len = 2;
	}
}

static inline void t_reply_init(actor_pool_reply *r)
{
	memset(r, 0, sizeof *r);
	r->reserve = t_reserve;
	t_reply_reset(r);
}

static inline void t_reply_free(actor_pool_reply *r)
{
	free(r->data);
	memset(r, 0, sizeof *r);
}

/* Requests hold exact-size heap copies, so a read past the message is an
 * ASan report rather than a quiet look at the neighbours. */
static inline actor_pool_request t_req(const void *p, size_t n, int is_binary, int is_ask)
{
	actor_pool_request q = { .data = t_dup(p, n), .len = n, .is_binary = is_binary, .is_ask = is_ask };
	return q;
}

static inline void t_req_free(actor_pool_request *q)
{
	free((void *)q->data);
	q->data = NULL;
}

/* One handle call on a fresh reply. */
static inline actor_pool_status t_call(const actor_pool_handler *h, void *state, const void *p, size_t n, int is_binary,
				       int is_ask, actor_pool_reply *reply)
{
	actor_pool_request q = t_req(p, n, is_binary, is_ask);
	t_reply_reset(reply);
	actor_pool_status st = h->handle(state, &q, reply);
	t_req_free(&q);
	return st;
}

#define t_assert_reply_atom(r, name)                                              \
	do {                                                                      \
		assert_int_equal((r)->kind, AP_REPLY_ATOM);                       \
		assert_int_equal((r)->len, strlen(name));                         \
		assert_memory_equal((r)->data, (name), strlen(name));             \
	} while (0)

#endif
