/* fuzz_classify: libFuzzer target over what a C node makes of a message:
 * ap_node_classify over prefixes of the input, and ap_encode_reply on the
 * tag of the call it finds. */
/*
 * The input is a message as it follows a control tuple (from its 131
 * byte). Each prefix is classified as the head of an oversized frame would
 * be: the input is copied once into an exact-size buffer and the bytes past
 * the prefix are poisoned, so ASan sees any read past the prefix (and past
 * the buffer) as well as an exact-size copy of the prefix would show it.
 *
 * Which prefixes: every one up to T_DENSE bytes (the 131, the tuple, the
 * atom, {Pid, Tag} with a long node name and a small tag: where a head's
 * structure is decided), the whole input, and, past T_DENSE, the point
 * where the verdict changes (found by bisection), every prefix within
 * T_WINDOW bytes of it, and T_SAMPLES lengths drawn from a generator seeded
 * by the input (deterministic: a replay checks the same ones). Classifying
 * all of them made the target O(n^2) and 2.8K exec/s.
 *
 * Checked:
 * - a call's tag is one term, by the walk, inside the prefix, and its
 *   request starts right after it; a cast's request lies inside too;
 * - what a head was taken for, the whole message is too: every prefix
 *   checked is either an info or exactly what the whole input is (kind,
 *   request offset, tag, caller), and no info prefix is longer than a
 *   call or cast prefix;
 * - the reply to a call is one frame that ap_ctrl_decode takes whole: an
 *   ALIAS_SEND to the alias when the tag is [alias | Ref], else a SEND to
 *   the caller, whose message is {Tag, Reply} with the tag's bytes as they
 *   came. It is built for the shortest call prefix (the tag ends on the
 *   poison) and for the whole input.
 */
#include <ei.h>
#include <sanitizer/asan_interface.h>
#include <errno.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ap_ctrl.h"
#include "ap_node.h"
#include "ap_node_int.h"
#include "ap_term.h"

#include "t_fuzz.h"

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

#define T_DENSE 384   /* every prefix up to here */
#define T_WINDOW 8    /* every prefix this close to the verdict's change */
#define T_SAMPLES 24  /* seeded lengths past T_DENSE */

/* The input, once, and how much of it is readable now. */
struct t_in {
	char *d;
	size_t size;
	size_t n;
	size_t max_info, min_decided; /* longest info prefix, shortest other */
	ap_msg whole;                 /* the verdict on the whole input */
};

/* Make d[0..n) readable and d[n..size) poisoned. */
static void t_cut(struct t_in *in, size_t n)
{
	if (n > in->n)
		__asan_unpoison_memory_region(in->d + in->n, n - in->n);
	else if (n < in->n)
		__asan_poison_memory_region(in->d + n, in->n - n);
	in->n = n;
}

static void t_classify(struct t_in *in, size_t n, ap_msg *m)
{
	t_cut(in, n);
	const char *d = in->d;
	*m = (ap_msg){ .kind = AP_MSG_INFO, .buf = d, .len = (int)n, .index = 1 };
	ap_node_classify(m);
	t_check(m->kind == AP_MSG_INFO || m->kind == AP_MSG_CALL || m->kind == AP_MSG_CAST);
	t_check(m->buf == d && m->len == (int)n);
	if (m->kind == AP_MSG_CALL) {
		t_check(m->tag > d && m->tag_len > 0 && m->tag + m->tag_len <= d + n);
		int t0 = (int)(m->tag - d);
		t_check(ap_term_end(d, n, t0) == t0 + m->tag_len);
		t_check(m->index == t0 + m->tag_len);
		t_check(memchr(m->from.node, 0, sizeof m->from.node) != NULL);
	} else if (m->kind == AP_MSG_CAST) {
		t_check(m->index > 1 && (size_t)m->index <= n);
	} else {
		t_check(m->index == 1 && m->tag == NULL);
	}
}

/* Classify the prefix of n bytes and hold it to the whole input's verdict:
 * 1 if it is an info, 0 if it is what the whole input is. */
static int t_prefix(struct t_in *in, size_t n)
{
	ap_msg m;
	t_classify(in, n, &m);
	if (m.kind == AP_MSG_INFO) {
		if (n > in->max_info)
			in->max_info = n;
		return 1;
	}
	const ap_msg *w = &in->whole;
	t_check(m.kind == w->kind && m.index == w->index);
	if (m.kind == AP_MSG_CALL)
		t_check(m.tag == w->tag && m.tag_len == w->tag_len && pid_same(&m.from, &w->from));
	if (n < in->min_decided)
		in->min_decided = n;
	return 0;
}

/* splitmix64: the sampled lengths follow from the input alone. */
static uint64_t t_next(uint64_t *s)
{
	uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
	z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
	return z ^ (z >> 31);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	struct t_in in = { .d = malloc(size ? size : 1), .size = size, .n = size, .min_decided = SIZE_MAX };
	if (!in.d)
		return 0;
	memcpy(in.d, data, size);
	t_classify(&in, size, &in.whole);
	if (in.whole.kind == AP_MSG_INFO)
		in.max_info = size;
	else
		in.min_decided = size;

	size_t dense = size < T_DENSE ? size : T_DENSE;
	for (size_t n = 0; n <= dense; n++)
		t_prefix(&in, n);
	if (size > dense) {
		/* Where the verdict changes past the dense part: bisect, then
		 * every prefix around the change. */
		if (in.whole.kind != AP_MSG_INFO && in.min_decided > dense) {
			size_t lo = dense, hi = size;
			while (hi - lo > 1) {
				size_t mid = lo + (hi - lo) / 2;
				if (t_prefix(&in, mid))
					lo = mid;
				else
					hi = mid;
			}
			size_t a = hi > dense + T_WINDOW ? hi - T_WINDOW : dense + 1;
			size_t b = hi + T_WINDOW < size ? hi + T_WINDOW : size;
			for (size_t n = a; n <= b; n++)
				t_prefix(&in, n);
		}
		uint64_t seed = 0xcbf29ce484222325ull;
		for (size_t k = 0; k < size; k++)
			seed = (seed ^ data[k]) * 0x100000001b3ull;
		for (int k = 0; k < T_SAMPLES; k++)
			t_prefix(&in, dense + 1 + t_next(&seed) % (size - dense));
	}
	t_check(in.max_info < in.min_decided);

	if (in.whole.kind == AP_MSG_CALL) {
		ap_msg m;
		t_classify(&in, in.min_decided, &m);
		t_reply(&m);
		t_classify(&in, size, &m);
		t_reply(&m);
	}
	t_cut(&in, size);
	free(in.d);
	return 0;
}
