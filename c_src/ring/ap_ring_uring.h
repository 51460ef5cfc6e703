/* ap_ring_uring: ring doorbells as io_uring futex operations (Linux 6.7+),
 * for an event loop that waits on a ring beside its sockets.
 *
 * liburing 2.3 has no futex helpers, so the SQEs are filled by hand:
 * opcode IORING_OP_FUTEX_WAIT (51) or _WAKE (52); fd = futex2 flags,
 * FUTEX2_SIZE_U32 without FUTEX2_PRIVATE (the word is shared with another
 * process); addr = the word; addr2 = the expected value (WAIT) or the
 * number to wake (WAKE); addr3 = the bitmask (0xffffffff: any); every
 * other field 0 (the kernel rejects len, futex_flags, buf_index and
 * file_index set). A WAIT completes with res 0 when woken, -EAGAIN when
 * the word did not hold the expected value, -ECANCELED when cancelled.
 *
 * Use with the sleep protocol of ap_ring.h:
 *   if (ap_ring_prepare_sleep(r, 0, &word, &expected) == 1)
 *           ap_ring_uring_prep_futex_wait(sqe, word, expected, tag);
 *   ... on its CQE: ap_ring_end_sleep(r), then drain the ring.
 *
 * Every wait gets a timeout (the peer may never ring):
 *   sqe = get_sqe(); ap_ring_uring_prep_futex_wait(sqe, ...);
 *   tmo = get_sqe(); ap_ring_uring_link_timeout(sqe, tmo, &ts, tag2);
 * both in one submit. And every completion means "look again", not "there
 * is data": the peer can ring at will (see "Bounded waits" in ap_ring.h).
 *
 * Cancel before unmapping. An armed wait holds the word's address in the
 * kernel: before the segment is unmapped (peer gone, shutdown), cancel it
 * (io_uring_prep_cancel64 on its user_data) and reap its CQE (-ECANCELED
 * or its result); only then munmap. A use-after-free was reported when a
 * process was killed with such a wait in flight.
 *
 * Support is probed at run time (IORING_REGISTER_PROBE): an older kernel,
 * or one where the op is filtered, gets the eventfd/thread fallback.
 * Reports on these ops (see the data-plane notes): PRIVATE waits lost
 * wake-ups on 6.17 (we use shared), late wake-ups seen by one project,
 * and a use-after-free when a process was killed with a wait in flight:
 * keep the fallback tested.
 */
#ifndef AP_RING_URING_H
#define AP_RING_URING_H

#include <liburing.h>
#include <stdint.h>

#define AP_RING_IORING_OP_FUTEX_WAIT 51
#define AP_RING_IORING_OP_FUTEX_WAKE 52
#define AP_RING_FUTEX2_SIZE_U32 0x02u
#define AP_RING_FUTEX2_PRIVATE 128u
#define AP_RING_FUTEX_BITSET_ANY 0xffffffffu

/* 1 if the ring (or, with ring NULL, a fresh probe ring) supports both
 * IORING_OP_FUTEX_WAIT and _WAKE; 0 if not or if io_uring is unavailable. */
int ap_ring_uring_futex_supported(struct io_uring *ring);

/* Fills sqe (cleared first) with a shared 32-bit FUTEX_WAIT on word while
 * it holds expected. */
void ap_ring_uring_prep_futex_wait(struct io_uring_sqe *sqe, uint32_t *word, uint32_t expected,
				   uint64_t user_data);

/* Links a timeout to the wait just prepared in wait_sqe: sets IOSQE_IO_LINK
 * on it and fills tmo_sqe, which must be the next SQE taken from the same
 * ring, with IORING_OP_LINK_TIMEOUT of *ts (relative; it must stay valid
 * until submitted). When ts passes first, the wait completes with
 * -ECANCELED and the timeout with -ETIME (6.18 reports 1 instead for a
 * futex wait: the number of requests its cancel found); when the wait
 * completes first,
 * the timeout's CQE (user_data) is -ECANCELED. Both CQEs come. */
void ap_ring_uring_link_timeout(struct io_uring_sqe *wait_sqe, struct io_uring_sqe *tmo_sqe,
				struct __kernel_timespec *ts, uint64_t user_data);

/* Fills sqe with a shared 32-bit FUTEX_WAKE of up to n waiters on word. */
void ap_ring_uring_prep_futex_wake(struct io_uring_sqe *sqe, uint32_t *word, uint32_t n, uint64_t user_data);

#endif
