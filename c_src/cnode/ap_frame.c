/* ap_frame: distribution frame reassembly. */
#include "ap_frame.h"

#include <errno.h>

void ap_frame_rx_init(ap_frame_rx *rx, uint32_t max_frame)
{
	rx->part = (ap_buf){ 0 };
	rx->max_frame = max_frame ? max_frame : AP_FRAME_DEFAULT_MAX;
}

void ap_frame_rx_free(ap_frame_rx *rx)
{
	ap_buf_free(&rx->part);
}

/* A frame assembled in part was delivered: empty it, and give a large
 * buffer back. */
static void part_done(ap_frame_rx *rx)
{
	rx->part.len = 0;
	if (rx->part.cap > AP_FRAME_KEEP)
		ap_buf_free(&rx->part);
}

int ap_frame_rx_feed(ap_frame_rx *rx, const uint8_t *data, size_t n, ap_frame_cb cb, void *arg)
{
	int r;

	/* Finish a frame begun in an earlier read. */
	while (rx->part.len > 0 && n > 0) {
		size_t want, total;
		if (rx->part.len < 4) {
			want = 4 - rx->part.len;
			total = 4;
		} else {
			total = 4 + (size_t)ap_get32be(rx->part.data);
			want = total - rx->part.len;
		}
		size_t take = want < n ? want : n;
		if (ap_buf_append_upto(&rx->part, data, take, total))
			return -ENOMEM;
		data += take;
		n -= take;
		if (rx->part.len == 4 && ap_get32be(rx->part.data) > rx->max_frame)
			return -EMSGSIZE;
		if (rx->part.len >= 4 && rx->part.len == 4 + (size_t)ap_get32be(rx->part.data)) {
			r = cb(arg, rx->part.data + 4, rx->part.len - 4);
			part_done(rx);
			if (r)
				return r;
		}
	}

	/* Whole frames straight from the caller's buffer. */
	while (n >= 4) {
		uint32_t flen = ap_get32be(data);
		if (flen > rx->max_frame)
			return -EMSGSIZE;
		if ((size_t)flen > n - 4)
			break;
		r = cb(arg, data + 4, flen);
		if (r)
			return r;
		data += 4 + (size_t)flen;
		n -= 4 + (size_t)flen;
	}

	/* Keep the start of the next frame: only the bytes that came. */
	if (n > 0 && ap_buf_append_upto(&rx->part, data, n, n >= 4 ? 4 + (size_t)ap_get32be(data) : SIZE_MAX))
		return -ENOMEM;
	return 0;
}
