/* ap_setup_sock: the ei socket callbacks of ap_setup (on sockets we own,
 * every read and write within the handshake's one deadline), and the
 * ei_cnode set up with them. */
#include "ap_setup_int.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "ap_log.h"
#include "ap_time.h"

/* ---- ei socket callbacks ------------------------------------------------ */

struct sctx {
	int fd;
	int keep;            /* the loop owns the fd now: close() must not close it */
	int connecting;      /* an outgoing connect registered in s->conn_fd */
	struct pend *p;      /* an accepted socket */
};

/* The per-thread state (ap_setup_int.h). */
__thread ap_setup *tl_setup;
__thread struct pend *tl_parked;  /* the socket the next accept adopts */
__thread int64_t tl_deadline;     /* of the handshake under way; 0: none */
__thread struct sctx *last_ctx;   /* the ctx the last handshake used */

/* Wait for ev on fd until the handshake's deadline (or ei's tmo, if
 * sooner): the deadline covers the whole handshake, not each read. */
int wait_fd(int fd, short ev, unsigned tmo)
{
	struct pollfd p = { .fd = fd, .events = ev };
	for (;;) {
		int t = tmo == EI_SCLBK_INF_TMO ? -1 : (int)tmo;
		if (tl_deadline) {
			int64_t left = tl_deadline - ap_mono_ms();
			if (left <= 0)
				return ETIMEDOUT;
			if (t < 0 || left < t)
				t = (int)left;
		}
		int r = poll(&p, 1, t);
		if (r > 0)
			return 0;
		if (r == 0) {
			if (tl_deadline && ap_mono_ms() < tl_deadline)
				continue;
			return ETIMEDOUT;
		}
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
	ap_setup *s = tl_setup;
	if (s && (c->p || c->connecting)) {
		/* Nobody may shutdown() this fd from now on: it is closed, or
		 * the loop's. */
		pthread_mutex_lock(&s->mu);
		if (c->p)
			c->p->fd = -1;
		if (c->connecting && s->conn_fd == c->fd)
			s->conn_fd = -1;
		pthread_mutex_unlock(&s->mu);
	}
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
	struct pend *p = tl_parked;
	if (!p || p->fd < 0)
		return EAGAIN;
	struct sctx *c = calloc(1, sizeof *c);
	if (!c)
		return ENOMEM;
	c->fd = p->fd;
	c->p = p;
	tl_parked = NULL;
	socklen_t sl = (socklen_t)*len;
	if (getpeername(c->fd, addr, &sl) == 0)
		*len = (int)sl;
	int one = 1;
	setsockopt(c->fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
	*ctx = c;
	last_ctx = c;
	return 0;
}

/* Register fd as the connect in progress, so that ap_setup_stop can shut it
 * down; ECANCELED once stopping (checked under the lock, so no connect
 * starts after the stop looked). */
int claim_conn_fd(ap_setup *s, int fd)
{
	int r = 0;
	pthread_mutex_lock(&s->mu);
	if (s->stop)
		r = ECANCELED;
	else
		s->conn_fd = fd;
	pthread_mutex_unlock(&s->mu);
	return r;
}

void release_conn_fd(ap_setup *s, int fd)
{
	pthread_mutex_lock(&s->mu);
	if (s->conn_fd == fd)
		s->conn_fd = -1;
	pthread_mutex_unlock(&s->mu);
}

/* Non-blocking connect within the deadline (wait_fd); fd stays
 * non-blocking. Returns 0 or an errno. */
int connect_nb(int fd, const void *addr, socklen_t len, unsigned tmo)
{
	int r = connect(fd, addr, len);
	if (r < 0 && errno != EINPROGRESS)
		return errno;
	if (r < 0) {
		r = wait_fd(fd, POLLOUT, tmo);
		if (!r) {
			socklen_t sl = sizeof r;
			if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &r, &sl) < 0)
				r = errno;
		}
	}
	return r;
}

static int cb_connect(void *ctx, void *addr, int len, unsigned tmo)
{
	struct sctx *c = ctx;
	ap_setup *s = tl_setup;
	if (s) {
		int e = claim_conn_fd(s, c->fd);
		if (e)
			return e;
		c->connecting = 1;
	}
	int fl = fcntl(c->fd, F_GETFL);
	fcntl(c->fd, F_SETFL, fl | O_NONBLOCK);
	int r = connect_nb(c->fd, addr, (socklen_t)len, tmo);
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
	for (;;) {
		int r = wait_fd(c->fd, POLLOUT, tmo);
		if (r)
			return r;
		ssize_t w = send(c->fd, buf, (size_t)*len, MSG_NOSIGNAL | MSG_DONTWAIT);
		if (w >= 0) {
			*len = w;
			return 0;
		}
		if (errno != EINTR && errno != EAGAIN && errno != EWOULDBLOCK)
			return errno;
	}
}

static int cb_read(void *ctx, char *buf, ssize_t *len, unsigned tmo)
{
	struct sctx *c = ctx;
	struct pend *p = c->p;
	if (p && p->off < p->got) {
		/* The first packet, read by the gate. */
		size_t n = p->got - p->off;
		if (n > (size_t)*len)
			n = (size_t)*len;
		memcpy(buf, p->pkt + p->off, n);
		p->off += (uint32_t)n;
		*len = (ssize_t)n;
		return 0;
	}
	for (;;) {
		int r = wait_fd(c->fd, POLLIN, tmo);
		if (r)
			return r;
		ssize_t n = recv(c->fd, buf, (size_t)*len, MSG_DONTWAIT);
		if (n >= 0) {
			*len = n;
			return 0;
		}
		if (errno != EINTR && errno != EAGAIN && errno != EWOULDBLOCK)
			return errno;
	}
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

/* ei's fd record goes; the fd itself stays open for the loop. */
void disown(int fd)
{
	if (last_ctx)
		last_ctx->keep = 1;
	ei_close_connection(fd);
	last_ctx = NULL;
}

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

int ap_listen_addr_ok(const char *addr)
{
	struct in_addr a;
	return !addr || !addr[0] || inet_pton(AF_INET, addr, &a) == 1 ? 0 : -1;
}

int ap_ei_listen(ei_cnode *ec, const char *addr, int *port)
{
	/* ei_xlisten speaks IPv4 only (it hands its callbacks a sockaddr_in). */
	struct in_addr ip = { .s_addr = htonl(INADDR_ANY) };
	if (addr && addr[0] && inet_pton(AF_INET, addr, &ip) != 1) {
		ap_log(AP_LOG_ERROR, "bad listen address '%s': want a dotted IPv4 address", addr);
		return -1;
	}
	*port = 0;
	int fd = ei_xlisten(ec, &ip, port, 128);
	if (fd < 0)
		ap_log(AP_LOG_ERROR, "listen on %s failed: %s", addr && addr[0] ? addr : "0.0.0.0",
		       strerror(erl_errno));
	return fd;
}
