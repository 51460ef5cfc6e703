/* t_rcpt: the receptionist's process (receptionist/rcpt_proto.c) on a real
 * node that has no connection, for test_rcpt_proto (cmocka) and
 * fuzz_rcpt_proto (libFuzzer).
 *
 * A message goes the runtime's way: refused unless ap_term_validate_msg
 * takes it (the node drops the connection of a peer that sends such a
 * frame), then ap_node_classify, then the process's function. What the
 * process sends (ap_send, ap_reply, ap_reply_atom: wrapped at link time,
 * -Wl,--wrap) is kept in t_r.out, each term copied to a block of its exact
 * size, for the includer to look at.
 *
 * The includer defines T_RCPT_CHECK(cond) (an assertion) before including
 * this file. Checked here, for everything the process sends: one whole term
 * (ap_term_end), sent to a pid whose node name is NUL-terminated, from the
 * process itself; and a reply only while a call is handled, exactly one
 * per call. No snapshot segment is opened (shm_state none).
 */
#ifndef T_RCPT_H
#define T_RCPT_H

#include <ei.h>
#include <stdlib.h>
#include <string.h>

#include "ap_log.h"
#include "ap_node.h"
#include "ap_node_int.h" /* ap_node_classify: what the runtime makes of a message */
#include "ap_term.h"
#include "rcpt_log.h"
#include "rcpt_proto.h"

#ifndef T_RCPT_CHECK
#error "define T_RCPT_CHECK before including t_rcpt.h"
#endif

#define T_RCPT_NAME "actor_receptionist"

struct t_out {
	erlang_pid to; /* a reply: the caller */
	int reply;     /* 1: ap_reply / ap_reply_atom */
	char *term;    /* without the version byte, exact size */
	int len;
};

static struct {
	ap_node *n;
	ap_proc *self;
	struct t_out *out;
	size_t nout, cap;
	const ap_msg *call; /* the call being handled */
	int replies;        /* to it */
} t_r;

static void t_rcpt_keep(const erlang_pid *to, int reply, const char *term, int len)
{
	T_RCPT_CHECK(len > 0);
	int v = (unsigned char)term[0] == 131 ? 1 : 0;
	T_RCPT_CHECK(len > v && ap_term_end(term, (size_t)len, v) == len);
	T_RCPT_CHECK(memchr(to->node, 0, sizeof to->node) != NULL);
	if (t_r.nout == t_r.cap) {
		size_t cap = t_r.cap ? t_r.cap * 2 : 16;
		struct t_out *o = realloc(t_r.out, cap * sizeof *o);
		T_RCPT_CHECK(o != NULL);
		t_r.out = o;
		t_r.cap = cap;
	}
	char *copy = malloc((size_t)(len - v));
	T_RCPT_CHECK(copy != NULL);
	memcpy(copy, term + v, (size_t)(len - v));
	t_r.out[t_r.nout++] = (struct t_out){ .to = *to, .reply = reply, .term = copy, .len = len - v };
}

int __wrap_ap_send(ap_node *n, const ap_proc *from, const erlang_pid *to, const char *term, int len);
int __wrap_ap_reply(ap_node *n, const ap_proc *self, const ap_msg *call, const char *term, int len);
int __wrap_ap_reply_atom(ap_node *n, const ap_proc *self, const ap_msg *call, const char *atom);

int __wrap_ap_send(ap_node *n, const ap_proc *from, const erlang_pid *to, const char *term, int len)
{
	T_RCPT_CHECK(n == t_r.n && from == t_r.self);
	t_rcpt_keep(to, 0, term, len);
	return 0;
}

int __wrap_ap_reply(ap_node *n, const ap_proc *self, const ap_msg *call, const char *term, int len)
{
	T_RCPT_CHECK(n == t_r.n && self == t_r.self);
	T_RCPT_CHECK(call && call == t_r.call && call->kind == AP_MSG_CALL);
	t_r.replies++;
	t_rcpt_keep(&call->from, 1, term, len);
	return 0;
}

int __wrap_ap_reply_atom(ap_node *n, const ap_proc *self, const ap_msg *call, const char *atom)
{
	char buf[MAXATOMLEN_UTF8 + 8];
	int i = 0;
	T_RCPT_CHECK(ei_encode_atom(buf, &i, atom) == 0);
	return __wrap_ap_reply(n, self, call, buf, i);
}

static void t_rcpt_clear(void)
{
	for (size_t k = 0; k < t_r.nout; k++)
		free(t_r.out[k].term);
	t_r.nout = 0;
}

/* A fresh registry (listings up to max_listing bytes) behind a fresh
 * actor_receptionist; the node is made once. */
static void t_rcpt_start(size_t max_listing)
{
	if (!t_r.n) {
		ap_log_set_level(AP_LOG_ERROR); /* malformed input logs warnings */
		ap_node_cfg cfg = { .node = "rcpt@localhost", .cookie = "t", .creation = 0x2345, .io = "epoll" };
		t_r.n = ap_node_new(&cfg);
		T_RCPT_CHECK(t_r.n != NULL);
		rcpt_log_init(t_r.n);
	}
	if (t_r.self) {
		ap_proc_exit(t_r.n, t_r.self, "normal");
		rcpt_proto_free();
	}
	t_r.self = rcpt_proto_start(t_r.n, max_listing);
	T_RCPT_CHECK(t_r.self != NULL && ap_proc_whereis(t_r.n, T_RCPT_NAME) == t_r.self);
	t_rcpt_clear();
}

static inline void t_rcpt_stop(void)
{
	t_rcpt_clear();
	free(t_r.out);
	t_r.out = NULL;
	t_r.cap = 0;
	if (t_r.self) {
		ap_proc_exit(t_r.n, t_r.self, "normal");
		rcpt_proto_free();
		t_r.self = NULL;
	}
	if (t_r.n)
		ap_node_free(t_r.n);
	t_r.n = NULL;
}

/* One message (version byte first) to actor_receptionist, as the runtime
 * delivers it. -1 when the runtime would refuse it (not one whole term),
 * else the kind it was delivered as. */
static int t_rcpt_deliver(const char *buf, int len)
{
	if (len < 1 || ap_term_validate_msg(buf, (size_t)len))
		return -1;
	ap_msg m = { .kind = AP_MSG_INFO, .buf = buf, .len = len, .index = 1 };
	ap_node_classify(&m);
	t_r.call = &m;
	t_r.replies = 0;
	t_r.self->fn(t_r.n, t_r.self, &m);
	T_RCPT_CHECK(t_r.replies == (m.kind == AP_MSG_CALL ? 1 : 0));
	t_r.call = NULL;
	return (int)m.kind;
}

#endif
