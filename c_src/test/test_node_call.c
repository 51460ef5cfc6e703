/* test_node_call: a call to the loop that must not be lost survives a
 * failed allocation (ap_node_call_on_loop_sure), where the plain call is
 * refused. Allocations fail on request: malloc is wrapped (--wrap=malloc)
 * for this binary's own objects. */
#include "t_helpers.h"

#include "ap_node.h"

void *__real_malloc(size_t size);
void *__wrap_malloc(size_t size);

/* Failures still to hand out, on this thread only: the node's io loop and
 * cmocka (a shared library, not wrapped) allocate as usual. */
static _Thread_local int fail_next;
static _Thread_local int failed;

void *__wrap_malloc(size_t size)
{
	if (fail_next > 0) {
		fail_next--;
		failed++;
		return NULL;
	}
	return __real_malloc(size);
}

static void count_call(ap_node *n, void *arg)
{
	(void)n;
	(*(int *)arg)++;
}

static void a_sure_call_outlasts_failed_allocations(void **state)
{
	(void)state;
	ap_node_cfg cfg = { .node = "t_node_call@localhost", .cookie = "cookie", .creation = 1 };
	ap_node *n = ap_node_new(&cfg);
	assert_non_null(n);
	int ran = 0;

	/* The plain call is refused, and nothing runs for it. */
	fail_next = 1;
	assert_int_equal(ap_node_call_on_loop(n, count_call, &ran), -1);
	ap_node_run_queued(n);
	assert_int_equal(ran, 0);

	/* The sure one waits out three failures and is queued once. */
	fail_next = 3;
	failed = 0;
	int64_t t0 = t_now_ms();
	ap_node_call_on_loop_sure(n, count_call, &ran);
	assert_int_equal(failed, 3);
	assert_int_equal(fail_next, 0);
	/* A millisecond's sleep after each failure but the first. */
	assert_true(t_now_ms() - t0 >= 2);
	ap_node_run_queued(n);
	assert_int_equal(ran, 1);

	/* With memory, it is queued at once. */
	ap_node_call_on_loop_sure(n, count_call, &ran);
	ap_node_run_queued(n);
	assert_int_equal(ran, 2);
	ap_node_free(n);
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(a_sure_call_outlasts_failed_allocations),
	};
	return cmocka_run_group_tests(tests, NULL, NULL);
}
