/* t_helpers: what every runtime test shares: cmocka, clocks, a seeded PRNG, exact-size copies. */
#ifndef T_HELPERS_H
#define T_HELPERS_H

/* cmocka needs these before its header. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include <ei.h>
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static inline int64_t t_now_ms(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* xorshift64*: reproducible, and cheap enough for megabytes of test data. */
typedef struct t_rng {
	uint64_t s;
} t_rng;

static inline void t_rng_seed(t_rng *r, uint64_t seed)
{
	r->s = seed ? seed : 0x9e3779b97f4a7c15ull;
}

static inline uint64_t t_rand64(t_rng *r)
{
	r->s ^= r->s >> 12;
	r->s ^= r->s << 25;
	r->s ^= r->s >> 27;
	return r->s * 0x2545f4914f6cdd1dull;
}

static inline uint32_t t_rand32(t_rng *r) { return (uint32_t)(t_rand64(r) >> 32); }

/* Uniform enough in [lo, hi]. */
static inline size_t t_rand_range(t_rng *r, size_t lo, size_t hi)
{
	return lo + (size_t)(t_rand64(r) % (hi - lo + 1));
}

/* The seed for a test's PRNG: $T_SEED when set (to replay a failure),
 * else a fixed value, so runs are reproducible. Printed either way. */
static inline uint64_t t_seed(const char *what)
{
	const char *e = getenv("T_SEED");
	uint64_t s = e ? strtoull(e, NULL, 0) : 0x5eed5eedull;
	print_message("[ seed     ] %s: T_SEED=0x%" PRIx64 "\n", what, s);
	return s;
}

/* The byte at offset `off` of a test stream: depends on the offset, so a
 * lost, repeated or reordered chunk shows up at the first byte it shifts. */
static inline uint8_t t_stream_byte(uint64_t off)
{
	uint64_t x = off * 0x9e3779b97f4a7c15ull;
	return (uint8_t)(x >> 56 ^ x >> 29 ^ off);
}

static inline void t_stream_fill(uint8_t *p, size_t n, uint64_t off)
{
	for (size_t i = 0; i < n; i++)
		p[i] = t_stream_byte(off + i);
}

/* First offset in p[0..n) that is not the stream at `off`, or n. */
static inline size_t t_stream_check(const uint8_t *p, size_t n, uint64_t off)
{
	for (size_t i = 0; i < n; i++)
		if (p[i] != t_stream_byte(off + i))
			return i;
	return n;
}

/* A heap copy of exactly n bytes, so ASan reports a read one past the end
 * of a truncated input. n == 0 gives a zero-size block: any read of it is
 * reported too. */
static inline uint8_t *t_dup(const void *p, size_t n)
{
	uint8_t *d = malloc(n);
	if (n)
		assert_non_null(d);
	if (n)
		memcpy(d, p, n);
	return d;
}

static inline erlang_pid t_pid(const char *node, unsigned num, unsigned serial, unsigned creation)
{
	erlang_pid p;
	memset(&p, 0, sizeof p);
	snprintf(p.node, sizeof p.node, "%s", node);
	p.num = num;
	p.serial = serial;
	p.creation = creation;
	return p;
}

#define t_assert_pid_eq(a, b)                                       \
	do {                                                        \
		assert_string_equal((a).node, (b).node);            \
		assert_int_equal((a).num, (b).num);                 \
		assert_int_equal((a).serial, (b).serial);           \
		assert_int_equal((a).creation, (b).creation);       \
	} while (0)

#endif
