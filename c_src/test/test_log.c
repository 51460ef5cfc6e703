/* test_log: ap_log lets each message kind through at its rate and counts what it drops. */
#include "t_helpers.h"

#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <unistd.h>

#include "ap_buf.h"
#include "ap_log.h"

static atomic_llong t_clock;
static int64_t t_fake_now(void) { return atomic_load(&t_clock); }

struct t_line {
	char level[16];
	char text[1100];
};

static int t_pipe[2];

static int t_setup(void **state)
{
	(void)state;
	assert_int_equal(pipe(t_pipe), 0);
	assert_int_equal(fcntl(t_pipe[0], F_SETFL, O_NONBLOCK), 0);
	atomic_store(&t_clock, 0);
	ap_log_set_clock(t_fake_now);
	ap_log_set_level(AP_LOG_DEBUG);
	ap_log_set_port_fd(t_pipe[1]);
	return 0;
}

static int t_teardown(void **state)
{
	(void)state;
	ap_log_set_port_fd(-1);
	ap_log_set_clock(NULL);
	ap_log_set_limits(0, 0);
	ap_log_set_level(AP_LOG_INFO);
	close(t_pipe[0]);
	close(t_pipe[1]);
	return 0;
}

static int t_read_full(void *p, size_t n)
{
	uint8_t *c = p;
	while (n) {
		ssize_t r = read(t_pipe[0], c, n);
		if (r <= 0)
			return -1;
		c += r;
		n -= (size_t)r;
	}
	return 0;
}

/* The {log, Level, Bin} packets written so far. */
static size_t t_lines(struct t_line *out, size_t max)
{
	size_t n = 0;
	uint8_t h[4];
	while (t_read_full(h, 4) == 0) {
		uint32_t len = ap_get32be(h);
		char *b = malloc(len);
		assert_non_null(b);
		assert_int_equal(t_read_full(b, len), 0);
		int i = 0, arity, type, size, ver;
		char atom[MAXATOMLEN];
		long blen;
		assert_int_equal(ei_decode_version(b, &i, &ver), 0);
		assert_int_equal(ei_decode_tuple_header(b, &i, &arity), 0);
		assert_int_equal(arity, 3);
		assert_int_equal(ei_decode_atom(b, &i, atom), 0);
		assert_string_equal(atom, "log");
		assert_true(n < max);
		assert_int_equal(ei_decode_atom(b, &i, out[n].level), 0);
		assert_int_equal(ei_get_type(b, &i, &type, &size), 0);
		assert_true(size < (int)sizeof out[n].text);
		assert_int_equal(ei_decode_binary(b, &i, out[n].text, &blen), 0);
		out[n].text[blen] = 0;
		free(b);
		n++;
	}
	return n;
}

/* The N of a "suppressed N similar messages" line, or -1. */
static long long t_suppressed(const struct t_line *l)
{
	long long n;
	return sscanf(l->text, "suppressed %lld similar messages", &n) == 1 ? n : -1;
}

static void test_a_kind_gets_its_burst_then_its_rate(void **state)
{
	(void)state;
	struct t_line ls[64];
	ap_log_set_limits(3, 2);
	for (int i = 0; i < 10; i++)
		ap_log(AP_LOG_WARNING, "handshake failed %d", i);
	size_t n = t_lines(ls, 64);
	assert_int_equal(n, 3);
	assert_string_equal(ls[0].level, "warning");
	assert_string_equal(ls[2].text, "handshake failed 2");
	/* Half a second later: one token (2 a second), so one line, and
	 * before it the count of the seven dropped. */
	atomic_store(&t_clock, 500);
	for (int i = 10; i < 13; i++)
		ap_log(AP_LOG_WARNING, "handshake failed %d", i);
	n = t_lines(ls, 64);
	assert_int_equal(n, 2);
	assert_int_equal(t_suppressed(&ls[0]), 7);
	assert_string_equal(ls[0].level, "warning");
	assert_non_null(strstr(ls[0].text, "handshake failed %d"));
	assert_string_equal(ls[1].text, "handshake failed 10");
}

static void test_kinds_are_limited_apart(void **state)
{
	(void)state;
	struct t_line ls[64];
	ap_log_set_limits(2, 1);
	for (int i = 0; i < 100; i++)
		ap_log(AP_LOG_WARNING, "flood %d", i);
	ap_log(AP_LOG_ERROR, "something else");
	ap_log(AP_LOG_INFO, "and another %s", "kind");
	size_t n = t_lines(ls, 64);
	assert_int_equal(n, 4);
	assert_string_equal(ls[2].text, "something else");
	assert_string_equal(ls[2].level, "error");
	assert_string_equal(ls[3].text, "and another kind");
}

static void test_flush_reports_a_flood_that_stopped(void **state)
{
	(void)state;
	struct t_line ls[64];
	ap_log_set_limits(1, 1);
	for (int i = 0; i < 50; i++)
		ap_log(AP_LOG_NOTICE, "burst %d", i);
	ap_log_flush(); /* no token yet: nothing */
	assert_int_equal(t_lines(ls, 64), 1);
	atomic_store(&t_clock, 1000);
	ap_log_flush();
	assert_int_equal(t_lines(ls, 64), 1);
	assert_int_equal(t_suppressed(&ls[0]), 49);
	assert_string_equal(ls[0].level, "notice");
	/* Reported once. */
	atomic_store(&t_clock, 5000);
	ap_log_flush();
	assert_int_equal(t_lines(ls, 64), 0);
}

static void test_levels_filtered_out_cost_no_token(void **state)
{
	(void)state;
	struct t_line ls[8];
	ap_log_set_limits(1, 1);
	ap_log_set_level(AP_LOG_INFO);
	for (int i = 0; i < 10; i++)
		ap_log(AP_LOG_DEBUG, "quiet %d", i);
	assert_int_equal(t_lines(ls, 8), 0);
	atomic_store(&t_clock, 10000);
	ap_log_flush();
	assert_int_equal(t_lines(ls, 8), 0);
}

#define T_THREADS 4
#define T_PER_THREAD 2000

static void *t_logger(void *arg)
{
	(void)arg;
	for (int i = 0; i < T_PER_THREAD; i++)
		ap_log(AP_LOG_WARNING, "from many threads %d", i);
	return NULL;
}

/* Every line is either written or counted, whatever thread logs it. */
static void test_threads_share_one_count(void **state)
{
	(void)state;
	struct t_line ls[64];
	ap_log_set_limits(10, 1);
	pthread_t th[T_THREADS];
	for (int i = 0; i < T_THREADS; i++)
		assert_int_equal(pthread_create(&th[i], NULL, t_logger, NULL), 0);
	for (int i = 0; i < T_THREADS; i++)
		pthread_join(th[i], NULL);
	atomic_store(&t_clock, 1000);
	ap_log_flush();
	size_t n = t_lines(ls, 64);
	assert_int_equal(n, 11);
	long long total = 10;
	for (size_t i = 0; i < 10; i++)
		assert_int_equal(t_suppressed(&ls[i]), -1);
	total += t_suppressed(&ls[10]);
	assert_int_equal(total, T_THREADS * T_PER_THREAD);
}

/* Names from a peer go into lines escaped: nothing in them can end a line,
 * forge another, or carry bytes that are not UTF-8; printable ASCII and
 * well-formed UTF-8 stay as they are. */
static void test_escape_keeps_names_on_one_printable_line(void **state)
{
	(void)state;
	static const struct { const char *in, *out; } cases[] = {
		{ "echo", "echo" },
		{ "evil\nname", "evil\\x0aname" },
		{ "a\r\tb\x1b[31m", "a\\x0d\\x09b\\x1b[31m" },
		{ "q'uote\\", "q\\x27uote\\x5c" },
		{ "del\x7f", "del\\x7f" },
		{ "caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80", "caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80" },
		{ "c1\xc2\x85", "c1\\xc2\\x85" },               /* NEL, a C1 control */
		{ "bad\xc3", "bad\\xc3" },                        /* cut sequence */
		{ "over\xc0\xaf", "over\\xc0\\xaf" },             /* overlong */
		{ "sur\xed\xa0\x80", "sur\\xed\\xa0\\x80" },        /* surrogate */
	};
	char out[64];
	for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
		const char *r = ap_log_escape(out, sizeof out, cases[k].in);
		assert_ptr_equal(r, out);
		assert_string_equal(out, cases[k].out);
	}
	/* Too long: cut whole, with "...", inside the buffer. */
	char big[300];
	memset(big, '\n', sizeof big - 1);
	big[sizeof big - 1] = 0;
	char small[16];
	ap_log_escape(small, sizeof small, big);
	assert_string_equal(small, "\\x0a\\x0a\\x0a...");
	ap_log_escape(small, 4, "abcdef");
	assert_string_equal(small, "...");
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test_setup_teardown(test_a_kind_gets_its_burst_then_its_rate, t_setup, t_teardown),
		cmocka_unit_test_setup_teardown(test_kinds_are_limited_apart, t_setup, t_teardown),
		cmocka_unit_test_setup_teardown(test_flush_reports_a_flood_that_stopped, t_setup, t_teardown),
		cmocka_unit_test_setup_teardown(test_levels_filtered_out_cost_no_token, t_setup, t_teardown),
		cmocka_unit_test_setup_teardown(test_threads_share_one_count, t_setup, t_teardown),
		cmocka_unit_test(test_escape_keeps_names_on_one_printable_line),
	};
	return cmocka_run_group_tests(tests, NULL, NULL);
}
