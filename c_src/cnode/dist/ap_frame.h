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
/* Of a frame over max_frame, at most this many first bytes are kept, for
 * its control message and the head of its message (who sent it, to whom,
 * and a call's reply tag); the rest is passed over as it arrives. By
 * default the head is max_frame, within [AP_FRAME_HEAD_MIN,
 * AP_FRAME_HEAD_DEFAULT]: a node told to keep little keeps little, and
 * AP_FRAME_HEAD_MIN still holds the usual headers whole (a REG_SEND of a
 * $gen_call with an [alias|Ref] tag between 255-byte node names is under
 * 2 KiB). */
#define AP_FRAME_HEAD_DEFAULT (64u << 10)
#define AP_FRAME_HEAD_MIN (4u << 10)

/* Called once per frame over max_frame, with its first bytes (after the
 * length): head_len is min(frame_len, head_max). The rest of the frame is
 * then read and discarded, never buffered. Returns like ap_frame_cb. */
typedef int (*ap_frame_over_cb)(void *arg, const uint8_t *head, size_t head_len, uint32_t frame_len);

typedef struct ap_frame_rx {
	/* Bytes of an unfinished frame, carried between reads. It grows with
	 * the bytes that arrive, never from the announced length, so a header
	 * alone reserves nothing. */
	ap_buf part;
	uint32_t max_frame; /* a larger frame is an error, or passed over (on_over) */
	ap_frame_over_cb on_over; /* NULL: a frame over max_frame is -EMSGSIZE */
	uint32_t head_max;        /* bytes of an oversized frame given to on_over */
	uint64_t skip;            /* bytes of an oversized frame still to discard */
} ap_frame_rx;

/* Called once per complete frame; len 0 is a tick. A non-zero return stops
 * the feed and is passed back to the caller (the connection is closing). The
 * frame bytes are only valid during the call. */
typedef int (*ap_frame_cb)(void *arg, const uint8_t *frame, size_t len);

void ap_frame_rx_init(ap_frame_rx *rx, uint32_t max_frame);
void ap_frame_rx_free(ap_frame_rx *rx);
/* Pass frames over max_frame over instead of failing: cb sees the first
 * head_max bytes (0: min(AP_FRAME_HEAD_DEFAULT, max(max_frame,
 * AP_FRAME_HEAD_MIN))), the rest is skipped. Memory
 * stays bounded by head_max whatever length a peer announces. */
void ap_frame_rx_on_oversize(ap_frame_rx *rx, ap_frame_over_cb cb, uint32_t head_max);

/* Feed n bytes. Frames lying wholly inside `data` are passed without a copy;
 * only a frame split across reads is assembled in rx->part (for an
 * oversized frame, only its head).
 * Returns 0, -EMSGSIZE (a length over max_frame, without on_over), -ENOMEM,
 * or a callback's non-zero value. After an error the rx must not be fed
 * again. */
int ap_frame_rx_feed(ap_frame_rx *rx, const uint8_t *data, size_t n, ap_frame_cb cb, void *arg);

#endif
