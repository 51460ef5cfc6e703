/* test_seg: the data plane's segment: geometry, format and parse (hostile
 * headers refused), ring placement, and the segment-wide doorbells between
 * threads and between processes over a sealed memfd. */
#include "t_helpers.h"

#include <pthread.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include "ap_ring.h"
#include "ap_seg.h"

#define T_WAIT_MS 2000

static void *t_seg_mem(size_t size)
{
	void *m = aligned_alloc(4096, (size + 4095) & ~(size_t)4095);
	assert_non_null(m);
	memset(m, 0xee, size);
	return m;
}

static void test_size_limits(void **state)
{
	(void)state;
	assert_int_equal(ap_seg_size(1, 4096, 1, 4096), AP_SEG_HDR_SIZE + 2 * ap_ring_size(4096));
	assert_int_equal(ap_seg_size(0, 4096, 1, 4096), 0);
	assert_int_equal(ap_seg_size(1, 4096, 0, 4096), 0);
	assert_int_equal(ap_seg_size(AP_SEG_MAX_REQ + 1, 4096, 1, 4096), 0);
	assert_int_equal(ap_seg_size(1, 4096, AP_SEG_MAX_REP + 1, 4096), 0);
	assert_int_equal(ap_seg_size(1, 4095, 1, 4096), 0);
	assert_int_equal(ap_seg_size(1, 4096, 1, 32), 0);
	assert_int_equal(ap_seg_size(1, 4096, 1, (uint64_t)AP_RING_MAX_CAP * 2), 0);
	/* 1024 rings of 1 GiB: over the 16 GiB cap. */
	assert_int_equal(ap_seg_size(AP_SEG_MAX_REQ, AP_RING_MAX_CAP, 1, 4096), 0);
}

static void test_format_parse_attach(void **state)
{
	(void)state;
	size_t size = ap_seg_size(3, 1024, 2, 2048);
	uint8_t *m = t_seg_mem(size);
	struct ap_seg s;

	assert_int_equal(ap_seg_parse(&s, m, size), -EINVAL); /* not formatted */
	assert_int_equal(ap_seg_format(m, size - 1, 3, 1024, 2, 2048), -EINVAL);
	assert_int_equal(ap_seg_format(m + 8, size, 3, 1024, 2, 2048), -EINVAL);
	assert_int_equal(ap_seg_format(m, size, 3, 1024, 2, 2048), 0);
	assert_int_equal(ap_seg_parse(&s, m, size), 0);
	assert_int_equal(s.n_req, 3);
	assert_int_equal(s.n_rep, 2);
	assert_int_equal(s.req_cap, 1024);
	assert_int_equal(s.rep_cap, 2048);
	assert_null(ap_seg_req(&s, 3));
	assert_null(ap_seg_rep(&s, 2));
	/* Rings tile the segment after the header, in order, without overlap,
	 * and each side can attach to each of them. */
	uint8_t *expect = m + AP_SEG_HDR_SIZE;
	for (uint32_t i = 0; i < 3; i++, expect += ap_ring_size(1024)) {
		struct ap_ring p, c;
		assert_ptr_equal(ap_seg_req(&s, i), expect);
		assert_int_equal(ap_ring_attach_producer(&p, ap_seg_req(&s, i), ap_seg_req_size(&s)), 0);
		assert_int_equal(ap_ring_attach_consumer(&c, ap_seg_req(&s, i), ap_seg_req_size(&s)), 0);
	}
	for (uint32_t i = 0; i < 2; i++, expect += ap_ring_size(2048)) {
		struct ap_ring p;
		assert_ptr_equal(ap_seg_rep(&s, i), expect);
		assert_int_equal(ap_ring_attach_producer(&p, ap_seg_rep(&s, i), ap_seg_rep_size(&s)), 0);
	}
	assert_ptr_equal(expect, m + size);
	/* A bigger mapping is fine (page rounding); the geometry is the header's. */
	assert_int_equal(ap_seg_parse(&s, m, size + 100), 0);
	assert_int_equal(s.size, size);
	free(m);
}

/* Every header field a hostile peer could change is refused, one at a time. */
static void test_parse_refuses_hostile_headers(void **state)
{
	(void)state;
	size_t size = ap_seg_size(2, 1024, 1, 1024);
	uint8_t *m = t_seg_mem(size);
	struct ap_seg_hdr *h = (struct ap_seg_hdr *)m;
	struct ap_seg s;
	static const char *const cases[] = { "magic", "version", "hdr_size", "total_size small", "total_size big",
					      "n_req 0", "n_req huge", "n_rep over size", "req_cap odd", "rep_cap huge" };
	for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
		assert_int_equal(ap_seg_format(m, size, 2, 1024, 1, 1024), 0);
		switch (k) {
		case 0: h->magic ^= 1; break;
		case 1: h->version = AP_SEG_VERSION + 1; break;
		case 2: h->hdr_size = 128; break;
		case 3: h->total_size = size - 8; break;
		case 4: h->total_size = size + 4096; break;
		case 5: h->n_req = 0; break;
		case 6: h->n_req = 0xffffffffu; break;
		case 7: h->n_rep = 2; h->total_size = ap_seg_size(2, 1024, 2, 1024); break;
		case 8: h->req_cap = 1000; break;
		case 9: h->rep_cap = 1ULL << 40; break;
		}
		print_message("[ hostile  ] %s\n", cases[k]);
		assert_int_equal(ap_seg_parse(&s, m, size), -EINVAL);
		assert_null(ap_seg_req(&s, 0));
	}
	assert_int_equal(ap_seg_parse(&s, m, AP_SEG_HDR_SIZE - 1), -EINVAL);
	assert_int_equal(ap_seg_parse(&s, m + 8, size), -EINVAL);
	free(m);
}

/* ---- doorbells ---------------------------------------------------------------- */

struct t_bell {
	struct ap_seg seg;
	struct ap_ring prod[2], cons[2];
	pthread_t th;
	int rc, got;
	int64_t waited_ms;
	int spin, timeout_ms;
};

static int t_any_readable(void *arg)
{
	struct t_bell *t = arg;
	return ap_ring_readable(&t->cons[0]) > 0 || ap_ring_readable(&t->cons[1]) > 0;
}

static void *t_waiter(void *arg)
{
	struct t_bell *t = arg;
	int64_t t0 = t_now_ms();
	t->rc = ap_seg_wait(t->seg.hdr, AP_SEG_BELL_REQ, t_any_readable, t, (unsigned)t->spin, t->timeout_ms);
	t->waited_ms = t_now_ms() - t0;
	t->got = t_any_readable(t);
	return NULL;
}

static struct t_bell *t_bell_new(uint8_t **mem)
{
	size_t size = ap_seg_size(2, 1024, 1, 1024);
	struct t_bell *t = calloc(1, sizeof *t);
	*mem = t_seg_mem(size);
	assert_int_equal(ap_seg_format(*mem, size, 2, 1024, 1, 1024), 0);
	assert_int_equal(ap_seg_parse(&t->seg, *mem, size), 0);
	for (int i = 0; i < 2; i++) {
		assert_int_equal(ap_ring_attach_producer(&t->prod[i], ap_seg_req(&t->seg, i), ap_seg_req_size(&t->seg)), 0);
		assert_int_equal(ap_ring_attach_consumer(&t->cons[i], ap_seg_req(&t->seg, i), ap_seg_req_size(&t->seg)), 0);
	}
	return t;
}

/* Poll-with-deadline until the waiter has raised its flag (it is asleep or
 * about to be), so the notify below has a sleeper to wake. */
static void t_until_sleeping(struct t_bell *t)
{
	int64_t end = t_now_ms() + T_WAIT_MS;
	while (!__atomic_load_n(&t->seg.hdr->req_sleeping, __ATOMIC_ACQUIRE)) {
		assert_true(t_now_ms() < end);
		usleep(100);
	}
}

static void t_put(struct ap_ring *r)
{
	void *p;
	assert_int_equal(ap_ring_reserve(r, 16, &p), 0);
	memset(p, 7, 16);
	assert_int_equal(ap_ring_publish(r), 0);
}

/* A sleeper on the segment's bell is woken by a publish into ANY of its
 * rings plus one notify, and a notify with nobody asleep costs no wake. */
static void test_bell_wakes_sleeper_on_any_ring(void **state)
{
	(void)state;
	for (int ring = 0; ring < 2; ring++) {
		uint8_t *m;
		struct t_bell *t = t_bell_new(&m);
		t->timeout_ms = 5000;
		assert_int_equal(pthread_create(&t->th, NULL, t_waiter, t), 0);
		t_until_sleeping(t);
		t_put(&t->prod[ring]);
		assert_int_equal(ap_seg_notify(t->seg.hdr, AP_SEG_BELL_REQ), 1);
		pthread_join(t->th, NULL);
		assert_int_equal(t->rc, 0);
		assert_true(t->got);
		assert_true(t->waited_ms < 5000);
		/* Nobody sleeps now: a notify takes no syscall, returns 0. */
		t_put(&t->prod[ring]);
		assert_int_equal(ap_seg_notify(t->seg.hdr, AP_SEG_BELL_REQ), 0);
		free(t);
		free(m);
	}
}

/* No data: the wait ends by its timeout; a peer that rings the bell
 * without publishing (hostile, or a stray kick) cannot extend it. */
static void test_bell_timeout_bounded_under_stray_rings(void **state)
{
	(void)state;
	uint8_t *m;
	struct t_bell *t = t_bell_new(&m);
	t->timeout_ms = 200;
	assert_int_equal(pthread_create(&t->th, NULL, t_waiter, t), 0);
	int64_t end = t_now_ms() + 600;
	while (t_now_ms() < end) {
		/* What a hostile producer can do: raise the bell whenever. */
		__atomic_fetch_add(&t->seg.hdr->req_bell, 1, __ATOMIC_RELEASE);
		ap_ring_futex_wake(&t->seg.hdr->req_bell, 1);
		usleep(1000);
	}
	pthread_join(t->th, NULL);
	assert_int_equal(t->rc, -ETIMEDOUT);
	assert_false(t->got);
	assert_in_range(t->waited_ms, 190, 500);
	free(t);
	free(m);
}

/* ap_seg_close wakes a sleeper at once, and the closed bits say who left. */
static void test_close_ends_wait(void **state)
{
	(void)state;
	uint8_t *m;
	struct t_bell *t = t_bell_new(&m);
	t->timeout_ms = 10000;
	assert_int_equal(pthread_create(&t->th, NULL, t_waiter, t), 0);
	t_until_sleeping(t);
	assert_int_equal(ap_seg_closed(t->seg.hdr), 0);
	ap_seg_close(t->seg.hdr, AP_SEG_CLOSED_NODE);
	pthread_join(t->th, NULL);
	assert_int_equal(t->rc, 0);
	assert_false(t->got);
	assert_true(t->waited_ms < 5000);
	assert_int_equal(ap_seg_closed(t->seg.hdr), AP_SEG_CLOSED_NODE);
	ap_seg_close(t->seg.hdr, AP_SEG_CLOSED_BEAM);
	assert_int_equal(ap_seg_closed(t->seg.hdr), AP_SEG_CLOSED_NODE | AP_SEG_CLOSED_BEAM);
	free(t);
	free(m);
}

/* Two processes over a sealed memfd: the child produces N records spread
 * over both request rings with a notify each; the parent sleeps on the
 * segment bell between drains and gets them all, in order per ring. */
static void test_bell_across_processes(void **state)
{
	(void)state;
	enum { N = 20000 };
	struct ap_ring_map map;
	size_t size = ap_seg_size(2, 4096, 1, 4096);
	assert_int_equal(ap_ring_map_create_memfd(&map, "test_seg", size), 0);
	assert_int_equal(ap_seg_format(map.mem, map.size, 2, 4096, 1, 4096), 0);

	pid_t child = fork();
	assert_true(child >= 0);
	if (child == 0) {
		struct ap_seg s;
		struct ap_ring p[2];
		if (ap_seg_parse(&s, map.mem, map.size))
			_exit(2);
		for (int i = 0; i < 2; i++)
			if (ap_ring_attach_producer(&p[i], ap_seg_req(&s, i), ap_seg_req_size(&s)))
				_exit(3);
		for (uint64_t k = 0; k < N; k++) {
			struct ap_ring *r = &p[k % 3 == 0];
			void *q;
			int rc;
			while ((rc = ap_ring_reserve(r, sizeof k, &q)) == -EAGAIN)
				if (ap_ring_wait_space(r, sizeof k, 50, T_WAIT_MS))
					_exit(4);
			if (rc)
				_exit(5);
			memcpy(q, &k, sizeof k);
			if (ap_ring_publish(r))
				_exit(6);
			ap_seg_notify(s.hdr, AP_SEG_BELL_REQ);
		}
		_exit(0);
	}
	struct t_bell t = { 0 };
	assert_int_equal(ap_seg_parse(&t.seg, map.mem, map.size), 0);
	for (int i = 0; i < 2; i++)
		assert_int_equal(ap_ring_attach_consumer(&t.cons[i], ap_seg_req(&t.seg, i), ap_seg_req_size(&t.seg)), 0);
	uint64_t got = 0, last[2] = { UINT64_MAX, UINT64_MAX };
	int64_t end = t_now_ms() + 20000;
	while (got < N) {
		assert_true(t_now_ms() < end);
		int rc = ap_seg_wait(t.seg.hdr, AP_SEG_BELL_REQ, t_any_readable, &t, 50, T_WAIT_MS);
		assert_int_equal(rc, 0);
		for (int i = 0; i < 2; i++) {
			const void *q;
			size_t len;
			while ((rc = ap_ring_read(&t.cons[i], &q, &len)) == 0) {
				uint64_t k;
				assert_int_equal(len, sizeof k);
				memcpy(&k, q, sizeof k);
				assert_int_equal((k % 3 == 0), i);
				assert_true(last[i] == UINT64_MAX || k > last[i]);
				last[i] = k;
				got++;
			}
			assert_int_equal(rc, -EAGAIN);
			ap_ring_release(&t.cons[i]);
		}
	}
	int status;
	assert_int_equal(waitpid(child, &status, 0), child);
	assert_true(WIFEXITED(status));
	assert_int_equal(WEXITSTATUS(status), 0);
	assert_int_equal(got, N);
	ap_ring_map_close(&map);
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_size_limits),
		cmocka_unit_test(test_format_parse_attach),
		cmocka_unit_test(test_parse_refuses_hostile_headers),
		cmocka_unit_test(test_bell_wakes_sleeper_on_any_ring),
		cmocka_unit_test(test_bell_timeout_bounded_under_stray_rings),
		cmocka_unit_test(test_close_ends_wait),
		cmocka_unit_test(test_bell_across_processes),
	};
	return cmocka_run_group_tests(tests, NULL, NULL);
}
