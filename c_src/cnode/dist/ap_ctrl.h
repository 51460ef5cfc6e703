/* ap_ctrl: the control messages of distribution frames: decoding what a
 * BEAM sends to an ei node, encoding what a C node sends back; and every
 * frame a C node writes (replies to calls included), so the bytes of the
 * wire are made in one place. */
#ifndef AP_CTRL_H
#define AP_CTRL_H

#include <ei.h>
#include <stddef.h>
#include <stdint.h>

#include "ap_buf.h"

enum ap_op {
	AP_OP_LINK = 1,
	AP_OP_SEND = 2,
	AP_OP_EXIT = 3,
	AP_OP_UNLINK = 4,
	AP_OP_REG_SEND = 6,
	AP_OP_GROUP_LEADER = 7,
	AP_OP_EXIT2 = 8,
	AP_OP_ALIAS_SEND = 33,
	AP_OP_UNLINK_ID = 35,
	AP_OP_UNLINK_ID_ACK = 36,
};

typedef struct ap_ctrl {
	int op;                      /* an enum ap_op; *_TT forms are mapped to the plain op */
	erlang_pid from;             /* LINK UNLINK_ID(_ACK) EXIT EXIT2 REG_SEND GROUP_LEADER */
	erlang_pid to;               /* SEND LINK UNLINK_ID(_ACK) EXIT EXIT2 GROUP_LEADER */
	char toname[MAXATOMLEN_UTF8];/* REG_SEND */
	unsigned long long id;       /* UNLINK_ID(_ACK) */
	const char *reason;          /* EXIT EXIT2: the reason term, no version byte */
	int reason_len;
	const char *msg;             /* SEND REG_SEND ALIAS_SEND: the message, from its 131 byte */
	int msg_len;
} ap_ctrl;

/* Decode one data frame (the bytes after the length). Every byte is bounds-
 * checked before ei touches it, and the message of a send is validated whole.
 * Returns 0; -EBADMSG for anything malformed (the connection must close);
 * -ENOTSUP for a well-formed operation this runtime does not take (it is
 * logged and dropped). */
int ap_ctrl_decode(const uint8_t *frame, size_t len, ap_ctrl *c);
/* The same for the first len bytes of a frame too large to keep: the
 * control tuple must lie whole inside them; the message of a send is what
 * of it came (msg_len may be 0), unvalidated: read it only through
 * bounds-checked walks. -ENODATA: the bytes start as a control tuple does
 * ('p', 131, a small tuple, a small-integer op) but it does not end inside
 * them, so nothing is decoded; a head cut that short is no proof of bad
 * input, unlike -EBADMSG. */
int ap_ctrl_decode_head(const uint8_t *head, size_t len, ap_ctrl *c);

/* Outgoing frames: ap_frame_begin reserves the length and writes 'p';
 * the encoders append one control tuple; a send's message goes after it;
 * ap_frame_end patches the length. Encoders return 0 or -1 (out of memory). */
size_t ap_frame_begin(ap_buf *b);
int ap_frame_end(ap_buf *b, size_t start);
int ap_enc_send(ap_buf *b, const erlang_pid *to);
int ap_enc_reg_send(ap_buf *b, const erlang_pid *from, const char *toname);
/* ALIAS_SEND {33, From, Alias}: `alias` is an encoded reference, copied as is. */
int ap_enc_alias_send(ap_buf *b, const erlang_pid *from, const char *alias, int alias_len);
int ap_enc_link(ap_buf *b, const erlang_pid *from, const erlang_pid *to);
/* EXIT {3, From, To, Reason}: `reason` is an encoded term without version. */
int ap_enc_exit(ap_buf *b, const erlang_pid *from, const erlang_pid *to, const char *reason, int reason_len);
int ap_enc_unlink_id_ack(ap_buf *b, unsigned long long id, const erlang_pid *from, const erlang_pid *to);
/* Append an already encoded term (with or without its 131) as a message. */
int ap_enc_msg_raw(ap_buf *b, const char *term, int len);
/* EXIT {3, From, To, Reason} with an atom for Reason (noproc: the answer
 * to a link to a process that is not there). */
int ap_enc_exit_atom(ap_buf *b, const erlang_pid *from, const erlang_pid *to, const char *reason);
/* Append a tick (a zero-length frame). */
int ap_enc_tick(ap_buf *b);

/* ---- the messages inside: gen_server's protocol and this library's ----- */

/* The atoms that tag a message: gen_server's call and cast (OTP's
 * gen.erl), a batch of tells and asks (actor_pool_batcher.erl) and the
 * call that asks a pool for its stats (actor_pool.erl). */
#define AP_GEN_CALL "$gen_call" /* {'$gen_call', {Pid, Tag}, Req} */
#define AP_GEN_CAST "$gen_cast" /* {'$gen_cast', Req} */
#define AP_BATCH "$ap_batch"    /* {'$ap_batch', [{tell, Msg} | {ask, Pid, Tag, Msg}]} */
#define AP_STATS "$ap_stats"    /* a call's Req */

/* Encode {Tag, Reply} for a call into a frame appended to b; the frame
 * goes by ALIAS_SEND when the tag carries an alias, else SEND to the
 * caller. `term` may start with its 131 byte. Returns 0 or -1. */
int ap_encode_reply(ap_buf *b, const erlang_pid *self, const erlang_pid *caller, const char *tag,
		    int tag_len, const char *term, int len);
/* The same in two steps, for replies made later or elsewhere: the head
 * (frame start, control message, `{Tag, ` of the reply) is appended to b
 * and its start offset returned ((size_t)-1 on failure); append the reply
 * term without its 131 byte, then ap_frame_end(b, start). */
size_t ap_encode_reply_head(ap_buf *b, const erlang_pid *self, const erlang_pid *caller, const char *tag,
			    int tag_len);

/* {error, Reason}, without a version byte: what a call is answered when no
 * process or handler could answer it. Reason is one of the runtime's own
 * atoms; past AP_ERROR_REASON_MAX bytes it is cut. */
#define AP_ERROR_REASON_MAX 40
#define AP_ERROR_TERM_MAX 64 /* bytes of any such term */
/* Into out; returns its length. */
size_t ap_enc_error_term(char out[AP_ERROR_TERM_MAX], const char *reason);
/* Appended to b. 0 or -1. */
int ap_enc_error(ap_buf *b, const char *reason);
/* A whole frame answering the call (caller, tag) with {error, Reason} from
 * self, appended to b. 0 or -1 (no memory, or a tag ap_encode_reply_head
 * refuses). */
int ap_enc_error_reply(ap_buf *b, const erlang_pid *self, const erlang_pid *caller, const char *tag, int tag_len,
		       const char *reason);

#endif
