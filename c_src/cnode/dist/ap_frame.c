/* ap_frame: distribution frame reassembly. */
#include "ap_frame.h"

#include <errno.h>

void ap_frame_rx_init(ap_frame_rx *rx, uint32_t max_frame)
{
	*rx = (ap_frame_rx){ 0 };
	rx->max_frame = max_frame ? max_frame : AP_FRAME_DEFAULT_MAX;
	rx->head_max = AP_FRAME_HEAD_DEFAULT;
}

void ap_frame_rx_free(ap_frame_rx *rx)
{
	ap_buf_free(&rx->part);
}

void ap_frame_rx_on_oversize(ap_frame_rx *rx, ap_frame_over_cb cb, uint32_t head_max)
{
	if (!head_max) {
		head_max = rx->max_frame < AP_FRAME_HEAD_MIN ? AP_FRAME_HEAD_MIN : rx->max_frame;
		if (head_max > AP_FRAME_HEAD_DEFAULT)
			head_max = AP_FRAME_HEAD_DEFAULT;
	}
	rx->on_over = cb;
	rx->head_max = head_max;
}

/* A frame assembled in part was delivered: empty it, and give a large
 * buffer back. A frame of AP_FRAME_KEEP bytes (a default head among them)
 * fills 4 more with its length: that one is kept, or every oversized frame
 * would free and grow the buffer again. */
static void part_done(ap_frame_rx *rx)
{
	rx->part.len = 0;
	if (rx->part.cap > 4 + (size_t)AP_FRAME_KEEP)
		ap_buf_free(&rx->part);
}

/* The bytes of a frame of body length flen that are delivered, its header
 * included: all of a frame, the head of an oversized one. */
static size_t frame_keep(const ap_frame_rx *rx, uint32_t flen)
{
	if (flen <= rx->max_frame)
		return 4 + (size_t)flen;
	return 4 + (size_t)(flen < rx->head_max ? flen : rx->head_max);
}

/* Deliver the frame (or oversized head) whose length starts at p, with all
 * of its frame_keep bytes present. */
static int deliver(ap_frame_rx *rx, const uint8_t *p, ap_frame_cb cb, void *arg)
{
	uint32_t flen = ap_get32be(p);
	if (flen <= rx->max_frame)
		return cb(arg, p + 4, flen);
	size_t hl = frame_keep(rx, flen) - 4;
	rx->skip = flen - hl;
	return rx->on_over(arg, p + 4, hl, flen);
}

/* Discard what is left of an oversized frame from the front of the data.
 * Returns 1 while more of it is still to come. */
static int skip_some(ap_frame_rx *rx, const uint8_t **data, size_t *n)
{
	size_t k = rx->skip < *n ? (size_t)rx->skip : *n;
	rx->skip -= k;
	*data += k;
	*n -= k;
	return rx->skip > 0;
}

int ap_frame_rx_feed(ap_frame_rx *rx, const uint8_t *data, size_t n, ap_frame_cb cb, void *arg)
{
	int r;

	for (;;) {
		if (rx->skip && skip_some(rx, &data, &n))
			return 0;
		if (rx->part.len == 0 || n == 0)
			break;
		/* Finish a frame begun in an earlier read. */
		size_t total = rx->part.len < 4 ? 4 : frame_keep(rx, ap_get32be(rx->part.data));
		size_t want = total - rx->part.len;
		size_t take = want < n ? want : n;
		if (ap_buf_append_upto(&rx->part, data, take, total))
			return -ENOMEM;
		data += take;
		n -= take;
		if (rx->part.len == 4 && ap_get32be(rx->part.data) > rx->max_frame && !rx->on_over)
			return -EMSGSIZE;
		if (rx->part.len >= 4 && rx->part.len == frame_keep(rx, ap_get32be(rx->part.data))) {
			r = deliver(rx, rx->part.data, cb, arg);
			part_done(rx);
			if (r)
				return r;
		}
	}

	/* Whole frames (and whole heads) straight from the caller's buffer. */
	while (n >= 4) {
		uint32_t flen = ap_get32be(data);
		if (flen > rx->max_frame && !rx->on_over)
			return -EMSGSIZE;
		size_t keep = frame_keep(rx, flen);
		if (keep > n)
			break;
		r = deliver(rx, data, cb, arg);
		if (r)
			return r;
		data += keep;
		n -= keep;
		if (rx->skip && skip_some(rx, &data, &n))
			return 0;
	}

	/* Keep the start of the next frame: only the bytes that came. */
	if (n > 0 && ap_buf_append_upto(&rx->part, data, n, n >= 4 ? frame_keep(rx, ap_get32be(data)) : SIZE_MAX))
		return -ENOMEM;
	return 0;
}
