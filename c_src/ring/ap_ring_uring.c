/* ap_ring_uring: io_uring futex SQEs filled by hand, and the probe. */
#include "ap_ring_uring.h"

#include <string.h>

int ap_ring_uring_futex_supported(struct io_uring *ring)
{
	struct io_uring_probe *p = ring ? io_uring_get_probe_ring(ring) : io_uring_get_probe();
	int ok;

	if (!p)
		return 0;
	ok = io_uring_opcode_supported(p, AP_RING_IORING_OP_FUTEX_WAIT) &&
	     io_uring_opcode_supported(p, AP_RING_IORING_OP_FUTEX_WAKE);
	io_uring_free_probe(p);
	return ok;
}

static void prep_futex(struct io_uring_sqe *sqe, uint8_t op, uint32_t *word, uint64_t val, uint64_t user_data)
{
	memset(sqe, 0, sizeof *sqe);
	sqe->opcode = op;
	sqe->fd = (int32_t)AP_RING_FUTEX2_SIZE_U32; /* shared: no FUTEX2_PRIVATE */
	sqe->addr = (uint64_t)(uintptr_t)word;
	sqe->addr2 = val;
	sqe->addr3 = AP_RING_FUTEX_BITSET_ANY;
	sqe->user_data = user_data;
}

void ap_ring_uring_prep_futex_wait(struct io_uring_sqe *sqe, uint32_t *word, uint32_t expected, uint64_t user_data)
{
	prep_futex(sqe, AP_RING_IORING_OP_FUTEX_WAIT, word, expected, user_data);
}

void ap_ring_uring_prep_futex_wake(struct io_uring_sqe *sqe, uint32_t *word, uint32_t n, uint64_t user_data)
{
	prep_futex(sqe, AP_RING_IORING_OP_FUTEX_WAKE, word, n, user_data);
}

void ap_ring_uring_link_timeout(struct io_uring_sqe *wait_sqe, struct io_uring_sqe *tmo_sqe,
				struct __kernel_timespec *ts, uint64_t user_data)
{
	wait_sqe->flags |= IOSQE_IO_LINK;
	io_uring_prep_link_timeout(tmo_sqe, ts, 0);
	tmo_sqe->user_data = user_data;
}
