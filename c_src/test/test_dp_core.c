/* test_dp_core: the data plane NIF's erl_nif-free core (dp_core.c): request
 * records as the pool node reads them, reply records it writes (valid,
 * hostile, torn), the bounded drain, and the attach handshake against a
 * pool-node end in a thread (t_dp_peer.h, on the real ring library). */
#include "t_helpers.h"

#include <pthread.h>
#include <fcntl.h>
#include <sys/eventfd.h>
#include <sys/mman.h>

#include "dp_core.h"
#include "t_dp_peer.h"

static const uint8_t T_TOKEN[AP_SEG_TOKEN_LEN] = "0123456789abcdef";

/* A formatted segment in private memory with the NIF's views: producer
 * of request rings, consumer of reply rings; and the pool node's views. */
struct t_seg {
	void *mem;
	size_t size;
	struct ap_seg seg;
	struct ap_ring nreq, nrep; /* NIF: ring 0 of each */
	struct ap_ring preq, prep; /* pool node */
};

static void t_seg_open(struct t_seg *t, uint64_t req_cap, uint64_t rep_cap)
{
	assert_int_equal(dp_geom(2, req_cap, 2, rep_cap, &t->size), 0);
	t->mem = mmap(NULL, t->size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	assert_true(t->mem != MAP_FAILED);
	assert_int_equal(ap_seg_format(t->mem, t->size, 2, req_cap, 2, rep_cap), 0);
	assert_int_equal(ap_seg_parse(&t->seg, t->mem, t->size), 0);
	assert_int_equal(ap_ring_attach_producer(&t->nreq, ap_seg_req(&t->seg, 0), ap_seg_req_size(&t->seg)), 0);
	assert_int_equal(ap_ring_attach_consumer(&t->preq, ap_seg_req(&t->seg, 0), ap_seg_req_size(&t->seg)), 0);
	assert_int_equal(ap_ring_attach_consumer(&t->nrep, ap_seg_rep(&t->seg, 0), ap_seg_rep_size(&t->seg)), 0);
	assert_int_equal(ap_ring_attach_producer(&t->prep, ap_seg_rep(&t->seg, 0), ap_seg_rep_size(&t->seg)), 0);
}

static void t_seg_close(struct t_seg *t) { munmap(t->mem, t->size); }

static void test_geometry_is_checked(void **state)
{
	size_t sz;

	(void)state;
	assert_int_equal(dp_geom(4, 1 << 20, 2, 4 << 20, &sz), 0);
	assert_int_equal(sz, AP_SEG_HDR_SIZE + 4 * ap_ring_size(1 << 20) + 2 * ap_ring_size(4 << 20));
	assert_int_equal(dp_geom(0, 1 << 20, 2, 4 << 20, &sz), -EINVAL);
	assert_int_equal(dp_geom(4, 1 << 20, 0, 4 << 20, &sz), -EINVAL);
	assert_int_equal(dp_geom(4, 3000, 2, 4 << 20, &sz), -EINVAL);
	assert_int_equal(dp_geom(4, 1 << 20, 2, 32, &sz), -EINVAL);
	assert_int_equal(dp_geom(AP_SEG_MAX_REQ + 1, 1 << 20, 2, 4 << 20, &sz), -EINVAL);
	assert_int_equal(dp_geom(1024, 1u << 30, 64, 1u << 30, &sz), -EINVAL); /* over AP_SEG_MAX_BYTES */
}

static void test_request_records_carry_every_field(void **state)
{
	struct t_seg t;
	uint8_t pre[5], msg[300], pid[40];
	const void *p;
	size_t len;
	struct ap_dp_req h;

	(void)state;
	t_seg_open(&t, 4096, 4096);
	t_stream_fill(msg, sizeof msg, 0);
	dp_binary_prefix(pre, sizeof msg);
	assert_memory_equal(pre, ((uint8_t[]){ 109, 0, 0, 1, 44 }), 5);

	/* an ask by name, a binary message, a fence */
	struct dp_req_parts q = { .kind = AP_DP_ASK, .dest_kind = AP_DP_DEST_NAME, .dest = "echo", .dest_len = 4,
				  .msg_pre = pre, .pre_len = 5, .msg = msg, .msg_len = sizeof msg, .ask_id = 77,
				  .fence_ring = 1, .fence_pos = 4096 + 64 };
	void *w;
	assert_int_equal(dp_req_check(&q), 0);
	assert_int_equal(ap_ring_reserve(&t.nreq, dp_req_len(q.dest_len, q.pre_len + q.msg_len), &w), 0);
	dp_req_write(w, &q);
	/* a tell by pid: no ask id, no fence */
	memset(pid, 0x58, sizeof pid);
	struct dp_req_parts q2 = { .kind = AP_DP_TELL, .dest_kind = AP_DP_DEST_PID, .dest = pid, .dest_len = sizeof pid,
				   .msg = msg, .msg_len = 10, .ask_id = 5, .fence_ring = AP_DP_NO_FENCE, .fence_pos = 9 };
	assert_int_equal(dp_req_check(&q2), 0);
	assert_int_equal(ap_ring_reserve(&t.nreq, dp_req_len(q2.dest_len, q2.msg_len), &w), 0);
	dp_req_write(w, &q2);
	assert_int_equal(ap_ring_publish(&t.nreq), 0);

	assert_int_equal(ap_ring_read(&t.preq, &p, &len), 0);
	assert_int_equal(len, sizeof h + 4 + 5 + sizeof msg);
	memcpy(&h, p, sizeof h);
	assert_int_equal(h.kind, AP_DP_ASK);
	assert_int_equal(h.dest_kind, AP_DP_DEST_NAME);
	assert_int_equal(h.dest_len, 4);
	assert_int_equal(h.msg_len, 5 + sizeof msg);
	assert_int_equal(h.ask_id, 77);
	assert_int_equal(h.fence_ring, 1);
	assert_int_equal(h.fence_pos, 4096 + 64);
	assert_int_equal(h.reserved, 0);
	assert_memory_equal((const uint8_t *)p + sizeof h, "echo", 4);
	assert_memory_equal((const uint8_t *)p + sizeof h + 4, pre, 5);
	assert_memory_equal((const uint8_t *)p + sizeof h + 9, msg, sizeof msg);

	assert_int_equal(ap_ring_read(&t.preq, &p, &len), 0);
	assert_int_equal(len, sizeof h + sizeof pid + 10);
	memcpy(&h, p, sizeof h);
	assert_int_equal(h.kind, AP_DP_TELL);
	assert_int_equal(h.dest_kind, AP_DP_DEST_PID);
	assert_int_equal(h.ask_id, 0);
	assert_int_equal(h.fence_ring, AP_DP_NO_FENCE);
	assert_int_equal(h.fence_pos, 0);
	assert_memory_equal((const uint8_t *)p + sizeof h, pid, sizeof pid);
	assert_int_equal(ap_ring_read(&t.preq, &p, &len), -EAGAIN);
	t_seg_close(&t);
}

static void test_request_checks_refuse_bad_parts(void **state)
{
	uint8_t big[DP_MAX_DEST_NAME + 1];

	(void)state;
	memset(big, 'a', sizeof big);
	struct dp_req_parts ok = { .kind = AP_DP_STATS, .dest_kind = AP_DP_DEST_NAME, .dest = "p", .dest_len = 1,
				   .fence_ring = AP_DP_NO_FENCE };
	assert_int_equal(dp_req_check(&ok), 0);
	struct dp_req_parts q = ok;
	q.msg = big;
	q.msg_len = 1; /* stats carry no message */
	assert_int_equal(dp_req_check(&q), -EINVAL);
	q = ok;
	q.kind = AP_DP_TELL; /* a tell carries one */
	assert_int_equal(dp_req_check(&q), -EINVAL);
	q = ok;
	q.kind = 9;
	assert_int_equal(dp_req_check(&q), -EINVAL);
	q = ok;
	q.dest_len = 0;
	assert_int_equal(dp_req_check(&q), -EINVAL);
	q = ok;
	q.dest = big;
	q.dest_len = sizeof big;
	assert_int_equal(dp_req_check(&q), -EINVAL);
	q = ok;
	q.dest_kind = 3;
	assert_int_equal(dp_req_check(&q), -EINVAL);
}

static void test_reply_header_must_match_the_record_exactly(void **state)
{
	uint8_t b[64];
	struct ap_dp_rep h = { .ask_id = 0x1122334455667788ull, .len = 7 };
	uint64_t id;
	size_t tl;

	(void)state;
	memset(b, 0, sizeof b);
	memcpy(b, &h, sizeof h);
	assert_int_equal(dp_rep_parse(b, 16 + 7, &id, &tl), 0);
	assert_int_equal(id, 0x1122334455667788ull);
	assert_int_equal(tl, 7);
	assert_int_equal(dp_rep_parse(b, 16 + 8, &id, &tl), -EPROTO); /* longer than said */
	assert_int_equal(dp_rep_parse(b, 16 + 6, &id, &tl), -EPROTO); /* shorter */
	assert_int_equal(dp_rep_parse(b, 15, &id, &tl), -EPROTO);     /* no header */
	h.len = 0;
	memcpy(b, &h, sizeof h);
	assert_int_equal(dp_rep_parse(b, 16, &id, &tl), -EPROTO); /* no term */
	h.len = 7;
	h.reserved = 1;
	memcpy(b, &h, sizeof h);
	assert_int_equal(dp_rep_parse(b, 16 + 7, &id, &tl), -EPROTO);
	h.reserved = 0;
	h.len = 0xffffffffu;
	memcpy(b, &h, sizeof h);
	assert_int_equal(dp_rep_parse(b, 16 + 7, &id, &tl), -EPROTO);
	/* a compressed term would have the decoder allocate what it claims */
	h.len = 7;
	memcpy(b, &h, sizeof h);
	memcpy(b + 16, "\x50\xff\xff\xff\xff\x78\x9c", 7);
	assert_int_equal(dp_rep_parse(b, 16 + 7, &id, &tl), -EPROTO);
	b[16] = 104;
	assert_int_equal(dp_rep_parse(b, 16 + 7, &id, &tl), 0);
}

struct t_got {
	unsigned n;
	uint64_t ids[600];
	uint8_t first[600][8];
	size_t lens[600];
};

static void t_collect(void *arg, uint64_t id, const uint8_t *term, size_t len)
{
	struct t_got *g = arg;

	assert_true(g->n < 600);
	assert_true(len >= 2);
	assert_int_equal(term[0], 131);
	g->ids[g->n] = id;
	g->lens[g->n] = len;
	memcpy(g->first[g->n], term, len < 8 ? len : 8);
	g->n++;
}

static void t_put_reply(struct ap_ring *r, uint64_t id, const char *term, uint32_t len, uint32_t hdr_len)
{
	struct ap_dp_rep h = { .ask_id = id, .len = hdr_len };
	void *w;

	assert_int_equal(ap_ring_reserve(r, sizeof h + len, &w), 0);
	memcpy(w, &h, sizeof h);
	memcpy((uint8_t *)w + sizeof h, term, len);
}

static void test_drain_delivers_valid_replies_and_skips_bad_ones(void **state)
{
	struct t_seg t;
	struct t_got *g = calloc(1, sizeof *g);
	uint8_t *buf;
	size_t cap = ap_ring_max_payload(4096) + 1;
	struct dp_drain_stats st = { 0, 0 };

	(void)state;
	t_seg_open(&t, 4096, 4096);
	buf = malloc(cap);
	t_put_reply(&t.prep, 1, "h\x02w\x02okw\x01x", 10, 10);
	t_put_reply(&t.prep, 2, "abc", 3, 4); /* a lie about its length */
	t_put_reply(&t.prep, 3, "a\x05", 2, 2);
	assert_int_equal(ap_ring_publish(&t.prep), 0);
	assert_int_equal(dp_drain(&t.nrep, buf, cap, DP_DRAIN_BATCH, t_collect, g, &st), 3);
	assert_int_equal(st.replies, 2);
	assert_int_equal(st.bad_records, 1);
	assert_int_equal(g->n, 2);
	assert_int_equal(g->ids[0], 1);
	assert_int_equal(g->lens[0], 11);
	assert_memory_equal(g->first[0], "\x83h\x02w\x02okw", 8);
	assert_int_equal(g->ids[1], 3);
	/* everything was given back: the producer sees the space again */
	assert_int_equal(__atomic_load_n(&t.prep.hdr->head, __ATOMIC_ACQUIRE), t.prep.tail);
	assert_int_equal(dp_drain(&t.nrep, buf, cap, DP_DRAIN_BATCH, t_collect, g, &st), 0);
	/* too small a buffer is refused, not overrun */
	assert_int_equal(dp_drain(&t.nrep, buf, cap - 2, DP_DRAIN_BATCH, t_collect, g, &st), -EINVAL);
	free(buf);
	free(g);
	t_seg_close(&t);
}

/* dp_drain_upto stops before a record over max_len and leaves it whole in
 * the ring (a pad before it too): a plain drain reads it next. */
static void test_drain_upto_leaves_a_long_record_unread(void **state)
{
	struct t_seg t;
	struct t_got *g = calloc(1, sizeof *g);
	uint8_t *buf, big[1500];
	size_t cap = ap_ring_max_payload(4096) + 1;
	struct dp_drain_stats st = { 0, 0, 0 };

	(void)state;
	memset(big, 'a', sizeof big);
	big[0] = 'm'; /* LARGE_BIG_EXT's tag is not needed: only lengths are checked */
	t_seg_open(&t, 4096, 4096);
	buf = malloc(cap);
	/* move the ring's position on so that the long record wraps (a pad) */
	t_put_reply(&t.prep, 9, (const char *)big, 1400, 1400);
	t_put_reply(&t.prep, 9, (const char *)big, 1400, 1400);
	assert_int_equal(ap_ring_publish(&t.prep), 0);
	assert_int_equal(dp_drain(&t.nrep, buf, cap, DP_DRAIN_BATCH, t_collect, g, &st), 2);
	assert_true((t.nrep.pos & t.nrep.mask) + 1500 > t.nrep.cap); /* the next long one wraps */
	g->n = 0;
	t_put_reply(&t.prep, 1, "a\x05", 2, 2);
	t_put_reply(&t.prep, 2, (const char *)big, sizeof big, sizeof big);
	t_put_reply(&t.prep, 3, "a\x06", 2, 2);
	assert_int_equal(ap_ring_publish(&t.prep), 0);
	assert_int_equal(dp_drain_upto(&t.nrep, buf, cap, DP_DRAIN_BATCH, 100, t_collect, g, &st), 1);
	assert_int_equal(st.held, 1);
	assert_int_equal(g->n, 1);
	assert_int_equal(g->ids[0], 1);
	/* still there, whole, with what follows it */
	assert_int_equal(dp_drain_upto(&t.nrep, buf, cap, DP_DRAIN_BATCH, 100, t_collect, g, &st), 0);
	assert_int_equal(g->n, 1);
	st.held = 0;
	assert_int_equal(dp_drain(&t.nrep, buf, cap, DP_DRAIN_BATCH, t_collect, g, &st), 2);
	assert_int_equal(st.held, 0);
	assert_int_equal(g->n, 3);
	assert_int_equal(g->ids[1], 2);
	assert_int_equal(g->lens[1], sizeof big + 1);
	assert_int_equal(g->ids[2], 3);
	assert_int_equal(__atomic_load_n(&t.prep.hdr->head, __ATOMIC_ACQUIRE), t.prep.tail);
	free(buf);
	free(g);
	t_seg_close(&t);
}

static void test_drain_is_bounded_per_pass(void **state)
{
	struct t_seg t;
	struct t_got *g = calloc(1, sizeof *g);
	size_t cap = ap_ring_max_payload(1 << 16) + 1;
	uint8_t *buf = malloc(cap);
	struct dp_drain_stats st = { 0, 0 };

	(void)state;
	t_seg_open(&t, 4096, 1 << 16);
	for (uint64_t i = 0; i < 500; i++)
		t_put_reply(&t.prep, i, "a\x01", 2, 2);
	assert_int_equal(ap_ring_publish(&t.prep), 0);
	assert_int_equal(dp_drain(&t.nrep, buf, cap, 200, t_collect, g, &st), 200);
	assert_int_equal(dp_drain(&t.nrep, buf, cap, 200, t_collect, g, &st), 200);
	assert_int_equal(dp_drain(&t.nrep, buf, cap, 200, t_collect, g, &st), 100);
	assert_int_equal(g->n, 500);
	for (unsigned i = 0; i < 500; i++)
		assert_int_equal(g->ids[i], i);
	free(buf);
	free(g);
	t_seg_close(&t);
}

/* What a hostile or broken pool node can leave in a reply ring: a tail past
 * head + cap, an unaligned tail, a published record that was never written
 * (zeroed memory), a record length over the ring. Each is -EPROTO, and
 * stays so; nothing is handed out. */
static void test_drain_reports_a_broken_ring(void **state)
{
	static const uint64_t bad_tails[] = { 4096 + 8, 12, UINT64_MAX - 7, 64 };
	uint8_t *buf;
	size_t cap = ap_ring_max_payload(4096) + 1;

	(void)state;
	buf = malloc(cap);
	for (unsigned k = 0; k < sizeof bad_tails / sizeof bad_tails[0]; k++) {
		struct t_seg t;
		struct t_got g = { 0 };
		struct dp_drain_stats st = { 0, 0 };

		t_seg_open(&t, 4096, 4096);
		/* the last case: a record header claims more than the ring holds */
		if (bad_tails[k] == 64) {
			uint64_t w = (uint64_t)ap_ring_stamp(t.nrep.nonce, AP_RING_STAMP_DATA, 0) << 32 | 0xfffff;
			memcpy(t.nrep.data, &w, 8);
		}
		__atomic_store_n(&t.nrep.hdr->tail, bad_tails[k], __ATOMIC_RELEASE);
		assert_int_equal(dp_drain(&t.nrep, buf, cap, DP_DRAIN_BATCH, t_collect, &g, &st), -EPROTO);
		assert_int_equal(g.n, 0);
		assert_int_equal(dp_drain(&t.nrep, buf, cap, DP_DRAIN_BATCH, t_collect, &g, &st), -EPROTO);
		t_seg_close(&t);
	}
	free(buf);
}

/* ---- attach ----------------------------------------------------------------- */

struct t_srv {
	int lfd;
	uint32_t status;  /* the ack's */
	int mode;         /* 0 accept; 1 bad ack magic; 2 accept and stay silent */
	int ack_fd;       /* mode 0: sent with the ack when >= 0 */
	int rc;
	struct t_dp_peer peer;
};

static void *t_srv_thread(void *arg)
{
	struct t_srv *s = arg;

	if (s->mode == 0) {
		s->rc = t_dp_accept(s->lfd, T_TOKEN, s->status, s->ack_fd, &s->peer);
		return NULL;
	}
	s->peer.sock = accept4(s->lfd, NULL, NULL, SOCK_CLOEXEC);
	if (s->mode == 1) {
		struct ap_seg_hello h;
		struct ap_seg_ack ack = { .magic = 0xdead, .status = 0 };
		s->rc = t_dp_read_full(s->peer.sock, &h, sizeof h);
		(void)!write(s->peer.sock, &ack, sizeof ack);
	}
	return NULL;
}

static void t_memfd_seg(struct ap_ring_map *m, uint32_t n_req, uint32_t n_rep)
{
	size_t sz;

	assert_int_equal(dp_geom(n_req, 4096, n_rep, 4096, &sz), 0);
	assert_int_equal(ap_ring_map_create_memfd(m, "t_dp", sz), 0);
	assert_int_equal(ap_seg_format(m->mem, m->size, n_req, 4096, n_rep, 4096), 0);
}

static int t_attach_bell(struct t_srv *srv, struct ap_ring_map *m, const char *name, size_t nlen, int64_t ms,
			 int *sock, int *bell)
{
	pthread_t th;
	int rc;

	assert_int_equal(pthread_create(&th, NULL, t_srv_thread, srv), 0);
	rc = dp_attach(name, nlen, T_TOKEN, "beam@host", 9, m->fd, dp_now_ms() + ms, sock, bell);
	if (srv->mode == 2)
		shutdown(srv->lfd, SHUT_RDWR); /* unblocks nothing; the thread returned after accept */
	pthread_join(th, NULL);
	return rc;
}

static int t_attach(struct t_srv *srv, struct ap_ring_map *m, const char *name, size_t nlen, int64_t ms, int *sock)
{
	int bell, rc = t_attach_bell(srv, m, name, nlen, ms, sock, &bell);
	assert_int_equal(bell, -1); /* no ack here carries one */
	return rc;
}

static void test_attach_hands_the_segment_to_the_pool_node(void **state)
{
	char name[108];
	size_t nlen;
	struct t_srv srv = { .status = 0, .mode = 0, .ack_fd = -1 };
	struct ap_ring_map m;
	struct ap_seg seg;
	struct ap_ring rep;
	int sock;
	uint8_t *buf;
	struct t_got g = { 0 };
	struct dp_drain_stats st = { 0, 0 };

	(void)state;
	srv.lfd = t_dp_listen(name, &nlen);
	assert_true(srv.lfd >= 0);
	t_memfd_seg(&m, 3, 2);
	assert_int_equal(t_attach(&srv, &m, name, nlen, 2000, &sock), 0);
	assert_int_equal(srv.rc, 0);
	assert_true(sock >= 0);
	assert_string_equal(srv.peer.name, "beam@host");
	assert_int_equal(srv.peer.seg.n_req, 3);
	assert_int_equal(srv.peer.seg.n_rep, 2);
	/* one memory: a reply written by the pool node's mapping is read
	 * through ours */
	assert_int_equal(ap_seg_parse(&seg, m.mem, m.size), 0);
	assert_int_equal(ap_ring_attach_consumer(&rep, ap_seg_rep(&seg, 1), ap_seg_rep_size(&seg)), 0);
	assert_int_equal(t_dp_reply(&srv.peer, 1, 42, "a\x07", 2, 2), 0);
	buf = malloc(ap_ring_max_payload(4096) + 1);
	assert_int_equal(dp_drain(&rep, buf, ap_ring_max_payload(4096) + 1, DP_DRAIN_BATCH, t_collect, &g, &st), 1);
	assert_int_equal(g.ids[0], 42);
	/* the connection stays up; its end is the pool node's end */
	assert_int_equal(dp_peer_gone(sock), 0);
	t_dp_peer_close(&srv.peer);
	assert_int_equal(dp_peer_gone(sock), 1);
	free(buf);
	close(sock);
	close(srv.lfd);
	ap_ring_map_close(&m);
}

static void test_attach_failures_are_reported(void **state)
{
	char name[108];
	size_t nlen;
	struct ap_ring_map m;
	int sock = 7, bell;
	int64_t t0;

	(void)state;
	t_memfd_seg(&m, 1, 1);
	/* the pool node refuses: its status, positive */
	struct t_srv srv = { .status = EPERM, .mode = 0, .ack_fd = -1 };
	srv.lfd = t_dp_listen(name, &nlen);
	assert_int_equal(t_attach(&srv, &m, name, nlen, 2000, &sock), EPERM);
	assert_int_equal(sock, -1);
	close(srv.lfd);
	/* a bad ack */
	struct t_srv srv1 = { .mode = 1, .ack_fd = -1 };
	srv1.lfd = t_dp_listen(name, &nlen);
	assert_int_equal(t_attach(&srv1, &m, name, nlen, 2000, &sock), -EPROTO);
	close(srv1.peer.sock);
	close(srv1.lfd);
	/* a listener that never answers: the deadline, not a hang */
	struct t_srv srv2 = { .mode = 2, .ack_fd = -1 };
	srv2.lfd = t_dp_listen(name, &nlen);
	t0 = t_now_ms();
	assert_int_equal(t_attach(&srv2, &m, name, nlen, 300, &sock), -ETIMEDOUT);
	assert_true(t_now_ms() - t0 >= 250 && t_now_ms() - t0 < 2000);
	close(srv2.peer.sock);
	close(srv2.lfd);
	/* nobody there */
	assert_int_equal(dp_attach(name, nlen, T_TOKEN, "b", 1, m.fd, dp_now_ms() + 500, &sock, &bell), -ECONNREFUSED);
	/* bad arguments: not an abstract name, no node name */
	assert_int_equal(dp_attach("/tmp/x", 6, T_TOKEN, "b", 1, m.fd, dp_now_ms() + 500, &sock, &bell), -EINVAL);
	assert_int_equal(dp_attach(name, nlen, T_TOKEN, "b", 0, m.fd, dp_now_ms() + 500, &sock, &bell), -EINVAL);
	ap_ring_map_close(&m);
}

static int t_open_fds(void)
{
	int n = 0;
	for (int fd = 0; fd < 1024; fd++)
		if (fcntl(fd, F_GETFD) >= 0)
			n++;
	return n;
}

/* An epoll pool node's ack carries its bell: the write end of a pipe.
 * The NIF rings it instead of the futex with a write that cannot block:
 * here the pipe is blocking and full, as a hostile node could leave it,
 * and a ring still returns at once. Anything but a pipe (an eventfd,
 * whose write would block so) is refused and nothing it passed stays
 * open. */
static void test_attach_takes_the_bell_pipe_only(void **state)
{
	char name[108], b[4096];
	size_t nlen;
	struct ap_ring_map m;
	int sock, bell, pp[2], efd, before;
	uint32_t *word, expected;

	(void)state;
	t_memfd_seg(&m, 1, 1);
	assert_int_equal(pipe2(pp, O_CLOEXEC), 0);
	assert_true(fcntl(pp[0], F_SETFL, O_NONBLOCK) == 0);
	struct t_srv srv = { .status = 0, .mode = 0, .ack_fd = pp[1] };
	srv.lfd = t_dp_listen(name, &nlen);
	assert_int_equal(t_attach_bell(&srv, &m, name, nlen, 2000, &sock, &bell), 0);
	assert_true(bell >= 0 && bell != pp[1]);
	assert_int_equal(read(pp[0], b, sizeof b), 1); /* the attach's probe */
	/* no flag up: no ring; flag up: one byte for the node */
	assert_int_equal(ap_seg_notify_fd(srv.peer.seg.hdr, AP_SEG_BELL_REQ, bell), 0);
	assert_int_equal(read(pp[0], b, sizeof b), -1);
	ap_seg_sleep_begin(srv.peer.seg.hdr, AP_SEG_BELL_REQ, &word, &expected);
	assert_int_equal(ap_seg_notify_fd(srv.peer.seg.hdr, AP_SEG_BELL_REQ, bell), 1);
	assert_int_equal(read(pp[0], b, sizeof b), 1);
	assert_int_not_equal(*word, expected); /* the bell word moved too */
	/* full and blocking: the ring returns, it does not wait for room */
	assert_int_equal(fcntl(pp[1], F_SETFL, O_NONBLOCK), 0);
	while (write(pp[1], b, sizeof b) > 0)
		;
	assert_int_equal(fcntl(pp[1], F_SETFL, 0), 0);
	ap_seg_sleep_begin(srv.peer.seg.hdr, AP_SEG_BELL_REQ, &word, &expected);
	assert_int_equal(ap_seg_notify_fd(srv.peer.seg.hdr, AP_SEG_BELL_REQ, bell), 1);
	t_dp_peer_close(&srv.peer);
	close(bell);
	close(sock);
	close(srv.lfd);
	close(pp[0]);
	close(pp[1]);
	/* an eventfd instead of a pipe: refused, nothing kept */
	efd = eventfd(0, EFD_CLOEXEC);
	assert_true(efd >= 0);
	before = t_open_fds();
	struct t_srv srv2 = { .status = 0, .mode = 0, .ack_fd = efd };
	srv2.lfd = t_dp_listen(name, &nlen);
	assert_int_equal(t_attach_bell(&srv2, &m, name, nlen, 2000, &sock, &bell), -EPROTO);
	assert_int_equal(sock, -1);
	assert_int_equal(bell, -1);
	t_dp_peer_close(&srv2.peer);
	close(srv2.lfd);
	assert_int_equal(t_open_fds(), before);
	close(efd);
	ap_ring_map_close(&m);
}

static void test_peer_gone_sees_eof_not_data(void **state)
{
	int sv[2];

	(void)state;
	assert_int_equal(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
	assert_int_equal(dp_peer_gone(sv[0]), 0);
	assert_int_equal(write(sv[1], "junk", 4), 4);
	assert_int_equal(dp_peer_gone(sv[0]), 0);
	close(sv[1]);
	assert_int_equal(dp_peer_gone(sv[0]), 1);
	close(sv[0]);
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_geometry_is_checked),
		cmocka_unit_test(test_request_records_carry_every_field),
		cmocka_unit_test(test_request_checks_refuse_bad_parts),
		cmocka_unit_test(test_reply_header_must_match_the_record_exactly),
		cmocka_unit_test(test_drain_delivers_valid_replies_and_skips_bad_ones),
		cmocka_unit_test(test_drain_upto_leaves_a_long_record_unread),
		cmocka_unit_test(test_drain_is_bounded_per_pass),
		cmocka_unit_test(test_drain_reports_a_broken_ring),
		cmocka_unit_test(test_attach_hands_the_segment_to_the_pool_node),
		cmocka_unit_test(test_attach_failures_are_reported),
		cmocka_unit_test(test_attach_takes_the_bell_pipe_only),
		cmocka_unit_test(test_peer_gone_sees_eof_not_data),
	};
	return cmocka_run_group_tests(tests, NULL, NULL);
}
