/* test_ring: the shared-memory record ring: two threads and two processes
 * through it, wrap-around, full and empty, batching and doorbells, a writer
 * killed mid-write, hostile indexes and records, segments, and the io_uring
 * futex wait. */
#include "t_helpers.h"
#include "t_tmpfs.h"

#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/mount.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/utsname.h>
#include <sys/wait.h>
#include <unistd.h>

#include "ap_ring.h"
#include "ap_ring_uring.h"

#define T_SPIN AP_RING_DEFAULT_SPIN
#define T_WAIT_MS 2000

/* Checks in a forked child: exit with the line that failed. */
/* ---- helpers ---------------------------------------------------------------- */

/* A formatted ring in exact-size heap memory (ASan sees any overrun). */
static void *t_ring_mem(size_t cap)
{
	void *m = aligned_alloc(64, ap_ring_size(cap));
	assert_non_null(m);
	memset(m, 0xee, ap_ring_size(cap));
	assert_int_equal(ap_ring_format(m, ap_ring_size(cap), cap), 0);
	return m;
}

/* Record k's payload: its bytes depend on k and their offset, so a lost,
 * repeated, torn or misplaced record shows. */
static void t_fill(uint8_t *p, size_t n, uint64_t k)
{
	for (size_t i = 0; i < n; i++)
		p[i] = (uint8_t)(k * 131 + i * 7 + (k >> 8));
}

static int t_check_rec(const uint8_t *p, size_t n, uint64_t k)
{
	for (size_t i = 0; i < n; i++)
		if (p[i] != (uint8_t)(k * 131 + i * 7 + (k >> 8)))
			return 0;
	return 1;
}

static uint64_t t_sum(uint64_t sum, const uint8_t *p, size_t n)
{
	for (size_t i = 0; i < n; i++)
		sum = (sum ^ p[i]) * 0x100000001b3ull;
	return sum;
}

/* Reserve + fill + commit one record, waiting for room if needed. */
static int t_put(struct ap_ring *r, size_t len, uint64_t k)
{
	void *p;
	int rc;

	while ((rc = ap_ring_reserve(r, len, &p)) == -EAGAIN) {
		rc = ap_ring_wait_space(r, len, T_SPIN, T_WAIT_MS);
		if (rc)
			return rc;
	}
	if (rc)
		return rc;
	t_fill(p, len, k);
	rc = ap_ring_commit(r);
	return rc < 0 ? rc : 0; /* 1: it woke the consumer */
}

static uint64_t *t_word(void *mem, size_t cap, uint64_t idx)
{
	return (uint64_t *)((uint8_t *)mem + AP_RING_HDR_SIZE + (idx & (cap - 1)));
}

/* A record header word as the producer of the ring at mem writes it at
 * index idx (the ring's nonce is in its line 0). */
static uint64_t t_rec_word(const void *mem, uint32_t kind, uint64_t idx, uint32_t len)
{
	return (uint64_t)ap_ring_stamp(((const struct ap_ring_hdr *)mem)->nonce, kind, idx) << 32 | len;
}

/* ---- format and attach ---------------------------------------------------- */

/* A fresh ring of cap bytes, formatted, with a producer and a consumer
 * attached; free() the returned memory. */
static void *t_pair(size_t cap, struct ap_ring *p, struct ap_ring *c)
{
	void *m = t_ring_mem(cap);
	assert_int_equal(ap_ring_attach_producer(p, m, ap_ring_size(cap)), 0);
	assert_int_equal(ap_ring_attach_consumer(c, m, ap_ring_size(cap)), 0);
	return m;
}

static void test_format_and_attach_reject_what_is_not_a_ring(void **state)
{
	(void)state;
	size_t cap = 4096;
	uint8_t *m = aligned_alloc(64, ap_ring_size(cap) + 64);
	struct ap_ring r;
	struct ap_ring_hdr *h = (struct ap_ring_hdr *)m;

	assert_non_null(m);
	assert_int_equal(ap_ring_format(m, ap_ring_size(cap), 3000), -EINVAL);          /* not a power of two */
	assert_int_equal(ap_ring_format(m, ap_ring_size(cap), 32), -EINVAL);            /* below the minimum */
	assert_int_equal(ap_ring_format(m, ap_ring_size(cap) - 1, cap), -EINVAL);       /* memory too small */
	assert_int_equal(ap_ring_format(m + 4, ap_ring_size(cap), cap), -EINVAL);       /* misaligned */
	assert_int_equal(ap_ring_format(NULL, ap_ring_size(cap), cap), -EINVAL);
	assert_int_equal(ap_ring_format(m, ap_ring_size(cap), cap), 0);
	assert_int_equal(ap_ring_attach_consumer(&r, m, ap_ring_size(cap)), 0);
	assert_int_equal(ap_ring_attach_producer(&r, m, ap_ring_size(cap)), 0);
	assert_int_equal(ap_ring_attach_consumer(&r, m, ap_ring_size(cap) - 8), -EINVAL); /* cap past the mapping */
	assert_int_equal(ap_ring_attach_consumer(&r, m, 100), -EINVAL);

	h->version = AP_RING_VERSION + 1;
	assert_int_equal(ap_ring_attach_consumer(&r, m, ap_ring_size(cap)), -EINVAL);
	h->version = AP_RING_VERSION;
	h->cap = 4000;
	assert_int_equal(ap_ring_attach_consumer(&r, m, ap_ring_size(cap)), -EINVAL);
	h->cap = 1u << 31;
	assert_int_equal(ap_ring_attach_producer(&r, m, ap_ring_size(cap)), -EINVAL);
	h->cap = cap;
	h->magic ^= 1;
	assert_int_equal(ap_ring_attach_producer(&r, m, ap_ring_size(cap)), -EINVAL);
	h->magic ^= 1;
	h->head = 16;
	h->tail = 8;
	assert_int_equal(ap_ring_attach_consumer(&r, m, ap_ring_size(cap)), -EPROTO);
	h->head = 0;
	h->tail = cap + 8;
	assert_int_equal(ap_ring_attach_producer(&r, m, ap_ring_size(cap)), -EPROTO);
	h->tail = 4;
	assert_int_equal(ap_ring_attach_consumer(&r, m, ap_ring_size(cap)), -EPROTO);
	/* Indexes near 2^64 would overflow the producer's arithmetic. */
	h->head = h->tail = UINT64_MAX - 7;
	assert_int_equal(ap_ring_attach_producer(&r, m, ap_ring_size(cap)), -EPROTO);
	assert_int_equal(ap_ring_attach_consumer(&r, m, ap_ring_size(cap)), -EPROTO);
	h->head = h->tail = AP_RING_MAX_INDEX;
	assert_int_equal(ap_ring_attach_producer(&r, m, ap_ring_size(cap)), 0);
	h->head = h->tail = 0;
	assert_int_equal(ap_ring_attach_consumer(&r, m, ap_ring_size(cap)), 0);
	free(m);
}

/* ---- two threads ------------------------------------------------------------ */

#define T_THREAD_RECS 2000000u
#define T_THREAD_MAXLEN 120u
#define T_THREAD_CAP 65536u

struct t_pc {
	void *mem;
	uint64_t seed;
	uint64_t sum;
	int rc;
};

static void *t_producer_thread(void *arg)
{
	struct t_pc *pc = arg;
	struct ap_ring r;
	t_rng rng;
	uint64_t k = 0;

	t_rng_seed(&rng, pc->seed);
	pc->rc = ap_ring_attach_producer(&r, pc->mem, ap_ring_size(T_THREAD_CAP));
	while (!pc->rc && k < T_THREAD_RECS) {
		/* A batch of 1..8 records, one commit and at most one wake. */
		size_t batch = t_rand_range(&rng, 1, 8);
		for (size_t b = 0; b < batch && k < T_THREAD_RECS && !pc->rc; b++, k++) {
			size_t len = t_rand_range(&rng, 0, T_THREAD_MAXLEN);
			void *p;
			int rc;
			while ((rc = ap_ring_reserve(&r, len, &p)) == -EAGAIN) {
				if ((rc = ap_ring_commit(&r)) < 0 ||
				    (rc = ap_ring_wait_space(&r, len, T_SPIN, T_WAIT_MS)))
					break;
			}
			if (rc) {
				pc->rc = rc;
				break;
			}
			t_fill(p, len, k);
			pc->sum = t_sum(pc->sum, p, len);
		}
		if (!pc->rc && ap_ring_commit(&r) < 0)
			pc->rc = -EPROTO;
	}
	return NULL;
}

/* The producer's lengths, replayed: a batch size, then that many lengths. */
struct t_lens {
	t_rng rng;
	size_t left;
};

static size_t t_next_len(struct t_lens *l)
{
	if (!l->left)
		l->left = t_rand_range(&l->rng, 1, 8);
	l->left--;
	return t_rand_range(&l->rng, 0, T_THREAD_MAXLEN);
}

static void test_two_threads_pass_millions_of_random_records_in_order(void **state)
{
	(void)state;
	struct t_pc pc = { .mem = t_ring_mem(T_THREAD_CAP), .seed = t_seed("two threads") };
	struct t_lens lens = { .left = 0 };
	struct ap_ring r;
	pthread_t th;
	uint64_t k = 0, sum = 0;
	const void *p;
	size_t len;

	t_rng_seed(&lens.rng, pc.seed);
	assert_int_equal(ap_ring_attach_consumer(&r, pc.mem, ap_ring_size(T_THREAD_CAP)), 0);
	assert_int_equal(pthread_create(&th, NULL, t_producer_thread, &pc), 0);
	while (k < T_THREAD_RECS) {
		int rc = ap_ring_read(&r, &p, &len);
		if (rc == -EAGAIN) {
			ap_ring_release(&r);
			rc = ap_ring_wait(&r, T_SPIN, T_WAIT_MS);
			assert_int_equal(rc, 0);
			continue;
		}
		assert_int_equal(rc, 0);
		size_t want = t_next_len(&lens);
		if (len != want)
			fail_msg("record %" PRIu64 " has length %zu, sent %zu", k, len, want);
		assert_true((const uint8_t *)p + len <= r.data + r.cap);
		if (!t_check_rec(p, len, k))
			fail_msg("record %" PRIu64 " (len %zu) is not its bytes", k, len);
		sum = t_sum(sum, p, len);
		k++;
		if (k % 64 == 0)
			ap_ring_release(&r);
	}
	ap_ring_release(&r);
	assert_int_equal(pthread_join(th, NULL), 0);
	assert_int_equal(pc.rc, 0);
	assert_true(sum == pc.sum);
	/* Nothing more than what was sent. */
	assert_int_equal(ap_ring_read(&r, &p, &len), -EAGAIN);
	print_message("[ info     ] consumer futex waits %" PRIu64 ", wakes %" PRIu64 "\n", r.n_sleep, r.n_wake);
	free(pc.mem);
}

/* ---- wrap-around, full, empty ------------------------------------------------- */

static void test_wrap_around_writes_a_pad_and_records_stay_contiguous(void **state)
{
	(void)state;
	size_t cap = 256;
	struct ap_ring p, c;
	const void *rp;
	size_t len;
	void *wp;

	void *m = t_pair(cap, &p, &c);
	/* 40-byte payloads take 48 bytes: five fill 240, the sixth does not
	 * fit in the last 16 and goes to offset 0 behind a pad. */
	for (uint64_t k = 0; k < 5; k++) {
		assert_int_equal(t_put(&p, 40, k), 0);
		assert_int_equal(ap_ring_read(&c, &rp, &len), 0);
		assert_true(len == 40 && t_check_rec(rp, len, k));
		ap_ring_release(&c);
	}
	assert_int_equal(ap_ring_reserve(&p, 40, &wp), 0);
	assert_ptr_equal(wp, p.data + AP_RING_REC_HDR);
	assert_true(*t_word(m, cap, 240) == t_rec_word(m, AP_RING_STAMP_PAD, 240, 8));
	t_fill(wp, 40, 5);
	/* Not visible before the commit, pad included. */
	assert_int_equal(ap_ring_read(&c, &rp, &len), -EAGAIN);
	assert_int_equal(ap_ring_commit(&p), 0);
	assert_int_equal(ap_ring_read(&c, &rp, &len), 0);
	assert_ptr_equal(rp, c.data + AP_RING_REC_HDR);
	assert_true(len == 40 && t_check_rec(rp, len, 5));
	ap_ring_release(&c);
	assert_true(c.head == 256 + 48);

	/* Random sizes up to the maximum over hundreds of laps. */
	t_rng rng;
	t_rng_seed(&rng, t_seed("wrap"));
	for (uint64_t k = 6; k < 20000; k++) {
		size_t l = t_rand_range(&rng, 0, ap_ring_max_payload(cap));
		assert_int_equal(t_put(&p, l, k), 0);
		assert_int_equal(ap_ring_read(&c, &rp, &len), 0);
		assert_true(len == l);
		assert_true((const uint8_t *)rp >= c.data && (const uint8_t *)rp + len <= c.data + cap);
		assert_true(t_check_rec(rp, len, k));
		ap_ring_release(&c);
	}
	assert_true(c.head > 100 * cap);
	assert_int_equal(ap_ring_read(&c, &rp, &len), -EAGAIN);
	free(m);
}

static void test_full_and_empty(void **state)
{
	(void)state;
	size_t cap = 4096;
	struct ap_ring p, c;
	const void *rp;
	size_t len;
	void *wp;

	void *m = t_pair(cap, &p, &c);
	assert_int_equal(ap_ring_read(&c, &rp, &len), -EAGAIN);
	assert_int_equal(ap_ring_readable(&c), 0);
	assert_int_equal(ap_ring_wait(&c, 10, 0), -ETIMEDOUT);

	/* 56-byte payloads take 64 bytes: exactly 64 fit. */
	for (uint64_t k = 0; k < 64; k++) {
		assert_int_equal(ap_ring_reserve(&p, 56, &wp), 0);
		t_fill(wp, 56, k);
	}
	assert_int_equal(ap_ring_reserve(&p, 0, &wp), -EAGAIN);
	assert_int_equal(ap_ring_has_room(&p, 0), 0);
	assert_int_equal(ap_ring_commit(&p), 0);
	assert_int_equal(ap_ring_wait_space(&p, 0, 10, 0), -ETIMEDOUT);
	/* Reading does not free: only release does. */
	assert_int_equal(ap_ring_read(&c, &rp, &len), 0);
	assert_true(len == 56 && t_check_rec(rp, len, 0));
	assert_int_equal(ap_ring_reserve(&p, 0, &wp), -EAGAIN);
	ap_ring_release(&c);
	assert_int_equal(ap_ring_has_room(&p, 56), 1);
	assert_int_equal(ap_ring_reserve(&p, 57, &wp), -EAGAIN); /* 72 bytes > the 64 freed */
	assert_int_equal(ap_ring_reserve(&p, 56, &wp), 0);
	t_fill(wp, 56, 64);
	assert_int_equal(ap_ring_commit(&p), 0);
	for (uint64_t k = 1; k <= 64; k++) {
		assert_int_equal(ap_ring_read(&c, &rp, &len), 0);
		assert_true(len == 56 && t_check_rec(rp, len, k));
	}
	assert_int_equal(ap_ring_read(&c, &rp, &len), -EAGAIN);
	ap_ring_release(&c);

	/* Sizes: over the maximum is refused; zero-length records exist. */
	assert_int_equal(ap_ring_reserve(&p, ap_ring_max_payload(cap) + 1, &wp), -EMSGSIZE);
	assert_null(wp);
	assert_int_equal(ap_ring_reserve(&p, 0, &wp), 0);
	assert_int_equal(ap_ring_commit(&p), 0);
	assert_int_equal(ap_ring_read(&c, &rp, &len), 0);
	assert_int_equal(len, 0);
	ap_ring_release(&c);
	free(m);

	/* An empty ring takes a record of the maximum size wherever its
	 * indexes stand. */
	cap = 256;
	m = t_ring_mem(cap);
	for (size_t at = 0; at < cap; at += 8) {
		assert_int_equal(ap_ring_format(m, ap_ring_size(cap), cap), 0);
		assert_int_equal(ap_ring_attach_producer(&p, m, ap_ring_size(cap)), 0);
		assert_int_equal(ap_ring_attach_consumer(&c, m, ap_ring_size(cap)), 0);
		/* Empty records (8 bytes each) move the indexes to `at`. */
		for (size_t i = 0; i < at / 8; i++) {
			assert_int_equal(t_put(&p, 0, 1), 0);
			assert_int_equal(ap_ring_read(&c, &rp, &len), 0);
			ap_ring_release(&c);
		}
		assert_true(c.head == at);
		assert_int_equal(ap_ring_reserve(&p, ap_ring_max_payload(cap), &wp), 0);
		t_fill(wp, ap_ring_max_payload(cap), 2);
		assert_int_equal(ap_ring_commit(&p), 0);
		assert_int_equal(ap_ring_read(&c, &rp, &len), 0);
		assert_true(len == ap_ring_max_payload(cap) && t_check_rec(rp, len, 2));
		ap_ring_release(&c);
	}
	free(m);
}

/* ---- batching and doorbells ------------------------------------------------------ */

static void test_batch_commit_publishes_all_and_rings_once(void **state)
{
	(void)state;
	size_t cap = 32768;
	struct ap_ring p, c;
	const void *rp;
	size_t len;
	void *wp;
	uint32_t *word, expected;

	void *m = t_pair(cap, &p, &c);
	struct ap_ring_hdr *h = m;
	/* The consumer is about to sleep (its flag is up). */
	assert_int_equal(ap_ring_prepare_sleep(&c, 0, &word, &expected), 1);
	assert_ptr_equal(word, &h->data_bell);
	for (uint64_t k = 0; k < 10; k++) {
		assert_int_equal(ap_ring_reserve(&p, 100, &wp), 0);
		t_fill(wp, 100, k);
	}
	assert_int_equal(ap_ring_readable(&c), 0);
	assert_int_equal(ap_ring_commit(&p), 1); /* 1: it had to wake the consumer */
	assert_true(p.n_wake == 1);
	assert_true(h->data_bell == expected + 1);
	/* More commits before the sleeper is up: it is already being woken,
	 * so they cost no syscall (the waker takes the flag down). */
	for (uint64_t k = 10; k < 109; k++)
		assert_int_equal(t_put(&p, 100, k), 0);
	assert_int_equal(ap_ring_reserve(&p, 100, &wp), 0);
	t_fill(wp, 100, 109);
	assert_int_equal(ap_ring_commit(&p), 0); /* 0: no wake needed */
	assert_true(p.n_wake == 1);
	assert_true(h->data_bell == expected + 1);
	/* Its futex wait would return at once: the bell moved. */
	assert_int_equal(ap_ring_futex_wait(word, expected, 1000), 0);
	ap_ring_end_sleep(&c);
	for (uint64_t k = 0; k < 110; k++) {
		assert_int_equal(ap_ring_read(&c, &rp, &len), 0);
		assert_true(len == 100 && t_check_rec(rp, len, k));
	}
	assert_int_equal(ap_ring_read(&c, &rp, &len), -EAGAIN);
	ap_ring_release(&c);
	/* A consumer that is not asleep costs the producer no syscall. */
	for (uint64_t k = 0; k < 1000; k++) {
		assert_int_equal(t_put(&p, 20, k), 0);
		assert_int_equal(ap_ring_read(&c, &rp, &len), 0);
		ap_ring_release(&c);
	}
	assert_true(p.n_wake == 1);
	assert_true(c.n_wake == 0);
	/* A ring with data is no reason to sleep. */
	assert_int_equal(t_put(&p, 20, 0), 0);
	assert_int_equal(ap_ring_prepare_sleep(&c, 0, &word, &expected), 0);
	assert_int_equal(h->cons_waiting, 0);
	/* A full ring: the producer may sleep, and the consumer's release
	 * rings its bell once. */
	while (ap_ring_reserve(&p, 1000, &wp) == 0)
		;
	assert_int_equal(ap_ring_commit(&p), 0);
	assert_int_equal(ap_ring_prepare_sleep(&p, 1000, &word, &expected), 1);
	assert_ptr_equal(word, &h->space_bell);
	assert_int_equal(ap_ring_read(&c, &rp, &len), 0);
	assert_int_equal(ap_ring_read(&c, &rp, &len), 0);
	ap_ring_release(&c);
	assert_true(c.n_wake == 1 && h->space_bell == expected + 1);
	ap_ring_end_sleep(&p);
	assert_int_equal(h->prod_waiting, 0);
	free(m);
}

static void test_abort_drops_uncommitted_reservations(void **state)
{
	(void)state;
	size_t cap = 1024;
	struct ap_ring p, c;
	const void *rp;
	size_t len;
	void *wp;

	void *m = t_pair(cap, &p, &c);
	assert_int_equal(t_put(&p, 10, 1), 0);
	assert_int_equal(ap_ring_reserve(&p, 30, &wp), 0);
	memset(wp, 0x55, 30);
	ap_ring_abort(&p);
	assert_int_equal(ap_ring_commit(&p), 0);
	assert_int_equal(t_put(&p, 12, 2), 0);
	assert_int_equal(ap_ring_read(&c, &rp, &len), 0);
	assert_true(len == 10 && t_check_rec(rp, len, 1));
	assert_int_equal(ap_ring_read(&c, &rp, &len), 0);
	assert_true(len == 12 && t_check_rec(rp, len, 2));
	assert_int_equal(ap_ring_read(&c, &rp, &len), -EAGAIN);
	free(m);
}

/* ---- wake-ups ------------------------------------------------------------------ */

struct t_waiter {
	struct ap_ring r;
	int rc;
	int64_t ms;
};

static void *t_wait_thread(void *arg)
{
	struct t_waiter *w = arg;
	int64_t t0 = t_now_ms();
	w->rc = ap_ring_wait(&w->r, 0, 10000);
	w->ms = t_now_ms() - t0;
	return NULL;
}

/* Polls `word` until it is non-zero, or fails at the deadline. */
static void t_until_set(const uint32_t *word, int ms)
{
	int64_t end = t_now_ms() + ms;
	while (!__atomic_load_n(word, __ATOMIC_ACQUIRE)) {
		if (t_now_ms() > end)
			fail_msg("flag not set within %d ms", ms);
		poll(NULL, 0, 1);
	}
}

static void test_wait_times_out_and_wake_ends_a_sleep(void **state)
{
	(void)state;
	size_t cap = 1024;
	void *m = t_ring_mem(cap);
	struct ap_ring_hdr *h = m;
	struct t_waiter w;
	struct ap_ring p;
	pthread_t th;

	assert_int_equal(ap_ring_attach_consumer(&w.r, m, ap_ring_size(cap)), 0);
	assert_int_equal(ap_ring_attach_producer(&p, m, ap_ring_size(cap)), 0);
	int64_t t0 = t_now_ms();
	assert_int_equal(ap_ring_wait(&w.r, T_SPIN, 30), -ETIMEDOUT);
	assert_true(t_now_ms() - t0 >= 25);
	assert_int_equal(h->cons_waiting, 0);

	/* A sleeping consumer, woken by a commit... */
	assert_int_equal(pthread_create(&th, NULL, t_wait_thread, &w), 0);
	t_until_set(&h->cons_waiting, 5000);
	assert_int_equal(t_put(&p, 8, 1), 0);
	assert_int_equal(pthread_join(th, NULL), 0);
	assert_int_equal(w.rc, 0);
	assert_true(w.ms < 5000);
	assert_true(p.n_wake == 1);
	const void *rp;
	size_t len;
	assert_int_equal(ap_ring_read(&w.r, &rp, &len), 0);
	ap_ring_release(&w.r);

	/* ...and by ap_ring_wake with nothing to read. */
	assert_int_equal(pthread_create(&th, NULL, t_wait_thread, &w), 0);
	t_until_set(&h->cons_waiting, 5000);
	ap_ring_wake(&w.r); /* a kick on the waiter's own view (another thread of ours) */
	assert_int_equal(pthread_join(th, NULL), 0);
	assert_int_equal(w.rc, 0);
	assert_true(w.ms < 5000);
	assert_int_equal(ap_ring_read(&w.r, &rp, &len), -EAGAIN);
	free(m);
}

/* ---- two processes ------------------------------------------------------------- */

#define T_PROC_RECS 200000u
#define T_PROC_CAP 16384u

static size_t t_proc_len(uint64_t k) { return (size_t)((k * 2654435761u) >> 7) % 200; }

/* Child: the producer, pausing now and then so that the consumer sleeps;
 * `stats` (after the ring) gets its futex counts. */
static void t_child_producer(void *mem, uint64_t *stats)
{
	struct ap_ring r;

	T_CK(ap_ring_attach_producer(&r, mem, ap_ring_size(T_PROC_CAP)) == 0);
	for (uint64_t k = 0; k < T_PROC_RECS; k++) {
		T_CK(t_put(&r, t_proc_len(k), k) == 0);
		/* Pacing, not synchronisation: gives the consumer time to
		 * fall asleep so the futex path is exercised. */
		if (k % 20000 == 19999)
			poll(NULL, 0, 3);
	}
	stats[0] = r.n_wake;
	stats[1] = r.n_sleep;
	_exit(0);
}

static void test_two_processes_with_futex_sleeps(void **state)
{
	(void)state;
	struct ap_ring_map map;
	struct ap_ring c;
	uint64_t *stats;
	int st;

	assert_int_equal(ap_ring_map_create_memfd(&map, "test_ring", ap_ring_size(T_PROC_CAP) + 64), 0);
	stats = (uint64_t *)((uint8_t *)map.mem + ap_ring_size(T_PROC_CAP));
	assert_int_equal(ap_ring_format(map.mem, map.size, T_PROC_CAP), 0);
	assert_int_equal(ap_ring_attach_consumer(&c, map.mem, map.size), 0);
	fflush(stdout);
	fflush(stderr);
	pid_t pid = fork();
	assert_true(pid >= 0);
	if (pid == 0)
		t_child_producer(map.mem, stats);
	uint64_t k = 0;
	while (k < T_PROC_RECS) {
		const void *p;
		size_t len;
		int rc = ap_ring_read(&c, &p, &len);
		if (rc == -EAGAIN) {
			ap_ring_release(&c);
			rc = ap_ring_wait(&c, T_SPIN, T_WAIT_MS);
			if (rc)
				kill(pid, SIGKILL);
			assert_int_equal(rc, 0);
			continue;
		}
		if (rc)
			kill(pid, SIGKILL);
		assert_int_equal(rc, 0);
		assert_true(len == t_proc_len(k));
		if (!t_check_rec(p, len, k)) {
			kill(pid, SIGKILL);
			fail_msg("record %" PRIu64 " is not its bytes", k);
		}
		k++;
		/* A slow stretch: the producer fills the ring and sleeps. */
		if (k == T_PROC_RECS / 2)
			poll(NULL, 0, 20);
		if (k % 32 == 0)
			ap_ring_release(&c);
	}
	ap_ring_release(&c);
	assert_int_equal(waitpid(pid, &st, 0), pid);
	assert_true(WIFEXITED(st));
	assert_int_equal(WEXITSTATUS(st), 0);
	print_message("[ info     ] consumer: %" PRIu64 " sleeps %" PRIu64 " wakes; producer: %" PRIu64
		      " wakes %" PRIu64 " sleeps\n", c.n_sleep, c.n_wake, stats[0], stats[1]);
	/* Both directions slept and were woken by the other process. */
	assert_true(c.n_sleep > 0 && stats[0] > 0);
	assert_true(stats[1] > 0 && c.n_wake > 0);
	ap_ring_map_close(&map);
}

/* One message in flight at a time, both sides sleeping whenever they
 * wait: a lost wake-up cannot be rescued by a later message, so it shows
 * as a wait that ended by its timeout. */
#define T_PP_ROUNDS 4000u

static void t_pp_side(struct ap_ring *in, struct ap_ring *out, int first, unsigned spin)
{
	t_rng rng;

	t_rng_seed(&rng, 0x9b9b + (uint64_t)first);
	for (uint64_t i = 0; i < T_PP_ROUNDS; i++) {
		const void *p;
		size_t len;
		int rc;

		/* A random few microseconds before each send, so that sends
		 * land anywhere in the peer's way to sleep, its races
		 * included. */
		for (volatile size_t d = t_rand_range(&rng, 0, 3000); d > 0; d--)
			;
		if (first)
			T_CK(t_put(out, 8, i) == 0);
		/* A wait that times out is counted (the parent fails on it);
		 * three end this side. */
		while ((rc = ap_ring_read(in, &p, &len)) == -EAGAIN) {
			rc = ap_ring_wait(in, spin, 1000);
			T_CK((rc == 0 || rc == -ETIMEDOUT) && in->n_timeout < 3);
		}
		T_CK(rc == 0 && len == 8 && t_check_rec(p, len, i));
		ap_ring_release(in);
		if (!first)
			T_CK(t_put(out, 8, i) == 0);
	}
}

static void test_ping_pong_between_processes_loses_no_wake_up(void **state)
{
	(void)state;
	size_t one = ap_ring_size(4096);
	static const unsigned spins[] = { 0, T_SPIN };
	struct ap_ring_map map;
	int st;

	assert_int_equal(ap_ring_map_create_memfd(&map, "test_ring_pp", 2 * one + 64), 0);
	uint64_t *child_timeouts = (uint64_t *)((uint8_t *)map.mem + 2 * one);
	for (size_t s = 0; s < sizeof spins / sizeof spins[0]; s++) {
		struct ap_ring a_out, a_in;
		assert_int_equal(ap_ring_format(map.mem, one, 4096), 0);
		assert_int_equal(ap_ring_format((uint8_t *)map.mem + one, one, 4096), 0);
		fflush(stdout);
		fflush(stderr);
		pid_t pid = fork();
		assert_true(pid >= 0);
		if (pid == 0) {
			struct ap_ring b_in, b_out;
			T_CK(ap_ring_attach_consumer(&b_in, map.mem, one) == 0);
			T_CK(ap_ring_attach_producer(&b_out, (uint8_t *)map.mem + one, one) == 0);
			t_pp_side(&b_in, &b_out, 0, spins[s]);
			*child_timeouts = b_in.n_timeout + b_out.n_timeout;
			_exit(0);
		}
		assert_int_equal(ap_ring_attach_producer(&a_out, map.mem, one), 0);
		assert_int_equal(ap_ring_attach_consumer(&a_in, (uint8_t *)map.mem + one, one), 0);
		pid_t side = fork();
		assert_true(side >= 0);
		if (side == 0) {
			/* The parent's side in a child of its own, so that T_CK
			 * can fail it without leaving the other one behind. */
			t_pp_side(&a_in, &a_out, 1, spins[s]);
			_exit(a_in.n_timeout + a_out.n_timeout ? 100 : 0);
		}
		int st2;
		assert_int_equal(waitpid(side, &st2, 0), side);
		if (!WIFEXITED(st2) || WEXITSTATUS(st2))
			kill(pid, SIGKILL);
		assert_int_equal(waitpid(pid, &st, 0), pid);
		if (WIFEXITED(st2) && WEXITSTATUS(st2) == 100)
			fail_msg("spin %u: the initiator's waits timed out (lost wake-ups)", spins[s]);
		assert_true(WIFEXITED(st2) && WEXITSTATUS(st2) == 0);
		assert_true(WIFEXITED(st) && WEXITSTATUS(st) == 0);
		if (*child_timeouts)
			fail_msg("spin %u: %" PRIu64 " of the echo side's waits timed out (lost wake-ups)", spins[s],
				 *child_timeouts);
	}
	ap_ring_map_close(&map);
}

/* ---- a writer killed mid-write ----------------------------------------------------- */

static void test_writer_killed_mid_write_is_never_read(void **state)
{
	(void)state;
	size_t cap = 4096;
	struct ap_ring_map map;
	struct ap_ring c;
	int up[2], down[2], st;
	char b;

	assert_int_equal(ap_ring_map_create_memfd(&map, "test_ring_kill", ap_ring_size(cap)), 0);
	assert_int_equal(ap_ring_format(map.mem, map.size, cap), 0);
	assert_int_equal(ap_ring_attach_consumer(&c, map.mem, map.size), 0);
	assert_int_equal(pipe(up), 0);
	assert_int_equal(pipe(down), 0);
	fflush(stdout);
	fflush(stderr);
	pid_t pid = fork();
	assert_true(pid >= 0);
	if (pid == 0) {
		struct ap_ring r;
		void *wp;
		close(up[0]);
		close(down[1]);
		T_CK(ap_ring_attach_producer(&r, map.mem, map.size) == 0);
		/* Three 1200-byte records (1208 each): 3624 bytes. */
		for (uint64_t k = 0; k < 3; k++)
			T_CK(t_put(&r, 1200, k) == 0);
		T_CK(write(up[1], "1", 1) == 1);
		/* Once they are read and released: a fourth record, half
		 * written, ends at 3736; a fifth (512 bytes) does not fit in
		 * the last 360, so a pad goes at 3736 and it goes at 0. Both
		 * reserved, never committed. */
		T_CK(read(down[0], &b, 1) == 1);
		T_CK(ap_ring_reserve(&r, 100, &wp) == 0);
		memset(wp, 0xa5, 40);
		T_CK(ap_ring_reserve(&r, 500, &wp) == 0);
		T_CK(wp == r.data + AP_RING_REC_HDR);
		memset(wp, 0x5a, 500);
		T_CK(write(up[1], "2", 1) == 1);
		for (;;)
			pause();
	}
	close(up[1]);
	close(down[0]);
	struct pollfd pfd = { .fd = up[0], .events = POLLIN };
	int ready = poll(&pfd, 1, 10000) == 1 && read(up[0], &b, 1) == 1;
	if (!ready)
		kill(pid, SIGKILL);
	assert_true(ready);
	const void *p;
	size_t len;
	for (uint64_t k = 0; k < 3; k++) {
		assert_int_equal(ap_ring_read(&c, &p, &len), 0);
		assert_true(len == 1200 && t_check_rec(p, len, k));
	}
	ap_ring_release(&c);
	assert_int_equal(write(down[1], "g", 1), 1);
	ready = poll(&pfd, 1, 10000) == 1 && read(up[0], &b, 1) == 1;
	assert_int_equal(kill(pid, SIGKILL), 0); /* whatever happened: it must not outlive the test */
	if (!ready)
		waitpid(pid, &st, 0);
	assert_true(ready);
	assert_int_equal(waitpid(pid, &st, 0), pid);
	assert_true(WIFSIGNALED(st) && WTERMSIG(st) == SIGKILL);
	close(up[0]);
	close(down[1]);

	/* The pad and the fifth record really were written... */
	void *m = map.mem;
	assert_true(*t_word(m, cap, 3736) == t_rec_word(m, AP_RING_STAMP_PAD, 3736, 360 - 8));
	assert_true(*t_word(m, cap, 4096) == t_rec_word(m, AP_RING_STAMP_DATA, 4096, 500));
	assert_true(((uint8_t *)m)[AP_RING_HDR_SIZE + 8] == 0x5a);
	/* ...and none of it is read: tail stayed at 3624. */
	assert_int_equal(ap_ring_read(&c, &p, &len), -EAGAIN);
	assert_int_equal(ap_ring_readable(&c), 0);
	/* And waiting for more ends by its timeout, not a hang. */
	assert_int_equal(ap_ring_wait(&c, T_SPIN, 50), -ETIMEDOUT);
	assert_int_equal(ap_ring_read(&c, &p, &len), -EAGAIN);
	/* A producer restarted on the same ring starts at the committed
	 * tail, over the dead one's reservations. */
	struct ap_ring r2;
	assert_int_equal(ap_ring_attach_producer(&r2, map.mem, map.size), 0);
	assert_int_equal(t_put(&r2, 500, 7), 0);
	assert_int_equal(ap_ring_read(&c, &p, &len), 0);
	assert_true(len == 500 && t_check_rec(p, len, 7));
	ap_ring_map_close(&map);
}

/* ---- hostile segments ---------------------------------------------------------------- */

/* A ring of cap 256 holding records 0..2 (40 bytes, 48 each), with the
 * consumer attached; the scribble then runs and the consumer must say
 * -EPROTO on its first read that meets it, and keep saying it. */
typedef void (*t_scribble_fn)(void *mem, size_t cap);

static void t_sc_tail_unaligned(void *m, size_t cap) { (void)cap; ((struct ap_ring_hdr *)m)->tail = 148; }
static void t_sc_tail_past_cap(void *m, size_t cap) { ((struct ap_ring_hdr *)m)->tail = cap + 8; }
static void t_sc_tail_huge(void *m, size_t cap) { (void)cap; ((struct ap_ring_hdr *)m)->tail = UINT64_MAX - 7; }
static void t_sc_len_huge(void *m, size_t cap) { *t_word(m, cap, 0) = t_rec_word(m, AP_RING_STAMP_DATA, 0, 0xffffffffu); }
static void t_sc_len_max(void *m, size_t cap)
{
	*t_word(m, cap, 0) = t_rec_word(m, AP_RING_STAMP_DATA, 0, (uint32_t)ap_ring_max_payload(cap) + 1);
}
static void t_sc_len_past_tail(void *m, size_t cap) { *t_word(m, cap, 96) = t_rec_word(m, AP_RING_STAMP_DATA, 96, 48); }
static void t_sc_stale_stamp(void *m, size_t cap)
{
	*t_word(m, cap, 48) = t_rec_word(m, AP_RING_STAMP_DATA, 48 + cap, 40);
}
static void t_sc_garbage(void *m, size_t cap) { memset((uint8_t *)m + AP_RING_HDR_SIZE, 0x41, cap); }
static void t_sc_pad_at_zero(void *m, size_t cap)
{
	*t_word(m, cap, 0) = t_rec_word(m, AP_RING_STAMP_PAD, 0, (uint32_t)cap - 8);
}
static void t_sc_pad_short(void *m, size_t cap) { *t_word(m, cap, 48) = t_rec_word(m, AP_RING_STAMP_PAD, 48, 16); }
/* A pad to the end committed alone: the producer never does that. */
static void t_sc_pad_alone(void *m, size_t cap)
{
	struct ap_ring_hdr *h = m;
	*t_word(m, cap, 144) = t_rec_word(m, AP_RING_STAMP_PAD, 144, (uint32_t)(cap - 144 - 8));
	h->tail = cap;
}
/* Tail published past a record that was never written (stale bytes). */
static void t_sc_publish_unwritten(void *m, size_t cap)
{
	(void)cap;
	((struct ap_ring_hdr *)m)->tail = 144 + 48;
}

static void test_hostile_tail_and_records_are_errors_never_reads(void **state)
{
	(void)state;
	static const struct {
		const char *what;
		t_scribble_fn fn;
		int readable; /* records still good before the bad one */
	} cases[] = {
		{ "tail unaligned", t_sc_tail_unaligned, 0 },
		{ "tail past head + cap", t_sc_tail_past_cap, 0 },
		{ "tail near 2^64", t_sc_tail_huge, 0 },
		{ "len 2^32-1", t_sc_len_huge, 0 },
		{ "len over the maximum", t_sc_len_max, 0 },
		{ "record past tail", t_sc_len_past_tail, 2 },
		{ "stamp of another lap", t_sc_stale_stamp, 1 },
		{ "garbage records", t_sc_garbage, 0 },
		{ "pad at offset 0", t_sc_pad_at_zero, 0 },
		{ "pad short of the end", t_sc_pad_short, 1 },
		{ "pad committed alone", t_sc_pad_alone, 3 },
		{ "tail past unwritten bytes", t_sc_publish_unwritten, 3 },
	};
	size_t cap = 256;

	for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
		struct ap_ring p, c;
		const void *rp;
		size_t len;
		int rc = 0, n = 0;

		void *m = t_pair(cap, &p, &c);
		for (uint64_t k = 0; k < 3; k++)
			assert_int_equal(t_put(&p, 40, k), 0);
		cases[i].fn(m, cap);
		for (int tries = 0; tries < 10 && (rc = ap_ring_read(&c, &rp, &len)) == 0; tries++) {
			if (!t_check_rec(rp, len, (uint64_t)n) || len != 40)
				fail_msg("%s: record %d handed out wrong", cases[i].what, n);
			n++;
		}
		if (rc != -EPROTO || n != cases[i].readable)
			fail_msg("%s: rc %d after %d records (want -EPROTO after %d)", cases[i].what, rc, n,
				 cases[i].readable);
		/* Broken for good. */
		assert_int_equal(ap_ring_read(&c, &rp, &len), -EPROTO);
		assert_null(rp);
		assert_int_equal(ap_ring_wait(&c, T_SPIN, 10), -EPROTO);
		free(m);
	}
}

static void test_hostile_head_is_an_error_for_the_producer(void **state)
{
	(void)state;
	static const uint64_t bad_heads[] = { 100, 312, 1000, UINT64_MAX - 7 };
	size_t cap = 256;

	for (size_t i = 0; i < sizeof bad_heads / sizeof bad_heads[0] + 1; i++) {
		struct ap_ring p, c;
		const void *rp;
		size_t len;
		void *wp;

		void *m = t_pair(cap, &p, &c);
		struct ap_ring_hdr *h = m;
		for (uint64_t k = 0; k < 5; k++)
			assert_int_equal(t_put(&p, 40, k), 0); /* 240 of 256: the next needs head */
		assert_int_equal(ap_ring_read(&c, &rp, &len), 0);
		assert_int_equal(ap_ring_read(&c, &rp, &len), 0);
		ap_ring_release(&c);                           /* head 96 */
		assert_int_equal(t_put(&p, 40, 5), 0);         /* the producer has read head 96 */
		if (i < sizeof bad_heads / sizeof bad_heads[0])
			h->head = bad_heads[i];                /* unaligned, past tail, far past */
		else
			h->head = 48;                          /* backwards */
		/* Tail 304, cached head 96: a 112-byte record must read head. */
		int rc = 0;
		for (int n = 0; n < 10 && rc == 0; n++)
			rc = ap_ring_reserve(&p, 100, &wp);
		assert_int_equal(rc, -EPROTO);
		assert_null(wp);
		assert_int_equal(ap_ring_reserve(&p, 0, &wp), -EPROTO);
		assert_int_equal(ap_ring_commit(&p), -EPROTO);
		assert_int_equal(ap_ring_wait_space(&p, 8, T_SPIN, 10), -EPROTO);
		free(m);
	}
}

static volatile unsigned t_touch;

/* Random bytes over a live ring, many times: every answer is a record
 * inside the data area, -EAGAIN or -EPROTO, in bounded calls. */
static void test_random_scribbles_never_crash(void **state)
{
	(void)state;
	size_t cap = 512;
	t_rng rng;

	t_rng_seed(&rng, t_seed("scribbles"));
	for (int it = 0; it < 20000; it++) {
		struct ap_ring p, c;
		const void *rp;
		size_t len;
		void *wp;
		int n = (int)t_rand_range(&rng, 0, 12);

		void *m = t_pair(cap, &p, &c);
		for (int k = 0; k < n; k++) {
			if (ap_ring_reserve(&p, t_rand_range(&rng, 0, 100), &wp) == 0 && k % 3 == 2)
				ap_ring_commit(&p);
			if (k % 4 == 3) {
				while (ap_ring_read(&c, &rp, &len) == 0)
					;
				ap_ring_release(&c);
			}
		}
		ap_ring_commit(&p);
		int hits = (int)t_rand_range(&rng, 1, 8);
		for (int s = 0; s < hits; s++) {
			size_t off = t_rand_range(&rng, 0, ap_ring_size(cap) - 8) & ~(size_t)(t_rand32(&rng) & 1 ? 7 : 0);
			uint64_t v = t_rand64(&rng);
			if (t_rand32(&rng) & 1)
				v &= 0x3ff; /* small values reach deeper checks */
			memcpy((uint8_t *)m + off, &v, t_rand32(&rng) & 1 ? 8 : 1 + (t_rand32(&rng) & 7));
		}
		for (size_t k = 0; k < cap / 8 + 4; k++) {
			int rc = ap_ring_read(&c, &rp, &len);
			if (rc)
				assert_true(rc == -EAGAIN || rc == -EPROTO);
			if (rc)
				break;
			assert_true((const uint8_t *)rp >= c.data && (const uint8_t *)rp + len <= c.data + cap);
			assert_true(len <= ap_ring_max_payload(cap));
			/* Touch both ends: ASan checks they are ours. */
			if (len)
				t_touch += ((const volatile uint8_t *)rp)[0] + ((const volatile uint8_t *)rp)[len - 1];
		}
		ap_ring_release(&c);
		int rc = ap_ring_reserve(&p, t_rand_range(&rng, 0, 200), &wp);
		assert_true(rc == 0 || rc == -EAGAIN || rc == -EPROTO);
		if (rc == 0)
			memset(wp, 0, 1);
		free(m);
	}
}

/* ---- segments ------------------------------------------------------------------- */

static void t_shm_name(char *buf, size_t n, const char *what)
{
	snprintf(buf, n, "/ap_ring_test_%s_%d", what, (int)getpid());
}

/* Teardown: the segment goes even when an assert failed half way. */
static int t_unlink_seg(void **state)
{
	char name[64];

	(void)state;
	t_shm_name(name, sizeof name, "seg");
	ap_ring_shm_unlink(name);
	return 0;
}

static void test_shm_segment_is_exclusive_0600_reserved_and_unlinked(void **state)
{
	(void)state;
	char name[64];
	struct ap_ring_map a, b, x;
	struct stat st;
	size_t size = ap_ring_size(8192);

	t_shm_name(name, sizeof name, "seg");
	ap_ring_shm_unlink(name);
	mode_t old = umask(0);
	int rc = ap_ring_map_create_shm(&a, name, size);
	umask(old);
	assert_int_equal(rc, 0);
	assert_int_equal(fstat(a.fd, &st), 0);
	assert_int_equal(st.st_mode & 0777, 0600);
	assert_true((size_t)st.st_size == size);
	/* Reserved, not sparse: every block is allocated. */
	assert_true((size_t)st.st_blocks * 512 >= size);
	assert_int_equal(ap_ring_map_create_shm(&x, name, size), -EEXIST);
	assert_int_equal(ap_ring_map_open_shm(&x, name, size + 1), -EINVAL);
	assert_int_equal(ap_ring_map_create_shm(&x, "no-slash", size), -EINVAL);
	assert_int_equal(ap_ring_map_open_shm(&b, name, size), 0);
	assert_true(b.size == size);

	/* One side through each mapping. */
	struct ap_ring p, c;
	const void *rp;
	size_t len;
	assert_int_equal(ap_ring_format(a.mem, a.size, 8192), 0);
	assert_int_equal(ap_ring_attach_producer(&p, a.mem, a.size), 0);
	assert_int_equal(ap_ring_attach_consumer(&c, b.mem, b.size), 0);
	assert_int_equal(t_put(&p, 77, 9), 0);
	assert_int_equal(ap_ring_read(&c, &rp, &len), 0);
	assert_true(len == 77 && t_check_rec(rp, len, 9));

	assert_int_equal(ap_ring_shm_unlink(name), 0);
	assert_int_equal(ap_ring_shm_unlink(name), -ENOENT);
	assert_int_equal(ap_ring_map_open_shm(&x, name, 0), -ENOENT);
	ap_ring_map_close(&a);
	ap_ring_map_close(&b);
	assert_null(a.mem);
}

/* A segment larger than a full tmpfs: create says -ENOSPC and leaves
 * nothing, where a sparse ftruncate would have "worked" and the first
 * store past the filesystem's end would have been SIGBUS. Runs in a forked
 * child with a 1 MiB tmpfs on /dev/shm in a private mount namespace (root
 * only, as test_shm's full-tmpfs cases); the child checks with T_CK. */
static void t_child_small_tmpfs(void)
{
	struct ap_ring_map m;
	char name[64];

	t_shm_name(name, sizeof name, "small");
	T_CK(ap_ring_map_create_shm(&m, name, 4u << 20) == -ENOSPC);
	T_CK(m.mem == NULL && m.fd == -1);
	T_CK(ap_ring_map_open_shm(&m, name, 0) == -ENOENT);
	/* What fits is fully backed: every byte can be written. */
	T_CK(ap_ring_map_create_shm(&m, name, 512u << 10) == 0);
	memset(m.mem, 0x11, m.size);
	T_CK(ap_ring_map_create_shm(&m, "/ap_ring_test_more", 768u << 10) == -ENOSPC);
	ap_ring_map_close(&m);
	T_CK(ap_ring_shm_unlink(name) == 0);
	_exit(0);
}

static void test_shm_segment_larger_than_tmpfs_is_enospc_not_sigbus(void **state)
{
	(void)state;
	t_in_small_tmpfs("size=1m", t_child_small_tmpfs);
}

static void test_memfd_segment_is_sealed_and_unsealed_fds_are_refused(void **state)
{
	(void)state;
	struct ap_ring_map a, b;
	size_t size = ap_ring_size(4096);

	assert_int_equal(ap_ring_map_create_memfd(&a, "t", size), 0);
	assert_int_equal(fcntl(a.fd, F_GET_SEALS) & (F_SEAL_SHRINK | F_SEAL_GROW), F_SEAL_SHRINK | F_SEAL_GROW);
	assert_true(ftruncate(a.fd, 0) < 0); /* cannot be shrunk under a mapping */
	int fd = dup(a.fd);
	assert_true(fd >= 0);
	assert_int_equal(ap_ring_map_open_fd(&b, fd, size), 0);
	assert_int_equal(ap_ring_format(a.mem, a.size, 4096), 0);
	struct ap_ring c;
	assert_int_equal(ap_ring_attach_consumer(&c, b.mem, b.size), 0);
	ap_ring_map_close(&b);
	fd = dup(a.fd);
	assert_int_equal(ap_ring_map_open_fd(&b, fd, size + 1), -EINVAL);
	close(fd);

	int raw = memfd_create("unsealed", MFD_CLOEXEC);
	assert_true(raw >= 0);
	assert_int_equal(ftruncate(raw, (off_t)size), 0);
	assert_int_equal(ap_ring_map_open_fd(&b, raw, size), -EPERM);
	close(raw);
	ap_ring_map_close(&a);
}

/* ---- io_uring futex wait ---------------------------------------------------------- */

static int t_kernel_at_least(int maj, int min)
{
	struct utsname u;
	int a = 0, b = 0;
	if (uname(&u) < 0 || sscanf(u.release, "%d.%d", &a, &b) != 2)
		return 0;
	return a > maj || (a == maj && b >= min);
}

static void test_uring_futex_wait_is_woken_by_another_process(void **state)
{
	(void)state;
	struct io_uring ring;
	struct io_uring_cqe *cqe;
	struct __kernel_timespec ts = { .tv_sec = 5 };
	struct ap_ring_map map;
	struct ap_ring c;
	uint32_t *word, expected;
	int st;

	int rc = io_uring_queue_init(8, &ring, 0);
	if (rc < 0) {
		/* Passes only where io_uring truly is not there (seccomp,
		 * kernel.io_uring_disabled, an old kernel) and the probe agrees,
		 * so the event loop takes the fallback; any other failure, or
		 * a probe that says yes, fails. */
		char dis[16] = "?";
		FILE *f = fopen("/proc/sys/kernel/io_uring_disabled", "r");
		if (f) {
			if (!fgets(dis, sizeof dis, f))
				snprintf(dis, sizeof dis, "?");
			dis[strcspn(dis, "\n")] = 0;
			fclose(f);
		}
		print_message("[ info     ] io_uring unavailable here: io_uring_queue_init: %s, "
			      "kernel.io_uring_disabled=%s; the futex-wait path cannot run, checking the "
			      "probe reports no support\n", strerror(-rc), dis);
		assert_true(rc == -EPERM || rc == -ENOSYS);
		assert_int_equal(ap_ring_uring_futex_supported(NULL), 0);
		return;
	}
	int ok = ap_ring_uring_futex_supported(&ring);
	assert_int_equal(ok, ap_ring_uring_futex_supported(NULL));
	if (!t_kernel_at_least(6, 7)) {
		/* An older kernel: the probe must say no (the loop falls back). */
		assert_int_equal(ok, 0);
		io_uring_queue_exit(&ring);
		return;
	}
	assert_int_equal(ok, 1);

	assert_int_equal(ap_ring_map_create_memfd(&map, "t_uring", ap_ring_size(4096)), 0);
	assert_int_equal(ap_ring_format(map.mem, map.size, 4096), 0);
	assert_int_equal(ap_ring_attach_consumer(&c, map.mem, map.size), 0);

	/* A stale expected value completes at once with -EAGAIN. */
	struct io_uring_sqe *sqe = io_uring_get_sqe(&ring);
	ap_ring_uring_prep_futex_wait(sqe, &c.hdr->data_bell, c.hdr->data_bell + 1, 7);
	assert_int_equal(io_uring_submit(&ring), 1);
	assert_int_equal(io_uring_wait_cqe_timeout(&ring, &cqe, &ts), 0);
	assert_true(cqe->user_data == 7);
	assert_int_equal(cqe->res, -EAGAIN);
	io_uring_cqe_seen(&ring, cqe);

	/* The real thing: arm the sleep, wait through io_uring, and let a
	 * producer process commit. */
	assert_int_equal(ap_ring_prepare_sleep(&c, 0, &word, &expected), 1);
	sqe = io_uring_get_sqe(&ring);
	ap_ring_uring_prep_futex_wait(sqe, word, expected, 42);
	assert_int_equal(io_uring_submit(&ring), 1);
	/* Armed and not completed: nothing has been committed. */
	assert_int_equal(io_uring_peek_cqe(&ring, &cqe), -EAGAIN);
	fflush(stdout);
	fflush(stderr);
	pid_t pid = fork();
	assert_true(pid >= 0);
	if (pid == 0) {
		struct ap_ring r;
		T_CK(ap_ring_attach_producer(&r, map.mem, map.size) == 0);
		poll(NULL, 0, 20); /* pacing only: the parent is already armed */
		T_CK(t_put(&r, 123, 4) == 0);
		T_CK(r.n_wake == 1);
		_exit(0);
	}
	rc = io_uring_wait_cqe_timeout(&ring, &cqe, &ts);
	if (rc)
		kill(pid, SIGKILL);
	assert_int_equal(waitpid(pid, &st, 0), pid);
	assert_int_equal(rc, 0);
	assert_true(WIFEXITED(st) && WEXITSTATUS(st) == 0);
	assert_true(cqe->user_data == 42);
	assert_int_equal(cqe->res, 0);
	io_uring_cqe_seen(&ring, cqe);
	ap_ring_end_sleep(&c);
	const void *rp;
	size_t len;
	assert_int_equal(ap_ring_read(&c, &rp, &len), 0);
	assert_true(len == 123 && t_check_rec(rp, len, 4));

	/* An io_uring FUTEX_WAKE wakes a plain futex sleeper too: a
	 * producer publishes without its own wake-up, then rings through
	 * io_uring. */
	struct t_waiter w;
	struct ap_ring p;
	void *wp;
	pthread_t th;
	ap_ring_release(&c);
	w.r = c;
	assert_int_equal(pthread_create(&th, NULL, t_wait_thread, &w), 0);
	t_until_set(&c.hdr->cons_waiting, 5000);
	assert_int_equal(ap_ring_attach_producer(&p, map.mem, map.size), 0);
	assert_int_equal(ap_ring_reserve(&p, 10, &wp), 0);
	t_fill(wp, 10, 5);
	assert_int_equal(ap_ring_publish(&p), 0);
	__atomic_fetch_add(&c.hdr->data_bell, 1, __ATOMIC_RELEASE);
	sqe = io_uring_get_sqe(&ring);
	ap_ring_uring_prep_futex_wake(sqe, &c.hdr->data_bell, 1, 9);
	assert_int_equal(io_uring_submit(&ring), 1);
	assert_int_equal(io_uring_wait_cqe_timeout(&ring, &cqe, &ts), 0);
	assert_true(cqe->user_data == 9 && cqe->res >= 0);
	io_uring_cqe_seen(&ring, cqe);
	assert_int_equal(pthread_join(th, NULL), 0);
	assert_int_equal(w.rc, 0);
	assert_true(w.ms < 5000);
	c = w.r;
	assert_int_equal(ap_ring_read(&c, &rp, &len), 0);
	assert_true(len == 10 && t_check_rec(rp, len, 5));
	ap_ring_release(&c);

	/* A wait with a linked timeout, nobody ringing: the wait is
	 * cancelled when the timeout fires, both CQEs come. */
	struct __kernel_timespec tmo = { .tv_nsec = 100 * 1000000L };
	assert_int_equal(ap_ring_prepare_sleep(&c, 0, &word, &expected), 1);
	sqe = io_uring_get_sqe(&ring);
	ap_ring_uring_prep_futex_wait(sqe, word, expected, 50);
	ap_ring_uring_link_timeout(sqe, io_uring_get_sqe(&ring), &tmo, 51);
	int64_t t0 = t_now_ms();
	assert_int_equal(io_uring_submit(&ring), 2);
	int got = 0, wait_res = 1, tmo_res = 1;
	while (got < 2 && io_uring_wait_cqe_timeout(&ring, &cqe, &ts) == 0) {
		if (cqe->user_data == 50)
			wait_res = cqe->res;
		else if (cqe->user_data == 51)
			tmo_res = cqe->res;
		io_uring_cqe_seen(&ring, cqe);
		got++;
	}
	ap_ring_end_sleep(&c);
	print_message("[ info     ] linked timeout: wait %d, timeout %d, after %" PRId64 " ms\n", wait_res, tmo_res,
		      t_now_ms() - t0);
	assert_int_equal(got, 2);
	assert_int_equal(wait_res, -ECANCELED);
	/* -ETIME, or (6.18 for futex waits) the count the cancel found. */
	assert_true(tmo_res == -ETIME || tmo_res == 1);

	/* What a loop does before unmapping: cancel the armed wait and reap
	 * it. */
	assert_int_equal(ap_ring_prepare_sleep(&c, 0, &word, &expected), 1);
	sqe = io_uring_get_sqe(&ring);
	ap_ring_uring_prep_futex_wait(sqe, word, expected, 60);
	assert_int_equal(io_uring_submit(&ring), 1);
	sqe = io_uring_get_sqe(&ring);
	io_uring_prep_cancel64(sqe, 60, 0);
	sqe->user_data = 61;
	assert_int_equal(io_uring_submit(&ring), 1);
	got = 0;
	wait_res = tmo_res = 1;
	while (got < 2 && io_uring_wait_cqe_timeout(&ring, &cqe, &ts) == 0) {
		if (cqe->user_data == 60)
			wait_res = cqe->res;
		else if (cqe->user_data == 61)
			tmo_res = cqe->res;
		io_uring_cqe_seen(&ring, cqe);
		got++;
	}
	ap_ring_end_sleep(&c);
	assert_int_equal(got, 2);
	assert_int_equal(wait_res, -ECANCELED);
	assert_true(tmo_res == 0 || tmo_res == 1); /* found it (1 on 6.18 for futex waits), not -ENOENT */

	io_uring_queue_exit(&ring);
	ap_ring_map_close(&map);
}

/* ---- review fixes: bounded waits, failed attach, stamps, segments -------------- */

/* A hostile peer's thread: rings `bell` whenever `flag` is up, so every
 * sleep of ours is cut short at once. */
struct t_ringer {
	uint32_t *flag, *bell;
	int stop;
	uint64_t rings;
};

static void *t_ringer_thread(void *arg)
{
	struct t_ringer *g = arg;

	while (!__atomic_load_n(&g->stop, __ATOMIC_ACQUIRE)) {
		if (__atomic_load_n(g->flag, __ATOMIC_ACQUIRE)) {
			__atomic_fetch_add(g->bell, 1, __ATOMIC_RELEASE);
			ap_ring_futex_wake(g->bell, INT_MAX);
			g->rings++;
		} else {
			sched_yield();
		}
	}
	return NULL;
}

/* Runs wait_fn under a ringer; returns its result and sets *ms. */
static int t_wait_under_ringer(uint32_t *flag, uint32_t *bell, int (*wait_fn)(void *), void *arg, int64_t *ms,
			       uint64_t *rings)
{
	struct t_ringer g = { .flag = flag, .bell = bell };
	pthread_t th;

	assert_int_equal(pthread_create(&th, NULL, t_ringer_thread, &g), 0);
	int64_t t0 = t_now_ms();
	int rc = wait_fn(arg);
	*ms = t_now_ms() - t0;
	__atomic_store_n(&g.stop, 1, __ATOMIC_RELEASE);
	assert_int_equal(pthread_join(th, NULL), 0);
	*rings = g.rings;
	return rc;
}

static int t_wait_data_200(void *r) { return ap_ring_wait(r, T_SPIN, 200); }
static int t_wait_space_200(void *r) { return ap_ring_wait_space(r, 56, T_SPIN, 200); }

static void test_hostile_bell_cannot_cut_short_or_stretch_a_wait(void **state)
{
	(void)state;
	size_t cap = 4096;
	struct ap_ring p, c;
	uint64_t rings;
	int64_t ms;
	void *wp;
	int rc;

	void *m = t_pair(cap, &p, &c);
	struct ap_ring_hdr *h = m;
	/* Nothing to read: the wait ends by its timeout, however often the
	 * bell rings. */
	rc = t_wait_under_ringer(&h->cons_waiting, &h->data_bell, t_wait_data_200, &c, &ms, &rings);
	print_message("[ info     ] data wait under a ringer: rc %d after %" PRId64 " ms, %" PRIu64
		      " rings, %" PRIu64 " sleeps\n", rc, ms, rings, c.n_sleep);
	assert_int_equal(rc, -ETIMEDOUT);
	assert_true(rings > 0);  /* the peer did ring */
	assert_true(ms >= 199 && ms < 1000);
	assert_int_equal(h->cons_waiting, 0);

	/* The same for space: a full ring and a consumer that only rings. */
	while (ap_ring_reserve(&p, 56, &wp) == 0)
		;
	assert_int_equal(ap_ring_commit(&p), 0);
	rc = t_wait_under_ringer(&h->prod_waiting, &h->space_bell, t_wait_space_200, &p, &ms, &rings);
	print_message("[ info     ] space wait under a ringer: rc %d after %" PRId64 " ms, %" PRIu64 " rings\n", rc,
		      ms, rings);
	assert_int_equal(rc, -ETIMEDOUT);
	assert_true(rings > 0);
	assert_true(ms >= 199 && ms < 1000);

	free(m);
}

static void test_a_failed_attach_leaves_a_view_every_call_refuses(void **state)
{
	(void)state;
	size_t cap = 256;
	void *m = aligned_alloc(64, ap_ring_size(cap));
	struct ap_ring r;
	const void *rp;
	size_t len;
	void *wp;
	uint32_t *word, expected;

	assert_non_null(m);
	memset(m, 0, ap_ring_size(cap)); /* not a ring */
	for (int role = 0; role < 2; role++) {
		memset(&r, 0x5a, sizeof r);
		if (role)
			assert_int_equal(ap_ring_attach_producer(&r, m, ap_ring_size(cap)), -EINVAL);
		else
			assert_int_equal(ap_ring_attach_consumer(&r, m, ap_ring_size(cap)), -EINVAL);
		assert_null(r.hdr);
		assert_int_equal(ap_ring_readable(&r), -EINVAL);
		assert_int_equal(ap_ring_wait(&r, 10, 10), -EINVAL);
		assert_int_equal(ap_ring_read(&r, &rp, &len), -EINVAL);
		ap_ring_release(&r);
		ap_ring_wake(&r);
		assert_int_equal(ap_ring_prepare_sleep(&r, 0, &word, &expected), -EINVAL);
		ap_ring_end_sleep(&r);
		assert_int_equal(ap_ring_reserve(&r, 8, &wp), -EINVAL);
		assert_int_equal(ap_ring_commit(&r), -EINVAL);
		assert_int_equal(ap_ring_publish(&r), -EINVAL);
		assert_int_equal(ap_ring_notify(&r), -EINVAL);
		assert_int_equal(ap_ring_has_room(&r, 8), -EINVAL);
		assert_int_equal(ap_ring_wait_space(&r, 8, 10, 10), -EINVAL);
		ap_ring_abort(&r);
	}
	/* Nothing was written to the memory it refused. */
	for (size_t i = 0; i < ap_ring_size(cap); i++)
		assert_int_equal(((uint8_t *)m)[i], 0);
	free(m);
}

static void test_release_on_a_broken_ring_gives_nothing_back(void **state)
{
	(void)state;
	size_t cap = 256;
	struct ap_ring p, c;
	const void *rp;
	size_t len;

	void *m = t_pair(cap, &p, &c);
	struct ap_ring_hdr *h = m;
	for (uint64_t k = 0; k < 3; k++)
		assert_int_equal(t_put(&p, 40, k), 0);
	assert_int_equal(ap_ring_read(&c, &rp, &len), 0);
	*t_word(m, cap, 48) = 0x4141414141414141ull;
	assert_int_equal(ap_ring_read(&c, &rp, &len), -EPROTO);
	h->prod_waiting = 1;
	ap_ring_release(&c);
	assert_true(h->head == 0);
	assert_int_equal(h->prod_waiting, 1); /* and no wake-up either */
	assert_true(c.n_wake == 0);
	free(m);
}

/* Zeroed memory published without a write, at indexes where an all-zero
 * word used to be a valid header (stamp 0 == kind ^ index / 8). */
static void test_zeroed_data_published_without_a_write_is_an_error(void **state)
{
	(void)state;
	size_t cap = 256;
	void *m = t_ring_mem(cap);
	struct ap_ring_hdr *h = m;

	for (int i = 0; i < 4; i++) {
		struct ap_ring c;
		const void *rp;
		size_t len;

		assert_int_equal(ap_ring_format(m, ap_ring_size(cap), cap), 0);
		uint64_t at[] = { 0, 8ull * AP_RING_STAMP_DATA, 8ull * AP_RING_STAMP_PAD,
				  8ull * (AP_RING_STAMP_DATA ^ h->nonce) };
		memset((uint8_t *)m + AP_RING_HDR_SIZE, 0, cap);
		h->head = h->tail = at[i];
		assert_int_equal(ap_ring_attach_consumer(&c, m, ap_ring_size(cap)), 0);
		h->tail = at[i] + 48;
		int rc = ap_ring_read(&c, &rp, &len);
		if (rc != -EPROTO)
			fail_msg("zeroes at index 0x%" PRIx64 ": read %d (len %zu), want -EPROTO", at[i], rc, len);
		assert_null(rp);
	}
	free(m);
}

static void test_records_of_an_earlier_format_are_refused(void **state)
{
	(void)state;
	size_t cap = 256;
	void *m = t_ring_mem(cap);
	struct ap_ring_hdr *h = m;
	struct ap_ring p, c;
	const void *rp;
	size_t len;

	for (int lap = 0; lap < 3; lap++) {
		assert_int_equal(ap_ring_attach_producer(&p, m, ap_ring_size(cap)), 0);
		for (uint64_t k = 0; k < 3; k++)
			assert_int_equal(t_put(&p, 40, k), 0); /* records at 0, 48, 96 */
		uint32_t before = h->nonce;
		assert_int_equal(ap_ring_format(m, ap_ring_size(cap), cap), 0);
		assert_true(h->tail == 0);
		assert_int_equal(ap_ring_attach_consumer(&c, m, ap_ring_size(cap)), 0);
		/* A producer of the new format publishes without writing:
		 * the old records lie there with the old nonce. */
		h->tail = 144;
		assert_int_equal(ap_ring_read(&c, &rp, &len), -EPROTO);
		assert_null(rp);
		assert_true(h->nonce != before);
		assert_int_equal(ap_ring_format(m, ap_ring_size(cap), cap), 0);
	}
	free(m);
}

/* Segment objects made by hand, as a peer (or a stranger) would. */
static const char *const t_shm_kinds[] = { "good", "sparse", "grp", "oth", "foreign", "fifo" };

static int t_unlink_kinds(void **state)
{
	char name[64], path[96];

	(void)state;
	for (size_t i = 0; i < sizeof t_shm_kinds / sizeof t_shm_kinds[0]; i++) {
		t_shm_name(name, sizeof name, t_shm_kinds[i]);
		ap_ring_shm_unlink(name);
		snprintf(path, sizeof path, "/dev/shm%s", name);
		unlink(path); /* the FIFO, should shm_unlink refuse it */
	}
	return 0;
}

static void t_shm_obj(const char *name, mode_t mode, size_t size, int reserve, uid_t uid)
{
	int fd = shm_open(name, O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, 0600);
	assert_true(fd >= 0);
	assert_int_equal(ftruncate(fd, (off_t)size), 0);
	if (reserve)
		assert_int_equal(posix_fallocate(fd, 0, (off_t)size), 0);
	if (uid != geteuid())
		assert_int_equal(fchown(fd, uid, uid), 0);
	assert_int_equal(fchmod(fd, mode), 0);
	close(fd);
}

/* Each case is checked and reported; the test fails at the end, listing
 * every case that was let through. */
static int t_shm_case(const char *kind, int want, size_t size, int *bad)
{
	struct ap_ring_map m;
	char name[64];

	t_shm_name(name, sizeof name, kind);
	int rc = ap_ring_map_open_shm(&m, name, size);
	if (rc == 0)
		ap_ring_map_close(&m);
	else if (m.mem || m.fd != -1)
		rc = 1000; /* a refusal must leave nothing mapped or open */
	print_message("[ info     ] open_shm %-8s -> %d (want %d)\n", kind, rc, want);
	if (rc != want)
		(*bad)++;
	return rc;
}

static void test_shm_open_refuses_sparse_foreign_and_open_objects(void **state)
{
	(void)state;
	size_t size = ap_ring_size(65536);
	char name[64], path[96];
	struct stat st;
	int bad = 0;

	t_unlink_kinds(NULL);
	/* The control: a private, reserved object of ours is taken. */
	t_shm_name(name, sizeof name, "good");
	t_shm_obj(name, 0600, size, 1, geteuid());
	t_shm_case("good", 0, size, &bad);
	/* Sparse: its first touch on a full tmpfs would be SIGBUS. */
	t_shm_name(name, sizeof name, "sparse");
	t_shm_obj(name, 0600, size, 0, geteuid());
	t_shm_case("sparse", -EINVAL, size, &bad);
	t_shm_name(name, sizeof name, "grp");
	t_shm_obj(name, 0640, size, 1, geteuid());
	t_shm_case("grp", -EPERM, size, &bad);
	t_shm_name(name, sizeof name, "oth");
	t_shm_obj(name, 0602, size, 1, geteuid());
	t_shm_case("oth", -EPERM, size, &bad);
	/* Owned by someone else (a root test can give it away). */
	t_shm_name(name, sizeof name, "foreign");
	if (geteuid() == 0) {
		t_shm_obj(name, 0600, size, 1, 65534);
		snprintf(path, sizeof path, "/dev/shm%s", name);
		assert_int_equal(stat(path, &st), 0);
		assert_true(st.st_uid == 65534);
		t_shm_case("foreign", -EPERM, size, &bad);
	} else {
		print_message("[ info     ] not root: cannot make an object owned by another uid, "
			      "the foreign-owner case is not exercised here\n");
	}
	/* Not a regular file: refused, and the open does not block. */
	t_shm_name(name, sizeof name, "fifo");
	snprintf(path, sizeof path, "/dev/shm%s", name);
	assert_int_equal(mkfifo(path, 0600), 0);
	t_shm_case("fifo", -EINVAL, 0, &bad);
	t_unlink_kinds(NULL);
	if (bad)
		fail_msg("%d shm objects got an answer other than the one wanted (see above)", bad);
}

/* Sends n fds in one message, as a hostile peer might. */
static void t_send_fds(int sock, const int *fds, size_t n)
{
	char byte = 'x';
	struct iovec iov = { .iov_base = &byte, .iov_len = 1 };
	char buf[CMSG_SPACE(8 * sizeof(int))];
	struct msghdr msg = { .msg_iov = &iov, .msg_iovlen = 1 };

	memset(buf, 0, sizeof buf);
	if (n) {
		msg.msg_control = buf;
		msg.msg_controllen = CMSG_SPACE(n * sizeof(int));
		struct cmsghdr *c = CMSG_FIRSTHDR(&msg);
		c->cmsg_level = SOL_SOCKET;
		c->cmsg_type = SCM_RIGHTS;
		c->cmsg_len = CMSG_LEN(n * sizeof(int));
		memcpy(CMSG_DATA(c), fds, n * sizeof(int));
	}
	assert_int_equal(sendmsg(sock, &msg, 0), 1);
}

static int t_fd_open(int fd) { return fcntl(fd, F_GETFD) >= 0; }

static void test_memfd_passed_over_a_socket_cannot_be_shrunk_by_the_peer(void **state)
{
	(void)state;
	size_t cap = 65536, size = ap_ring_size(cap);
	struct ap_ring_map a;
	struct ap_ring c;
	int sv[2], st, fd;

	assert_int_equal(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
	assert_int_equal(ap_ring_map_create_memfd(&a, "t_pass", size), 0);
	assert_int_equal(ap_ring_format(a.mem, a.size, cap), 0);
	assert_int_equal(ap_ring_attach_consumer(&c, a.mem, a.size), 0);
	fflush(stdout);
	fflush(stderr);
	pid_t pid = fork();
	assert_true(pid >= 0);
	if (pid == 0) {
		/* The peer: gets the fd, tries to shrink, grow and unseal it,
		 * then produces through it. */
		struct ap_ring_map pm;
		struct ap_ring r;
		close(sv[0]);
		T_CK(ap_ring_recv_fd(sv[1], &fd) == 0 && fd >= 0);
		T_CK((fcntl(fd, F_GETFD) & FD_CLOEXEC) != 0);
		T_CK(ftruncate(fd, 0) < 0 && errno == EPERM);
		T_CK(ftruncate(fd, (off_t)size / 2) < 0 && errno == EPERM);
		T_CK(ftruncate(fd, (off_t)size * 2) < 0 && errno == EPERM);
		T_CK(fcntl(fd, F_ADD_SEALS, F_SEAL_WRITE) < 0 && errno == EPERM);
		T_CK(ap_ring_map_open_fd(&pm, fd, size) == 0);
		T_CK(ap_ring_attach_producer(&r, pm.mem, pm.size) == 0);
		T_CK(t_put(&r, 300, 3) == 0);
		ap_ring_map_close(&pm);
		_exit(0);
	}
	close(sv[1]);
	assert_int_equal(ap_ring_send_fd(sv[0], a.fd), 0);
	assert_int_equal(waitpid(pid, &st, 0), pid);
	assert_true(WIFEXITED(st));
	assert_int_equal(WEXITSTATUS(st), 0);
	const void *rp;
	size_t len;
	assert_int_equal(ap_ring_read(&c, &rp, &len), 0);
	assert_true(len == 300 && t_check_rec(rp, len, 3));
	/* Every byte of our mapping is still there (a shrink would SIGBUS). */
	struct stat sb;
	assert_int_equal(fstat(a.fd, &sb), 0);
	assert_true((size_t)sb.st_size == size);
	t_touch += ((volatile uint8_t *)a.mem)[size - 1];
	close(sv[0]);

	/* Hostile messages: two fds at once, none, end of stream. Whatever
	 * came is closed. */
	assert_int_equal(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
	int probe = dup(0);
	assert_true(probe >= 0);
	close(probe); /* the lowest free number: where a received fd lands */
	int two[2] = { a.fd, a.fd };
	t_send_fds(sv[0], two, 2);
	assert_int_equal(ap_ring_recv_fd(sv[1], &fd), -EPROTO);
	assert_int_equal(fd, -1);
	assert_false(t_fd_open(probe));
	assert_false(t_fd_open(probe + 1));
	t_send_fds(sv[0], NULL, 0);
	assert_int_equal(ap_ring_recv_fd(sv[1], &fd), -EPROTO);
	close(sv[0]);
	assert_int_equal(ap_ring_recv_fd(sv[1], &fd), -ECONNRESET);
	assert_int_equal(ap_ring_send_fd(sv[1], -1), -EBADF);
	close(sv[1]);
	ap_ring_map_close(&a);
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_format_and_attach_reject_what_is_not_a_ring),
		cmocka_unit_test(test_two_threads_pass_millions_of_random_records_in_order),
		cmocka_unit_test(test_wrap_around_writes_a_pad_and_records_stay_contiguous),
		cmocka_unit_test(test_full_and_empty),
		cmocka_unit_test(test_batch_commit_publishes_all_and_rings_once),
		cmocka_unit_test(test_abort_drops_uncommitted_reservations),
		cmocka_unit_test(test_wait_times_out_and_wake_ends_a_sleep),
		cmocka_unit_test(test_two_processes_with_futex_sleeps),
		cmocka_unit_test(test_ping_pong_between_processes_loses_no_wake_up),
		cmocka_unit_test(test_writer_killed_mid_write_is_never_read),
		cmocka_unit_test(test_hostile_tail_and_records_are_errors_never_reads),
		cmocka_unit_test(test_hostile_head_is_an_error_for_the_producer),
		cmocka_unit_test(test_random_scribbles_never_crash),
		cmocka_unit_test_teardown(test_shm_segment_is_exclusive_0600_reserved_and_unlinked, t_unlink_seg),
		cmocka_unit_test(test_shm_segment_larger_than_tmpfs_is_enospc_not_sigbus),
		cmocka_unit_test(test_memfd_segment_is_sealed_and_unsealed_fds_are_refused),
		cmocka_unit_test(test_uring_futex_wait_is_woken_by_another_process),
		cmocka_unit_test(test_hostile_bell_cannot_cut_short_or_stretch_a_wait),
		cmocka_unit_test(test_a_failed_attach_leaves_a_view_every_call_refuses),
		cmocka_unit_test(test_release_on_a_broken_ring_gives_nothing_back),
		cmocka_unit_test(test_zeroed_data_published_without_a_write_is_an_error),
		cmocka_unit_test(test_records_of_an_earlier_format_are_refused),
		cmocka_unit_test_teardown(test_shm_open_refuses_sparse_foreign_and_open_objects, t_unlink_kinds),
		cmocka_unit_test(test_memfd_passed_over_a_socket_cannot_be_shrunk_by_the_peer),
	};
	return cmocka_run_group_tests(tests, NULL, NULL);
}
