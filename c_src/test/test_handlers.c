/* test_handlers: the built-in handlers answer exactly as documented, and plugin loading refuses bad files without crashing. */
#include "t_reply.h"

#include <sys/stat.h>
#include <unistd.h>

#include "handlers.h"

#ifndef T_BUILD_DIR
#error "T_BUILD_DIR: where the Makefile put the test plugins"
#endif
#ifndef T_TESTBIN_DIR
#error "T_TESTBIN_DIR: where the Makefile put the plugins the Erlang tests load (plugin_crash.so)"
#endif

/* ---- json_validate ---------------------------------------------------------- */

struct t_json_bad {
	const char *doc;
	size_t len; /* 0: strlen(doc) */
	size_t off;
	const char *reason;
};

#define BAD(d, o, r) { d, sizeof(d) - 1, o, #r }

static const struct t_json_bad t_json_bad_cases[] = {
	/* structure */
	BAD("{\"a\":1,}", 7, unexpected_byte),
	BAD("[1,]", 3, unexpected_byte),
	BAD("[,1]", 1, unexpected_byte),
	BAD("[1 2]", 3, unexpected_byte),
	BAD("[1}", 2, unexpected_byte),
	BAD("{\"a\":1]", 6, unexpected_byte),
	BAD("{\"a\" 1}", 5, unexpected_byte),
	BAD("{\"a\":}", 5, unexpected_byte),
	BAD("{1:2}", 1, unexpected_byte),
	BAD("{,}", 1, unexpected_byte),
	BAD("[nulll]", 5, unexpected_byte),
	BAD(".5", 0, unexpected_byte),
	BAD("+1", 0, unexpected_byte),
	BAD("'a'", 0, unexpected_byte),
	BAD("\xef\xbb\xbf[]", 0, unexpected_byte), /* a BOM is not whitespace */
	BAD("\x0c" "1", 0, unexpected_byte),       /* nor is a form feed */
	BAD("[\x80]", 1, unexpected_byte),         /* non-ASCII outside a string */
	BAD("\x00", 0, unexpected_byte),
	/* cut short */
	BAD("", 0, unexpected_end),
	BAD("   ", 3, unexpected_end),
	BAD("[1,2", 4, unexpected_end),
	BAD("[", 1, unexpected_end),
	BAD("{", 1, unexpected_end),
	BAD("[1,", 3, unexpected_end),
	BAD("{\"a\":1", 6, unexpected_end),
	BAD("{\"a\":1,", 7, unexpected_end),
	BAD("{\"a\"", 4, unexpected_end),
	BAD("{\"a\":", 5, unexpected_end),
	BAD("\"abc", 4, unexpected_end),
	BAD("\"\\ud800", 7, unexpected_end),
	/* trailing data */
	BAD("[]]", 2, trailing_data),
	BAD("1 2", 2, trailing_data),
	BAD("{} x", 3, trailing_data),
	BAD("{\"a\":1}}", 7, trailing_data),
	BAD("truefalse", 4, trailing_data),
	BAD("0x10", 1, trailing_data),
	BAD("1.5.3", 3, trailing_data),
	BAD("\"a\"\x00", 3, trailing_data),
	/* numbers */
	BAD("01", 1, invalid_number),
	BAD("00", 1, invalid_number),
	BAD("[-01]", 3, invalid_number),
	BAD("-", 1, invalid_number),
	BAD("-a", 1, invalid_number),
	BAD("[-]", 2, invalid_number),
	BAD("1.", 2, invalid_number),
	BAD("-0.", 3, invalid_number),
	BAD("1.e5", 2, invalid_number),
	BAD("1e", 2, invalid_number),
	BAD("0e", 2, invalid_number),
	BAD("1e+", 3, invalid_number),
	BAD("1E-x", 3, invalid_number),
	BAD("[1.]", 3, invalid_number),
	/* literals */
	BAD("tru", 3, invalid_literal),
	BAD("trUe", 2, invalid_literal),
	BAD("nul", 3, invalid_literal),
	BAD("fals", 4, invalid_literal),
	BAD("nan", 1, invalid_literal),
	BAD("[nulx]", 4, invalid_literal),
	/* escapes */
	BAD("\"\\x\"", 2, invalid_escape),
	BAD("\"\\\"", 3, unexpected_end), /* \" is an escape: the string is open */
	BAD("\"\\", 2, invalid_escape),
	BAD("\"\\u12", 5, invalid_escape),
	BAD("\"\\u12G4\"", 5, invalid_escape),
	BAD("\"\\U0041\"", 2, invalid_escape),
	BAD("\"\\ud800\\", 8, invalid_escape),
	BAD("\"\\ud800\\u", 9, invalid_escape),
	BAD("\"\\ud800\\u12\"", 11, invalid_escape),
	BAD("\"\\'\"", 2, invalid_escape),
	/* surrogates */
	BAD("\"\\ud800\"", 1, lone_surrogate),
	BAD("\"\\udc00\"", 1, lone_surrogate),
	BAD("\"\\uDBFF\\u0041\"", 1, lone_surrogate),
	BAD("\"\\ud800\\ud800\"", 1, lone_surrogate),
	BAD("\"ab\\ud800x\"", 3, lone_surrogate),
	BAD("\"\\ud800\\n\"", 1, lone_surrogate),
	BAD("\"\\ud83d\\ude00\\ude00\"", 13, lone_surrogate),
	/* control characters */
	BAD("\"a\x01" "b\"", 2, control_char_in_string),
	BAD("\"\t\"", 1, control_char_in_string),
	BAD("\"\n\"", 1, control_char_in_string),
	BAD("\"\x00\"", 1, control_char_in_string),
	BAD("\"\x1f\"", 1, control_char_in_string),
	BAD("{\"k\x02\":1}", 3, control_char_in_string),
	/* UTF-8 */
	BAD("\"\xc3\x28\"", 1, invalid_utf8),         /* lead without continuation */
	BAD("\"\xc0\x80\"", 1, invalid_utf8),         /* overlong NUL */
	BAD("\"\xc1\xbf\"", 1, invalid_utf8),         /* overlong 2-byte */
	BAD("\"\xe0\x80\xaf\"", 1, invalid_utf8),     /* overlong 3-byte */
	BAD("\"\xf0\x80\x80\xaf\"", 1, invalid_utf8), /* overlong 4-byte */
	BAD("\"\xed\xa0\x80\"", 1, invalid_utf8),     /* encoded surrogate */
	BAD("\"\xed\xbf\xbf\"", 1, invalid_utf8),
	BAD("\"\xf4\x90\x80\x80\"", 1, invalid_utf8), /* above U+10FFFF */
	BAD("\"\xf5\x80\x80\x80\"", 1, invalid_utf8),
	BAD("\"\xff\"", 1, invalid_utf8),
	BAD("\"\x80\"", 1, invalid_utf8),             /* stray continuation */
	BAD("\"\xe2\x82\"", 1, invalid_utf8),         /* cut by the quote */
	BAD("\"ab\xe2\x82", 3, invalid_utf8),         /* cut by the end */
	BAD("\"\xf0\x9f\x98", 1, invalid_utf8),
	BAD("{\"\xc3\":1}", 2, invalid_utf8),         /* in a key */
	/* past the 16-byte fast path */
	BAD("\"0123456789abcdefghijklmnopqrstuvwxyz\x01\"", 37, control_char_in_string),
	BAD("\"0123456789abcdefghijklmnopqrstuvwxyz\xc0\xaf\"", 37, invalid_utf8),
	BAD("\"0123456789abcdefghij\\q0123456789abcdefghij\"", 22, invalid_escape),
	BAD("[\"0123456789abcdefghijklmnopqrstuvwxyz\" \"x\"]", 40, unexpected_byte),
};

struct t_json_result {
	actor_pool_status st;
	unsigned long long off;
	char reason[MAXATOMLEN_UTF8];
};

/* The json_validate reply, decoded: "ok", or the {Offset, Reason} tuple. */
static struct t_json_result t_json(const void *doc, size_t len)
{
	const actor_pool_handler *h = ap_builtin_handler("json_validate");
	struct t_json_result res = { 0 };
	actor_pool_reply reply;
	int idx = 0, ver, arity;

	assert_non_null(h);
	t_reply_init(&reply);
	res.st = t_call(h, NULL, doc, len, 1, 1, &reply);
	if (res.st == AP_HANDLER_OK) {
		t_assert_reply_atom(&reply, "ok");
		snprintf(res.reason, sizeof res.reason, "ok");
	} else {
		assert_int_equal(res.st, AP_HANDLER_ERROR);
		assert_int_equal(reply.kind, AP_REPLY_TERM);
		const char *b = (const char *)reply.data;
		assert_int_equal(ei_decode_version(b, &idx, &ver), 0);
		assert_int_equal(ei_decode_tuple_header(b, &idx, &arity), 0);
		assert_int_equal(arity, 2);
		assert_int_equal(ei_decode_ulonglong(b, &idx, &res.off), 0);
		assert_int_equal(ei_decode_atom(b, &idx, res.reason), 0);
		assert_int_equal((size_t)idx, reply.len);
	}
	t_reply_free(&reply);
	return res;
}

static void t_assert_json_ok(const char *doc, size_t len)
{
	struct t_json_result r = t_json(doc, len);
	if (r.st != AP_HANDLER_OK)
		fail_msg("valid document refused: {%llu, %s} for \"%.*s\"", r.off, r.reason, (int)(len > 80 ? 80 : len),
			 doc);
}

static void test_json_valid_documents_are_ok(void **state)
{
	static const char *const docs[] = {
		"0", "-0", "1e5", "1.5E-3", "-12.5e+10", "1E400", "0.0", "-0.0e-0", "123456789012345678901234567890",
		"true", "false", "null", "\"\"", "[]", "{}", " [ ] ", "\t\n\r 1 \t\n\r", "[[],[[]],{}]",
		"{\"a\":[1,2,{\"b\":null}],\"c\":\"d\",\"e\":{\"f\":[true,false]}}",
		"{\"a\":1,\"a\":2}", /* duplicate keys are allowed */
		"[ 1 , \"x\" , { \"k\" : [ ] } ]",
		/* every escape, a pair, U+0000 */
		"\"\\\"\\\\\\/\\b\\f\\n\\r\\t\\u0000\\u00e9\\uFFFF\\ud83d\\ude00\\uDBFF\\uDFFF\"",
		/* raw UTF-8: 2, 3 and 4 bytes; the edges of each range */
		"\"h\xc3\xa9llo w\xc3\xb6rld \xe6\x97\xa5\xe6\x9c\xac\xe8\xaa\x9e \xf0\x9f\x98\x80\"",
		"\"\xc2\x80\xdf\xbf\xe0\xa0\x80\xed\x9f\xbf\xee\x80\x80\xef\xbf\xbf\xf0\x90\x80\x80\xf4\x8f\xbf\xbf\"",
		"\"\x7f\"", /* DEL is no control character in JSON */
		"\"0123456789abcdefghijklmnopqrstuvwxyz\\n0123456789abcdefghijklmnopqrstuvwxyz\xc3\xa9.\"",
		"{\"0123456789abcdefghijklmnopqrstuvwxyz\":\"0123456789abcdefghijklmnopqrstuvwxyz\"}",
	};

	(void)state;
	for (size_t k = 0; k < sizeof docs / sizeof docs[0]; k++)
		t_assert_json_ok(docs[k], strlen(docs[k]));
}

static void test_json_invalid_documents_give_offset_and_reason(void **state)
{
	(void)state;
	assert_true(sizeof t_json_bad_cases / sizeof t_json_bad_cases[0] >= 40);
	for (size_t k = 0; k < sizeof t_json_bad_cases / sizeof t_json_bad_cases[0]; k++) {
		const struct t_json_bad *c = &t_json_bad_cases[k];
		struct t_json_result r = t_json(c->doc, c->len);
		if (r.st != AP_HANDLER_ERROR || r.off != c->off || strcmp(r.reason, c->reason))
			fail_msg("case %zu: want {%zu, %s}, got %s {%llu, %s}", k, c->off, c->reason,
				 r.st == AP_HANDLER_OK ? "ok" : "error", r.off, r.reason);
	}
}

/* `depth` nested containers: arrays, or objects whose single key "a" holds
 * the next one (the innermost holds 0). */
static char *t_nested(unsigned depth, int objects, size_t *len)
{
	size_t open = objects ? 5 : 1, n = depth * (open + 1) + (objects ? 1 : 0);
	char *d = malloc(n + 1), *p = d;

	assert_non_null(d);
	for (unsigned k = 0; k < depth; k++) {
		memcpy(p, objects ? "{\"a\":" : "[", open);
		p += open;
	}
	if (objects)
		*p++ = '0';
	for (unsigned k = 0; k < depth; k++)
		*p++ = objects ? '}' : ']';
	*p = '\0';
	*len = n;
	return d;
}

static void test_json_nesting_up_to_512_is_ok(void **state)
{
	size_t len;
	char *d;

	(void)state;
	for (int obj = 0; obj <= 1; obj++) {
		d = t_nested(AP_JSON_MAX_DEPTH, obj, &len);
		t_assert_json_ok(d, len);
		free(d);
	}
	/* Mixed, and deep-ish with content at every level. */
	char mixed[AP_JSON_MAX_DEPTH * 12], *p = mixed;
	for (int k = 0; k < AP_JSON_MAX_DEPTH / 2; k++)
		p += sprintf(p, "[1,{\"k\":");
	p += sprintf(p, "\"leaf\"");
	for (int k = 0; k < AP_JSON_MAX_DEPTH / 2; k++)
		p += sprintf(p, "}]");
	t_assert_json_ok(mixed, (size_t)(p - mixed));
}

static void test_json_nesting_513_is_too_deep_at_the_513th_bracket(void **state)
{
	struct t_json_result r;
	size_t len;
	char *d;

	(void)state;
	d = t_nested(AP_JSON_MAX_DEPTH + 1, 0, &len);
	r = t_json(d, len);
	assert_int_equal(r.st, AP_HANDLER_ERROR);
	assert_string_equal(r.reason, "too_deep");
	assert_int_equal(r.off, AP_JSON_MAX_DEPTH);
	free(d);

	d = t_nested(AP_JSON_MAX_DEPTH + 1, 1, &len);
	r = t_json(d, len);
	assert_string_equal(r.reason, "too_deep");
	assert_int_equal(r.off, AP_JSON_MAX_DEPTH * 5);
	free(d);

	/* A hostile depth costs no more than the first 513 brackets. */
	size_t big = 10u << 20;
	d = malloc(big);
	assert_non_null(d);
	memset(d, '[', big);
	r = t_json(d, big);
	assert_string_equal(r.reason, "too_deep");
	assert_int_equal(r.off, AP_JSON_MAX_DEPTH);
	free(d);
}

static void test_json_not_a_binary_is_refused(void **state)
{
	const actor_pool_handler *h = ap_builtin_handler("json_validate");
	actor_pool_reply reply;
	ei_x_buff x;

	(void)state;
	ei_x_new_with_version(&x);
	ei_x_encode_string(&x, "[1,2]");
	t_reply_init(&reply);
	assert_int_equal(t_call(h, NULL, x.buff, (size_t)x.index, 0, 1, &reply), AP_HANDLER_ERROR);
	t_assert_reply_atom(&reply, "not_a_binary");
	t_reply_free(&reply);
	ei_x_free(&x);
}

static void test_json_tells_are_judged_without_a_reply(void **state)
{
	const actor_pool_handler *h = ap_builtin_handler("json_validate");
	actor_pool_reply reply;

	(void)state;
	t_reply_init(&reply);
	assert_int_equal(t_call(h, NULL, "[1]", 3, 1, 0, &reply), AP_HANDLER_OK);
	assert_int_equal(t_call(h, NULL, "[1,]", 4, 1, 0, &reply), AP_HANDLER_ERROR);
	t_assert_reply_atom(&reply, "ok"); /* the pool's preset, untouched */
	t_reply_free(&reply);
}

static void test_json_reply_that_cannot_grow_is_a_crash(void **state)
{
	const actor_pool_handler *h = ap_builtin_handler("json_validate");
	actor_pool_reply reply;

	(void)state;
	t_reply_init(&reply);
	reply.reserve = t_reserve_fails;
	assert_int_equal(t_call(h, NULL, "[1,]", 4, 1, 1, &reply), AP_HANDLER_CRASH);
	assert_int_equal(t_call(h, NULL, "[1]", 3, 1, 1, &reply), AP_HANDLER_CRASH);
	t_reply_free(&reply);
}

/* Mutated and truncated documents: no crash, no read past the end (each
 * run is an exact-size copy), an offset inside the document, and a valid
 * prefix never judged by a byte after it. */
static void test_json_mutations_never_crash(void **state)
{
	static const char *const seeds[] = {
		"{\"a\":[1,2,{\"b\":null}],\"c\":\"d\\u00e9\\ud83d\\ude00\",\"e\":-1.5e+3}",
		"[\"0123456789abcdefghijklmnopqrstuvwxyz\",true,false,null,{\"k\":{}}]",
		"\"\xc3\xa9\xe6\x97\xa5\xf0\x9f\x98\x80\\n\\t\"",
	};
	static const char interesting[] = "{}[]\",:\\u0eE.-+ \x80\xc3\xed\xf4";
	t_rng rng;
	uint8_t buf[256];

	(void)state;
	t_rng_seed(&rng, t_seed("json mutations"));
	for (int iter = 0; iter < 200000; iter++) {
		const char *s = seeds[t_rand32(&rng) % (sizeof seeds / sizeof seeds[0])];
		size_t n = strlen(s);
		memcpy(buf, s, n);
		int muts = (int)t_rand_range(&rng, 0, 3);
		for (int m = 0; m < muts; m++) {
			uint32_t what = t_rand32(&rng);
			size_t at = t_rand_range(&rng, 0, n - 1);
			if (what & 1)
				buf[at] = (uint8_t)t_rand32(&rng);
			else
				buf[at] = (uint8_t)interesting[t_rand32(&rng) % (sizeof interesting - 1)];
		}
		if (t_rand32(&rng) & 1)
			n = t_rand_range(&rng, 0, n);
		uint8_t *d = t_dup(buf, n);
		size_t off = SIZE_MAX;
		enum ap_json_result r = ap_json_validate(d, n, &off);
		if (r != AP_JSON_OK) {
			assert_true(off <= n);
			assert_string_not_equal(ap_json_reason_name(r), "unknown");
		}
		free(d);
	}
}

/* ---- echo -------------------------------------------------------------------- */

static void test_echo_replies_binaries_unchanged(void **state)
{
	const actor_pool_handler *h = ap_builtin_handler("echo");
	static const uint8_t bin[] = { 'h', 'i', 0, 0xff, 131, '\n' };
	actor_pool_reply reply;

	(void)state;
	t_reply_init(&reply);
	assert_int_equal(t_call(h, NULL, bin, sizeof bin, 1, 1, &reply), AP_HANDLER_OK);
	assert_int_equal(reply.kind, AP_REPLY_BINARY);
	assert_int_equal(reply.len, sizeof bin);
	assert_memory_equal(reply.data, bin, sizeof bin);

	assert_int_equal(t_call(h, NULL, "", 0, 1, 1, &reply), AP_HANDLER_OK);
	assert_int_equal(reply.kind, AP_REPLY_BINARY);
	assert_int_equal(reply.len, 0);

	/* A megabyte, through a reply that grows. */
	size_t big = 1u << 20;
	uint8_t *b = malloc(big);
	assert_non_null(b);
	t_stream_fill(b, big, 7);
	assert_int_equal(t_call(h, NULL, b, big, 1, 1, &reply), AP_HANDLER_OK);
	assert_int_equal(reply.len, big);
	assert_int_equal(t_stream_check(reply.data, big, 7), big);
	free(b);
	t_reply_free(&reply);
}

static void test_echo_replies_terms_unchanged(void **state)
{
	const actor_pool_handler *h = ap_builtin_handler("echo");
	actor_pool_reply reply;
	ei_x_buff x;

	(void)state;
	ei_x_new_with_version(&x);
	ei_x_encode_tuple_header(&x, 3);
	ei_x_encode_atom(&x, "hello");
	ei_x_encode_list_header(&x, 2);
	ei_x_encode_long(&x, 1);
	ei_x_encode_double(&x, 2.5);
	ei_x_encode_empty_list(&x);
	ei_x_encode_binary(&x, "bin", 3);
	t_reply_init(&reply);
	assert_int_equal(t_call(h, NULL, x.buff, (size_t)x.index, 0, 1, &reply), AP_HANDLER_OK);
	assert_int_equal(reply.kind, AP_REPLY_TERM);
	assert_int_equal(reply.len, (size_t)x.index);
	assert_memory_equal(reply.data, x.buff, (size_t)x.index);
	t_reply_free(&reply);
	ei_x_free(&x);
}

static void test_echo_tells_leave_the_reply_alone(void **state)
{
	const actor_pool_handler *h = ap_builtin_handler("echo");
	actor_pool_reply reply;

	(void)state;
	t_reply_init(&reply);
	assert_int_equal(t_call(h, NULL, "tell", 4, 1, 0, &reply), AP_HANDLER_OK);
	t_assert_reply_atom(&reply, "ok"); /* the pool's preset, untouched */
	reply.reserve = t_reserve_fails;
	assert_int_equal(t_call(h, NULL, "ask", 3, 1, 1, &reply), AP_HANDLER_CRASH);
	t_reply_free(&reply);
}

static void test_builtins_are_found_by_name_only(void **state)
{
	(void)state;
	const char *names[] = { "echo", "json_validate" };
	for (size_t k = 0; k < 2; k++) {
		const actor_pool_handler *h = ap_builtin_handler(names[k]);
		assert_non_null(h);
		assert_int_equal(h->abi_version, ACTOR_POOL_HANDLER_ABI);
		assert_string_equal(h->name, names[k]);
		assert_non_null(h->handle);
	}
	assert_null(ap_builtin_handler("nope"));
	assert_null(ap_builtin_handler("Echo"));
	assert_null(ap_builtin_handler(""));
	assert_null(ap_builtin_handler(NULL));
}

/* ---- plugins ----------------------------------------------------------------- */

struct t_load {
	int rc;
	const actor_pool_handler *h;
	void *dl;
	uint32_t got;
	char why[256];
};

static struct t_load t_load(const char *path)
{
	struct t_load l;
	memset(&l, 0xa5, sizeof l); /* prove every out parameter is written */
	l.rc = ap_plugin_load(path, &l.h, &l.dl, &l.got, l.why, sizeof l.why);
	assert_true(strlen(l.why) < sizeof l.why);
	if (l.rc) {
		assert_null(l.h);
		assert_null(l.dl);
		assert_true(l.why[0] != '\0');
	}
	return l;
}

static void test_plugin_ok_loads_and_runs(void **state)
{
	struct t_load a, b;
	actor_pool_reply reply;
	void *s1, *s2;

	(void)state;
	a = t_load(T_BUILD_DIR "/plugin_ok.so");
	assert_int_equal(a.rc, 0);
	assert_non_null(a.h);
	assert_non_null(a.dl);
	assert_string_equal(a.h->name, "plugin_ok");
	assert_int_equal(a.got, 0);

	/* Loaded twice (two pools): both work, and each worker has its own state. */
	b = t_load(T_BUILD_DIR "/plugin_ok.so");
	assert_int_equal(b.rc, 0);
	assert_int_equal(a.h->init(&s1, NULL, 0), 0);
	assert_int_equal(b.h->init(&s2, (const uint8_t *)"\x83j", 2), 0);
	t_reply_init(&reply);
	assert_int_equal(t_call(a.h, s1, "x", 1, 1, 1, &reply), AP_HANDLER_OK);
	assert_int_equal(t_call(a.h, s1, "x", 1, 1, 1, &reply), AP_HANDLER_OK);
	assert_int_equal(reply.kind, AP_REPLY_BINARY);
	assert_int_equal(reply.len, strlen("seen 2 config 0"));
	assert_memory_equal(reply.data, "seen 2 config 0", reply.len);
	assert_int_equal(t_call(b.h, s2, "x", 1, 1, 1, &reply), AP_HANDLER_OK);
	assert_memory_equal(reply.data, "seen 1 config 2", reply.len);
	a.h->terminate(s1);
	b.h->terminate(s2);
	t_reply_free(&reply);
	ap_plugin_unload(b.dl);
	ap_plugin_unload(a.dl);
	ap_plugin_unload(NULL);
}

static void test_plugin_name_without_slash_is_a_file_here(void **state)
{
	char cwd[4096];
	struct t_load l;

	(void)state;
	assert_non_null(getcwd(cwd, sizeof cwd));
	assert_int_equal(chdir(T_BUILD_DIR), 0);
	l = t_load("plugin_ok.so");
	assert_int_equal(chdir(cwd), 0);
	assert_int_equal(l.rc, 0);
	ap_plugin_unload(l.dl);
	/* ...and not a library from the search path. */
	l = t_load("libc.so.6");
	assert_int_equal(l.rc, -1);
}

static void test_plugin_wrong_abi_is_minus_2_with_the_version(void **state)
{
	struct t_load l;

	(void)state;
	l = t_load(T_BUILD_DIR "/plugin_badabi.so");
	assert_int_equal(l.rc, -2);
	assert_int_equal(l.got, 999);
	assert_non_null(strstr(l.why, "999"));
	/* The copy built for the Erlang tests is the same plugin. */
	l = t_load(T_TESTBIN_DIR "/plugin_badabi.so");
	assert_int_equal(l.rc, -2);
	assert_int_equal(l.got, 999);
	/* got may be NULL. */
	const actor_pool_handler *h;
	void *dl;
	char why[64];
	assert_int_equal(ap_plugin_load(T_BUILD_DIR "/plugin_badabi.so", &h, &dl, NULL, why, sizeof why), -2);
}

static void test_plugin_bad_files_are_minus_1_and_never_crash(void **state)
{
	char text[] = "/tmp/t_handlers_textXXXXXX";
	struct t_load l;
	int fd;

	(void)state;
	l = t_load(T_BUILD_DIR "/plugin_nosym.so");
	assert_int_equal(l.rc, -1);
	assert_non_null(strstr(l.why, ACTOR_POOL_HANDLER_SYMBOL));

	l = t_load(T_BUILD_DIR "/plugin_null.so");
	assert_int_equal(l.rc, -1);
	assert_non_null(strstr(l.why, "NULL"));

	l = t_load(T_BUILD_DIR "/plugin_nohandle.so");
	assert_int_equal(l.rc, -1);
	assert_non_null(strstr(l.why, "handle"));

	l = t_load("/nonexistent/dir/plugin.so");
	assert_int_equal(l.rc, -1);
	assert_non_null(strstr(l.why, "No such file"));

	fd = mkstemp(text);
	assert_true(fd >= 0);
	assert_int_equal(write(fd, "this is not an ELF file\n", 24), 24);
	close(fd);
	l = t_load(text);
	assert_int_equal(l.rc, -1);
	unlink(text);

	l = t_load(T_BUILD_DIR); /* a directory */
	assert_int_equal(l.rc, -1);
	l = t_load("");
	assert_int_equal(l.rc, -1);
	l = t_load(NULL);
	assert_int_equal(l.rc, -1);
}

static void test_plugin_why_is_cut_to_fit(void **state)
{
	const actor_pool_handler *h;
	void *dl;
	char why[8];

	(void)state;
	memset(why, 'x', sizeof why);
	assert_int_equal(ap_plugin_load("/nonexistent/plugin.so", &h, &dl, NULL, why, sizeof why), -1);
	assert_int_equal(strlen(why), sizeof why - 1);
	assert_int_equal(ap_plugin_load("/nonexistent/plugin.so", &h, &dl, NULL, NULL, 0), -1);
}

/* ap_plugin_check: a file there to be opened, and why not, without
 * loading anything (a worker process loads it). */
static void test_plugin_check_names_a_missing_file_and_loads_nothing(void **state)
{
	char why[256], cwd[4096], fifo[] = "/tmp/t_handlers_fifoXXXXXX";
	const char *missing = "/nonexistent/dir/plugin.so";

	(void)state;
	/* A plugin that would not load is still a file that opens: the check
	 * is about the file, the load is the worker's. */
	assert_int_equal(ap_plugin_check(T_BUILD_DIR "/plugin_nosym.so", why, sizeof why), 0);
	assert_int_equal(ap_plugin_check(T_BUILD_DIR "/plugin_ok.so", why, sizeof why), 0);

	memset(why, 'x', sizeof why);
	assert_int_equal(ap_plugin_check(missing, why, sizeof why), -1);
	assert_true(strlen(why) < sizeof why);
	assert_int_equal(strncmp(why, missing, strlen(missing)), 0);
	assert_non_null(strstr(why, "No such file or directory"));

	assert_int_equal(ap_plugin_check(T_BUILD_DIR, why, sizeof why), -1);
	assert_non_null(strstr(why, "not a regular file"));

	/* A FIFO is refused at once, not waited on for a writer. */
	assert_non_null(mkdtemp(fifo));
	char path[sizeof fifo + 8];
	snprintf(path, sizeof path, "%s/p.so", fifo);
	assert_int_equal(mkfifo(path, 0600), 0);
	assert_int_equal(ap_plugin_check(path, why, sizeof why), -1);
	assert_non_null(strstr(why, "not a regular file"));
	unlink(path);
	rmdir(fifo);

	/* A bare name is a file here, as for ap_plugin_load. */
	assert_non_null(getcwd(cwd, sizeof cwd));
	assert_int_equal(chdir(T_BUILD_DIR), 0);
	int here = ap_plugin_check("plugin_ok.so", why, sizeof why);
	assert_int_equal(chdir(cwd), 0);
	assert_int_equal(here, 0);
	assert_int_equal(ap_plugin_check("libc.so.6", why, sizeof why), -1);

	assert_int_equal(ap_plugin_check("", why, sizeof why), -1);
	assert_int_equal(ap_plugin_check(NULL, why, sizeof why), -1);
	/* why is cut to fit, or not written at all. */
	char small[8];
	assert_int_equal(ap_plugin_check(missing, small, sizeof small), -1);
	assert_int_equal(strlen(small), sizeof small - 1);
	assert_int_equal(ap_plugin_check(missing, NULL, 0), -1);
}

/* plugin_crash: what the Erlang tests rely on. */
static void test_plugin_crash_does_what_its_requests_say(void **state)
{
	struct t_load l;
	actor_pool_reply reply;
	ei_x_buff x;

	(void)state;
	l = t_load(T_TESTBIN_DIR "/plugin_crash.so");
	assert_int_equal(l.rc, 0);
	t_reply_init(&reply);

	assert_int_equal(t_call(l.h, NULL, "crash", 5, 1, 1, &reply), AP_HANDLER_CRASH);
	assert_int_equal(t_call(l.h, NULL, "crash", 5, 1, 0, &reply), AP_HANDLER_CRASH);

	assert_int_equal(t_call(l.h, NULL, "crash!", 6, 1, 1, &reply), AP_HANDLER_OK);
	assert_int_equal(reply.kind, AP_REPLY_BINARY);
	assert_memory_equal(reply.data, "crash!", 6);

	ei_x_new_with_version(&x);
	ei_x_encode_tuple_header(&x, 2);
	ei_x_encode_atom(&x, "sleep");
	ei_x_encode_long(&x, 30);
	int64_t t0 = t_now_ms();
	assert_int_equal(t_call(l.h, NULL, x.buff, (size_t)x.index, 0, 1, &reply), AP_HANDLER_OK);
	assert_true(t_now_ms() - t0 >= 30);
	t_assert_reply_atom(&reply, "ok");
	ei_x_free(&x);

	ei_x_new_with_version(&x);
	ei_x_encode_tuple_header(&x, 2);
	ei_x_encode_atom(&x, "fail");
	ei_x_encode_atom(&x, "no_way");
	assert_int_equal(t_call(l.h, NULL, x.buff, (size_t)x.index, 0, 1, &reply), AP_HANDLER_ERROR);
	t_assert_reply_atom(&reply, "no_way");
	ei_x_free(&x);

	/* {fail, NotAnAtom} and other shapes are echoed. */
	ei_x_new_with_version(&x);
	ei_x_encode_tuple_header(&x, 2);
	ei_x_encode_atom(&x, "fail");
	ei_x_encode_long(&x, 1);
	assert_int_equal(t_call(l.h, NULL, x.buff, (size_t)x.index, 0, 1, &reply), AP_HANDLER_OK);
	assert_int_equal(reply.kind, AP_REPLY_TERM);
	assert_int_equal(reply.len, (size_t)x.index);
	assert_memory_equal(reply.data, x.buff, reply.len);
	ei_x_free(&x);

	t_reply_free(&reply);
	ap_plugin_unload(l.dl);
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_json_valid_documents_are_ok),
		cmocka_unit_test(test_json_invalid_documents_give_offset_and_reason),
		cmocka_unit_test(test_json_nesting_up_to_512_is_ok),
		cmocka_unit_test(test_json_nesting_513_is_too_deep_at_the_513th_bracket),
		cmocka_unit_test(test_json_not_a_binary_is_refused),
		cmocka_unit_test(test_json_tells_are_judged_without_a_reply),
		cmocka_unit_test(test_json_reply_that_cannot_grow_is_a_crash),
		cmocka_unit_test(test_json_mutations_never_crash),
		cmocka_unit_test(test_echo_replies_binaries_unchanged),
		cmocka_unit_test(test_echo_replies_terms_unchanged),
		cmocka_unit_test(test_echo_tells_leave_the_reply_alone),
		cmocka_unit_test(test_builtins_are_found_by_name_only),
		cmocka_unit_test(test_plugin_ok_loads_and_runs),
		cmocka_unit_test(test_plugin_name_without_slash_is_a_file_here),
		cmocka_unit_test(test_plugin_wrong_abi_is_minus_2_with_the_version),
		cmocka_unit_test(test_plugin_bad_files_are_minus_1_and_never_crash),
		cmocka_unit_test(test_plugin_why_is_cut_to_fit),
		cmocka_unit_test(test_plugin_check_names_a_missing_file_and_loads_nothing),
		cmocka_unit_test(test_plugin_crash_does_what_its_requests_say),
	};
	return cmocka_run_group_tests(tests, NULL, NULL);
}
