/* ap_node_conn: a C node's connections: a handshake's result made a
 * connection, the loop's callbacks (accept, data, close, the hand-off
 * queue), and the tick that keeps connections alive or closes a reader
 * that stopped (see ap_node.c). */
#include "ap_node.h"
#include "ap_node_int.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "ap_frame.h"
#include "ap_io.h"
#include "ap_log.h"
#include "ap_sendq.h"
#include "ap_setup.h"
#include "ap_time.h"

/* ---- connections -------------------------------------------------------- */

static void drop_links_to(ap_node *n, const char *peer)
{
	for (int b = 0; b < PROC_BUCKETS; b++)
		for (ap_proc *p = n->procs[b]; p; p = p->next)
			for (int i = 0; i < p->nlinks;)
				if (strcmp(p->links[i].node, peer) == 0)
					p->links[i] = p->links[--p->nlinks];
				else
					i++;
}

static void conn_up(ap_node *n, int fd, const char *peer, int tag)
{
	ap_conn *old = conn_for(n, peer);
	if (old) {
		/* The peer reconnected: whatever the old socket still holds is
		 * from a connection the peer has given up. */
		ap_log(AP_LOG_INFO, "replacing connection to %s", peer);
		ap_loop_close(n->loop, old->io, 0);
	}
	ap_conn *c = calloc(1, sizeof *c);
	if (!c) {
		close(fd);
		return;
	}
	c->node = n;
	snprintf(c->peer, sizeof c->peer, "%s", peer);
	ap_frame_rx_init(&c->rx, n->cfg.max_frame);
	ap_frame_rx_on_oversize(&c->rx, on_oversize, 0);
	c->last_rx_ms = c->last_tx_ms = c->progress_ms = n->now_ms;
	c->io = ap_loop_add_conn(n->loop, fd, c);
	if (!c->io) {
		ap_log(AP_LOG_ERROR, "cannot add connection to %s to the loop", peer);
		free(c);
		return;
	}
	c->next = n->conns;
	n->conns = c;
	n->stats.connections++;
	ap_log(AP_LOG_INFO, "connected to %s", peer);
	if (tag == TAG_PARENT)
		send_ready(n);
	/* Any connection to the parent, ours or one it made to us. The parent
	 * may connect first (its processes send to this node by name as soon
	 * as epmd lists it), and then ours fails: this one makes us ready. */
	if (n->cfg.parent && !strcmp(peer, n->cfg.parent)) {
		send_ready(n);
		n->parent_attempts = 0;
		n->parent_retry_ms = 0;
		if (n->parent_up_fn)
			n->parent_up_fn(n, n->parent_up_arg);
	}
}

void ap_node_on_parent_up(ap_node *n, ap_loop_fn fn, void *arg)
{
	n->parent_up_fn = fn;
	n->parent_up_arg = arg;
}

const char *ap_node_parent(const ap_node *n)
{
	return n->cfg.parent;
}

void io_on_accept(void *arg, int fd)
{
	ap_node *n = arg;
	ap_setup_accept(n->setup, fd);
}

int io_on_data(void *arg, ap_io_conn *io, const uint8_t *data, size_t len)
{
	ap_node *n = arg;
	ap_conn *c = io->owner;
	n->now_ms = ap_mono_ms(); /* vDSO, no syscall */
	c->last_rx_ms = n->now_ms;
	int r = ap_frame_rx_feed(&c->rx, data, len, on_frame, c);
	if (r == -EMSGSIZE)
		bad_frame(n, c, "frame larger than max_frame");
	else if (r == -ENOMEM)
		bad_frame(n, c, "out of memory for a frame");
	return r;
}

void io_on_closed(void *arg, ap_io_conn *io)
{
	ap_node *n = arg;
	ap_conn *c = io->owner;
	ap_conn **pp = &n->conns;
	while (*pp && *pp != c)
		pp = &(*pp)->next;
	if (*pp)
		*pp = c->next;
	n->stats.connections--;
	if (!conn_for(n, c->peer))
		drop_links_to(n, c->peer);
	/* A standalone node (no owner port) that loses its parent connects
	 * again, with the same attempts as at start; a port-mode node leaves
	 * that to its owner, which restarts it. */
	if (!n->cfg.port_mode && n->cfg.parent && !strcmp(c->peer, n->cfg.parent) && !conn_for(n, c->peer) &&
	    !n->stop)
		n->parent_retry_ms = n->now_ms + PARENT_RETRY_MS;
	ap_log(AP_LOG_INFO, "connection to %s closed%s%s", c->peer, io->close_err ? ": " : "",
	       io->close_err ? strerror(io->close_err) : "");
	ap_frame_rx_free(&c->rx);
	free(c);
}

static void drain_queue(ap_node *n)
{
	ap_sendq_item *it = ap_sendq_drain(&n->q);
	while (it) {
		ap_sendq_item *next = it->next;
		ap_setup_result res;
		switch (it->kind) {
		case AP_Q_FRAME: {
			ap_conn *c = conn_for(n, it->node);
			if (c && ap_buf_append(&c->io->out, it->data, it->len) == 0)
				conn_flush(n, c);
			else
				n->stats.dropped++;
			break;
		}
		case AP_Q_CONN_UP:
			memcpy(&res, it->data, sizeof res);
			conn_up(n, res.fd, it->node, res.tag);
			break;
		case AP_Q_CONN_FAILED:
			memcpy(&res, it->data, sizeof res);
			if (res.tag == TAG_PARENT)
				n->parent_retry_ms = n->now_ms + PARENT_RETRY_MS;
			break;
		case AP_Q_CALL: {
			struct ap_call_item ci;
			memcpy(&ci, it->data, sizeof ci);
			n->now_ms = ap_mono_ms();
			ci.fn(n, ci.arg);
			break;
		}
		}
		free(it);
		it = next;
	}
}

void ap_node_run_queued(ap_node *n) { drain_queue(n); }

void io_on_readable(void *arg, int id)
{
	ap_node *n = arg;
	if (id == READER_QUEUE) {
		drain_queue(n);
	} else if (id >= READER_EXTRA && id < READER_EXTRA + N_EXTRA) {
		if (n->extra_fn[id - READER_EXTRA])
			n->extra_fn[id - READER_EXTRA](n, n->extra_arg[id - READER_EXTRA]);
	} else if (id == READER_STDIN) {
		char buf[4096];
		ssize_t r = read(STDIN_FILENO, buf, sizeof buf);
		if (r == 0 || (r < 0 && errno != EAGAIN && errno != EINTR)) {
			ap_log(AP_LOG_INFO, "owner port closed, stopping");
			n->stop = 1;
		}
	}
}

/* Periodic: drop silent peers, tick quiet ones, retry the parent. */
void on_timer(ap_node *n)
{
	int idle = n->cfg.idle_timeout_ms;
	for (ap_conn *c = n->conns; c; c = c->next) {
		if (c->io->closing)
			continue;
		if (n->now_ms - c->last_rx_ms > idle) {
			ap_log(AP_LOG_WARNING, "closing connection to %s: silent for %d ms", c->peer, idle);
			ap_loop_close(n->loop, c->io, ETIMEDOUT);
			continue;
		}
		/* A peer that stopped reading and sends nothing more is found
		 * here, not only when something is queued for it. */
		if (conn_close_if_not_reading(n, c))
			continue;
		if (n->now_ms - c->last_tx_ms >= idle / 4 && ap_enc_tick(&c->io->out) == 0)
			conn_flush(n, c);
	}
	if (n->parent_retry_ms && n->now_ms >= n->parent_retry_ms) {
		n->parent_retry_ms = 0;
		if (++n->parent_attempts >= PARENT_ATTEMPTS) {
			ap_log(AP_LOG_ERROR, "cannot connect to %s, giving up", n->cfg.parent);
			n->stop = 1;
		} else {
			ap_setup_connect(n->setup, n->cfg.parent, TAG_PARENT);
		}
	}
}
