/* fuzz_decode: libFuzzer target over frame reassembly, control decoding and term validation. */
/*
 * Input layout: byte 0 = k (mod 8), then k chunk-size bytes, then the byte
 * stream a socket would deliver. The stream is fed to ap_frame_rx_feed in
 * chunks of sizes[i % k] + 1 bytes (one chunk when k is 0); every frame is
 * decoded with ap_ctrl_decode from an exact-size copy (so ASan sees any read
 * past it), and whatever the decoder vouches for is checked: a send's message
 * validates whole, a reason is one term, and ei, which takes no length, ends
 * both exactly where the walk did. ap_term_skip and ap_term_validate_msg also
 * run on the raw input, and ei must agree with whatever they accept; so
 * does the strict reply check (ap_term_check), which must take only what
 * the walk takes, and end where it ends (bit 0 of byte 0: its atom
 * callback refuses from the fourth atom on).
 * With bit 3 of byte 0 set, frames over T_MAX_FRAME are passed over instead
 * (ap_frame_rx_on_oversize, a head of T_HEAD bytes), and every head, like
 * a prefix of every frame, goes through ap_ctrl_decode_head.
 */
#include <ei.h>
#include <errno.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ap_ctrl.h"
#include "ap_frame.h"
#include "ap_term.h"

#define T_MAX_FRAME (1u << 20)
#define T_HEAD 64

#include "t_fuzz.h"

/* The head of a frame, from an exact-size copy: a control tuple that lies
 * inside it, and a message span (maybe empty) that ends with it. */
static void t_head(const uint8_t *h, size_t len)
{
	uint8_t *d = malloc(len ? len : 1);
	if (!d)
		return;
	memcpy(d, h, len);
	ap_ctrl c;
	int r = ap_ctrl_decode_head(d, len, &c);
	t_check(r == 0 || r == -EBADMSG || r == -ENOTSUP || r == -ENODATA);
	if (r == 0 && c.msg)
		t_check(c.msg >= (const char *)d && c.msg_len >= 0 && c.msg + c.msg_len == (const char *)d + len);
	if (r == 0 && c.op == AP_OP_REG_SEND)
		t_check(memchr(c.toname, 0, sizeof c.toname) != NULL);
	free(d);
}

static int t_on_over(void *arg, const uint8_t *head, size_t hl, uint32_t flen)
{
	(void)arg;
	t_check(flen > T_MAX_FRAME && hl == T_HEAD);
	t_head(head, hl);
	return 0;
}

/* The differential check: for a term ap_term vouched for at buf[start..end)
 * of an exact-size block buf[0..len), ei_skip_term must succeed and end at
 * exactly `end`. Anything else means a consumer that trusts ei after the walk
 * reads bytes the walk never looked at: ei_skip_term ignores an element it
 * cannot read inside a tuple, list or map and carries on from there, so
 * "stays inside" is not enough. ASan reports any read past len. */
static void t_ei_agrees(const char *buf, int len, int start, int end)
{
	int i = start;
	t_check(end >= start && end <= len);
	t_check(ei_skip_term(buf, &i) == 0);
	t_check(i == end);
}

static int t_on_frame(void *arg, const uint8_t *f, size_t len)
{
	size_t *frames = arg;
	(*frames)++;
	t_check(len <= T_MAX_FRAME);
	if (len == 0)
		return 0; /* a tick */

	t_head(f, len / 2);
	uint8_t *d = malloc(len);
	if (!d)
		return -ENOMEM;
	memcpy(d, f, len);
	ap_ctrl c;
	int r = ap_ctrl_decode(d, len, &c);
	t_check(r == 0 || r == -EBADMSG || r == -ENOTSUP);
	if (r == 0) {
		const char *lo = (const char *)d, *hi = lo + len;
		switch (c.op) {
		case AP_OP_SEND:
		case AP_OP_REG_SEND:
		case AP_OP_ALIAS_SEND:
			t_check(c.msg && c.msg >= lo && c.msg_len > 0 && c.msg + c.msg_len == hi);
			t_check(ap_term_validate_msg(c.msg, (size_t)c.msg_len) == 0);
			t_ei_agrees(c.msg, c.msg_len, 1, c.msg_len);
			if (c.op == AP_OP_REG_SEND)
				t_check(memchr(c.toname, 0, sizeof c.toname) != NULL);
			break;
		case AP_OP_EXIT:
		case AP_OP_EXIT2: {
			t_check(c.reason && c.reason >= lo && c.reason_len > 0 && c.reason + c.reason_len <= hi);
			int i = 0;
			t_check(ap_term_skip(c.reason, (size_t)c.reason_len, &i) == 0 && i == c.reason_len);
			/* ei reads a reason in place, so give it exactly the span. */
			char *rs = malloc((size_t)c.reason_len);
			if (rs) {
				memcpy(rs, c.reason, (size_t)c.reason_len);
				t_ei_agrees(rs, c.reason_len, 0, c.reason_len);
				free(rs);
			}
			t_check(c.msg == NULL);
			break;
		}
		case AP_OP_LINK:
		case AP_OP_UNLINK:
		case AP_OP_UNLINK_ID:
		case AP_OP_UNLINK_ID_ACK:
		case AP_OP_GROUP_LEADER:
			t_check(c.msg == NULL && c.reason == NULL);
			break;
		default:
			t_check(0); /* decoded to an op it does not return */
		}
		t_check(memchr(c.from.node, 0, sizeof c.from.node) != NULL);
		t_check(memchr(c.to.node, 0, sizeof c.to.node) != NULL);
	}
	free(d);
	return 0;
}

/* The strict check's atom callback: every name one it vouched for (at
 * most 255 characters of UTF-8, 1020 bytes); refusing from the fourth on
 * when asked to. */
static int t_atoms_left;

static int t_atom(void *arg, const uint8_t *name, size_t len)
{
	(void)arg;
	t_check(len <= 1020 && name != NULL);
	if (t_atoms_left == 0)
		return -1;
	if (t_atoms_left > 0)
		t_atoms_left--;
	return 0;
}

/* The strict check on an exact-size copy of data[0, size). */
static void t_strict(const uint8_t *data, size_t size, int refuse)
{
	uint8_t *d = malloc(size);
	if (!d)
		return;
	memcpy(d, data, size);
	ap_term_strict st;
	memset(&st, 0, sizeof st);
	st.self_node = "a@b";
	st.self_node_len = 3;
	st.atom = t_atom;
	t_atoms_left = refuse ? 3 : -1;
	int idx = 0, sidx = 0;
	if (ap_term_check((const char *)d, size, &idx, &st) == 0) {
		t_check(ap_term_skip((const char *)d, size, &sidx) == 0 && sidx == idx);
		t_ei_agrees((const char *)d, idx, 0, idx);
	} else {
		t_check(idx == 0 && st.why != NULL);
	}
	ap_term_strict_free(&st);
	free(d);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	if (size == 0)
		return 0;

	/* The raw input as a term and as a message. */
	int idx = 0, sidx = 0;
	uint64_t max_map;
	int sr = ap_term_scan((const char *)data, size, &sidx, &max_map);
	if (ap_term_skip((const char *)data, size, &idx) == 0) {
		/* the scan walks alike, and no map is larger than the input */
		t_check(sr == 0 && sidx == idx && max_map <= size);
		t_check(idx > 0 && (size_t)idx <= size);
		uint8_t *d = malloc((size_t)idx);
		if (d) {
			memcpy(d, data, (size_t)idx);
			t_ei_agrees((const char *)d, idx, 0, idx);
			free(d);
		}
	} else {
		t_check(idx == 0 && sr == -1 && sidx == 0);
	}
	if (ap_term_validate_msg((const char *)data, size) == 0)
		t_ei_agrees((const char *)data, (int)size, 1, (int)size);
	t_strict(data, size, data[0] & 1);

	/* The input as a socket stream. */
	size_t k = data[0] % 8;
	if (size < 1 + k)
		return 0;
	const uint8_t *sizes = data + 1;
	const uint8_t *s = data + 1 + k;
	size_t n = size - 1 - k;

	ap_frame_rx rx;
	ap_frame_rx_init(&rx, T_MAX_FRAME);
	if (data[0] & 8)
		ap_frame_rx_on_oversize(&rx, t_on_over, T_HEAD);
	size_t frames = 0;
	int r = 0;
	for (size_t at = 0, i = 0; at < n && r == 0; i++) {
		size_t want = k ? (size_t)sizes[i % k] + 1 : n;
		if (want > n - at)
			want = n - at;
		/* Each chunk in its own block, as a read would leave it. */
		uint8_t *chunk = malloc(want);
		if (!chunk)
			break;
		memcpy(chunk, s + at, want);
		r = ap_frame_rx_feed(&rx, chunk, want, t_on_frame, &frames);
		free(chunk);
		at += want;
	}
	t_check(r == 0 || r == -EMSGSIZE || r == -ENOMEM);
	t_check(rx.part.len <= 4 + (size_t)T_MAX_FRAME);
	t_check(!(data[0] & 8) || r != -EMSGSIZE);
	ap_frame_rx_free(&rx);
	return 0;
}
