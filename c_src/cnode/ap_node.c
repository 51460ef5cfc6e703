/* ap_node: connections, the process table and message dispatch of a C node.
 *
 * Everything here runs on the loop thread except ap_node_post (any thread)
 * and the handshakes (ap_setup's thread). A connection exists in the table
 * only after its handshake; ei has forgotten its fd by then, so this file is
 * its only reader and writer.
 *
 * Over 700 lines, kept whole: the process table, the connection table and
 * dispatch share the loop's private state (ap_node_int.h) and every path
 * from a frame to a process crosses all three; the codec and the event
 * loop it calls live apart (dist/, io/).
 */
#include "ap_node.h"
#include "ap_node_int.h"

#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "ap_ctrl.h"
#include "ap_dec.h"
#include "ap_frame.h"
#include "ap_io.h"
#include "ap_log.h"
#include "ap_sendq.h"
#include "ap_setup.h"
#include "ap_term.h"
#include "ap_time.h"

#define PROC_BUCKETS 256
#define READER_QUEUE 0
#define READER_STDIN 1
#define READER_EXTRA 2 /* ap_node_add_reader: ids READER_EXTRA.., for the owner of the node */
#define N_EXTRA 2      /* the pool node: its child-exit signalfd, its ring bell (epoll) */
#define TICK_ANSWER_GAP_MS 100   /* answer a tick unless we sent something this recently */
#define PARENT_RETRY_MS 500
#define PARENT_ATTEMPTS 20
#define TAG_PARENT 1
/* A peer is taken to have stopped reading when more than out_limit bytes
 * wait for it and none has been written for OUT_STALL_MS, or when twice
 * out_limit wait: a reader that is merely behind (a burst of replies, a GC
 * pause) keeps its connection, one that stopped costs bounded memory. */
#define OUT_LIMIT_MIN (64u << 20)
#define OUT_STALL_MS 5000

struct ap_conn {
	ap_io_conn *io;
	char peer[MAXNODELEN + 1];
	ap_frame_rx rx;
	int64_t last_rx_ms, last_tx_ms;
	uint64_t seen_out;    /* io->bytes_out when last looked at */
	int64_t progress_ms;  /* when bytes were last written, or the queue was under out_limit */
	ap_node *node;
	struct ap_conn *next;
};

struct ap_timer {
	int64_t at_ms;
	ap_loop_fn fn;
	void *arg;
	struct ap_timer *next;
};

struct ap_call_item {
	ap_loop_fn fn;
	void *arg;
};

struct ap_node {
	ap_node_cfg cfg;
	ap_loop_fn parent_up_fn;
	void *parent_up_arg;
	char name[MAXNODELEN + 1];
	ei_cnode ec;
	ap_loop *loop;
	ap_sendq q;
	ap_setup *setup;
	int lfd, epmd_fd, port;
	ap_conn *conns;
	ap_proc *procs[PROC_BUCKETS];
	ap_node_stats stats;
	size_t out_limit;         /* max(4 * max_frame, OUT_LIMIT_MIN): see OUT_STALL_MS */
	int64_t now_ms, next_tick_ms, parent_retry_ms;
	int parent_attempts;
	int ready_sent;
	ap_proc *kernel;          /* net_kernel: also the sender of replies we make ourselves */
	FILE *dump;               /* $ACTOR_POOL_FRAME_DUMP: every received frame, for captures */
	struct ap_timer *timers;  /* one-shot timers, soonest first */
	ap_dead_letter_fn dead_letter;
	ap_idle_fn idle;
	void *idle_arg;
	ap_loop_fn extra_fn[N_EXTRA];
	void *extra_arg[N_EXTRA];
	volatile int stop;
	int outlived; /* ap_node_outlived_by_threads */
};

/* ---- processes ---------------------------------------------------------- */

static unsigned pid_hash(const erlang_pid *p) { return (p->num ^ (p->serial << 7)) % PROC_BUCKETS; }

static int is_local(const ap_node *n, const erlang_pid *p)
{
	return p->creation == n->ec.creation && strcmp(p->node, n->name) == 0;
}

static ap_proc *find_pid(ap_node *n, const erlang_pid *p)
{
	if (!is_local(n, p))
		return NULL;
	for (ap_proc *q = n->procs[pid_hash(p)]; q; q = q->next)
		if (q->pid.num == p->num && q->pid.serial == p->serial)
			return q;
	return NULL;
}

ap_proc *ap_proc_whereis(ap_node *n, const char *name)
{
	/* Few processes have names; a scan is cheaper than another table. */
	for (int b = 0; b < PROC_BUCKETS; b++)
		for (ap_proc *q = n->procs[b]; q; q = q->next)
			if (q->name[0] && strcmp(q->name, name) == 0)
				return q;
	return NULL;
}

ap_proc *ap_proc_spawn(ap_node *n, const char *name, ap_proc_fn fn, void *state)
{
	if (name && (strlen(name) >= MAXATOMLEN_UTF8 || ap_proc_whereis(n, name)))
		return NULL;
	ap_proc *p = calloc(1, sizeof *p);
	if (!p)
		return NULL;
	if (ei_make_pid(&n->ec, &p->pid)) {
		free(p);
		return NULL;
	}
	if (name)
		strcpy(p->name, name);
	p->fn = fn;
	p->state = state;
	unsigned h = pid_hash(&p->pid);
	p->next = n->procs[h];
	n->procs[h] = p;
	return p;
}

static ap_conn *conn_for(ap_node *n, const char *node)
{
	for (ap_conn *c = n->conns; c; c = c->next)
		if (!c->io->closing && strcmp(c->peer, node) == 0)
			return c;
	return NULL;
}

/* Close c if its peer has stopped reading (see OUT_STALL_MS); 1 if so. */
static int conn_close_if_not_reading(ap_node *n, ap_conn *c)
{
	ap_io_conn *io = c->io;
	size_t unsent = io->out.len;
	if (io->inflight_off < io->inflight.len) /* off stays at the old length after a send */
		unsent += io->inflight.len - io->inflight_off;
	if (io->bytes_out != c->seen_out || unsent <= n->out_limit) {
		c->seen_out = io->bytes_out;
		c->progress_ms = n->now_ms;
	}
	if (unsent <= n->out_limit ||
	    (unsent <= 2 * n->out_limit && n->now_ms - c->progress_ms < OUT_STALL_MS))
		return 0;
	char peer[4 * MAXNODELEN + 8];
	ap_log(AP_LOG_WARNING, "closing connection to %s: %zu bytes unsent, none written for %lld ms, peer not reading",
	       ap_log_escape(peer, sizeof peer, c->peer), unsent, (long long)(n->now_ms - c->progress_ms));
	ap_loop_close(n->loop, io, ENOBUFS);
	return 1;
}

static void conn_flush(ap_node *n, ap_conn *c)
{
	c->last_tx_ms = n->now_ms;
	if (conn_close_if_not_reading(n, c))
		return;
	ap_loop_flush(n->loop, c->io);
}

void ap_proc_exit(ap_node *n, ap_proc *p, const char *reason_atom)
{
	char reason[MAXATOMLEN_UTF8 + 8];
	int rlen = 0;
	ei_encode_atom_as(reason, &rlen, reason_atom, ERLANG_UTF8, ERLANG_UTF8); /* names are UTF-8 */
	for (int i = 0; i < p->nlinks; i++) {
		ap_conn *c = conn_for(n, p->links[i].node);
		if (!c)
			continue;
		size_t st = ap_frame_begin(&c->io->out);
		if (ap_enc_exit(&c->io->out, &p->pid, &p->links[i], reason, rlen) || ap_frame_end(&c->io->out, st))
			continue;
		conn_flush(n, c);
	}
	ap_proc **pp = &n->procs[pid_hash(&p->pid)];
	while (*pp != p)
		pp = &(*pp)->next;
	*pp = p->next;
	free(p->links);
	free(p);
}

static int pid_eq(const erlang_pid *a, const erlang_pid *b)
{
	return a->num == b->num && a->serial == b->serial && a->creation == b->creation &&
	       strcmp(a->node, b->node) == 0;
}

static void link_add(ap_proc *p, const erlang_pid *remote)
{
	for (int i = 0; i < p->nlinks; i++)
		if (pid_eq(&p->links[i], remote))
			return;
	if (p->nlinks == p->caplinks) {
		int cap = p->caplinks ? p->caplinks * 2 : 4;
		erlang_pid *l = realloc(p->links, (size_t)cap * sizeof *l);
		if (!l)
			return;
		p->links = l;
		p->caplinks = cap;
	}
	p->links[p->nlinks++] = *remote;
}

static void link_del(ap_proc *p, const erlang_pid *remote)
{
	for (int i = 0; i < p->nlinks; i++)
		if (pid_eq(&p->links[i], remote)) {
			p->links[i] = p->links[--p->nlinks];
			return;
		}
}

/* ---- sending ------------------------------------------------------------ */

int ap_send(ap_node *n, const ap_proc *from, const erlang_pid *to, const char *term, int len)
{
	(void)from; /* SEND carries no sender: ei advertises no SEND_SENDER */
	ap_conn *c = conn_for(n, to->node);
	if (!c) {
		n->stats.dropped++;
		return -1;
	}
	ap_buf *b = &c->io->out;
	size_t st = ap_frame_begin(b);
	if (ap_enc_send(b, to) || ap_enc_msg_raw(b, term, len) || ap_frame_end(b, st))
		return -1;
	conn_flush(n, c);
	return 0;
}

int ap_send_named(ap_node *n, const ap_proc *from, const char *node, const char *name, const char *term,
		  int len)
{
	ap_conn *c = conn_for(n, node);
	if (!c) {
		n->stats.dropped++;
		return -1;
	}
	ap_buf *b = &c->io->out;
	size_t st = ap_frame_begin(b);
	if (ap_enc_reg_send(b, &from->pid, name) || ap_enc_msg_raw(b, term, len) || ap_frame_end(b, st))
		return -1;
	conn_flush(n, c);
	return 0;
}

int ap_reply(ap_node *n, const ap_proc *self, const ap_msg *call, const char *term, int len)
{
	ap_conn *c = call->conn && !call->conn->io->closing ? call->conn : conn_for(n, call->from.node);
	if (!c) {
		n->stats.dropped++;
		return -1;
	}
	if (ap_encode_reply(&c->io->out, &self->pid, &call->from, call->tag, call->tag_len, term, len))
		return -1;
	conn_flush(n, c);
	return 0;
}

int ap_reply_atom(ap_node *n, const ap_proc *self, const ap_msg *call, const char *atom)
{
	char buf[MAXATOMLEN_UTF8 + 8];
	int i = 0;
	ei_encode_atom(buf, &i, atom);
	return ap_reply(n, self, call, buf, i);
}

int ap_link(ap_node *n, ap_proc *p, const erlang_pid *remote)
{
	ap_conn *c = conn_for(n, remote->node);
	if (!c)
		return -1;
	size_t st = ap_frame_begin(&c->io->out);
	if (ap_enc_link(&c->io->out, &p->pid, remote) || ap_frame_end(&c->io->out, st))
		return -1;
	link_add(p, remote);
	conn_flush(n, c);
	return 0;
}

int ap_node_post(ap_node *n, const char *node, const uint8_t *frame, size_t len)
{
	ap_sendq_item *it = ap_sendq_item_new(AP_Q_FRAME, node, len);
	if (!it)
		return -1;
	memcpy(it->data, frame, len);
	ap_sendq_push(&n->q, it);
	return 0;
}

/* ---- receiving ---------------------------------------------------------- */

static int log_unknown(ap_node *n)
{
	/* Everything is counted (deliver); the first few are logged and then
	 * every 1000th, so a misdirected stream cannot flood the log. */
	uint64_t k = n->stats.unknown_name;
	return k <= 10 || k % 1000 == 0;
}

/* Parse {'$gen_call', {Pid, Tag}, Req} or {'$gen_cast', Req}; fills m.
 * Anything else stays an INFO. m->buf may hold only the start of the
 * message (the head of an oversized frame): each part is proved to lie
 * within m->len before ei reads it, and the request may be cut short.
 * (Not static only for fuzz_classify: see ap_node_int.h.) */
void ap_node_classify(ap_msg *m)
{
	const char *b = m->buf;
	size_t len = m->len > 0 ? (size_t)m->len : 0;
	int i = 1, arity, type, size;
	char atom[16];
	/* 131, then SMALL_TUPLE_EXT (1-byte arity) or LARGE_TUPLE_EXT (4). */
	if (len < 3 || (uint8_t)b[0] != 131 || ((uint8_t)b[1] != 104 && ((uint8_t)b[1] != 105 || len < 6)))
		return;
	if (ei_decode_tuple_header(b, &i, &arity) || (arity != 2 && arity != 3))
		return;
	if (ap_term_end(b, len, i) < 0 || ap_get_atom(b, &i, atom, sizeof atom))
		return;
	if (arity == 3 && strcmp(atom, AP_GEN_CALL) == 0) {
		int a2;
		erlang_pid from;
		/* {Pid, Tag} whole, then its parts. */
		if (ap_term_end(b, len, i) < 0 || ei_decode_tuple_header(b, &i, &a2) || a2 != 2 ||
		    ei_get_type(b, &i, &type, &size) || type != ERL_PID_EXT || ei_decode_pid(b, &i, &from))
			return;
		/* The tag's end by the walk: it is copied into the reply, and
		 * the request starts there. */
		int t0 = i;
		if (ap_term_skip(b, len, &i))
			return;
		m->kind = AP_MSG_CALL;
		m->from = from;
		m->tag = b + t0;
		m->tag_len = i - t0;
		m->index = i;
	} else if (arity == 2 && strcmp(atom, AP_GEN_CAST) == 0) {
		m->kind = AP_MSG_CAST;
		m->index = i;
	}
}

static void deliver(ap_node *n, ap_conn *c, ap_proc *p, const ap_ctrl *ctl, const char *toname)
{
	ap_msg m = { .kind = AP_MSG_INFO, .buf = ctl->msg, .len = ctl->msg_len, .index = 1, .conn = c };
	ap_node_classify(&m);
	if (p) {
		n->stats.received++;
		p->fn(n, p, &m);
		return;
	}
	n->stats.unknown_name++;
	if (n->dead_letter && n->dead_letter(n, n->kernel, &m, c->peer, toname))
		return;
	if (log_unknown(n)) {
		/* Both names come from the peer: escaped, a name cannot forge
		 * log lines. */
		char peer[4 * MAXNODELEN + 8], name[2 * MAXATOMLEN_UTF8];
		ap_log_escape(peer, sizeof peer, c->peer);
		if (toname)
			ap_log(AP_LOG_WARNING, "message from %s to unregistered name '%s' dropped (%llu so far)",
			       peer, ap_log_escape(name, sizeof name, toname),
			       (unsigned long long)n->stats.unknown_name);
		else
			ap_log(AP_LOG_WARNING, "message from %s to dead pid <%u.%u> dropped (%llu so far)", peer,
			       ctl->to.num, ctl->to.serial, (unsigned long long)n->stats.unknown_name);
	}
	if (m.kind == AP_MSG_CALL) {
		/* A caller's monitor never fires on a C-node process: answer, or
		 * it would wait out its whole timeout. */
		if (ap_enc_error_reply(&c->io->out, &n->kernel->pid, &m.from, m.tag, m.tag_len, "noproc") == 0)
			conn_flush(n, c);
	}
}

static void on_exit_signal(ap_node *n, ap_conn *c, const ap_ctrl *ctl)
{
	ap_proc *p = find_pid(n, &ctl->to);
	if (!p)
		return;
	if (ctl->op == AP_OP_EXIT)
		link_del(p, &ctl->from);
	ap_msg m = { .kind = AP_MSG_EXIT, .buf = ctl->reason, .len = ctl->reason_len, .index = 0,
		     .from = ctl->from, .exit2 = ctl->op == AP_OP_EXIT2, .conn = c };
	n->stats.received++;
	p->fn(n, p, &m);
}

static void send_exit_noproc(ap_node *n, ap_conn *c, const erlang_pid *from, const erlang_pid *to)
{
	size_t st = ap_frame_begin(&c->io->out);
	if (ap_enc_exit_atom(&c->io->out, from, to, "noproc") == 0 && ap_frame_end(&c->io->out, st) == 0)
		conn_flush(n, c);
}

static void bad_frame(ap_node *n, ap_conn *c, const char *why)
{
	char peer[4 * MAXNODELEN + 8];
	n->stats.bad_frames++;
	ap_log(AP_LOG_WARNING, "closing connection to %s: %s", ap_log_escape(peer, sizeof peer, c->peer), why);
}

/* A frame over max_frame: its first bytes are here, the rest is being
 * passed over. Nothing is delivered; a call whose caller and tag are in
 * those bytes is answered {error, too_large}, as a missing process would be
 * answered noproc, so the caller does not wait out its timeout. The
 * connection stays while the frame's length can be trusted to keep the
 * stream in step: its head reads as a control message, or starts as one
 * and was cut before it ended (an EXIT reason, a trace token longer than
 * the head). A head that is no control message at all means the length
 * came from bytes out of step (junk, a peer's framing bug): skipping by it
 * would pass over up to 4 GiB of good frames, so the connection closes as
 * for any bad frame. */
static int on_oversize(void *arg, const uint8_t *head, size_t hl, uint32_t flen)
{
	ap_conn *c = arg;
	ap_node *n = c->node;
	const char *what = "frame";
	char to[2 * MAXATOMLEN_UTF8] = "unknown (header cut short)";
	char from[MAXATOMLEN_UTF8 + 48] = "";
	char peer[4 * MAXNODELEN + 8];
	int answered = 0;
	ap_ctrl ctl;
	int r = ap_ctrl_decode_head(head, hl, &ctl);
	if (r == -EBADMSG || (r == -ENODATA && hl == flen)) {
		/* (A whole frame that is no control message is bad as well.) */
		bad_frame(n, c, "oversized frame that is no control message: stream out of step");
		return -EBADMSG;
	}
	uint64_t k = ++n->stats.oversized;
	ap_log_escape(peer, sizeof peer, c->peer);
	if (r == 0 && (ctl.op == AP_OP_SEND || ctl.op == AP_OP_REG_SEND || ctl.op == AP_OP_ALIAS_SEND)) {
		ap_msg m = { .kind = AP_MSG_INFO, .buf = ctl.msg, .len = ctl.msg_len, .index = 1, .conn = c };
		ap_node_classify(&m);
		what = m.kind == AP_MSG_CALL ? "call" : m.kind == AP_MSG_CAST ? "cast" : "message";
		if (ctl.op == AP_OP_REG_SEND) {
			char name[2 * MAXATOMLEN_UTF8 - 2];
			snprintf(to, sizeof to, "'%s'", ap_log_escape(name, sizeof name, ctl.toname));
		} else if (ctl.op == AP_OP_SEND) {
			snprintf(to, sizeof to, "<%u.%u>", ctl.to.num, ctl.to.serial);
		} else {
			snprintf(to, sizeof to, "an alias");
		}
		/* Who sent it: the caller of a call, else the sender a REG_SEND
		 * or ALIAS_SEND names (a SEND names none). */
		const erlang_pid *sender = m.kind == AP_MSG_CALL ? &m.from : ctl.op != AP_OP_SEND ? &ctl.from : NULL;
		if (sender)
			snprintf(from, sizeof from, " <%u.%u>", sender->num, sender->serial);
		if (m.kind == AP_MSG_CALL) {
			if (ap_enc_error_reply(&c->io->out, &n->kernel->pid, &m.from, m.tag, m.tag_len, "too_large") ==
			    0) {
				conn_flush(n, c);
				answered = 1;
			}
		}
	} else if (r == 0 || r == -ENOTSUP) {
		what = "control message";
		snprintf(to, sizeof to, "unknown");
		if (r == 0 && ctl.to.node[0])
			snprintf(to, sizeof to, "<%u.%u>", ctl.to.num, ctl.to.serial);
		if (r == 0 && ctl.from.node[0])
			snprintf(from, sizeof from, " <%u.%u>", ctl.from.num, ctl.from.serial);
	}
	/* One format for every case: ap_log limits it as one kind. */
	ap_log(AP_LOG_WARNING, "oversized %s from%s on %s to %s dropped%s: %u bytes, max_frame %u (%llu so far)",
	       what, from, peer, to, answered ? ", answered {error, too_large}" : "", flen, n->cfg.max_frame,
	       (unsigned long long)k);
	return 0;
}

static int on_frame(void *arg, const uint8_t *f, size_t len)
{
	ap_conn *c = arg;
	ap_node *n = c->node;
	if (n->dump) {
		uint8_t h[4];
		ap_put32be(h, (uint32_t)len);
		fwrite(h, 1, 4, n->dump);
		fwrite(f, 1, len, n->dump);
		fflush(n->dump);
	}
	if (len == 0) {
		/* A tick. Answer unless we sent something just now: the peer
		 * only needs to hear from us, and two C nodes must not answer
		 * each other's answers forever. */
		if (n->now_ms - c->last_tx_ms >= TICK_ANSWER_GAP_MS && ap_enc_tick(&c->io->out) == 0)
			conn_flush(n, c);
		return 0;
	}
	ap_ctrl ctl;
	int r = ap_ctrl_decode(f, len, &ctl);
	if (r == -ENOTSUP) {
		ap_log(AP_LOG_INFO, "unsupported control message from %s dropped", c->peer);
		return 0;
	}
	if (r) {
		bad_frame(n, c, "malformed control message or term");
		return -EBADMSG;
	}
	switch (ctl.op) {
	case AP_OP_SEND:
		deliver(n, c, find_pid(n, &ctl.to), &ctl, NULL);
		break;
	case AP_OP_REG_SEND:
		deliver(n, c, ap_proc_whereis(n, ctl.toname), &ctl, ctl.toname);
		break;
	case AP_OP_LINK: {
		ap_proc *p = find_pid(n, &ctl.to);
		if (p)
			link_add(p, &ctl.from);
		else
			send_exit_noproc(n, c, &ctl.to, &ctl.from);
		break;
	}
	case AP_OP_UNLINK_ID: {
		ap_proc *p = find_pid(n, &ctl.to);
		if (p)
			link_del(p, &ctl.from);
		size_t st = ap_frame_begin(&c->io->out);
		if (ap_enc_unlink_id_ack(&c->io->out, ctl.id, &ctl.to, &ctl.from) == 0 &&
		    ap_frame_end(&c->io->out, st) == 0)
			conn_flush(n, c);
		break;
	}
	case AP_OP_UNLINK: {
		ap_proc *p = find_pid(n, &ctl.to);
		if (p)
			link_del(p, &ctl.from);
		break;
	}
	case AP_OP_EXIT:
	case AP_OP_EXIT2:
		on_exit_signal(n, c, &ctl);
		break;
	default:
		/* UNLINK_ID_ACK, GROUP_LEADER, ALIAS_SEND to us: nothing to do. */
		break;
	}
	return 0;
}

/* ---- connections -------------------------------------------------------- */

static void drop_links_to(ap_node *n, const char *peer)
{
	for (int b = 0; b < PROC_BUCKETS; b++)
		for (ap_proc *p = n->procs[b]; p; p = p->next)
			for (int i = 0; i < p->nlinks;)
				if (strcmp(p->links[i].node, peer) == 0)
					p->links[i] = p->links[--p->nlinks];
				else
					i++;
}

static void send_ready(ap_node *n);
static void run_timers(ap_node *n);

static void conn_up(ap_node *n, int fd, const char *peer, int tag)
{
	ap_conn *old = conn_for(n, peer);
	if (old) {
		/* The peer reconnected: whatever the old socket still holds is
		 * from a connection the peer has given up. */
		ap_log(AP_LOG_INFO, "replacing connection to %s", peer);
		ap_loop_close(n->loop, old->io, 0);
	}
	ap_conn *c = calloc(1, sizeof *c);
	if (!c) {
		close(fd);
		return;
	}
	c->node = n;
	snprintf(c->peer, sizeof c->peer, "%s", peer);
	ap_frame_rx_init(&c->rx, n->cfg.max_frame);
	ap_frame_rx_on_oversize(&c->rx, on_oversize, 0);
	c->last_rx_ms = c->last_tx_ms = c->progress_ms = n->now_ms;
	c->io = ap_loop_add_conn(n->loop, fd, c);
	if (!c->io) {
		ap_log(AP_LOG_ERROR, "cannot add connection to %s to the loop", peer);
		free(c);
		return;
	}
	c->next = n->conns;
	n->conns = c;
	n->stats.connections++;
	ap_log(AP_LOG_INFO, "connected to %s", peer);
	if (tag == TAG_PARENT)
		send_ready(n);
	/* Any connection to the parent, ours or one it made to us. The parent
	 * may connect first (its processes send to this node by name as soon
	 * as epmd lists it), and then ours fails: this one makes us ready. */
	if (n->cfg.parent && !strcmp(peer, n->cfg.parent)) {
		send_ready(n);
		n->parent_attempts = 0;
		n->parent_retry_ms = 0;
		if (n->parent_up_fn)
			n->parent_up_fn(n, n->parent_up_arg);
	}
}

void ap_node_on_parent_up(ap_node *n, ap_loop_fn fn, void *arg)
{
	n->parent_up_fn = fn;
	n->parent_up_arg = arg;
}

const char *ap_node_parent(const ap_node *n)
{
	return n->cfg.parent;
}

static void io_on_accept(void *arg, int fd)
{
	ap_node *n = arg;
	ap_setup_accept(n->setup, fd);
}

static int io_on_data(void *arg, ap_io_conn *io, const uint8_t *data, size_t len)
{
	ap_node *n = arg;
	ap_conn *c = io->owner;
	n->now_ms = ap_mono_ms(); /* vDSO, no syscall */
	c->last_rx_ms = n->now_ms;
	int r = ap_frame_rx_feed(&c->rx, data, len, on_frame, c);
	if (r == -EMSGSIZE)
		bad_frame(n, c, "frame larger than max_frame");
	else if (r == -ENOMEM)
		bad_frame(n, c, "out of memory for a frame");
	return r;
}

static void io_on_closed(void *arg, ap_io_conn *io)
{
	ap_node *n = arg;
	ap_conn *c = io->owner;
	ap_conn **pp = &n->conns;
	while (*pp && *pp != c)
		pp = &(*pp)->next;
	if (*pp)
		*pp = c->next;
	n->stats.connections--;
	if (!conn_for(n, c->peer))
		drop_links_to(n, c->peer);
	/* A standalone node (no owner port) that loses its parent connects
	 * again, with the same attempts as at start; a port-mode node leaves
	 * that to its owner, which restarts it. */
	if (!n->cfg.port_mode && n->cfg.parent && !strcmp(c->peer, n->cfg.parent) && !conn_for(n, c->peer) &&
	    !n->stop)
		n->parent_retry_ms = n->now_ms + PARENT_RETRY_MS;
	ap_log(AP_LOG_INFO, "connection to %s closed%s%s", c->peer, io->close_err ? ": " : "",
	       io->close_err ? strerror(io->close_err) : "");
	ap_frame_rx_free(&c->rx);
	free(c);
}

static void drain_queue(ap_node *n)
{
	ap_sendq_item *it = ap_sendq_drain(&n->q);
	while (it) {
		ap_sendq_item *next = it->next;
		ap_setup_result res;
		switch (it->kind) {
		case AP_Q_FRAME: {
			ap_conn *c = conn_for(n, it->node);
			if (c && ap_buf_append(&c->io->out, it->data, it->len) == 0)
				conn_flush(n, c);
			else
				n->stats.dropped++;
			break;
		}
		case AP_Q_CONN_UP:
			memcpy(&res, it->data, sizeof res);
			conn_up(n, res.fd, it->node, res.tag);
			break;
		case AP_Q_CONN_FAILED:
			memcpy(&res, it->data, sizeof res);
			if (res.tag == TAG_PARENT)
				n->parent_retry_ms = n->now_ms + PARENT_RETRY_MS;
			break;
		case AP_Q_CALL: {
			struct ap_call_item ci;
			memcpy(&ci, it->data, sizeof ci);
			n->now_ms = ap_mono_ms();
			ci.fn(n, ci.arg);
			break;
		}
		}
		free(it);
		it = next;
	}
}

void ap_node_run_queued(ap_node *n) { drain_queue(n); }

static void io_on_readable(void *arg, int id)
{
	ap_node *n = arg;
	if (id == READER_QUEUE) {
		drain_queue(n);
	} else if (id >= READER_EXTRA && id < READER_EXTRA + N_EXTRA) {
		if (n->extra_fn[id - READER_EXTRA])
			n->extra_fn[id - READER_EXTRA](n, n->extra_arg[id - READER_EXTRA]);
	} else if (id == READER_STDIN) {
		char buf[4096];
		ssize_t r = read(STDIN_FILENO, buf, sizeof buf);
		if (r == 0 || (r < 0 && errno != EAGAIN && errno != EINTR)) {
			ap_log(AP_LOG_INFO, "owner port closed, stopping");
			n->stop = 1;
		}
	}
}

/* Periodic: drop silent peers, tick quiet ones, retry the parent. */
static void on_timer(ap_node *n)
{
	int idle = n->cfg.idle_timeout_ms;
	for (ap_conn *c = n->conns; c; c = c->next) {
		if (c->io->closing)
			continue;
		if (n->now_ms - c->last_rx_ms > idle) {
			ap_log(AP_LOG_WARNING, "closing connection to %s: silent for %d ms", c->peer, idle);
			ap_loop_close(n->loop, c->io, ETIMEDOUT);
			continue;
		}
		/* A peer that stopped reading and sends nothing more is found
		 * here, not only when something is queued for it. */
		if (conn_close_if_not_reading(n, c))
			continue;
		if (n->now_ms - c->last_tx_ms >= idle / 4 && ap_enc_tick(&c->io->out) == 0)
			conn_flush(n, c);
	}
	if (n->parent_retry_ms && n->now_ms >= n->parent_retry_ms) {
		n->parent_retry_ms = 0;
		if (++n->parent_attempts >= PARENT_ATTEMPTS) {
			ap_log(AP_LOG_ERROR, "cannot connect to %s, giving up", n->cfg.parent);
			n->stop = 1;
		} else {
			ap_setup_connect(n->setup, n->cfg.parent, TAG_PARENT);
		}
	}
}

/* ---- the built-in net_kernel -------------------------------------------- */

/* net_adm:ping/1 calls net_kernel with {is_auth, Node}; answer yes. */
static void net_kernel_fn(ap_node *n, ap_proc *self, const ap_msg *m)
{
	if (m->kind == AP_MSG_CALL)
		ap_reply_atom(n, self, m, "yes");
}

/* ---- life cycle --------------------------------------------------------- */

static void send_ready(ap_node *n)
{
	if (n->ready_sent)
		return;
	n->ready_sent = 1;
	ap_log(AP_LOG_NOTICE, "%s ready: port %d, io %s, os pid %d", n->name, n->port, ap_loop_backend(n->loop),
	       (int)getpid());
	if (!n->cfg.port_mode)
		return;
	ei_x_buff x;
	ei_x_new_with_version(&x);
	ei_x_encode_tuple_header(&x, 2);
	ei_x_encode_atom(&x, "ready");
	ei_x_encode_map_header(&x, 4);
	ei_x_encode_atom(&x, "node");
	ei_x_encode_atom(&x, n->name);
	ei_x_encode_atom(&x, "os_pid");
	ei_x_encode_long(&x, (long)getpid());
	ei_x_encode_atom(&x, "io");
	ei_x_encode_atom(&x, ap_loop_backend(n->loop));
	ei_x_encode_atom(&x, "port");
	ei_x_encode_long(&x, n->port);
	ap_port_write_packet(x.buff, x.index);
	ei_x_free(&x);
}

ap_node *ap_node_new(const ap_node_cfg *cfg)
{
	ap_node *n = calloc(1, sizeof *n);
	if (!n)
		return NULL;
	n->cfg = *cfg;
	/* The clock before the loop first reads it: what init starts (a
	 * standalone node's pools) is stamped with the time, not with 0. */
	n->now_ms = ap_mono_ms();
	n->lfd = n->epmd_fd = -1;
	if (!n->cfg.max_frame)
		n->cfg.max_frame = AP_FRAME_DEFAULT_MAX;
	n->out_limit = (size_t)n->cfg.max_frame * 4;
	if (n->out_limit < OUT_LIMIT_MIN)
		n->out_limit = OUT_LIMIT_MIN;
	if (n->cfg.idle_timeout_ms <= 0)
		n->cfg.idle_timeout_ms = 60000;
	if (!n->cfg.io)
		n->cfg.io = getenv("ACTOR_POOL_IO");
	snprintf(n->name, sizeof n->name, "%s", cfg->node);
	n->q.efd = -1;
	if (getenv("ACTOR_POOL_FRAME_DUMP"))
		n->dump = fopen(getenv("ACTOR_POOL_FRAME_DUMP"), "ab");

	static const ap_io_cbs cbs = {
		.on_accept = io_on_accept,
		.on_data = io_on_data,
		.on_closed = io_on_closed,
		.on_readable = io_on_readable,
	};
	if (ap_ei_init(&n->ec, cfg->node, cfg->cookie, cfg->creation))
		goto err;
	if (ap_sendq_init(&n->q))
		goto err;
	n->q.dispose = ap_setup_dispose;
	n->loop = ap_loop_new(n->cfg.io, &cbs, n);
	if (!n->loop)
		goto err;
	n->kernel = ap_proc_spawn(n, "net_kernel", net_kernel_fn, NULL);
	if (!n->kernel)
		goto err;
	return n;
err:
	ap_node_free(n);
	return NULL;
}

void ap_node_free(ap_node *n)
{
	if (!n)
		return;
	ap_setup_stop(n->setup);
	n->setup = NULL;
	/* Close connections and let the loop report them. */
	for (ap_conn *c = n->conns; c; c = c->next)
		ap_loop_close(n->loop, c->io, 0);
	while (n->conns && n->loop)
		ap_loop_run_once(n->loop, 100);
	if (n->epmd_fd >= 0)
		close(n->epmd_fd); /* unregisters from epmd */
	n->epmd_fd = -1;
	if (n->lfd >= 0)
		close(n->lfd);
	n->lfd = -1;
	if (n->dump)
		fclose(n->dump);
	n->dump = NULL;
	if (n->outlived)
		return; /* the exit frees the rest: see ap_node_outlived_by_threads */
	while (n->timers) {
		struct ap_timer *t = n->timers;
		n->timers = t->next;
		free(t);
	}
	for (int b = 0; b < PROC_BUCKETS; b++)
		while (n->procs[b]) {
			ap_proc *p = n->procs[b];
			n->procs[b] = p->next;
			free(p->links);
			free(p);
		}
	ap_loop_free(n->loop);
	if (n->q.efd >= 0)
		ap_sendq_destroy(&n->q);
	free(n);
}

void ap_node_outlived_by_threads(ap_node *n) { n->outlived = 1; }

int ap_node_run(ap_node *n)
{
	signal(SIGPIPE, SIG_IGN);
	n->now_ms = ap_mono_ms();
	n->lfd = ap_ei_listen(&n->ec, n->cfg.listen, &n->port);
	if (n->lfd < 0)
		return -EIO;
	n->epmd_fd = ei_publish(&n->ec, n->port);
	if (n->epmd_fd < 0) {
		ap_log(AP_LOG_ERROR, "cannot publish %s to epmd (is epmd running?)", n->name);
		return -EIO;
	}
	const ap_setup_cfg scfg = {
		.handshake_ms = n->cfg.handshake_timeout_ms,
		.max_pending = n->cfg.max_handshakes,
		.max_per_source = n->cfg.max_handshakes_per_source,
	};
	n->setup = ap_setup_start(&n->ec, &n->q, &scfg);
	if (!n->setup)
		return -ENOMEM;
	ap_setup_set_listener(n->setup, n->lfd);
	if (ap_loop_listen(n->loop, n->lfd) || ap_loop_add_reader(n->loop, ap_sendq_fd(&n->q), READER_QUEUE))
		return -EIO;
	if (n->cfg.port_mode && ap_loop_add_reader(n->loop, STDIN_FILENO, READER_STDIN))
		return -EIO;
	if (n->cfg.parent && n->cfg.parent[0])
		ap_setup_connect(n->setup, n->cfg.parent, TAG_PARENT);
	else
		send_ready(n);

	int period = n->cfg.idle_timeout_ms / 8;
	if (period < 10)
		period = 10;
	n->next_tick_ms = n->now_ms + period;
	while (!n->stop) {
		int64_t due = n->next_tick_ms;
		if (n->timers && n->timers->at_ms < due)
			due = n->timers->at_ms;
		int64_t wait = due - n->now_ms;
		int busy = n->idle ? n->idle(n, n->idle_arg) : 0;
		if (busy)
			wait = 0;
		if (busy == 2)
			ap_loop_look_now(n->loop);
		int r = ap_loop_run_once(n->loop, wait < 0 ? 0 : (int)wait);
		if (r < 0) {
			ap_log(AP_LOG_ERROR, "event loop failed: %s", strerror(-r));
			return r;
		}
		n->now_ms = ap_mono_ms();
		run_timers(n);
		if (n->now_ms >= n->next_tick_ms) {
			on_timer(n);
			n->next_tick_ms = n->now_ms + period;
		}
	}
	return 0;
}

void ap_node_stop(ap_node *n) { n->stop = 1; }
const char *ap_node_name(const ap_node *n) { return n->name; }
const char *ap_node_backend(const ap_node *n) { return ap_loop_backend(n->loop); }
const ap_node_stats *ap_node_get_stats(const ap_node *n) { return &n->stats; }
uint32_t ap_node_max_frame(const ap_node *n) { return n->cfg.max_frame; }
ei_cnode *ap_node_ei(ap_node *n) { return &n->ec; }

int ap_node_call_on_loop(ap_node *n, ap_loop_fn fn, void *arg)
{
	struct ap_call_item ci = { .fn = fn, .arg = arg };
	ap_sendq_item *it = ap_sendq_item_new(AP_Q_CALL, NULL, sizeof ci);
	if (!it)
		return -1;
	memcpy(it->data, &ci, sizeof ci);
	ap_sendq_push(&n->q, it);
	return 0;
}

void ap_node_call_on_loop_sure(ap_node *n, ap_loop_fn fn, void *arg)
{
	if (ap_node_call_on_loop(n, fn, arg) == 0)
		return;
	ap_log(AP_LOG_WARNING, "out of memory for a call to the event loop; trying again until it is queued");
	/* The loop frees the memory it holds as it runs; a worker thread can
	 * wait for it, and dropping the call would leave a slot for good. */
	struct timespec ms = { 0, 1000000 };
	while (ap_node_call_on_loop(n, fn, arg))
		nanosleep(&ms, NULL);
}

int ap_node_timer(ap_node *n, int delay_ms, ap_loop_fn fn, void *arg)
{
	struct ap_timer *t = malloc(sizeof *t);
	if (!t)
		return -1;
	t->at_ms = ap_mono_ms() + (delay_ms > 0 ? delay_ms : 0);
	t->fn = fn;
	t->arg = arg;
	/* Few timers are live at once (worker restarts, a stats tick): a
	 * sorted list is enough. */
	struct ap_timer **pp = &n->timers;
	while (*pp && (*pp)->at_ms <= t->at_ms)
		pp = &(*pp)->next;
	t->next = *pp;
	*pp = t;
	return 0;
}

static void run_timers(ap_node *n)
{
	while (n->timers && n->timers->at_ms <= n->now_ms) {
		struct ap_timer *t = n->timers;
		n->timers = t->next;
		t->fn(n, t->arg);
		free(t);
	}
}

void ap_node_set_dead_letter(ap_node *n, ap_dead_letter_fn fn) { n->dead_letter = fn; }

void ap_node_set_idle(ap_node *n, ap_idle_fn fn, void *arg)
{
	n->idle = fn;
	n->idle_arg = arg;
}

int ap_node_add_reader(ap_node *n, int fd, ap_loop_fn fn, void *arg)
{
	int i = 0;
	while (i < N_EXTRA && n->extra_fn[i])
		i++;
	if (i == N_EXTRA)
		return -EBUSY;
	int r = ap_loop_add_reader(n->loop, fd, READER_EXTRA + i);
	if (r == 0) {
		n->extra_fn[i] = fn;
		n->extra_arg[i] = arg;
	}
	return r;
}

int ap_node_futex_supported(const ap_node *n) { return ap_loop_futex_supported(n->loop); }

int ap_node_futex_wait(ap_node *n, ap_io_futex *f, uint32_t *word, uint32_t expected, int timeout_ms)
{
	return ap_loop_futex_wait(n->loop, f, word, expected, timeout_ms);
}

void ap_node_futex_cancel(ap_node *n, ap_io_futex *f) { ap_loop_futex_cancel(n->loop, f); }
int64_t ap_node_now_ms(const ap_node *n) { return n->now_ms; }
