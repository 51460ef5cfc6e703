/* ap_node_int: ap_node's internals: what its parts share (ap_node.c says
 * which part is where) and what its tests and fuzz targets reach; no C node
 * calls these. */
#ifndef AP_NODE_INT_H
#define AP_NODE_INT_H

#include "ap_node.h"

#include <stdio.h>

#include "ap_frame.h"
#include "ap_io.h"
#include "ap_sendq.h"
#include "ap_setup.h"

#define PROC_BUCKETS 256
#define READER_QUEUE 0
#define READER_STDIN 1
#define READER_EXTRA 2 /* ap_node_add_reader: ids READER_EXTRA.., for the owner of the node */
#define N_EXTRA 2      /* the pool node: its child-exit signalfd, its ring bell (epoll) */
#define TICK_ANSWER_GAP_MS 100   /* answer a tick unless we sent something this recently */
#define PARENT_RETRY_MS 500
#define PARENT_ATTEMPTS 20
#define TAG_PARENT 1
/* A peer is taken to have stopped reading when more than out_limit bytes
 * wait for it and none has been written for OUT_STALL_MS, or when twice
 * out_limit wait: a reader that is merely behind (a burst of replies, a GC
 * pause) keeps its connection, one that stopped costs bounded memory. */
#define OUT_LIMIT_MIN (64u << 20)
#define OUT_STALL_MS 5000

struct ap_conn {
	ap_io_conn *io;
	char peer[MAXNODELEN + 1];
	ap_frame_rx rx;
	int64_t last_rx_ms, last_tx_ms;
	uint64_t seen_out;    /* io->bytes_out when last looked at */
	int64_t progress_ms;  /* when bytes were last written, or the queue was under out_limit */
	ap_node *node;
	struct ap_conn *next;
};

struct ap_timer {
	int64_t at_ms;
	ap_loop_fn fn;
	void *arg;
	struct ap_timer *next;
};

struct ap_call_item {
	ap_loop_fn fn;
	void *arg;
};

struct ap_node {
	ap_node_cfg cfg;
	ap_loop_fn parent_up_fn;
	void *parent_up_arg;
	char name[MAXNODELEN + 1];
	ei_cnode ec;
	ap_loop *loop;
	ap_sendq q;
	ap_setup *setup;
	int lfd, epmd_fd, port;
	ap_conn *conns;
	ap_proc *procs[PROC_BUCKETS];
	ap_node_stats stats;
	size_t out_limit;         /* max(4 * max_frame, OUT_LIMIT_MIN): see OUT_STALL_MS */
	int64_t now_ms, next_tick_ms, parent_retry_ms;
	int parent_attempts;
	int ready_sent;
	ap_proc *kernel;          /* net_kernel: also the sender of replies we make ourselves */
	FILE *dump;               /* $ACTOR_POOL_FRAME_DUMP: every received frame, for captures */
	struct ap_timer *timers;  /* one-shot timers, soonest first */
	ap_dead_letter_fn dead_letter;
	ap_idle_fn idle;
	void *idle_arg;
	ap_loop_fn extra_fn[N_EXTRA];
	void *extra_arg[N_EXTRA];
	volatile int stop;
	int outlived; /* ap_node_outlived_by_threads */
};

/* ap_node.c: processes, sending, timers. */
ap_proc *find_pid(ap_node *n, const erlang_pid *p);
ap_conn *conn_for(ap_node *n, const char *node);
int conn_close_if_not_reading(ap_node *n, ap_conn *c);
void conn_flush(ap_node *n, ap_conn *c);
void link_add(ap_proc *p, const erlang_pid *remote);
void link_del(ap_proc *p, const erlang_pid *remote);
void send_ready(ap_node *n);
void run_timers(ap_node *n);

/* ap_node_recv.c: frames from a peer, to processes. */
void bad_frame(ap_node *n, ap_conn *c, const char *why);
int on_oversize(void *arg, const uint8_t *head, size_t hl, uint32_t flen);
int on_frame(void *arg, const uint8_t *f, size_t len);

/* ap_node_conn.c: connections, the loop's callbacks. */
void io_on_accept(void *arg, int fd);
int io_on_data(void *arg, ap_io_conn *io, const uint8_t *data, size_t len);
void io_on_closed(void *arg, ap_io_conn *io);
void io_on_readable(void *arg, int id);
void on_timer(ap_node *n);

/* What a message is: m->buf[0..m->len) holds its encoding from the 131
 * byte (maybe only its start: the head of an oversized frame); m->kind is
 * AP_MSG_INFO on entry. A {'$gen_call', {Pid, Tag}, Req} becomes
 * AP_MSG_CALL with from, tag, tag_len and index (the request) set, a
 * {'$gen_cast', Req} AP_MSG_CAST with index set; anything else stays. Every
 * part is proved to lie inside m->len before ei reads it. */
void ap_node_classify(ap_msg *m);

#endif
