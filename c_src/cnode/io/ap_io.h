/* ap_io: the event loop under a C node: accept, receive, batched send,
 * readiness of auxiliary fds, and waits bounded by the caller's next timer.
 *
 * Two backends sit behind it, one per file: io_uring (ap_io_uring.c) and
 * epoll (ap_io_epoll.c). The backend is chosen at run time, because whether
 * io_uring may start is only known then (seccomp, kernel.io_uring_disabled).
 * Everything here runs on the loop thread only.
 */
#ifndef AP_IO_H
#define AP_IO_H

#include <linux/time_types.h>
#include <stddef.h>
#include <stdint.h>

#include "ap_buf.h"

typedef struct ap_loop ap_loop;

typedef struct ap_io_conn {
	int fd;
	void *owner;          /* the owner's per-connection state */
	ap_buf out;           /* frames queued by the loop thread, sent at the next flush */
	ap_buf inflight;      /* bytes handed to the kernel; never touched until sent */
	size_t inflight_off;  /* bytes of inflight already written (short sends) */
	unsigned sending : 1; /* a send is in flight */
	unsigned dirty : 1;   /* on the loop's flush list */
	unsigned closing : 1; /* being torn down; on_closed follows */
	int refs;             /* backend operations still referencing this conn */
	int close_err;        /* why it closed: 0 for EOF / requested, else an errno */
	struct ap_io_conn *next_dirty;
	struct ap_io_conn *next_closed;
	struct ap_io_conn *next_rearm; /* uring: receive deferred while coalescing */
	unsigned rearm_pending : 1;
	uint64_t bytes_in, bytes_out, sends;
} ap_io_conn;

typedef struct ap_io_cbs {
	/* A new connection on the listening socket: fd is blocking and owned
	 * by the callee. */
	void (*on_accept)(void *arg, int fd);
	/* Bytes arrived on c (valid during the call only). Return non-zero to
	 * close c. */
	int (*on_data)(void *arg, ap_io_conn *c, const uint8_t *data, size_t n);
	/* c is closed and about to be freed: peer EOF, an error, or
	 * ap_loop_close. The owner drops every pointer to it. */
	void (*on_closed)(void *arg, ap_io_conn *c);
	/* An fd added with ap_loop_add_reader is readable; the callee reads it. */
	void (*on_readable)(void *arg, int id);
} ap_io_cbs;

/* want: "auto" (io_uring, else epoll), "uring" or "epoll"; NULL = auto.
 * "uring" that cannot start falls back to epoll with a warning. */
ap_loop *ap_loop_new(const char *want, const ap_io_cbs *cbs, void *arg);
void ap_loop_free(ap_loop *l);
const char *ap_loop_backend(const ap_loop *l); /* "uring" or "epoll" */

int ap_loop_listen(ap_loop *l, int lfd);                 /* 0 or -errno */
/* Adopt a connected socket (it becomes non-blocking). NULL on failure, and
 * then the fd is closed. */
ap_io_conn *ap_loop_add_conn(ap_loop *l, int fd, void *owner);
/* Queue c->out for sending; every queued conn is flushed before the loop
 * waits, so whatever one loop turn produced goes out as one write. */
void ap_loop_flush(ap_loop *l, ap_io_conn *c);
void ap_loop_close(ap_loop *l, ap_io_conn *c, int err);
int ap_loop_add_reader(ap_loop *l, int fd, int id);      /* 0 or -errno */
/* A wait on a futex word inside the loop (io_uring IORING_OP_FUTEX_WAIT,
 * Linux 6.7+, with a linked timeout): for doorbells in memory shared with
 * another process. The caller owns f and keeps it alive until done() has
 * run, which it does exactly once per accepted wait, on the loop thread:
 * res 0 (woken), -EAGAIN (the word no longer held expected), -ECANCELED
 * (the timeout passed, or ap_loop_futex_cancel), or another -errno.
 * Whatever res says, the caller looks again: a wake-up proves nothing. */
typedef struct ap_io_futex {
	void (*done)(struct ap_io_futex *f, int res);
	void *arg;
	struct __kernel_timespec ts; /* the linked timeout, read at submit */
} ap_io_futex;
/* 1 if this loop can wait on futex words (io_uring with futex support). */
int ap_loop_futex_supported(const ap_loop *l);
/* 0, or -ENOTSUP (epoll, or a kernel without futex operations). */
int ap_loop_futex_wait(ap_loop *l, ap_io_futex *f, uint32_t *word, uint32_t expected, int timeout_ms);
/* Ends an armed wait early; its done() still runs (reap it before
 * unmapping the word). */
void ap_loop_futex_cancel(ap_loop *l, ap_io_futex *f);

/* Flush, wait up to timeout_ms (-1: no limit) and dispatch what arrived.
 * Returns 0, or -errno on a fatal backend error. */
int ap_loop_run_once(ap_loop *l, int timeout_ms);
/* The next run_once with timeout 0 looks at the sockets even if it would
 * skip that as too soon after the last look (epoll, BUSY_LOOK_US): for a
 * loop that has nothing of its own to do and only yields, a message by
 * distribution must not wait for the busy loop's rate. */
void ap_loop_look_now(ap_loop *l);

#endif
