/* reply: a pool's answers, by its workers (a handler's result) and by the
 * loop (an ask answered without a worker), each sent by its job's route
 * (pool_int.h): the one place an answer leaves. */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "ap_atomset.h"
#include "ap_ctrl.h"
#include "ap_log.h"
#include "ap_term.h"
#include "pool_int.h"

int ap_pool_reply_reserve(actor_pool_reply *r, size_t more)
{
	if (more > SIZE_MAX - r->len)
		return -1;
	return ap_grow(&r->data, &r->cap, r->len + more, 256, SIZE_MAX);
}

/* ---- the check of a handler's reply ----------------------------------------
 * A term a BEAM refuses closes the whole distribution connection it came
 * on (every ask in flight to this node fails with it), and one it takes
 * may hold atoms it never frees: so every reply a handler makes, for
 * either transport and in either isolation mode, is checked here, on the
 * thread that answers, before it leaves: ap_term_check (ap_term.h says
 * what it enforces and why) against the receiving node, and each atom
 * against the pool's budget (max_reply_atoms: the distinct atom names its
 * replies may carry, a set of their keyed hashes that every answering
 * thread adds to without a lock). A reply that fails becomes
 * {error, bad_reply} for its asker alone, counted (stats: bad_replies),
 * and logged once per pool. Binaries carry no atoms and are not walked.
 * The pool's own replies (status atoms, error reasons) are not the
 * handler's and pass unchecked. */

static int admit_atom(void *arg, const uint8_t *name, size_t len)
{
	return ap_atomset_admit(arg, name, len) ? 0 : -1;
}

/* The handler's term t[0, len) (no 131), as the receiving node takes it. */
static int check_term(ap_worker *w, const ap_job *j, const char *t, size_t len)
{
	ap_term_strict *st = &w->check;
	const char *node = j->route.ops->peer(&j->route, ap_job_addr(j));
	int idx = 0;
	st->self_node = node;
	st->self_node_len = strlen(node);
	st->atom = admit_atom;
	st->arg = w->pool->atoms;
	if (len == 0 || len > INT32_MAX) {
		st->why = "no term";
		return -1;
	}
	if (ap_term_check(t, len, &idx, st))
		return -1;
	if ((size_t)idx != len) {
		st->why = "bytes after the term";
		return -1;
	}
	return 0;
}

/* Append {Status, Value} (no 131) to b from the reply r: the handler's
 * (checked: j is the ask it answers), or the pool's own (j NULL). Returns
 * 0, or -1 when the reply will not do (w->check.why says why). */
static int enc_result(ap_buf *b, const char *status, const actor_pool_reply *r, ap_worker *w, const ap_job *j)
{
	char tmp[MAXATOMLEN_UTF8 + 16];
	int i = 0;
	ei_encode_tuple_header(tmp, &i, 2);
	ei_encode_atom(tmp, &i, status);
	if (ap_buf_append(b, tmp, (size_t)i))
		goto nomem;
	switch (r->kind) {
	case AP_REPLY_BINARY: {
		uint8_t h[5] = { 109 };
		if (r->len > UINT32_MAX) {
			w->check.why = "a binary over 4 GiB";
			return -1;
		}
		ap_put32be(h + 1, (uint32_t)r->len);
		if (ap_buf_append(b, h, 5) || ap_buf_append(b, r->data, r->len))
			goto nomem;
		return 0;
	}
	case AP_REPLY_ATOM:
		i = 0;
		if (r->len > 255 * 4) {
			w->check.why = "an atom of over 255 characters";
			return -1;
		}
		if (ei_encode_atom_len_as(tmp, &i, (const char *)r->data, (int)r->len, ERLANG_UTF8, ERLANG_UTF8)) {
			w->check.why = "an atom ei cannot encode";
			return -1;
		}
		if (j && check_term(w, j, tmp, (size_t)i))
			return -1;
		if (ap_buf_append(b, tmp, (size_t)i))
			goto nomem;
		return 0;
	case AP_REPLY_TERM: {
		const char *t = (const char *)r->data;
		size_t len = r->len;
		if (len > 0 && (uint8_t)t[0] == 131) {
			t++;
			len--;
		}
		if (j && check_term(w, j, t, len))
			return -1;
		if (ap_buf_append(b, t, len))
			goto nomem;
		return 0;
	}
	}
	w->check.why = "an unknown reply kind";
	return -1;
nomem:
	w->check.why = "no memory";
	return -1;
}

void ap_pool_set_atom_reply(actor_pool_reply *r, const char *atom)
{
	actor_pool_reply_set(r, AP_REPLY_ATOM, atom, strlen(atom));
}

/* A reply refused: counted, and logged once per pool (the first refusal,
 * with what was wrong; and the first time the atom budget ran out). */
static void bad_reply(ap_pool *p, const char *why, int budget)
{
	atomic_fetch_add_explicit(&p->bad_replies, 1, memory_order_relaxed);
	int bit = budget ? 2 : 1;
	int was = atomic_fetch_or(&p->bad_reply_logged, bit | 1);
	if (!(was & 1))
		ap_log(AP_LOG_WARNING,
		       "pool %s: handler %s made a reply the receiving node would refuse or must not take (%s); its "
		       "asker got {error, bad_reply}, and later ones are counted in stats bad_replies, not logged",
		       p->name, p->handler_desc, why);
	else if (budget && !(was & 2))
		ap_log(AP_LOG_WARNING,
		       "pool %s: its replies carried max_reply_atoms (%u) distinct atoms; a reply with another is "
		       "{error, bad_reply}",
		       p->name, p->o.max_reply_atoms);
}

/* {Status, reply} after j's head into w->out; 0, or -1 (nothing to send).
 * own: the reply is the pool's, not the handler's. */
static int enc_answer(ap_worker *w, const ap_job *j, const char *status, actor_pool_reply *r, int own)
{
	ap_buf *b = &w->out;
	b->len = 0;
	if (ap_buf_append(b, j->data, j->head_len))
		return -1;
	if (enc_result(b, status, r, w, own ? NULL : j)) {
		if (own)
			return -1; /* no memory: nothing to send */
		const char *why = w->check.why ? w->check.why : "malformed";
		bad_reply(w->pool, why, why == ap_term_why_atom);
		b->len = j->head_len;
		ap_pool_set_atom_reply(r, "bad_reply");
		if (enc_result(b, "error", r, w, NULL))
			return -1;
	}
	return 0;
}

/* The answer to the ask j (its head, then {Status, reply}), sent by its
 * route: every ask is answered exactly once, here or by the loop, and its
 * route's hold released with it. */
int ap_answer(ap_worker *w, const ap_job *j, const char *status, actor_pool_reply *r, int how)
{
	ap_buf *b = &w->out;
	if (enc_answer(w, j, status, r, how & AP_ANSWER_OWN)) {
		ap_route_drop(&j->route); /* nothing to send */
		return 0;
	}
	return j->route.ops->send(&j->route, ap_job_addr(j), b->data, b->len, (unsigned)w->id,
				  how & AP_ANSWER_NOWAIT ? AP_SEND_NOWAIT : AP_SEND_WAIT);
}

void ap_answer_error(ap_worker *w, const ap_job *j, const char *reason)
{
	ap_pool_set_atom_reply(&w->reply, reason);
	ap_answer(w, j, "error", &w->reply, AP_ANSWER_OWN);
}

int ap_answer_made(ap_worker *w, ap_job *j, ap_send_mode mode)
{
	return j->route.ops->send(&j->route, ap_job_addr(j), j->data, (size_t)j->head_len + j->msg_len,
				  (unsigned)w->id, mode);
}

void ap_answer_loop(ap_pool *p, const ap_route *r, const void *head, size_t head_len, const char *addr,
		    const char *reason)
{
	ap_buf *b = &p->scratch;
	b->len = 0;
	if (ap_buf_append(b, head, head_len) || ap_enc_error(b, reason)) {
		ap_route_drop(r);
		return;
	}
	(void)r->ops->send(r, addr, b->data, b->len, 0, AP_SEND_LOOP);
}

/* Why a pool did not start: what its first failing worker process said
 * (sandbox.h, ISO_FAIL_*), else its init's code. */
static void enc_init_fail(ei_x_buff *x, const ap_pool *p)
{
	const struct ap_init_fail *f = &p->init_fail;
	ei_x_encode_tuple_header(x, 3 - (f->kind == ISO_FAIL_LOAD || f->kind == ISO_FAIL_ABI ||
					 f->kind == ISO_FAIL_SANDBOX ? 0 : 1));
	switch (f->kind) {
	case ISO_FAIL_LOAD:
		ei_x_encode_atom(x, "plugin_load_failed");
		ei_x_encode_binary(x, p->spec, (long)strlen(p->spec));
		ei_x_encode_binary(x, f->why, (long)strlen(f->why));
		break;
	case ISO_FAIL_ABI:
		ei_x_encode_atom(x, "abi_mismatch");
		ei_x_encode_ulong(x, (uint32_t)f->num);
		ei_x_encode_ulong(x, ACTOR_POOL_HANDLER_ABI);
		break;
	case ISO_FAIL_SANDBOX: {
		/* The layer's name is ours (sandbox_child.c), but the child
		 * wrote it: an atom only if it is one of them. */
		static const char *const layers[] = { "cgroup", "pidns", "uid", "no_new_privs", "landlock", "seccomp" };
		const char *l = "sandbox";
		for (size_t i = 0; i < sizeof layers / sizeof *layers; i++)
			if (!strcmp(f->layer, layers[i]))
				l = layers[i];
		ei_x_encode_atom(x, "sandbox_failed");
		ei_x_encode_atom(x, l);
		ei_x_encode_binary(x, f->why, (long)strlen(f->why));
		break;
	}
	default:
		ei_x_encode_atom(x, "handler_init_failed");
		ei_x_encode_long(x, p->init_failed);
	}
}

/* Loop thread: the answer to the start request, once every worker ran its
 * init: {ok, Pid}, {error, Why} (enc_init_fail), or {error, stopped} for a
 * pool stopped meanwhile. */
void ap_pool_answer_start(ap_pool *p, int ok)
{
	ap_pending_reply *r = p->start_reply;
	if (!r)
		return;
	p->start_reply = NULL;
	ei_x_buff x;
	if (ei_x_new(&x) == 0) {
		ei_x_encode_tuple_header(&x, 2);
		if (ok) {
			ei_x_encode_atom(&x, "ok");
			ei_x_encode_pid(&x, &p->pid);
		} else if (p->stopping) {
			ei_x_encode_atom(&x, "error");
			ei_x_encode_atom(&x, "stopped");
		} else {
			ei_x_encode_atom(&x, "error");
			enc_init_fail(&x, p);
		}
		if (ap_buf_append(&r->head, x.buff, (size_t)x.index) == 0 && ap_frame_end(&r->head, 0) == 0)
			ap_node_post(p->n, r->node, r->head.data, r->head.len);
		ei_x_free(&x);
	}
	ap_buf_free(&r->head);
	free(r);
}
