/* bench_json: json_validate's reference validator against simdjson, ns per document (not a test). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "handlers.h"
#include "json_simd.h"

struct doc {
	uint8_t *p;
	size_t n;
};

struct set {
	const char *name;
	struct doc *d;
	size_t count, bytes;
};

static uint64_t now_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static void *xmalloc(size_t n)
{
	void *p = malloc(n ? n : 1);
	if (!p) {
		perror("malloc");
		exit(2);
	}
	return p;
}

static void set_free(struct set *s)
{
	for (size_t k = 0; k < s->count; k++)
		free(s->d[k].p);
	free(s->d);
}

static uint64_t rng_state = 0x2026113013ull;

static uint32_t rnd(void)
{
	rng_state ^= rng_state << 13;
	rng_state ^= rng_state >> 7;
	rng_state ^= rng_state << 17;
	return (uint32_t)(rng_state >> 16);
}

/* The file holds 4-byte big-endian lengths, each followed by a document. */
static struct set load(const char *path)
{
	struct set s = { .name = "valid ~2 KB (pool bench docs)" };
	FILE *f = fopen(path, "rb");
	uint8_t len[4];
	size_t cap = 0;

	if (!f) {
		perror(path);
		exit(2);
	}
	while (fread(len, 1, 4, f) == 4) {
		size_t n = (size_t)len[0] << 24 | (size_t)len[1] << 16 | (size_t)len[2] << 8 | len[3];
		if (n > (1u << 24)) {
			fprintf(stderr, "%s: bad length %zu\n", path, n);
			exit(2);
		}
		if (s.count == cap) {
			cap = cap ? 2 * cap : 64;
			struct doc *d = realloc(s.d, cap * sizeof *s.d);
			if (!d) {
				perror("realloc");
				exit(2);
			}
			s.d = d;
		}
		uint8_t *p = xmalloc(n);
		if (fread(p, 1, n, f) != n) {
			fprintf(stderr, "%s: truncated\n", path);
			exit(2);
		}
		s.d[s.count++] = (struct doc){ p, n };
		s.bytes += n;
	}
	fclose(f);
	return s;
}

/* ~100-byte objects of the same flavour: a few keys, a nested array, a
 * float, a boolean, a string with an escape. */
static struct set small_docs(size_t count)
{
	struct set s = { .name = "valid ~100 B", .d = xmalloc(count * sizeof(struct doc)), .count = count };
	for (size_t k = 0; k < count; k++) {
		char b[256];
		int n = snprintf(b, sizeof b,
				 "{\"id\":%u,\"name\":\"user %u\\n\",\"email\":\"u%u@example.com\",\"ok\":%s,"
				 "\"score\":%u.%u,\"tags\":[\"a\",\"b\"]}",
				 rnd() % 100000, rnd() % 1000, rnd() % 1000, rnd() & 1 ? "true" : "false", rnd() % 100,
				 rnd() % 1000);
		s.d[k].p = xmalloc((size_t)n);
		memcpy(s.d[k].p, b, (size_t)n);
		s.d[k].n = (size_t)n;
		s.bytes += (size_t)n;
	}
	return s;
}

/* Each document with one byte set to 0x01 at a random offset: invalid
 * wherever it lands (a control character in a string, else an unexpected
 * byte), the error on average half-way in. */
static struct set corrupt(const struct set *in, const char *name)
{
	struct set s = { .name = name, .d = xmalloc(in->count * sizeof(struct doc)), .count = in->count,
			 .bytes = in->bytes };
	for (size_t k = 0; k < in->count; k++) {
		s.d[k].n = in->d[k].n;
		s.d[k].p = xmalloc(s.d[k].n);
		memcpy(s.d[k].p, in->d[k].p, s.d[k].n);
		s.d[k].p[rnd() % s.d[k].n] = 0x01;
	}
	return s;
}

enum method { M_REF, M_SIMD, M_WIRED };
static const char *const method_names[] = { "reference (ap_json_validate)", "simdjson DOM alone",
					    "simdjson, reference on invalid" };

static volatile unsigned sink;

static unsigned judge(enum method m, const struct doc *d)
{
	size_t off = 0;
	switch (m) {
	case M_REF:
		return ap_json_validate(d->p, d->n, &off) == AP_JSON_OK;
	case M_SIMD:
		return (unsigned)ap_json_simd_valid(d->p, d->n, AP_JSON_MAX_DEPTH);
	case M_WIRED:
		if (ap_json_simd_valid(d->p, d->n, AP_JSON_MAX_DEPTH))
			return 1;
		return ap_json_validate(d->p, d->n, &off) == AP_JSON_OK;
	}
	return 0;
}

static int cmp_double(const void *a, const void *b)
{
	double x = *(const double *)a, y = *(const double *)b;
	return (x > y) - (x < y);
}

/* Median ns per document over `runs` runs of about 0.2 s each. */
static double measure(enum method m, const struct set *s, int runs)
{
	double ns[64];
	size_t reps = 1;
	unsigned ok = 0;

	/* Warm up and size a run. */
	for (;;) {
		uint64_t t0 = now_ns();
		for (size_t r = 0; r < reps; r++)
			for (size_t k = 0; k < s->count; k++)
				ok += judge(m, &s->d[k]);
		if (now_ns() - t0 > 50000000u)
			break;
		reps *= 2;
	}
	reps *= 4;
	for (int i = 0; i < runs; i++) {
		uint64_t t0 = now_ns();
		for (size_t r = 0; r < reps; r++)
			for (size_t k = 0; k < s->count; k++)
				ok += judge(m, &s->d[k]);
		ns[i] = (double)(now_ns() - t0) / (double)(reps * s->count);
	}
	sink = ok;
	qsort(ns, (size_t)runs, sizeof ns[0], cmp_double);
	return ns[runs / 2];
}

/* ---- do they judge alike? --------------------------------------------------- */

struct tally {
	size_t both_ok, both_bad, simd_stricter, simd_looser;
};

static int compare(struct tally *t, const uint8_t *p, size_t n, int verbose)
{
	size_t off = 0;
	enum ap_json_result r = ap_json_validate(p, n, &off);
	int s = ap_json_simd_valid(p, n, AP_JSON_MAX_DEPTH);

	if (!r && s) {
		t->both_ok++;
	} else if (r && !s) {
		t->both_bad++;
	} else if (!r) {
		/* simdjson refuses what the contract accepts: harmless when the
		 * reference judges every document simdjson refuses. */
		t->simd_stricter++;
		if (verbose)
			printf("  simdjson refuses, the contract accepts: \"%.*s\"\n", (int)(n > 60 ? 60 : n), p);
	} else {
		/* simdjson accepts what the contract refuses: it could not give
		 * the verdict alone. */
		t->simd_looser++;
		printf("  simdjson ACCEPTS, the contract refuses (%s at %zu): \"%.*s\"\n", ap_json_reason_name(r), off,
		       (int)(n > 60 ? 60 : n), p);
	}
	return 0;
}

#define TRICKY(x) { x, sizeof(x) - 1 }

static const struct {
	const char *p;
	size_t n;
} tricky[] = {
	TRICKY("1"), TRICKY("\"a\""), TRICKY("true"), TRICKY("null"), TRICKY("  1  "), TRICKY(""), TRICKY("  "),
	TRICKY("1e400"), TRICKY("-1e400"), TRICKY("123456789012345678901234567890"), TRICKY("1e-400"),
	TRICKY("18446744073709551615"), TRICKY("18446744073709551616"), TRICKY("-9223372036854775808"),
	TRICKY("-9223372036854775809"), TRICKY("1.7976931348623157e308"), TRICKY("1.8e308"), TRICKY("4.9e-324"),
	TRICKY("[0.1e99999999999999999999]"), TRICKY("{\"a\":1,\"a\":2}"),
	TRICKY("\"\\udc00\""), TRICKY("\"\\ud800\""), TRICKY("\"\\ud800\\u0041\""), TRICKY("\"\\ud800\\ud800\""),
	TRICKY("\"\\udbff\\udfff\""), TRICKY("\"\\ud800\\\""), TRICKY("\"\\ud800\\x\""), TRICKY("\"\\u00e9\\u0000\""),
	TRICKY("\"\xed\xa0\x80\""), TRICKY("\"\xc0\xaf\""), TRICKY("\"\xf4\x90\x80\x80\""), TRICKY("\"\xf4\x8f\xbf\xbf\""),
	TRICKY("\"\xe0\x9f\xbf\""), TRICKY("\"\xef\xbf\xbf\""), TRICKY("\"\x7f\""), TRICKY("\"ab\xe2\x82"),
	TRICKY("1\0"), TRICKY("[1]\0"), TRICKY("\0"), TRICKY("\"a\0\""), TRICKY("[1\0]"), TRICKY("true\0"),
	TRICKY("tru"), TRICKY("truex"), TRICKY("nul"), TRICKY("[nulll]"), TRICKY("[true,false,null]"),
	TRICKY("[1,]"), TRICKY("{\"a\":1,}"), TRICKY("[1 2]"), TRICKY("{\"a\" 1}"), TRICKY("{1:2}"), TRICKY("1 2"),
	TRICKY("[]]"), TRICKY("{}}"), TRICKY("01"), TRICKY("-0"), TRICKY("-"), TRICKY("1."), TRICKY("1.e5"),
	TRICKY("1e"), TRICKY("1e+"), TRICKY("1E+5"), TRICKY("-0.0e-0"), TRICKY(".5"), TRICKY("+1"), TRICKY("'a'"),
	TRICKY("\x0c" "1"), TRICKY("\xef\xbb\xbf[]"), TRICKY("[\x80]"), TRICKY("\"\t\""), TRICKY("\"\\x\""),
	TRICKY("\"\\u12G4\""), TRICKY("\"\\u12\""), TRICKY("[\"\\/\\b\\f\\n\\r\\t\\\"\\\\\"]"), TRICKY("{\"\":\"\"}"),
	TRICKY(" [ 1 , { \"a\" : [ ] } ]\r\n\t"),
};

static const char interesting[] = "{}[]\",:\\u0eE.-+ \x01\x7f\x80\xbf\xc0\xc3\xe0\xed\xf0\xf4\xff";

/* Random mutations: a byte replaced, a span cut out, a token pasted in, the
 * end cut off; one to three of them per document. */
static size_t mutate(uint8_t *b, size_t n, size_t cap)
{
	static const char *const tokens[] = { "1e999", "123456789012345678901234567890", "-", "\\ud800", "\\udc00",
					      "\\u", "[", "]", "{}", "\"", ",", "nul", "\xed\xa0\x80", "\xf4\x90" };
	int muts = 1 + (int)(rnd() % 3);
	for (int m = 0; m < muts && n; m++) {
		size_t at = rnd() % n;
		switch (rnd() % 5) {
		case 0:
			b[at] = (uint8_t)rnd();
			break;
		case 1:
			b[at] = (uint8_t)interesting[rnd() % (sizeof interesting - 1)];
			break;
		case 2: {
			size_t len = 1 + rnd() % 8;
			if (at + len > n)
				len = n - at;
			memmove(b + at, b + at + len, n - at - len);
			n -= len;
			break;
		}
		case 3: {
			const char *t = tokens[rnd() % (sizeof tokens / sizeof tokens[0])];
			size_t len = strlen(t);
			if (n + len > cap)
				break;
			memmove(b + at + len, b + at, n - at);
			memcpy(b + at, t, len);
			n += len;
			break;
		}
		default:
			n = at;
			break;
		}
	}
	return n;
}

static int agreement(const struct set *big, const struct set *small)
{
	struct tally t = { 0 };
	enum { MUTATIONS = 20000 };
	uint8_t buf[8192];

	printf("agreement, reference against simdjson alone:\n");
	for (size_t k = 0; k < sizeof tricky / sizeof tricky[0]; k++)
		compare(&t, (const uint8_t *)tricky[k].p, tricky[k].n, 1);
	for (unsigned depth = 510; depth <= 514; depth++) {
		memset(buf, '[', depth);
		memset(buf + depth, ']', depth);
		compare(&t, buf, 2 * depth, 1);
	}
	for (unsigned i = 0; i < MUTATIONS; i++) {
		const struct set *s = i & 1 ? small : big;
		const struct doc *d = &s->d[rnd() % s->count];
		memcpy(buf, d->p, d->n);
		size_t n = mutate(buf, d->n, sizeof buf);
		compare(&t, buf, n, 0);
	}
	printf("  %zu tricky documents and nestings of 510..514, %u mutations of the documents below:\n"
	       "  both valid %zu, both invalid %zu, only simdjson refuses %zu, only simdjson accepts %zu\n\n",
	       sizeof tricky / sizeof tricky[0], MUTATIONS, t.both_ok, t.both_bad, t.simd_stricter, t.simd_looser);
	return t.simd_looser != 0;
}

int main(int argc, char **argv)
{
	int runs = argc > 2 ? atoi(argv[2]) : 7;

	if (argc < 2) {
		fprintf(stderr, "usage: %s DOCS_FILE [RUNS]\n", argv[0]);
		return 2;
	}
	if (runs < 1 || runs > 64)
		runs = 7;
	struct set sets[4];
	sets[0] = load(argv[1]);
	sets[1] = small_docs(1000);
	sets[2] = corrupt(&sets[0], "invalid ~2 KB (0x01 at a random offset)");
	sets[3] = corrupt(&sets[1], "invalid ~100 B (0x01 at a random offset)");

	/* Both must agree on every document, or the numbers mean nothing. */
	for (size_t i = 0; i < 4; i++)
		for (size_t k = 0; k < sets[i].count; k++)
			if (judge(M_REF, &sets[i].d[k]) != judge(M_WIRED, &sets[i].d[k]) ||
			    judge(M_REF, &sets[i].d[k]) != (i < 2)) {
				fprintf(stderr, "%s: document %zu judged differently\n", sets[i].name, k);
				return 1;
			}
	if (agreement(&sets[0], &sets[1]))
		return 1;

	printf("json_validate micro-benchmark: one thread, median of %d runs\n", runs);
	for (size_t i = 0; i < 4; i++) {
		printf("\n%s: %zu docs, avg %zu bytes\n", sets[i].name, sets[i].count, sets[i].bytes / sets[i].count);
		double base = 0;
		for (enum method m = M_REF; m <= M_WIRED; m++) {
			double ns = measure(m, &sets[i], runs);
			if (m == M_REF)
				base = ns;
			printf("  %-32s %9.1f ns/doc %12.0f docs/s %8.0f MB/s  %5.2fx\n", method_names[m], ns, 1e9 / ns,
			       (double)sets[i].bytes / (double)sets[i].count / ns * 1e3, base / ns);
		}
	}
	for (size_t i = 0; i < 4; i++)
		set_free(&sets[i]);
	ap_json_simd_release();
	return 0;
}
