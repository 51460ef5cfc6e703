/* fuzz_ring: libFuzzer target over the ring's consumer and producer, which
 * will run inside the BEAM (reply rings) and the pool node (request rings)
 * and so must survive any segment bytes. */
/*
 * Input layout: byte 0 = mode, bytes 1-2 = a little-endian 16-bit `at`,
 * then the payload.
 *
 *   mode & 3 == 0   the payload is the whole ring (header + data);
 *   mode & 3 == 1   the same, with magic, version, hdr_size put right and
 *                   cap set to the largest power of two that fits, so the
 *                   indexes and records are what is fuzzed;
 *   mode & 3 >= 2   a valid ring of cap 512 with records written by the
 *                   producer (sizes from `at`; some read and released
 *                   already, so records wrap), the payload over it at
 *                   at % size, clipped at its end; with 3, the header's
 *                   constant fields put back afterwards;
 *   mode & 4        the peer moves while we work: after the consumer's
 *                   (at % 4)-th read, `tail` becomes the payload's first 8
 *                   bytes, and after the producer's first reservation
 *                   `head` becomes the next 8 (payloads shorter than 16
 *                   bytes leave them alone).
 *
 * The ring is an exact-size heap block, so ASan reports any access past
 * it. The consumer drains it in at most cap / 8 + 4 reads, releasing as it
 * goes; every record it hands out must lie inside the data area and be no
 * longer than the maximum; results must be ones the API names. Then a
 * producer attached to the same bytes reserves and commits a few records,
 * with the same checks, and asks whether it would sleep for space.
 */
#include <errno.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ap_ring.h"

/* The failed line on stderr, then a trap libFuzzer reports. */
#include "t_fuzz.h"

#define T_CAP 512u

static volatile unsigned t_sink;

static void t_fix_header(uint8_t *mem, size_t len)
{
	struct ap_ring_hdr *h = (struct ap_ring_hdr *)mem;
	uint64_t cap = AP_RING_MIN_CAP;

	h->magic = AP_RING_MAGIC;
	h->version = AP_RING_VERSION;
	h->hdr_size = AP_RING_HDR_SIZE;
	if (len >= AP_RING_HDR_SIZE + AP_RING_MIN_CAP)
		while (cap * 2 <= len - AP_RING_HDR_SIZE && cap * 2 <= AP_RING_MAX_CAP)
			cap *= 2;
	h->cap = cap;
}

/* A live ring: records of sizes drawn from `at`, a few consumed. */
static void t_template(uint8_t *mem, uint16_t at)
{
	struct ap_ring p, c;
	const void *rp;
	size_t len;
	void *wp;
	uint32_t x = at * 2654435761u + 1;

	t_check(ap_ring_format(mem, ap_ring_size(T_CAP), T_CAP) == 0);
	t_check(ap_ring_attach_producer(&p, mem, ap_ring_size(T_CAP)) == 0);
	t_check(ap_ring_attach_consumer(&c, mem, ap_ring_size(T_CAP)) == 0);
	for (int k = 0; k < 12; k++) {
		x = x * 1103515245u + 12345u;
		size_t l = (x >> 16) % 120;
		if (ap_ring_reserve(&p, l, &wp) == 0) {
			memset(wp, 'a' + k, l);
			ap_ring_commit(&p);
		}
		if ((x >> 8) & 1) {
			while (ap_ring_read(&c, &rp, &len) == 0)
				;
			ap_ring_release(&c);
		}
	}
}

static void t_in_data(const struct ap_ring *r, const void *p, size_t len)
{
	const uint8_t *b = p;

	t_check(b >= r->data && b <= r->data + r->cap);
	t_check(len <= ap_ring_max_payload(r->cap));
	t_check(b + len <= r->data + r->cap);
	if (len)
		t_sink += b[0] + b[len - 1];
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	if (size < 3)
		return 0;
	uint8_t mode = data[0];
	uint16_t at = (uint16_t)(data[1] | data[2] << 8);
	const uint8_t *pl = data + 3;
	size_t pl_len = size - 3, len;
	uint8_t *mem;

	if ((mode & 3) < 2) {
		len = pl_len;
		mem = malloc(len ? len : 1);
		t_check(mem);
		memcpy(mem, pl, len);
		if ((mode & 3) == 1 && len >= AP_RING_HDR_SIZE)
			t_fix_header(mem, len);
	} else {
		len = ap_ring_size(T_CAP);
		mem = malloc(len);
		t_check(mem);
		t_template(mem, at);
		size_t off = at % len, n = pl_len < len - off ? pl_len : len - off;
		memcpy(mem + off, pl, n);
		if ((mode & 3) == 3)
			t_fix_header(mem, len);
	}

	struct ap_ring c, p;
	const void *rp;
	size_t rl;
	void *wp;
	if (ap_ring_attach_consumer(&c, mem, len) == 0) {
		uint32_t *word, expected;
		int rc = ap_ring_prepare_sleep(&c, 0, &word, &expected);
		t_check(rc == 0 || rc == 1 || rc == -EPROTO);
		if (rc == 1)
			t_check(word == &c.hdr->data_bell);
		ap_ring_end_sleep(&c);
		for (uint64_t k = 0; k < c.cap / 8 + 4; k++) {
			if ((mode & 4) && pl_len >= 16 && k == at % 4u)
				memcpy(&c.hdr->tail, pl, 8);
			rc = ap_ring_read(&c, &rp, &rl);
			t_check(rc == 0 || rc == -EAGAIN || rc == -EPROTO);
			if (rc)
				break;
			t_in_data(&c, rp, rl);
			if (k % 4 == 3)
				ap_ring_release(&c);
		}
		ap_ring_release(&c);
		t_check(c.head <= c.tail && c.tail - c.head <= c.cap);
	}
	if (ap_ring_attach_producer(&p, mem, len) == 0) {
		for (int k = 0; k < 8; k++) {
			size_t l = (size_t)(at >> (k & 7)) % (ap_ring_max_payload(p.cap) + 2);
			int rc = ap_ring_reserve(&p, l, &wp);
			t_check(rc == 0 || rc == -EAGAIN || rc == -EMSGSIZE || rc == -EPROTO);
			if (rc == 0) {
				t_in_data(&p, wp, l);
				memset(wp, 0x77, l);
			}
			if ((mode & 4) && pl_len >= 16 && k == 0)
				memcpy(&p.hdr->head, pl + 8, 8);
			if (k & 1) {
				rc = ap_ring_publish(&p);
				t_check(rc == 0 || rc == -EPROTO);
			}
		}
		uint32_t *word, expected;
		int rc = ap_ring_prepare_sleep(&p, at % 512u, &word, &expected);
		t_check(rc == 0 || rc == 1 || rc == -EMSGSIZE || rc == -EPROTO);
		if (rc == 1)
			t_check(word == &p.hdr->space_bell);
		ap_ring_end_sleep(&p);
		t_check(p.head <= p.tail && p.tail <= p.pos && p.pos - p.head <= p.cap);
	}
	free(mem);
	return 0;
}
