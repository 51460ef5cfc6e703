/* ap_ring_fd: passing a segment's memfd to the peer over a connected
 * AF_UNIX socket (SCM_RIGHTS), the only way the NIF side attaches (see
 * "Segments" in ap_ring.h). */
#include "ap_ring.h"

#include <errno.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

/* One sendmsg of len bytes with fd as SCM_RIGHTS: bytes sent or -errno. */
static ssize_t send_fd_msg(int sock, const void *buf, size_t len, int fd, int flags)
{
	struct iovec iov = { .iov_base = (void *)buf, .iov_len = len };
	union {
		struct cmsghdr h;
		char buf[CMSG_SPACE(sizeof(int))];
	} u;
	struct msghdr msg = { .msg_iov = &iov, .msg_iovlen = 1, .msg_control = u.buf, .msg_controllen = sizeof u.buf };
	struct cmsghdr *c;
	ssize_t n;

	if (sock < 0 || fd < 0)
		return -EBADF;
	memset(&u, 0, sizeof u);
	c = CMSG_FIRSTHDR(&msg);
	c->cmsg_level = SOL_SOCKET;
	c->cmsg_type = SCM_RIGHTS;
	c->cmsg_len = CMSG_LEN(sizeof(int));
	memcpy(CMSG_DATA(c), &fd, sizeof fd);
	do
		n = sendmsg(sock, &msg, flags);
	while (n < 0 && errno == EINTR);
	return n < 0 ? -errno : n;
}

int ap_ring_send_fd(int sock, int fd)
{
	char byte = 'R';
	ssize_t n = send_fd_msg(sock, &byte, 1, fd, MSG_NOSIGNAL);
	return n == 1 ? 0 : n < 0 ? (int)n : -EIO;
}

/* Every fd a message carried: the first into *keep when keep is given
 * and *keep is -1, every other one closed (what a hostile sender adds
 * beyond the one we asked for must not leak into our process). */
static void take_fds(struct msghdr *msg, int *keep)
{
	for (struct cmsghdr *c = CMSG_FIRSTHDR(msg); c; c = CMSG_NXTHDR(msg, c)) {
		if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS || c->cmsg_len < CMSG_LEN(0))
			continue;
		size_t n = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
		for (size_t i = 0; i < n; i++) {
			int fd;
			memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof fd);
			if (keep && *keep < 0)
				*keep = fd;
			else
				close(fd);
		}
	}
}

static void close_all(struct msghdr *msg) { take_fds(msg, NULL); }

int ap_ring_recv_fd(int sock, int *fd)
{
	char byte;
	struct iovec iov = { .iov_base = &byte, .iov_len = 1 };
	/* Room for a few: a sender that passes more is detected and its fds
	 * closed, instead of the kernel truncating (and leaking nothing we
	 * could see). */
	union {
		struct cmsghdr h;
		char buf[CMSG_SPACE(4 * sizeof(int))];
	} u;
	struct msghdr msg = { .msg_iov = &iov, .msg_iovlen = 1, .msg_control = u.buf, .msg_controllen = sizeof u.buf };
	struct cmsghdr *c;
	ssize_t n;

	*fd = -1;
	if (sock < 0)
		return -EBADF;
	do
		n = recvmsg(sock, &msg, MSG_CMSG_CLOEXEC);
	while (n < 0 && errno == EINTR);
	if (n < 0)
		return -errno;
	if (n == 0) {
		close_all(&msg);
		return -ECONNRESET;
	}
	c = CMSG_FIRSTHDR(&msg);
	if ((msg.msg_flags & MSG_CTRUNC) || !c || c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS ||
	    c->cmsg_len != CMSG_LEN(sizeof(int)) || CMSG_NXTHDR(&msg, c)) {
		close_all(&msg);
		return -EPROTO;
	}
	memcpy(fd, CMSG_DATA(c), sizeof *fd);
	return 0;
}

int ap_ring_send_with_fd(int sock, const void *buf, size_t len, int fd)
{
	ssize_t n = send_fd_msg(sock, buf, len, fd, MSG_NOSIGNAL | MSG_DONTWAIT);
	return n == (ssize_t)len ? 0 : n < 0 ? (int)n : -EAGAIN;
}

ssize_t ap_ring_recv_some(int sock, void *buf, size_t len, int *fd)
{
	struct iovec iov = { .iov_base = buf, .iov_len = len };
	union {
		struct cmsghdr h;
		char buf[CMSG_SPACE(4 * sizeof(int))];
	} u;
	struct msghdr msg = { .msg_iov = &iov, .msg_iovlen = 1, .msg_control = u.buf, .msg_controllen = sizeof u.buf };
	ssize_t n;

	do
		n = recvmsg(sock, &msg, MSG_CMSG_CLOEXEC);
	while (n < 0 && errno == EINTR);
	if (n < 0)
		return -errno;
	take_fds(&msg, fd);
	return n;
}
