/* test_term: ap_term_skip/validate_msg take real terms, refuse truncated, unknown, oversized ones. */
#include "t_helpers.h"

#include "ap_buf.h"
#include "ap_term.h"
#include "t_fun_overrun.h"

/* ---- building terms ----------------------------------------------------- */

/* Every sample is a whole message: 131 and one term. */
typedef void (*t_build_fn)(ei_x_buff *x);

struct t_sample {
	const char *name;
	t_build_fn build;
};

static void t_raw(ei_x_buff *x, const void *p, size_t n) { assert_int_equal(ei_x_append_buf(x, p, (int)n), 0); }

static void t_byte(ei_x_buff *x, uint8_t b) { t_raw(x, &b, 1); }

static void t_be32(ei_x_buff *x, uint32_t v)
{
	uint8_t b[4] = { (uint8_t)(v >> 24), (uint8_t)(v >> 16), (uint8_t)(v >> 8), (uint8_t)v };
	t_raw(x, b, 4);
}

static void t_be16(ei_x_buff *x, uint16_t v)
{
	uint8_t b[2] = { (uint8_t)(v >> 8), (uint8_t)v };
	t_raw(x, b, 2);
}

static void t_term_atom(ei_x_buff *x) { assert_int_equal(ei_x_encode_atom(x, "hello"), 0); }
static void t_term_atom_empty(ei_x_buff *x) { assert_int_equal(ei_x_encode_atom(x, ""), 0); }

static void t_term_atom_utf8(ei_x_buff *x)
{
	/* 255 characters of 2 bytes each: ATOM_UTF8_EXT with a 16-bit length. */
	char s[511];
	for (int i = 0; i < 255; i++) {
		s[2 * i] = (char)0xc3;
		s[2 * i + 1] = (char)0xa9;
	}
	s[510] = 0;
	assert_int_equal(ei_x_encode_atom_as(x, s, ERLANG_UTF8, ERLANG_UTF8), 0);
	assert_int_equal((uint8_t)x->buff[1], 118);
}

static void t_term_atom_latin1_old(ei_x_buff *x)
{
	t_byte(x, 100); /* ATOM_EXT */
	t_be16(x, 3);
	t_raw(x, "abc", 3);
}

static void t_term_small_atom_old(ei_x_buff *x)
{
	t_byte(x, 115); /* SMALL_ATOM_EXT */
	t_byte(x, 2);
	t_raw(x, "ok", 2);
}

static void t_term_small_int(ei_x_buff *x) { assert_int_equal(ei_x_encode_long(x, 200), 0); }
static void t_term_int(ei_x_buff *x) { assert_int_equal(ei_x_encode_long(x, -100000), 0); }
static void t_term_small_big(ei_x_buff *x) { assert_int_equal(ei_x_encode_longlong(x, -(1ll << 62)), 0); }
static void t_term_small_big_max(ei_x_buff *x) { assert_int_equal(ei_x_encode_ulonglong(x, UINT64_MAX), 0); }

static void t_term_large_big(ei_x_buff *x)
{
	/* 2^2400: 301 digit bytes, more than SMALL_BIG_EXT holds. */
	t_byte(x, 111);
	t_be32(x, 301);
	t_byte(x, 0);
	for (int i = 0; i < 300; i++)
		t_byte(x, 0);
	t_byte(x, 1);
}

static void t_term_float(ei_x_buff *x) { assert_int_equal(ei_x_encode_double(x, -1.5e300), 0); }

static void t_term_binary(ei_x_buff *x)
{
	char b[1000];
	for (int i = 0; i < 1000; i++)
		b[i] = (char)i;
	assert_int_equal(ei_x_encode_binary(x, b, sizeof b), 0);
}

static void t_term_binary_empty(ei_x_buff *x) { assert_int_equal(ei_x_encode_binary(x, "", 0), 0); }

static void t_term_bit_binary(ei_x_buff *x)
{
	static const char b[] = { (char)0xff, (char)0xa0 };
	assert_int_equal(ei_x_encode_bitstring(x, b, 0, 13), 0);
	assert_int_equal((uint8_t)x->buff[1], 77);
}

static void t_term_pid(ei_x_buff *x)
{
	erlang_pid p = t_pid("beam@host", 77, 3, 0x6b0c4b45);
	assert_int_equal(ei_x_encode_pid(x, &p), 0);
	assert_int_equal((uint8_t)x->buff[1], 88);
}

static void t_term_pid_old(ei_x_buff *x)
{
	t_byte(x, 103); /* PID_EXT: node, id, serial, 1-byte creation */
	t_byte(x, 119);
	t_byte(x, 6);
	t_raw(x, "a@host", 6);
	t_be32(x, 5);
	t_be32(x, 0);
	t_byte(x, 2);
}

static void t_term_port(ei_x_buff *x)
{
	erlang_port p;
	memset(&p, 0, sizeof p);
	strcpy(p.node, "beam@host");
	p.id = 12;
	p.creation = 7;
	assert_int_equal(ei_x_encode_port(x, &p), 0);
}

static void t_term_port_v4(ei_x_buff *x)
{
	erlang_port p;
	memset(&p, 0, sizeof p);
	strcpy(p.node, "beam@host");
	p.id = 1ull << 40;
	p.creation = 7;
	assert_int_equal(ei_x_encode_port(x, &p), 0);
	assert_int_equal((uint8_t)x->buff[1], 120);
}

static void t_term_port_old(ei_x_buff *x)
{
	t_byte(x, 102); /* PORT_EXT */
	t_byte(x, 115);
	t_byte(x, 1);
	t_byte(x, 'n');
	t_be32(x, 9);
	t_byte(x, 1);
}

static void t_term_ref(ei_x_buff *x)
{
	erlang_ref r;
	memset(&r, 0, sizeof r);
	strcpy(r.node, "beam@host");
	r.len = 3;
	r.n[0] = 1;
	r.n[1] = 2;
	r.n[2] = 3;
	r.creation = 0x6b0c4b45;
	assert_int_equal(ei_x_encode_ref(x, &r), 0);
	assert_int_equal((uint8_t)x->buff[1], 90);
}

static void t_term_ref_5words(ei_x_buff *x)
{
	erlang_ref r;
	memset(&r, 0, sizeof r);
	strcpy(r.node, "n@h");
	r.len = 5;
	r.creation = 1;
	assert_int_equal(ei_x_encode_ref(x, &r), 0);
}

static void t_term_new_ref_old(ei_x_buff *x)
{
	t_byte(x, 114); /* NEW_REFERENCE_EXT: words, node, 1-byte creation, ids */
	t_be16(x, 2);
	t_byte(x, 119);
	t_byte(x, 3);
	t_raw(x, "n@h", 3);
	t_byte(x, 1);
	t_be32(x, 10);
	t_be32(x, 11);
}

static void t_term_ref_old(ei_x_buff *x)
{
	t_byte(x, 101); /* REFERENCE_EXT */
	t_byte(x, 119);
	t_byte(x, 3);
	t_raw(x, "n@h", 3);
	t_be32(x, 10);
	t_byte(x, 1);
}

static void t_term_tuple(ei_x_buff *x)
{
	assert_int_equal(ei_x_encode_tuple_header(x, 3), 0);
	ei_x_encode_atom(x, "ok");
	ei_x_encode_long(x, 1);
	ei_x_encode_binary(x, "xy", 2);
}

static void t_term_tuple_empty(ei_x_buff *x) { assert_int_equal(ei_x_encode_tuple_header(x, 0), 0); }

static void t_term_large_tuple(ei_x_buff *x)
{
	assert_int_equal(ei_x_encode_tuple_header(x, 300), 0);
	assert_int_equal((uint8_t)x->buff[1], 105);
	for (int i = 0; i < 300; i++)
		ei_x_encode_long(x, i);
}

static void t_term_nil(ei_x_buff *x) { assert_int_equal(ei_x_encode_empty_list(x), 0); }

static void t_term_list(ei_x_buff *x)
{
	assert_int_equal(ei_x_encode_list_header(x, 3), 0);
	ei_x_encode_atom(x, "a");
	ei_x_encode_long(x, 100000);
	ei_x_encode_double(x, 2.0);
	ei_x_encode_empty_list(x);
}

static void t_term_improper_list(ei_x_buff *x)
{
	/* [1, 2 | three] */
	assert_int_equal(ei_x_encode_list_header(x, 2), 0);
	ei_x_encode_long(x, 1);
	ei_x_encode_long(x, 2);
	ei_x_encode_atom(x, "three");
}

static void t_term_string(ei_x_buff *x)
{
	assert_int_equal(ei_x_encode_string(x, "hello world"), 0);
	assert_int_equal((uint8_t)x->buff[1], 107);
}

static void t_term_long_string(ei_x_buff *x)
{
	/* Over 65535 characters: ei encodes a list of small integers. */
	static char s[70001];
	memset(s, 'z', 70000);
	s[70000] = 0;
	assert_int_equal(ei_x_encode_string(x, s), 0);
	assert_int_equal((uint8_t)x->buff[1], 108);
}

static void t_term_map(ei_x_buff *x)
{
	assert_int_equal(ei_x_encode_map_header(x, 2), 0);
	ei_x_encode_atom(x, "a");
	ei_x_encode_long(x, 1);
	ei_x_encode_binary(x, "k", 1);
	ei_x_encode_list_header(x, 1);
	ei_x_encode_atom(x, "x");
	ei_x_encode_empty_list(x);
}

static void t_term_map_empty(ei_x_buff *x) { assert_int_equal(ei_x_encode_map_header(x, 0), 0); }

static void t_term_export(ei_x_buff *x)
{
	/* fun lists:reverse/1 */
	t_byte(x, 113);
	ei_x_encode_atom(x, "lists");
	ei_x_encode_atom(x, "reverse");
	ei_x_encode_long(x, 1);
}

/* A closure as a BEAM encodes one: Module, OldIndex, OldUniq, Pid, then
 * `nfree` free variables (an atom, then integers). */
static void t_closure(ei_x_buff *x, int nfree)
{
	erlang_fun f;
	ei_x_buff fv;
	memset(&f, 0, sizeof f);
	f.arity = 1;
	strcpy(f.module, "erl_eval");
	f.type = EI_FUN_CLOSURE;
	memset(f.u.closure.md5, 0xab, sizeof f.u.closure.md5);
	f.u.closure.index = 5;
	f.u.closure.old_index = 5;
	f.u.closure.uniq = 1234;
	assert_int_equal(ei_x_new(&fv), 0);
	for (int k = 0; k < nfree; k++)
		assert_int_equal(k ? ei_x_encode_long(&fv, 7 * k) : ei_x_encode_atom(&fv, "x"), 0);
	f.u.closure.n_free_vars = nfree;
	f.u.closure.free_vars = fv.buff;
	f.u.closure.free_var_len = fv.index;
	f.u.closure.pid = t_pid("n@h", 1, 0, 1);
	assert_int_equal(ei_x_encode_fun(x, &f), 0);
	ei_x_free(&fv);
}

static void t_term_closure(ei_x_buff *x) { t_closure(x, 2); }
static void t_term_closure_no_free_vars(ei_x_buff *x) { t_closure(x, 0); }

static void t_term_closure_in_closure(ei_x_buff *x)
{
	/* A fun whose only free variable is a fun: the inner one must end
	 * where its Size says, and then the outer one where its Size says. */
	ei_x_buff inner;
	assert_int_equal(ei_x_new(&inner), 0);
	t_closure(&inner, 1);
	erlang_fun f;
	memset(&f, 0, sizeof f);
	strcpy(f.module, "m");
	f.type = EI_FUN_CLOSURE;
	f.u.closure.n_free_vars = 1;
	f.u.closure.free_vars = inner.buff;
	f.u.closure.free_var_len = inner.index;
	f.u.closure.pid = t_pid("n@h", 2, 0, 1);
	assert_int_equal(ei_x_encode_fun(x, &f), 0);
	ei_x_free(&inner);
}

static void t_term_nested(ei_x_buff *x)
{
	/* {ok, [#{k => {1, <<"b">>, [a | b]}, 2 => "str"}], -1.5, <<1:3>>} */
	erlang_pid p = t_pid("n@h", 1, 2, 3);
	ei_x_encode_tuple_header(x, 5);
	ei_x_encode_atom(x, "ok");
	ei_x_encode_list_header(x, 1);
	ei_x_encode_map_header(x, 2);
	ei_x_encode_atom(x, "k");
	ei_x_encode_tuple_header(x, 3);
	ei_x_encode_long(x, 1);
	ei_x_encode_binary(x, "b", 1);
	ei_x_encode_list_header(x, 1);
	ei_x_encode_atom(x, "a");
	ei_x_encode_atom(x, "b");
	ei_x_encode_long(x, 2);
	ei_x_encode_string(x, "str");
	ei_x_encode_empty_list(x);
	ei_x_encode_double(x, -1.5);
	ei_x_encode_bitstring(x, "\x20", 0, 3);
	ei_x_encode_pid(x, &p);
}

#define S(fn) { &(#fn)[7], fn } /* the name without t_term_ */
static const struct t_sample samples[] = {
	S(t_term_atom), S(t_term_atom_empty), S(t_term_atom_utf8), S(t_term_atom_latin1_old),
	S(t_term_small_atom_old), S(t_term_small_int), S(t_term_int), S(t_term_small_big),
	S(t_term_small_big_max), S(t_term_large_big), S(t_term_float),
	S(t_term_binary), S(t_term_binary_empty), S(t_term_bit_binary), S(t_term_pid),
	S(t_term_pid_old), S(t_term_port), S(t_term_port_v4), S(t_term_port_old), S(t_term_ref),
	S(t_term_ref_5words), S(t_term_new_ref_old), S(t_term_ref_old), S(t_term_tuple),
	S(t_term_tuple_empty), S(t_term_large_tuple), S(t_term_nil), S(t_term_list),
	S(t_term_improper_list), S(t_term_string), S(t_term_long_string), S(t_term_map),
	S(t_term_map_empty), S(t_term_export), S(t_term_closure), S(t_term_closure_no_free_vars),
	S(t_term_closure_in_closure), S(t_term_nested),
};
#define NSAMPLES (sizeof samples / sizeof samples[0])

static ei_x_buff t_build(const struct t_sample *s)
{
	ei_x_buff x;
	assert_int_equal(ei_x_new_with_version(&x), 0);
	s->build(&x);
	return x;
}

/* ---- tests -------------------------------------------------------------- */

static void test_real_terms_are_accepted_whole(void **state)
{
	(void)state;
	for (size_t k = 0; k < NSAMPLES; k++) {
		ei_x_buff x = t_build(&samples[k]);
		uint8_t *m = t_dup(x.buff, (size_t)x.index);
		int idx = 1, eidx = 1;

		if (ap_term_validate_msg((const char *)m, (size_t)x.index) != 0)
			fail_msg("%s: valid message refused", samples[k].name);
		if (ap_term_skip((const char *)m, (size_t)x.index, &idx) != 0 || idx != x.index)
			fail_msg("%s: skip ended at %d, term is %d bytes", samples[k].name, idx, x.index);
		/* ei agrees on where the term ends. */
		assert_int_equal(ei_skip_term(x.buff, &eidx), 0);
		assert_int_equal(eidx, idx);
		free(m);
		ei_x_free(&x);
	}
}

/* ap_term_scan reports the largest map arity anywhere in the term (none:
 * 0), with the same end as ap_term_skip; map-like bytes inside atoms or
 * binaries are not maps. */
static void test_scan_reports_the_largest_map(void **state)
{
	ei_x_buff x;
	uint64_t m = 99;
	int idx = 1;

	(void)state;
	ei_x_new_with_version(&x);
	ei_x_encode_tuple_header(&x, 3);
	ei_x_encode_atom(&x, "tttt");                  /* 116 bytes, not a map */
	ei_x_encode_binary(&x, "t\0\0\1\0", 5);
	ei_x_encode_list_header(&x, 1);
	ei_x_encode_map_header(&x, 2);
	ei_x_encode_atom(&x, "a");
	ei_x_encode_map_header(&x, 40);
	for (int k = 0; k < 40; k++) {
		ei_x_encode_long(&x, k);
		ei_x_encode_long(&x, k);
	}
	ei_x_encode_atom(&x, "b");
	ei_x_encode_map_header(&x, 0);
	ei_x_encode_empty_list(&x);
	assert_int_equal(ap_term_scan(x.buff, (size_t)x.index, &idx, &m), 0);
	assert_int_equal(idx, x.index);
	assert_int_equal(m, 40);
	ei_x_free(&x);

	ei_x_new_with_version(&x);
	ei_x_encode_tuple_header(&x, 2);
	ei_x_encode_atom(&x, "tuple");
	ei_x_encode_map_header(&x, 32);
	for (int k = 0; k < 32; k++) {
		ei_x_encode_long(&x, k);
		ei_x_encode_atom(&x, "t");
	}
	idx = 1;
	assert_int_equal(ap_term_scan(x.buff, (size_t)x.index, &idx, &m), 0);
	assert_int_equal(m, 32);
	/* a truncated term: refused, as by ap_term_skip */
	idx = 1;
	assert_int_equal(ap_term_scan(x.buff, (size_t)x.index - 1, &idx, &m), -1);
	ei_x_free(&x);
}

static void test_every_truncation_is_refused(void **state)
{
	(void)state;
	for (size_t k = 0; k < NSAMPLES; k++) {
		ei_x_buff x = t_build(&samples[k]);
		size_t len = (size_t)x.index;
		for (size_t n = 0; n < len; n++) {
			/* Each check walks the prefix, so a sample of 100+ KiB
			 * would take minutes: past 8 KiB, every prefix near both
			 * ends and every 61st in between. */
			if (len > 8192 && n > 4096 && n < len - 4096 && n % 61)
				continue;
			/* An exact-size copy: ASan catches a read past the prefix. */
			uint8_t *m = t_dup(x.buff, n);
			int idx = 1;
			if (ap_term_validate_msg((const char *)m, n) != -1)
				fail_msg("%s: truncated to %zu of %d bytes accepted", samples[k].name, n, x.index);
			if (n >= 1) {
				if (ap_term_skip((const char *)m, n, &idx) != -1)
					fail_msg("%s: skip of %zu of %d bytes succeeded", samples[k].name, n, x.index);
				if (idx != 1)
					fail_msg("%s: failed skip moved idx to %d", samples[k].name, idx);
			}
			free(m);
		}
		ei_x_free(&x);
	}
}

static void test_trailing_bytes_are_refused_but_skippable(void **state)
{
	(void)state;
	for (size_t k = 0; k < NSAMPLES; k++) {
		ei_x_buff x = t_build(&samples[k]);
		int len = x.index;
		t_byte(&x, 106); /* a whole extra term: [] */
		uint8_t *m = t_dup(x.buff, (size_t)x.index);
		int idx = 1;
		if (ap_term_validate_msg((const char *)m, (size_t)x.index) != -1)
			fail_msg("%s: message with a trailing byte accepted", samples[k].name);
		/* skip reads one term only and stops where it ends. */
		assert_int_equal(ap_term_skip((const char *)m, (size_t)x.index, &idx), 0);
		assert_int_equal(idx, len);
		free(m);
		ei_x_free(&x);
	}
}

static void test_missing_or_wrong_version_byte_is_refused(void **state)
{
	(void)state;
	for (size_t k = 0; k < NSAMPLES; k++) {
		ei_x_buff x = t_build(&samples[k]);
		uint8_t *m = t_dup(x.buff + 1, (size_t)x.index - 1);
		if (ap_term_validate_msg((const char *)m, (size_t)x.index - 1) != -1)
			fail_msg("%s: message without its version byte accepted", samples[k].name);
		free(m);
		m = t_dup(x.buff, (size_t)x.index);
		m[0] = 130;
		if (ap_term_validate_msg((const char *)m, (size_t)x.index) != -1)
			fail_msg("%s: version byte 130 accepted", samples[k].name);
		free(m);
		ei_x_free(&x);
	}
}

static int t_tag_known(int tag)
{
	static const uint8_t known[] = { 70, 77, 88, 89, 90, 97, 98, 100, 101, 102, 103, 104, 105, 106,
					 107, 108, 109, 110, 111, 112, 113, 114, 115, 116, 118, 119, 120 };
	return memchr(known, tag, sizeof known) != NULL;
}

static void test_unknown_tags_are_refused(void **state)
{
	(void)state;
	int unknown = 0;
	for (int tag = 0; tag < 256; tag++) {
		if (t_tag_known(tag))
			continue;
		unknown++;
		/* The tag, then enough zeros to satisfy any fixed-size term. */
		uint8_t b[64] = { 131, (uint8_t)tag };
		int idx = 1;
		if (ap_term_validate_msg((const char *)b, sizeof b) != -1 ||
		    ap_term_skip((const char *)b, sizeof b, &idx) != -1 || idx != 1)
			fail_msg("unknown tag %d accepted", tag);
		/* Nor inside a container. */
		uint8_t t[64] = { 131, 104, 2, 106, (uint8_t)tag };
		if (ap_term_validate_msg((const char *)t, sizeof t) != -1)
			fail_msg("unknown tag %d accepted inside a tuple", tag);
	}
	/* Atom cache refs, compressed, LOCAL_EXT, FUN_EXT, FLOAT_EXT (ei reads
	 * its text with sscanf, unbounded by the 31 bytes), a nested 131. */
	assert_false(t_tag_known(82) || t_tag_known(80) || t_tag_known(121) || t_tag_known(117) ||
		     t_tag_known(99) || t_tag_known(131));
	assert_int_equal(unknown, 256 - 27);
}

static void test_new_fun_is_walked_and_its_size_bounded(void **state)
{
	(void)state;
	/* A closure with two free variables, as a BEAM encodes one: users
	 * send funs by mistake, and that must not cost the connection. */
	ei_x_buff x;
	ei_x_new_with_version(&x);
	t_closure(&x, 2);
	assert_int_equal((uint8_t)x.buff[1], 112);
	int eidx = 1, idx = 1;
	assert_int_equal(ei_skip_term(x.buff, &eidx), 0);
	assert_int_equal(ap_term_skip(x.buff, (size_t)x.index, &idx), 0);
	assert_int_equal(idx, eidx); /* we and ei agree where it ends */
	assert_int_equal(ap_term_validate_msg(x.buff, (size_t)x.index), 0);

	/* Every truncation is refused. */
	for (int n = 1; n < x.index; n++) {
		char *c = malloc((size_t)n);
		memcpy(c, x.buff, (size_t)n);
		idx = 1;
		assert_int_equal(ap_term_skip(c, (size_t)n, &idx), -1);
		free(c);
	}
	/* A Size reaching past the buffer is refused, even with a valid body:
	 * ei would trust it to find the free variables. */
	uint32_t size = ap_get32be((const uint8_t *)x.buff + 2);
	ap_put32be((uint8_t *)x.buff + 2, size + 100);
	idx = 1;
	assert_int_equal(ap_term_skip(x.buff, (size_t)x.index, &idx), -1);
	ei_x_free(&x);
}

/* The Size of a fun and its walk must agree to the byte: ei skips a fun by
 * Size, and a fun whose walk ends elsewhere would have ei (and every
 * consumer after it) read from bytes the walk never vouched for. */
static void test_fun_size_must_match_where_its_walk_ends(void **state)
{
	(void)state;
	for (int nfree = 0; nfree <= 2; nfree++) {
		for (int delta = -3; delta <= 3; delta++) {
			ei_x_buff x;
			ei_x_new_with_version(&x);
			ei_x_encode_tuple_header(&x, 2);
			int at = x.index;
			t_closure(&x, nfree);
			int fun_end = x.index;
			/* Enough well-formed terms after it for any Size to land in. */
			ei_x_encode_string(&x, "abcdefgh");
			uint32_t size = ap_get32be((const uint8_t *)x.buff + at + 1);
			ap_put32be((uint8_t *)x.buff + at + 1, size + (uint32_t)delta);
			uint8_t *m = t_dup(x.buff, (size_t)x.index);
			int idx = at;
			int r = ap_term_skip((const char *)m, (size_t)x.index, &idx);
			if (delta == 0) {
				if (r != 0 || idx != fun_end)
					fail_msg("%d free vars: exact Size refused", nfree);
				assert_int_equal(ap_term_validate_msg((const char *)m, (size_t)x.index), 0);
			} else {
				if (r != -1 || idx != at)
					fail_msg("%d free vars: Size off by %d accepted", nfree, delta);
				assert_int_equal(ap_term_validate_msg((const char *)m, (size_t)x.index), -1);
			}
			free(m);
			ei_x_free(&x);
		}
	}
}

/* The reproducer of issue 12: {'$gen_cast', {Fun, Pad}} where ei, skipping
 * Fun by its Size, lands on a binary header claiming 256 MiB inside Pad. The
 * old walk accepted it, and ei_skip_term then ended 256 MiB past the buffer. */
static void test_fun_overrunning_into_a_huge_binary_header_is_refused(void **state)
{
	(void)state;
	ei_x_buff x;
	ei_x_new_with_version(&x);
	ei_x_encode_tuple_header(&x, 2);
	ei_x_encode_atom(&x, "$gen_cast");
	ei_x_encode_tuple_header(&x, 2);
	assert_int_equal(t_fun_overrun(&x, 256u << 20), 0);
	uint8_t *m = t_dup(x.buff, (size_t)x.index);
	assert_int_equal(ap_term_validate_msg((const char *)m, (size_t)x.index), -1);
	int idx = 1;
	assert_int_equal(ap_term_skip((const char *)m, (size_t)x.index, &idx), -1);
	assert_int_equal(idx, 1);
	/* What ei makes of it: the very disagreement the walk must refuse. */
	int eidx = 1;
	assert_int_equal(ei_skip_term((const char *)m, &eidx), 0);
	assert_true(eidx > x.index);
	free(m);
	ei_x_free(&x);
}

/* A NEW_FUN_EXT from its parts, with a Size that matches them. */
static ei_x_buff t_fun_raw(const char *fields, size_t flen, uint32_t nfree, const char *fv, size_t fvlen)
{
	ei_x_buff x;
	assert_int_equal(ei_x_new_with_version(&x), 0);
	t_byte(&x, 112);
	t_be32(&x, (uint32_t)(29 + flen + fvlen));
	t_byte(&x, 1);
	for (int k = 0; k < 16; k++)
		t_byte(&x, 0xab);
	t_be32(&x, 5);
	t_be32(&x, nfree);
	t_raw(&x, fields, flen);
	t_raw(&x, fv, fvlen);
	return x;
}

static void t_expect(const char *what, const char *b, size_t len, int ok)
{
	uint8_t *m = t_dup(b, len);
	int r = ap_term_validate_msg((const char *)m, len);
	if (ok && r != 0)
		fail_msg("%s: refused", what);
	if (!ok && r != -1)
		fail_msg("%s: accepted", what);
	if (ok) {
		int i = 1;
		assert_int_equal(ei_skip_term((const char *)m, &i), 0);
		assert_int_equal(i, (int)len);
	}
	free(m);
}

#define T_PID_NH "\x58\x77\x03n@h\0\0\0\1\0\0\0\0\0\0\0\1"

/* A fun's fixed fields are checked as ei_decode_fun reads them (Module an
 * atom, OldIndex and OldUniq integers, Pid a pid), and an export's as well
 * (two atoms and a small integer): ei refuses the rest, and a refusal ei
 * makes inside a container is one ei_skip_term silently steps past. */
static void test_fun_and_export_fields_are_checked(void **state)
{
	(void)state;
	static const struct {
		const char *what;
		const char *f;
		size_t len;
		int ok;
	} funs[] = {
#define F(what, lit, ok) { what, lit, sizeof(lit) - 1, ok }
		F("fields as a BEAM encodes them", "\x77\x01m" "\x61\x05" "\x62\0\0\4\xd2" T_PID_NH, 1),
		F("old pid and latin-1 module", "\x64\0\x01m" "\x61\x05" "\x61\x07" "\x67\x73\x01n\0\0\0\1\0\0\0\0\1", 1),
		F("module a string", "\x6b\0\0" "\x61\x05" "\x62\0\0\4\xd2" T_PID_NH, 0),
		F("module a small integer", "\x61\x01" "\x61\x05" "\x62\0\0\4\xd2" T_PID_NH, 0),
		F("old index a nil", "\x77\x01m" "\x6a" "\x62\0\0\4\xd2" T_PID_NH, 0),
		F("old index a small big", "\x77\x01m" "\x6e\x01\0\x05" "\x62\0\0\4\xd2" T_PID_NH, 0),
		F("old uniq an atom", "\x77\x01m" "\x61\x05" "\x77\x01u" T_PID_NH, 0),
		F("pid a port", "\x77\x01m" "\x61\x05" "\x62\0\0\4\xd2" "\x59\x77\x03n@h\0\0\0\1\0\0\0\1", 0),
		F("pid missing", "\x77\x01m" "\x61\x05" "\x62\0\0\4\xd2", 0),
		F("pid whose node is a binary", "\x77\x01m" "\x61\x05" "\x62\0\0\4\xd2" "\x58\x6d\0\0\0\0\0\0\0\1\0\0\0\0\0\0\0\1", 0),
#undef F
	};
	for (size_t k = 0; k < sizeof funs / sizeof funs[0]; k++) {
		ei_x_buff x = t_fun_raw(funs[k].f, funs[k].len, 0, "", 0);
		t_expect(funs[k].what, x.buff, (size_t)x.index, funs[k].ok);
		ei_x_free(&x);
		/* The same with a free variable. */
		x = t_fun_raw(funs[k].f, funs[k].len, 1, "\x6a", 1);
		t_expect(funs[k].what, x.buff, (size_t)x.index, funs[k].ok);
		ei_x_free(&x);
	}
	/* NumFree 0 with bytes left before Size: ei would skip them unread. */
	ei_x_buff x = t_fun_raw("\x77\x01m" "\x61\x05" "\x62\0\0\4\xd2" T_PID_NH, 23, 0, "\x6a", 1);
	t_expect("no free variables but a byte before Size", x.buff, (size_t)x.index, 0);
	ei_x_free(&x);
	/* Fields running past Size: refused, even with Size in the buffer. */
	x = t_fun_raw("\x77\x01m" "\x61\x05" "\x62\0\0\4\xd2" T_PID_NH, 23, 1, "\x6a", 1);
	ap_put32be((uint8_t *)x.buff + 2, 29 + 10);
	t_expect("fields past Size", x.buff, (size_t)x.index, 0);
	ei_x_free(&x);

	static const struct {
		const char *what;
		const char *b;
		size_t len;
		int ok;
	} exports[] = {
#define E(what, lit, ok) { what, lit, sizeof(lit) - 1, ok }
		E("lists:reverse/1", "\x83\x71\x77\x05lists\x77\x07reverse\x61\x01", 1),
		E("latin-1 atoms", "\x83\x71\x64\0\x01m\x73\x01" "f\x61\x00", 1),
		E("arity an INTEGER_EXT", "\x83\x71\x77\x01m\x77\x01" "f\x62\0\0\0\x01", 0),
		E("arity an atom", "\x83\x71\x77\x01m\x77\x01" "f\x77\x01" "a", 0),
		E("module a small integer", "\x83\x71\x61\x01\x77\x01" "f\x61\x01", 0),
		E("function a binary", "\x83\x71\x77\x01m\x6d\0\0\0\x01" "f\x61\x01", 0),
#undef E
	};
	for (size_t k = 0; k < sizeof exports / sizeof exports[0]; k++)
		t_expect(exports[k].what, exports[k].b, exports[k].len, exports[k].ok);
}

/* Atoms are refused past what ei decodes in every place: ei converts a
 * Latin-1 node or module name to UTF-8 into 1020 bytes. */
static void test_atoms_longer_than_ei_reads_are_refused(void **state)
{
	(void)state;
	static const struct {
		const char *what;
		int tag;
		size_t n;
		int ok;
	} cases[] = {
		{ "latin-1 atom of 255", 100, 255, 1 },  { "latin-1 atom of 256", 100, 256, 0 },
		{ "latin-1 atom of 1020", 100, 1020, 0 }, { "utf-8 atom of 1020", 118, 1020, 1 },
		{ "utf-8 atom of 1021", 118, 1021, 0 },
	};
	for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
		for (int in_pid = 0; in_pid <= 1; in_pid++) {
			ei_x_buff x;
			ei_x_new_with_version(&x);
			if (in_pid)
				t_byte(&x, 88);
			t_byte(&x, (uint8_t)cases[k].tag);
			t_be16(&x, (uint16_t)cases[k].n);
			for (size_t i = 0; i < cases[k].n; i++)
				t_byte(&x, 0xe9 & (cases[k].tag == 118 ? 0x7f : 0xff)); /* é in Latin-1 */
			if (in_pid)
				for (int i = 0; i < 12; i++)
					t_byte(&x, 0);
			t_expect(cases[k].what, x.buff, (size_t)x.index, cases[k].ok);
			ei_x_free(&x);
		}
	}
}

/* Headers announcing far more than the buffer holds: refused at once, without
 * reading past the end (ASan) or spinning through 2^32 phantom elements. */
static void test_huge_announced_sizes_are_refused(void **state)
{
	(void)state;
	static const struct {
		const char *what;
		uint8_t b[16];
		size_t len;
	} cases[] = {
		{ "list of 2^32-1 elements in 10 bytes", { 131, 108, 0xff, 0xff, 0xff, 0xff, 106, 106, 106, 106 }, 10 },
		{ "list of 2^31 elements", { 131, 108, 0x80, 0, 0, 0, 97, 1, 97, 2, 106 }, 11 },
		{ "large tuple of 2^32-1", { 131, 105, 0xff, 0xff, 0xff, 0xff, 106, 106, 106 }, 9 },
		{ "small tuple of 255 in 8 bytes", { 131, 104, 255, 106, 106, 106, 106, 106 }, 8 },
		{ "map of 2^32-1 pairs", { 131, 116, 0xff, 0xff, 0xff, 0xff, 106, 106, 106, 106 }, 10 },
		{ "map of 2^31 pairs (2^32 terms)", { 131, 116, 0x80, 0, 0, 0, 106, 106 }, 8 },
		{ "binary of 2^32-1 bytes", { 131, 109, 0xff, 0xff, 0xff, 0xff, 1, 2, 3 }, 9 },
		{ "bit binary of 2^32-1 bytes", { 131, 77, 0xff, 0xff, 0xff, 0xff, 8, 1, 2 }, 9 },
		{ "large big of 2^32-1 digits", { 131, 111, 0xff, 0xff, 0xff, 0xff, 0, 1, 2 }, 9 },
		{ "small big of 255 digits", { 131, 110, 255, 0, 1, 2, 3 }, 7 },
		{ "string of 65535 chars", { 131, 107, 0xff, 0xff, 'a', 'b' }, 6 },
		{ "atom of 65535 bytes", { 131, 118, 0xff, 0xff, 'a', 'b' }, 6 },
		{ "small atom of 255 bytes", { 131, 119, 255, 'a', 'b' }, 5 },
		{ "pid whose node atom runs off the end", { 131, 88, 119, 200, 'n', 0, 0, 0, 0 }, 9 },
		{ "ref of 65535 words", { 131, 90, 0xff, 0xff, 119, 1, 'n', 0, 0, 0, 0, 0, 0, 0, 0 }, 15 },
		{ "list inside list, both huge", { 131, 108, 0, 0, 0, 2, 108, 0xff, 0xff, 0xff, 0xff, 106 }, 12 },
	};
	for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
		uint8_t *m = t_dup(cases[k].b, cases[k].len);
		int idx = 1;
		if (ap_term_validate_msg((const char *)m, cases[k].len) != -1)
			fail_msg("%s: accepted", cases[k].what);
		if (ap_term_skip((const char *)m, cases[k].len, &idx) != -1 || idx != 1)
			fail_msg("%s: skipped", cases[k].what);
		free(m);
	}
}

/* Fields with a fixed range, well inside the buffer but out of range. */
static void test_out_of_range_fields_are_refused(void **state)
{
	(void)state;
	static const struct {
		const char *what;
		uint8_t b[40];
		size_t len;
	} bad[] = {
		{ "bit binary with 0 bits in the last byte", { 131, 77, 0, 0, 0, 1, 0, 0xff }, 8 },
		{ "bit binary with 9 bits in the last byte", { 131, 77, 0, 0, 0, 1, 9, 0xff }, 8 },
		{ "empty bit binary with 8 bits in its last byte", { 131, 77, 0, 0, 0, 0, 8 }, 7 },
		{ "FLOAT_EXT text", { 131, 99, '1', '.', '5', 0 }, 33 },
		{ "small big with sign 2", { 131, 110, 1, 2, 7 }, 5 },
		{ "large big with sign 255", { 131, 111, 0, 0, 0, 1, 255, 7 }, 8 },
		{ "ref of 0 words", { 131, 90, 0, 0, 119, 1, 'n', 0, 0, 0, 1 }, 11 },
		{ "ref of 6 words", { 131, 90, 0, 6, 119, 1, 'n', 0, 0, 0, 1 }, 11 },
		{ "pid with an integer for a node", { 131, 88, 97, 1, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0 }, 17 },
		{ "port with a binary for a node", { 131, 89, 109, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 1 }, 15 },
	};
	static const struct {
		const char *what;
		uint8_t b[24];
		size_t len;
	} good[] = {
		{ "bit binary with 1 bit in the last byte", { 131, 77, 0, 0, 0, 1, 1, 0x80 }, 8 },
		{ "bit binary with 8 bits in the last byte", { 131, 77, 0, 0, 0, 1, 8, 0xff }, 8 },
		{ "empty bit binary with 0 bits", { 131, 77, 0, 0, 0, 0, 0 }, 7 },
		{ "small big with sign 1", { 131, 110, 1, 1, 7 }, 5 },
		{ "ref of 1 word", { 131, 90, 0, 1, 119, 1, 'n', 0, 0, 0, 1, 0, 0, 0, 1 }, 15 },
	};
	for (size_t k = 0; k < sizeof bad / sizeof bad[0]; k++) {
		uint8_t *m = t_dup(bad[k].b, bad[k].len);
		if (ap_term_validate_msg((const char *)m, bad[k].len) != -1)
			fail_msg("%s: accepted", bad[k].what);
		free(m);
	}
	/* The same shapes with the field in range pass, so the refusals above
	 * are about the field and not the shape. */
	for (size_t k = 0; k < sizeof good / sizeof good[0]; k++) {
		uint8_t *m = t_dup(good[k].b, good[k].len);
		if (ap_term_validate_msg((const char *)m, good[k].len) != 0)
			fail_msg("%s: refused", good[k].what);
		free(m);
	}
}

static void test_skip_rejects_bad_index_and_length(void **state)
{
	(void)state;
	static const char b[] = { (char)131, 97, 1 };
	int idx = -1;
	assert_int_equal(ap_term_skip(b, sizeof b, &idx), -1);
	assert_int_equal(idx, -1);
	idx = 4;
	assert_int_equal(ap_term_skip(b, sizeof b, &idx), -1);
	assert_int_equal(idx, 4);
	idx = 3; /* at the end: no term there */
	assert_int_equal(ap_term_skip(b, sizeof b, &idx), -1);
	assert_int_equal(idx, 3);
	/* A length the int index could not express is refused before any read
	 * past the term. */
	idx = 1;
	assert_int_equal(ap_term_skip(b, (size_t)INT32_MAX + 1, &idx), -1);
	assert_int_equal(idx, 1);
	idx = 1;
	assert_int_equal(ap_term_skip(b, sizeof b, &idx), 0);
	assert_int_equal(idx, 3);
	/* Skip from the middle of a buffer: the second of two terms. */
	static const char two[] = { 97, 1, 106 };
	idx = 1;
	assert_int_equal(ap_term_skip(two, sizeof two, &idx), -1); /* 1 is not a tag */
	idx = 2;
	assert_int_equal(ap_term_skip(two, sizeof two, &idx), 0);
	assert_int_equal(idx, 3);
}

/* {{{...[]...}}} nested `depth` tuples deep. */
static uint8_t *nested(size_t depth, size_t *len)
{
	*len = 1 + 2 * depth + 1;
	uint8_t *b = malloc(*len);
	assert_non_null(b);
	b[0] = 131;
	for (size_t i = 0; i < depth; i++) {
		b[1 + 2 * i] = 104;
		b[2 + 2 * i] = 1;
	}
	b[*len - 1] = 106;
	return b;
}

/* ei's skip and decoders recurse once per level: the walk itself is
 * iterative, and refuses nesting beyond AP_TERM_MAX_DEPTH, so that a term a
 * million deep (which overflowed the stack in ei_skip_term) never reaches
 * ei; up to the limit, ei agrees with the walk. */
static void test_nesting_is_bounded(void **state)
{
	(void)state;
	size_t len;
	uint8_t *b = nested(AP_TERM_MAX_DEPTH, &len);
	assert_int_equal(ap_term_validate_msg((const char *)b, len), 0);
	int i = 1;
	assert_int_equal(ei_skip_term((const char *)b, &i), 0);
	assert_int_equal(i, (int)len);
	b[len / 2 & ~(size_t)1] = 2; /* one tuple claims a second element that is missing */
	assert_int_equal(ap_term_validate_msg((const char *)b, len), -1);
	free(b);

	b = nested(AP_TERM_MAX_DEPTH + 1, &len);
	assert_int_equal(ap_term_validate_msg((const char *)b, len), -1);
	free(b);
	b = nested(1000000, &len);
	assert_int_equal(ap_term_validate_msg((const char *)b, len), -1);
	free(b);

	/* Wide is fine: a list of 100000 small tuples is depth 2. */
	len = 1 + 5 + 100000 * 3 + 1;
	b = malloc(len);
	assert_non_null(b);
	b[0] = 131;
	b[1] = 108;
	ap_put32be(b + 2, 100000);
	for (size_t k = 0; k < 100000; k++) {
		b[6 + 3 * k] = 104;
		b[7 + 3 * k] = 1;
		b[8 + 3 * k] = 106;
	}
	b[len - 1] = 106;
	assert_int_equal(ap_term_validate_msg((const char *)b, len), 0);
	free(b);
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_real_terms_are_accepted_whole),
		cmocka_unit_test(test_scan_reports_the_largest_map),
		cmocka_unit_test(test_every_truncation_is_refused),
		cmocka_unit_test(test_trailing_bytes_are_refused_but_skippable),
		cmocka_unit_test(test_missing_or_wrong_version_byte_is_refused),
		cmocka_unit_test(test_unknown_tags_are_refused),
		cmocka_unit_test(test_new_fun_is_walked_and_its_size_bounded),
		cmocka_unit_test(test_fun_size_must_match_where_its_walk_ends),
		cmocka_unit_test(test_fun_overrunning_into_a_huge_binary_header_is_refused),
		cmocka_unit_test(test_fun_and_export_fields_are_checked),
		cmocka_unit_test(test_atoms_longer_than_ei_reads_are_refused),
		cmocka_unit_test(test_huge_announced_sizes_are_refused),
		cmocka_unit_test(test_out_of_range_fields_are_refused),
		cmocka_unit_test(test_skip_rejects_bad_index_and_length),
		cmocka_unit_test(test_nesting_is_bounded),
	};
	return cmocka_run_group_tests(tests, NULL, NULL);
}
