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
};

struct ap_loop {
	const struct ap_io_ops *ops;
	ap_io_cbs cbs;
	void *arg;
	void *be;                 /* backend state */
	ap_io_conn *dirty;        /* conns with bytes to flush */
	ap_io_conn *closed;       /* conns whose teardown finished, reported after dispatch */
	/* Receive-rate window. Under a flood of small messages a wakeup per
	 * TCP segment costs more than the messages it brings, so the backends
	 * pause briefly before waiting and take the flood in batches. */
	int64_t win_start_us;
	unsigned win_recvs;
	uint64_t win_bytes;
	int coalesce;
};

#define AP_IO_RATE_WINDOW_US 1000
#define AP_IO_COALESCE_RECVS 20        /* receives per window that start pausing */
#define AP_IO_COALESCE_KEEP_BYTES 2048 /* bytes per receive that keep it up */
#define AP_IO_COALESCE_US 100          /* the pause; the latency a flood adds */

/* Update the coalescing mode at a window boundary; returns it. */
int ap_io_coalesce_check(ap_loop *l);
void ap_io_pause(void);

extern const struct ap_io_ops ap_io_uring_ops;
extern const struct ap_io_ops ap_io_epoll_ops;

/* Backends call these. */
void ap_io_sent(ap_loop *l, ap_io_conn *c, long res); /* a send completed with res */
void ap_io_finished(ap_loop *l, ap_io_conn *c);        /* no op references c any more */
void ap_io_data(ap_loop *l, ap_io_conn *c, const uint8_t *data, size_t n);

#endif
