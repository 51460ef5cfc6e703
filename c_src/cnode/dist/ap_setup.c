/* ap_setup: ei handshakes on our own sockets: a gate thread, a few
 * handshake threads, a connect thread.
 *
 * Over 700 lines, kept whole: the gate, the handshake threads and the
 * connect thread share one lock, one table of pending handshakes and the
 * fairness rules over it (ap_setup.h); split, the bounds that keep a peer
 * from holding the machinery would be spread over files that each see
 * only part of them. */
#include "ap_setup.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "ap_log.h"
#include "ap_time.h"

#define DEF_HANDSHAKE_MS 5000
#define DEF_MAX_PENDING 256
#define DEF_MAX_PER_SOURCE 64
#define DEF_THREADS 4
#define DEF_GRACE_MS 250
#define SUMMARY_MS 1000
#define EPMD_PORT 4369

/* One accepted socket from accept to hand-over. The gate thread owns it in
 * P_GATE and P_READY (only it frees those), a handshake thread in P_RUN.
 * fd is -1 once ei closed it or handed it over: other threads may
 * shutdown() it, under s->mu, only while it is >= 0. */
enum pend_state { P_GATE, P_READY, P_RUN };

/* One peer address with pending handshakes: what the caps and the
 * fairness rules count. Lives while a pend points at it. */
struct src {
	struct src *next;
	int refs;                  /* pends pointing here, dropped ones too */
	int npend;                 /* of them, not dropped */
	int nrun;                  /* of them, running and not dropped */
	uint8_t addr[16];
	uint8_t len;               /* 4, 16, or 0: unknown (all unknown are one) */
};

struct pend {
	struct pend *prev, *next;  /* every pending handshake, oldest first */
	int fd;
	enum pend_state st;
	int dropped;               /* capped, evicted or stopping: no longer counted */
	struct src *src;           /* the peer's address */
	int64_t deadline, t_run;
	uint32_t need;             /* the first packet with its 2-byte header, once known */
	uint32_t got;              /* bytes of it read by the gate */
	uint32_t off;              /* bytes of it ei has read */
	uint8_t pkt[2 + AP_SETUP_MAX_NAME_PKT];
};

struct cjob {
	struct cjob *next;
	int tag;
	char node[MAXNODELEN + 1];
};

struct ap_setup {
	ei_cnode *ec;
	ap_sendq *q;
	int lfd;
	ap_setup_cfg cfg;
	pthread_mutex_t mu;
	pthread_cond_t ready_cv;   /* handshake threads: a P_READY entry, or stop */
	pthread_cond_t conn_cv;    /* connect thread: a job, or stop */
	struct pend *head, *tail;
	struct src *srcs;          /* the addresses of the entries */
	int npend;                 /* entries not dropped */
	int nready;                /* P_READY entries not dropped */
	int nrun;                  /* P_RUN entries, dropped too: each holds a thread */
	int nevict;                /* P_RUN entries dropped, their thread not yet back */
	int run_cap;               /* running handshakes per source address */
	int wake_fd;               /* eventfd: wakes the gate */
	int conn_fd;               /* the socket of the connect in progress, or -1 */
	struct cjob *cj_head, *cj_tail;
	int stop;
	ap_setup_stats st, logged; /* counters, and their values at the last summary */
	int64_t last_summary;
	pthread_t gate, connector;
	pthread_t *workers;
	int nworkers;
};

/* ---- ei socket callbacks ------------------------------------------------ */

struct sctx {
	int fd;
	int keep;            /* the loop owns the fd now: close() must not close it */
	int connecting;      /* an outgoing connect registered in s->conn_fd */
	struct pend *p;      /* an accepted socket */
};

/* Each thread runs one handshake at a time, so these thread-locals pass
 * state between our calls into ei and its callbacks. */
static __thread ap_setup *tl_setup;
static __thread struct pend *tl_parked;  /* the socket the next accept adopts */
static __thread int64_t tl_deadline;     /* of the handshake under way; 0: none */
static __thread struct sctx *last_ctx;   /* the ctx the last handshake used */

/* Wait for ev on fd until the handshake's deadline (or ei's tmo, if
 * sooner): the deadline covers the whole handshake, not each read. */
static int wait_fd(int fd, short ev, unsigned tmo)
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
static int claim_conn_fd(ap_setup *s, int fd)
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

static void release_conn_fd(ap_setup *s, int fd)
{
	pthread_mutex_lock(&s->mu);
	if (s->conn_fd == fd)
		s->conn_fd = -1;
	pthread_mutex_unlock(&s->mu);
}

/* Non-blocking connect within the deadline (wait_fd); fd stays
 * non-blocking. Returns 0 or an errno. */
static int connect_nb(int fd, const void *addr, socklen_t len, unsigned tmo)
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

/* ---- pending handshakes ------------------------------------------------- */

static void wake_gate(ap_setup *s)
{
	uint64_t one = 1;
	ssize_t r = write(s->wake_fd, &one, sizeof one);
	(void)r; /* a full counter (EAGAIN) wakes it all the same */
}

static void unlink_pend(ap_setup *s, struct pend *p)
{
	if (p->prev)
		p->prev->next = p->next;
	else
		s->head = p->next;
	if (p->next)
		p->next->prev = p->prev;
	else
		s->tail = p->prev;
	p->prev = p->next = NULL;
}

/* Under s->mu: p no longer counts; its fd is shut down, which wakes a
 * handshake thread blocked on it. Whoever owns p frees it. */
static void drop(ap_setup *s, struct pend *p, unsigned long long *counter)
{
	if (p->dropped)
		return;
	p->dropped = 1;
	s->npend--;
	p->src->npend--;
	if (p->st == P_READY) {
		s->nready--;
	} else if (p->st == P_RUN) {
		s->nevict++;
		p->src->nrun--;
	}
	if (p->fd >= 0)
		shutdown(p->fd, SHUT_RDWR);
	(*counter)++;
}

/* Under s->mu: the source record of addr (new if none), one more
 * reference; NULL if out of memory. */
static struct src *src_get(ap_setup *s, const uint8_t *addr, uint8_t len)
{
	struct src *x = s->srcs;
	while (x && !(x->len == len && !memcmp(x->addr, addr, len)))
		x = x->next;
	if (!x) {
		x = calloc(1, sizeof *x);
		if (!x)
			return NULL;
		memcpy(x->addr, addr, len);
		x->len = len;
		x->next = s->srcs;
		s->srcs = x;
	}
	x->refs++;
	return x;
}

/* Under s->mu: p's reference to its source goes, then p. */
static void pend_free(ap_setup *s, struct pend *p)
{
	struct src *x = p->src;
	if (x && --x->refs == 0) {
		struct src **pp = &s->srcs;
		while (*pp != x)
			pp = &(*pp)->next;
		*pp = x->next;
		free(x);
	}
	free(p);
}

/* Under s->mu: the entry of source x to drop for room: its oldest not yet
 * on a handshake thread (those that sent their name are likelier to be
 * nodes, and stalled ones are evicted by the grace rule), else its oldest
 * running one that has had its grace; NULL if none: a handshake under way
 * is never cut short at once. */
static struct pend *oldest_of(ap_setup *s, const struct src *x, int64_t now)
{
	struct pend *run = NULL;
	for (struct pend *o = s->head; o; o = o->next) {
		if (o->dropped || o->src != x)
			continue;
		if (o->st != P_RUN)
			return o;
		if (!run && now - o->t_run >= s->cfg.grace_ms)
			run = o;
	}
	return run;
}

/* Under s->mu, at the pending cap: the entry to drop for newcomer p. It
 * comes from the source holding the most pending handshakes, p counted:
 * p's own when it holds as many, else (or when p's own has nothing that
 * may go) the other that holds the most, the one with the oldest entry of
 * those holding as many. Never from a source holding fewer than p's: a
 * churning flood from many addresses only recycles its own slots, and an
 * address holding its fair share (max_pending / addresses) or less keeps
 * it. NULL: refuse p. */
static struct pend *cap_victim(ap_setup *s, const struct pend *p, int64_t now)
{
	const struct src *most = NULL;
	for (struct pend *o = s->head; o; o = o->next)
		if (!o->dropped && o->src != p->src && (!most || o->src->npend > most->npend))
			most = o->src;
	int n = p->src->npend + 1;
	struct pend *v = NULL;
	if (!most || n >= most->npend)
		v = oldest_of(s, p->src, now);
	if (!v && most && most->npend >= n)
		v = oldest_of(s, most, now);
	return v;
}

static void source_of(int fd, uint8_t *src, uint8_t *srclen)
{
	struct sockaddr_storage ss;
	socklen_t sl = sizeof ss;
	*srclen = 0;
	if (getpeername(fd, (struct sockaddr *)&ss, &sl) < 0)
		return;
	if (ss.ss_family == AF_INET) {
		memcpy(src, &((struct sockaddr_in *)&ss)->sin_addr, 4);
		*srclen = 4;
	} else if (ss.ss_family == AF_INET6) {
		memcpy(src, &((struct sockaddr_in6 *)&ss)->sin6_addr, 16);
		*srclen = 16;
	}
}

void ap_setup_accept(ap_setup *s, int fd)
{
	struct pend *p = s ? calloc(1, sizeof *p) : NULL;
	if (!p) { /* no memory, or stopped (the loop still runs at teardown) */
		close(fd);
		return;
	}
	p->fd = fd;
	p->st = P_GATE;
	uint8_t addr[16];
	uint8_t alen;
	source_of(fd, addr, &alen);
	pthread_mutex_lock(&s->mu);
	s->st.accepted++;
	int64_t now = ap_mono_ms();
	p->deadline = now + s->cfg.handshake_ms;
	p->src = src_get(s, addr, alen);
	/* At a cap with nothing that may go, the newcomer is refused. */
	int refuse = !p->src;
	if (!refuse && p->src->npend >= s->cfg.max_per_source) {
		struct pend *o = oldest_of(s, p->src, now);
		if (o)
			drop(s, o, &s->st.capped);
		else
			refuse = 1;
	}
	if (!refuse && s->npend >= s->cfg.max_pending) {
		struct pend *o = cap_victim(s, p, now);
		if (o)
			drop(s, o, &s->st.capped);
		else
			refuse = 1;
	}
	if (refuse) {
		s->st.capped++;
		pend_free(s, p);
		pthread_mutex_unlock(&s->mu);
		close(fd);
		wake_gate(s); /* for its summary line */
		return;
	}
	p->prev = s->tail;
	if (s->tail)
		s->tail->next = p;
	else
		s->head = p;
	s->tail = p;
	s->npend++;
	p->src->npend++;
	pthread_mutex_unlock(&s->mu);
	wake_gate(s);
}

/* ---- the gate --------------------------------------------------------------- */

/* Read what has arrived of p's first packet without blocking. 1: all of it
 * is here; 0: wait for more; -1: closed or failed; -2: too large. */
static int gate_read(struct pend *p)
{
	for (;;) {
		uint32_t want = p->need ? p->need - p->got : 2 - p->got;
		ssize_t r = recv(p->fd, p->pkt + p->got, want, MSG_DONTWAIT);
		if (r < 0 && errno == EINTR)
			continue;
		if (r < 0)
			return errno == EAGAIN || errno == EWOULDBLOCK ? 0 : -1;
		if (r == 0)
			return -1;
		p->got += (uint32_t)r;
		if (!p->need && p->got == 2) {
			uint32_t len = (uint32_t)p->pkt[0] << 8 | p->pkt[1];
			if (len == 0 || len > AP_SETUP_MAX_NAME_PKT)
				return -2;
			p->need = 2 + len;
		}
		if (p->need && p->got == p->need)
			return 1;
	}
}

/* Under s->mu: close and free the dropped entries the gate owns. */
static void gate_reap(ap_setup *s)
{
	struct pend *p = s->head;
	while (p) {
		struct pend *next = p->next;
		if (p->dropped && p->st != P_RUN) {
			unlink_pend(s, p);
			if (p->fd >= 0)
				close(p->fd);
			pend_free(s, p);
		}
		p = next;
	}
}

/* Under s->mu: the running handshake of source x that has run longest, or
 * NULL. */
static struct pend *oldest_running_of(ap_setup *s, const struct src *x)
{
	struct pend *o = NULL;
	for (struct pend *p = s->head; p; p = p->next)
		if (p->st == P_RUN && !p->dropped && p->src == x && (!o || p->t_run < o->t_run))
			o = p;
	return o;
}

/* Under s->mu: the ready socket a free thread takes: of the sources below
 * their thread cap, the one running the fewest handshakes, then the one
 * holding the fewest pending, then the oldest of that source. Never by age
 * alone: a node's socket from an address of its own goes before the older
 * ones of addresses that hold many, however many addresses the flood
 * comes from. */
static struct pend *take_ready(ap_setup *s)
{
	struct pend *best = NULL;
	for (struct pend *p = s->head; p; p = p->next) {
		if (p->st != P_READY || p->dropped || p->src->nrun >= s->run_cap)
			continue;
		if (!best || p->src->nrun < best->src->nrun ||
		    (p->src->nrun == best->src->nrun && p->src->npend < best->src->npend))
			best = p;
	}
	return best;
}

/* Under s->mu: drop running handshakes that have had their grace while
 * ready sockets wait that no free thread will take. The victim comes from
 * the source holding the most threads (its oldest handshake), and only if
 * that is more than the waiting socket's source holds (else from the
 * waiting socket's own source): a flood from one address recycles its own
 * threads, not a lone node's. Ready sockets whose source is at its thread
 * cap only recycle that source's threads. A
 * handshake already dropped frees its thread soon: it counts as free, so
 * one ready socket never costs two handshakes. Returns when to look again
 * (or INT64_MAX; a worker that leaves ready sockets behind wakes the gate). */
static int64_t gate_evict(ap_setup *s, int64_t now)
{
	while (s->nready) {
		int want = 0;
		struct pend *capped = NULL; /* the oldest ready one at its source's cap */
		for (struct pend *p = s->head; p; p = p->next) {
			if (p->st != P_READY || p->dropped)
				continue;
			if (p->src->nrun < s->run_cap)
				want++;
			else if (!capped)
				capped = p;
		}
		int freeing = s->nworkers - s->nrun + s->nevict;
		struct pend *victim = NULL;
		if (want > freeing) {
			/* For the one a thread would take next, from a source that
			 * holds more than its own; else one of its own source's. */
			struct pend *r = take_ready(s);
			int most = r->src->nrun;
			for (struct pend *p = s->head; p; p = p->next) {
				if (p->st != P_RUN || p->dropped)
					continue;
				int c = p->src->nrun;
				if (c > most || (c == most && victim && p->t_run < victim->t_run)) {
					victim = p;
					most = c;
				}
			}
			if (!victim)
				victim = oldest_running_of(s, r->src);
		} else if (!want && capped && !s->nevict) {
			victim = oldest_running_of(s, capped->src);
		}
		if (!victim)
			return INT64_MAX;
		if (now - victim->t_run < s->cfg.grace_ms)
			return victim->t_run + s->cfg.grace_ms;
		drop(s, victim, &s->st.evicted);
		/* Its source may be below the cap now: an idle thread may take
		 * one of its ready sockets without waiting for the victim's. */
		pthread_cond_signal(&s->ready_cv);
	}
	return INT64_MAX;
}

/* Outside s->mu: at most one line a second (force: now, at stop), only
 * when a handshake was refused or a connection closed before its name. */
static void gate_summary(ap_setup *s, int64_t now, int64_t *next, int force)
{
	pthread_mutex_lock(&s->mu);
	ap_setup_stats c = s->st, l = s->logged;
	int64_t since = force ? SUMMARY_MS : now - s->last_summary;
	int refused = c.timed_out != l.timed_out || c.capped != l.capped || c.too_large != l.too_large ||
		      c.evicted != l.evicted || c.failed != l.failed;
	/* Connections closed before their name (port scans, health checks)
	 * are worth a line too, so every connection is accounted for, but
	 * they are no warning. */
	int any = refused || c.closed != l.closed;
	if (any && since >= SUMMARY_MS) {
		s->logged = c;
		s->last_summary = now;
	}
	pthread_mutex_unlock(&s->mu);
	if (!any) {
		*next = INT64_MAX;
		return;
	}
	if (since < SUMMARY_MS) {
		*next = now + (SUMMARY_MS - since);
		return;
	}
	*next = INT64_MAX;
	ap_log(refused ? AP_LOG_WARNING : AP_LOG_NOTICE,
	       "incoming handshakes refused: %llu timed out, %llu dropped at the pending cap, %llu with an "
	       "oversized first packet, %llu stalled and evicted, %llu failed (wrong cookie or not a node); "
	       "%llu closed by the peer",
	       c.timed_out - l.timed_out, c.capped - l.capped, c.too_large - l.too_large, c.evicted - l.evicted,
	       c.failed - l.failed, c.closed - l.closed);
}

static void *gate_main(void *arg)
{
	ap_setup *s = arg;
	struct pollfd *pfd = NULL;
	struct pend **pp = NULL;
	size_t cap = 0;
	int64_t next_summary = INT64_MAX;
	pthread_mutex_lock(&s->mu);
	while (!s->stop) {
		int64_t now = ap_mono_ms();
		int64_t due = gate_evict(s, now);
		if (next_summary < due)
			due = next_summary;
		size_t n = 1;
		for (struct pend *p = s->head; p; p = p->next) {
			if (p->dropped || p->st == P_RUN)
				continue;
			if (p->deadline <= now) {
				drop(s, p, &s->st.timed_out);
				continue;
			}
			if (p->deadline < due)
				due = p->deadline;
			if (p->st == P_GATE)
				n++;
		}
		gate_reap(s);
		if (n > cap) {
			size_t nc = n * 2;
			struct pollfd *npfd = realloc(pfd, nc * sizeof *pfd);
			if (npfd)
				pfd = npfd;
			struct pend **npp = realloc(pp, nc * sizeof *pp);
			if (npp)
				pp = npp;
			if (!npfd || !npp) {
				/* Keep going with what fits; the rest time out. */
				n = cap;
			} else {
				cap = nc;
			}
		}
		if (!pfd || !pp) {
			pthread_mutex_unlock(&s->mu);
			poll(NULL, 0, 100);
			pthread_mutex_lock(&s->mu);
			continue;
		}
		pfd[0] = (struct pollfd){ .fd = s->wake_fd, .events = POLLIN };
		size_t k = 1;
		for (struct pend *p = s->head; p && k < n; p = p->next)
			if (!p->dropped && p->st == P_GATE) {
				pfd[k] = (struct pollfd){ .fd = p->fd, .events = POLLIN };
				pp[k++] = p;
			}
		/* Only this thread frees P_GATE entries, so pp stays valid while
		 * the lock is down; one dropped meanwhile is skipped below. */
		pthread_mutex_unlock(&s->mu);
		int tmo = due == INT64_MAX ? -1 : due <= now ? 0 : (int)(due - now);
		int r = poll(pfd, k, tmo);
		now = ap_mono_ms();
		if (r > 0 && (pfd[0].revents & POLLIN)) {
			uint64_t v;
			ssize_t rr = read(s->wake_fd, &v, sizeof v);
			(void)rr;
		}
		if (now >= next_summary || next_summary == INT64_MAX)
			gate_summary(s, now, &next_summary, 0);
		pthread_mutex_lock(&s->mu);
		for (size_t i = 1; r > 0 && i < k; i++) {
			struct pend *p = pp[i];
			if (!pfd[i].revents || p->dropped)
				continue;
			int g = gate_read(p);
			if (g == 1) {
				p->st = P_READY;
				s->nready++;
				pthread_cond_signal(&s->ready_cv);
			} else if (g == -1) {
				drop(s, p, &s->st.closed);
			} else if (g == -2) {
				drop(s, p, &s->st.too_large);
			}
		}
	}
	pthread_mutex_unlock(&s->mu);
	gate_summary(s, ap_mono_ms(), &next_summary, 1);
	free(pfd);
	free(pp);
	return NULL;
}

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

/* ei's fd record goes; the fd itself stays open for the loop. */
static void disown(int fd)
{
	if (last_ctx)
		last_ctx->keep = 1;
	ei_close_connection(fd);
	last_ctx = NULL;
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
