/* ap_node_recv: what a C node makes of the frames its peers send: each
 * message classified and delivered to its process, exit signals, and the
 * frames it refuses (see ap_node.c). */
#include "ap_node.h"
#include "ap_node_int.h"

#include <errno.h>
#include <stdio.h>
#include <string.h>

#include "ap_ctrl.h"
#include "ap_dec.h"
#include "ap_frame.h"
#include "ap_log.h"
#include "ap_term.h"

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

void bad_frame(ap_node *n, ap_conn *c, const char *why)
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
int on_oversize(void *arg, const uint8_t *head, size_t hl, uint32_t flen)
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

int on_frame(void *arg, const uint8_t *f, size_t len)
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
