/* fuzz_classify: libFuzzer target over what a C node makes of a message:
 * ap_node_classify over every prefix of the input, and ap_encode_reply on
 * the tag of each call it finds. */
/*
 * The input is a message as it follows a control tuple (from its 131
 * byte). Each prefix is classified from an exact-size copy, as the head of
 * an oversized frame would be, so ASan sees any read past it. Checked:
 * - a call's tag is one term, by the walk, inside the prefix, and its
 *   request starts right after it; a cast's request lies inside too;
 * - once a prefix is a call (or a cast), every longer one is the same, with
 *   the same tag: more bytes never change what a head was taken for;
 * - the reply to a call is one frame that ap_ctrl_decode takes whole: an
 *   ALIAS_SEND to the alias when the tag is [alias | Ref], else a SEND to
 *   the caller, whose message is {Tag, Reply} with the tag's bytes as they
 *   came.
 */
#include <ei.h>
#include <errno.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ap_ctrl.h"
#include "ap_node.h"
#include "ap_node_int.h"
#include "ap_term.h"

#define t_check(cond)                       \
	do {                                \
		if (!(cond))                \
			__builtin_trap();   \
	} while (0)

/* [alias | Ref]: LIST_EXT of one element, the atom alias, a reference
 * tail. The same test ap_encode_reply_head makes, written apart. */
static int is_alias_tag(const char *t, int len)
{
	int i = 0, arity, type, size;
	char atom[MAXATOMLEN_UTF8];
	return ei_decode_list_header(t, &i, &arity) == 0 && arity == 1 && ei_get_type(t, &i, &type, &size) == 0 &&
	       type == ERL_ATOM_EXT && ei_decode_atom_as(t, &i, atom, sizeof atom, ERLANG_UTF8, NULL, NULL) == 0 &&
	       strcmp(atom, "alias") == 0 && ei_get_type(t, &i, &type, &size) == 0 &&
	       type == ERL_NEW_REFERENCE_EXT && i < len;
}

static int pid_same(const erlang_pid *a, const erlang_pid *b)
{
	return a->num == b->num && a->serial == b->serial && a->creation == b->creation &&
	       strcmp(a->node, b->node) == 0;
}

/* Reply to the call m with {error, too_large} and check the frame. */
static void t_reply(const ap_msg *m)
{
	static const char reply[] = { (char)131, 104, 2, 119, 5, 'e', 'r', 'r', 'o', 'r',
				      119, 9, 't', 'o', 'o', '_', 'l', 'a', 'r', 'g', 'e' };
	erlang_pid self = { .num = 1, .serial = 0, .creation = 0x12345678 };
	strcpy(self.node, "fuzz@localhost");
	ap_buf b = { 0 };
	if (ap_encode_reply(&b, &self, &m->from, m->tag, m->tag_len, reply, sizeof reply)) {
		ap_buf_free(&b);
		return; /* out of memory */
	}
	t_check(b.len > 4 && ap_get32be(b.data) == b.len - 4);
	uint8_t *f = malloc(b.len - 4);
	t_check(f != NULL);
	memcpy(f, b.data + 4, b.len - 4);
	ap_ctrl c;
	t_check(ap_ctrl_decode(f, b.len - 4, &c) == 0);
	if (is_alias_tag(m->tag, m->tag_len)) {
		t_check(c.op == AP_OP_ALIAS_SEND);
		t_check(pid_same(&c.from, &self));
	} else {
		t_check(c.op == AP_OP_SEND);
		t_check(pid_same(&c.to, &m->from));
	}
	/* {Tag, Reply}: 131, SMALL_TUPLE 2, the tag verbatim, the reply. */
	t_check(c.msg_len == 3 + m->tag_len + (int)sizeof reply - 1);
	t_check((uint8_t)c.msg[0] == 131 && c.msg[1] == 104 && c.msg[2] == 2);
	t_check(memcmp(c.msg + 3, m->tag, (size_t)m->tag_len) == 0);
	t_check(memcmp(c.msg + 3 + m->tag_len, reply + 1, sizeof reply - 1) == 0);
	free(f);
	ap_buf_free(&b);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	enum ap_msg_kind first = AP_MSG_INFO;
	size_t tag_at = 0, tag_len = 0, req_at = 0;
	for (size_t n = 0; n <= size; n++) {
		char *d = malloc(n ? n : 1);
		if (!d)
			return 0;
		memcpy(d, data, n);
		ap_msg m = { .kind = AP_MSG_INFO, .buf = d, .len = (int)n, .index = 1 };
		ap_node_classify(&m);
		t_check(m.kind == AP_MSG_INFO || m.kind == AP_MSG_CALL || m.kind == AP_MSG_CAST);
		t_check(m.buf == d && m.len == (int)n);
		if (m.kind == AP_MSG_CALL) {
			t_check(m.tag > d && m.tag_len > 0 && m.tag + m.tag_len <= d + n);
			int t0 = (int)(m.tag - d);
			t_check(ap_term_end(d, n, t0) == t0 + m.tag_len);
			t_check(m.index == t0 + m.tag_len);
			t_check(memchr(m.from.node, 0, sizeof m.from.node) != NULL);
			t_reply(&m);
		} else if (m.kind == AP_MSG_CAST) {
			t_check(m.index > 1 && (size_t)m.index <= n);
		} else {
			t_check(m.index == 1 && m.tag == NULL);
		}
		/* Monotone in the prefix: what a head was taken for, the whole
		 * message is too. */
		if (first != AP_MSG_INFO) {
			t_check(m.kind == first && (size_t)m.index == req_at);
			if (first == AP_MSG_CALL)
				t_check((size_t)(m.tag - d) == tag_at && (size_t)m.tag_len == tag_len);
		} else if (m.kind != AP_MSG_INFO) {
			first = m.kind;
			req_at = (size_t)m.index;
			if (m.kind == AP_MSG_CALL) {
				tag_at = (size_t)(m.tag - d);
				tag_len = (size_t)m.tag_len;
			}
		}
		free(d);
	}
	return 0;
}
