/* test_sendq: items from many threads arrive once, in per-producer order, woken by the eventfd. */
#include "t_helpers.h"

#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>

#include "ap_sendq.h"

#define NPROD 4
#define PER_PROD 100000
#define STALL_MS 5000

struct t_payload {
	uint32_t producer;
	uint32_t seq;
	uint64_t check; /* a function of both, so a torn or mixed item shows */
};

static uint64_t t_check(uint32_t p, uint32_t seq) { return ((uint64_t)p << 32 | seq) * 0x9e3779b97f4a7c15ull; }

struct t_run {
	ap_sendq q;
	atomic_int go;
	atomic_int producers_done;
	uint32_t per_prod;
	uint32_t yield_mask; /* producers yield when seq & mask == 0 */
	/* Consumer results, checked on the main thread (cmocka asserts only
	 * work there). */
	char err[256];
	uint32_t next[NPROD];
	uint64_t items, drains, empty_drains, wakeups;
};

struct t_prod {
	struct t_run *run;
	uint32_t id;
	int alloc_failed;
};

static void *t_producer(void *arg)
{
	struct t_prod *p = arg;
	char node[32];
	snprintf(node, sizeof node, "p%u@host", p->id);
	while (!atomic_load(&p->run->go))
		;
	for (uint32_t seq = 0; seq < p->run->per_prod; seq++) {
		/* Lengths vary so the flexible array is exercised, not just a
		 * fixed struct. */
		size_t len = sizeof(struct t_payload) + seq % 7;
		ap_sendq_item *it = ap_sendq_item_new((int)p->id, node, len);
		if (!it) {
			p->alloc_failed = 1;
			break;
		}
		struct t_payload pl = { p->id, seq, t_check(p->id, seq) };
		memcpy(it->data, &pl, sizeof pl);
		memset(it->data + sizeof pl, (int)(seq & 0xff), len - sizeof pl);
		ap_sendq_push(&p->run->q, it);
		if ((seq & p->run->yield_mask) == 0)
			sched_yield(); /* let the queue drain empty now and then */
	}
	atomic_fetch_add(&p->run->producers_done, 1);
	return NULL;
}

static int t_consume(struct t_run *run, ap_sendq_item *it)
{
	struct t_payload pl;
	if (it->kind < 0 || it->kind >= NPROD) {
		snprintf(run->err, sizeof run->err, "item of unknown kind %d", it->kind);
		return -1;
	}
	uint32_t p = (uint32_t)it->kind;
	if (it->len < sizeof pl) {
		snprintf(run->err, sizeof run->err, "item of %u bytes", it->len);
		return -1;
	}
	memcpy(&pl, it->data, sizeof pl);
	char node[32];
	snprintf(node, sizeof node, "p%u@host", p);
	if (pl.producer != p || pl.check != t_check(pl.producer, pl.seq) || strcmp(it->node, node) != 0 ||
	    it->len != sizeof pl + pl.seq % 7) {
		snprintf(run->err, sizeof run->err, "corrupt item: kind %u, producer %u, seq %u, node %.32s", p,
			 pl.producer, pl.seq, it->node);
		return -1;
	}
	for (size_t i = sizeof pl; i < it->len; i++)
		if (it->data[i] != (uint8_t)(pl.seq & 0xff)) {
			snprintf(run->err, sizeof run->err, "corrupt tail in producer %u seq %u", p, pl.seq);
			return -1;
		}
	if (pl.seq != run->next[p]) {
		snprintf(run->err, sizeof run->err, "producer %u: got seq %u, expected %u (%s)", p, pl.seq,
			 run->next[p], pl.seq < run->next[p] ? "duplicate or reordered" : "lost items");
		return -1;
	}
	run->next[p]++;
	run->items++;
	return 0;
}

/* The loop thread's part: sleep in poll() on the eventfd and drain only
 * when it says so, as ap_node does. A push that failed to ring the doorbell
 * shows up as no progress for STALL_MS. */
static void *t_consumer(void *arg)
{
	struct t_run *run = arg;
	int64_t last_progress = t_now_ms();
	while (run->items < (uint64_t)NPROD * run->per_prod) {
		struct pollfd pfd = { .fd = ap_sendq_fd(&run->q), .events = POLLIN };
		int r = poll(&pfd, 1, 100);
		if (r < 0 && errno != EINTR) {
			snprintf(run->err, sizeof run->err, "poll: %s", strerror(errno));
			return NULL;
		}
		if (r > 0 && (pfd.revents & POLLIN)) {
			run->wakeups++;
			ap_sendq_item *it = ap_sendq_drain(&run->q);
			run->drains++;
			if (!it)
				run->empty_drains++;
			while (it) {
				ap_sendq_item *next = it->next;
				int bad = t_consume(run, it);
				free(it);
				if (bad) {
					/* free the rest, then report */
					for (it = next; it; it = next) {
						next = it->next;
						free(it);
					}
					return NULL;
				}
				it = next;
			}
			last_progress = t_now_ms();
			continue;
		}
		if (t_now_ms() - last_progress > STALL_MS) {
			snprintf(run->err, sizeof run->err,
				 "no wakeup for %d ms with %" PRIu64 " of %d items received (%d producers done, "
				 "%zu queued)",
				 STALL_MS, run->items, NPROD * run->per_prod, atomic_load(&run->producers_done),
				 run->q.count);
			return NULL;
		}
	}
	return NULL;
}

static void t_run_producers(uint32_t per_prod, uint32_t yield_mask)
{
	struct t_run *run = calloc(1, sizeof *run);
	assert_non_null(run);
	run->per_prod = per_prod;
	run->yield_mask = yield_mask;
	assert_int_equal(ap_sendq_init(&run->q), 0);
	pthread_t cons, prod[NPROD];
	struct t_prod ps[NPROD];
	assert_int_equal(pthread_create(&cons, NULL, t_consumer, run), 0);
	for (uint32_t i = 0; i < NPROD; i++) {
		ps[i] = (struct t_prod){ .run = run, .id = i };
		assert_int_equal(pthread_create(&prod[i], NULL, t_producer, &ps[i]), 0);
	}
	int64_t t0 = t_now_ms();
	atomic_store(&run->go, 1);
	for (int i = 0; i < NPROD; i++)
		pthread_join(prod[i], NULL);
	pthread_join(cons, NULL);
	int64_t ms = t_now_ms() - t0;

	for (int i = 0; i < NPROD; i++)
		assert_false(ps[i].alloc_failed);
	if (run->err[0])
		fail_msg("%s", run->err);
	for (int i = 0; i < NPROD; i++)
		assert_int_equal(run->next[i], per_prod);
	assert_int_equal(run->items, (uint64_t)NPROD * per_prod);
	/* Nothing left behind, and the doorbell is quiet. */
	assert_null(ap_sendq_drain(&run->q));
	struct pollfd pfd = { .fd = ap_sendq_fd(&run->q), .events = POLLIN };
	assert_int_equal(poll(&pfd, 1, 0), 0);
	print_message("[ info     ] %d items in %" PRId64 " ms: %" PRIu64 " drains (%" PRIu64 " empty)\n",
		      NPROD * per_prod, ms, run->drains, run->empty_drains);
	/* Batching happened: fewer wakeups than items. */
	assert_true(run->drains < run->items);
	ap_sendq_destroy(&run->q);
	free(run);
}

static void test_many_producers_one_consumer_every_item_once_in_order(void **state)
{
	(void)state;
	t_run_producers(PER_PROD, 0x3fff);
}

/* Producers that yield after every push keep the queue near empty, so the
 * empty -> non-empty edge, where a lost wakeup would hide, is crossed
 * thousands of times while the consumer drains. */
static void test_doorbell_edge_crossed_often_never_loses_a_wakeup(void **state)
{
	(void)state;
	t_run_producers(PER_PROD / 4, 0);
}

static int t_readable(int fd)
{
	struct pollfd pfd = { .fd = fd, .events = POLLIN };
	int r = poll(&pfd, 1, 0);
	assert_true(r >= 0);
	return r > 0 && (pfd.revents & POLLIN);
}

static void test_push_into_empty_queue_makes_fd_readable(void **state)
{
	(void)state;
	ap_sendq q;
	assert_int_equal(ap_sendq_init(&q), 0);
	assert_false(t_readable(ap_sendq_fd(&q)));

	ap_sendq_item *a = ap_sendq_item_new(1, "n@h", 3);
	assert_non_null(a);
	memcpy(a->data, "abc", 3);
	ap_sendq_push(&q, a);
	assert_true(t_readable(ap_sendq_fd(&q)));

	/* A second push while items wait keeps it readable. */
	ap_sendq_item *b = ap_sendq_item_new(2, NULL, 0);
	assert_non_null(b);
	ap_sendq_push(&q, b);
	assert_true(t_readable(ap_sendq_fd(&q)));
	assert_int_equal(q.count, 2);

	/* Drain clears the doorbell and hands back both, oldest first. */
	ap_sendq_item *it = ap_sendq_drain(&q);
	assert_false(t_readable(ap_sendq_fd(&q)));
	assert_ptr_equal(it, a);
	assert_int_equal(it->kind, 1);
	assert_int_equal(it->len, 3);
	assert_string_equal(it->node, "n@h");
	assert_memory_equal(it->data, "abc", 3);
	assert_ptr_equal(it->next, b);
	assert_int_equal(b->kind, 2);
	assert_string_equal(b->node, "");
	assert_null(b->next);
	assert_int_equal(q.count, 0);
	free(a);
	free(b);

	/* The next push into the now empty queue rings again. */
	ap_sendq_item *c = ap_sendq_item_new(3, NULL, 0);
	assert_non_null(c);
	ap_sendq_push(&q, c);
	assert_true(t_readable(ap_sendq_fd(&q)));
	it = ap_sendq_drain(&q);
	assert_ptr_equal(it, c);
	free(c);
	ap_sendq_destroy(&q);
}

static void test_drain_of_empty_queue_returns_null(void **state)
{
	(void)state;
	ap_sendq q;
	assert_int_equal(ap_sendq_init(&q), 0);
	assert_null(ap_sendq_drain(&q));
	assert_null(ap_sendq_drain(&q));
	assert_false(t_readable(ap_sendq_fd(&q)));
	ap_sendq_destroy(&q);
}

static void test_destroy_frees_queued_items(void **state)
{
	(void)state;
	/* LeakSanitizer fails the run if these survive destroy. */
	ap_sendq q;
	assert_int_equal(ap_sendq_init(&q), 0);
	for (int i = 0; i < 100; i++) {
		ap_sendq_item *it = ap_sendq_item_new(i, "n@h", 1000);
		assert_non_null(it);
		ap_sendq_push(&q, it);
	}
	assert_int_equal(q.count, 100);
	ap_sendq_destroy(&q);
	assert_int_equal(q.efd, -1);
}

static void test_item_node_is_truncated_and_terminated(void **state)
{
	(void)state;
	char longname[400];
	memset(longname, 'x', sizeof longname - 1);
	longname[sizeof longname - 1] = 0;
	ap_sendq_item *it = ap_sendq_item_new(0, longname, 0);
	assert_non_null(it);
	assert_int_equal(strlen(it->node), sizeof it->node - 1);
	free(it);
	/* A length its 32-bit field could not hold is refused. */
	if (sizeof(size_t) > 4)
		assert_null(ap_sendq_item_new(0, NULL, (size_t)UINT32_MAX + 1));
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_many_producers_one_consumer_every_item_once_in_order),
		cmocka_unit_test(test_doorbell_edge_crossed_often_never_loses_a_wakeup),
		cmocka_unit_test(test_push_into_empty_queue_makes_fd_readable),
		cmocka_unit_test(test_drain_of_empty_queue_returns_null),
		cmocka_unit_test(test_destroy_frees_queued_items),
		cmocka_unit_test(test_item_node_is_truncated_and_terminated),
	};
	return cmocka_run_group_tests(tests, NULL, NULL);
}
