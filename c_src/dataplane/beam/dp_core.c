/* dp_core: parsing, validation and the attach handshake of the NIF side of
 * the data plane, without erl_nif (see dp_core.h). */
#include "dp_core.h"

#include <errno.h>
#include <poll.h>
#include <stddef.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

int64_t dp_now_ms(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

int dp_geom(uint32_t n_req, uint64_t req_cap, uint32_t n_rep, uint64_t rep_cap, size_t *size)
{
	size_t n = ap_seg_size(n_req, req_cap, n_rep, rep_cap);

	*size = n;
	return n ? 0 : -EINVAL;
}

void dp_binary_prefix(uint8_t out[5], uint32_t len)
{
	out[0] = 109; /* BINARY_EXT */
	out[1] = (uint8_t)(len >> 24);
	out[2] = (uint8_t)(len >> 16);
	out[3] = (uint8_t)(len >> 8);
	out[4] = (uint8_t)len;
}

int dp_req_check(const struct dp_req_parts *q)
{
	if (q->kind < AP_DP_TELL || q->kind > AP_DP_STATS)
		return -EINVAL;
	if (q->dest_kind == AP_DP_DEST_NAME) {
		if (q->dest_len < 1 || q->dest_len > DP_MAX_DEST_NAME)
			return -EINVAL;
	} else if (q->dest_kind == AP_DP_DEST_PID) {
		if (q->dest_len < 1 || q->dest_len > DP_MAX_DEST_PID)
			return -EINVAL;
	} else {
		return -EINVAL;
	}
	/* STATS carries no message; the others one whole term. */
	if ((q->kind == AP_DP_STATS) != (q->pre_len + q->msg_len == 0))
		return -EINVAL;
	if (q->pre_len + q->msg_len > UINT32_MAX - sizeof(struct ap_dp_req) - q->dest_len)
		return -EMSGSIZE;
	return 0;
}

void dp_req_write(void *p, const struct dp_req_parts *q)
{
	struct ap_dp_req h = {
		.kind = q->kind,
		.dest_kind = q->dest_kind,
		.dest_len = (uint16_t)q->dest_len,
		.msg_len = (uint32_t)(q->pre_len + q->msg_len),
		.ask_id = q->kind == AP_DP_TELL ? 0 : q->ask_id,
		.fence_ring = q->fence_ring,
		.reserved = 0,
		.fence_pos = q->fence_ring == AP_DP_NO_FENCE ? 0 : q->fence_pos,
	};
	uint8_t *o = p;

	memcpy(o, &h, sizeof h);
	o += sizeof h;
	memcpy(o, q->dest, q->dest_len);
	o += q->dest_len;
	if (q->pre_len)
		memcpy(o, q->msg_pre, q->pre_len);
	o += q->pre_len;
	if (q->msg_len)
		memcpy(o, q->msg, q->msg_len);
}

int dp_rep_parse(const uint8_t *buf, size_t len, uint64_t *ask_id, size_t *term_len)
{
	struct ap_dp_rep h;

	if (len < sizeof h)
		return -EPROTO;
	memcpy(&h, buf, sizeof h);
	/* An empty answer is no term: refused here, not at decode. */
	if (h.reserved != 0 || h.len == 0 || (uint64_t)h.len != len - sizeof h)
		return -EPROTO;
	if (buf[sizeof h] == 80) /* COMPRESSED_TERM */
		return -EPROTO;
	*ask_id = h.ask_id;
	*term_len = h.len;
	return 0;
}

int dp_drain(struct ap_ring *r, uint8_t *buf, size_t buf_cap, unsigned max, dp_reply_fn fn, void *arg,
	     struct dp_drain_stats *st)
{
	return dp_drain_upto(r, buf, buf_cap, max, SIZE_MAX, fn, arg, st);
}

int dp_drain_upto(struct ap_ring *r, uint8_t *buf, size_t buf_cap, unsigned max, size_t max_len, dp_reply_fn fn,
		  void *arg, struct dp_drain_stats *st)
{
	unsigned n = 0;
	int rc = 0;

	if (r->role != AP_RING_CONSUMER || buf_cap < ap_ring_max_payload(r->cap) + 1)
		return -EINVAL;
	while (n < max) {
		const void *p;
		size_t len, tlen;
		uint64_t id, at = r->pos;

		rc = ap_ring_read(r, &p, &len);
		if (rc == -EAGAIN) {
			rc = 0;
			break;
		}
		if (rc < 0)
			break;
		if (len > max_len) {
			/* Unread: the next read (a pad before it, if any, too)
			 * finds it again. */
			r->pos = at;
			st->held = 1;
			break;
		}
		n++;
		/* len was read once and checked by the ring (<= max payload);
		 * the bytes may still change under us, so parse the copy. */
		memcpy(buf, p, len);
		if (dp_rep_parse(buf, len, &id, &tlen)) {
			st->bad_records++;
			continue;
		}
		st->replies++;
		buf[sizeof(struct ap_dp_rep) - 1] = 131; /* VERSION_MAGIC before the term */
		fn(arg, id, buf + sizeof(struct ap_dp_rep) - 1, tlen + 1);
	}
	ap_ring_release(r);
	return rc < 0 ? rc : (int)n;
}

/* ---- attach ----------------------------------------------------------------- */

/* Waits until fd has `events`, at most until deadline. 0, -ETIMEDOUT, or
 * -ECONNRESET when the peer hung up while we wait to read. */
static int wait_fd(int fd, short events, int64_t deadline)
{
	for (;;) {
		struct pollfd pfd = { .fd = fd, .events = events };
		int64_t left = deadline - dp_now_ms();
		int rc;

		if (left <= 0)
			return -ETIMEDOUT;
		rc = poll(&pfd, 1, left > 1000 ? 1000 : (int)left);
		if (rc < 0 && errno != EINTR)
			return -errno;
		if (rc > 0) {
			if (pfd.revents & events)
				return 0;
			if (pfd.revents & (POLLERR | POLLHUP | POLLNVAL))
				return -ECONNRESET;
		}
	}
}

static int write_all(int fd, const void *p, size_t n, int64_t deadline)
{
	const uint8_t *b = p;

	while (n) {
		ssize_t w = send(fd, b, n, MSG_NOSIGNAL);
		if (w > 0) {
			b += w;
			n -= (size_t)w;
			continue;
		}
		if (w < 0 && errno == EINTR)
			continue;
		if (w < 0 && errno != EAGAIN)
			return -errno;
		int rc = wait_fd(fd, POLLOUT, deadline);
		if (rc)
			return rc;
	}
	return 0;
}

/* 1 if fd is a pipe whose write honours RWF_NOWAIT (the probe rings it
 * once; EAGAIN, a full pipe, is a yes): the bell is written so, and then
 * never blocks whatever its flags. A hostile pool node could pass a file,
 * a socket or an eventfd instead (an eventfd's write blocks when its
 * O_NONBLOCK, shared with the sender, is cleared and its count full). */
int dp_is_bell_pipe(int fd)
{
	struct stat st;
	char c = 'b';
	struct iovec iov = { .iov_base = &c, .iov_len = 1 };
	if (fstat(fd, &st) || !S_ISFIFO(st.st_mode))
		return 0;
	return pwritev2(fd, &iov, 1, -1, RWF_NOWAIT) == 1 || errno == EAGAIN;
}

/* Reads the ack, and the fd that may ride on it (attach, step 4). */
static int read_ack(int fd, struct ap_seg_ack *ack, int *bell_fd, int64_t deadline)
{
	uint8_t *b = (uint8_t *)ack;
	size_t n = sizeof *ack;

	while (n) {
		ssize_t r = ap_ring_recv_some(fd, b, n, bell_fd);
		if (r > 0) {
			b += r;
			n -= (size_t)r;
			continue;
		}
		if (r == 0)
			return -ECONNRESET;
		if (r != -EAGAIN)
			return (int)r;
		int rc = wait_fd(fd, POLLIN, deadline);
		if (rc)
			return rc;
	}
	return 0;
}

static int do_connect(int fd, const void *name, size_t name_len, int64_t deadline)
{
	struct sockaddr_un sa = { .sun_family = AF_UNIX };
	socklen_t alen = (socklen_t)(offsetof(struct sockaddr_un, sun_path) + name_len);
	struct timespec pause = { 0, 2 * 1000 * 1000 };
	int err;
	socklen_t elen = sizeof err;

	memcpy(sa.sun_path, name, name_len);
	for (;;) {
		if (connect(fd, (struct sockaddr *)&sa, alen) == 0)
			return 0;
		if (errno == EINTR)
			continue;
		if (errno == EINPROGRESS)
			break;
		/* A full backlog: the listener is busy, try again shortly. */
		if (errno != EAGAIN)
			return -errno;
		if (dp_now_ms() >= deadline)
			return -ETIMEDOUT;
		nanosleep(&pause, NULL);
	}
	int rc = wait_fd(fd, POLLOUT, deadline);
	if (rc)
		return rc;
	if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &elen))
		return -errno;
	return err ? -err : 0;
}

int dp_attach(const void *name, size_t name_len, const uint8_t token[AP_SEG_TOKEN_LEN], const void *node,
	      size_t node_len, int memfd, int64_t deadline_ms, int *sock, int *bell_fd)
{
	struct ap_seg_hello hello = { .magic = AP_SEG_HELLO_MAGIC, .version = AP_SEG_VERSION };
	struct ap_seg_ack ack;
	struct ucred cred;
	socklen_t clen = sizeof cred;
	int fd, rc;

	*sock = -1;
	*bell_fd = -1;
	if (name_len < 2 || name_len > sizeof(((struct sockaddr_un *)0)->sun_path) || ((const uint8_t *)name)[0] != 0 ||
	    node_len < 1 || node_len > AP_SEG_MAX_NAME || memfd < 0)
		return -EINVAL;
	fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
	if (fd < 0)
		return -errno;
	if ((rc = do_connect(fd, name, name_len, deadline_ms)))
		goto err;
	if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &clen)) {
		rc = -errno;
		goto err;
	}
	if (cred.uid != geteuid()) {
		rc = -EPERM;
		goto err;
	}
	memcpy(hello.token, token, AP_SEG_TOKEN_LEN);
	hello.name_len = (uint32_t)node_len;
	hello.os_pid = (uint32_t)getpid();
	if ((rc = write_all(fd, &hello, sizeof hello, deadline_ms)) || (rc = write_all(fd, node, node_len, deadline_ms)))
		goto err;
	for (;;) {
		rc = ap_ring_send_fd(fd, memfd);
		if (rc != -EAGAIN)
			break;
		if ((rc = wait_fd(fd, POLLOUT, deadline_ms)))
			break;
	}
	if (rc)
		goto err;
	if ((rc = read_ack(fd, &ack, bell_fd, deadline_ms)))
		goto err;
	if (ack.magic != AP_SEG_HELLO_MAGIC) {
		rc = -EPROTO;
		goto err;
	}
	if (ack.status) {
		/* A refusal is positive; a hostile status out of errno's range
		 * is just a protocol error. */
		rc = ack.status < 4096 ? (int)ack.status : -EPROTO;
		goto err;
	}
	if (*bell_fd >= 0 && !dp_is_bell_pipe(*bell_fd)) {
		rc = -EPROTO;
		goto err;
	}
	*sock = fd;
	return 0;
err:
	if (*bell_fd >= 0)
		close(*bell_fd);
	*bell_fd = -1;
	close(fd);
	return rc;
}

int dp_peer_gone(int sock)
{
	struct pollfd pfd = { .fd = sock, .events = POLLIN | POLLRDHUP };
	uint8_t junk[256];

	if (poll(&pfd, 1, 0) <= 0)
		return 0;
	if (pfd.revents & (POLLERR | POLLHUP | POLLRDHUP | POLLNVAL))
		return 1;
	for (int i = 0; i < 4; i++) {
		ssize_t r = recv(sock, junk, sizeof junk, MSG_DONTWAIT);
		if (r == 0)
			return 1;
		if (r < 0)
			return errno == EAGAIN || errno == EINTR ? 0 : 1;
	}
	return 0;
}
