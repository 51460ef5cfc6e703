/* fuzz_dp_request: libFuzzer target over the pool node's ring ingress
 * (dataplane/node/ring_ingress.c: drain_seg, drain_ring, handle, resolve,
 * fences; ring_seg.c: error replies, the ring route), which reads request
 * records a BEAM writes into shared memory, so it must survive any record
 * there.
 *
 * ring_ingress.c and ring_seg.c are compiled into this file (their record
 * handling is static, on the loop thread, over the segment struct); the
 * rest of the pool node is stubbed below: a pool is found by the name "p"
 * or by a pid whose number is 7, dispatch checks what it is handed, stats
 * are a small map. Nothing of either file is changed for the fuzzer.
 *
 * Input layout: byte 0 = geometry (bits 0-1: n_req - 1, bit 2: a small
 * reply ring that fills), then records: a byte choosing the request ring
 * (mod n_req), two bytes of length (little-endian), that many payload
 * bytes (cut short at the end of the input). The payload goes into the
 * ring as one record, as the NIF's producer writes it: a struct ap_dp_req,
 * destination, message, or anything at all. A record that does not fit
 * (full ring, over the ring's payload limit) is skipped. Then the node's
 * drain runs until it finds nothing (or the segment is detached), and
 * every reply record it wrote is read back: each must be a 16-byte header
 * whose length covers exactly one whole term.
 */
#include "../dataplane/node/ring_ingress.c"
#include "../dataplane/node/ring_seg.c"

#include "t_fuzz.h"

#define T_REQ_CAP 4096u
#define T_REP_CAP_SMALL 256u
#define T_REP_CAP 4096u

static ap_pool t_pool; /* the one pool */
static int64_t t_now;
static volatile unsigned t_sink;

/* ---- the rest of the pool node, stubbed ----------------------------------- */

int ap_log(enum ap_log_level lvl, const char *fmt, ...)
{
	(void)lvl;
	(void)fmt;
	return 1;
}

void ap_pool_no_pool(const char *peer, const char *name, size_t name_len, const erlang_pid *pid, uint64_t tells)
{
	(void)peer, (void)name, (void)name_len, (void)pid, (void)tells;
}

int64_t ap_node_now_ms(const ap_node *n)
{
	(void)n;
	return t_now += 7;
}

/* A broken reply ring: the real loop runs fn later; here at once is the
 * same (the drain holds its own reference). */
int ap_node_call_on_loop(ap_node *n, ap_loop_fn fn, void *arg)
{
	fn(n, arg);
	return 0;
}

void ap_node_futex_cancel(ap_node *n, ap_io_futex *f)
{
	(void)n;
	(void)f;
	t_check(0); /* never armed here */
}

int ap_node_futex_wait(ap_node *n, ap_io_futex *f, uint32_t *word, uint32_t expected, int timeout_ms)
{
	(void)n, (void)f, (void)word, (void)expected, (void)timeout_ms;
	return -ENOSYS;
}

ap_pool *ap_pool_find(ap_node *n, const char *name, const erlang_pid *pid)
{
	(void)n;
	if (name) {
		t_check(strlen(name) >= 1);
		return strcmp(name, "p") == 0 ? (ap_pool *)&t_pool : NULL;
	}
	t_check(pid);
	return pid->num == 7 ? (ap_pool *)&t_pool : NULL;
}

/* No pool ever starts or stops here: the ingress may keep what the stub
 * above answered for a destination, which is always the same answer. */
uint64_t ap_pool_generation(void) { return 1; }

/* What the ingress hands on: one whole term, inside the copy it made, by
 * the ring route; an ask's route holds a reference on its segment. */
void ap_pool_dispatch(ap_pool *p, const ap_request *rq)
{
	t_check(p == (ap_pool *)&t_pool);
	t_check(rq->kind == AP_REQ_TELL || rq->kind == AP_REQ_ASK);
	t_check(rq->route.ops == &dp_ring_route && rq->msg_len > 0);
	t_check(rq->kind == AP_REQ_TELL || (rq->route.ctx == ap_dp.segs[0] && atomic_load(&ap_dp.segs[0]->refs) >= 2));
	t_check((const uint8_t *)rq->msg >= ap_dp.copy.data &&
		(const uint8_t *)rq->msg + rq->msg_len <= ap_dp.copy.data + ap_dp.copy.len);
	t_check(ap_term_end(rq->msg, (size_t)rq->msg_len, 0) == rq->msg_len);
	unsigned s = 0;
	for (int i = 0; i < rq->msg_len; i++)
		s += (uint8_t)rq->msg[i];
	t_sink += s;
	if (rq->kind == AP_REQ_ASK) {
		/* 'ok', as a worker answers, by the route (which drops the
		 * reference); never waiting for room (nobody reads the reply
		 * rings while the drain runs). */
		uint8_t ok[] = { 0x64, 0x00, 0x02, 'o', 'k' };
		t_check(rq->route.ops->send(&rq->route, NULL, ok, sizeof ok, 0, AP_SEND_LOOP) == 0);
	}
}

void ap_pool_encode_stats(ap_pool *p, ei_x_buff *x)
{
	t_check(p == (ap_pool *)&t_pool);
	ei_x_encode_map_header(x, 1);
	ei_x_encode_atom(x, "workers");
	ei_x_encode_long(x, 4);
}

void ap_pool_wake_all_pushed(void)
{
}

int ap_iso_take_all(int looks)
{
	(void)looks;
	return 0;
}

/* ---- the target -------------------------------------------------------------- */

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	if (size < 1)
		return 0;
	uint32_t n_req = (data[0] & 3u) + 1, n_rep = 2;
	uint64_t rep_cap = (data[0] & 4) ? T_REP_CAP_SMALL : T_REP_CAP;
	data++;
	size--;

	size_t segsz = ap_seg_size(n_req, T_REQ_CAP, n_rep, rep_cap);
	t_check(segsz > 0);
	uint8_t *mem = aligned_alloc(4096, (segsz + 4095) & ~(size_t)4095);
	t_check(mem);
	t_check(ap_seg_format(mem, segsz, n_req, T_REQ_CAP, n_rep, rep_cap) == 0);

	/* The segment as make_seg builds it, registered in slot 0. */
	struct ap_dp_seg *sg = calloc(1, sizeof *sg);
	t_check(sg);
	sg->map.fd = -1;
	t_check(ap_seg_parse(&sg->s, mem, segsz) == 0);
	sg->req = calloc(n_req, sizeof *sg->req);
	sg->busy = calloc(n_req, 1);
	sg->seen = calloc(n_req, sizeof *sg->seen);
	sg->rep = calloc(n_rep, sizeof *sg->rep);
	t_check(sg->req && sg->busy && sg->seen && sg->rep);
	for (uint32_t i = 0; i < n_req; i++)
		t_check(ap_ring_attach_consumer(&sg->req[i], ap_seg_req(&sg->s, i), ap_seg_req_size(&sg->s)) == 0);
	for (uint32_t i = 0; i < n_rep; i++) {
		t_check(ap_ring_attach_producer(&sg->rep[i].r, ap_seg_rep(&sg->s, i), ap_seg_rep_size(&sg->s)) == 0);
		pthread_mutex_init(&sg->rep[i].mu, NULL);
	}
	snprintf(sg->peer, sizeof sg->peer, "beam@fuzz");
	atomic_store(&sg->refs, 1); /* the registry's */
	atomic_store(&ap_dp.nsegs, 1);
	ap_dp.n = (ap_node *)&t_pool; /* never dereferenced: every ap_node_* is a stub */
	ap_dp.efd = -1;
	ap_dp.segs[0] = sg;
	ap_dp.n_live = 1;
	ap_dp.top = 1;
	sg->slot = 0;

	/* The BEAM's side: producer views of the request rings, consumer
	 * views of the reply rings. */
	struct ap_ring prod[4], cons[2];
	for (uint32_t i = 0; i < n_req; i++)
		t_check(ap_ring_attach_producer(&prod[i], ap_seg_req(&sg->s, i), ap_seg_req_size(&sg->s)) == 0);
	for (uint32_t i = 0; i < n_rep; i++)
		t_check(ap_ring_attach_consumer(&cons[i], ap_seg_rep(&sg->s, i), ap_seg_rep_size(&sg->s)) == 0);

	size_t off = 0;
	while (off + 3 <= size) {
		uint32_t ring = data[off] % n_req;
		size_t len = (size_t)data[off + 1] | (size_t)data[off + 2] << 8;
		off += 3;
		if (len > size - off)
			len = size - off;
		void *w;
		if (len > 0 && ap_ring_reserve(&prod[ring], len, &w) == 0) {
			memcpy(w, data + off, len);
			t_check(ap_ring_publish(&prod[ring]) == 0);
		}
		off += len;
	}

	/* The loop's drains, until nothing is left (a bounded number: each
	 * reads at most DP_BUDGET records per ring, and nothing refills). */
	for (int k = 0; k < 8; k++)
		if (drain_seg(sg) <= 0)
			break;
	if (sg->slot >= 0)
		t_check(!seg_pending(sg));

	/* Every reply: a header, then exactly one whole term. */
	for (uint32_t i = 0; i < n_rep; i++) {
		const void *p;
		size_t len;
		int r;
		while ((r = ap_ring_read(&cons[i], &p, &len)) == 0) {
			struct ap_dp_rep h;
			t_check(len >= sizeof h);
			memcpy(&h, p, sizeof h);
			t_check(h.len == len - sizeof h && h.reserved == 0);
			t_check(ap_term_end((const char *)p + sizeof h, h.len, 0) == (int)h.len);
		}
		t_check(r == -EAGAIN);
		ap_ring_release(&cons[i]);
	}

	if (sg->slot >= 0)
		dp_detach(sg, "the fuzz input ended"); /* drops the registry's reference: freed */
	else
		t_check(atomic_load(&ap_dp.nsegs) == 0); /* detached inside, and freed then */
	t_check(ap_dp.n_live == 0 && ap_dp.top == 0);
	free(mem);
	return 0;
}
