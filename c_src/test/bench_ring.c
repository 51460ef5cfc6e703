/* bench_ring: records/s through one ring between two processes, and a
 * futex ping-pong round trip over two rings. Not a test: prints numbers.
 *
 *   bench_ring [records]   (default 5000000)
 *
 * Throughput: 100-byte records, the producer committing one record at a
 * time or 32 per commit; the consumer spinning AP_RING_DEFAULT_SPIN rounds
 * before sleeping ("spin+futex") or sleeping as soon as the ring is empty
 * ("futex only"). Round trip: an 8-byte record there and back, p50/p99,
 * back to back and with 50 us of idle between rounds, with the same two
 * wait policies, "wake-aware" (no spin when our last commit had to wake
 * the peer), and with both sides spinning (no sleeps at all); then the
 * cost of one spin round and the idle round trip over a range of spins.
 */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "ap_ring.h"

#define B_CAP (1u << 20)
#define B_REC 100u

static uint64_t b_now_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static void b_die(const char *what, int rc)
{
	fprintf(stderr, "bench_ring: %s: %s\n", what, strerror(-rc));
	exit(1);
}

static void b_produce(void *mem, uint64_t n, unsigned batch, unsigned spin)
{
	struct ap_ring r;
	void *p;
	int rc;

	if ((rc = ap_ring_attach_producer(&r, mem, ap_ring_size(B_CAP))))
		b_die("attach", rc);
	for (uint64_t k = 0; k < n; k++) {
		while ((rc = ap_ring_reserve(&r, B_REC, &p)) == -EAGAIN) {
			ap_ring_commit(&r);
			if ((rc = ap_ring_wait_space(&r, B_REC, spin, 5000)) && rc != -ETIMEDOUT)
				b_die("wait_space", rc);
		}
		if (rc)
			b_die("reserve", rc);
		memcpy(p, &k, sizeof k);
		memset((uint8_t *)p + sizeof k, (int)k, B_REC - sizeof k);
		if ((k + 1) % batch == 0)
			ap_ring_commit(&r);
	}
	ap_ring_commit(&r);
}

static void b_throughput(uint64_t n, unsigned batch, unsigned spin, const char *label)
{
	struct ap_ring_map m;
	struct ap_ring c;
	int rc, st;

	if ((rc = ap_ring_map_create_memfd(&m, "bench", ap_ring_size(B_CAP))))
		b_die("memfd", rc);
	ap_ring_format(m.mem, m.size, B_CAP);
	ap_ring_attach_consumer(&c, m.mem, m.size);
	pid_t pid = fork();
	if (pid == 0) {
		b_produce(m.mem, n, batch, spin);
		_exit(0);
	}
	uint64_t t0 = 0, k = 0;
	while (k < n) {
		const void *p;
		size_t len;
		rc = ap_ring_read(&c, &p, &len);
		if (rc == -EAGAIN) {
			ap_ring_release(&c);
			if ((rc = ap_ring_wait(&c, spin, 5000)) && rc != -ETIMEDOUT)
				b_die("wait", rc);
			continue;
		}
		if (rc)
			b_die("read", rc);
		uint64_t v;
		memcpy(&v, p, sizeof v);
		if (v != k || len != B_REC) {
			fprintf(stderr, "bench_ring: record %" PRIu64 " is %" PRIu64 "\n", k, v);
			exit(1);
		}
		if (k++ == 0)
			t0 = b_now_ns();
		if (k % 64 == 0)
			ap_ring_release(&c);
	}
	ap_ring_release(&c);
	double s = (double)(b_now_ns() - t0) / 1e9;
	waitpid(pid, &st, 0);
	printf("%-44s %8.2f M records/s  (consumer sleeps %" PRIu64 ", wakes sent %" PRIu64 ")\n", label,
	       (double)(n - 1) / s / 1e6, c.n_sleep, c.n_wake);
	ap_ring_map_close(&m);
}

static int b_cmp(const void *a, const void *b)
{
	uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
	return x < y ? -1 : x > y;
}

/* One side of the ping-pong: read one record from `in`, send it back on
 * `out`; the initiator times each round. */
static void b_pong(struct ap_ring *in, struct ap_ring *out, uint64_t rounds, unsigned spin, uint64_t *lat,
		   unsigned idle_us, int wake_aware)
{
	int woke = 0;

	for (uint64_t i = 0; i < rounds; i++) {
		const void *p;
		size_t len;
		void *w;
		uint64_t t0 = 0;

		if (lat) {
			if (idle_us) {
				uint64_t until = b_now_ns() + idle_us * 1000u;
				struct timespec ts = { 0, (long)idle_us * 1000 };
				nanosleep(&ts, NULL);
				while (b_now_ns() < until)
					;
			}
			t0 = b_now_ns();
			if (ap_ring_reserve(out, 8, &w))
				b_die("reserve", -EAGAIN);
			memcpy(w, &i, 8);
			woke = ap_ring_commit(out) == 1;
		}
		int rc;
		/* Wake-aware: no spin for an answer from a peer we just woke
		 * (it is microseconds away), nor, on the echo side, for the
		 * next request after waking the initiator. */
		unsigned s = wake_aware && woke ? 0 : spin;
		while ((rc = ap_ring_read(in, &p, &len)) == -EAGAIN)
			if ((rc = ap_ring_wait(in, s, 5000)) && rc != -ETIMEDOUT)
				b_die("wait", rc);
		if (rc)
			b_die("read", rc);
		ap_ring_release(in);
		if (lat) {
			lat[i] = b_now_ns() - t0;
		} else {
			if (ap_ring_reserve(out, 8, &w))
				b_die("reserve", -EAGAIN);
			memcpy(w, p, 8);
			woke = ap_ring_commit(out) == 1;
		}
	}
}

static void b_pingpong(uint64_t rounds, unsigned spin, unsigned idle_us, int wake_aware, const char *label)
{
	size_t one = ap_ring_size(4096);
	struct ap_ring_map m;
	struct ap_ring a_out, a_in;
	uint64_t *lat = calloc(rounds, sizeof *lat);
	int rc, st;

	if (!lat || (rc = ap_ring_map_create_memfd(&m, "bench_pp", 2 * one)))
		b_die("memfd", -ENOMEM);
	ap_ring_format(m.mem, one, 4096);
	ap_ring_format((uint8_t *)m.mem + one, one, 4096);
	pid_t pid = fork();
	if (pid == 0) {
		struct ap_ring b_in, b_out;
		ap_ring_attach_consumer(&b_in, m.mem, one);
		ap_ring_attach_producer(&b_out, (uint8_t *)m.mem + one, one);
		b_pong(&b_in, &b_out, rounds, spin, NULL, 0, wake_aware);
		_exit(0);
	}
	ap_ring_attach_producer(&a_out, m.mem, one);
	ap_ring_attach_consumer(&a_in, (uint8_t *)m.mem + one, one);
	b_pong(&a_in, &a_out, rounds, spin, lat, idle_us, wake_aware);
	waitpid(pid, &st, 0);
	qsort(lat, rounds, sizeof *lat, b_cmp);
	printf("%-44s p50 %7.2f us  p99 %7.2f us  (sleeps %" PRIu64 ")\n", label, (double)lat[rounds / 2] / 1e3,
	       (double)lat[rounds * 99 / 100] / 1e3, a_in.n_sleep);
	free(lat);
	ap_ring_map_close(&m);
}

int main(int argc, char **argv)
{
	uint64_t n = argc > 1 ? strtoull(argv[1], NULL, 0) : 5000000u;
	unsigned spin = AP_RING_DEFAULT_SPIN;
	char l[128];

	printf("ring between two processes, %u-byte records, cap %u KiB, %ld CPUs online\n", B_REC, B_CAP >> 10,
	       sysconf(_SC_NPROCESSORS_ONLN));
	snprintf(l, sizeof l, "commit each, spin %u + futex", spin);
	b_throughput(n, 1, spin, l);
	snprintf(l, sizeof l, "commit per 32, spin %u + futex", spin);
	b_throughput(n, 32, spin, l);
	b_throughput(n, 1, 0, "commit each, futex only");
	b_throughput(n, 32, 0, "commit per 32, futex only");

	uint64_t rounds = n / 100 < 20000 ? 20000 : n / 100;
	for (int aware = 0; aware < 2; aware++) {
		const char *a = aware ? ", wake-aware" : "";
		snprintf(l, sizeof l, "round trip, spin %u + futex%s, back to back", spin, a);
		b_pingpong(rounds, spin, 0, aware, l);
		snprintf(l, sizeof l, "round trip, spin %u + futex%s, 50 us idle", spin, a);
		b_pingpong(rounds / 4, spin, 50, aware, l);
	}
	b_pingpong(rounds, 0, 0, 0, "round trip, futex only, back to back");
	b_pingpong(rounds / 4, 0, 50, 0, "round trip, futex only, 50 us idle");
	b_pingpong(rounds, 1u << 30, 0, 0, "round trip, both spinning");

	/* What a spin round costs here, and the spin against a sleeping peer. */
	uint64_t t0 = b_now_ns();
	for (int i = 0; i < 1000000; i++)
		ap_ring_cpu_relax();
	printf("one spin round (pause) %.1f ns\n", (double)(b_now_ns() - t0) / 1e6);
	static const unsigned sweep[] = { 0, 20, 50, 100, 200, 500, 2000 };
	for (size_t i = 0; i < sizeof sweep / sizeof sweep[0]; i++) {
		snprintf(l, sizeof l, "round trip, spin %u + futex, 50 us idle", sweep[i]);
		b_pingpong(rounds / 4, sweep[i], 50, 0, l);
	}
	return 0;
}
