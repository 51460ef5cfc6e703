/* t_dp_peer: the pool node's end of a data-plane segment, for tests of the
 * NIF side (test_dp_core, actor_dp_peer): listen on an abstract socket,
 * take an attach as ap_seg.h describes (hello, memfd, ap_seg_parse, rings
 * attached with the ring library), write replies. No erl_nif, no ei. */
#ifndef T_DP_PEER_H
#define T_DP_PEER_H

#include <errno.h>
#include <poll.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include "ap_seg.h"

#define T_DP_MAX_RINGS 64

struct t_dp_peer {
	int sock; /* the attached BEAM's connection */
	struct ap_ring_map map;
	struct ap_seg seg;
	struct ap_ring req[T_DP_MAX_RINGS];
	struct ap_ring rep[T_DP_MAX_RINGS];
	char name[AP_SEG_MAX_NAME + 1];
};

/* Binds "\0actor_dp_test.<pid>.<random>" and listens; the name (with its
 * leading 0) in name/len. The socket, or -errno. */
static inline int t_dp_listen(char *name, size_t *len)
{
	struct sockaddr_un sa = { .sun_family = AF_UNIX };
	uint32_t rnd = 0;
	int fd, n;

	if (getrandom(&rnd, sizeof rnd, 0) != sizeof rnd)
		rnd = (uint32_t)getpid() * 2654435761u;
	n = snprintf(sa.sun_path + 1, sizeof sa.sun_path - 1, "actor_dp_test.%d.%08x", (int)getpid(), rnd);
	*len = (size_t)n + 1;
	memcpy(name, sa.sun_path, *len);
	fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
	if (fd < 0)
		return -errno;
	if (bind(fd, (struct sockaddr *)&sa, (socklen_t)(offsetof(struct sockaddr_un, sun_path) + *len)) ||
	    listen(fd, 8)) {
		int e = errno;
		close(fd);
		return -e;
	}
	return fd;
}

static inline int t_dp_read_full(int fd, void *p, size_t n)
{
	uint8_t *b = p;
	while (n) {
		ssize_t r = read(fd, b, n);
		if (r <= 0)
			return -1;
		b += r;
		n -= (size_t)r;
	}
	return 0;
}

/* Accepts one attach: checks the hello against token, receives and maps
 * the memfd, parses the segment, attaches every ring, answers `status`
 * (0: attached), with ack_fd on the ack when >= 0 (an epoll pool node's
 * bell). 0, or -1 (the connection is closed, nothing kept). */
static inline int t_dp_accept(int lfd, const uint8_t token[AP_SEG_TOKEN_LEN], uint32_t status, int ack_fd,
			      struct t_dp_peer *p)
{
	struct ap_seg_hello h;
	struct ap_seg_ack ack = { .magic = AP_SEG_HELLO_MAGIC, .status = status };
	int fd;

	memset(p, 0, sizeof *p);
	p->sock = accept4(lfd, NULL, NULL, SOCK_CLOEXEC);
	if (p->sock < 0)
		return -1;
	if (t_dp_read_full(p->sock, &h, sizeof h) || h.magic != AP_SEG_HELLO_MAGIC || h.version != AP_SEG_VERSION ||
	    h.name_len < 1 || h.name_len > AP_SEG_MAX_NAME || memcmp(h.token, token, AP_SEG_TOKEN_LEN) ||
	    t_dp_read_full(p->sock, p->name, h.name_len))
		goto err;
	if (ap_ring_recv_fd(p->sock, &fd))
		goto err;
	if (status) {
		close(fd);
		(void)!write(p->sock, &ack, sizeof ack);
		goto err;
	}
	if (ap_ring_map_open_fd(&p->map, fd, AP_SEG_HDR_SIZE)) {
		close(fd);
		goto err;
	}
	if (ap_seg_parse(&p->seg, p->map.mem, p->map.size) || p->seg.n_req > T_DP_MAX_RINGS ||
	    p->seg.n_rep > T_DP_MAX_RINGS)
		goto err_map;
	for (uint32_t i = 0; i < p->seg.n_req; i++)
		if (ap_ring_attach_consumer(&p->req[i], ap_seg_req(&p->seg, i), ap_seg_req_size(&p->seg)))
			goto err_map;
	for (uint32_t i = 0; i < p->seg.n_rep; i++)
		if (ap_ring_attach_producer(&p->rep[i], ap_seg_rep(&p->seg, i), ap_seg_rep_size(&p->seg)))
			goto err_map;
	if (ack_fd >= 0 ? ap_ring_send_with_fd(p->sock, &ack, sizeof ack, ack_fd) != 0
			: write(p->sock, &ack, sizeof ack) != (ssize_t)sizeof ack)
		goto err_map;
	return 0;
err_map:
	ap_ring_map_close(&p->map);
err:
	close(p->sock);
	p->sock = -1;
	return -1;
}

static inline void t_dp_peer_close(struct t_dp_peer *p)
{
	if (p->map.mem)
		ap_ring_map_close(&p->map);
	if (p->sock >= 0)
		close(p->sock);
	p->sock = -1;
}

/* Writes one reply record on reply ring i: the header says `hdr_len`
 * bytes of answer (== len for a valid record), then len bytes of term
 * (without 131). Published and notified. 0 or a ring error. */
static inline int t_dp_reply(struct t_dp_peer *p, uint32_t i, uint64_t ask_id, const void *term, uint32_t len,
			     uint32_t hdr_len)
{
	struct ap_dp_rep h = { .ask_id = ask_id, .len = hdr_len };
	void *w;
	int rc = ap_ring_reserve(&p->rep[i], sizeof h + len, &w);

	if (rc)
		return rc;
	memcpy(w, &h, sizeof h);
	memcpy((uint8_t *)w + sizeof h, term, len);
	rc = ap_ring_publish(&p->rep[i]);
	ap_seg_notify(p->seg.hdr, AP_SEG_BELL_REP);
	return rc < 0 ? rc : 0;
}

#endif
