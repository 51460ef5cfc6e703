/* test_io: both event-loop backends receive, send, close, watch readers and accept, over real sockets. */
#include "t_helpers.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <linux/futex.h>
#include <sys/eventfd.h>
#include <sys/syscall.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include "ap_io.h"
#include "ap_log.h"
#include "ap_ring_uring.h"

#define DEADLINE_MS 30000
#define TURN_MS 20

/* What the callbacks saw. Loop thread only. */
struct t_io {
	ap_loop *l;
	/* on_data */
	uint64_t in_off;          /* stream bytes received and checked */
	uint64_t bad_at;          /* first offset that was not the stream, or UINT64_MAX */
	int data_calls;
	int zero_len_calls;
	int close_in_data;        /* 1: ap_loop_close on the first call; 2: return non-zero;
				   * 3: close the other of conns[] on the first call */
	ap_io_conn *conns[2];
	int data_after_close;
	ap_io_conn *closed_by_us;
	/* on_closed */
	int closed;
	ap_io_conn *closed_conn;
	int closed_err;
	int closed_flag_seen;
	uint64_t closed_bytes_in;
	/* on_readable */
	int readable[8];
	int reader_fd[8];
	/* on_accept */
	int accepted[8];
	int naccepted;
};

static int t_on_data(void *arg, ap_io_conn *c, const uint8_t *data, size_t n)
{
	struct t_io *t = arg;
	if (c == t->closed_by_us) {
		t->data_after_close++;
		return 0;
	}
	t->data_calls++;
	if (n == 0)
		t->zero_len_calls++;
	size_t bad = t_stream_check(data, n, t->in_off);
	if (bad != n && t->bad_at == UINT64_MAX)
		t->bad_at = t->in_off + bad;
	t->in_off += n;
	if (t->close_in_data == 1) {
		t->closed_by_us = c;
		ap_loop_close(t->l, c, 0);
		return 0;
	}
	if (t->close_in_data == 2) {
		t->closed_by_us = c;
		return 1;
	}
	if (t->close_in_data == 3 && !t->closed_by_us) {
		t->closed_by_us = c == t->conns[0] ? t->conns[1] : t->conns[0];
		ap_loop_close(t->l, t->closed_by_us, 0);
	}
	return 0;
}

static void t_on_closed(void *arg, ap_io_conn *c)
{
	struct t_io *t = arg;
	t->closed++;
	t->closed_conn = c;
	t->closed_err = c->close_err;
	t->closed_flag_seen = c->closing;
	t->closed_bytes_in = c->bytes_in;
}

static void t_on_readable(void *arg, int id)
{
	struct t_io *t = arg;
	t->readable[id]++;
	uint64_t v;
	if (t->reader_fd[id] >= 0) {
		ssize_t r = read(t->reader_fd[id], &v, sizeof v);
		(void)r;
	}
}

static void t_on_accept(void *arg, int fd)
{
	struct t_io *t = arg;
	if (t->naccepted < 8)
		t->accepted[t->naccepted++] = fd;
	else
		close(fd);
}

static const ap_io_cbs t_cbs = {
	.on_accept = t_on_accept,
	.on_data = t_on_data,
	.on_closed = t_on_closed,
	.on_readable = t_on_readable,
};

static struct t_io *t_io_new(const char *backend)
{
	struct t_io *t = calloc(1, sizeof *t);
	assert_non_null(t);
	t->bad_at = UINT64_MAX;
	for (int i = 0; i < 8; i++)
		t->reader_fd[i] = -1;
	t->l = ap_loop_new(backend, &t_cbs, t);
	assert_non_null(t->l);
	/* No silent fallback: the backend asked for is the one tested. */
	assert_string_equal(ap_loop_backend(t->l), backend);
	return t;
}

static void t_io_free(struct t_io *t)
{
	ap_loop_free(t->l);
	free(t);
}

/* Run loop turns until cond holds or DEADLINE_MS passes; the value of cond. */
#define T_RUN_UNTIL(t, cond)                                                    \
	({                                                                      \
		int64_t dl_ = t_now_ms() + DEADLINE_MS;                         \
		while (!(cond) && t_now_ms() < dl_)                             \
			assert_int_equal(ap_loop_run_once((t)->l, TURN_MS), 0); \
		(cond);                                                         \
	})

/* A few more turns, for things that must not happen. */
static void t_run_for(struct t_io *t, int ms)
{
	int64_t dl = t_now_ms() + ms;
	while (t_now_ms() < dl)
		assert_int_equal(ap_loop_run_once(t->l, TURN_MS), 0);
}

static void t_socketpair(int sv[2])
{
	assert_int_equal(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
}

/* ---- peer threads ------------------------------------------------------- */

struct t_peer {
	int fd;
	uint64_t total;
	uint64_t done;      /* bytes written / read */
	uint64_t bad_at;    /* reader: first offset not the stream, or UINT64_MAX */
	int err;            /* errno of a failed write/read, 0 if none */
	int eof;            /* reader: saw EOF before total */
	uint64_t seed;
	int ignore_epipe;   /* writer: stop quietly when the far end is gone */
	size_t max_write;   /* writer: 0 for the default mix, else sizes 1..max_write */
};

static void *t_writer(void *arg)
{
	struct t_peer *p = arg;
	t_rng r;
	t_rng_seed(&r, p->seed);
	uint8_t *buf = malloc(256 * 1024);
	if (!buf) {
		p->err = ENOMEM;
		return NULL;
	}
	while (p->done < p->total) {
		/* Mostly large writes, some tiny ones, so reads split anywhere. */
		size_t n = t_rand_range(&r, 0, 7) == 0 ? t_rand_range(&r, 1, 100) : t_rand_range(&r, 1, 256 * 1024);
		if (p->max_write)
			n = t_rand_range(&r, 1, p->max_write);
		if (n > p->total - p->done)
			n = (size_t)(p->total - p->done);
		t_stream_fill(buf, n, p->done);
		size_t at = 0;
		while (at < n) {
			ssize_t w = send(p->fd, buf + at, n - at, MSG_NOSIGNAL);
			if (w < 0 && errno == EINTR)
				continue;
			if (w < 0) {
				if (!(p->ignore_epipe && (errno == EPIPE || errno == ECONNRESET)))
					p->err = errno;
				free(buf);
				return NULL;
			}
			at += (size_t)w;
			p->done += (uint64_t)w;
		}
	}
	free(buf);
	return NULL;
}

static void *t_reader(void *arg)
{
	struct t_peer *p = arg;
	uint8_t *buf = malloc(64 * 1024);
	if (!buf) {
		p->err = ENOMEM;
		return NULL;
	}
	int64_t dl = t_now_ms() + DEADLINE_MS;
	while (p->done < p->total) {
		struct pollfd pfd = { .fd = p->fd, .events = POLLIN };
		int pr = poll(&pfd, 1, 100);
		if (pr == 0) {
			if (t_now_ms() > dl) {
				p->err = ETIMEDOUT;
				break;
			}
			continue;
		}
		ssize_t n = read(p->fd, buf, 64 * 1024);
		if (n < 0 && (errno == EINTR || errno == EAGAIN))
			continue;
		if (n < 0) {
			p->err = errno;
			break;
		}
		if (n == 0) {
			p->eof = 1;
			break;
		}
		size_t bad = t_stream_check(buf, (size_t)n, p->done);
		if (bad != (size_t)n && p->bad_at == UINT64_MAX)
			p->bad_at = p->done + bad;
		p->done += (uint64_t)n;
	}
	free(buf);
	return NULL;
}

/* Close c from our side and wait for its on_closed. */
static void t_close_conn(struct t_io *t, ap_io_conn *c)
{
	int before = t->closed;
	ap_loop_close(t->l, c, 0);
	assert_true(T_RUN_UNTIL(t, t->closed == before + 1));
	assert_ptr_equal(t->closed_conn, c);
}

/* ---- tests -------------------------------------------------------------- */

/* (a) */
static void test_peer_bytes_arrive_in_order(void **state)
{
	const char *backend = *state;
	struct t_io *t = t_io_new(backend);
	int sv[2];
	t_socketpair(sv);
	ap_io_conn *c = ap_loop_add_conn(t->l, sv[0], NULL);
	assert_non_null(c);
	assert_true(fcntl(sv[0], F_GETFL) & O_NONBLOCK); /* adopted as non-blocking */

	struct t_peer w = { .fd = sv[1], .total = 10u << 20, .seed = t_seed(backend), .bad_at = UINT64_MAX };
	pthread_t th;
	assert_int_equal(pthread_create(&th, NULL, t_writer, &w), 0);
	int ok = T_RUN_UNTIL(t, t->in_off >= w.total);
	pthread_join(th, NULL);
	assert_int_equal(w.err, 0);
	if (!ok)
		fail_msg("%s: %" PRIu64 " of %" PRIu64 " bytes arrived", backend, t->in_off, w.total);
	assert_int_equal(t->in_off, w.total);
	if (t->bad_at != UINT64_MAX)
		fail_msg("%s: received bytes differ from the sent stream at offset %" PRIu64, backend, t->bad_at);
	assert_int_equal(t->zero_len_calls, 0);
	assert_int_equal(c->bytes_in, w.total);
	print_message("[ info     ] %s: 10 MiB in %d on_data calls\n", backend, t->data_calls);

	close(sv[1]);
	assert_true(T_RUN_UNTIL(t, t->closed == 1));
	assert_int_equal(t->closed_bytes_in, w.total);
	t_io_free(t);
}

/* (a, flood) Tens of thousands of tiny writes: the receive path that
 * batches a flood of small messages must still deliver every byte in order,
 * and the close that ends the flood. */
static void test_flood_of_tiny_writes_arrives_in_order(void **state)
{
	const char *backend = *state;
	struct t_io *t = t_io_new(backend);
	int sv[2];
	t_socketpair(sv);
	ap_io_conn *c = ap_loop_add_conn(t->l, sv[0], NULL);
	assert_non_null(c);
	struct t_peer w = { .fd = sv[1], .total = 2u << 20, .seed = 11, .max_write = 64, .bad_at = UINT64_MAX };
	pthread_t th;
	assert_int_equal(pthread_create(&th, NULL, t_writer, &w), 0);
	int ok = T_RUN_UNTIL(t, t->in_off >= w.total);
	pthread_join(th, NULL);
	assert_int_equal(w.err, 0);
	if (!ok)
		fail_msg("%s: %" PRIu64 " of %" PRIu64 " bytes arrived", backend, t->in_off, w.total);
	assert_int_equal(t->in_off, w.total);
	if (t->bad_at != UINT64_MAX)
		fail_msg("%s: received bytes differ from the sent stream at offset %" PRIu64, backend, t->bad_at);
	print_message("[ info     ] %s: 2 MiB of writes up to 64 bytes in %d on_data calls\n", backend,
		      t->data_calls);
	close(sv[1]);
	assert_true(T_RUN_UNTIL(t, t->closed == 1));
	t_run_for(t, 50);
	assert_int_equal(t->closed, 1);
	t_io_free(t);
}

/* (b) */
static void test_many_small_queued_writes_arrive_in_order(void **state)
{
	const char *backend = *state;
	struct t_io *t = t_io_new(backend);
	int sv[2];
	t_socketpair(sv);
	/* A small send buffer, so sends come back short. */
	int sz = 4096;
	assert_int_equal(setsockopt(sv[0], SOL_SOCKET, SO_SNDBUF, &sz, sizeof sz), 0);
	ap_io_conn *c = ap_loop_add_conn(t->l, sv[0], NULL);
	assert_non_null(c);

	const uint64_t total = 8u << 20;
	struct t_peer rd = { .fd = sv[1], .total = total, .bad_at = UINT64_MAX };
	pthread_t th;
	assert_int_equal(pthread_create(&th, NULL, t_reader, &rd), 0);

	t_rng r;
	t_rng_seed(&r, t_seed(backend));
	uint64_t queued = 0;
	unsigned flushes = 0;
	int64_t dl = t_now_ms() + DEADLINE_MS;
	uint8_t piece[4096];
	while (queued < total && t_now_ms() < dl) {
		/* One loop turn's worth of small frames, as a busy node queues them:
		 * appended to c->out while an earlier batch may still be in flight. */
		size_t turn = t_rand_range(&r, 1, 96 * 1024);
		for (size_t k = 0; k < turn && queued < total;) {
			size_t n = t_rand_range(&r, 1, sizeof piece);
			if (n > total - queued)
				n = (size_t)(total - queued);
			t_stream_fill(piece, n, queued);
			assert_int_equal(ap_buf_append(&c->out, piece, n), 0);
			ap_loop_flush(t->l, c);
			flushes++;
			queued += n;
			k += n;
		}
		assert_int_equal(ap_loop_run_once(t->l, 0), 0);
		/* Back-pressure, as a node would apply it: let the backlog shrink
		 * before queuing more, so batches swap in and out many times. */
		size_t limit = t_rand_range(&r, 16 * 1024, 256 * 1024);
		while (c->out.len > limit && t_now_ms() < dl)
			assert_int_equal(ap_loop_run_once(t->l, TURN_MS), 0);
	}
	assert_int_equal(queued, total);
	/* Let the rest drain; the reader counts what it got. */
	int ok = T_RUN_UNTIL(t, c->bytes_out >= total && !c->sending);
	pthread_join(th, NULL);
	assert_true(ok);
	assert_int_equal(rd.err, 0);
	assert_false(rd.eof);
	assert_int_equal(rd.done, total);
	if (rd.bad_at != UINT64_MAX)
		fail_msg("%s: peer read bytes that differ from the queued stream at offset %" PRIu64, backend,
			 rd.bad_at);
	assert_int_equal(c->bytes_out, total);
	assert_int_equal(c->out.len, 0);
	/* Appends made while a send was in flight went out together, and
	 * there were many batches. */
	assert_true(c->sends < flushes);
	assert_true(c->sends > 16);
	print_message("[ info     ] %s: 8 MiB from %u appends in %" PRIu64 " sends\n", backend, flushes, c->sends);

	t_close_conn(t, c);
	close(sv[1]);
	t_io_free(t);
}

/* (b, bulk) One 8 MiB batch through a 4 KiB send buffer: hundreds of short
 * sends, each resumed where the last stopped. */
static void test_one_large_batch_survives_short_sends(void **state)
{
	const char *backend = *state;
	struct t_io *t = t_io_new(backend);
	int sv[2];
	t_socketpair(sv);
	int sz = 4096;
	assert_int_equal(setsockopt(sv[0], SOL_SOCKET, SO_SNDBUF, &sz, sizeof sz), 0);
	ap_io_conn *c = ap_loop_add_conn(t->l, sv[0], NULL);
	assert_non_null(c);

	const uint64_t total = 8u << 20;
	assert_int_equal(ap_buf_reserve(&c->out, total), 0);
	t_stream_fill(c->out.data, total, 0);
	c->out.len = total;
	ap_loop_flush(t->l, c);

	struct t_peer rd = { .fd = sv[1], .total = total, .bad_at = UINT64_MAX };
	pthread_t th;
	assert_int_equal(pthread_create(&th, NULL, t_reader, &rd), 0);
	int ok = T_RUN_UNTIL(t, c->bytes_out >= total && !c->sending);
	pthread_join(th, NULL);
	assert_true(ok);
	assert_int_equal(rd.err, 0);
	assert_int_equal(rd.done, total);
	if (rd.bad_at != UINT64_MAX)
		fail_msg("%s: peer read bytes that differ at offset %" PRIu64, backend, rd.bad_at);
	assert_int_equal(c->sends, 1); /* one batch, however many syscalls */
	t_close_conn(t, c);
	close(sv[1]);
	t_io_free(t);
}

/* (c) */
static void test_peer_close_gives_on_closed_once(void **state)
{
	const char *backend = *state;
	struct t_io *t = t_io_new(backend);
	int sv[2];
	t_socketpair(sv);
	ap_io_conn *c = ap_loop_add_conn(t->l, sv[0], NULL);
	assert_non_null(c);
	t_run_for(t, 50);
	assert_int_equal(t->closed, 0);

	/* Bytes sent just before the close still arrive, then the close. */
	uint8_t b[1000];
	t_stream_fill(b, sizeof b, 0);
	assert_int_equal(write(sv[1], b, sizeof b), (ssize_t)sizeof b);
	close(sv[1]);
	assert_true(T_RUN_UNTIL(t, t->closed == 1));
	assert_ptr_equal(t->closed_conn, c);
	assert_int_equal(t->closed_err, 0); /* EOF, not an error */
	assert_true(t->closed_flag_seen);
	assert_int_equal(t->in_off, sizeof b);
	assert_int_equal(t->bad_at, UINT64_MAX);
	t_run_for(t, 200);
	assert_int_equal(t->closed, 1);
	/* The loop closed our end: the fd number is free again. */
	assert_int_equal(fcntl(sv[0], F_GETFD), -1);
	t_io_free(t);
}

/* (d) */
static void t_close_from_on_data(const char *backend, int how)
{
	struct t_io *t = t_io_new(backend);
	t->close_in_data = how;
	int sv[2];
	t_socketpair(sv);
	ap_io_conn *c = ap_loop_add_conn(t->l, sv[0], NULL);
	assert_non_null(c);
	/* Far more than one receive: several reads' worth is waiting or on
	 * its way when the first on_data closes. */
	struct t_peer w = { .fd = sv[1], .total = 4u << 20, .seed = 7, .ignore_epipe = 1, .bad_at = UINT64_MAX };
	pthread_t th;
	assert_int_equal(pthread_create(&th, NULL, t_writer, &w), 0);
	assert_true(T_RUN_UNTIL(t, t->closed == 1));
	assert_ptr_equal(t->closed_conn, c);
	t_run_for(t, 200);
	pthread_join(th, NULL);
	assert_int_equal(w.err, 0);
	assert_int_equal(t->data_calls, 1);
	assert_int_equal(t->data_after_close, 0);
	assert_int_equal(t->closed, 1);
	assert_int_equal(t->closed_err, 0);
	assert_int_equal(t->bad_at, UINT64_MAX);
	/* The writer was cut off before the end. */
	assert_true(w.done < w.total);
	close(sv[1]);
	t_io_free(t);
}

static void test_close_from_on_data_gives_on_closed_once_and_no_more_data(void **state)
{
	t_close_from_on_data(*state, 1);
}

static void test_on_data_nonzero_return_closes_like_ap_loop_close(void **state)
{
	t_close_from_on_data(*state, 2);
}

/* A conn closed from another conn's on_data hears nothing more, even when
 * its bytes were already received in the same wakeup. */
static void test_conn_closed_from_another_callback_gets_no_more_data(void **state)
{
	const char *backend = *state;
	struct t_io *t = t_io_new(backend);
	t->close_in_data = 3;
	int a[2], b[2];
	t_socketpair(a);
	t_socketpair(b);
	/* Both peers have written before the loop first waits. */
	uint8_t buf[1000];
	t_stream_fill(buf, sizeof buf, 0);
	assert_int_equal(write(a[1], buf, sizeof buf), (ssize_t)sizeof buf);
	assert_int_equal(write(b[1], buf, sizeof buf), (ssize_t)sizeof buf);
	t->conns[0] = ap_loop_add_conn(t->l, a[0], NULL);
	t->conns[1] = ap_loop_add_conn(t->l, b[0], NULL);
	assert_non_null(t->conns[0]);
	assert_non_null(t->conns[1]);
	assert_true(T_RUN_UNTIL(t, t->closed == 1));
	ap_io_conn *survivor = t->closed_conn == t->conns[0] ? t->conns[1] : t->conns[0];
	t_run_for(t, 100);
	assert_int_equal(t->data_after_close, 0);
	assert_int_equal(t->data_calls, 1); /* the survivor's bytes, in one read */
	assert_int_equal(t->closed, 1);
	t_close_conn(t, survivor);
	close(a[1]);
	close(b[1]);
	t_io_free(t);
}

/* Closing twice, or closing with bytes still queued, reports once. */
static void test_double_close_with_pending_output_reports_once(void **state)
{
	const char *backend = *state;
	struct t_io *t = t_io_new(backend);
	int sv[2];
	t_socketpair(sv);
	ap_io_conn *c = ap_loop_add_conn(t->l, sv[0], NULL);
	assert_non_null(c);
	assert_int_equal(ap_buf_append(&c->out, "queued", 6), 0);
	ap_loop_flush(t->l, c);
	ap_loop_close(t->l, c, ECONNRESET);
	ap_loop_close(t->l, c, 0);
	assert_true(T_RUN_UNTIL(t, t->closed == 1));
	assert_int_equal(t->closed_err, ECONNRESET); /* the first reason stands */
	t_run_for(t, 100);
	assert_int_equal(t->closed, 1);
	close(sv[1]);
	t_io_free(t);
}

/* (e) */
static void test_eventfd_reader_triggers_on_readable(void **state)
{
	const char *backend = *state;
	struct t_io *t = t_io_new(backend);
	int efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
	assert_true(efd >= 0);
	t->reader_fd[3] = efd;
	assert_int_equal(ap_loop_add_reader(t->l, efd, 3), 0);
	assert_int_equal(ap_loop_add_reader(t->l, efd, 8), -EINVAL);
	assert_int_equal(ap_loop_add_reader(t->l, efd, -1), -EINVAL);

	t_run_for(t, 60);
	assert_int_equal(t->readable[3], 0); /* nothing written yet */

	uint64_t one = 1;
	for (int round = 1; round <= 3; round++) {
		assert_int_equal(write(efd, &one, sizeof one), sizeof one);
		assert_true(T_RUN_UNTIL(t, t->readable[3] == round));
		/* The callback read it: no more wakeups until the next write. */
		t_run_for(t, 60);
		assert_int_equal(t->readable[3], round);
	}
	for (int i = 0; i < 8; i++)
		if (i != 3)
			assert_int_equal(t->readable[i], 0);
	t_io_free(t);
	close(efd);
}

/* ---- futex waits in the loop (the pool node's ring doorbells) ---------- */

struct t_fw {
	ap_io_futex f;
	int done;
	int res;
};

static void t_fw_done(ap_io_futex *f, int res)
{
	struct t_fw *w = f->arg;
	w->done++;
	w->res = res;
}

static void t_fw_init(struct t_fw *w)
{
	memset(w, 0, sizeof *w);
	w->f.done = t_fw_done;
	w->f.arg = w;
}

/* io_uring on this kernel: woken, stale, timed out, cancelled, each
 * reported once; epoll (or a kernel without futex ops): -ENOTSUP. */
static void test_futex_wait_completes_once_for_each_outcome(void **state)
{
	const char *backend = *state;
	struct t_io *t = t_io_new(backend);
	uint32_t word = 0;
	struct t_fw w;
	t_fw_init(&w);
	if (!ap_loop_futex_supported(t->l)) {
		/* epoll always; io_uring only on kernels before 6.7 */
		if (!strcmp(backend, "uring"))
			assert_false(ap_ring_uring_futex_supported(NULL));
		assert_int_equal(ap_loop_futex_wait(t->l, &w.f, &word, 0, 1000), -ENOTSUP);
		t_io_free(t);
		return;
	}

	/* Woken: the word moves and FUTEX_WAKE comes, as a producer rings. */
	assert_int_equal(ap_loop_futex_wait(t->l, &w.f, &word, 0, 10000), 0);
	t_run_for(t, 60);
	assert_int_equal(w.done, 0); /* armed, nothing rang */
	__atomic_store_n(&word, 1, __ATOMIC_RELEASE);
	/* shared (no FUTEX_PRIVATE_FLAG), as the ring's wake-ups are */
	assert_true(syscall(SYS_futex, &word, FUTEX_WAKE, 1, NULL, NULL, 0) >= 0);
	assert_true(T_RUN_UNTIL(t, w.done == 1));
	assert_int_equal(w.res, 0);

	/* Stale: the word no longer holds what the sleeper saw. */
	t_fw_init(&w);
	assert_int_equal(ap_loop_futex_wait(t->l, &w.f, &word, 0, 10000), 0);
	assert_true(T_RUN_UNTIL(t, w.done == 1));
	assert_int_equal(w.res, -EAGAIN);

	/* Timed out: the linked timeout cancels it; its own CQE is not a
	 * second completion. */
	t_fw_init(&w);
	int64_t t0 = t_now_ms();
	assert_int_equal(ap_loop_futex_wait(t->l, &w.f, &word, 1, 50), 0);
	assert_true(T_RUN_UNTIL(t, w.done == 1));
	assert_int_equal(w.res, -ECANCELED);
	assert_true(t_now_ms() - t0 >= 40);
	t_run_for(t, 100);
	assert_int_equal(w.done, 1);

	/* Cancelled long before its timeout: reported at once, so the word's
	 * memory can go. */
	t_fw_init(&w);
	assert_int_equal(ap_loop_futex_wait(t->l, &w.f, &word, 1, 60000), 0);
	t_run_for(t, 40);
	assert_int_equal(w.done, 0);
	ap_loop_futex_cancel(t->l, &w.f);
	assert_true(T_RUN_UNTIL(t, w.done == 1));
	assert_int_equal(w.res, -ECANCELED);
	t_run_for(t, 60);
	assert_int_equal(w.done, 1);
	t_io_free(t);
}

/* A listener on an ephemeral loopback port, handed to t's loop; its
 * address in *a. */
static int t_listen_loopback(struct t_io *t, int backlog, struct sockaddr_in *a)
{
	int lfd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
	assert_true(lfd >= 0);
	*a = (struct sockaddr_in){ .sin_family = AF_INET, .sin_port = 0 };
	a->sin_addr.s_addr = htonl(INADDR_LOOPBACK);
	assert_int_equal(bind(lfd, (struct sockaddr *)a, sizeof *a), 0);
	assert_int_equal(listen(lfd, backlog), 0);
	socklen_t alen = sizeof *a;
	assert_int_equal(getsockname(lfd, (struct sockaddr *)a, &alen), 0);
	assert_int_equal(ap_loop_listen(t->l, lfd), 0);
	return lfd;
}

/* (f) */
static void test_listener_accepts_with_a_valid_blocking_fd(void **state)
{
	const char *backend = *state;
	struct t_io *t = t_io_new(backend);
	struct sockaddr_in a;
	int lfd = t_listen_loopback(t, 16, &a);
	socklen_t alen;

	int cl[2];
	struct sockaddr_in local[2];
	for (int i = 0; i < 2; i++) {
		cl[i] = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
		assert_true(cl[i] >= 0);
		assert_int_equal(connect(cl[i], (struct sockaddr *)&a, sizeof a), 0);
		alen = sizeof local[i];
		assert_int_equal(getsockname(cl[i], (struct sockaddr *)&local[i], &alen), 0);
		/* One accept per client: the listener stays armed. */
		assert_true(T_RUN_UNTIL(t, t->naccepted == i + 1));
	}
	for (int i = 0; i < 2; i++) {
		int fd = t->accepted[i];
		assert_true(fd >= 0);
		assert_true(fcntl(fd, F_GETFD) & FD_CLOEXEC);
		assert_false(fcntl(fd, F_GETFL) & O_NONBLOCK);
		/* It is the client's connection... */
		struct sockaddr_in peer;
		alen = sizeof peer;
		assert_int_equal(getpeername(fd, (struct sockaddr *)&peer, &alen), 0);
		assert_int_equal(peer.sin_port, local[i].sin_port);
		/* ...and carries its bytes. */
		assert_int_equal(write(cl[i], "hi", 2), 2);
		char buf[2];
		assert_int_equal(read(fd, buf, 2), 2);
		assert_memory_equal(buf, "hi", 2);
		close(fd);
		close(cl[i]);
	}
	t_run_for(t, 50);
	assert_int_equal(t->naccepted, 2);
	t_io_free(t);
	close(lfd);
}

/* (g) */
#define T_FDLIMIT_CLIENTS 6

static struct rlimit t_saved_nofile;

static int t_restore_nofile(void **state)
{
	(void)state;
	if (t_saved_nofile.rlim_cur)
		setrlimit(RLIMIT_NOFILE, &t_saved_nofile);
	return 0;
}

/* Out of fds, accepts pause instead of failing in a loop: the loop turns at
 * its own pace, the clients it cannot take are closed (not left hanging),
 * and once fds are back a new client is accepted. */
static void test_accept_at_the_fd_limit_pauses_sheds_and_resumes(void **state)
{
	const char *backend = *state;
	struct t_io *t = t_io_new(backend);
	struct sockaddr_in a;
	int lfd = t_listen_loopback(t, 64, &a);
	int cl[T_FDLIMIT_CLIENTS];
	for (int i = 0; i < T_FDLIMIT_CLIENTS; i++) {
		cl[i] = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
		assert_true(cl[i] >= 0);
		assert_int_equal(connect(cl[i], (struct sockaddr *)&a, sizeof a), 0);
	}
	/* Room for exactly one more fd: the lowest free one is the last. */
	int probe = dup(0);
	assert_true(probe >= 0);
	close(probe);
	assert_int_equal(getrlimit(RLIMIT_NOFILE, &t_saved_nofile), 0);
	struct rlimit low = { .rlim_cur = (rlim_t)probe + 1, .rlim_max = t_saved_nofile.rlim_max };
	assert_int_equal(setrlimit(RLIMIT_NOFILE, &low), 0);

	int turns = 0;
	int64_t end = t_now_ms() + 500;
	while (t_now_ms() < end) {
		assert_int_equal(ap_loop_run_once(t->l, TURN_MS), 0);
		turns++;
	}
	assert_int_equal(t->naccepted, 1);
	/* A spinning loop turns thousands of times in 500 ms; a paused one
	 * about once per TURN_MS, plus a wakeup per end of pause. */
	if (turns > 100)
		fail_msg("%d loop turns in 500 ms at the fd limit", turns);
	int eof = 0, open = 0;
	for (int i = 0; i < T_FDLIMIT_CLIENTS; i++) {
		char c;
		ssize_t r = recv(cl[i], &c, 1, MSG_DONTWAIT);
		if (r == 0 || (r < 0 && errno == ECONNRESET))
			eof++;
		else if (r < 0 && errno == EAGAIN)
			open++;
	}
	assert_int_equal(open, 1);
	assert_int_equal(eof, T_FDLIMIT_CLIENTS - 1);

	/* Fds come back: the next client is taken. */
	assert_int_equal(setrlimit(RLIMIT_NOFILE, &t_saved_nofile), 0);
	close(t->accepted[0]);
	int late = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
	assert_true(late >= 0);
	assert_int_equal(connect(late, (struct sockaddr *)&a, sizeof a), 0);
	assert_true(T_RUN_UNTIL(t, t->naccepted == 2));
	close(t->accepted[1]);
	close(late);
	for (int i = 0; i < T_FDLIMIT_CLIENTS; i++)
		close(cl[i]);
	t_io_free(t);
	close(lfd);
}

/* Every test once per backend, named for both. */
#define BOTH(fn) { #fn "(uring)", fn, NULL, NULL, (void *)"uring" }, { #fn "(epoll)", fn, NULL, NULL, (void *)"epoll" }

int main(void)
{
	signal(SIGPIPE, SIG_IGN);
	ap_log_set_level(AP_LOG_NOTICE);
	const struct CMUnitTest tests[] = {
		BOTH(test_peer_bytes_arrive_in_order),
		BOTH(test_flood_of_tiny_writes_arrives_in_order),
		BOTH(test_many_small_queued_writes_arrive_in_order),
		BOTH(test_one_large_batch_survives_short_sends),
		BOTH(test_peer_close_gives_on_closed_once),
		BOTH(test_close_from_on_data_gives_on_closed_once_and_no_more_data),
		BOTH(test_on_data_nonzero_return_closes_like_ap_loop_close),
		BOTH(test_conn_closed_from_another_callback_gets_no_more_data),
		BOTH(test_double_close_with_pending_output_reports_once),
		BOTH(test_eventfd_reader_triggers_on_readable),
		BOTH(test_futex_wait_completes_once_for_each_outcome),
		BOTH(test_listener_accepts_with_a_valid_blocking_fd),
		{ "test_accept_at_the_fd_limit_pauses_sheds_and_resumes(uring)",
		  test_accept_at_the_fd_limit_pauses_sheds_and_resumes, NULL, t_restore_nofile, (void *)"uring" },
		{ "test_accept_at_the_fd_limit_pauses_sheds_and_resumes(epoll)",
		  test_accept_at_the_fd_limit_pauses_sheds_and_resumes, NULL, t_restore_nofile, (void *)"epoll" },
	};
	return cmocka_run_group_tests(tests, NULL, NULL);
}
