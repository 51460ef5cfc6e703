/* ring_attach: how a BEAM of this host attaches its segment to the pool
 * node (ap_seg.h, the handshake): an abstract AF_UNIX socket and a random
 * token, both drawn at start and handed out by the manager (dp_info) over
 * distribution; an attach thread that accepts, runs each handshake
 * (SO_PEERCRED, hello, memfd, ap_seg_parse, ack) without ever blocking on
 * one peer (poll, a deadline each, at most DP_MAX_ATTACHING at once, at
 * most DP_MAX_SEGS segments attached), hands each segment to the loop
 * (dp_seg_added), then watches every attached socket for EOF
 * (dp_peer_gone).
 */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include "ap_log.h"
#include "ap_seg.h"
#include "ap_time.h"
#include "pool_int.h"
#include "ring_ingress.h"
#include "ring_int.h"

/* ---- the attach thread ---------------------------------------------------------- */

struct attaching {
	int fd;
	int64_t deadline_ms;
	int stage; /* 0 hello, 1 name, 2 fd */
	size_t got;
	struct ap_seg_hello hello;
	char name[AP_SEG_MAX_NAME + 1];
};

static int send_ack(int fd, uint32_t status)
{
	struct ap_seg_ack a = { .magic = AP_SEG_HELLO_MAGIC, .status = status };
	return send(fd, &a, sizeof a, MSG_NOSIGNAL | MSG_DONTWAIT) == (ssize_t)sizeof a ? 0 : -1;
}

static void refuse(struct attaching *a, uint32_t status, const char *why)
{
	ap_log(AP_LOG_WARNING, "ring attach%s%s refused: %s", a->stage > 0 ? " of " : "", a->stage > 0 ? a->name : "",
	       why);
	if (status)
		(void)send_ack(a->fd, status);
	close(a->fd);
	a->fd = -1;
}

static int token_ok(const uint8_t *t)
{
	uint8_t d = 0;
	for (int i = 0; i < AP_SEG_TOKEN_LEN; i++)
		d |= (uint8_t)(t[i] ^ ap_dp.token[i]);
	return d == 0;
}

/* Maps and parses the segment in mfd, attaches every ring. 0, or a
 * positive errno for the ack. */
static uint32_t make_seg(struct attaching *a, int mfd, struct ap_dp_seg **out)
{
	struct ap_dp_seg *sg = calloc(1, sizeof *sg);
	if (!sg) {
		close(mfd);
		return ENOMEM;
	}
	sg->map.fd = -1;
	int r = ap_ring_map_open_fd(&sg->map, mfd, AP_SEG_HDR_SIZE);
	if (r) {
		close(mfd);
		free(sg);
		return (uint32_t)-r;
	}
	uint32_t st = EINVAL;
	if (ap_seg_parse(&sg->s, sg->map.mem, sg->map.size))
		goto fail;
	sg->req = calloc(sg->s.n_req, sizeof *sg->req);
	sg->busy = calloc(sg->s.n_req, 1);
	sg->seen = calloc(sg->s.n_req, sizeof *sg->seen);
	sg->rep = calloc(sg->s.n_rep, sizeof *sg->rep);
	if (!sg->req || !sg->busy || !sg->rep || !sg->seen) {
		st = ENOMEM;
		goto fail;
	}
	for (uint32_t i = 0; i < sg->s.n_req; i++) {
		if (ap_ring_attach_consumer(&sg->req[i], ap_seg_req(&sg->s, i), ap_seg_req_size(&sg->s)))
			goto fail;
		sg->seen[i] = sg->req[i].pos;
	}
	for (uint32_t i = 0; i < sg->s.n_rep; i++)
		if (ap_ring_attach_producer(&sg->rep[i].r, ap_seg_rep(&sg->s, i), ap_seg_rep_size(&sg->s)))
			goto fail;
	for (uint32_t i = 0; i < sg->s.n_rep; i++)
		pthread_mutex_init(&sg->rep[i].mu, NULL);
	memcpy(sg->peer, a->name, sizeof sg->peer);
	sg->os_pid = a->hello.os_pid;
	sg->slot = -1;
	sg->id = ++ap_dp.next_id;
	*out = sg;
	return 0;
fail:
	free(sg->req);
	free(sg->busy);
	free(sg->seen);
	free(sg->rep);
	ap_ring_map_close(&sg->map);
	free(sg);
	return st;
}

/* Reads into buf until a->got is n: 1 once it is, 0 to wait for more, -1
 * refused (the peer closed). */
static int fill(struct attaching *a, void *buf, size_t n)
{
	if (a->got < n) {
		ssize_t k = recv(a->fd, (uint8_t *)buf + a->got, n - a->got, MSG_DONTWAIT);
		if (k <= 0) {
			if (k < 0 && (errno == EAGAIN || errno == EINTR))
				return 0;
			refuse(a, 0, "closed during the hello");
			return -1;
		}
		a->got += (size_t)k;
	}
	return a->got == n;
}

/* One step of a handshake, when its socket is readable. */
static void step(struct attaching *a, struct ap_dp_seg **attached, int *nattached)
{
	if (a->stage == 0) {
		if (fill(a, &a->hello, sizeof a->hello) <= 0)
			return;
		if (a->hello.magic != AP_SEG_HELLO_MAGIC || a->hello.version != AP_SEG_VERSION) {
			refuse(a, EPROTO, "not a hello of this version");
			return;
		}
		if (!token_ok(a->hello.token)) {
			refuse(a, EACCES, "wrong token");
			return;
		}
		if (a->hello.name_len > AP_SEG_MAX_NAME) {
			refuse(a, EPROTO, "node name too long");
			return;
		}
		a->stage = 1;
		a->got = 0;
	}
	if (a->stage == 1) {
		/* Exactly name_len bytes: the fd rides on the next one. */
		if (fill(a, a->name, a->hello.name_len) <= 0)
			return;
		a->name[a->hello.name_len] = 0;
		a->stage = 2;
	}
	int mfd;
	int r = ap_ring_recv_fd(a->fd, &mfd);
	if (r == -EAGAIN || r == -EINTR)
		return;
	if (r) {
		refuse(a, EPROTO, r == -ECONNRESET ? "closed before it sent the segment" : "no segment fd");
		return;
	}
	if (atomic_load(&ap_dp.nsegs) >= DP_MAX_SEGS) {
		close(mfd);
		refuse(a, EMFILE, "too many segments attached");
		return;
	}
	struct ap_dp_seg *sg = NULL;
	uint32_t st = make_seg(a, mfd, &sg);
	if (st) {
		refuse(a, st, "the segment is not valid");
		return;
	}
	struct ap_seg_ack ok = { .magic = AP_SEG_HELLO_MAGIC, .status = 0 };
	if (ap_dp.bell_tx >= 0 ? ap_ring_send_with_fd(a->fd, &ok, sizeof ok, ap_dp.bell_tx) : send_ack(a->fd, 0)) {
		refuse(a, 0, "cannot answer");
		dp_seg_free(sg);
		return;
	}
	sg->sock = a->fd;
	a->fd = -1;
	atomic_fetch_add(&ap_dp.nsegs, 1);
	atomic_store(&sg->refs, 2); /* the attach thread's socket, the registry's */
	attached[(*nattached)++] = sg;
	if (ap_node_call_on_loop(ap_dp.n, dp_seg_added, sg)) {
		atomic_store(&sg->dead, 1);
		atomic_store(&sg->close_req, 1);
		uint64_t one = 1;
		(void)!write(ap_dp.efd, &one, sizeof one); /* so the next poll returns */
		ap_dp_seg_put(sg);
	}
}

static void *attach_main(void *arg)
{
	(void)arg;
	pthread_setname_np(pthread_self(), "dp-attach");
	static struct attaching att[DP_MAX_ATTACHING];
	static struct ap_dp_seg *segs[DP_MAX_SEGS];
	static struct pollfd pfd[2 + DP_MAX_ATTACHING + DP_MAX_SEGS];
	int natt = 0, nseg = 0;
	for (;;) {
		int64_t now = ap_mono_ms(), next = -1;
		int np = 0;
		pfd[np++] = (struct pollfd){ .fd = ap_dp.efd, .events = POLLIN };
		pfd[np++] = (struct pollfd){ .fd = natt < DP_MAX_ATTACHING ? ap_dp.lfd : -1, .events = POLLIN };
		for (int i = 0; i < natt; i++) {
			pfd[np++] = (struct pollfd){ .fd = att[i].fd, .events = POLLIN };
			if (next < 0 || att[i].deadline_ms < next)
				next = att[i].deadline_ms;
		}
		for (int i = 0; i < nseg; i++)
			pfd[np++] = (struct pollfd){ .fd = segs[i]->sock, .events = POLLIN | POLLRDHUP };
		int tmo = next < 0 ? -1 : next <= now ? 0 : (int)(next - now);
		int r = poll(pfd, (nfds_t)np, tmo);
		if (r < 0 && errno != EINTR)
			break;
		now = ap_mono_ms();
		if (pfd[0].revents) {
			uint64_t v;
			(void)!read(ap_dp.efd, &v, sizeof v);
		}
		/* Sockets first, in the order polled; the lists change after. */
		int base = 2, polled_segs = nseg; /* step may add segments: not polled yet */
		for (int i = 0; i < natt; i++) {
			if (pfd[base + i].revents)
				step(&att[i], segs, &nseg);
			else if (att[i].fd >= 0 && now >= att[i].deadline_ms)
				refuse(&att[i], ETIMEDOUT, "handshake timed out");
		}
		base += natt;
		for (int i = 0; i < nseg; i++) {
			struct ap_dp_seg *sg = segs[i];
			int gone = atomic_load(&sg->close_req);
			if (i < polled_segs && (pfd[base + i].revents & (POLLIN | POLLRDHUP | POLLHUP | POLLERR))) {
				char junk[256];
				ssize_t k = recv(sg->sock, junk, sizeof junk, MSG_DONTWAIT);
				if (k == 0 || (k < 0 && errno != EAGAIN && errno != EINTR))
					gone = 2; /* EOF or error: the peer is gone */
			}
			if (!gone)
				continue;
			close(sg->sock);
			sg->sock = -1;
			segs[i] = NULL;
			if (gone == 2) {
				if (ap_node_call_on_loop(ap_dp.n, dp_peer_gone, sg))
					ap_dp_seg_put(sg);
			} else {
				ap_dp_seg_put(sg);
			}
		}
		int w = 0;
		for (int i = 0; i < nseg; i++)
			if (segs[i])
				segs[w++] = segs[i];
		nseg = w;
		w = 0;
		for (int i = 0; i < natt; i++)
			if (att[i].fd >= 0)
				att[w++] = att[i];
		natt = w;
		/* New connections last (their slots were not polled). */
		if (pfd[1].revents & POLLIN) {
			while (natt < DP_MAX_ATTACHING) {
				int fd = accept4(ap_dp.lfd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
				if (fd < 0)
					break;
				struct ucred cr;
				socklen_t cl = sizeof cr;
				if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cr, &cl) || cr.uid != geteuid()) {
					ap_log(AP_LOG_WARNING, "ring attach refused: peer of another user");
					(void)send_ack(fd, EPERM);
					close(fd);
					continue;
				}
				att[natt++] = (struct attaching){ .fd = fd, .deadline_ms = now + AP_SEG_ATTACH_TIMEOUT_MS };
			}
		}
	}
	ap_log(AP_LOG_ERROR, "ring attach thread stopped: %s", strerror(errno));
	return NULL;
}

/* ---- start and dp_info -------------------------------------------------------- */

int ap_dp_start(ap_node *n, int enabled, int poll_us, int lone_us, int nap_us, int ask_nap_us)
{
	ap_dp.n = n;
	ap_dp.poll_us = poll_us;
	ap_dp.lone_us = lone_us;
	ap_dp.nap_us = nap_us;
	ap_dp.ask_nap_us = ask_nap_us;
	ap_dp.gap_us = INT64_MAX;
	if (!enabled) {
		ap_log(AP_LOG_INFO, "same-host rings: disabled (--no-fast-path)");
		return 0;
	}
	uint8_t rnd[8];
	if (getrandom(ap_dp.token, sizeof ap_dp.token, 0) != (ssize_t)sizeof ap_dp.token ||
	    getrandom(rnd, sizeof rnd, 0) != (ssize_t)sizeof rnd) {
		ap_log(AP_LOG_ERROR, "same-host rings: no random bytes (%s)", strerror(errno));
		return -1;
	}
	char hex[2 * sizeof rnd + 1];
	for (size_t i = 0; i < sizeof rnd; i++)
		snprintf(hex + 2 * i, 3, "%02x", rnd[i]);
	/* "\0actor_pool.<node>.<os pid>.<hex>"; a long node name is cut so the
	 * pid and the random part always fit. */
	char body[sizeof ap_dp.name];
	int k = snprintf(body, sizeof body, "actor_pool.%.60s.%d.%s", ap_node_name(n), (int)getpid(), hex);
	if (k < 0 || (size_t)k >= sizeof body - 1)
		return -1;
	ap_dp.name[0] = 0;
	memcpy(ap_dp.name + 1, body, (size_t)k);
	ap_dp.name_len = (size_t)k + 1;
	ap_dp.addr.sun_family = AF_UNIX;
	memcpy(ap_dp.addr.sun_path, ap_dp.name, ap_dp.name_len);
	ap_dp.addr_len = (socklen_t)(offsetof(struct sockaddr_un, sun_path) + ap_dp.name_len);
	ap_dp.lfd = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
	ap_dp.efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
	if (ap_dp.lfd < 0 || ap_dp.efd < 0 || bind(ap_dp.lfd, (struct sockaddr *)&ap_dp.addr, ap_dp.addr_len) ||
	    listen(ap_dp.lfd, 128)) {
		ap_log(AP_LOG_ERROR, "same-host rings: cannot listen (%s); distribution only", strerror(errno));
		goto off;
	}
	ap_dp.uring = ap_node_futex_supported(n);
	if (!ap_dp.uring) {
		/* A pipe, not an eventfd: the BEAMs write it with RWF_NOWAIT,
		 * which never blocks whatever anyone does to the shared write
		 * end's flags (an eventfd's write blocks when a peer cleared
		 * O_NONBLOCK and filled it). The read end is ours alone. */
		int sv[2], r = pipe2(sv, O_NONBLOCK | O_CLOEXEC) ? -errno : 0;
		if (!r) {
			ap_dp.bell_fd = sv[0];
			ap_dp.bell_tx = sv[1];
			r = ap_node_add_reader(n, ap_dp.bell_fd, dp_on_bell, NULL);
		}
		if (r) {
			ap_log(AP_LOG_ERROR, "same-host rings: no bell for the epoll loop (%s); distribution only",
			       strerror(-r));
			if (ap_dp.bell_fd >= 0)
				close(ap_dp.bell_fd);
			if (ap_dp.bell_tx >= 0)
				close(ap_dp.bell_tx);
			ap_dp.bell_fd = ap_dp.bell_tx = -1;
			goto off;
		}
	}
	if (pthread_create(&ap_dp.th, NULL, attach_main, NULL)) {
		ap_log(AP_LOG_ERROR, "same-host rings: no attach thread; distribution only");
		goto off;
	}
	pthread_detach(ap_dp.th);
	ap_node_set_idle(n, dp_idle, NULL);
	ap_dp.enabled = 1;
	ap_log(AP_LOG_INFO, "same-host rings: listening on @%s, wake-ups by %s", body,
	       ap_dp.uring ? "io_uring futex waits" : "a bell pipe in the epoll set");
	return 0;
off:
	if (ap_dp.lfd >= 0)
		close(ap_dp.lfd);
	if (ap_dp.efd >= 0)
		close(ap_dp.efd);
	ap_dp.lfd = ap_dp.efd = -1;
	return 0;
}

void ap_dp_encode_info(ei_x_buff *x)
{
	ei_x_encode_tuple_header(x, 2);
	if (!ap_dp.enabled) {
		ei_x_encode_atom(x, "error");
		ei_x_encode_atom(x, "disabled");
		return;
	}
	ei_x_encode_atom(x, "ok");
	ei_x_encode_map_header(x, 2);
	ei_x_encode_atom(x, "socket");
	ei_x_encode_binary(x, ap_dp.name, (long)ap_dp.name_len);
	ei_x_encode_atom(x, "token");
	ei_x_encode_binary(x, ap_dp.token, sizeof ap_dp.token);
}
