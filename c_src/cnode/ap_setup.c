/* ap_setup: ei handshakes on our own sockets, one helper thread. */
#include "ap_setup.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "ap_log.h"

/* ---- ei socket callbacks ------------------------------------------------ */

struct sctx {
	int fd;
	int keep; /* the loop owns the fd now: close() must not close it */
};

/* The helper thread is the only one that runs handshakes, so these
 * thread-locals pass state between our calls into ei and its callbacks. */
static __thread int parked_fd = -1;       /* the socket the next accept adopts */
static __thread struct sctx *last_ctx;    /* the ctx the last handshake used */

static int wait_fd(int fd, short ev, unsigned tmo)
{
	struct pollfd p = { .fd = fd, .events = ev };
	int t = tmo == EI_SCLBK_INF_TMO ? -1 : (int)tmo;
	for (;;) {
		int r = poll(&p, 1, t);
		if (r > 0)
			return 0;
		if (r == 0)
			return ETIMEDOUT;
		if (errno != EINTR)
			return errno;
	}
}

static int cb_socket(void **ctx, void *setup_ctx)
{
	(void)setup_ctx;
	struct sctx *c = calloc(1, sizeof *c);
	if (!c)
		return ENOMEM;
	c->fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
	if (c->fd < 0) {
		int e = errno;
		free(c);
		return e;
	}
	*ctx = c;
	last_ctx = c;
	return 0;
}

static int cb_close(void *ctx)
{
	struct sctx *c = ctx;
	if (!c->keep && c->fd >= 0)
		close(c->fd);
	free(c);
	return 0;
}

static int cb_listen(void *ctx, void *addr, int *len, int backlog)
{
	struct sctx *c = ctx;
	int one = 1;
	socklen_t sl = (socklen_t)*len;
	setsockopt(c->fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
	if (bind(c->fd, addr, (socklen_t)*len) < 0 || listen(c->fd, backlog) < 0 ||
	    getsockname(c->fd, addr, &sl) < 0)
		return errno;
	*len = (int)sl;
	return 0;
}

static int cb_accept(void **ctx, void *addr, int *len, unsigned tmo)
{
	(void)tmo;
	if (parked_fd < 0)
		return EAGAIN;
	struct sctx *c = calloc(1, sizeof *c);
	if (!c)
		return ENOMEM;
	c->fd = parked_fd;
	parked_fd = -1;
	socklen_t sl = (socklen_t)*len;
	if (getpeername(c->fd, addr, &sl) == 0)
		*len = (int)sl;
	int one = 1;
	setsockopt(c->fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
	*ctx = c;
	last_ctx = c;
	return 0;
}

static int cb_connect(void *ctx, void *addr, int len, unsigned tmo)
{
	struct sctx *c = ctx;
	int fl = fcntl(c->fd, F_GETFL);
	fcntl(c->fd, F_SETFL, fl | O_NONBLOCK);
	int r = connect(c->fd, addr, (socklen_t)len);
	if (r < 0 && errno != EINPROGRESS) {
		r = errno;
		fcntl(c->fd, F_SETFL, fl);
		return r;
	}
	if (r < 0) {
		r = wait_fd(c->fd, POLLOUT, tmo);
		if (!r) {
			socklen_t sl = sizeof r;
			if (getsockopt(c->fd, SOL_SOCKET, SO_ERROR, &r, &sl) < 0)
				r = errno;
		}
	}
	fcntl(c->fd, F_SETFL, fl);
	if (!r) {
		int one = 1;
		setsockopt(c->fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
	}
	return r;
}

static int cb_write(void *ctx, const char *buf, ssize_t *len, unsigned tmo)
{
	struct sctx *c = ctx;
	int r = wait_fd(c->fd, POLLOUT, tmo);
	if (r)
		return r;
	ssize_t w;
	do
		w = send(c->fd, buf, (size_t)*len, MSG_NOSIGNAL);
	while (w < 0 && errno == EINTR);
	if (w < 0)
		return errno;
	*len = w;
	return 0;
}

static int cb_read(void *ctx, char *buf, ssize_t *len, unsigned tmo)
{
	struct sctx *c = ctx;
	int r = wait_fd(c->fd, POLLIN, tmo);
	if (r)
		return r;
	ssize_t n;
	do
		n = recv(c->fd, buf, (size_t)*len, 0);
	while (n < 0 && errno == EINTR);
	if (n < 0)
		return errno;
	*len = n;
	return 0;
}

static int cb_hs_header(void *ctx, int *sz)
{
	(void)ctx;
	*sz = 2;
	return 0;
}

static int cb_get_fd(void *ctx, int *fd)
{
	*fd = ((struct sctx *)ctx)->fd;
	return 0;
}

static ei_socket_callbacks cbs = {
	.flags = EI_SCLBK_FLG_FULL_IMPL,
	.socket = cb_socket,
	.close = cb_close,
	.listen = cb_listen,
	.EI_ACCEPT_NAME = cb_accept,
	.connect = cb_connect,
	.writev = NULL,
	.write = cb_write,
	.read = cb_read,
	.handshake_packet_header_size = cb_hs_header,
	.connect_handshake_complete = NULL,
	.accept_handshake_complete = NULL,
	.get_fd = cb_get_fd,
};

int ap_ei_init(ei_cnode *ec, const char *node, const char *cookie, unsigned creation)
{
	char alive[EI_MAXALIVELEN + 1], host[EI_MAXHOSTNAMELEN + 1];
	const char *at = strchr(node, '@');
	if (!at || at == node || (size_t)(at - node) > EI_MAXALIVELEN || strlen(at + 1) == 0 ||
	    strlen(at + 1) > EI_MAXHOSTNAMELEN || strlen(node) > MAXNODELEN) {
		ap_log(AP_LOG_ERROR, "bad node name '%s': want alive@host", node);
		return -1;
	}
	memcpy(alive, node, (size_t)(at - node));
	alive[at - node] = 0;
	strcpy(host, at + 1);
	if (ei_connect_xinit_ussi(ec, host, alive, node, NULL, cookie, creation, &cbs, sizeof cbs, NULL) < 0) {
		ap_log(AP_LOG_ERROR, "ei_connect_xinit failed for %s", node);
		return -1;
	}
	return 0;
}

int ap_ei_listen(ei_cnode *ec, int *port)
{
	struct in_addr any = { .s_addr = htonl(INADDR_ANY) };
	*port = 0;
	int fd = ei_xlisten(ec, &any, port, 128);
	if (fd < 0)
		ap_log(AP_LOG_ERROR, "listen failed: %s", strerror(errno));
	return fd;
}

/* ---- the helper thread ---------------------------------------------------- */

struct job {
	struct job *next;
	int fd;                 /* accept: the socket; connect: -1 */
	int tag;
	char node[MAXNODELEN + 1];
};

struct ap_setup {
	ei_cnode *ec;
	ap_sendq *q;
	int lfd;
	int handshake_ms;
	pthread_t th;
	pthread_mutex_t mu;
	pthread_cond_t cv;
	struct job *head, *tail;
	int stop;
};

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

/* ei's fd record goes; the fd itself stays open for the loop. */
static void disown(int fd)
{
	if (last_ctx)
		last_ctx->keep = 1;
	ei_close_connection(fd);
	last_ctx = NULL;
}

static void run_job(ap_setup *s, struct job *j)
{
	ErlConnect conn;
	if (j->fd >= 0) {
		parked_fd = j->fd;
		last_ctx = NULL;
		int fd = ei_accept_tmo(s->ec, s->lfd, &conn, (unsigned)s->handshake_ms);
		if (parked_fd >= 0) { /* ei gave up before adopting it */
			close(parked_fd);
			parked_fd = -1;
		}
		if (fd < 0) {
			ap_log(AP_LOG_WARNING, "incoming handshake failed (erl_errno %d): wrong cookie, or not a node", erl_errno);
			return;
		}
		disown(fd);
		post(s, AP_Q_CONN_UP, conn.nodename, fd, 0);
	} else {
		last_ctx = NULL;
		int fd = ei_connect_tmo(s->ec, j->node, (unsigned)s->handshake_ms);
		if (fd < 0) {
			ap_log(AP_LOG_WARNING, "connect to %s failed (erl_errno %d)", j->node, erl_errno);
			post(s, AP_Q_CONN_FAILED, j->node, -1, j->tag);
			return;
		}
		disown(fd);
		post(s, AP_Q_CONN_UP, j->node, fd, j->tag);
	}
}

static void *setup_main(void *arg)
{
	ap_setup *s = arg;
	pthread_mutex_lock(&s->mu);
	while (!s->stop) {
		struct job *j = s->head;
		if (!j) {
			pthread_cond_wait(&s->cv, &s->mu);
			continue;
		}
		s->head = j->next;
		if (!s->head)
			s->tail = NULL;
		pthread_mutex_unlock(&s->mu);
		run_job(s, j);
		free(j);
		pthread_mutex_lock(&s->mu);
	}
	pthread_mutex_unlock(&s->mu);
	return NULL;
}

ap_setup *ap_setup_start(ei_cnode *ec, ap_sendq *q, int handshake_ms)
{
	ap_setup *s = calloc(1, sizeof *s);
	if (!s)
		return NULL;
	s->ec = ec;
	s->q = q;
	s->lfd = -1;
	s->handshake_ms = handshake_ms;
	pthread_mutex_init(&s->mu, NULL);
	pthread_cond_init(&s->cv, NULL);
	if (pthread_create(&s->th, NULL, setup_main, s)) {
		free(s);
		return NULL;
	}
	return s;
}

void ap_setup_set_listener(ap_setup *s, int lfd) { s->lfd = lfd; }

static void enqueue(ap_setup *s, struct job *j)
{
	pthread_mutex_lock(&s->mu);
	if (s->tail)
		s->tail->next = j;
	else
		s->head = j;
	s->tail = j;
	pthread_cond_signal(&s->cv);
	pthread_mutex_unlock(&s->mu);
}

void ap_setup_accept(ap_setup *s, int fd)
{
	struct job *j = calloc(1, sizeof *j);
	if (!j) {
		close(fd);
		return;
	}
	j->fd = fd;
	enqueue(s, j);
}

void ap_setup_connect(ap_setup *s, const char *node, int tag)
{
	struct job *j = calloc(1, sizeof *j);
	if (!j)
		return;
	j->fd = -1;
	j->tag = tag;
	strncpy(j->node, node, MAXNODELEN);
	enqueue(s, j);
}

void ap_setup_stop(ap_setup *s)
{
	if (!s)
		return;
	pthread_mutex_lock(&s->mu);
	s->stop = 1;
	pthread_cond_signal(&s->cv);
	pthread_mutex_unlock(&s->mu);
	pthread_join(s->th, NULL);
	while (s->head) {
		struct job *j = s->head;
		s->head = j->next;
		if (j->fd >= 0)
			close(j->fd);
		free(j);
	}
	pthread_mutex_destroy(&s->mu);
	pthread_cond_destroy(&s->cv);
	free(s);
}
