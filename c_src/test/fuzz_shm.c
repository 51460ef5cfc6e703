/* fuzz_shm: libFuzzer target over the snapshot reader, which runs inside the
 * BEAM and so must survive any segment bytes. */
/*
 * Input layout: byte 0 = mode, bytes 1-2 = a little-endian 16-bit number
 * `at`, then the payload.
 *
 *   mode & 3 == 0   the payload is the whole segment;
 *   mode & 3 != 0   a valid small segment built by the writer (1: gen 0;
 *                   2: compacted once, gen odd; 3: compacted twice, so both
 *                   halves were written) with the payload over it at
 *                   at % size, clipped at its end;
 *   mode & 4        the mapping is only at % (size + 1) bytes long;
 *   mode & 8        magic, version, hdr_size and state are put back, so a
 *                   payload over the header still reaches the halves.
 *
 * The segment is always an exact-size 8-aligned heap block, so ASan reports
 * any read past len. The reader is asked for the template's keys, a missing
 * one, and a key taken from the payload, with a 4-byte and a 64 KiB buffer,
 * through lookup and through find + read, and read is also asked for a
 * (gen, off) taken from the payload. Results must be ones the API names,
 * consistent with the buffer sizes; and, on an untouched template, right.
 * A whole-segment payload is also judged as the sweep judges a header
 * (ap_shm_judge).
 */
#include <errno.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ap_shm.h"

#include "t_fuzz.h"

#define T_SEG 32768u /* the smallest caller memory the writer takes, rounded up */
#define T_BIG (1u << 16)

static const char *t_keys[] = { "alpha", "beta", "gamma", "delta", "", "a much longer key, more than 8 bytes", "gone" };
#define T_NKEYS (sizeof t_keys / sizeof t_keys[0])

static uint8_t *t_tmpl[3];

static void t_value(char *buf, size_t n, size_t i) { snprintf(buf, n, "value %zu of key '%s'", i, t_keys[i]); }

static int t_put(ap_shm_writer *w, const char *k, const void *v, size_t vlen)
{
	return ap_shm_put(w, k, strlen(k), v, vlen);
}

/* A template: every key but "gone" (removed) at its value, after
 * `compactions` compactions forced by updates of a fat value. */
static uint8_t *t_build(uint64_t compactions)
{
	uint8_t *mem = aligned_alloc(8, T_SEG);
	ap_shm_writer *w;
	uint64_t c = 0;
	char v[128];
	static char fat[300];

	t_check(mem);
	memset(mem, 0, T_SEG);
	memset(fat, 'f', sizeof fat);
	t_check(ap_shm_writer_init_mem(&w, mem, T_SEG, "fuzz@host", 1) == 0);
	for (size_t i = 0; i < T_NKEYS; i++) {
		t_value(v, sizeof v, i);
		t_check(t_put(w, t_keys[i], v, strlen(v)) == 0);
	}
	for (int n = 0; c < compactions; n++) {
		t_check(t_put(w, t_keys[n % 3], fat, sizeof fat - (size_t)(n % 50)) == 0);
		ap_shm_writer_stats(w, NULL, NULL, &c);
	}
	for (size_t i = 0; i < 3; i++) {
		t_value(v, sizeof v, i);
		t_check(t_put(w, t_keys[i], v, strlen(v)) == 0);
	}
	t_check(t_put(w, "gone", NULL, 0) == 0);
	ap_shm_writer_close(w, 0);
	/* Closing marked it CLOSED, which readers refuse outright. */
	((struct ap_shm_hdr *)mem)->state = AP_SHM_STATE_LIVE;
	t_check(ap_shm_check(mem, T_SEG) == AP_SHM_OK);
	return mem;
}

static int t_result_ok(int r) { return r >= AP_SHM_OK && r <= AP_SHM_ETOOBIG; }

/* Everything a reader may call, on seg[0..len). `exact`: the template,
 * untouched, whose answers are known. */
static void t_read(const uint8_t *seg, size_t len, const uint8_t *payload, size_t plen, int exact)
{
	static uint8_t big[T_BIG];
	uint8_t small[4];
	char want[128];
	int r = ap_shm_check(seg, len);

	t_check(r == AP_SHM_OK || r == AP_SHM_EBAD || r == AP_SHM_ESTALE || r == AP_SHM_EBUSY);
	if (exact)
		t_check(r == AP_SHM_OK);
	/* The label reads the header only: never past len, and on the template
	 * exactly the counter the writer left. */
	uint64_t label = ap_shm_changes(seg, len);
	if (label != AP_SHM_NO_CHANGES)
		t_check(len >= AP_SHM_HDR_SIZE);
	if (exact)
		t_check(label == ((const struct ap_shm_hdr *)seg)->changes);
	for (size_t i = 0; i <= T_NKEYS + 1; i++) {
		const void *k;
		size_t kl;
		uint32_t vl = 0, vl2 = 0;
		uint64_t gen = 0, off = 0;

		if (i < T_NKEYS) {
			k = t_keys[i];
			kl = strlen(t_keys[i]);
		} else if (i == T_NKEYS) {
			k = "missing";
			kl = 7;
		} else {
			k = payload;
			kl = plen < 40 ? plen : 40;
		}

		r = ap_shm_lookup(seg, len, k, kl, big, sizeof big, &vl);
		t_check(t_result_ok(r));
		if (r == AP_SHM_OK)
			t_check(vl > 0 && vl <= sizeof big);
		if (r == AP_SHM_ETOOBIG)
			t_check(vl > sizeof big);
		if (exact && i < T_NKEYS) {
			if (!strcmp(t_keys[i], "gone")) {
				t_check(r == AP_SHM_ENOTFOUND);
			} else {
				t_value(want, sizeof want, i);
				t_check(r == AP_SHM_OK && vl == strlen(want) && !memcmp(big, want, vl));
			}
		}
		if (exact && i == T_NKEYS)
			t_check(r == AP_SHM_ENOTFOUND);

		r = ap_shm_lookup(seg, len, k, kl, small, sizeof small, &vl);
		t_check(t_result_ok(r));
		if (r == AP_SHM_OK)
			t_check(vl > 0 && vl <= sizeof small);
		if (r == AP_SHM_ETOOBIG)
			t_check(vl > sizeof small);

		r = ap_shm_find(seg, len, k, kl, &gen, &off, &vl);
		t_check(t_result_ok(r) && r != AP_SHM_ETOOBIG);
		if (r == AP_SHM_OK) {
			t_check(vl > 0 && off > 0 && off % 8 == 0);
			/* Nothing changes the segment: read agrees with find. */
			r = ap_shm_read(seg, len, gen, off, big, sizeof big, &vl2);
			t_check(r == AP_SHM_OK || r == AP_SHM_ETOOBIG);
			t_check(vl2 == vl);
			r = ap_shm_read(seg, len, gen, off, small, sizeof small, &vl2);
			t_check(r == (vl <= sizeof small ? AP_SHM_OK : AP_SHM_ETOOBIG) && vl2 == vl);
		}
	}

	/* read trusts nothing it is given either. */
	if (plen >= 16) {
		uint64_t gen, off;
		uint32_t vl = 0;
		memcpy(&gen, payload, 8);
		memcpy(&off, payload + 8, 8);
		r = ap_shm_read(seg, len, gen, off, big, sizeof big, &vl);
		t_check(t_result_ok(r) && r != AP_SHM_ENOTFOUND && r != AP_SHM_ESTALE);
		r = ap_shm_read(seg, len, gen, off % T_SEG, big, sizeof big, &vl);
		t_check(t_result_ok(r) && r != AP_SHM_ENOTFOUND && r != AP_SHM_ESTALE);
	}
}

/* The sweep's verdict on the same bytes (a header read from a file anyone
 * could have written): one the API names; LIVE whenever the lock is held;
 * with the lock free, "gone" only for an empty object, a zero or creating
 * magic, or our magic at this layout (or 3 or 4, whose pid kill(2) finds no
 * process: harmless to ask about any pid). */
static void t_judge(const uint8_t *seg, size_t len)
{
	struct ap_shm_verdict v;
	uint64_t magic = 0;
	enum ap_shm_fate f = ap_shm_judge(seg, len, 1, &v);

	t_check(f == v.fate && f == AP_SHM_FATE_LIVE);
	f = ap_shm_judge(seg, len, 0, &v);
	t_check(f == v.fate && f <= AP_SHM_FATE_UNREADABLE);
	if (len >= sizeof magic)
		memcpy(&magic, seg, sizeof magic);
	if (f == AP_SHM_FATE_GONE)
		t_check(len == 0 || (len >= sizeof magic && (magic == 0 || magic == AP_SHM_MAGIC_CREATING ||
							      (magic == AP_SHM_MAGIC && (v.version == AP_SHM_VERSION ||
											v.version == 3 || v.version == 4)))));
	if (f == AP_SHM_FATE_UNKNOWN || f == AP_SHM_FATE_UNREADABLE)
		t_check(v.why != NULL);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	if (size < 3)
		return 0;
	if (!t_tmpl[0]) {
		t_tmpl[0] = t_build(0);
		t_tmpl[1] = t_build(1);
		t_tmpl[2] = t_build(2);
		t_check(((struct ap_shm_hdr *)t_tmpl[1])->gen % 2 == 1);
		t_check(((struct ap_shm_hdr *)t_tmpl[2])->gen % 2 == 0 && ((struct ap_shm_hdr *)t_tmpl[2])->gen > 0);
	}

	unsigned mode = data[0];
	size_t at = (size_t)data[1] | (size_t)data[2] << 8;
	const uint8_t *payload = data + 3;
	size_t plen = size - 3, len;
	uint8_t *seg;

	if ((mode & 3) == 0) {
		len = plen;
		seg = malloc(len ? len : 1);
		t_check(seg);
		if (len)
			memcpy(seg, payload, len);
		t_read(seg, len, payload, plen, 0);
		t_judge(seg, len);
		free(seg);
		return 0;
	}

	const uint8_t *tmpl = t_tmpl[(mode & 3) - 1];
	size_t put_at = at % T_SEG, n = plen < T_SEG - put_at ? plen : T_SEG - put_at;
	len = mode & 4 ? at % (T_SEG + 1) : T_SEG;
	seg = malloc(len ? len : 1); /* malloc: 16-aligned */
	t_check(seg);
	/* Build the whole segment, then keep its first len bytes. */
	uint8_t *full = malloc(T_SEG);
	t_check(full);
	memcpy(full, tmpl, T_SEG);
	memcpy(full + put_at, payload, n);
	if (mode & 8) {
		struct ap_shm_hdr *h = (struct ap_shm_hdr *)full;
		const struct ap_shm_hdr *th = (const struct ap_shm_hdr *)tmpl;
		h->magic = th->magic;
		h->version = th->version;
		h->hdr_size = th->hdr_size;
		h->state = AP_SHM_STATE_LIVE;
	}
	memcpy(seg, full, len);
	t_read(seg, len, payload, plen, len == T_SEG && (n == 0 || !memcmp(full, tmpl, T_SEG)));
	free(full);
	free(seg);
	return 0;
}
