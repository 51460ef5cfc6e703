/* actor_echo_node: the smallest service on the C-node runtime, for tests
 * and the runtime benchmark (built into build/testbin/, never priv/).
 *
 * Registered as `echo`:
 *   call ping -> pong; call pid -> its pid; call spawn -> {ok, Pid} of a
 *   temporary process; call stats -> a map of counters; any other call
 *   Req -> Req.
 *   cast {reply_to, Pid, Term} -> Pid ! Term
 *   info {Pid, Term} -> Pid ! Term; {batch, List} counts length(List);
 *   anything else is counted.
 * A temporary process stops on `stop` (reason normal) or {stop, Reason},
 * and its links get the EXIT.
 */
#include <ei.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>

#include "ap_dec.h"
#include "ap_main.h"
#include "ap_term.h"

struct echo_state {
	unsigned long long tells; /* messages counted, batch elements included */
};

static struct echo_state st;

/* The term at m->index, as bytes: its end by the walk, so an echo never
 * carries bytes past the validated message. */
static int term_span(const ap_msg *m, const char **p, int *len)
{
	int i = m->index;
	if (ap_term_skip(m->buf, (size_t)m->len, &i))
		return -1;
	*p = m->buf + m->index;
	*len = i - m->index;
	return 0;
}

static void reply_pid(ap_node *n, ap_proc *self, const ap_msg *m, const erlang_pid *pid, int ok_tuple)
{
	ei_x_buff x;
	ei_x_new(&x);
	if (ok_tuple) {
		ei_x_encode_tuple_header(&x, 2);
		ei_x_encode_atom(&x, "ok");
	}
	ei_x_encode_pid(&x, pid);
	ap_reply(n, self, m, x.buff, x.index);
	ei_x_free(&x);
}

static void reply_stats(ap_node *n, ap_proc *self, const ap_msg *m)
{
	const ap_node_stats *s = ap_node_get_stats(n);
	struct rusage ru;
	getrusage(RUSAGE_SELF, &ru);
	ei_x_buff x;
	ei_x_new(&x);
	ei_x_encode_map_header(&x, 9);
	ei_x_encode_atom(&x, "received");
	ei_x_encode_ulonglong(&x, s->received);
	ei_x_encode_atom(&x, "tells");
	ei_x_encode_ulonglong(&x, st.tells);
	ei_x_encode_atom(&x, "unknown_name");
	ei_x_encode_ulonglong(&x, s->unknown_name);
	ei_x_encode_atom(&x, "bad_frames");
	ei_x_encode_ulonglong(&x, s->bad_frames);
	ei_x_encode_atom(&x, "oversized");
	ei_x_encode_ulonglong(&x, s->oversized);
	ei_x_encode_atom(&x, "utime_us");
	ei_x_encode_longlong(&x, (long long)ru.ru_utime.tv_sec * 1000000 + ru.ru_utime.tv_usec);
	ei_x_encode_atom(&x, "stime_us");
	ei_x_encode_longlong(&x, (long long)ru.ru_stime.tv_sec * 1000000 + ru.ru_stime.tv_usec);
	ei_x_encode_atom(&x, "io");
	ei_x_encode_atom(&x, ap_node_backend(n));
	ei_x_encode_atom(&x, "connections");
	ei_x_encode_long(&x, s->connections);
	ap_reply(n, self, m, x.buff, x.index);
	ei_x_free(&x);
}

/* {Pid, Term} in b[0..len): send Term to Pid. Returns 1 if it was that shape. */
static int forward(ap_node *n, ap_proc *self, const char *b, size_t len, int i)
{
	int arity, type, size;
	erlang_pid to;
	if (ei_decode_tuple_header(b, &i, &arity) || arity != 2 || ei_get_type(b, &i, &type, &size) ||
	    type != ERL_PID_EXT || ei_decode_pid(b, &i, &to))
		return 0;
	int t0 = i;
	if (ap_term_skip(b, len, &i))
		return 0;
	ap_send(n, self, &to, b + t0, i - t0);
	return 1;
}

static void temp_fn(ap_node *n, ap_proc *self, const ap_msg *m)
{
	if (m->kind == AP_MSG_CALL) {
		const char *p;
		int len;
		if (term_span(m, &p, &len) == 0)
			ap_reply(n, self, m, p, len);
		return;
	}
	if (m->kind != AP_MSG_INFO)
		return;
	if (ap_is_atom(m->buf, m->index, "stop")) {
		ap_proc_exit(n, self, "normal");
		return;
	}
	int i = m->index, arity;
	char a[MAXATOMLEN_UTF8], reason[MAXATOMLEN_UTF8];
	if (ei_decode_tuple_header(m->buf, &i, &arity) == 0 && arity == 2 &&
	    ei_decode_atom_as(m->buf, &i, a, sizeof a, ERLANG_UTF8, NULL, NULL) == 0 && !strcmp(a, "stop") &&
	    ei_decode_atom_as(m->buf, &i, reason, sizeof reason, ERLANG_UTF8, NULL, NULL) == 0)
		ap_proc_exit(n, self, reason);
}

static void echo_fn(ap_node *n, ap_proc *self, const ap_msg *m)
{
	const char *b = m->buf;
	switch (m->kind) {
	case AP_MSG_CALL: {
		if (ap_is_atom(m->buf, m->index, "ping")) {
			ap_reply_atom(n, self, m, "pong");
		} else if (ap_is_atom(m->buf, m->index, "pid")) {
			reply_pid(n, self, m, &self->pid, 0);
		} else if (ap_is_atom(m->buf, m->index, "stats")) {
			reply_stats(n, self, m);
		} else if (ap_is_atom(m->buf, m->index, "spawn")) {
			ap_proc *t = ap_proc_spawn(n, NULL, temp_fn, NULL);
			if (t)
				reply_pid(n, self, m, &t->pid, 1);
			else
				ap_reply_atom(n, self, m, "error");
		} else {
			const char *p;
			int len;
			if (term_span(m, &p, &len) == 0)
				ap_reply(n, self, m, p, len);
		}
		break;
	}
	case AP_MSG_CAST: {
		/* {reply_to, Pid, Term} */
		int i = m->index, arity, type, size;
		char a[16];
		erlang_pid to;
		if (ei_decode_tuple_header(b, &i, &arity) || arity != 3 || ap_get_atom(b, &i, a, sizeof a) ||
		    strcmp(a, "reply_to") || ei_get_type(b, &i, &type, &size) || type != ERL_PID_EXT ||
		    ei_decode_pid(b, &i, &to))
			break;
		int t0 = i;
		if (ap_term_skip(b, (size_t)m->len, &i) == 0)
			ap_send(n, self, &to, b + t0, i - t0);
		break;
	}
	case AP_MSG_INFO: {
		int i = m->index, arity, type, size;
		if (b[i] == 'm') { /* a binary: the benchmark's tell */
			st.tells++;
			break;
		}
		if (forward(n, self, b, (size_t)m->len, i)) {
			st.tells++;
			break;
		}
		char a[16];
		if (ei_decode_tuple_header(b, &i, &arity) == 0 && arity == 2 && ap_get_atom(b, &i, a, sizeof a) == 0 &&
		    !strcmp(a, "batch")) {
			int len = 0;
			if (ei_get_type(b, &i, &type, &size) == 0 && (type == ERL_LIST_EXT || type == ERL_STRING_EXT ||
								   type == ERL_NIL_EXT))
				len = size;
			st.tells += (unsigned long long)len;
			break;
		}
		st.tells++;
		break;
	}
	case AP_MSG_EXIT:
		break;
	}
}

static int echo_init(ap_node *n, int argc, char **argv)
{
	(void)argc;
	(void)argv;
	return ap_proc_spawn(n, "echo", echo_fn, &st) ? 0 : 1;
}

int main(int argc, char **argv)
{
	return ap_cnode_main(argc, argv, "actor_echo_node", echo_init);
}
