/* fuzz_dp_reply: libFuzzer target over the NIF's reply path (dp_drain,
 * dp_rep_parse), which runs in the BEAM's reply thread on a ring the pool
 * node writes, so it must survive any bytes there. */
/*
 * Input layout: byte 0 = mode, then the payload.
 *
 *   mode & 1 == 0   a valid reply ring of cap 1024 (nonce, header); the
 *                   payload is laid over its data area, and `tail` is the
 *                   payload's first 8 bytes (so the stamps almost never
 *                   match: that is the "torn or forged record" case);
 *   mode & 1 == 1   the same ring, with records written by the producer
 *                   from the payload: each record is a 16-byte reply
 *                   header (ask id, a length that may lie, reserved) and
 *                   up to 200 term bytes, cut from the payload in turn;
 *                   with mode & 2, one payload byte then overwrites the
 *                   data area at a payload-chosen offset after publish.
 *
 * The ring and the copy buffer are exact-size heap blocks, so ASan reports
 * any access past them. The drain runs up to 8 passes of at most 64
 * records; every answer handed out must be inside the copy buffer, start
 * with 131 and have the length its header said; the result must be a
 * count or -EPROTO, and -EPROTO must stay.
 */
#include <errno.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dp_core.h"

#include "t_fuzz.h"

#define T_CAP 1024u

static volatile unsigned t_sink;

struct t_ctx {
	const uint8_t *buf;
	size_t cap;
	unsigned n;
};

static void t_cb(void *arg, uint64_t id, const uint8_t *term, size_t len)
{
	struct t_ctx *c = arg;
	unsigned s = 0;

	(void)id;
	t_check(term >= c->buf && len >= 2 && term + len <= c->buf + c->cap);
	t_check(term[0] == 131);
	for (size_t i = 0; i < len; i++)
		s += term[i];
	t_sink += s;
	c->n++;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	size_t rsz = ap_ring_size(T_CAP), bcap = ap_ring_max_payload(T_CAP) + 1;
	uint8_t *mem, *buf;
	struct ap_ring prod, cons;
	struct t_ctx ctx;
	uint8_t mode;
	int broken = 0;

	if (size < 1)
		return 0;
	mode = data[0];
	data++;
	size--;
	mem = calloc(1, rsz);
	buf = malloc(bcap);
	if (!mem || !buf)
		abort();
	t_check(ap_ring_format(mem, rsz, T_CAP) == 0);
	if (!(mode & 1)) {
		uint64_t tail = 0;
		if (size >= 8) {
			memcpy(&tail, data, 8);
			data += 8;
			size -= 8;
		}
		memcpy(mem + AP_RING_HDR_SIZE, data, size < T_CAP ? size : T_CAP);
		((struct ap_ring_hdr *)mem)->tail = tail;
		if (ap_ring_attach_consumer(&cons, mem, rsz))
			goto out; /* refused at attach: nothing to drain */
	} else {
		t_check(ap_ring_attach_producer(&prod, mem, rsz) == 0);
		t_check(ap_ring_attach_consumer(&cons, mem, rsz) == 0);
		size_t off = 0;
		for (int k = 0; k < 32 && off + 12 <= size; k++) {
			struct ap_dp_rep h;
			uint32_t tl;
			void *w;

			memcpy(&h.ask_id, data + off, 8);
			memcpy(&h.len, data + off + 8, 4);
			h.reserved = (data[off + 8] & 0x80) ? 1 : 0;
			off += 12;
			tl = off < size ? data[off] % 200u : 0;
			off++;
			if (tl > size - off)
				tl = (uint32_t)(size - off);
			if (ap_ring_reserve(&prod, sizeof h + tl, &w))
				break;
			memcpy(w, &h, sizeof h);
			memcpy((uint8_t *)w + sizeof h, data + off, tl);
			off += tl;
		}
		ap_ring_publish(&prod);
		if ((mode & 2) && size >= 3) {
			size_t at = ((size_t)data[0] << 8 | data[1]) % T_CAP;
			mem[AP_RING_HDR_SIZE + at] = data[2];
		}
	}
	ctx.buf = buf;
	ctx.cap = bcap;
	ctx.n = 0;
	for (int pass = 0; pass < 8; pass++) {
		struct dp_drain_stats st = { 0, 0, 0 };
		unsigned before = ctx.n;
		/* Odd passes as an awaiting asker drains (long records left in
		 * the ring); the last ones as the reply thread, which takes all. */
		size_t max_len = (pass & 1) && pass < 6 && size ? 16u + data[size - 1] : SIZE_MAX;
		int rc = dp_drain_upto(&cons, buf, bcap, 64, max_len, t_cb, &ctx, &st);

		t_check(rc == -EPROTO || (rc >= 0 && rc <= 64));
		t_check(!st.held || max_len != SIZE_MAX);
		if (broken)
			t_check(rc == -EPROTO);
		if (rc == -EPROTO) {
			broken = 1;
			continue;
		}
		t_check(st.replies == ctx.n - before);
		t_check(st.replies + st.bad_records == (uint64_t)rc);
		if (rc == 0 && !st.held && pass >= 6)
			break;
	}
out:
	free(buf);
	free(mem);
	return 0;
}
