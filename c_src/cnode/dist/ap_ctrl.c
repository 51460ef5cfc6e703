/* ap_ctrl: control-message codec for the distribution protocol, and the
 * frames a C node writes. */
#include "ap_ctrl.h"

#include <errno.h>
#include <string.h>

#include "ap_dec.h"
#include "ap_term.h"

/* Upper bound of one encoded pid / atom / small header, so ei encoders can
 * write straight into reserved space. */
#define ENC_SLACK (2 * MAXATOMLEN_UTF8 + 64)

static int dec_pid(const char *buf, int *idx, erlang_pid *p)
{
	int type, size;
	if (ei_get_type(buf, idx, &type, &size) || type != ERL_PID_EXT)
		return -1;
	return ei_decode_pid(buf, idx, p) ? -1 : 0;
}

/* Skip an element of the validated control tuple (buf[0..len), len its end)
 * by the walk, never by ei_skip_term: the end the walk vouched for is the
 * only one to trust. */
static int dec_skip(const char *buf, size_t len, int *idx)
{
	return ap_term_skip(buf, len, idx);
}

/* The first bytes of a control tuple as the BEAM writes one: 'p', 131, a
 * small tuple of 2 to 6 elements whose first is a small integer, an
 * operation id. A head that starts so but whose tuple does not end inside
 * it was cut shorter than its control message (an EXIT reason, a trace
 * token): not a sign of a stream out of step. */
static int starts_like_ctrl(const uint8_t *frame, size_t len)
{
	return len >= 6 && frame[2] == 104 && frame[3] >= 2 && frame[3] <= 6 && frame[4] == 97 && frame[5] >= 1 &&
	       frame[5] <= 40;
}

/* whole: frame is all of a frame; else only its first bytes, whose message
 * (if any) may be cut short and is not checked here. */
static int decode(const uint8_t *frame, size_t len, ap_ctrl *c, int whole)
{
	const char *buf = (const char *)frame;
	int idx = 2, end, arity;
	long op;

	memset(c, 0, sizeof *c);
	if (len < 3 || frame[0] != 'p' || frame[1] != 131 || len > INT32_MAX)
		return -EBADMSG;
	/* Prove the control term lies inside the frame before decoding it. */
	end = idx;
	if (ap_term_skip(buf, len, &end))
		return !whole && starts_like_ctrl(frame, len) ? -ENODATA : -EBADMSG;
	if (ei_decode_tuple_header(buf, &idx, &arity) || arity < 1)
		return -EBADMSG;
	if (ei_decode_long(buf, &idx, &op))
		return -EBADMSG;

	switch (op) {
	case AP_OP_SEND: /* {2, Unused, To} */
	case 12:         /* {12, Unused, To, Token} */
		if (arity != (op == 2 ? 3 : 4) || dec_skip(buf, (size_t)end, &idx) || dec_pid(buf, &idx, &c->to))
			return -EBADMSG;
		if (op == 12 && dec_skip(buf, (size_t)end, &idx)) /* the trace token */
			return -EBADMSG;
		c->op = AP_OP_SEND;
		break;
	case AP_OP_REG_SEND: /* {6, From, Unused, ToName} */
	case 16:             /* {16, From, Unused, ToName, Token} */
		if (arity != (op == 6 ? 4 : 5) || dec_pid(buf, &idx, &c->from) ||
		    dec_skip(buf, (size_t)end, &idx) || ap_get_atom(buf, &idx, c->toname, sizeof c->toname))
			return -EBADMSG;
		if (op == 16 && dec_skip(buf, (size_t)end, &idx)) /* the trace token */
			return -EBADMSG;
		c->op = AP_OP_REG_SEND;
		break;
	case AP_OP_LINK: /* {1, From, To} */
	case AP_OP_UNLINK:
	case AP_OP_GROUP_LEADER:
		if (arity != 3 || dec_pid(buf, &idx, &c->from) || dec_pid(buf, &idx, &c->to))
			return -EBADMSG;
		c->op = (int)op;
		break;
	case AP_OP_UNLINK_ID: /* {35, Id, From, To} */
	case AP_OP_UNLINK_ID_ACK:
		if (arity != 4 || ei_decode_ulonglong(buf, &idx, &c->id) ||
		    dec_pid(buf, &idx, &c->from) || dec_pid(buf, &idx, &c->to))
			return -EBADMSG;
		c->op = (int)op;
		break;
	case AP_OP_EXIT:  /* {3, From, To, Reason} */
	case AP_OP_EXIT2:
	case 13:          /* {13, From, To, Token, Reason} */
	case 18: {
		int tt = op > 10;
		if (arity != (tt ? 5 : 4) || dec_pid(buf, &idx, &c->from) || dec_pid(buf, &idx, &c->to))
			return -EBADMSG;
		if (tt && dec_skip(buf, (size_t)end, &idx))
			return -EBADMSG;
		int r0 = idx;
		if (dec_skip(buf, (size_t)end, &idx))
			return -EBADMSG;
		c->reason = buf + r0;
		c->reason_len = idx - r0;
		c->op = (op == 3 || op == 13) ? AP_OP_EXIT : AP_OP_EXIT2;
		break;
	}
	case AP_OP_ALIAS_SEND: /* {33, From, Alias}: we own no aliases */
		if (arity != 3 || dec_pid(buf, &idx, &c->from) || dec_skip(buf, (size_t)end, &idx))
			return -EBADMSG;
		c->op = AP_OP_ALIAS_SEND;
		break;
	default:
		/* Monitors, spawn and payload variants are never negotiated with
		 * an ei node; a well-formed one is dropped, not fatal. */
		return -ENOTSUP;
	}
	if (idx != end)
		return -EBADMSG; /* trailing elements the arity did not announce */

	if (c->op == AP_OP_SEND || c->op == AP_OP_REG_SEND || c->op == AP_OP_ALIAS_SEND) {
		if (whole && ap_term_validate_msg(buf + end, len - (size_t)end))
			return -EBADMSG;
		c->msg = buf + end;
		c->msg_len = (int)(len - (size_t)end);
	} else if (whole && (size_t)end != len) {
		return -EBADMSG; /* a message after a control op that takes none */
	}
	return 0;
}

int ap_ctrl_decode(const uint8_t *frame, size_t len, ap_ctrl *c)
{
	return decode(frame, len, c, 1);
}

int ap_ctrl_decode_head(const uint8_t *head, size_t len, ap_ctrl *c)
{
	return decode(head, len, c, 0);
}

size_t ap_frame_begin(ap_buf *b)
{
	size_t start = b->len;
	if (ap_buf_reserve(b, 5 + ENC_SLACK))
		return (size_t)-1;
	memset(b->data + b->len, 0, 4);
	b->data[b->len + 4] = 'p';
	b->len += 5;
	return start;
}

int ap_frame_end(ap_buf *b, size_t start)
{
	if (start == (size_t)-1 || b->len < start + 4 || b->len - start - 4 > UINT32_MAX)
		return -1;
	ap_put32be(b->data + start, (uint32_t)(b->len - start - 4));
	return 0;
}

/* Run an ei encoder against the tail of b after reserving `room` bytes. */
#define ENC(b, room, expr)                                        \
	do {                                                      \
		if (ap_buf_reserve((b), (room)))                  \
			return -1;                                \
		char *eb_ = (char *)(b)->data + (b)->len;         \
		int ei_ = 0;                                      \
		(void)eb_;                                        \
		if (expr)                                         \
			return -1;                                \
		(b)->len += (size_t)ei_;                          \
	} while (0)

static int enc_ctrl_head(ap_buf *b, int arity, long op)
{
	ENC(b, 16, ei_encode_version(eb_, &ei_) || ei_encode_tuple_header(eb_, &ei_, arity) ||
			   ei_encode_long(eb_, &ei_, op));
	return 0;
}

static int enc_pid(ap_buf *b, const erlang_pid *p)
{
	ENC(b, ENC_SLACK, ei_encode_pid(eb_, &ei_, p));
	return 0;
}

static int enc_atom(ap_buf *b, const char *a)
{
	ENC(b, ENC_SLACK, ei_encode_atom_as(eb_, &ei_, a, ERLANG_UTF8, ERLANG_UTF8));
	return 0;
}

int ap_enc_send(ap_buf *b, const erlang_pid *to)
{
	return enc_ctrl_head(b, 3, AP_OP_SEND) || enc_atom(b, "") || enc_pid(b, to) ? -1 : 0;
}

int ap_enc_reg_send(ap_buf *b, const erlang_pid *from, const char *toname)
{
	return enc_ctrl_head(b, 4, AP_OP_REG_SEND) || enc_pid(b, from) || enc_atom(b, "") ||
			       enc_atom(b, toname)
		       ? -1
		       : 0;
}

int ap_enc_alias_send(ap_buf *b, const erlang_pid *from, const char *alias, int alias_len)
{
	if (enc_ctrl_head(b, 3, AP_OP_ALIAS_SEND) || enc_pid(b, from))
		return -1;
	return ap_buf_append(b, alias, (size_t)alias_len);
}

int ap_enc_link(ap_buf *b, const erlang_pid *from, const erlang_pid *to)
{
	return enc_ctrl_head(b, 3, AP_OP_LINK) || enc_pid(b, from) || enc_pid(b, to) ? -1 : 0;
}

int ap_enc_exit(ap_buf *b, const erlang_pid *from, const erlang_pid *to, const char *reason, int reason_len)
{
	if (enc_ctrl_head(b, 4, AP_OP_EXIT) || enc_pid(b, from) || enc_pid(b, to))
		return -1;
	return ap_buf_append(b, reason, (size_t)reason_len);
}

int ap_enc_unlink_id_ack(ap_buf *b, unsigned long long id, const erlang_pid *from, const erlang_pid *to)
{
	if (enc_ctrl_head(b, 4, AP_OP_UNLINK_ID_ACK))
		return -1;
	ENC(b, 16, ei_encode_ulonglong(eb_, &ei_, id));
	return enc_pid(b, from) || enc_pid(b, to) ? -1 : 0;
}

int ap_enc_msg_raw(ap_buf *b, const char *term, int len)
{
	static const char ver = (char)131;
	if (len > 0 && (unsigned char)term[0] != 131 && ap_buf_append(b, &ver, 1))
		return -1;
	return ap_buf_append(b, term, (size_t)len);
}

int ap_enc_exit_atom(ap_buf *b, const erlang_pid *from, const erlang_pid *to, const char *reason)
{
	if (enc_ctrl_head(b, 4, AP_OP_EXIT) || enc_pid(b, from) || enc_pid(b, to))
		return -1;
	return enc_atom(b, reason);
}

int ap_enc_tick(ap_buf *b)
{
	static const uint8_t zero[4];
	return ap_buf_append(b, zero, 4);
}

/* ---- replies to calls -------------------------------------------------- */

size_t ap_encode_reply_head(ap_buf *b, const erlang_pid *self, const erlang_pid *caller, const char *tag,
			    int tag_len)
{
	/* A tag [alias | Ref] (OTP 24+) names an alias: reply to it, so a reply
	 * that comes after the caller gave up is dropped by the BEAM. */
	int idx = 0, arity, type, size;
	const char *alias = NULL;
	int alias_len = 0;
	if (ei_decode_list_header(tag, &idx, &arity) == 0 && arity == 1) {
		char atom[MAXATOMLEN_UTF8];
		if (ei_get_type(tag, &idx, &type, &size) == 0 && type == ERL_ATOM_EXT &&
		    ei_decode_atom_as(tag, &idx, atom, sizeof atom, ERLANG_UTF8, NULL, NULL) == 0 &&
		    strcmp(atom, "alias") == 0 && ei_get_type(tag, &idx, &type, &size) == 0 &&
		    type == ERL_NEW_REFERENCE_EXT) {
			alias = tag + idx;
			alias_len = tag_len - idx;
		}
	}
	size_t st = ap_frame_begin(b);
	if (st == (size_t)-1)
		return st;
	if (alias ? ap_enc_alias_send(b, self, alias, alias_len) : ap_enc_send(b, caller))
		return (size_t)-1;
	static const char hdr[] = { (char)131, 104, 2 }; /* {Tag, Reply} */
	if (ap_buf_append(b, hdr, sizeof hdr) || ap_buf_append(b, tag, (size_t)tag_len))
		return (size_t)-1;
	return st;
}

int ap_encode_reply(ap_buf *b, const erlang_pid *self, const erlang_pid *caller, const char *tag, int tag_len,
		    const char *term, int len)
{
	size_t st = ap_encode_reply_head(b, self, caller, tag, tag_len);
	if (st == (size_t)-1)
		return -1;
	if (len > 0 && (unsigned char)term[0] == 131) {
		term++;
		len--;
	}
	if (ap_buf_append(b, term, (size_t)len))
		return -1;
	return ap_frame_end(b, st);
}

size_t ap_enc_error_term(char out[AP_ERROR_TERM_MAX], const char *reason)
{
	int i = 0;
	ei_encode_tuple_header(out, &i, 2);
	ei_encode_atom(out, &i, "error");
	ei_encode_atom_len(out, &i, reason, (int)strnlen(reason, AP_ERROR_REASON_MAX));
	return (size_t)i;
}

int ap_enc_error(ap_buf *b, const char *reason)
{
	char tmp[AP_ERROR_TERM_MAX];
	size_t n = ap_enc_error_term(tmp, reason);
	return ap_buf_append(b, tmp, n);
}

int ap_enc_error_reply(ap_buf *b, const erlang_pid *self, const erlang_pid *caller, const char *tag, int tag_len,
		       const char *reason)
{
	size_t st = ap_encode_reply_head(b, self, caller, tag, tag_len);
	if (st == (size_t)-1 || ap_enc_error(b, reason))
		return -1;
	return ap_frame_end(b, st);
}
