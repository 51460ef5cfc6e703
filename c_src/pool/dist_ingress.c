/* dist_ingress: the pool process, what a pool receives by distribution
 * ('$gen_call', '$gen_cast', '$ap_batch', plain messages) turned into
 * dispatched requests, and the distribution route their answers go back
 * by; and the answers for a batch to a pool that is gone. */
#include <string.h>

#include "ap_ctrl.h"
#include "ap_dec.h"
#include "ap_term.h"
#include "pool_int.h"
#include "ring_ingress.h"

/* The end of the term at b[i] in a message of len bytes, by the walk: what
 * dispatch copies and what a reply carries never reach past what the walk
 * vouched for (ei_skip_term trusts a fun's Size and a binary's length). */
static int term_end(const char *b, int len, int i)
{
	return len < 0 ? -1 : ap_term_end(b, (size_t)len, i);
}

/* ---- the distribution route ---------------------------------------------------
 * An ask's answer is {Tag, Reply} to its caller (by ALIAS_SEND when the tag
 * is [alias | Ref]), a frame for the loop to send: the job's head is the
 * frame's head (ap_encode_reply_head), its address the caller's node, the
 * route's context the node. It holds nothing, and never waits: the loop's
 * send queue takes the frame at once. */

static int dist_send(const ap_route *r, const char *addr, uint8_t *b, size_t len, unsigned worker,
		     ap_send_mode mode)
{
	(void)worker;
	(void)mode;
	ap_buf f = { .data = b, .len = len, .cap = len };
	if (ap_frame_end(&f, 0))
		return 0;
	ap_node_post(r->ctx, addr, b, len);
	return 0;
}

static void dist_drop(const ap_route *r) { (void)r; }

static const char *dist_peer(const ap_route *r, const char *addr)
{
	(void)r;
	return addr;
}

static const ap_route_ops dist_route = { .send = dist_send, .drop = dist_drop, .peer = dist_peer };

/* A message came by distribution: the ring ingress stops yielding for
 * records (ap_dp_poll_cancel) before the loop sleeps. */
static void tell(ap_pool *p, const char *msg, int msg_len)
{
	p->by_dist++;
	ap_dp_poll_cancel();
	ap_pool_dispatch(p, &(ap_request){ .kind = AP_REQ_TELL, .route = { &dist_route, p->n, 0 }, .msg = msg,
					   .msg_len = msg_len });
}

/* The head of the answer to the ask being dispatched (loop thread): made
 * here, once; the worker only appends the result, and the loop answers
 * overload with the same head. */
static ap_buf ask_head;

/* tag: the reply tag, copied verbatim into {Tag, Reply}; like msg, a term
 * without its 131 byte that the walk vouched for. */
static void ask(ap_pool *p, const erlang_pid *caller, const char *tag, int tag_len, const char *msg, int msg_len)
{
	p->by_dist++;
	ap_dp_poll_cancel();
	ask_head.len = 0;
	if (ap_encode_reply_head(&ask_head, &p->pid, caller, tag, tag_len) == (size_t)-1)
		return;
	ap_pool_dispatch(p, &(ap_request){ .kind = AP_REQ_ASK, .route = { &dist_route, p->n, 0 },
					   .head = (const char *)ask_head.data, .head_len = (uint32_t)ask_head.len,
					   .addr = caller->node, .addr_len = (uint32_t)strlen(caller->node) + 1,
					   .msg = msg, .msg_len = msg_len });
}

/* ---- the pool process ------------------------------------------------------------ */

/* {'$ap_batch', [{tell, Msg} | {ask, Pid, Tag, Msg}]} in b[0..len) */
static int batch(ap_pool *p, const char *b, int len, int i)
{
	int arity, n, type, size;
	if (ei_get_type(b, &i, &type, &size) || (type != ERL_LIST_EXT && type != ERL_NIL_EXT))
		return 0;
	if (type == ERL_NIL_EXT)
		return 1;
	if (ei_decode_list_header(b, &i, &n))
		return 0;
	for (int k = 0; k < n; k++) {
		char tag[8];
		int e = term_end(b, len, i);
		if (e < 0)
			return 1;
		static const char tell_hdr[] = { 104, 2, 119, 4, 't', 'e', 'l', 'l' };
		if (e - i > (int)sizeof tell_hdr && !memcmp(b + i, tell_hdr, sizeof tell_hdr)) {
			/* The common case, {tell, Msg} as a BEAM encodes it. */
			i += sizeof tell_hdr;
			tell(p, b + i, e - i);
			i = e;
			continue;
		}
		if (ei_decode_tuple_header(b, &i, &arity) || ap_get_atom(b, &i, tag, sizeof tag)) {
			i = e;
			continue;
		}
		if (arity == 2 && !strcmp(tag, "tell")) {
			tell(p, b + i, e - i);
		} else if (arity == 4 && !strcmp(tag, "ask")) {
			erlang_pid caller;
			if (ei_get_type(b, &i, &type, &size) == 0 && type == ERL_PID_EXT &&
			    ei_decode_pid(b, &i, &caller) == 0) {
				int t0 = i, t1 = term_end(b, e, i);
				if (t1 > 0)
					ask(p, &caller, b + t0, t1 - t0, b + t1, e - t1);
			}
		}
		i = e;
	}
	return 1;
}

static int is_batch(const char *b, int i, int *list)
{
	int arity;
	char a[16];
	if (ei_decode_tuple_header(b, &i, &arity) || arity != 2 || ap_get_atom(b, &i, a, sizeof a) ||
	    strcmp(a, AP_BATCH))
		return 0;
	*list = i;
	return 1;
}

void ap_pool_process(ap_node *n, ap_proc *self, const ap_msg *m)
{
	ap_pool *p = self->state;
	int e, list;
	switch (m->kind) {
	case AP_MSG_CALL:
		if (ap_is_atom(m->buf, m->index, AP_STATS)) {
			ei_x_buff x;
			if (ei_x_new(&x))
				return;
			ap_pool_encode_stats(p, &x);
			ap_reply(n, self, m, x.buff, x.index);
			ei_x_free(&x);
			return;
		}
		e = term_end(m->buf, m->len, m->index);
		if (e > 0)
			ask(p, &m->from, m->tag, m->tag_len, m->buf + m->index, e - m->index);
		break;
	case AP_MSG_CAST:
		e = term_end(m->buf, m->len, m->index);
		if (e > 0)
			tell(p, m->buf + m->index, e - m->index);
		break;
	case AP_MSG_INFO:
		if (is_batch(m->buf, m->index, &list) && batch(p, m->buf, m->len, list))
			break;
		tell(p, m->buf + 1, m->len - 1);
		break;
	case AP_MSG_EXIT:
		break;
	}
	ap_pool_wake_pushed(p);
}

/* A batch to a pool that is gone: its asks answered {error, noproc}; the
 * number of its tells. */
static uint64_t batch_dead(ap_node *n, ap_proc *self, const ap_msg *m, int list)
{
	int k, nitems, arity, type, size;
	const char *b = m->buf;
	int i = list;
	uint64_t tells = 0;
	if (ei_get_type(b, &i, &type, &size) || type != ERL_LIST_EXT || ei_decode_list_header(b, &i, &nitems))
		return 0;
	ap_buf out = { 0 };
	for (k = 0; k < nitems; k++) {
		int e = term_end(b, m->len, i);
		char tag[8];
		erlang_pid caller;
		if (e < 0)
			break;
		if (ei_decode_tuple_header(b, &i, &arity) == 0 && ap_get_atom(b, &i, tag, sizeof tag) == 0) {
			if (arity == 2 && !strcmp(tag, "tell")) {
				tells++;
			} else if (arity == 4 && !strcmp(tag, "ask") && ei_get_type(b, &i, &type, &size) == 0 &&
				   type == ERL_PID_EXT && ei_decode_pid(b, &i, &caller) == 0) {
				int t0 = i, t1 = term_end(b, e, i);
				out.len = 0;
				if (t1 > 0 && ap_enc_error_reply(&out, &self->pid, &caller, b + t0, t1 - t0, "noproc") == 0)
					ap_node_post(n, caller.node, out.data, out.len);
			}
		}
		i = e;
	}
	ap_buf_free(&out);
	return tells;
}

/* A message to a name or pid with no process: its tells are counted and
 * the asks of a batch answered; a name is logged here, once, and the node
 * logs the rest. A plain call (an ask) is left to the node, which answers
 * it noproc. */
int ap_pool_dead_letter(ap_node *n, ap_proc *self, const ap_msg *m, const char *peer, const char *toname)
{
	int list;
	if (m->kind != AP_MSG_INFO && m->kind != AP_MSG_CAST)
		return 0;
	uint64_t tells = m->kind == AP_MSG_INFO && is_batch(m->buf, m->index, &list) ? batch_dead(n, self, m, list) : 1;
	ap_pool_no_pool(peer, toname, toname ? strlen(toname) : 0, NULL, tells);
	return toname != NULL;
}
