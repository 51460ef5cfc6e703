/* ap_io_int: what the generic loop and its backends share. Private. */
#ifndef AP_IO_INT_H
#define AP_IO_INT_H

#include "ap_io.h"

struct ap_io_ops {
	const char *name;
	int (*init)(ap_loop *l);  /* 0 or -errno; on failure nothing is left allocated */
	void (*fini)(ap_loop *l);
	int (*listen)(ap_loop *l, int lfd);
	int (*add_conn)(ap_loop *l, ap_io_conn *c);
	void (*start_send)(ap_loop *l, ap_io_conn *c); /* c->inflight holds bytes, none in flight */
	void (*close)(ap_loop *l, ap_io_conn *c);      /* begin teardown */
	int (*add_reader)(ap_loop *l, int fd, int id);
	int (*wait)(ap_loop *l, int timeout_ms);
	void (*accept_pause)(ap_loop *l);  /* stop taking connections off the listener */
	void (*accept_resume)(ap_loop *l); /* and take them again */
	/* Optional (NULL: unsupported): ap_loop_futex_wait / _cancel. */
	int (*futex_supported)(const ap_loop *l);
	int (*futex_wait)(ap_loop *l, ap_io_futex *f, uint32_t *word, uint32_t expected, int timeout_ms);
	void (*futex_cancel)(ap_loop *l, ap_io_futex *f);
};

struct ap_loop {
	const struct ap_io_ops *ops;
	ap_io_cbs cbs;
	void *arg;
	void *be;                 /* backend state */
	int look_now;             /* ap_loop_look_now: the next 0-timeout wait looks */
	ap_io_conn *dirty;        /* conns with bytes to flush */
	ap_io_conn *closed;       /* conns whose teardown finished, reported after dispatch */
	/* Receive-rate window. Under a flood of small messages a wakeup per
	 * TCP segment costs more than the messages it brings, so the backends
	 * pause briefly before waiting and take the flood in batches. */
	int64_t win_start_us;
	unsigned win_recvs;
	uint64_t win_bytes;
	int coalesce;
	/* Accept when the process runs out of fds (or memory): instead of
	 * failing again at once, forever, the listener is paused for a
	 * backoff (AP_IO_ACCEPT_PAUSE_MIN_MS doubling to _MAX_MS) and the
	 * backlog is shed through a reserve fd, so waiting clients get a
	 * close instead of a hang. */
	int lfd;
	int reserve_fd;            /* /dev/null, held for the shedding; -1 if lost */
	int accept_paused;
	int accept_backoff_ms;     /* 0 while accepts succeed */
	int64_t accept_resume_us;
	uint64_t accept_failed;    /* in this episode */
	uint64_t accept_shed;
};

#define AP_IO_RATE_WINDOW_US 1000
#define AP_IO_COALESCE_RECVS 20        /* receives per window that start pausing */
#define AP_IO_COALESCE_KEEP_BYTES 2048 /* bytes per receive that keep it up */
#define AP_IO_COALESCE_US 100          /* the pause; the latency a flood adds */

#define AP_IO_ACCEPT_PAUSE_MIN_MS 10
#define AP_IO_ACCEPT_PAUSE_MAX_MS 1000
#define AP_IO_ACCEPT_SHED_MAX 1024     /* connections shed per failure */

/* Update the coalescing mode at a window boundary; returns it. */
int ap_io_coalesce_check(ap_loop *l);
void ap_io_pause(void);

extern const struct ap_io_ops ap_io_uring_ops;
extern const struct ap_io_ops ap_io_epoll_ops;

/* Backends call these. */
void ap_io_sent(ap_loop *l, ap_io_conn *c, long res); /* a send completed with res */
void ap_io_finished(ap_loop *l, ap_io_conn *c);        /* no op references c any more */
void ap_io_data(ap_loop *l, ap_io_conn *c, const uint8_t *data, size_t n);
/* An accept returned fd: hands it on and ends a failure episode. */
void ap_io_accepted(ap_loop *l, int fd);
/* An accept failed with errno err. Returns 0 to go on accepting (an error
 * of that one connection), or 1 after pausing accepts (accept_pause was
 * called; ap_loop_run_once resumes them). can_shed: no accept of the
 * backend is pending, so the loop may accept on the listener itself. */
int ap_io_accept_error(ap_loop *l, int err, int can_shed);

#endif
