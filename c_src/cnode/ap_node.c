/* ap_node: connections, the process table and message dispatch of a C node.
 *
 * Everything here runs on the loop thread except ap_node_post (any thread)
 * and the handshakes (ap_setup's thread). A connection exists in the table
 * only after its handshake; ei has forgotten its fd by then, so ap_node's
 * files are its only reader and writer.
 *
 * Where the parts are (ap_node_int.h has what they share):
 *   ap_node.c        processes, sending, the built-in net_kernel, start,
 *                    the loop, timers
 *   ap_node_recv.c   frames from peers: classification, delivery, refusal
 *   ap_node_conn.c   connections and the loop's callbacks
 * The codec and the event loop they call live apart (dist/, io/).
 */
#include "ap_node.h"
#include "ap_node_int.h"

#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "ap_frame.h"
#include "ap_io.h"
#include "ap_log.h"
#include "ap_sendq.h"
#include "ap_setup.h"
#include "ap_time.h"

/* ---- processes ---------------------------------------------------------- */

static unsigned pid_hash(const erlang_pid *p) { return (p->num ^ (p->serial << 7)) % PROC_BUCKETS; }

static int is_local(const ap_node *n, const erlang_pid *p)
{
	return p->creation == n->ec.creation && strcmp(p->node, n->name) == 0;
}

ap_proc *find_pid(ap_node *n, const erlang_pid *p)
{
	if (!is_local(n, p))
		return NULL;
	for (ap_proc *q = n->procs[pid_hash(p)]; q; q = q->next)
		if (q->pid.num == p->num && q->pid.serial == p->serial)
			return q;
	return NULL;
}

ap_proc *ap_proc_whereis(ap_node *n, const char *name)
{
	/* Few processes have names; a scan is cheaper than another table. */
	for (int b = 0; b < PROC_BUCKETS; b++)
		for (ap_proc *q = n->procs[b]; q; q = q->next)
			if (q->name[0] && strcmp(q->name, name) == 0)
				return q;
	return NULL;
}

ap_proc *ap_proc_spawn(ap_node *n, const char *name, ap_proc_fn fn, void *state)
{
	if (name && (strlen(name) >= MAXATOMLEN_UTF8 || ap_proc_whereis(n, name)))
		return NULL;
	ap_proc *p = calloc(1, sizeof *p);
	if (!p)
		return NULL;
	if (ei_make_pid(&n->ec, &p->pid)) {
		free(p);
		return NULL;
	}
	if (name)
		strcpy(p->name, name);
	p->fn = fn;
	p->state = state;
	unsigned h = pid_hash(&p->pid);
	p->next = n->procs[h];
	n->procs[h] = p;
	return p;
}

ap_conn *conn_for(ap_node *n, const char *node)
{
	for (ap_conn *c = n->conns; c; c = c->next)
		if (!c->io->closing && strcmp(c->peer, node) == 0)
			return c;
	return NULL;
}

/* Close c if its peer has stopped reading (see OUT_STALL_MS); 1 if so. */
int conn_close_if_not_reading(ap_node *n, ap_conn *c)
{
	ap_io_conn *io = c->io;
	size_t unsent = io->out.len;
	if (io->inflight_off < io->inflight.len) /* off stays at the old length after a send */
		unsent += io->inflight.len - io->inflight_off;
	if (io->bytes_out != c->seen_out || unsent <= n->out_limit) {
		c->seen_out = io->bytes_out;
		c->progress_ms = n->now_ms;
	}
	if (unsent <= n->out_limit ||
	    (unsent <= 2 * n->out_limit && n->now_ms - c->progress_ms < OUT_STALL_MS))
		return 0;
	char peer[4 * MAXNODELEN + 8];
	ap_log(AP_LOG_WARNING, "closing connection to %s: %zu bytes unsent, none written for %lld ms, peer not reading",
	       ap_log_escape(peer, sizeof peer, c->peer), unsent, (long long)(n->now_ms - c->progress_ms));
	ap_loop_close(n->loop, io, ENOBUFS);
	return 1;
}

void conn_flush(ap_node *n, ap_conn *c)
{
	c->last_tx_ms = n->now_ms;
	if (conn_close_if_not_reading(n, c))
		return;
	ap_loop_flush(n->loop, c->io);
}

void ap_proc_exit(ap_node *n, ap_proc *p, const char *reason_atom)
{
	char reason[MAXATOMLEN_UTF8 + 8];
	int rlen = 0;
	ei_encode_atom_as(reason, &rlen, reason_atom, ERLANG_UTF8, ERLANG_UTF8); /* names are UTF-8 */
	for (int i = 0; i < p->nlinks; i++) {
		ap_conn *c = conn_for(n, p->links[i].node);
		if (!c)
			continue;
		size_t st = ap_frame_begin(&c->io->out);
		if (ap_enc_exit(&c->io->out, &p->pid, &p->links[i], reason, rlen) || ap_frame_end(&c->io->out, st))
			continue;
		conn_flush(n, c);
	}
	ap_proc **pp = &n->procs[pid_hash(&p->pid)];
	while (*pp != p)
		pp = &(*pp)->next;
	*pp = p->next;
	free(p->links);
	free(p);
}

static int pid_eq(const erlang_pid *a, const erlang_pid *b)
{
	return a->num == b->num && a->serial == b->serial && a->creation == b->creation &&
	       strcmp(a->node, b->node) == 0;
}

void link_add(ap_proc *p, const erlang_pid *remote)
{
	for (int i = 0; i < p->nlinks; i++)
		if (pid_eq(&p->links[i], remote))
			return;
	if (p->nlinks == p->caplinks) {
		int cap = p->caplinks ? p->caplinks * 2 : 4;
		erlang_pid *l = realloc(p->links, (size_t)cap * sizeof *l);
		if (!l)
			return;
		p->links = l;
		p->caplinks = cap;
	}
	p->links[p->nlinks++] = *remote;
}

void link_del(ap_proc *p, const erlang_pid *remote)
{
	for (int i = 0; i < p->nlinks; i++)
		if (pid_eq(&p->links[i], remote)) {
			p->links[i] = p->links[--p->nlinks];
			return;
		}
}

/* ---- sending ------------------------------------------------------------ */

int ap_send(ap_node *n, const ap_proc *from, const erlang_pid *to, const char *term, int len)
{
	(void)from; /* SEND carries no sender: ei advertises no SEND_SENDER */
	ap_conn *c = conn_for(n, to->node);
	if (!c) {
		n->stats.dropped++;
		return -1;
	}
	ap_buf *b = &c->io->out;
	size_t st = ap_frame_begin(b);
	if (ap_enc_send(b, to) || ap_enc_msg_raw(b, term, len) || ap_frame_end(b, st))
		return -1;
	conn_flush(n, c);
	return 0;
}

int ap_send_named(ap_node *n, const ap_proc *from, const char *node, const char *name, const char *term,
		  int len)
{
	ap_conn *c = conn_for(n, node);
	if (!c) {
		n->stats.dropped++;
		return -1;
	}
	ap_buf *b = &c->io->out;
	size_t st = ap_frame_begin(b);
	if (ap_enc_reg_send(b, &from->pid, name) || ap_enc_msg_raw(b, term, len) || ap_frame_end(b, st))
		return -1;
	conn_flush(n, c);
	return 0;
}

int ap_reply(ap_node *n, const ap_proc *self, const ap_msg *call, const char *term, int len)
{
	ap_conn *c = call->conn && !call->conn->io->closing ? call->conn : conn_for(n, call->from.node);
	if (!c) {
		n->stats.dropped++;
		return -1;
	}
	if (ap_encode_reply(&c->io->out, &self->pid, &call->from, call->tag, call->tag_len, term, len))
		return -1;
	conn_flush(n, c);
	return 0;
}

int ap_reply_atom(ap_node *n, const ap_proc *self, const ap_msg *call, const char *atom)
{
	char buf[MAXATOMLEN_UTF8 + 8];
	int i = 0;
	ei_encode_atom(buf, &i, atom);
	return ap_reply(n, self, call, buf, i);
}

int ap_link(ap_node *n, ap_proc *p, const erlang_pid *remote)
{
	ap_conn *c = conn_for(n, remote->node);
	if (!c)
		return -1;
	size_t st = ap_frame_begin(&c->io->out);
	if (ap_enc_link(&c->io->out, &p->pid, remote) || ap_frame_end(&c->io->out, st))
		return -1;
	link_add(p, remote);
	conn_flush(n, c);
	return 0;
}

int ap_node_post(ap_node *n, const char *node, const uint8_t *frame, size_t len)
{
	ap_sendq_item *it = ap_sendq_item_new(AP_Q_FRAME, node, len);
	if (!it)
		return -1;
	memcpy(it->data, frame, len);
	ap_sendq_push(&n->q, it);
	return 0;
}

/* ---- the built-in net_kernel -------------------------------------------- */

/* net_adm:ping/1 calls net_kernel with {is_auth, Node}; answer yes. */
static void net_kernel_fn(ap_node *n, ap_proc *self, const ap_msg *m)
{
	if (m->kind == AP_MSG_CALL)
		ap_reply_atom(n, self, m, "yes");
}

/* ---- life cycle --------------------------------------------------------- */

void send_ready(ap_node *n)
{
	if (n->ready_sent)
		return;
	n->ready_sent = 1;
	ap_log(AP_LOG_NOTICE, "%s ready: port %d, io %s, os pid %d", n->name, n->port, ap_loop_backend(n->loop),
	       (int)getpid());
	if (!n->cfg.port_mode)
		return;
	ei_x_buff x;
	ei_x_new_with_version(&x);
	ei_x_encode_tuple_header(&x, 2);
	ei_x_encode_atom(&x, "ready");
	ei_x_encode_map_header(&x, 4);
	ei_x_encode_atom(&x, "node");
	ei_x_encode_atom(&x, n->name);
	ei_x_encode_atom(&x, "os_pid");
	ei_x_encode_long(&x, (long)getpid());
	ei_x_encode_atom(&x, "io");
	ei_x_encode_atom(&x, ap_loop_backend(n->loop));
	ei_x_encode_atom(&x, "port");
	ei_x_encode_long(&x, n->port);
	ap_port_write_packet(x.buff, x.index);
	ei_x_free(&x);
}

ap_node *ap_node_new(const ap_node_cfg *cfg)
{
	ap_node *n = calloc(1, sizeof *n);
	if (!n)
		return NULL;
	n->cfg = *cfg;
	/* The clock before the loop first reads it: what init starts (a
	 * standalone node's pools) is stamped with the time, not with 0. */
	n->now_ms = ap_mono_ms();
	n->lfd = n->epmd_fd = -1;
	if (!n->cfg.max_frame)
		n->cfg.max_frame = AP_FRAME_DEFAULT_MAX;
	n->out_limit = (size_t)n->cfg.max_frame * 4;
	if (n->out_limit < OUT_LIMIT_MIN)
		n->out_limit = OUT_LIMIT_MIN;
	if (n->cfg.idle_timeout_ms <= 0)
		n->cfg.idle_timeout_ms = 60000;
	if (!n->cfg.io)
		n->cfg.io = getenv("ACTOR_POOL_IO");
	snprintf(n->name, sizeof n->name, "%s", cfg->node);
	n->q.efd = -1;
	if (getenv("ACTOR_POOL_FRAME_DUMP"))
		n->dump = fopen(getenv("ACTOR_POOL_FRAME_DUMP"), "ab");

	static const ap_io_cbs cbs = {
		.on_accept = io_on_accept,
		.on_data = io_on_data,
		.on_closed = io_on_closed,
		.on_readable = io_on_readable,
	};
	if (ap_ei_init(&n->ec, cfg->node, cfg->cookie, cfg->creation))
		goto err;
	if (ap_sendq_init(&n->q))
		goto err;
	n->q.dispose = ap_setup_dispose;
	n->loop = ap_loop_new(n->cfg.io, &cbs, n);
	if (!n->loop)
		goto err;
	n->kernel = ap_proc_spawn(n, "net_kernel", net_kernel_fn, NULL);
	if (!n->kernel)
		goto err;
	return n;
err:
	ap_node_free(n);
	return NULL;
}

void ap_node_free(ap_node *n)
{
	if (!n)
		return;
	ap_setup_stop(n->setup);
	n->setup = NULL;
	/* Close connections and let the loop report them. */
	for (ap_conn *c = n->conns; c; c = c->next)
		ap_loop_close(n->loop, c->io, 0);
	while (n->conns && n->loop)
		ap_loop_run_once(n->loop, 100);
	if (n->epmd_fd >= 0)
		close(n->epmd_fd); /* unregisters from epmd */
	n->epmd_fd = -1;
	if (n->lfd >= 0)
		close(n->lfd);
	n->lfd = -1;
	if (n->dump)
		fclose(n->dump);
	n->dump = NULL;
	if (n->outlived)
		return; /* the exit frees the rest: see ap_node_outlived_by_threads */
	while (n->timers) {
		struct ap_timer *t = n->timers;
		n->timers = t->next;
		free(t);
	}
	for (int b = 0; b < PROC_BUCKETS; b++)
		while (n->procs[b]) {
			ap_proc *p = n->procs[b];
			n->procs[b] = p->next;
			free(p->links);
			free(p);
		}
	ap_loop_free(n->loop);
	if (n->q.efd >= 0)
		ap_sendq_destroy(&n->q);
	free(n);
}

void ap_node_outlived_by_threads(ap_node *n) { n->outlived = 1; }

int ap_node_run(ap_node *n)
{
	signal(SIGPIPE, SIG_IGN);
	n->now_ms = ap_mono_ms();
	n->lfd = ap_ei_listen(&n->ec, n->cfg.listen, &n->port);
	if (n->lfd < 0)
		return -EIO;
	n->epmd_fd = ei_publish(&n->ec, n->port);
	if (n->epmd_fd < 0) {
		ap_log(AP_LOG_ERROR, "cannot publish %s to epmd (is epmd running?)", n->name);
		return -EIO;
	}
	const ap_setup_cfg scfg = {
		.handshake_ms = n->cfg.handshake_timeout_ms,
		.max_pending = n->cfg.max_handshakes,
		.max_per_source = n->cfg.max_handshakes_per_source,
	};
	n->setup = ap_setup_start(&n->ec, &n->q, &scfg);
	if (!n->setup)
		return -ENOMEM;
	ap_setup_set_listener(n->setup, n->lfd);
	if (ap_loop_listen(n->loop, n->lfd) || ap_loop_add_reader(n->loop, ap_sendq_fd(&n->q), READER_QUEUE))
		return -EIO;
	if (n->cfg.port_mode && ap_loop_add_reader(n->loop, STDIN_FILENO, READER_STDIN))
		return -EIO;
	if (n->cfg.parent && n->cfg.parent[0])
		ap_setup_connect(n->setup, n->cfg.parent, TAG_PARENT);
	else
		send_ready(n);

	int period = n->cfg.idle_timeout_ms / 8;
	if (period < 10)
		period = 10;
	n->next_tick_ms = n->now_ms + period;
	while (!n->stop) {
		int64_t due = n->next_tick_ms;
		if (n->timers && n->timers->at_ms < due)
			due = n->timers->at_ms;
		int64_t wait = due - n->now_ms;
		int busy = n->idle ? n->idle(n, n->idle_arg) : 0;
		if (busy)
			wait = 0;
		if (busy == 2)
			ap_loop_look_now(n->loop);
		int r = ap_loop_run_once(n->loop, wait < 0 ? 0 : (int)wait);
		if (r < 0) {
			ap_log(AP_LOG_ERROR, "event loop failed: %s", strerror(-r));
			return r;
		}
		n->now_ms = ap_mono_ms();
		run_timers(n);
		if (n->now_ms >= n->next_tick_ms) {
			on_timer(n);
			n->next_tick_ms = n->now_ms + period;
		}
	}
	return 0;
}

void ap_node_stop(ap_node *n) { n->stop = 1; }
const char *ap_node_name(const ap_node *n) { return n->name; }
const char *ap_node_backend(const ap_node *n) { return ap_loop_backend(n->loop); }
const ap_node_stats *ap_node_get_stats(const ap_node *n) { return &n->stats; }
uint32_t ap_node_max_frame(const ap_node *n) { return n->cfg.max_frame; }
ei_cnode *ap_node_ei(ap_node *n) { return &n->ec; }

int ap_node_call_on_loop(ap_node *n, ap_loop_fn fn, void *arg)
{
	struct ap_call_item ci = { .fn = fn, .arg = arg };
	ap_sendq_item *it = ap_sendq_item_new(AP_Q_CALL, NULL, sizeof ci);
	if (!it)
		return -1;
	memcpy(it->data, &ci, sizeof ci);
	ap_sendq_push(&n->q, it);
	return 0;
}

void ap_node_call_on_loop_sure(ap_node *n, ap_loop_fn fn, void *arg)
{
	if (ap_node_call_on_loop(n, fn, arg) == 0)
		return;
	ap_log(AP_LOG_WARNING, "out of memory for a call to the event loop; trying again until it is queued");
	/* The loop frees the memory it holds as it runs; a worker thread can
	 * wait for it, and dropping the call would leave a slot for good. */
	struct timespec ms = { 0, 1000000 };
	while (ap_node_call_on_loop(n, fn, arg))
		nanosleep(&ms, NULL);
}

int ap_node_timer(ap_node *n, int delay_ms, ap_loop_fn fn, void *arg)
{
	struct ap_timer *t = malloc(sizeof *t);
	if (!t)
		return -1;
	t->at_ms = ap_mono_ms() + (delay_ms > 0 ? delay_ms : 0);
	t->fn = fn;
	t->arg = arg;
	/* Few timers are live at once (worker restarts, a stats tick): a
	 * sorted list is enough. */
	struct ap_timer **pp = &n->timers;
	while (*pp && (*pp)->at_ms <= t->at_ms)
		pp = &(*pp)->next;
	t->next = *pp;
	*pp = t;
	return 0;
}

void run_timers(ap_node *n)
{
	while (n->timers && n->timers->at_ms <= n->now_ms) {
		struct ap_timer *t = n->timers;
		n->timers = t->next;
		t->fn(n, t->arg);
		free(t);
	}
}

void ap_node_set_dead_letter(ap_node *n, ap_dead_letter_fn fn) { n->dead_letter = fn; }

void ap_node_set_idle(ap_node *n, ap_idle_fn fn, void *arg)
{
	n->idle = fn;
	n->idle_arg = arg;
}

int ap_node_add_reader(ap_node *n, int fd, ap_loop_fn fn, void *arg)
{
	int i = 0;
	while (i < N_EXTRA && n->extra_fn[i])
		i++;
	if (i == N_EXTRA)
		return -EBUSY;
	int r = ap_loop_add_reader(n->loop, fd, READER_EXTRA + i);
	if (r == 0) {
		n->extra_fn[i] = fn;
		n->extra_arg[i] = arg;
	}
	return r;
}

int ap_node_futex_supported(const ap_node *n) { return ap_loop_futex_supported(n->loop); }

int ap_node_futex_wait(ap_node *n, ap_io_futex *f, uint32_t *word, uint32_t expected, int timeout_ms)
{
	return ap_loop_futex_wait(n->loop, f, word, expected, timeout_ms);
}

void ap_node_futex_cancel(ap_node *n, ap_io_futex *f) { ap_loop_futex_cancel(n->loop, f); }
int64_t ap_node_now_ms(const ap_node *n) { return n->now_ms; }
