/* test_ctrl: decoding frames captured from an OTP 25 BEAM, refusing broken ones, encoder round trips. */
#include "t_helpers.h"

#include "ap_ctrl.h"
#include "ap_frame.h"
#include "ap_node_int.h"
#include "ap_frame.h"

#include "captured_frames.h"
#include "t_fun_overrun.h"

/* The pids in captured_frames.h, as erl decoded them with binary_to_term
 * (see capture_frames.sh; rerunning it changes creations and refs, and
 * these must follow). */
#define BEAM_NODE "capt@vm"
#define BEAM_CREATION 0x6b0c4b46u
#define C_NODE "cap@vm"
#define C_CREATION 0x402be6a5u

static erlang_pid t_shell_pid(void) { return t_pid(BEAM_NODE, 9, 0, BEAM_CREATION); }   /* the erl -eval process */
static erlang_pid t_linker_pid(void) { return t_pid(BEAM_NODE, 89, 0, BEAM_CREATION); } /* the process that linked and exited */
static erlang_pid t_tlinker_pid(void) { return t_pid(BEAM_NODE, 94, 0, BEAM_CREATION); } /* the same, with a trace token */
static erlang_pid t_echo_pid(void) { return t_pid(C_NODE, 1, 1, C_CREATION); }          /* echo */
static erlang_pid t_temp_pid(void) { return t_pid(C_NODE, 2, 1, C_CREATION); }          /* T, from call spawn */

static ap_ctrl t_decode_ok(const uint8_t *f, size_t len)
{
	ap_ctrl c;
	uint8_t *d = t_dup(f, len);
	int r = ap_ctrl_decode(d, len, &c);
	if (r != 0)
		fail_msg("decode returned %d", r);
	/* The spans point into the frame; rebase them onto f so the caller
	 * can compare after the copy is gone. */
	if (c.reason)
		c.reason = (const char *)f + (c.reason - (const char *)d);
	if (c.msg)
		c.msg = (const char *)f + (c.msg - (const char *)d);
	free(d);
	return c;
}

static int t_decode_rc(const uint8_t *f, size_t len)
{
	ap_ctrl c;
	uint8_t *d = t_dup(f, len);
	int r = ap_ctrl_decode(d, len, &c);
	free(d);
	return r;
}

/* ---- captured frames ---------------------------------------------------- */

static const struct cap_frame *t_cap(const char *name)
{
	for (size_t k = 0; k < sizeof cap_frames / sizeof cap_frames[0]; k++)
		if (strcmp(cap_frames[k].name, name) == 0)
			return &cap_frames[k];
	fail_msg("no captured frame %s", name);
	return NULL;
}

static void test_captured_reg_send_decodes(void **state)
{
	(void)state;
	ap_ctrl c = t_decode_ok(cap_reg_send, cap_reg_send_len);
	erlang_pid from = t_shell_pid();
	assert_int_equal(c.op, AP_OP_REG_SEND);
	t_assert_pid_eq(c.from, from);
	assert_string_equal(c.toname, "echo");
	static const char hello[] = "\x83\x77\x05hello";
	assert_int_equal(c.msg_len, sizeof hello - 1);
	assert_ptr_equal(c.msg, (const char *)cap_reg_send + cap_reg_send_len - c.msg_len);
	assert_memory_equal(c.msg, hello, sizeof hello - 1);
	assert_null(c.reason);
}

/* The three gen_server:calls: REG_SEND to echo of {'$gen_call', {Shell,
 * [alias | Ref]}, Req}, the message spanning the rest of the frame. */
static void test_captured_gen_calls_decode(void **state)
{
	(void)state;
	static const struct {
		const uint8_t *f;
		size_t len;
		const char *req;
		int msg_len;
	} calls[] = {
		{ cap_gen_call, cap_gen_call_len, "ping", 84 },
		{ cap_gen_call_2, cap_gen_call_2_len, "pid", 83 },
		{ cap_gen_call_3, cap_gen_call_3_len, "spawn", 85 },
	};
	erlang_pid shell = t_shell_pid();
	for (size_t k = 0; k < 3; k++) {
		ap_ctrl c = t_decode_ok(calls[k].f, calls[k].len);
		assert_int_equal(c.op, AP_OP_REG_SEND);
		t_assert_pid_eq(c.from, shell);
		assert_string_equal(c.toname, "echo");
		assert_int_equal(c.msg_len, calls[k].msg_len);
		assert_ptr_equal(c.msg, (const char *)calls[k].f + calls[k].len - c.msg_len);

		/* The span is a whole message ei can walk. */
		const char *m = c.msg;
		int i = 0, ver, arity, type, size;
		char atom[MAXATOMLEN_UTF8];
		erlang_pid caller;
		erlang_ref ref;
		assert_int_equal(ei_decode_version(m, &i, &ver), 0);
		assert_int_equal(ei_decode_tuple_header(m, &i, &arity), 0);
		assert_int_equal(arity, 3);
		assert_int_equal(ei_decode_atom(m, &i, atom), 0);
		assert_string_equal(atom, "$gen_call");
		assert_int_equal(ei_decode_tuple_header(m, &i, &arity), 0);
		assert_int_equal(arity, 2);
		assert_int_equal(ei_decode_pid(m, &i, &caller), 0);
		t_assert_pid_eq(caller, shell);
		assert_int_equal(ei_decode_list_header(m, &i, &arity), 0); /* [alias | Ref] */
		assert_int_equal(arity, 1);
		assert_int_equal(ei_decode_atom(m, &i, atom), 0);
		assert_string_equal(atom, "alias");
		assert_int_equal(ei_get_type(m, &i, &type, &size), 0);
		assert_int_equal(type, ERL_NEW_REFERENCE_EXT); /* ei reports NEWER_REFERENCE so */
		assert_int_equal(ei_decode_ref(m, &i, &ref), 0);
		assert_string_equal(ref.node, BEAM_NODE);
		assert_int_equal(ei_decode_atom(m, &i, atom), 0);
		assert_string_equal(atom, calls[k].req);
		assert_int_equal(i, c.msg_len);
	}
}

static void test_captured_send_to_pid_decodes(void **state)
{
	(void)state;
	ap_ctrl c = t_decode_ok(cap_send, cap_send_len);
	erlang_pid to = t_echo_pid();
	assert_int_equal(c.op, AP_OP_SEND);
	t_assert_pid_eq(c.to, to);
	static const char msg[] = "\x83\x77\x03msg";
	assert_int_equal(c.msg_len, sizeof msg - 1);
	assert_ptr_equal(c.msg, (const char *)cap_send + cap_send_len - c.msg_len);
	assert_memory_equal(c.msg, msg, sizeof msg - 1);
}

static void test_captured_links_decode(void **state)
{
	(void)state;
	erlang_pid t = t_temp_pid(), shell = t_shell_pid(), linker = t_linker_pid();
	ap_ctrl c = t_decode_ok(cap_link, cap_link_len);
	assert_int_equal(c.op, AP_OP_LINK);
	t_assert_pid_eq(c.from, shell);
	t_assert_pid_eq(c.to, t);
	assert_null(c.msg);
	assert_int_equal(c.msg_len, 0);

	c = t_decode_ok(cap_link_2, cap_link_2_len);
	assert_int_equal(c.op, AP_OP_LINK);
	t_assert_pid_eq(c.from, linker);
	t_assert_pid_eq(c.to, t);
}

static void test_captured_unlink_id_decodes(void **state)
{
	(void)state;
	erlang_pid t = t_temp_pid(), shell = t_shell_pid();
	ap_ctrl c = t_decode_ok(cap_unlink_id, cap_unlink_id_len);
	assert_int_equal(c.op, AP_OP_UNLINK_ID);
	assert_int_equal(c.id, 4);
	t_assert_pid_eq(c.from, shell);
	t_assert_pid_eq(c.to, t);
	assert_null(c.msg);
}

static void test_captured_exit2_decodes(void **state)
{
	(void)state;
	erlang_pid t = t_temp_pid(), shell = t_shell_pid();
	ap_ctrl c = t_decode_ok(cap_exit2, cap_exit2_len);
	assert_int_equal(c.op, AP_OP_EXIT2);
	t_assert_pid_eq(c.from, shell);
	t_assert_pid_eq(c.to, t);
	static const char boom[] = "\x77\x04" "boom";
	assert_int_equal(c.reason_len, sizeof boom - 1);
	assert_ptr_equal(c.reason, (const char *)cap_exit2 + cap_exit2_len - c.reason_len);
	assert_memory_equal(c.reason, boom, sizeof boom - 1);
	assert_null(c.msg);
}

static void test_captured_exit_decodes(void **state)
{
	(void)state;
	erlang_pid t = t_temp_pid(), linker = t_linker_pid();
	ap_ctrl c = t_decode_ok(cap_exit, cap_exit_len);
	assert_int_equal(c.op, AP_OP_EXIT);
	t_assert_pid_eq(c.from, linker);
	t_assert_pid_eq(c.to, t);
	static const char bye[] = "\x77\x03" "bye";
	assert_int_equal(c.reason_len, sizeof bye - 1);
	assert_memory_equal(c.reason, bye, sizeof bye - 1);
}

/* With a seq_trace token set, the BEAM sends the _TT forms: the token is an
 * extra element after the plain ones, and the ops map to the plain ones. */
static void test_captured_traced_sends_decode(void **state)
{
	(void)state;
	erlang_pid shell = t_shell_pid(), echo = t_echo_pid();
	static const char traced[] = "\x83\x77\x06traced";
	ap_ctrl c = t_decode_ok(cap_reg_send_tt, cap_reg_send_tt_len);
	assert_int_equal(cap_reg_send_tt[5], 16);
	assert_int_equal(c.op, AP_OP_REG_SEND);
	t_assert_pid_eq(c.from, shell);
	assert_string_equal(c.toname, "echo");
	assert_int_equal(c.msg_len, sizeof traced - 1);
	assert_memory_equal(c.msg, traced, sizeof traced - 1);

	c = t_decode_ok(cap_send_tt, cap_send_tt_len);
	assert_int_equal(cap_send_tt[5], 12);
	assert_int_equal(c.op, AP_OP_SEND);
	t_assert_pid_eq(c.to, echo);
	assert_int_equal(c.msg_len, sizeof traced - 1);
	assert_ptr_equal(c.msg, (const char *)cap_send_tt + cap_send_tt_len - c.msg_len);
	assert_memory_equal(c.msg, traced, sizeof traced - 1);
}

static void test_captured_traced_exit_decodes(void **state)
{
	(void)state;
	erlang_pid t = t_temp_pid(), tlinker = t_tlinker_pid(), shell = t_shell_pid();
	ap_ctrl c = t_decode_ok(cap_link_3, cap_link_3_len);
	assert_int_equal(c.op, AP_OP_LINK);
	t_assert_pid_eq(c.from, tlinker);
	t_assert_pid_eq(c.to, t);

	c = t_decode_ok(cap_exit_tt, cap_exit_tt_len);
	assert_int_equal(cap_exit_tt[5], 13);
	assert_int_equal(c.op, AP_OP_EXIT);
	t_assert_pid_eq(c.from, tlinker);
	t_assert_pid_eq(c.to, t);
	static const char reason[] = "\x77\x0atraced_bye";
	assert_int_equal(c.reason_len, sizeof reason - 1);
	assert_ptr_equal(c.reason, (const char *)cap_exit_tt + cap_exit_tt_len - c.reason_len);
	assert_memory_equal(c.reason, reason, sizeof reason - 1);

	/* exit/2 with a token set still went out as a plain EXIT2. */
	c = t_decode_ok(cap_exit2_2, cap_exit2_2_len);
	assert_int_equal(c.op, AP_OP_EXIT2);
	t_assert_pid_eq(c.from, shell);
	t_assert_pid_eq(c.to, t);
	assert_int_equal(c.reason_len, 8);
	assert_memory_equal(c.reason, "\x77\x06traced", 8);
}

static int t_tick_cb(void *arg, const uint8_t *f, size_t len)
{
	(void)f;
	assert_int_equal(len, 0);
	++*(size_t *)arg;
	return 0;
}

static void test_captured_tick_is_an_empty_frame(void **state)
{
	(void)state;
	assert_int_equal(cap_tick_len, 0);
	/* The frame codec delivers it as a zero-length frame. */
	ap_frame_rx rx;
	ap_frame_rx_init(&rx, 0);
	uint8_t wire[4] = { 0 };
	ap_put32be(wire, cap_tick_len);
	size_t seen = 0;
	assert_int_equal(ap_frame_rx_feed(&rx, wire, 4, t_tick_cb, &seen), 0);
	assert_int_equal(seen, 1);
	ap_frame_rx_free(&rx);
	/* A tick is not a control message: decoding one is refused. */
	assert_int_equal(t_decode_rc(cap_tick, cap_tick_len), -EBADMSG);
}

/* ---- broken frames ------------------------------------------------------ */

static void test_every_truncation_of_captured_frames_is_ebadmsg(void **state)
{
	(void)state;
	for (size_t k = 0; k < sizeof cap_frames / sizeof cap_frames[0]; k++) {
		const struct cap_frame *f = &cap_frames[k];
		for (size_t n = 0; n < f->len; n++) {
			int r = t_decode_rc(f->data, n);
			if (r != -EBADMSG)
				fail_msg("%s cut to %zu of %zu bytes: %d, not -EBADMSG", f->name, n, f->len, r);
		}
	}
}

/* The head of an oversized frame: every prefix of every captured frame is
 * refused until its control tuple is whole (-ENODATA, cut short, once the
 * op is in it; -EBADMSG before), and from there decodes to the fields of
 * the whole frame, a send's message being what of it came. */
static void test_heads_decode_once_the_control_tuple_is_whole(void **state)
{
	(void)state;
	for (size_t k = 0; k < sizeof cap_frames / sizeof cap_frames[0]; k++) {
		const struct cap_frame *f = &cap_frames[k];
		if (f->len == 0)
			continue; /* the tick */
		ap_ctrl whole = t_decode_ok(f->data, f->len);
		size_t end = whole.msg ? (size_t)(whole.msg - (const char *)f->data) : f->len;
		for (size_t n = 0; n <= f->len; n++) {
			ap_ctrl c;
			uint8_t *d = t_dup(f->data, n);
			int r = ap_ctrl_decode_head(d, n, &c);
			if (n < end) {
				if (r != (n >= 6 ? -ENODATA : -EBADMSG))
					fail_msg("%s head of %zu bytes (control ends at %zu): %d", f->name, n, end, r);
				free(d);
				continue;
			}
			if (r != 0)
				fail_msg("%s head of %zu bytes (control ends at %zu): %d", f->name, n, end, r);
			assert_int_equal(c.op, whole.op);
			assert_string_equal(c.toname, whole.toname);
			t_assert_pid_eq(c.from, whole.from);
			t_assert_pid_eq(c.to, whole.to);
			if (whole.msg) {
				assert_ptr_equal(c.msg, (const char *)d + end);
				assert_int_equal(c.msg_len, (int)(n - end));
			} else {
				assert_null(c.msg);
			}
			free(d);
		}
	}
}

/* A head that does not start as a control tuple is -EBADMSG, however it
 * ends: its stream is out of step (these are what a frame length read from
 * the middle of a message or from junk finds), never -ENODATA. */
/* The smallest head a node keeps of an oversized frame (AP_FRAME_HEAD_MIN)
 * holds the usual header whole at its longest: a REG_SEND of a $gen_call
 * with an [alias | Ref] tag, the node names 255 bytes (the BEAM's limit for
 * name@host), the registered name 255. Its control message decodes and the
 * call, its caller and its tag are found, so the caller gets its answer. */
static void test_the_smallest_head_holds_a_usual_call_header(void **state)
{
	(void)state;
	char node[256], name[256];
	memset(node, 'n', 255);
	memcpy(node + 100, "@", 1);
	node[255] = 0;
	memset(name, 'r', 255);
	name[255] = 0;
	erlang_pid from = { .num = 123, .serial = 4, .creation = 0x5eed };
	strcpy(from.node, node);
	erlang_ref ref = { .len = 5, .n = { 1, 2, 3, 4, 5 }, .creation = 0x5eed };
	strcpy(ref.node, node);
	static char big[16384];
	ei_x_buff x;
	assert_int_equal(ei_x_new(&x), 0);
	assert_int_equal(ei_x_append_buf(&x, "p", 1), 0);
	assert_int_equal(ei_x_encode_version(&x) || ei_x_encode_tuple_header(&x, 4) || ei_x_encode_long(&x, 6) ||
				 ei_x_encode_pid(&x, &from) || ei_x_encode_atom(&x, "") || ei_x_encode_atom(&x, name),
			 0);
	int msg_at = x.index;
	assert_int_equal(ei_x_encode_version(&x) || ei_x_encode_tuple_header(&x, 3) ||
				 ei_x_encode_atom(&x, "$gen_call") || ei_x_encode_tuple_header(&x, 2) ||
				 ei_x_encode_pid(&x, &from),
			 0);
	int tag_at = x.index;
	assert_int_equal(ei_x_encode_list_header(&x, 1) || ei_x_encode_atom(&x, "alias") || ei_x_encode_ref(&x, &ref),
			 0);
	int tag_end = x.index;
	assert_int_equal(ei_x_encode_binary(&x, big, sizeof big), 0);
	assert_true(tag_end <= (int)AP_FRAME_HEAD_MIN);
	assert_true(x.index > (int)AP_FRAME_HEAD_MIN);

	uint8_t *head = t_dup((const uint8_t *)x.buff, AP_FRAME_HEAD_MIN);
	ap_ctrl c;
	assert_int_equal(ap_ctrl_decode_head(head, AP_FRAME_HEAD_MIN, &c), 0);
	assert_int_equal(c.op, AP_OP_REG_SEND);
	assert_string_equal(c.toname, name);
	assert_ptr_equal(c.msg, (const char *)head + msg_at);
	ap_msg m = { .kind = AP_MSG_INFO, .buf = c.msg, .len = c.msg_len, .index = 1 };
	ap_node_classify(&m);
	assert_int_equal(m.kind, AP_MSG_CALL);
	t_assert_pid_eq(m.from, from);
	assert_ptr_equal(m.tag, (const char *)head + tag_at);
	assert_int_equal(m.tag_len, tag_end - tag_at);
	free(head);
	ei_x_free(&x);
}

static void test_heads_that_are_no_control_tuple_are_ebadmsg(void **state)
{
	(void)state;
	static const struct { const char *what; uint8_t b[8]; } heads[] = {
		{ "'q' then zeros", { 'q', 0, 0, 0, 0, 0, 0, 0 } },
		{ "a length and 'p'", { 0, 0, 0, 200, 'p', 131, 104, 4 } },
		{ "no version", { 'p', 130, 104, 4, 97, 6, 0, 0 } },
		{ "a list, not a tuple", { 'p', 131, 108, 0, 0, 0, 4, 97 } },
		{ "an arity of 9", { 'p', 131, 104, 9, 97, 6, 103, 0 } },
		{ "an atom op", { 'p', 131, 104, 4, 100, 0, 1, 'a' } },
		{ "op 0", { 'p', 131, 104, 4, 97, 0, 103, 100 } },
	};
	for (size_t k = 0; k < sizeof heads / sizeof heads[0]; k++) {
		ap_ctrl c;
		uint8_t *d = t_dup(heads[k].b, sizeof heads[k].b);
		int r = ap_ctrl_decode_head(d, sizeof heads[k].b, &c);
		if (r != -EBADMSG)
			fail_msg("%s: %d, not -EBADMSG", heads[k].what, r);
		free(d);
	}
}

static void test_wrong_first_byte_or_version_is_ebadmsg(void **state)
{
	(void)state;
	for (size_t k = 0; k < sizeof cap_frames / sizeof cap_frames[0]; k++) {
		const struct cap_frame *f = &cap_frames[k];
		if (f->len == 0)
			continue;
		uint8_t *d = t_dup(f->data, f->len);
		assert_int_equal(t_decode_rc(d, f->len), 0);
		d[0] = 'q';
		if (t_decode_rc(d, f->len) != -EBADMSG)
			fail_msg("%s with first byte 'q' accepted", f->name);
		d[0] = 'p';
		d[1] = 130;
		if (t_decode_rc(d, f->len) != -EBADMSG)
			fail_msg("%s with version 130 accepted", f->name);
		free(d);
	}
}

static void test_wrong_arity_is_ebadmsg(void **state)
{
	(void)state;
	for (size_t k = 0; k < sizeof cap_frames / sizeof cap_frames[0]; k++) {
		const struct cap_frame *f = &cap_frames[k];
		if (f->len == 0)
			continue;
		assert_int_equal(f->data[2], 104); /* SMALL_TUPLE_EXT, arity at [3] */
		for (int delta = -3; delta <= 3; delta++) {
			if (delta == 0 || f->data[3] + delta < 0)
				continue;
			uint8_t *d = t_dup(f->data, f->len);
			d[3] = (uint8_t)(d[3] + delta);
			int r = t_decode_rc(d, f->len);
			if (r != -EBADMSG)
				fail_msg("%s with arity %d: %d, not -EBADMSG", f->name, d[3], r);
			free(d);
		}
	}
}

static void test_trailing_term_after_linklike_ops_is_ebadmsg(void **state)
{
	(void)state;
	static const char *nomsg[] = { "link", "link_2", "link_3", "unlink_id", "exit2", "exit2_2", "exit", "exit_tt" };
	for (size_t k = 0; k < sizeof nomsg / sizeof nomsg[0]; k++) {
		const struct cap_frame *f = t_cap(nomsg[k]);
		uint8_t *d = malloc(f->len + 2);
		assert_non_null(d);
		memcpy(d, f->data, f->len);
		d[f->len] = 106; /* [] */
		if (t_decode_rc(d, f->len + 1) != -EBADMSG)
			fail_msg("%s followed by [] accepted", f->name);
		/* ...and as a whole message with its version byte. */
		d[f->len] = 131;
		d[f->len + 1] = 106;
		if (t_decode_rc(d, f->len + 2) != -EBADMSG)
			fail_msg("%s followed by a message accepted", f->name);
		free(d);
	}
}

static void test_bad_message_after_send_is_ebadmsg(void **state)
{
	(void)state;
	uint8_t d[64];
	assert_true(cap_send_len + 1 <= sizeof d);
	memcpy(d, cap_send, cap_send_len);
	d[cap_send_len] = 106; /* a byte after the message */
	assert_int_equal(t_decode_rc(d, cap_send_len + 1), -EBADMSG);
	/* The message without its version byte. */
	memcpy(d, cap_send, cap_send_len);
	memmove(d + cap_send_len - 6, d + cap_send_len - 5, 5);
	assert_int_equal(t_decode_rc(d, cap_send_len - 1), -EBADMSG);
	/* No message at all. */
	assert_int_equal(t_decode_rc(cap_send, cap_send_len - 6), -EBADMSG);
}

/* A control tuple built with ei: 'p', 131, then the caller's elements. */
static ei_x_buff t_ctrl_begin(int arity, long op)
{
	ei_x_buff x;
	ei_x_new(&x);
	ei_x_append_buf(&x, "p", 1);
	ei_x_encode_version(&x);
	ei_x_encode_tuple_header(&x, arity);
	ei_x_encode_long(&x, op);
	return x;
}

static void t_ref(ei_x_buff *x)
{
	erlang_ref r;
	memset(&r, 0, sizeof r);
	strcpy(r.node, BEAM_NODE);
	r.len = 3;
	r.n[0] = 92261;
	r.n[1] = 1226375170;
	r.n[2] = 1199042098;
	r.creation = BEAM_CREATION;
	ei_x_encode_ref(x, &r);
}

/* Issue 12: a fun whose Size overruns its fields into a binary header
 * claiming 256 MiB (t_fun_overrun), in each place a frame carries terms
 * from the peer: a send's message (as a cast, and as a call's tag), an exit
 * reason, a trace token. The frame is refused, so no consumer ever asks ei
 * where such a term ends. */
static void test_fun_whose_size_overruns_is_ebadmsg_everywhere(void **state)
{
	(void)state;
	erlang_pid to = t_echo_pid(), from = t_shell_pid();
	for (int where = 0; where < 4; where++) {
		ei_x_buff x = t_ctrl_begin(where == 2 ? 4 : where == 3 ? 4 : 3, where == 2 ? 3 : where == 3 ? 12 : 2);
		if (where == 2) { /* EXIT {3, From, To, Reason}: Reason = {Fun, Pad} */
			ei_x_encode_pid(&x, &from);
			ei_x_encode_pid(&x, &to);
			ei_x_encode_tuple_header(&x, 2);
			assert_int_equal(t_fun_overrun(&x, 256u << 20), 0);
		} else {
			ei_x_encode_atom(&x, "");
			ei_x_encode_pid(&x, &to);
			if (where == 3) { /* SEND_TT {12, '', To, Token}: Token = {Fun, Pad} */
				ei_x_encode_tuple_header(&x, 2);
				assert_int_equal(t_fun_overrun(&x, 256u << 20), 0);
			}
			ei_x_encode_version(&x);
			if (where == 3) { /* a plain message: only the token is bad */
				ei_x_encode_atom(&x, "ok");
			} else if (where == 0) { /* {'$gen_cast', {Fun, Pad}} */
				ei_x_encode_tuple_header(&x, 2);
				ei_x_encode_atom(&x, "$gen_cast");
				ei_x_encode_tuple_header(&x, 2);
				assert_int_equal(t_fun_overrun(&x, 256u << 20), 0);
			} else { /* {'$gen_call', {From, Fun}, Pad} */
				ei_x_encode_tuple_header(&x, 3);
				ei_x_encode_atom(&x, "$gen_call");
				ei_x_encode_tuple_header(&x, 2);
				ei_x_encode_pid(&x, &from);
				assert_int_equal(t_fun_overrun(&x, 256u << 20), 0);
			}
		}
		if (t_decode_rc((const uint8_t *)x.buff, (size_t)x.index) != -EBADMSG)
			fail_msg("case %d: crafted fun not refused", where);
		ei_x_free(&x);
	}
}

static void test_wellformed_unknown_op_is_enotsup(void **state)
{
	(void)state;
	erlang_pid from = t_shell_pid(), to = t_echo_pid();
	/* MONITOR_P {19, FromPid, ToProc, Ref}, DEMONITOR_P, MONITOR_P_EXIT
	 * {21, FromProc, ToPid, Ref, Reason}. */
	ei_x_buff x = t_ctrl_begin(4, 19);
	ei_x_encode_pid(&x, &from);
	ei_x_encode_pid(&x, &to);
	t_ref(&x);
	assert_int_equal(t_decode_rc((uint8_t *)x.buff, (size_t)x.index), -ENOTSUP);
	ei_x_free(&x);

	x = t_ctrl_begin(4, 20);
	ei_x_encode_pid(&x, &from);
	ei_x_encode_atom(&x, "echo");
	t_ref(&x);
	assert_int_equal(t_decode_rc((uint8_t *)x.buff, (size_t)x.index), -ENOTSUP);
	ei_x_free(&x);

	x = t_ctrl_begin(5, 21);
	ei_x_encode_pid(&x, &to);
	ei_x_encode_pid(&x, &from);
	t_ref(&x);
	ei_x_encode_atom(&x, "normal");
	assert_int_equal(t_decode_rc((uint8_t *)x.buff, (size_t)x.index), -ENOTSUP);
	ei_x_free(&x);

	/* The same MONITOR_P cut short is malformed, not unsupported. */
	x = t_ctrl_begin(4, 19);
	ei_x_encode_pid(&x, &from);
	ei_x_encode_pid(&x, &to);
	t_ref(&x);
	for (int n = 0; n < x.index; n++)
		assert_int_equal(t_decode_rc((uint8_t *)x.buff, (size_t)n), -EBADMSG);
	ei_x_free(&x);
}

static void test_op_that_is_not_an_integer_is_ebadmsg(void **state)
{
	(void)state;
	erlang_pid from = t_shell_pid(), to = t_echo_pid();
	ei_x_buff x;
	ei_x_new(&x);
	ei_x_append_buf(&x, "p", 1);
	ei_x_encode_version(&x);
	ei_x_encode_tuple_header(&x, 3);
	ei_x_encode_atom(&x, "link");
	ei_x_encode_pid(&x, &from);
	ei_x_encode_pid(&x, &to);
	assert_int_equal(t_decode_rc((uint8_t *)x.buff, (size_t)x.index), -EBADMSG);
	ei_x_free(&x);

	/* A control message that is not a tuple at all. */
	static const uint8_t list[] = { 'p', 131, 106 };
	assert_int_equal(t_decode_rc(list, sizeof list), -EBADMSG);
	static const uint8_t empty_tuple[] = { 'p', 131, 104, 0 };
	assert_int_equal(t_decode_rc(empty_tuple, sizeof empty_tuple), -EBADMSG);
}

static void test_pid_where_an_atom_belongs_is_ebadmsg(void **state)
{
	(void)state;
	/* REG_SEND {6, From, '', ToName} with a pid for ToName, and LINK with
	 * an atom for To: well-formed terms, wrong types. */
	erlang_pid from = t_shell_pid(), to = t_echo_pid();
	ei_x_buff x = t_ctrl_begin(4, 6);
	ei_x_encode_pid(&x, &from);
	ei_x_encode_atom(&x, "");
	ei_x_encode_pid(&x, &to);
	ei_x_encode_version(&x);
	ei_x_encode_atom(&x, "hi");
	assert_int_equal(t_decode_rc((uint8_t *)x.buff, (size_t)x.index), -EBADMSG);
	ei_x_free(&x);

	x = t_ctrl_begin(3, 1);
	ei_x_encode_pid(&x, &from);
	ei_x_encode_atom(&x, "echo");
	assert_int_equal(t_decode_rc((uint8_t *)x.buff, (size_t)x.index), -EBADMSG);
	ei_x_free(&x);
}

/* Operations the capture did not produce, built by hand in the shapes of
 * the distribution protocol. */
static void test_other_known_ops_decode(void **state)
{
	(void)state;
	erlang_pid from = t_shell_pid(), to = t_echo_pid();
	ap_ctrl c;

	/* UNLINK {4, From, To} and GROUP_LEADER {7, From, To} */
	static const int plain[] = { AP_OP_UNLINK, AP_OP_GROUP_LEADER };
	for (int k = 0; k < 2; k++) {
		ei_x_buff x = t_ctrl_begin(3, plain[k]);
		ei_x_encode_pid(&x, &from);
		ei_x_encode_pid(&x, &to);
		c = t_decode_ok((uint8_t *)x.buff, (size_t)x.index);
		assert_int_equal(c.op, plain[k]);
		t_assert_pid_eq(c.from, from);
		t_assert_pid_eq(c.to, to);
		ei_x_free(&x);
	}

	/* SEND_TT {12, '', To, Token} + message */
	ei_x_buff x = t_ctrl_begin(4, 12);
	ei_x_encode_atom(&x, "");
	ei_x_encode_pid(&x, &to);
	ei_x_encode_tuple_header(&x, 5); /* a seq_trace token */
	for (int i = 0; i < 5; i++)
		ei_x_encode_long(&x, i);
	int msg_at = x.index;
	ei_x_encode_version(&x);
	ei_x_encode_atom(&x, "traced");
	c = t_decode_ok((uint8_t *)x.buff, (size_t)x.index);
	assert_int_equal(c.op, AP_OP_SEND);
	t_assert_pid_eq(c.to, to);
	assert_int_equal(c.msg_len, x.index - msg_at);
	ei_x_free(&x);

	/* REG_SEND_TT {16, From, '', ToName, Token} + message */
	x = t_ctrl_begin(5, 16);
	ei_x_encode_pid(&x, &from);
	ei_x_encode_atom(&x, "");
	ei_x_encode_atom(&x, "echo");
	ei_x_encode_long(&x, 7);
	ei_x_encode_version(&x);
	ei_x_encode_atom(&x, "traced");
	c = t_decode_ok((uint8_t *)x.buff, (size_t)x.index);
	assert_int_equal(c.op, AP_OP_REG_SEND);
	t_assert_pid_eq(c.from, from);
	assert_string_equal(c.toname, "echo");
	ei_x_free(&x);

	/* EXIT_TT {13, From, To, Token, Reason}, EXIT2_TT {18, ...} */
	static const struct {
		int wire, op;
	} tt[] = { { 13, AP_OP_EXIT }, { 18, AP_OP_EXIT2 } };
	for (int k = 0; k < 2; k++) {
		x = t_ctrl_begin(5, tt[k].wire);
		ei_x_encode_pid(&x, &from);
		ei_x_encode_pid(&x, &to);
		ei_x_encode_long(&x, 7);
		int r0 = x.index;
		ei_x_encode_tuple_header(&x, 2);
		ei_x_encode_atom(&x, "shutdown");
		ei_x_encode_binary(&x, "why", 3);
		c = t_decode_ok((uint8_t *)x.buff, (size_t)x.index);
		assert_int_equal(c.op, tt[k].op);
		t_assert_pid_eq(c.from, from);
		t_assert_pid_eq(c.to, to);
		assert_int_equal(c.reason_len, x.index - r0);
		assert_memory_equal(c.reason, x.buff + r0, (size_t)c.reason_len);
		ei_x_free(&x);
	}

	/* ALIAS_SEND {33, From, Alias} + message */
	x = t_ctrl_begin(3, AP_OP_ALIAS_SEND);
	ei_x_encode_pid(&x, &from);
	t_ref(&x);
	msg_at = x.index;
	ei_x_encode_version(&x);
	ei_x_encode_long(&x, 42);
	c = t_decode_ok((uint8_t *)x.buff, (size_t)x.index);
	assert_int_equal(c.op, AP_OP_ALIAS_SEND);
	t_assert_pid_eq(c.from, from);
	assert_int_equal(c.msg_len, x.index - msg_at);
	ei_x_free(&x);

	/* UNLINK_ID_ACK {36, Id, From, To} with an id past 32 bits */
	x = t_ctrl_begin(4, AP_OP_UNLINK_ID_ACK);
	ei_x_encode_ulonglong(&x, 0xfedcba9876543210ull);
	ei_x_encode_pid(&x, &from);
	ei_x_encode_pid(&x, &to);
	c = t_decode_ok((uint8_t *)x.buff, (size_t)x.index);
	assert_int_equal(c.op, AP_OP_UNLINK_ID_ACK);
	assert_true(c.id == 0xfedcba9876543210ull);
	ei_x_free(&x);
}

/* ---- encoders ----------------------------------------------------------- */

/* The frame at b[start..]: checks its length and 'p', returns its body. */
static const uint8_t *t_frame_at(const ap_buf *b, size_t start, size_t *len)
{
	assert_true(b->len >= start + 5);
	*len = ap_get32be(b->data + start);
	assert_int_equal(*len, b->len - start - 4);
	assert_int_equal(b->data[start + 4], 'p');
	return b->data + start + 4;
}

static void test_encoders_write_what_a_beam_writes(void **state)
{
	(void)state;
	/* With the pids and names of the capture, the encoders produce the
	 * captured frames byte for byte. */
	erlang_pid shell = t_shell_pid(), echo = t_echo_pid(), t = t_temp_pid(), linker = t_linker_pid();
	const uint8_t *f;
	size_t len, st;
	ap_buf b = { 0 };

	st = ap_frame_begin(&b);
	assert_int_equal(ap_enc_link(&b, &shell, &t), 0);
	assert_int_equal(ap_frame_end(&b, st), 0);
	f = t_frame_at(&b, st, &len);
	assert_int_equal(len, cap_link_len);
	assert_memory_equal(f, cap_link, len);

	b.len = 0;
	st = ap_frame_begin(&b);
	assert_int_equal(ap_enc_reg_send(&b, &shell, "echo"), 0);
	assert_int_equal(ap_enc_msg_raw(&b, "\x77\x05hello", 7), 0);
	assert_int_equal(ap_frame_end(&b, st), 0);
	f = t_frame_at(&b, st, &len);
	assert_int_equal(len, cap_reg_send_len);
	assert_memory_equal(f, cap_reg_send, len);

	b.len = 0;
	st = ap_frame_begin(&b);
	assert_int_equal(ap_enc_send(&b, &echo), 0);
	assert_int_equal(ap_enc_msg_raw(&b, "\x83\x77\x03msg", 6), 0);
	assert_int_equal(ap_frame_end(&b, st), 0);
	f = t_frame_at(&b, st, &len);
	assert_int_equal(len, cap_send_len);
	assert_memory_equal(f, cap_send, len);

	b.len = 0;
	st = ap_frame_begin(&b);
	assert_int_equal(ap_enc_exit(&b, &linker, &t, "\x77\x03" "bye", 5), 0);
	assert_int_equal(ap_frame_end(&b, st), 0);
	f = t_frame_at(&b, st, &len);
	assert_int_equal(len, cap_exit_len);
	assert_memory_equal(f, cap_exit, len);
	ap_buf_free(&b);
}

/* What a call nothing could answer gets, and the EXIT a link to a missing
 * process gets: the bytes term_to_binary writes, which the node once
 * spelled out by hand. */
static void test_error_replies_write_what_a_beam_writes(void **state)
{
	(void)state;
	static const char noproc[] = { 104, 2, 119, 5, 'e', 'r', 'r', 'o', 'r', 119, 6, 'n', 'o', 'p', 'r', 'o', 'c' };
	char out[AP_ERROR_TERM_MAX];
	assert_int_equal(ap_enc_error_term(out, "noproc"), sizeof noproc);
	assert_memory_equal(out, noproc, sizeof noproc);
	/* A reason is cut at AP_ERROR_REASON_MAX bytes: the term always fits. */
	char longest[AP_ERROR_REASON_MAX + 8];
	memset(longest, 'x', sizeof longest - 1);
	longest[sizeof longest - 1] = 0;
	size_t n = ap_enc_error_term(out, longest);
	assert_true(n <= AP_ERROR_TERM_MAX);
	assert_int_equal(n, 9 + 2 + AP_ERROR_REASON_MAX);

	/* The whole reply: the head ap_encode_reply_head makes, then the term. */
	erlang_pid self = t_echo_pid(), caller = t_shell_pid();
	static const char tag[] = { 119, 1, 't' };
	ap_buf a = { 0 }, b = { 0 };
	assert_int_equal(ap_enc_error_reply(&a, &self, &caller, tag, sizeof tag, "noproc"), 0);
	size_t st = ap_encode_reply_head(&b, &self, &caller, tag, sizeof tag);
	assert_int_equal(st, 0);
	assert_int_equal(ap_buf_append(&b, noproc, sizeof noproc), 0);
	assert_int_equal(ap_frame_end(&b, st), 0);
	assert_int_equal(a.len, b.len);
	assert_memory_equal(a.data, b.data, a.len);

	/* EXIT with the atom noproc, as with the reason's bytes. */
	a.len = b.len = 0;
	size_t sa = ap_frame_begin(&a), sb = ap_frame_begin(&b);
	assert_int_equal(ap_enc_exit_atom(&a, &self, &caller, "noproc"), 0);
	assert_int_equal(ap_enc_exit(&b, &self, &caller, noproc + 9, 8), 0);
	assert_int_equal(ap_frame_end(&a, sa), 0);
	assert_int_equal(ap_frame_end(&b, sb), 0);
	assert_int_equal(a.len, b.len);
	assert_memory_equal(a.data, b.data, a.len);
	ap_buf_free(&a);
	ap_buf_free(&b);
}

/* Pids on a node with a 255-character name of 4-byte characters: the
 * largest a pid gets. */
static erlang_pid t_long_pid(unsigned num)
{
	erlang_pid p;
	memset(&p, 0, sizeof p);
	size_t i = 0;
	for (int k = 0; k < 250; k++) {
		memcpy(p.node + i, "\xf0\x9f\x98\x80", 4); /* U+1F600 */
		i += 4;
	}
	memcpy(p.node + i, "@host", 5);
	p.num = num;
	p.serial = 0x1fff;
	p.creation = 0xffffffffu;
	return p;
}

struct t_rt {
	ap_ctrl c[16];
	const uint8_t *frames[16];
	size_t lens[16];
	int n;
	int ticks;
};

static int t_rt_cb(void *arg, const uint8_t *f, size_t len)
{
	struct t_rt *rt = arg;
	if (len == 0) {
		rt->ticks++;
		return 0;
	}
	assert_true(rt->n < 16);
	int r = ap_ctrl_decode(f, len, &rt->c[rt->n]);
	if (r)
		return r;
	rt->frames[rt->n] = f;
	rt->lens[rt->n] = len;
	rt->n++;
	return 0;
}

static void t_roundtrip(const erlang_pid *a, const erlang_pid *bpid)
{
	ap_buf b = { 0 };
	size_t st;
	static const char msg[] = "\x83\x68\x02\x77\x02ok\x6d\x00\x00\x00\x03xyz"; /* {ok, <<"xyz">>} */
	const int msg_len = sizeof msg - 1;
	static const char reason[] = "\x68\x02\x77\x08shutdown\x61\x07"; /* {shutdown, 7}, no 131 */
	const int reason_len = sizeof reason - 1;
	ei_x_buff alias;
	ei_x_new(&alias);
	t_ref(&alias);

	/* Six frames and a tick in one buffer, as a loop turn would queue them. */
	st = ap_frame_begin(&b);
	assert_int_equal(ap_enc_send(&b, bpid), 0);
	assert_int_equal(ap_enc_msg_raw(&b, msg, msg_len), 0);
	assert_int_equal(ap_frame_end(&b, st), 0);

	st = ap_frame_begin(&b);
	assert_int_equal(ap_enc_reg_send(&b, a, "some_registered_name"), 0);
	assert_int_equal(ap_enc_msg_raw(&b, msg + 1, msg_len - 1), 0); /* without its 131 */
	assert_int_equal(ap_frame_end(&b, st), 0);

	st = ap_frame_begin(&b);
	assert_int_equal(ap_enc_link(&b, a, bpid), 0);
	assert_int_equal(ap_frame_end(&b, st), 0);

	assert_int_equal(ap_enc_tick(&b), 0);

	st = ap_frame_begin(&b);
	assert_int_equal(ap_enc_exit(&b, a, bpid, reason, reason_len), 0);
	assert_int_equal(ap_frame_end(&b, st), 0);

	st = ap_frame_begin(&b);
	assert_int_equal(ap_enc_unlink_id_ack(&b, 0x123456789abcull, a, bpid), 0);
	assert_int_equal(ap_frame_end(&b, st), 0);

	st = ap_frame_begin(&b);
	assert_int_equal(ap_enc_alias_send(&b, a, alias.buff, alias.index), 0);
	assert_int_equal(ap_enc_msg_raw(&b, msg, msg_len), 0);
	assert_int_equal(ap_frame_end(&b, st), 0);

	/* Read back through the frame codec. */
	struct t_rt rt;
	memset(&rt, 0, sizeof rt);
	ap_frame_rx rx;
	ap_frame_rx_init(&rx, 0);
	assert_int_equal(ap_frame_rx_feed(&rx, b.data, b.len, t_rt_cb, &rt), 0);
	assert_int_equal(rx.part.len, 0);
	ap_frame_rx_free(&rx);
	assert_int_equal(rt.n, 6);
	assert_int_equal(rt.ticks, 1);

	ap_ctrl *c = rt.c;
	assert_int_equal(c[0].op, AP_OP_SEND);
	t_assert_pid_eq(c[0].to, *bpid);
	assert_int_equal(c[0].msg_len, msg_len);
	assert_memory_equal(c[0].msg, msg, (size_t)msg_len);

	assert_int_equal(c[1].op, AP_OP_REG_SEND);
	t_assert_pid_eq(c[1].from, *a);
	assert_string_equal(c[1].toname, "some_registered_name");
	assert_int_equal(c[1].msg_len, msg_len); /* the 131 was added */
	assert_memory_equal(c[1].msg, msg, (size_t)msg_len);

	assert_int_equal(c[2].op, AP_OP_LINK);
	t_assert_pid_eq(c[2].from, *a);
	t_assert_pid_eq(c[2].to, *bpid);

	assert_int_equal(c[3].op, AP_OP_EXIT);
	t_assert_pid_eq(c[3].from, *a);
	t_assert_pid_eq(c[3].to, *bpid);
	assert_int_equal(c[3].reason_len, reason_len);
	assert_memory_equal(c[3].reason, reason, (size_t)reason_len);

	assert_int_equal(c[4].op, AP_OP_UNLINK_ID_ACK);
	assert_true(c[4].id == 0x123456789abcull);
	t_assert_pid_eq(c[4].from, *a);
	t_assert_pid_eq(c[4].to, *bpid);

	assert_int_equal(c[5].op, AP_OP_ALIAS_SEND);
	assert_int_equal(c[5].op, 33);
	t_assert_pid_eq(c[5].from, *a);
	assert_int_equal(c[5].msg_len, msg_len);
	assert_memory_equal(c[5].msg, msg, (size_t)msg_len);
	/* The alias went out as given, right before the message. */
	assert_memory_equal(c[5].msg - alias.index, alias.buff, (size_t)alias.index);

	/* Every encoded frame is also refused whole-or-nothing when cut. */
	for (int k = 0; k < rt.n; k++)
		for (size_t n = 0; n < rt.lens[k]; n++)
			assert_int_equal(t_decode_rc(rt.frames[k], n), -EBADMSG);

	ei_x_free(&alias);
	ap_buf_free(&b);
}

static void test_encoded_frames_decode_to_the_same_fields(void **state)
{
	(void)state;
	erlang_pid a = t_echo_pid(), b = t_shell_pid();
	t_roundtrip(&a, &b);
}

static void test_encoded_frames_with_longest_node_names_decode(void **state)
{
	(void)state;
	erlang_pid a = t_long_pid(1), b = t_long_pid(0x7fff);
	t_roundtrip(&a, &b);
}

static void test_frame_end_refuses_failed_begin(void **state)
{
	(void)state;
	ap_buf b = { 0 };
	assert_int_equal(ap_frame_end(&b, (size_t)-1), -1);
	assert_int_equal(ap_frame_end(&b, 0), -1); /* no room for a length */
	size_t st = ap_frame_begin(&b);
	assert_int_equal(st, 0);
	assert_int_equal(b.len, 5);
	assert_int_equal(ap_frame_end(&b, st), 0);
	assert_int_equal(ap_get32be(b.data), 1); /* just the 'p' */
	ap_buf_free(&b);
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_captured_reg_send_decodes),
		cmocka_unit_test(test_captured_gen_calls_decode),
		cmocka_unit_test(test_captured_send_to_pid_decodes),
		cmocka_unit_test(test_captured_links_decode),
		cmocka_unit_test(test_captured_unlink_id_decodes),
		cmocka_unit_test(test_captured_exit2_decodes),
		cmocka_unit_test(test_captured_exit_decodes),
		cmocka_unit_test(test_captured_traced_sends_decode),
		cmocka_unit_test(test_captured_traced_exit_decodes),
		cmocka_unit_test(test_captured_tick_is_an_empty_frame),
		cmocka_unit_test(test_every_truncation_of_captured_frames_is_ebadmsg),
		cmocka_unit_test(test_heads_decode_once_the_control_tuple_is_whole),
		cmocka_unit_test(test_heads_that_are_no_control_tuple_are_ebadmsg),
		cmocka_unit_test(test_the_smallest_head_holds_a_usual_call_header),
		cmocka_unit_test(test_wrong_first_byte_or_version_is_ebadmsg),
		cmocka_unit_test(test_wrong_arity_is_ebadmsg),
		cmocka_unit_test(test_trailing_term_after_linklike_ops_is_ebadmsg),
		cmocka_unit_test(test_bad_message_after_send_is_ebadmsg),
		cmocka_unit_test(test_fun_whose_size_overruns_is_ebadmsg_everywhere),
		cmocka_unit_test(test_wellformed_unknown_op_is_enotsup),
		cmocka_unit_test(test_op_that_is_not_an_integer_is_ebadmsg),
		cmocka_unit_test(test_pid_where_an_atom_belongs_is_ebadmsg),
		cmocka_unit_test(test_other_known_ops_decode),
		cmocka_unit_test(test_encoders_write_what_a_beam_writes),
		cmocka_unit_test(test_error_replies_write_what_a_beam_writes),
		cmocka_unit_test(test_encoded_frames_decode_to_the_same_fields),
		cmocka_unit_test(test_encoded_frames_with_longest_node_names_decode),
		cmocka_unit_test(test_frame_end_refuses_failed_begin),
	};
	return cmocka_run_group_tests(tests, NULL, NULL);
}
