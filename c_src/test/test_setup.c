/* test_setup: incoming handshakes are bounded: the listen address, oversized and slow first packets, the deadline, the caps, fair eviction by source, a prompt stop. */
#include "t_helpers.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include "ap_sendq.h"
#include "ap_setup.h"

#define WAIT_MS 10000

/* One ap_setup on a listener of its own; the test plays the event loop and
 * accepts for it. */
struct t_setup {
	ei_cnode ec;
	ap_sendq q;
	ap_setup *s;
	int lfd, port;
};

static void t_start(struct t_setup *t, const ap_setup_cfg *cfg)
{
	memset(t, 0, sizeof *t);
	assert_int_equal(ap_ei_init(&t->ec, "t_setup@localhost", "t_cookie", 77), 0);
	t->lfd = ap_ei_listen(&t->ec, "127.0.0.1", &t->port);
	assert_true(t->lfd >= 0);
	assert_int_equal(ap_sendq_init(&t->q), 0);
	t->q.dispose = ap_setup_dispose;
	t->s = ap_setup_start(&t->ec, &t->q, cfg);
	assert_non_null(t->s);
	ap_setup_set_listener(t->s, t->lfd);
}

static void t_stop(struct t_setup *t)
{
	ap_setup_stop(t->s);
	ei_close_connection(t->lfd);
	ap_sendq_destroy(&t->q);
}

/* A client socket from source address src (loopback: all of 127/8 is
 * local) connected to the listener, not yet accepted. */
static int t_connect_from(struct t_setup *t, const char *src)
{
	struct sockaddr_in a = { .sin_family = AF_INET, .sin_port = htons((uint16_t)t->port) };
	a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
	int c = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
	assert_true(c >= 0);
	struct sockaddr_in b = { .sin_family = AF_INET };
	assert_int_equal(inet_pton(AF_INET, src, &b.sin_addr), 1);
	assert_int_equal(bind(c, (struct sockaddr *)&b, sizeof b), 0);
	assert_int_equal(connect(c, (struct sockaddr *)&a, sizeof a), 0);
	return c;
}

/* The server side of the next connection, as the loop accepts it. */
static int t_accept(struct t_setup *t)
{
	int fd = accept4(t->lfd, NULL, NULL, SOCK_CLOEXEC);
	assert_true(fd >= 0);
	return fd;
}

/* A client from src, and the server side handed over. */
static int t_client_from(struct t_setup *t, const char *src)
{
	int c = t_connect_from(t, src);
	ap_setup_accept(t->s, t_accept(t));
	return c;
}

static int t_client(struct t_setup *t) { return t_client_from(t, "127.0.0.1"); }

static void t_send(int c, const void *p, size_t n)
{
	assert_int_equal(send(c, p, n, MSG_NOSIGNAL), (ssize_t)n);
}

/* A well-formed name packet ('N', flags, creation, name), as a node sends. */
static void t_send_name(int c)
{
	static const char name[] = "t_peer@localhost";
	uint8_t b[2 + 1 + 8 + 4 + 2 + sizeof name];
	size_t nl = sizeof name - 1, len = 1 + 8 + 4 + 2 + nl;
	uint64_t flags = 0x17FFFFFFFull;
	b[0] = (uint8_t)(len >> 8);
	b[1] = (uint8_t)len;
	b[2] = 'N';
	for (int i = 0; i < 8; i++)
		b[3 + i] = (uint8_t)(flags >> (56 - 8 * i));
	memset(b + 11, 0, 3);
	b[14] = 7;
	b[15] = 0;
	b[16] = (uint8_t)nl;
	memcpy(b + 17, name, nl);
	t_send(c, b, 2 + len);
}

/* Read until the server closes c; its time from now, or -1 after WAIT_MS.
 * *got (if given) is set when the server answered anything first. */
static int64_t t_closed_in(int c, int *got)
{
	int64_t t0 = t_now_ms();
	for (;;) {
		int64_t left = t0 + WAIT_MS - t_now_ms();
		if (left <= 0)
			return -1;
		struct pollfd p = { .fd = c, .events = POLLIN };
		if (poll(&p, 1, (int)left) <= 0)
			continue;
		char buf[256];
		ssize_t n = recv(c, buf, sizeof buf, 0);
		if (n > 0) {
			if (got)
				*got = 1;
			continue;
		}
		return t_now_ms() - t0;
	}
}

/* Wait up to ms for the node's answer to c's name (a handshake thread
 * took c) and read it; its time, or -1. */
static int64_t t_answered_in(int c, int ms)
{
	int64_t t0 = t_now_ms();
	struct pollfd p = { .fd = c, .events = POLLIN };
	if (poll(&p, 1, ms) != 1)
		return -1;
	char buf[256];
	if (recv(c, buf, sizeof buf, MSG_DONTWAIT) <= 0)
		return -1;
	return t_now_ms() - t0;
}

/* Whether c is still open (nothing closed it) after ms; reads what the
 * node sent meanwhile, so that a close behind data counts. */
static int t_open_after(int c, int ms)
{
	struct pollfd p = { .fd = c, .events = POLLIN };
	if (poll(&p, 1, ms) == 0)
		return 1;
	for (;;) {
		char buf[256];
		ssize_t n = recv(c, buf, sizeof buf, MSG_DONTWAIT);
		if (n == 0)
			return 0;
		if (n < 0)
			return errno == EAGAIN || errno == EWOULDBLOCK;
	}
}

/* The stats once `field` reached `want` (counters move on the setup's
 * threads, just after the socket closes); fails after WAIT_MS. */
#define T_WAIT_STAT(t, field, want)                                                      \
	({                                                                               \
		ap_setup_stats st_;                                                      \
		int64_t until_ = t_now_ms() + WAIT_MS;                                   \
		for (;;) {                                                               \
			ap_setup_get_stats((t)->s, &st_);                                \
			if (st_.field >= (want))                                         \
				break;                                                   \
			if (t_now_ms() >= until_)                                        \
				fail_msg(#field " stayed at %llu", st_.field);           \
			poll(NULL, 0, 5);                                                \
		}                                                                        \
		st_;                                                                     \
	})

static void listen_address_is_the_one_given(void **state)
{
	(void)state;
	assert_int_equal(ap_listen_addr_ok(NULL), 0);
	assert_int_equal(ap_listen_addr_ok(""), 0);
	assert_int_equal(ap_listen_addr_ok("10.1.2.3"), 0);
	assert_int_equal(ap_listen_addr_ok("bogus"), -1);
	assert_int_equal(ap_listen_addr_ok("::1"), -1);
	assert_int_equal(ap_listen_addr_ok("1.2.3.4.5"), -1);
	assert_int_equal(ap_listen_addr_ok("256.1.1.1"), -1);

	ei_cnode ec;
	assert_int_equal(ap_ei_init(&ec, "t_listen@localhost", "t_cookie", 78), 0);
	const char *addrs[] = { "127.0.0.1", NULL };
	const uint32_t want[] = { INADDR_LOOPBACK, INADDR_ANY };
	for (int i = 0; i < 2; i++) {
		int port;
		int lfd = ap_ei_listen(&ec, addrs[i], &port);
		assert_true(lfd >= 0);
		struct sockaddr_in a;
		socklen_t sl = sizeof a;
		assert_int_equal(getsockname(lfd, (struct sockaddr *)&a, &sl), 0);
		assert_int_equal(ntohl(a.sin_addr.s_addr), want[i]);
		assert_int_equal(ntohs(a.sin_port), port);
		ei_close_connection(lfd);
	}
	assert_int_equal(ap_ei_listen(&ec, "bogus", &(int){ 0 }), -1);
}

static void oversized_first_packet_is_refused_at_once(void **state)
{
	(void)state;
	struct t_setup t;
	t_start(&t, &(ap_setup_cfg){ .handshake_ms = 5000 });
	int c = t_client(&t);
	t_send(c, "\xff\xff", 2);
	int64_t ms = t_closed_in(c, NULL);
	assert_true(ms >= 0 && ms < 1000);
	ap_setup_stats st = T_WAIT_STAT(&t, too_large, 1);
	assert_int_equal(st.pending, 0);
	close(c);
	t_stop(&t);
}

/* A first packet trickling in, then a name followed by silence: each is
 * dropped at the deadline of the whole handshake, not of each read. */
static void deadline_covers_the_whole_handshake(void **state)
{
	(void)state;
	struct t_setup t;
	t_start(&t, &(ap_setup_cfg){ .handshake_ms = 400 });
	int slow = t_client(&t);
	t_send(slow, "\x00\x40N", 3);
	int64_t t0 = t_now_ms(), closed = -1;
	while (t_now_ms() - t0 < WAIT_MS) {
		if (send(slow, "x", 1, MSG_NOSIGNAL) != 1 || !t_open_after(slow, 50)) {
			closed = t_now_ms() - t0;
			break;
		}
	}
	assert_true(closed >= 350 && closed < 2000);
	T_WAIT_STAT(&t, timed_out, 1);

	int stall = t_client(&t);
	t_send_name(stall);
	int answered = 0;
	int64_t ms = t_closed_in(stall, &answered);
	assert_true(answered); /* a handshake thread took it */
	assert_true(ms >= 350 && ms < 2000);
	T_WAIT_STAT(&t, timed_out, 2);
	close(slow);
	close(stall);
	t_stop(&t);
}

/* At the per-source cap the oldest of that source goes; at the overall
 * cap, all from one source, the oldest of all. Newcomers always get in. */
static void caps_drop_the_oldest(void **state)
{
	(void)state;
	struct t_setup t;
	t_start(&t, &(ap_setup_cfg){ .handshake_ms = 5000, .max_pending = 100, .max_per_source = 3 });
	int c[5];
	for (int i = 0; i < 5; i++)
		c[i] = t_client(&t);
	ap_setup_stats st = T_WAIT_STAT(&t, capped, 2);
	assert_int_equal(st.pending, 3);
	assert_true(t_closed_in(c[0], NULL) >= 0);
	assert_true(t_closed_in(c[1], NULL) >= 0);
	for (int i = 2; i < 5; i++)
		assert_true(t_open_after(c[i], 50));
	for (int i = 0; i < 5; i++)
		close(c[i]);
	t_stop(&t);

	t_start(&t, &(ap_setup_cfg){ .handshake_ms = 5000, .max_pending = 2, .max_per_source = 100 });
	for (int i = 0; i < 3; i++)
		c[i] = t_client(&t);
	st = T_WAIT_STAT(&t, capped, 1);
	assert_int_equal(st.pending, 2);
	assert_true(t_closed_in(c[0], NULL) >= 0);
	assert_true(t_open_after(c[1], 50) && t_open_after(c[2], 50));
	for (int i = 0; i < 3; i++)
		close(c[i]);
	t_stop(&t);
}

/* At the overall cap the newcomer's room comes from the source holding the
 * most (its own when it holds as many), never from a lone older one: a
 * churning flood from other addresses cannot push a node's connection out. */
static void overall_cap_drops_from_the_source_holding_the_most(void **state)
{
	(void)state;
	struct t_setup t;
	t_start(&t, &(ap_setup_cfg){ .handshake_ms = 5000, .max_pending = 4, .max_per_source = 100 });
	int lone = t_client_from(&t, "127.0.0.1"); /* the oldest of all */
	int f[5];
	for (int i = 0; i < 3; i++)
		f[i] = t_client_from(&t, "127.0.0.3");
	f[3] = t_client_from(&t, "127.0.0.3"); /* its own oldest goes */
	f[4] = t_client_from(&t, "127.0.0.4"); /* the oldest of 127.0.0.3 goes */
	ap_setup_stats st = T_WAIT_STAT(&t, capped, 2);
	assert_int_equal(st.pending, 4);
	assert_true(t_closed_in(f[0], NULL) >= 0);
	assert_true(t_closed_in(f[1], NULL) >= 0);
	assert_true(t_open_after(lone, 50));
	for (int i = 2; i < 5; i++)
		assert_true(t_open_after(f[i], 0));
	/* 127.0.0.3 still holds the most (two): a newcomer from a source of
	 * its own takes its oldest, not the lone one's older entry. */
	int g = t_client_from(&t, "127.0.0.5");
	assert_true(t_closed_in(f[2], NULL) >= 0);
	assert_true(t_open_after(g, 50) && t_open_after(lone, 0) && t_open_after(f[4], 0));
	st = T_WAIT_STAT(&t, capped, 3);
	assert_int_equal(st.pending, 4);
	close(lone);
	close(g);
	for (int i = 0; i < 5; i++)
		close(f[i]);
	t_stop(&t);
}

/* One handshake thread, held by a peer that sent its name and stalls: a
 * ready newcomer evicts it after the grace, long before its deadline. */
static void stalled_handshake_is_evicted_for_a_ready_one(void **state)
{
	(void)state;
	struct t_setup t;
	t_start(&t, &(ap_setup_cfg){ .handshake_ms = 5000, .threads = 1, .grace_ms = 100 });
	int a = t_client(&t);
	t_send_name(a);
	int answered = 0;
	/* a is on the thread once the node answered its name. */
	struct pollfd p = { .fd = a, .events = POLLIN };
	assert_int_equal(poll(&p, 1, WAIT_MS), 1);
	int b = t_client(&t);
	t_send_name(b);
	int64_t ms = t_closed_in(a, &answered);
	assert_true(answered);
	assert_true(ms >= 0 && ms < 2000);
	p.fd = b;
	assert_int_equal(poll(&p, 1, WAIT_MS), 1); /* b got the thread */
	ap_setup_stats st = T_WAIT_STAT(&t, evicted, 1);
	assert_int_equal(st.timed_out, 0);
	close(a);
	close(b);
	t_stop(&t);
}

/* An outgoing connect (the parent node) has a thread of its own: it is
 * not queued behind an incoming handshake that holds every thread. */
static void connect_does_not_wait_behind_incoming_handshakes(void **state)
{
	(void)state;
	struct t_setup t;
	t_start(&t, &(ap_setup_cfg){ .handshake_ms = 5000, .threads = 1 });
	int a = t_client(&t);
	t_send_name(a);
	struct pollfd p = { .fd = a, .events = POLLIN };
	assert_int_equal(poll(&p, 1, WAIT_MS), 1); /* a holds the only thread */
	int64_t t0 = t_now_ms();
	ap_setup_connect(t.s, "t_nosuch@localhost", 9);
	ap_sendq_item *it = NULL;
	while (!it && t_now_ms() - t0 < WAIT_MS) {
		p = (struct pollfd){ .fd = ap_sendq_fd(&t.q), .events = POLLIN };
		poll(&p, 1, 100);
		it = ap_sendq_drain(&t.q);
	}
	assert_non_null(it);
	assert_true(t_now_ms() - t0 < 2000);
	assert_int_equal(it->kind, AP_Q_CONN_FAILED);
	ap_setup_result res;
	memcpy(&res, it->data, sizeof res);
	assert_int_equal(res.tag, 9);
	assert_string_equal(it->node, "t_nosuch@localhost");
	assert_null(it->next);
	free(it);
	assert_true(t_open_after(a, 0)); /* still on its thread */
	close(a);
	t_stop(&t);
}

/* Stalled handshakes from one address hold at most threads - 1 threads:
 * a node from another address gets the free one at once instead of after
 * the grace (5 s here). */
static void a_flooding_source_leaves_a_thread_for_other_sources(void **state)
{
	(void)state;
	struct t_setup t;
	t_start(&t, &(ap_setup_cfg){ .handshake_ms = 10000, .threads = 2, .grace_ms = 5000 });
	int f[3];
	for (int i = 0; i < 3; i++) {
		f[i] = t_client_from(&t, "127.0.0.3");
		t_send_name(f[i]);
	}
	struct pollfd p[3];
	for (int i = 0; i < 3; i++)
		p[i] = (struct pollfd){ .fd = f[i], .events = POLLIN };
	assert_true(poll(p, 3, WAIT_MS) >= 1); /* the flood is on a thread */
	int n = t_client(&t);
	t_send_name(n);
	int64_t ms = t_answered_in(n, WAIT_MS);
	assert_true(ms >= 0 && ms < 1000);
	close(n);
	for (int i = 0; i < 3; i++)
		close(f[i]);
	t_stop(&t);
}

/* One thread, held by a stalled peer from 127.0.0.3. Ready next: a node
 * from 127.0.0.1, then another stalled peer from 127.0.0.3. After the
 * grace the node goes first (its source runs nothing; oldest first), not
 * the newest; then the newest still gets its turn. */
static void threads_go_to_the_least_served_source_oldest_first(void **state)
{
	(void)state;
	struct t_setup t;
	t_start(&t, &(ap_setup_cfg){ .handshake_ms = 10000, .threads = 1, .grace_ms = 100 });
	int a = t_client_from(&t, "127.0.0.3");
	t_send_name(a);
	assert_true(t_answered_in(a, WAIT_MS) >= 0);
	int b = t_client_from(&t, "127.0.0.1");
	t_send_name(b);
	int c = t_client_from(&t, "127.0.0.3");
	t_send_name(c);
	int64_t ms = t_answered_in(b, WAIT_MS);
	assert_true(ms >= 0 && ms < 2000);
	assert_true(t_answered_in(c, 0) < 0); /* not before b */
	assert_true(t_answered_in(c, WAIT_MS) >= 0);
	ap_setup_stats st = T_WAIT_STAT(&t, evicted, 2);
	assert_int_equal(st.timed_out, 0);
	close(a);
	close(b);
	close(c);
	t_stop(&t);
}

/* One thread, held by a stalled peer from 127.0.0.3. Ready next: two
 * stalled peers from 127.0.0.4, then a node from 127.0.0.1. After the
 * grace the node goes first (its source holds the fewest pending), not the
 * oldest: however many addresses a flood comes from, each holding many
 * cannot keep a node behind them. */
static void threads_go_first_to_the_source_holding_the_fewest(void **state)
{
	(void)state;
	struct t_setup t;
	t_start(&t, &(ap_setup_cfg){ .handshake_ms = 10000, .threads = 1, .grace_ms = 300 });
	int a = t_client_from(&t, "127.0.0.3");
	t_send_name(a);
	assert_true(t_answered_in(a, WAIT_MS) >= 0);
	int b[2];
	for (int i = 0; i < 2; i++) {
		b[i] = t_client_from(&t, "127.0.0.4");
		t_send_name(b[i]);
	}
	int n = t_client_from(&t, "127.0.0.1");
	t_send_name(n);
	int64_t ms = t_answered_in(n, WAIT_MS);
	assert_true(ms >= 0 && ms < 2000);
	assert_true(t_answered_in(b[0], 0) < 0); /* not before n */
	assert_true(t_answered_in(b[0], WAIT_MS) >= 0);
	close(a);
	close(b[0]);
	close(b[1]);
	close(n);
	t_stop(&t);
}

/* Two names that arrive together, one thread: the first runs, the second
 * evicts it after the grace, long before either deadline; nobody sleeps
 * through the gap. */
static void two_ready_at_once_with_one_thread_are_both_served(void **state)
{
	(void)state;
	struct t_setup t;
	t_start(&t, &(ap_setup_cfg){ .handshake_ms = 5000, .threads = 1, .grace_ms = 100 });
	int c[2], fd[2];
	for (int i = 0; i < 2; i++) {
		c[i] = t_connect_from(&t, "127.0.0.1");
		t_send_name(c[i]);
	}
	for (int i = 0; i < 2; i++)
		fd[i] = t_accept(&t);
	ap_setup_accept(t.s, fd[0]);
	ap_setup_accept(t.s, fd[1]);
	int64_t t0 = t_now_ms();
	struct pollfd p[2] = { { .fd = c[0], .events = POLLIN }, { .fd = c[1], .events = POLLIN } };
	int answered[2] = { 0, 0 };
	while (!(answered[0] && answered[1]) && t_now_ms() - t0 < WAIT_MS) {
		if (poll(p, 2, 100) <= 0)
			continue;
		for (int i = 0; i < 2; i++) {
			char buf[256];
			if ((p[i].revents & POLLIN) && recv(c[i], buf, sizeof buf, MSG_DONTWAIT) > 0)
				answered[i] = 1;
		}
	}
	assert_true(answered[0] && answered[1]);
	assert_true(t_now_ms() - t0 < 2000);
	ap_setup_stats st = T_WAIT_STAT(&t, evicted, 1);
	assert_int_equal(st.timed_out, 0);
	close(c[0]);
	close(c[1]);
	t_stop(&t);
}

/* At the cap, with only a running handshake that has not had its grace
 * to drop, a bare connect is refused; the handshake goes on. */
static void a_bare_connect_never_cuts_a_running_handshake_short(void **state)
{
	(void)state;
	struct t_setup t;
	t_start(&t, &(ap_setup_cfg){ .handshake_ms = 10000, .max_pending = 1, .grace_ms = 5000 });
	int a = t_client(&t);
	t_send_name(a);
	assert_true(t_answered_in(a, WAIT_MS) >= 0);
	int b = t_client(&t);
	int64_t ms = t_closed_in(b, NULL);
	assert_true(ms >= 0 && ms < 1000);
	assert_true(t_open_after(a, 200));
	ap_setup_stats st = T_WAIT_STAT(&t, capped, 1);
	assert_int_equal(st.evicted, 0);
	assert_int_equal(st.pending, 1);
	close(a);
	close(b);
	t_stop(&t);
}

/* Four threads, two held by each of two sources (127.0.0.1 first, so its
 * handshakes are the oldest). A third ready socket from 127.0.0.3 takes
 * one of its own source's threads after the grace, not the oldest
 * handshake of a source that holds no more than its own. */
static void eviction_never_takes_from_a_source_holding_no_more(void **state)
{
	(void)state;
	struct t_setup t;
	t_start(&t, &(ap_setup_cfg){ .handshake_ms = 10000, .threads = 4, .grace_ms = 100 });
	const char *src[4] = { "127.0.0.1", "127.0.0.1", "127.0.0.3", "127.0.0.3" };
	int c[4];
	for (int i = 0; i < 4; i++) {
		c[i] = t_client_from(&t, src[i]);
		t_send_name(c[i]);
		assert_true(t_answered_in(c[i], WAIT_MS) >= 0);
	}
	int n = t_client_from(&t, "127.0.0.3");
	t_send_name(n);
	int64_t ms = t_answered_in(n, WAIT_MS);
	assert_true(ms >= 0 && ms < 2000);
	assert_true(t_closed_in(c[2], NULL) >= 0); /* the oldest of 127.0.0.3 */
	assert_true(t_open_after(c[0], 0) && t_open_after(c[1], 0) && t_open_after(c[3], 0));
	ap_setup_stats st = T_WAIT_STAT(&t, evicted, 1);
	assert_int_equal(st.evicted, 1);
	for (int i = 0; i < 4; i++)
		close(c[i]);
	close(n);
	t_stop(&t);
}

/* Stop returns at once while a connect waits on an epmd that never
 * answers (ei's own lookup would hold it for the whole timeout). */
static void stop_is_prompt_while_a_connect_waits_for_epmd(void **state)
{
	(void)state;
	int l = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
	struct sockaddr_in a = { .sin_family = AF_INET };
	a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
	assert_int_equal(bind(l, (struct sockaddr *)&a, sizeof a), 0);
	assert_int_equal(listen(l, 4), 0);
	socklen_t sl = sizeof a;
	assert_int_equal(getsockname(l, (struct sockaddr *)&a, &sl), 0);
	char port[16];
	snprintf(port, sizeof port, "%d", ntohs(a.sin_port));
	assert_int_equal(setenv("ERL_EPMD_PORT", port, 1), 0);
	struct t_setup t;
	t_start(&t, &(ap_setup_cfg){ .handshake_ms = 20000 });
	ap_setup_connect(t.s, "t_silent@127.0.0.1", 5);
	struct pollfd p = { .fd = l, .events = POLLIN };
	assert_int_equal(poll(&p, 1, WAIT_MS), 1);
	int e = accept4(l, NULL, NULL, SOCK_CLOEXEC); /* the lookup is waiting */
	assert_true(e >= 0);
	int64_t t0 = t_now_ms();
	t_stop(&t);
	int64_t ms = t_now_ms() - t0;
	unsetenv("ERL_EPMD_PORT");
	close(e);
	close(l);
	assert_true(ms < 1000);
}

/* A handshake that finished as the node stopped: its socket is closed
 * with the queue, not leaked. */
static void queued_connection_is_closed_with_the_queue(void **state)
{
	(void)state;
	ap_sendq q;
	assert_int_equal(ap_sendq_init(&q), 0);
	q.dispose = ap_setup_dispose;
	int sv[2];
	assert_int_equal(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
	ap_sendq_item *it = ap_sendq_item_new(AP_Q_CONN_UP, "t_peer@localhost", sizeof(ap_setup_result));
	assert_non_null(it);
	memcpy(it->data, &(ap_setup_result){ .fd = sv[0] }, sizeof(ap_setup_result));
	ap_sendq_push(&q, it);
	ap_sendq_destroy(&q);
	struct pollfd p = { .fd = sv[1], .events = POLLIN };
	assert_int_equal(poll(&p, 1, 1000), 1);
	char b;
	assert_int_equal(recv(sv[1], &b, 1, 0), 0); /* closed */
	close(sv[1]);
}

int main(void)
{
	ei_init();
	const struct CMUnitTest tests[] = {
		/* First: ei reads ERL_EPMD_PORT once, at its first lookup. */
		cmocka_unit_test(stop_is_prompt_while_a_connect_waits_for_epmd),
		cmocka_unit_test(listen_address_is_the_one_given),
		cmocka_unit_test(oversized_first_packet_is_refused_at_once),
		cmocka_unit_test(deadline_covers_the_whole_handshake),
		cmocka_unit_test(caps_drop_the_oldest),
		cmocka_unit_test(overall_cap_drops_from_the_source_holding_the_most),
		cmocka_unit_test(stalled_handshake_is_evicted_for_a_ready_one),
		cmocka_unit_test(connect_does_not_wait_behind_incoming_handshakes),
		cmocka_unit_test(a_flooding_source_leaves_a_thread_for_other_sources),
		cmocka_unit_test(threads_go_to_the_least_served_source_oldest_first),
		cmocka_unit_test(threads_go_first_to_the_source_holding_the_fewest),
		cmocka_unit_test(two_ready_at_once_with_one_thread_are_both_served),
		cmocka_unit_test(eviction_never_takes_from_a_source_holding_no_more),
		cmocka_unit_test(a_bare_connect_never_cuts_a_running_handshake_short),
		cmocka_unit_test(queued_connection_is_closed_with_the_queue),
	};
	return cmocka_run_group_tests(tests, NULL, NULL);
}
