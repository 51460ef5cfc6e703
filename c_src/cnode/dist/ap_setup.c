/* ap_setup: ei handshakes on our own sockets: a gate thread, a few
 * handshake threads, a connect thread (ap_setup.h says what bounds them).
 *
 * Where the parts are (ap_setup_int.h has what they share):
 *   ap_setup.c        the handshake threads, the connect thread, start and stop
 *   ap_setup_gate.c   the pending handshakes, their caps and fairness rules,
 *                     the gate thread
 *   ap_setup_sock.c   the ei socket callbacks and their per-thread state
 * The pending table and its counters are s->mu's, whichever part holds it. */
#include "ap_setup_int.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include "ap_log.h"
#include "ap_time.h"

/* ---- the handshake threads -------------------------------------------------- */

static void post(ap_setup *s, int kind, const char *node, int fd, int tag)
{
	ap_sendq_item *it = ap_sendq_item_new(kind, node, sizeof(ap_setup_result));
	if (!it) {
		if (fd >= 0)
			close(fd);
		return;
	}
	ap_setup_result res = { .fd = fd, .tag = tag };
	memcpy(it->data, &res, sizeof res);
	ap_sendq_push(s->q, it);
}


static void run_accept(ap_setup *s, struct pend *p)
{
	ErlConnect conn;
	tl_parked = p;
	tl_deadline = p->deadline;
	last_ctx = NULL;
	int fd = ei_accept_tmo(s->ec, s->lfd, &conn, (unsigned)s->cfg.handshake_ms);
	int err = erl_errno;
	tl_deadline = 0;
	if (tl_parked) { /* ei gave up before adopting it */
		tl_parked = NULL;
		pthread_mutex_lock(&s->mu);
		int pfd = p->fd;
		p->fd = -1;
		pthread_mutex_unlock(&s->mu);
		if (pfd >= 0)
			close(pfd);
	}
	if (fd >= 0)
		disown(fd); /* p->fd is -1 now: nobody else touches fd */
	pthread_mutex_lock(&s->mu);
	int dropped = p->dropped;
	if (!dropped) {
		s->npend--;
		p->src->npend--;
		p->src->nrun--;
		if (fd >= 0)
			s->st.handed_over++;
		else if (err == ETIMEDOUT)
			s->st.timed_out++;
		else
			s->st.failed++;
	}
	unlink_pend(s, p);
	s->nrun--;
	if (dropped)
		s->nevict--;
	pend_free(s, p);
	pthread_mutex_unlock(&s->mu);
	if (fd < 0) {
		if (!dropped)
			wake_gate(s); /* for its summary line */
		return;
	}
	if (dropped) {
		/* Evicted just as it finished: the socket is shut down. */
		close(fd);
		return;
	}
	post(s, AP_Q_CONN_UP, conn.nodename, fd, 0);
}

static void *worker_main(void *arg)
{
	ap_setup *s = arg;
	tl_setup = s;
	pthread_mutex_lock(&s->mu);
	while (!s->stop) {
		struct pend *p = take_ready(s);
		/* Ready sockets this thread leaves behind: the gate decides
		 * whether to evict for them (it may have looked while this
		 * thread was still free). */
		if (s->nready > (p ? 1 : 0))
			wake_gate(s);
		if (!p) {
			pthread_cond_wait(&s->ready_cv, &s->mu);
			continue;
		}
		p->st = P_RUN;
		p->t_run = ap_mono_ms();
		s->nready--;
		s->nrun++;
		p->src->nrun++;
		pthread_mutex_unlock(&s->mu);
		run_accept(s, p);
		pthread_mutex_lock(&s->mu);
	}
	pthread_mutex_unlock(&s->mu);
	return NULL;
}

/* ---- the connect thread ----------------------------------------------------- */

/* The distribution port of alive at ip, from epmd there (PORT2_REQ, as
 * ei asks it), on a socket of ours that ap_setup_stop can shut down and
 * within the connect's deadline: ei's own lookup runs on sockets we never
 * see, with the whole timeout per operation. Returns the port, or -1 with
 * errno set. */
static int epmd_port(ap_setup *s, struct in_addr ip, const char *alive)
{
	const char *e = getenv("ERL_EPMD_PORT");
	long ep = e ? strtol(e, NULL, 10) : 0;
	if (ep <= 0 || ep > 65535)
		ep = EPMD_PORT;
	size_t alen = strlen(alive);
	uint8_t req[3 + EI_MAXALIVELEN];
	if (alen == 0 || alen > EI_MAXALIVELEN) {
		errno = EINVAL;
		return -1;
	}
	req[0] = (uint8_t)((alen + 1) >> 8);
	req[1] = (uint8_t)(alen + 1);
	req[2] = 122; /* PORT_PLEASE2_REQ */
	memcpy(req + 3, alive, alen);
	int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
	if (fd < 0)
		return -1;
	int err = claim_conn_fd(s, fd);
	if (err) {
		close(fd);
		errno = err;
		return -1;
	}
	struct sockaddr_in a = { .sin_family = AF_INET, .sin_port = htons((uint16_t)ep), .sin_addr = ip };
	err = connect_nb(fd, &a, sizeof a, EI_SCLBK_INF_TMO);
	for (size_t off = 0; !err && off < 3 + alen;) {
		ssize_t w = send(fd, req + off, 3 + alen - off, MSG_NOSIGNAL);
		if (w > 0)
			off += (size_t)w;
		else if (w < 0 && errno != EINTR && errno != EAGAIN)
			err = errno;
		else if (w < 0 && errno == EAGAIN)
			err = wait_fd(fd, POLLOUT, EI_SCLBK_INF_TMO);
	}
	/* PORT2_RESP: 119, result, then (result 0) the port, 2 bytes. */
	uint8_t resp[4];
	size_t got = 0;
	while (!err && got < sizeof resp && !(got >= 2 && resp[1])) {
		ssize_t r = recv(fd, resp + got, sizeof resp - got, 0);
		if (r > 0)
			got += (size_t)r;
		else if (r == 0)
			err = EIO;
		else if (errno == EAGAIN)
			err = wait_fd(fd, POLLIN, EI_SCLBK_INF_TMO);
		else if (errno != EINTR)
			err = errno;
	}
	release_conn_fd(s, fd);
	close(fd);
	if (!err && (resp[0] != 119 || resp[1]))
		err = resp[1] ? ENOENT : EIO; /* ENOENT: not registered there */
	if (err) {
		errno = err;
		return -1;
	}
	return resp[2] << 8 | resp[3];
}

/* The node's host as an IPv4 address (ei's nodes speak IPv4 only). */
static int host_ip(const char *host, struct in_addr *ip)
{
	struct addrinfo hints = { .ai_family = AF_INET, .ai_socktype = SOCK_STREAM }, *res;
	if (getaddrinfo(host, NULL, &hints, &res) || !res)
		return -1;
	*ip = ((struct sockaddr_in *)res->ai_addr)->sin_addr;
	freeaddrinfo(res);
	return 0;
}

static void run_connect(ap_setup *s, struct cjob *j)
{
	last_ctx = NULL;
	int64_t deadline = ap_mono_ms() + s->cfg.handshake_ms;
	tl_deadline = deadline;
	int fd = -1, err = EINVAL;
	char alive[EI_MAXALIVELEN + 1];
	const char *at = strchr(j->node, '@');
	struct in_addr ip;
	if (at && at > j->node && (size_t)(at - j->node) <= EI_MAXALIVELEN) {
		memcpy(alive, j->node, (size_t)(at - j->node));
		alive[at - j->node] = 0;
		err = EHOSTUNREACH;
		if (!host_ip(at + 1, &ip)) {
			int port = epmd_port(s, ip, alive);
			err = errno;
			int64_t left = deadline - ap_mono_ms();
			if (port > 0 && left > 0) {
				fd = ei_xconnect_host_port_tmo(s->ec, &ip, port, (unsigned)left);
				err = erl_errno;
			} else if (port > 0) {
				err = ETIMEDOUT;
			}
		}
	}
	tl_deadline = 0;
	if (fd < 0) {
		ap_log(AP_LOG_WARNING, "connect to %s failed: %s", j->node,
		       err == ENOENT ? "not registered with epmd" : strerror(err));
		post(s, AP_Q_CONN_FAILED, j->node, -1, j->tag);
		return;
	}
	disown(fd);
	post(s, AP_Q_CONN_UP, j->node, fd, j->tag);
}

static void *connector_main(void *arg)
{
	ap_setup *s = arg;
	tl_setup = s;
	pthread_mutex_lock(&s->mu);
	while (!s->stop) {
		struct cjob *j = s->cj_head;
		if (!j) {
			pthread_cond_wait(&s->conn_cv, &s->mu);
			continue;
		}
		s->cj_head = j->next;
		if (!s->cj_head)
			s->cj_tail = NULL;
		pthread_mutex_unlock(&s->mu);
		run_connect(s, j);
		free(j);
		pthread_mutex_lock(&s->mu);
	}
	pthread_mutex_unlock(&s->mu);
	return NULL;
}

void ap_setup_connect(ap_setup *s, const char *node, int tag)
{
	struct cjob *j = s ? calloc(1, sizeof *j) : NULL;
	if (!j)
		return;
	j->tag = tag;
	snprintf(j->node, sizeof j->node, "%s", node);
	pthread_mutex_lock(&s->mu);
	if (s->cj_tail)
		s->cj_tail->next = j;
	else
		s->cj_head = j;
	s->cj_tail = j;
	pthread_cond_signal(&s->conn_cv);
	pthread_mutex_unlock(&s->mu);
}

/* ---- life cycle ------------------------------------------------------------- */

static void stop_threads(ap_setup *s, int gate, int connector, int nworkers)
{
	pthread_mutex_lock(&s->mu);
	s->stop = 1;
	for (struct pend *p = s->head; p; p = p->next)
		if (p->st == P_RUN && !p->dropped) {
			/* Not refused, only cut short: counted nowhere. */
			p->dropped = 1;
			s->npend--;
			p->src->npend--;
			p->src->nrun--;
			s->nevict++;
			if (p->fd >= 0)
				shutdown(p->fd, SHUT_RDWR);
		}
	if (s->conn_fd >= 0)
		shutdown(s->conn_fd, SHUT_RDWR);
	pthread_cond_broadcast(&s->ready_cv);
	pthread_cond_broadcast(&s->conn_cv);
	pthread_mutex_unlock(&s->mu);
	wake_gate(s);
	if (gate)
		pthread_join(s->gate, NULL);
	if (connector)
		pthread_join(s->connector, NULL);
	for (int i = 0; i < nworkers; i++)
		pthread_join(s->workers[i], NULL);
}

static void destroy(ap_setup *s)
{
	while (s->head) {
		struct pend *p = s->head;
		unlink_pend(s, p);
		if (p->fd >= 0)
			close(p->fd);
		pend_free(s, p);
	}
	while (s->cj_head) {
		struct cjob *j = s->cj_head;
		s->cj_head = j->next;
		free(j);
	}
	if (s->wake_fd >= 0)
		close(s->wake_fd);
	pthread_mutex_destroy(&s->mu);
	pthread_cond_destroy(&s->ready_cv);
	pthread_cond_destroy(&s->conn_cv);
	free(s->workers);
	free(s);
}

ap_setup *ap_setup_start(ei_cnode *ec, ap_sendq *q, const ap_setup_cfg *cfg)
{
	ap_setup *s = calloc(1, sizeof *s);
	if (!s)
		return NULL;
	s->ec = ec;
	s->q = q;
	s->lfd = -1;
	s->conn_fd = -1;
	s->cfg = *cfg;
	if (s->cfg.handshake_ms <= 0)
		s->cfg.handshake_ms = DEF_HANDSHAKE_MS;
	if (s->cfg.max_pending <= 0)
		s->cfg.max_pending = DEF_MAX_PENDING;
	if (s->cfg.max_per_source <= 0)
		s->cfg.max_per_source = DEF_MAX_PER_SOURCE;
	if (s->cfg.threads <= 0)
		s->cfg.threads = DEF_THREADS;
	if (s->cfg.grace_ms <= 0)
		s->cfg.grace_ms = DEF_GRACE_MS;
	/* One thread at least stays for other sources, whenever there are two. */
	s->run_cap = s->cfg.max_run_per_source > 0 ? s->cfg.max_run_per_source
						   : s->cfg.threads > 1 ? s->cfg.threads - 1 : 1;
	if (s->run_cap > s->cfg.threads)
		s->run_cap = s->cfg.threads;
	s->last_summary = ap_mono_ms() - SUMMARY_MS;
	pthread_mutex_init(&s->mu, NULL);
	pthread_cond_init(&s->ready_cv, NULL);
	pthread_cond_init(&s->conn_cv, NULL);
	s->wake_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
	s->workers = calloc((size_t)s->cfg.threads, sizeof *s->workers);
	if (s->wake_fd < 0 || !s->workers) {
		destroy(s);
		return NULL;
	}
	/* The gate last: it reads nworkers. */
	int gate = 0, connector = 0;
	for (; s->nworkers < s->cfg.threads; s->nworkers++)
		if (pthread_create(&s->workers[s->nworkers], NULL, worker_main, s))
			goto err;
	if (pthread_create(&s->connector, NULL, connector_main, s))
		goto err;
	connector = 1;
	if (pthread_create(&s->gate, NULL, gate_main, s))
		goto err;
	gate = 1;
	return s;
err:
	stop_threads(s, gate, connector, s->nworkers);
	destroy(s);
	return NULL;
}

void ap_setup_set_listener(ap_setup *s, int lfd) { s->lfd = lfd; }

void ap_setup_get_stats(ap_setup *s, ap_setup_stats *out)
{
	pthread_mutex_lock(&s->mu);
	*out = s->st;
	out->pending = s->npend;
	pthread_mutex_unlock(&s->mu);
}

void ap_setup_dispose(ap_sendq_item *it)
{
	if (it->kind != AP_Q_CONN_UP || it->len < sizeof(ap_setup_result))
		return;
	ap_setup_result res;
	memcpy(&res, it->data, sizeof res);
	if (res.fd >= 0)
		close(res.fd);
}

void ap_setup_stop(ap_setup *s)
{
	if (!s)
		return;
	stop_threads(s, 1, 1, s->nworkers);
	destroy(s);
}
