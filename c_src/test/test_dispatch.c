/* test_dispatch: ap_pool_dispatch, the one way from an ingress to a worker's
 * mailbox: routing, the job's bytes and route, overload answered by the
 * route; the handler-time buckets and the count of tells that find no
 * pool. No worker threads: the test is the mailboxes' consumer, and its
 * requests come by a route of its own that records what the core does
 * with it, as an ingress's would carry the answer back. */
#include "t_helpers.h"

#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <unistd.h>

#include "ap_log.h"
#include "pool_int.h"

#define T_WORKERS_MAX 4

typedef struct t_pool {
	ap_pool p;
	ap_worker w[T_WORKERS_MAX];
	int wake_list[T_WORKERS_MAX];
} t_pool;

/* What ap_pool_start sets up for dispatch, without threads or a process. */
static t_pool *t_pool_new(ap_node *n, int workers, ap_routing routing, uint32_t limit)
{
	assert_true(workers <= T_WORKERS_MAX);
	t_pool *t = calloc(1, sizeof *t);
	assert_non_null(t);
	ap_pool *p = &t->p;
	p->n = n;
	p->o.workers = workers;
	p->o.routing = routing;
	p->o.mailbox_limit = limit;
	p->w = t->w;
	p->wake_list = t->wake_list;
	p->rng = 0x5eed5eedull;
	snprintf(p->pid.node, sizeof p->pid.node, "pool@host");
	p->pid.num = 7;
	p->pid.creation = 1;
	for (int i = 0; i < workers; i++) {
		ap_worker *w = &t->w[i];
		w->pool = p;
		w->id = i;
		w->ops = &ap_worker_threads;
		assert_int_equal(ap_mbox_init(&w->mb), 0);
		atomic_store(&w->alive, 1);
	}
	return t;
}

static void t_pool_free(t_pool *t)
{
	for (int i = 0; i < t->p.o.workers; i++) {
		ap_worker *w = &t->w[i];
		ap_mbox_destroy(&w->mb);
		ap_job_free_list(w->job_cache);
	}
	ap_buf_free(&t->p.scratch);
	free(t);
}

/* The test's route: the answers sent by it (the last one's bytes,
 * address and mode) and the holds dropped. */
static struct {
	int sent, dropped;
	ap_send_mode mode;
	uint8_t bytes[256];
	size_t len;
	char addr[64];
} t_log;

static int t_send(const ap_route *r, const char *addr, uint8_t *b, size_t len, unsigned worker, ap_send_mode mode)
{
	(void)r, (void)worker;
	assert_true(len <= sizeof t_log.bytes);
	t_log.sent++;
	t_log.mode = mode;
	memcpy(t_log.bytes, b, len);
	t_log.len = len;
	snprintf(t_log.addr, sizeof t_log.addr, "%s", addr);
	return 0;
}

static void t_drop(const ap_route *r)
{
	(void)r;
	t_log.dropped++;
}

static const char *t_peer(const ap_route *r, const char *addr)
{
	(void)r;
	return addr;
}

static const ap_route_ops t_route = { .send = t_send, .drop = t_drop, .peer = t_peer };
static const ap_route_ops t_route_batched = { .send = t_send, .drop = t_drop, .peer = t_peer, .batched = 1 };

/* An ask by the test's route: its head and address bytes as an ingress
 * would give them (opaque to the core). */
static const char t_head[] = "HEAD:";
static void t_ask(ap_pool *p, uint64_t id, const char *msg, int len)
{
	ap_pool_dispatch(p, &(ap_request){ .kind = AP_REQ_ASK, .route = { &t_route, &t_log, id }, .head = t_head,
					   .head_len = sizeof t_head - 1, .addr = "caller@host",
					   .addr_len = sizeof "caller@host", .msg = msg, .msg_len = len });
}

/* An integer term without its 131 byte. */
static int t_int(char *buf, long v)
{
	int i = 0;
	ei_encode_long(buf, &i, v);
	return i;
}

static void tell(ap_pool *p, const char *msg, int len)
{
	ap_pool_dispatch(p, &(ap_request){ .kind = AP_REQ_TELL, .route = { &t_route, NULL, 0 }, .msg = msg,
					   .msg_len = len });
}

/* The next job of worker w must be the tell of integer v. */
static void expect_tell(ap_worker *w, long v)
{
	char want[16];
	int len = t_int(want, v);
	ap_job *j = ap_mbox_pop(&w->mb);
	assert_non_null(j);
	assert_false(j->is_ask);
	assert_false(j->is_binary);
	assert_null(j->route.ops);
	assert_int_equal(j->head_len, 0);
	assert_int_equal(j->addr_len, 0);
	assert_int_equal(j->msg_len, len + 1);
	assert_int_equal(j->data[0], 131);
	assert_memory_equal(j->data + 1, want, (size_t)len);
	ap_mbox_done(&w->mb);
}

static void test_tells_go_round_robin_in_order(void **state)
{
	(void)state;
	t_pool *t = t_pool_new(NULL, 3, AP_ROUTE_ROUND_ROBIN, 100);
	for (long v = 0; v < 6; v++) {
		char m[16];
		tell(&t->p, m, t_int(m, v));
	}
	/* One wake per worker for the whole batch, however many jobs. */
	assert_int_equal(t->p.nwake, 3);
	ap_pool_wake_pushed(&t->p);
	assert_int_equal(t->p.nwake, 0);
	for (int i = 0; i < 3; i++) {
		assert_int_equal(ap_mbox_depth(&t->w[i].mb), 2);
		assert_false(t->w[i].wake_pending);
		expect_tell(&t->w[i], i);
		expect_tell(&t->w[i], i + 3);
		assert_null(ap_mbox_pop(&t->w[i].mb));
	}
	t_pool_free(t);
}

static void test_a_binary_reaches_the_worker_as_its_bytes(void **state)
{
	(void)state;
	t_pool *t = t_pool_new(NULL, 1, AP_ROUTE_ROUND_ROBIN, 100);
	char m[32];
	int len = 0;
	ei_encode_binary(m, &len, "hello", 5);
	tell(&t->p, m, len);
	ap_job *j = ap_mbox_pop(&t->w[0].mb);
	assert_non_null(j);
	assert_true(j->is_binary);
	assert_int_equal(j->msg_len, 5);
	assert_memory_equal(j->data, "hello", 5);
	ap_mbox_done(&t->w[0].mb);
	t_pool_free(t);
}

/* An ask's job holds its route (with the route's hold: nothing is
 * dropped or sent), then the route's head bytes, the message and the
 * route's address bytes, whatever the route is. */
static void test_an_ask_carries_its_route_head_and_address(void **state)
{
	(void)state;
	memset(&t_log, 0, sizeof t_log);
	t_pool *t = t_pool_new(NULL, 2, AP_ROUTE_ROUND_ROBIN, 100);
	char m[16];
	int len = t_int(m, 99);
	t_ask(&t->p, 77, m, len);
	ap_job *j = ap_mbox_pop(&t->w[0].mb);
	assert_non_null(j);
	assert_true(j->is_ask);
	assert_ptr_equal(j->route.ops, &t_route);
	assert_ptr_equal(j->route.ctx, &t_log);
	assert_int_equal(j->route.id, 77);
	assert_int_equal(j->head_len, sizeof t_head - 1);
	assert_memory_equal(j->data, t_head, sizeof t_head - 1);
	assert_int_equal(j->msg_len, len + 1);
	assert_int_equal(j->data[j->head_len], 131);
	assert_memory_equal(j->data + j->head_len + 1, m, (size_t)len);
	assert_int_equal(j->addr_len, sizeof "caller@host");
	assert_string_equal(ap_job_addr(j), "caller@host");
	assert_int_equal(t_log.sent + t_log.dropped, 0);
	ap_mbox_done(&t->w[0].mb);
	t_pool_free(t);
}

/* Every mailbox full: a tell is counted as dropped; an ask is answered
 * {error, overloaded} by its route, once, from the loop (never waiting),
 * after the route's head, to its address; neither is queued past the
 * limit. */
static void test_full_mailboxes_drop_tells_and_refuse_asks(void **state)
{
	(void)state;
	memset(&t_log, 0, sizeof t_log);
	t_pool *t = t_pool_new(NULL, 2, AP_ROUTE_ROUND_ROBIN, 1);
	char m[16];
	int len = t_int(m, 1);
	tell(&t->p, m, len);
	tell(&t->p, m, len);
	tell(&t->p, m, len);
	assert_int_equal(t->p.dropped_tells, 1);
	assert_int_equal(t_log.sent + t_log.dropped, 0);

	t_ask(&t->p, 5, m, len);
	assert_int_equal(t->p.overloaded, 1);
	assert_int_equal(t->p.dropped_tells, 1);
	assert_int_equal(t_log.sent, 1);
	assert_int_equal(t_log.dropped, 0);
	assert_int_equal(t_log.mode, AP_SEND_LOOP);
	char err[AP_ERROR_TERM_MAX];
	size_t el = ap_enc_error_term(err, "overloaded");
	assert_int_equal(t_log.len, sizeof t_head - 1 + el);
	assert_memory_equal(t_log.bytes, t_head, sizeof t_head - 1);
	assert_memory_equal(t_log.bytes + sizeof t_head - 1, err, el);
	assert_string_equal(t_log.addr, "caller@host");
	for (int i = 0; i < 2; i++)
		assert_int_equal(ap_mbox_depth(&t->w[i].mb), 1);
	ap_pool_wake_pushed(&t->p);
	t_pool_free(t);
}

/* A job moved off a worker (a crashed or stalled one's queue) keeps its
 * route and bytes, and the route's hold with them; one that cannot be
 * moved (no other worker serves) is lost, and its route's hold dropped,
 * once. */
static void test_a_moved_job_keeps_its_route_and_a_lost_one_drops_it(void **state)
{
	(void)state;
	memset(&t_log, 0, sizeof t_log);
	t_pool *t = t_pool_new(NULL, 2, AP_ROUTE_ROUND_ROBIN, 100);
	char m[16];
	int len = t_int(m, 7);
	t_ask(&t->p, 9, m, len);
	ap_job *j = ap_mbox_pop(&t->w[0].mb);
	assert_non_null(j);
	ap_mbox_done(&t->w[0].mb);
	assert_int_equal(ap_pool_move_job(&t->p, &t->w[0], j), 0);
	ap_job *c = ap_mbox_pop(&t->w[1].mb);
	assert_non_null(c);
	assert_true(c->is_ask);
	assert_ptr_equal(c->route.ops, &t_route);
	assert_int_equal(c->route.id, 9);
	assert_int_equal(c->head_len, j->head_len);
	assert_int_equal(c->msg_len, j->msg_len);
	assert_int_equal(c->addr_len, j->addr_len);
	assert_memory_equal(c->data, j->data, (size_t)j->head_len + j->msg_len + j->addr_len);
	ap_mbox_done(&t->w[1].mb);
	assert_int_equal(t_log.sent + t_log.dropped, 0);

	atomic_store(&t->w[0].alive, 0);
	assert_int_equal(ap_pool_move_job(&t->p, &t->w[1], c), -1);
	assert_int_equal(t_log.dropped, 1);
	assert_int_equal(t_log.sent, 0);
	ap_pool_wake_pushed(&t->p);
	t_pool_free(t);
}

/* A kind of worker of the test's own: what dispatch asks of its workers,
 * and room made in a full mailbox by taking its oldest job. */
static struct {
	int wakes, wake_asks, posted, reclaims;
} t_klog;

static void t_kwake(ap_worker *w, int always, int ask)
{
	(void)w, (void)always;
	t_klog.wakes++;
	t_klog.wake_asks += ask;
}

static int t_kpost(ap_worker *w, const char *msg, int len, int is_binary)
{
	(void)w, (void)msg, (void)len, (void)is_binary;
	t_klog.posted++;
	return 1;
}

static void t_kreclaim(ap_worker *w)
{
	t_klog.reclaims++;
	if (ap_mbox_pop(&w->mb))
		ap_mbox_done(&w->mb);
}

static const ap_worker_ops t_kind = { .wake = t_kwake, .post_tell = t_kpost, .reclaim = t_kreclaim };

/* Dispatch reaches a worker through its kind alone: a wake pass rings
 * each worker with jobs once (an ask among them said), a full mailbox
 * asks the kind for room before the message is refused, and only a
 * batched route's tell is offered to the kind without a job. */
static void test_dispatch_reaches_a_worker_only_through_its_kind(void **state)
{
	(void)state;
	memset(&t_klog, 0, sizeof t_klog);
	memset(&t_log, 0, sizeof t_log);
	t_pool *t = t_pool_new(NULL, 1, AP_ROUTE_ROUND_ROBIN, 1);
	ap_worker *w = &t->w[0];
	w->ops = &t_kind;
	char m[16];
	int len = t_int(m, 3);
	tell(&t->p, m, len); /* not batched: a job */
	assert_int_equal(ap_mbox_depth(&w->mb), 1);
	assert_int_equal(t_klog.posted + t_klog.reclaims + t_klog.wakes, 0);
	ap_pool_wake_pushed(&t->p);
	assert_int_equal(t_klog.wakes, 1);
	assert_int_equal(t_klog.wake_asks, 0);

	/* Full: the kind makes room; a batched tell is then the kind's. */
	ap_pool_dispatch(&t->p, &(ap_request){ .kind = AP_REQ_TELL, .route = { &t_route_batched, NULL, 0 },
					       .msg = m, .msg_len = len });
	assert_int_equal(t_klog.reclaims, 1);
	assert_int_equal(t_klog.posted, 1);
	assert_int_equal(ap_mbox_depth(&w->mb), 0);
	assert_int_equal(t->p.dropped_tells, 0);
	ap_pool_wake_pushed(&t->p);
	assert_int_equal(t_klog.wakes, 2);

	/* An ask is a job whatever its route, and its wake says so. */
	ap_pool_dispatch(&t->p, &(ap_request){ .kind = AP_REQ_ASK, .route = { &t_route_batched, &t_log, 1 },
					       .msg = m, .msg_len = len });
	assert_int_equal(t_klog.posted, 1);
	assert_int_equal(ap_mbox_depth(&w->mb), 1);
	ap_pool_wake_pushed(&t->p);
	assert_int_equal(t_klog.wakes, 3);
	assert_int_equal(t_klog.wake_asks, 1);
	assert_int_equal(t_log.sent + t_log.dropped, 0);
	t_pool_free(t);
}

/* With two workers the two slots compared are always both: the lighter
 * one gets the message. */
static void test_smallest_mailbox_sends_to_the_lighter_worker(void **state)
{
	(void)state;
	t_pool *t = t_pool_new(NULL, 2, AP_ROUTE_SMALLEST_MAILBOX, 100);
	char m[16];
	int len = t_int(m, 1);
	for (int k = 0; k < 3; k++) /* all to worker 0 */
		ap_pool_push(&t->w[0], ap_job_alloc(&t->w[0].mb, &t->w[0].job_cache, 8));
	for (int k = 0; k < 3; k++)
		tell(&t->p, m, len);
	assert_int_equal(ap_mbox_depth(&t->w[0].mb), 3);
	assert_int_equal(ap_mbox_depth(&t->w[1].mb), 3);
	ap_pool_wake_pushed(&t->p);
	t_pool_free(t);
}

static void test_a_slot_awaiting_its_replacement_is_skipped(void **state)
{
	(void)state;
	t_pool *t = t_pool_new(NULL, 3, AP_ROUTE_ROUND_ROBIN, 100);
	atomic_store(&t->w[1].alive, 0);
	char m[16];
	for (long v = 0; v < 4; v++)
		tell(&t->p, m, t_int(m, v));
	assert_int_equal(ap_mbox_depth(&t->w[1].mb), 0);
	assert_int_equal(ap_mbox_depth(&t->w[0].mb), 2);
	assert_int_equal(ap_mbox_depth(&t->w[2].mb), 2);
	ap_pool_wake_pushed(&t->p);
	t_pool_free(t);
}

/* The worker's doorbell: a consumer thread sleeping in ap_worker_next_job
 * is woken by every push and wake, none lost, whether the push lands
 * before, during or after it goes to sleep; a stop wakes it for good. */
struct t_consumer {
	ap_worker *w;
	_Atomic int got;
};

static void *t_consume(void *arg)
{
	struct t_consumer *c = arg;
	while (ap_worker_next_job(c->w)) {
		ap_mbox_done(&c->w->mb);
		atomic_fetch_add(&c->got, 1);
	}
	return NULL;
}

static void test_a_sleeping_worker_is_woken_by_every_push(void **state)
{
	(void)state;
	t_pool *t = t_pool_new(NULL, 1, AP_ROUTE_ROUND_ROBIN, 0);
	ap_worker *w = &t->w[0];
	struct t_consumer c = { .w = w };
	pthread_t th;
	assert_int_equal(pthread_create(&th, NULL, t_consume, &c), 0);
	t_rng r;
	t_rng_seed(&r, t_seed("doorbell"));
	enum { N = 3000 };
	for (int i = 0; i < N; i++) {
		ap_job *j = ap_job_alloc(&w->mb, &w->job_cache, 16);
		assert_non_null(j);
		ap_mbox_push(&w->mb, j);
		ap_worker_wake(w, 0, 0);
		/* Mostly let it go to sleep before the next push; sometimes
		 * push into its spin or its way to sleep. */
		if (t_rand32(&r) % 4) {
			int64_t deadline = t_now_ms() + 5000;
			while (atomic_load(&c.got) < i + 1 && t_now_ms() < deadline)
				sched_yield();
			assert_int_equal(atomic_load(&c.got), i + 1);
		}
	}
	int64_t deadline = t_now_ms() + 5000;
	while (atomic_load(&c.got) < N && t_now_ms() < deadline)
		sched_yield();
	assert_int_equal(atomic_load(&c.got), N);
	atomic_store(&w->stop, 1);
	ap_worker_wake(w, 1, 0);
	assert_int_equal(pthread_join(th, NULL), 0);
	t_pool_free(t);
}

/* A duration lands in the first bucket whose bound is at or above it; the
 * sum is the durations' total. */
static void test_a_duration_lands_in_the_first_bucket_at_or_above_it(void **state)
{
	(void)state;
	for (unsigned b = 0; b < AP_HIST_BOUNDS; b++) {
		uint64_t bound = ap_hist_bounds_ns[b];
		assert_int_equal(ap_hist_bucket(bound), b);
		assert_int_equal(ap_hist_bucket(bound + 1), b + 1);
		if (b)
			assert_true(bound > ap_hist_bounds_ns[b - 1]);
	}
	assert_int_equal(ap_hist_bucket(0), 0);
	assert_int_equal(ap_hist_bucket(UINT64_MAX), AP_HIST_BUCKETS - 1);
	ap_hist h = { 0 };
	uint64_t got[AP_HIST_BUCKETS + 1] = { 0 };
	ap_hist_add(&h, 999);
	ap_hist_add(&h, 30000000);
	ap_hist_add_1w(&h, 30000000);
	ap_hist_sum_into(got, &h);
	assert_int_equal(got[0], 1);
	assert_int_equal(got[ap_hist_bucket(30000000)], 2);
	assert_int_equal(got[AP_HIST_BUCKETS], 999 + 2 * 30000000ull);
}

/* The log lines written to fd so far, as raw bytes ({packet,4} frames of
 * {log, Level, Text}: the text is in them as is). */
static size_t t_read_all(int fd, char *buf, size_t cap)
{
	size_t n = 0;
	ssize_t r;
	while (n < cap && (r = read(fd, buf + n, cap - n)) > 0)
		n += (size_t)r;
	return n;
}

static int t_count(const char *buf, size_t len, const char *needle)
{
	int k = 0;
	size_t nl = strlen(needle);
	for (size_t i = 0; i + nl <= len; i++)
		if (!memcmp(buf + i, needle, nl))
			k++;
	return k;
}

/* Tells that find no pool are counted, and each name logged once, however
 * many tells name it; a pid's are logged too (rate-limited, not
 * remembered). */
static void test_tells_to_no_pool_are_counted_and_each_name_logged_once(void **state)
{
	(void)state;
	int fds[2];
	assert_int_equal(pipe(fds), 0);
	assert_int_equal(fcntl(fds[0], F_SETFL, O_NONBLOCK), 0);
	ap_log_set_port_fd(fds[1]);
	uint64_t before = ap_pool_no_pool_tells();
	ap_pool_no_pool("peer@host", "misspelt", 8, NULL, 3);
	ap_pool_no_pool("peer@host", "misspelt_and_more", 8, NULL, 1); /* the same 8 bytes */
	ap_pool_no_pool("peer@host", "other", 5, NULL, 2);
	ap_pool_no_pool("peer@host", "other", 5, NULL, 0);
	erlang_pid pid = { .num = 42, .serial = 3 };
	ap_pool_no_pool("peer@host", NULL, 0, &pid, 1);
	ap_pool_no_pool("peer@host", NULL, 0, NULL, 1); /* the caller logs it */
	assert_int_equal(ap_pool_no_pool_tells() - before, 8);
	ap_log_set_port_fd(-1);
	static char buf[1 << 16];
	size_t n = t_read_all(fds[0], buf, sizeof buf);
	assert_int_equal(t_count(buf, n, "'misspelt'"), 1);
	assert_int_equal(t_count(buf, n, "'other'"), 1);
	assert_int_equal(t_count(buf, n, "pid <42.3>"), 1);
	assert_int_equal(t_count(buf, n, "dropped"), 3);
	close(fds[0]);
	close(fds[1]);
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_tells_go_round_robin_in_order),
		cmocka_unit_test(test_a_binary_reaches_the_worker_as_its_bytes),
		cmocka_unit_test(test_an_ask_carries_its_route_head_and_address),
		cmocka_unit_test(test_full_mailboxes_drop_tells_and_refuse_asks),
		cmocka_unit_test(test_a_moved_job_keeps_its_route_and_a_lost_one_drops_it),
		cmocka_unit_test(test_dispatch_reaches_a_worker_only_through_its_kind),
		cmocka_unit_test(test_smallest_mailbox_sends_to_the_lighter_worker),
		cmocka_unit_test(test_a_slot_awaiting_its_replacement_is_skipped),
		cmocka_unit_test(test_a_sleeping_worker_is_woken_by_every_push),
		cmocka_unit_test(test_a_duration_lands_in_the_first_bucket_at_or_above_it),
		cmocka_unit_test(test_tells_to_no_pool_are_counted_and_each_name_logged_once),
	};
	return cmocka_run_group_tests(tests, NULL, NULL);
}
