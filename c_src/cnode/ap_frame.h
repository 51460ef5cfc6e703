/* ap_frame: reassembly of distribution frames (4-byte length, 0 = tick)
 * from reads of any size. */
#ifndef AP_FRAME_H
#define AP_FRAME_H

#include <stddef.h>
#include <stdint.h>

#include "ap_buf.h"

#define AP_FRAME_DEFAULT_MAX (64u << 20)
/* A reassembly buffer larger than this is freed once its frame is
 * delivered: one large frame does not pin its size for the connection's
 * life. */
#define AP_FRAME_KEEP (64u << 10)

typedef struct ap_frame_rx {
	/* Bytes of an unfinished frame, carried between reads. It grows with
	 * the bytes that arrive, never from the announced length, so a header
	 * alone reserves nothing. */
	ap_buf part;
	uint32_t max_frame; /* a larger announced length closes the connection */
} ap_frame_rx;

/* Called once per complete frame; len 0 is a tick. A non-zero return stops
 * the feed and is passed back to the caller (the connection is closing). The
 * frame bytes are only valid during the call. */
typedef int (*ap_frame_cb)(void *arg, const uint8_t *frame, size_t len);

void ap_frame_rx_init(ap_frame_rx *rx, uint32_t max_frame);
void ap_frame_rx_free(ap_frame_rx *rx);

/* Feed n bytes. Frames lying wholly inside `data` are passed without a copy;
 * only a frame split across reads is assembled in rx->part.
 * Returns 0, -EMSGSIZE (a length over max_frame), -ENOMEM, or the callback's
 * non-zero value. After an error the rx must not be fed again. */
int ap_frame_rx_feed(ap_frame_rx *rx, const uint8_t *data, size_t n, ap_frame_cb cb, void *arg);

#endif
