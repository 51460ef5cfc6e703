/* test_term_check: ap_term_check refuses what a BEAM's decoder refuses, takes what it takes, and its atom set holds its cap. */
#include "t_helpers.h"

#include <pthread.h>

#include "ap_atomset.h"
#include "ap_buf.h"
#include "ap_term.h"

/* ---- building terms (no 131) --------------------------------------------- */

typedef struct t_buf {
	uint8_t *b;
	size_t n, cap;
} t_buf;

static void t_put(t_buf *t, const void *p, size_t n)
{
	if (t->n + n > t->cap) {
		t->cap = (t->n + n) * 2 + 64;
		t->b = realloc(t->b, t->cap);
		assert_non_null(t->b);
	}
	memcpy(t->b + t->n, p, n);
	t->n += n;
}

static void t_u8(t_buf *t, uint8_t v) { t_put(t, &v, 1); }

static void t_u16(t_buf *t, uint16_t v)
{
	uint8_t b[2] = { (uint8_t)(v >> 8), (uint8_t)v };
	t_put(t, b, 2);
}

static void t_u32(t_buf *t, uint32_t v)
{
	uint8_t b[4] = { (uint8_t)(v >> 24), (uint8_t)(v >> 16), (uint8_t)(v >> 8), (uint8_t)v };
	t_put(t, b, 4);
}

static void t_u64(t_buf *t, uint64_t v)
{
	t_u32(t, (uint32_t)(v >> 32));
	t_u32(t, (uint32_t)v);
}

static void t_sint(t_buf *t, uint8_t v) { t_u8(t, 97), t_u8(t, v); }
static void t_int(t_buf *t, int32_t v) { t_u8(t, 98), t_u32(t, (uint32_t)v); }
static void t_float(t_buf *t, uint64_t bits) { t_u8(t, 70), t_u64(t, bits); }
static void t_nil(t_buf *t) { t_u8(t, 106); }
static void t_tuple(t_buf *t, uint8_t n) { t_u8(t, 104), t_u8(t, n); }
static void t_list(t_buf *t, uint32_t n) { t_u8(t, 108), t_u32(t, n); }
static void t_map(t_buf *t, uint32_t n) { t_u8(t, 116), t_u32(t, n); }

static void t_utf8_atom(t_buf *t, const void *s, size_t n)
{
	if (n < 256) {
		t_u8(t, 119);
		t_u8(t, (uint8_t)n);
	} else {
		t_u8(t, 118);
		t_u16(t, (uint16_t)n);
	}
	t_put(t, s, n);
}

static void t_atom(t_buf *t, const char *s) { t_utf8_atom(t, s, strlen(s)); }

static void t_latin1_atom(t_buf *t, const void *s, size_t n)
{
	t_u8(t, 100);
	t_u16(t, (uint16_t)n);
	t_put(t, s, n);
}

static void t_binary(t_buf *t, const void *p, uint32_t n)
{
	t_u8(t, 109);
	t_u32(t, n);
	t_put(t, p, n);
}

static void t_new_pid(t_buf *t, const char *node, uint32_t num, uint32_t ser, uint32_t cr)
{
	t_u8(t, 88);
	t_atom(t, node);
	t_u32(t, num);
	t_u32(t, ser);
	t_u32(t, cr);
}

static void t_newer_ref(t_buf *t, const char *node, uint32_t cr, const uint32_t *w, uint16_t n)
{
	t_u8(t, 90);
	t_u16(t, n);
	t_atom(t, node);
	t_u32(t, cr);
	for (uint16_t i = 0; i < n; i++)
		t_u32(t, w[i]);
}

/* ---- running the check ---------------------------------------------------- */

#define SELF "beam@host"

/* Atoms seen, for the callback's tests. */
struct t_seen {
	char names[64][512];
	int n;
	int refuse_after; /* refuse atoms past this many; -1 never */
};

static int t_atom_cb(void *arg, const uint8_t *name, size_t len)
{
	struct t_seen *s = arg;
	if (s->refuse_after >= 0 && s->n >= s->refuse_after)
		return -1;
	if (s->n < 64) {
		assert_true(len < 512);
		memcpy(s->names[s->n], name, len);
		s->names[s->n][len] = 0;
	}
	s->n++;
	return 0;
}

/* ap_term_check on an exact-size copy (ASan sees any read past it): 0 or
 * -1, and the end agrees with ap_term_skip's for what it takes. */
static int t_check_seen(const t_buf *t, const char **why, struct t_seen *seen)
{
	uint8_t *d = malloc(t->n ? t->n : 1);
	assert_non_null(d);
	memcpy(d, t->b, t->n);
	ap_term_strict st;
	memset(&st, 0, sizeof st);
	st.self_node = SELF;
	st.self_node_len = strlen(SELF);
	if (seen) {
		st.atom = t_atom_cb;
		st.arg = seen;
	}
	int idx = 0, sidx = 0;
	int r = ap_term_check((const char *)d, t->n, &idx, &st);
	if (r == 0) {
		assert_int_equal(ap_term_skip((const char *)d, t->n, &sidx), 0);
		assert_int_equal(idx, sidx);
		assert_int_equal((size_t)idx, t->n);
	} else {
		assert_int_equal(idx, 0);
		assert_non_null(st.why);
	}
	if (why)
		*why = st.why;
	ap_term_strict_free(&st);
	free(d);
	return r;
}

static int t_check(const t_buf *t, const char **why) { return t_check_seen(t, why, NULL); }

static void t_reset(t_buf *t) { t->n = 0; }

/* Refused, for a reason that says `want' (NULL: any reason). */
static void t_refuses(const t_buf *t, const char *want)
{
	const char *why;
	assert_int_equal(t_check(t, &why), -1);
	if (want && !strstr(why, want))
		fail_msg("refused for \"%s\", not \"%s\"", why, want);
}

#define ACCEPTS(t) assert_int_equal(t_check((t), NULL), 0)
#define REFUSES(t, w) t_refuses((t), (w))

/* ---- floats ------------------------------------------------------------------ */

static void test_non_finite_floats_are_refused(void **state)
{
	(void)state;
	t_buf t = { 0 };
	const uint64_t bad[] = { 0x7ff8000000000000ull, 0x7ff0000000000001ull, 0xfff8000000000000ull,
				 0x7fffffffffffffffull, 0x7ff0000000000000ull, 0xfff0000000000000ull };
	for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
		t_reset(&t);
		t_float(&t, bad[i]);
		REFUSES(&t, "float");
		/* inside containers too */
		t_reset(&t);
		t_list(&t, 2);
		t_sint(&t, 1);
		t_float(&t, bad[i]);
		t_nil(&t);
		REFUSES(&t, "float");
	}
	const uint64_t good[] = { 0, 0x8000000000000000ull, 1, 0x7fefffffffffffffull, 0xffefffffffffffffull,
				  0x3ff8000000000000ull, 0x000fffffffffffffull };
	for (size_t i = 0; i < sizeof good / sizeof good[0]; i++) {
		t_reset(&t);
		t_float(&t, good[i]);
		ACCEPTS(&t);
	}
	free(t.b);
}

/* ---- atoms --------------------------------------------------------------------- */

static void test_atoms_up_to_255_characters_of_valid_utf8(void **state)
{
	(void)state;
	t_buf t = { 0 };
	uint8_t s[1100];
	/* 255 characters of 4 bytes: the largest UTF-8 atom */
	for (int i = 0; i < 255; i++)
		memcpy(s + 4 * i, "\xf0\x9f\x98\x80", 4);
	t_utf8_atom(&t, s, 1020);
	ACCEPTS(&t);
	/* 256 characters, however few bytes */
	memset(s, 'a', 256);
	t_reset(&t);
	t_utf8_atom(&t, s, 256);
	REFUSES(&t, "255 characters");
	for (int i = 0; i < 256; i++)
		memcpy(s + 2 * i, "\xc3\xa9", 2);
	t_reset(&t);
	t_utf8_atom(&t, s, 512);
	REFUSES(&t, "255 characters");
	t_reset(&t);
	t_utf8_atom(&t, s, 510);
	ACCEPTS(&t);
	/* Latin-1: any 255 bytes; the walk refuses 256 */
	memset(s, 0xff, 255);
	t_reset(&t);
	t_latin1_atom(&t, s, 255);
	ACCEPTS(&t);
	t_reset(&t);
	t_latin1_atom(&t, s, 256);
	REFUSES(&t, NULL);
	t_reset(&t);
	t_utf8_atom(&t, "", 0);
	ACCEPTS(&t);
	free(t.b);
}

static void test_atoms_that_are_not_utf8_are_refused(void **state)
{
	(void)state;
	static const struct {
		const char *s;
		int ok;
	} cases[] = {
		{ "\xc3\xa9", 1 },              /* é */
		{ "\xe2\x82\xac", 1 },          /* € */
		{ "\xf4\x8f\xbf\xbf", 1 },      /* U+10FFFF */
		{ "\xef\xbf\xbe", 1 },          /* U+FFFE: a noncharacter, but UTF-8 */
		{ "\xed\x9f\xbf", 1 },          /* U+D7FF */
		{ "\xee\x80\x80", 1 },          /* U+E000 */
		{ "\xc0\xaf", 0 },              /* overlong '/' */
		{ "\xc1\xbf", 0 },              /* overlong */
		{ "\xe0\x80\xaf", 0 },          /* overlong, 3 bytes */
		{ "\xe0\x9f\xbf", 0 },          /* overlong U+07FF */
		{ "\xf0\x80\x80\xaf", 0 },      /* overlong, 4 bytes */
		{ "\xf0\x8f\xbf\xbf", 0 },      /* overlong U+FFFF */
		{ "\xed\xa0\x80", 0 },          /* surrogate U+D800 */
		{ "\xed\xbf\xbf", 0 },          /* surrogate U+DFFF */
		{ "\xf4\x90\x80\x80", 0 },      /* U+110000 */
		{ "\xf5\x80\x80\x80", 0 },
		{ "\xff", 0 },
		{ "\x80", 0 },                  /* a stray continuation byte */
		{ "a\xbf", 0 },
		{ "\xe2\x82", 0 },              /* cut short */
		{ "\xc3", 0 },
		{ "\xf0\x9f\x98", 0 },
		{ "\xe2\x28\xa1", 0 },          /* a continuation that is not */
	};
	t_buf t = { 0 };
	for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
		t_reset(&t);
		t_utf8_atom(&t, cases[i].s, strlen(cases[i].s));
		const char *why;
		int r = t_check(&t, &why);
		if (cases[i].ok != (r == 0))
			fail_msg("case %zu: got %d (%s)", i, r, r ? why : "-");
		if (!cases[i].ok)
			assert_non_null(strstr(why, "UTF-8"));
		/* as a pid's node, an export's module: the same */
		t_reset(&t);
		t_u8(&t, 113);
		t_utf8_atom(&t, cases[i].s, strlen(cases[i].s));
		t_atom(&t, "f");
		t_sint(&t, 0);
		assert_int_equal(t_check(&t, NULL), cases[i].ok ? 0 : -1);
	}
	free(t.b);
}

static void test_every_atom_goes_to_the_callback_as_utf8(void **state)
{
	(void)state;
	t_buf t = { 0 };
	struct t_seen seen = { .refuse_after = -1 };
	/* {'é' (Latin-1), 'a', pid of n@h, fun m:f/1, #Ref<r@h>} */
	t_tuple(&t, 5);
	t_latin1_atom(&t, "\xe9", 1);
	t_atom(&t, "a");
	t_new_pid(&t, "n@h", 1, 0, 1);
	t_u8(&t, 113);
	t_atom(&t, "m");
	t_latin1_atom(&t, "f", 1);
	t_sint(&t, 1);
	uint32_t w[3] = { 1, 2, 3 };
	t_newer_ref(&t, "r@h", 1, w, 3);
	assert_int_equal(t_check_seen(&t, NULL, &seen), 0);
	assert_int_equal(seen.n, 6);
	const char *want[] = { "\xc3\xa9", "a", "n@h", "m", "f", "r@h" };
	for (int i = 0; i < 6; i++)
		assert_string_equal(seen.names[i], want[i]);
	/* a refusal refuses the term */
	struct t_seen stingy = { .refuse_after = 2 };
	const char *why;
	assert_int_equal(t_check_seen(&t, &why, &stingy), -1);
	assert_ptr_equal(why, ap_term_why_atom);
	free(t.b);
}

/* ---- maps ------------------------------------------------------------------------ */

typedef void (*t_key_fn)(t_buf *t);

static void k_int1_small(t_buf *t) { t_sint(t, 1); }
static void k_int1_int(t_buf *t) { t_int(t, 1); }
static void k_int1_small_big(t_buf *t) { t_u8(t, 110), t_u8(t, 1), t_u8(t, 0), t_u8(t, 1); }
static void k_int1_big_zeros(t_buf *t) { t_u8(t, 110), t_u8(t, 3), t_u8(t, 0), t_u8(t, 1), t_u8(t, 0), t_u8(t, 0); }
static void k_int1_large_big(t_buf *t) { t_u8(t, 111), t_u32(t, 2), t_u8(t, 0), t_u8(t, 1), t_u8(t, 0); }
static void k_int1_list0(t_buf *t) { t_list(t, 0), t_sint(t, 1); } /* [ | 1] is 1 */
static void k_neg5_int(t_buf *t) { t_int(t, -5); }
static void k_neg5_big(t_buf *t) { t_u8(t, 110), t_u8(t, 1), t_u8(t, 1), t_u8(t, 5); }
static void k_zero_small(t_buf *t) { t_sint(t, 0); }
static void k_zero_neg_big(t_buf *t) { t_u8(t, 110), t_u8(t, 0), t_u8(t, 1); }
static void k_big2_64_small(t_buf *t)
{
	t_u8(t, 110), t_u8(t, 9), t_u8(t, 0);
	for (int i = 0; i < 8; i++)
		t_u8(t, 0);
	t_u8(t, 1);
}
static void k_big2_64_large(t_buf *t)
{
	t_u8(t, 111), t_u32(t, 10), t_u8(t, 0);
	for (int i = 0; i < 8; i++)
		t_u8(t, 0);
	t_u8(t, 1), t_u8(t, 0);
}
static void k_int_min(t_buf *t) { t_int(t, INT32_MIN); }
static void k_int_min_big(t_buf *t) { t_u8(t, 110), t_u8(t, 4), t_u8(t, 1), t_u32(t, 0x00000080); }
static void k_atom_latin1(t_buf *t) { t_latin1_atom(t, "\xe9t\xe9", 3); }
static void k_atom_small_latin1(t_buf *t) { t_u8(t, 115), t_u8(t, 3), t_put(t, "\xe9t\xe9", 3); }
static void k_atom_utf8(t_buf *t) { t_atom(t, "\xc3\xa9t\xc3\xa9"); }
static void k_atom_large_utf8(t_buf *t) { t_u8(t, 118), t_u16(t, 5), t_put(t, "\xc3\xa9t\xc3\xa9", 5); }
static void k_str(t_buf *t) { t_u8(t, 107), t_u16(t, 2), t_put(t, "ab", 2); }
static void k_str_list(t_buf *t) { t_list(t, 2), t_sint(t, 'a'), t_int(t, 'b'), t_nil(t); }
static void k_str_split(t_buf *t) { t_list(t, 1), t_sint(t, 'a'), t_u8(t, 107), t_u16(t, 1), t_put(t, "b", 1); }
static void k_str_nested(t_buf *t) { t_list(t, 1), t_sint(t, 'a'), t_list(t, 1), t_sint(t, 'b'), t_nil(t); }
static void k_str_empty(t_buf *t) { t_u8(t, 107), t_u16(t, 0); }
static void k_nil(t_buf *t) { t_nil(t); }
static void k_zero(t_buf *t) { t_float(t, 0); }
static void k_neg_zero(t_buf *t) { t_float(t, 0x8000000000000000ull); }
static void k_tuple_small(t_buf *t) { t_tuple(t, 2), t_sint(t, 1), t_atom(t, "x"); }
static void k_tuple_large(t_buf *t) { t_u8(t, 105), t_u32(t, 2), t_int(t, 1), t_latin1_atom(t, "x", 1); }
static void k_bin(t_buf *t) { t_binary(t, "\x07\x08", 2); }
static void k_bits8(t_buf *t) { t_u8(t, 77), t_u32(t, 2), t_u8(t, 8), t_put(t, "\x07\x08", 2); }
static void k_bin_empty(t_buf *t) { t_binary(t, "", 0); }
static void k_bits_empty(t_buf *t) { t_u8(t, 77), t_u32(t, 0), t_u8(t, 0); }
static void k_bits4_a(t_buf *t) { t_u8(t, 77), t_u32(t, 2), t_u8(t, 4), t_put(t, "\x07\xf0", 2); }
static void k_bits4_b(t_buf *t) { t_u8(t, 77), t_u32(t, 2), t_u8(t, 4), t_put(t, "\x07\xff", 2); }
static void k_bits5(t_buf *t) { t_u8(t, 77), t_u32(t, 2), t_u8(t, 5), t_put(t, "\x07\xf0", 2); }
static void k_map_ab(t_buf *t) { t_map(t, 2), t_atom(t, "a"), t_sint(t, 1), t_atom(t, "b"), t_sint(t, 2); }
static void k_map_ba(t_buf *t) { t_map(t, 2), t_atom(t, "b"), t_int(t, 2), t_latin1_atom(t, "a", 1), t_sint(t, 1); }
static void k_map_ab3(t_buf *t) { t_map(t, 2), t_atom(t, "a"), t_sint(t, 1), t_atom(t, "b"), t_sint(t, 3); }
static void k_map_empty(t_buf *t) { t_map(t, 0); }
static void k_pid_new(t_buf *t) { t_new_pid(t, "n@h", 7, 1, 2); }
static void k_pid_old(t_buf *t)
{
	t_u8(t, 103), t_latin1_atom(t, "n@h", 3), t_u32(t, 7), t_u32(t, 1), t_u8(t, 2);
}
static void k_pid_cr3(t_buf *t) { t_new_pid(t, "n@h", 7, 1, 3); }
static void k_port_new(t_buf *t) { t_u8(t, 89), t_atom(t, "n@h"), t_u32(t, 9), t_u32(t, 2); }
static void k_port_v4(t_buf *t) { t_u8(t, 120), t_atom(t, "n@h"), t_u64(t, 9), t_u32(t, 2); }
static void k_port_old(t_buf *t) { t_u8(t, 102), t_atom(t, "n@h"), t_u32(t, 9), t_u8(t, 2); }
static void k_ref1(t_buf *t) { t_newer_ref(t, "n@h", 2, (const uint32_t[]){ 5 }, 1); }
static void k_ref3(t_buf *t) { t_newer_ref(t, "n@h", 2, (const uint32_t[]){ 5, 0, 0 }, 3); }
static void k_ref_old(t_buf *t) { t_u8(t, 101), t_atom(t, "n@h"), t_u32(t, 5), t_u8(t, 2); }
static void k_ref_new(t_buf *t) { t_u8(t, 114), t_u16(t, 1), t_atom(t, "n@h"), t_u8(t, 2), t_u32(t, 5); }
static void k_ref_05(t_buf *t) { t_newer_ref(t, "n@h", 2, (const uint32_t[]){ 0, 5 }, 2); }
static void k_export(t_buf *t) { t_u8(t, 113), t_atom(t, "lists"), t_atom(t, "sort"), t_sint(t, 1); }
static void k_export_latin1(t_buf *t)
{
	t_u8(t, 113), t_latin1_atom(t, "lists", 5), t_u8(t, 115), t_u8(t, 4), t_put(t, "sort", 4), t_sint(t, 1);
}

/* #{A => 1, B => 2}: refused exactly when A =:= B. */
static int t_pair(t_key_fn a, t_key_fn b, int depth)
{
	t_buf t = { 0 };
	/* wrapped in `depth' maps, as a key: #{#{A => 1, B => 2} => x} */
	for (int i = 0; i < depth; i++)
		t_map(&t, 1);
	t_map(&t, 2);
	a(&t);
	t_sint(&t, 1);
	b(&t);
	t_sint(&t, 2);
	for (int i = 0; i < depth; i++)
		t_atom(&t, "x");
	const char *why;
	int r = t_check(&t, &why);
	if (r)
		assert_non_null(strstr(why, "duplicate"));
	free(t.b);
	return r;
}

static void test_map_keys_equal_in_any_encoding_are_duplicates(void **state)
{
	(void)state;
	static const struct {
		t_key_fn a, b;
	} equal[] = {
		{ k_int1_small, k_int1_small }, { k_int1_small, k_int1_int }, { k_int1_small, k_int1_small_big },
		{ k_int1_int, k_int1_big_zeros }, { k_int1_small, k_int1_large_big }, { k_int1_small, k_int1_list0 },
		{ k_neg5_int, k_neg5_big }, { k_zero_small, k_zero_neg_big }, { k_big2_64_small, k_big2_64_large },
		{ k_int_min, k_int_min_big }, { k_atom_latin1, k_atom_utf8 }, { k_atom_small_latin1, k_atom_large_utf8 },
		{ k_atom_latin1, k_atom_small_latin1 }, { k_str, k_str_list }, { k_str, k_str_split },
		{ k_str_list, k_str_nested }, { k_str_empty, k_nil }, { k_zero, k_neg_zero },
		{ k_tuple_small, k_tuple_large }, { k_bin, k_bits8 }, { k_bin_empty, k_bits_empty },
		{ k_bits4_a, k_bits4_b }, { k_map_ab, k_map_ba }, { k_pid_new, k_pid_old }, { k_port_new, k_port_v4 },
		{ k_port_new, k_port_old }, { k_ref1, k_ref3 }, { k_ref1, k_ref_old }, { k_ref1, k_ref_new },
		{ k_export, k_export_latin1 },
	};
	for (size_t i = 0; i < sizeof equal / sizeof equal[0]; i++)
		for (int depth = 0; depth < 3; depth++)
			if (t_pair(equal[i].a, equal[i].b, depth) != -1)
				fail_msg("pair %zu at depth %d was not a duplicate", i, depth);
}

static void test_map_keys_that_differ_are_not_duplicates(void **state)
{
	(void)state;
	static const struct {
		t_key_fn a, b;
	} differ[] = {
		{ k_int1_small, k_zero }, /* 1 and 0.0 */
		{ k_zero_small, k_zero }, /* 0 and 0.0: =:= tells them apart */
		{ k_int1_small, k_neg5_int }, { k_big2_64_small, k_int1_small }, { k_atom_utf8, k_str },
		{ k_str, k_str_empty }, { k_nil, k_map_empty }, { k_nil, k_bin_empty }, { k_tuple_small, k_str_list },
		{ k_bin, k_bits4_a }, { k_bits4_a, k_bits5 }, { k_map_ab, k_map_ab3 }, { k_map_ab, k_map_empty },
		{ k_pid_new, k_pid_cr3 }, /* creation counts */
		{ k_pid_new, k_port_new }, { k_ref1, k_ref_05 }, { k_export, k_tuple_small },
		{ k_atom_latin1, k_bin },
	};
	for (size_t i = 0; i < sizeof differ / sizeof differ[0]; i++)
		for (int depth = 0; depth < 3; depth++)
			if (t_pair(differ[i].a, differ[i].b, depth) != 0)
				fail_msg("pair %zu at depth %d was taken for a duplicate", i, depth);
}

/* Over 32 keys (a hash map in the BEAM), a duplicate anywhere; a map in a
 * map's value, and a key that is a list of maps. */
static void test_duplicates_anywhere_are_found(void **state)
{
	(void)state;
	t_buf t = { 0 };
	for (uint32_t dup = 0; dup <= 100; dup += 20) {
		t_reset(&t);
		t_map(&t, 101);
		for (uint32_t k = 0; k < 100; k++) {
			t_int(&t, (int32_t)k * 3);
			t_nil(&t);
		}
		t_sint(&t, (uint8_t)(dup * 3 <= 255 ? dup * 3 : 1)); /* equal to key dup (or 1, a new one) */
		t_nil(&t);
		if (dup * 3 <= 255)
			REFUSES(&t, "duplicate");
		else
			ACCEPTS(&t);
	}
	/* [#{a => 1}, #{b => #{c => 1, c => 2}}] */
	t_reset(&t);
	t_list(&t, 2);
	t_map(&t, 1);
	t_atom(&t, "a");
	t_sint(&t, 1);
	t_map(&t, 1);
	t_atom(&t, "b");
	t_map(&t, 2);
	t_atom(&t, "c");
	t_sint(&t, 1);
	t_latin1_atom(&t, "c", 1);
	t_sint(&t, 2);
	t_nil(&t);
	REFUSES(&t, "duplicate");
	/* #{[#{a => 1, b => 2}] => 1, [#{b => 2, a => 1}] => 2} */
	t_reset(&t);
	t_map(&t, 2);
	t_list(&t, 1);
	k_map_ab(&t);
	t_nil(&t);
	t_sint(&t, 1);
	t_list(&t, 1);
	k_map_ba(&t);
	t_nil(&t);
	t_sint(&t, 2);
	REFUSES(&t, "duplicate");
	/* ... and with the inner values differing: two keys */
	t_reset(&t);
	t_map(&t, 2);
	t_list(&t, 1);
	k_map_ab(&t);
	t_nil(&t);
	t_sint(&t, 1);
	t_list(&t, 1);
	k_map_ab3(&t);
	t_nil(&t);
	t_sint(&t, 2);
	ACCEPTS(&t);
	free(t.b);
}

/* Maps nested in keys 1000 deep, each with a sibling key: each level's
 * key hashes come from one pass (no level rehashes what is under it), and
 * a duplicate at the bottom is still found. */
static void test_deep_keys_are_checked_in_one_pass(void **state)
{
	(void)state;
	t_buf t = { 0 };
	for (int dup = 0; dup < 2; dup++) {
		t_reset(&t);
		for (int i = 0; i < 1000; i++) {
			t_map(&t, 2);
			t_int(&t, i);
			t_nil(&t);
		}
		t_map(&t, 2);
		t_sint(&t, 1);
		t_nil(&t);
		t_sint(&t, dup ? 1 : 2);
		t_nil(&t);
		for (int i = 0; i < 1000; i++)
			t_nil(&t);
		if (dup)
			REFUSES(&t, "duplicate");
		else
			ACCEPTS(&t);
	}
	free(t.b);
}

/* ---- pids, ports, references --------------------------------------------------- */

static void test_old_formats_keep_to_their_limits(void **state)
{
	(void)state;
	t_buf t = { 0 };
	for (uint8_t cr = 0; cr < 6; cr++) {
		t_reset(&t);
		t_u8(&t, 103), t_atom(&t, "a@h"), t_u32(&t, 1), t_u32(&t, 0), t_u8(&t, cr);
		assert_int_equal(t_check(&t, NULL), cr <= 3 ? 0 : -1);
		t_reset(&t);
		t_u8(&t, 102), t_atom(&t, "a@h"), t_u32(&t, 1), t_u8(&t, cr);
		assert_int_equal(t_check(&t, NULL), cr <= 3 ? 0 : -1);
		t_reset(&t);
		t_u8(&t, 101), t_atom(&t, "a@h"), t_u32(&t, 1), t_u8(&t, cr);
		assert_int_equal(t_check(&t, NULL), cr <= 3 ? 0 : -1);
		t_reset(&t);
		t_u8(&t, 114), t_u16(&t, 3), t_atom(&t, "a@h"), t_u8(&t, cr), t_u32(&t, 1), t_u32(&t, 9), t_u32(&t, 9);
		assert_int_equal(t_check(&t, NULL), cr <= 3 ? 0 : -1);
	}
	/* old references: the first word under 2^18 */
	t_reset(&t);
	t_u8(&t, 101), t_atom(&t, "a@h"), t_u32(&t, 0x3ffff), t_u8(&t, 1);
	ACCEPTS(&t);
	t_reset(&t);
	t_u8(&t, 101), t_atom(&t, "a@h"), t_u32(&t, 0x40000), t_u8(&t, 1);
	REFUSES(&t, "18 bits");
	t_reset(&t);
	t_u8(&t, 114), t_u16(&t, 1), t_atom(&t, "a@h"), t_u8(&t, 1), t_u32(&t, 0x40000);
	REFUSES(&t, "18 bits");
	/* NEWER_REFERENCE_EXT of another node: any words */
	t_reset(&t);
	t_newer_ref(&t, "a@h", 1, (const uint32_t[]){ 0xffffffff, 1, 2, 3, 4 }, 5);
	ACCEPTS(&t);
	/* pids and ports of another node: any numbers */
	t_reset(&t);
	t_new_pid(&t, "a@h", 0xffffffff, 0xffffffff, 0xffffffff);
	ACCEPTS(&t);
	t_reset(&t);
	t_u8(&t, 120), t_atom(&t, "a@h"), t_u64(&t, UINT64_MAX), t_u32(&t, 1);
	ACCEPTS(&t);
	free(t.b);
}

static void test_the_receiving_nodes_own_are_in_range(void **state)
{
	(void)state;
	t_buf t = { 0 };
	static const struct {
		uint32_t num, ser;
		int ok;
	} pids[] = { { 0x7fff, 0x1fff, 1 }, { 0x8000, 0, 0 }, { 0, 0x2000, 0 }, { 0xffffffff, 0, 0 } };
	for (size_t i = 0; i < sizeof pids / sizeof pids[0]; i++) {
		/* whatever the creation: another incarnation had the same limits */
		for (uint32_t cr = 0; cr < 3; cr++) {
			t_reset(&t);
			t_new_pid(&t, SELF, pids[i].num, pids[i].ser, cr * 0x12345);
			assert_int_equal(t_check(&t, NULL), pids[i].ok ? 0 : -1);
		}
		/* another node's: taken */
		t_reset(&t);
		t_new_pid(&t, "beam@other", pids[i].num, pids[i].ser, 1);
		ACCEPTS(&t);
	}
	/* the node name as Latin-1 counts as the same name */
	t_reset(&t);
	t_u8(&t, 88), t_latin1_atom(&t, SELF, strlen(SELF)), t_u32(&t, 0x8000), t_u32(&t, 0), t_u32(&t, 1);
	REFUSES(&t, "receiving node");
	/* ports: under 2^28 */
	t_reset(&t);
	t_u8(&t, 120), t_atom(&t, SELF), t_u64(&t, 0xfffffff), t_u32(&t, 1);
	ACCEPTS(&t);
	t_reset(&t);
	t_u8(&t, 120), t_atom(&t, SELF), t_u64(&t, 0x10000000), t_u32(&t, 1);
	REFUSES(&t, "receiving node");
	t_reset(&t);
	t_u8(&t, 89), t_atom(&t, SELF), t_u32(&t, 0x10000000), t_u32(&t, 1);
	REFUSES(&t, "receiving node");
	/* references: 1 to 3 words, the first under 2^18 */
	static const struct {
		uint16_t n;
		uint32_t w0;
		int ok;
	} refs[] = { { 1, 1, 1 }, { 2, 1, 1 }, { 3, 0x3ffff, 1 }, { 3, 0x40000, 0 }, { 4, 1, 0 }, { 5, 1, 0 } };
	for (size_t i = 0; i < sizeof refs / sizeof refs[0]; i++) {
		uint32_t w[5] = { refs[i].w0, 0xffffffff, 0xffffffff, 1, 1 };
		t_reset(&t);
		t_newer_ref(&t, SELF, 7, w, refs[i].n);
		assert_int_equal(t_check(&t, NULL), refs[i].ok ? 0 : -1);
		t_reset(&t);
		t_newer_ref(&t, "beam@other", 7, w, refs[i].n);
		ACCEPTS(&t);
	}
	free(t.b);
}

/* ---- the rest --------------------------------------------------------------------- */

static void test_bigs_up_to_the_beams_limit(void **state)
{
	(void)state;
	t_buf t = { 0 };
	for (uint32_t n = 4194295; n <= 4194297; n++) {
		t_reset(&t);
		t_u8(&t, 111);
		t_u32(&t, n);
		t_u8(&t, 1);
		uint8_t *z = calloc(n, 1);
		assert_non_null(z);
		z[n - 1] = 1;
		t_put(&t, z, n);
		free(z);
		assert_int_equal(t_check(&t, NULL), n <= 4194296 ? 0 : -1);
	}
	free(t.b);
}

static void test_funs_are_refused_exports_taken(void **state)
{
	(void)state;
	t_buf t = { 0 };
	k_export(&t);
	ACCEPTS(&t);
	/* A well-formed NEW_FUN_EXT (ap_term_skip takes it): no free variables. */
	t_buf f = { 0 };
	t_u8(&f, 0);                /* arity */
	for (int i = 0; i < 16; i++)
		t_u8(&f, (uint8_t)i); /* uniq */
	t_u32(&f, 0);               /* index */
	t_u32(&f, 0);               /* num_free */
	t_atom(&f, "m");
	t_sint(&f, 0);
	t_sint(&f, 0);
	t_new_pid(&f, "n@h", 1, 0, 1);
	t_reset(&t);
	t_u8(&t, 112);
	t_u32(&t, (uint32_t)f.n + 4);
	t_put(&t, f.b, f.n);
	int idx = 0;
	assert_int_equal(ap_term_skip((const char *)t.b, t.n, &idx), 0);
	REFUSES(&t, "fun");
	free(f.b);
	free(t.b);
}

/* What the walk refuses, the check refuses: every prefix of a real term. */
static void test_truncations_are_refused(void **state)
{
	(void)state;
	t_buf t = { 0 };
	t_tuple(&t, 4);
	k_map_ab(&t);
	k_pid_new(&t);
	k_ref3(&t);
	k_str(&t);
	ACCEPTS(&t);
	size_t n = t.n;
	for (size_t k = 0; k < n; k++) {
		t.n = k;
		REFUSES(&t, NULL);
	}
	free(t.b);
}

/* ---- the atom set ------------------------------------------------------------------ */

static void test_atom_set_admits_its_cap_of_names(void **state)
{
	(void)state;
	ap_atomset *s = ap_atomset_new(100);
	assert_non_null(s);
	char name[32];
	for (int i = 0; i < 100; i++) {
		int n = snprintf(name, sizeof name, "name_%d", i);
		assert_true(ap_atomset_admit(s, name, (size_t)n));
	}
	assert_int_equal(ap_atomset_count(s), 100);
	for (int i = 0; i < 100; i++) { /* known: free */
		int n = snprintf(name, sizeof name, "name_%d", i);
		assert_true(ap_atomset_admit(s, name, (size_t)n));
	}
	for (int i = 100; i < 200; i++) {
		int n = snprintf(name, sizeof name, "name_%d", i);
		assert_false(ap_atomset_admit(s, name, (size_t)n));
	}
	assert_int_equal(ap_atomset_count(s), 100);
	free(s);
}

#define T_THREADS 4
#define T_NAMES 3000

struct t_race {
	ap_atomset *s;
	int id;
	int admitted[T_NAMES];
};

static void *t_racer(void *arg)
{
	struct t_race *r = arg;
	char name[32];
	/* every thread offers every name, each from its own start */
	for (int k = 0; k < T_NAMES; k++) {
		int i = (k + r->id * 997) % T_NAMES;
		int n = snprintf(name, sizeof name, "race_%d", i);
		r->admitted[i] = ap_atomset_admit(r->s, name, (size_t)n);
	}
	return NULL;
}

/* Threads racing over the same names: exactly cap names get in, and a
 * name one thread got in is in for all that came after. */
static void test_atom_set_holds_its_cap_under_races(void **state)
{
	(void)state;
	for (int round = 0; round < 20; round++) {
		ap_atomset *s = ap_atomset_new(1000);
		assert_non_null(s);
		struct t_race r[T_THREADS];
		pthread_t th[T_THREADS];
		for (int i = 0; i < T_THREADS; i++) {
			r[i].s = s;
			r[i].id = i;
			assert_int_equal(pthread_create(&th[i], NULL, t_racer, &r[i]), 0);
		}
		for (int i = 0; i < T_THREADS; i++)
			pthread_join(th[i], NULL);
		assert_int_equal(ap_atomset_count(s), 1000);
		int in = 0;
		char name[32];
		for (int i = 0; i < T_NAMES; i++) {
			int n = snprintf(name, sizeof name, "race_%d", i);
			int now = ap_atomset_admit(s, name, (size_t)n);
			in += now;
			for (int k = 0; k < T_THREADS; k++)
				if (r[k].admitted[i])
					assert_true(now);
		}
		assert_int_equal(in, 1000);
		free(s);
	}
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_non_finite_floats_are_refused),
		cmocka_unit_test(test_atoms_up_to_255_characters_of_valid_utf8),
		cmocka_unit_test(test_atoms_that_are_not_utf8_are_refused),
		cmocka_unit_test(test_every_atom_goes_to_the_callback_as_utf8),
		cmocka_unit_test(test_map_keys_equal_in_any_encoding_are_duplicates),
		cmocka_unit_test(test_map_keys_that_differ_are_not_duplicates),
		cmocka_unit_test(test_duplicates_anywhere_are_found),
		cmocka_unit_test(test_deep_keys_are_checked_in_one_pass),
		cmocka_unit_test(test_old_formats_keep_to_their_limits),
		cmocka_unit_test(test_the_receiving_nodes_own_are_in_range),
		cmocka_unit_test(test_bigs_up_to_the_beams_limit),
		cmocka_unit_test(test_funs_are_refused_exports_taken),
		cmocka_unit_test(test_truncations_are_refused),
		cmocka_unit_test(test_atom_set_admits_its_cap_of_names),
		cmocka_unit_test(test_atom_set_holds_its_cap_under_races),
	};
	return cmocka_run_group_tests(tests, NULL, NULL);
}
