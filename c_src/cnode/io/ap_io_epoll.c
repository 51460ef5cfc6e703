/* ap_io_epoll: the epoll backend of ap_io, for hosts where io_uring may not
 * start (container seccomp profiles, kernel.io_uring_disabled) or where
 * ACTOR_POOL_IO=epoll asks for it. Same contract as ap_io_uring.c. */
#include "ap_io_int.h"

#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

#include "ap_log.h"
#include "ap_time.h"

#define RECV_SIZE (256 * 1024)
#define MAX_EVENTS 64
#define MAX_READERS 8
#define READS_PER_EVENT 16  /* fairness: one busy peer cannot starve the rest */

/* epoll_event.data.u64: a conn pointer, the listener, or a reader id. */
enum { K_CONN = 0, K_LISTEN = 1, K_READER = 2 };

struct epoll_be {
	int epfd;
	int lfd;
	uint8_t *rbuf;
	int64_t looked_us; /* the last epoll_wait */
};

/* A loop busy with work of its own (same-host rings) asks for a look
 * without sleeping after every batch: one epoll_wait per this many
 * microseconds is enough for the sockets, and each costs a syscall of a
 * few microseconds here. */
#define BUSY_LOOK_US 50

static uint64_t key(int kind, uint64_t v) { return v << 2 | (uint64_t)kind; }

static int e_init(ap_loop *l)
{
	struct epoll_be *be = calloc(1, sizeof *be);
	if (!be)
		return -ENOMEM;
	be->epfd = epoll_create1(EPOLL_CLOEXEC);
	be->rbuf = malloc(RECV_SIZE);
	if (be->epfd < 0 || !be->rbuf) {
		int r = be->epfd < 0 ? -errno : -ENOMEM;
		if (be->epfd >= 0)
			close(be->epfd);
		free(be->rbuf);
		free(be);
		return r;
	}
	be->lfd = -1;
	l->be = be;
	return 0;
}

static void e_fini(ap_loop *l)
{
	struct epoll_be *be = l->be;
	close(be->epfd);
	free(be->rbuf);
	free(be);
}

static int ctl(struct epoll_be *be, int op, int fd, uint32_t events, uint64_t data)
{
	struct epoll_event ev = { .events = events, .data.u64 = data };
	return epoll_ctl(be->epfd, op, fd, &ev) ? -errno : 0;
}

static int e_listen(ap_loop *l, int lfd)
{
	struct epoll_be *be = l->be;
	int fl = fcntl(lfd, F_GETFL);
	if (fl < 0 || fcntl(lfd, F_SETFL, fl | O_NONBLOCK) < 0)
		return -errno;
	be->lfd = lfd;
	return ctl(be, EPOLL_CTL_ADD, lfd, EPOLLIN, key(K_LISTEN, 0));
}

static int e_add_conn(ap_loop *l, ap_io_conn *c)
{
	struct epoll_be *be = l->be;
	return ctl(be, EPOLL_CTL_ADD, c->fd, EPOLLIN | EPOLLRDHUP, (uint64_t)(uintptr_t)c);
}

static void e_start_send(ap_loop *l, ap_io_conn *c)
{
	struct epoll_be *be = l->be;
	while (c->sending && !c->closing) {
		ssize_t w = send(c->fd, c->inflight.data + c->inflight_off, c->inflight.len - c->inflight_off,
				 MSG_NOSIGNAL);
		if (w < 0 && errno == EINTR)
			continue;
		if (w < 0 && errno == EAGAIN) {
			/* Socket full: finish when it drains. */
			ctl(be, EPOLL_CTL_MOD, c->fd, EPOLLIN | EPOLLRDHUP | EPOLLOUT, (uint64_t)(uintptr_t)c);
			return;
		}
		/* ap_io_sent re-enters here for a remainder or the next
		 * batch, so the nested call does the rest. */
		ap_io_sent(l, c, w < 0 ? -errno : w);
		return;
	}
}

static void e_close(ap_loop *l, ap_io_conn *c)
{
	struct epoll_be *be = l->be;
	epoll_ctl(be->epfd, EPOLL_CTL_DEL, c->fd, NULL);
	ap_io_finished(l, c);
}

static int e_add_reader(ap_loop *l, int fd, int id)
{
	if (id < 0 || id >= MAX_READERS)
		return -EINVAL;
	return ctl(l->be, EPOLL_CTL_ADD, fd, EPOLLIN, key(K_READER, (uint64_t)id));
}

static void on_listen(ap_loop *l, struct epoll_be *be)
{
	for (;;) {
		int fd = accept4(be->lfd, NULL, NULL, SOCK_CLOEXEC);
		if (fd >= 0) {
			ap_io_accepted(l, fd);
			continue;
		}
		if (errno == EAGAIN)
			return;
		/* Level-triggered: a listener still readable would wake us
		 * at once, so ap_io takes it out of the set for a pause. */
		if (ap_io_accept_error(l, errno, 1))
			return;
	}
}

static void e_accept_pause(ap_loop *l)
{
	struct epoll_be *be = l->be;
	epoll_ctl(be->epfd, EPOLL_CTL_DEL, be->lfd, NULL);
}

static void e_accept_resume(ap_loop *l)
{
	struct epoll_be *be = l->be;
	int r = ctl(be, EPOLL_CTL_ADD, be->lfd, EPOLLIN, key(K_LISTEN, 0));
	if (r)
		ap_log(AP_LOG_ERROR, "cannot watch the listener again: %s", strerror(-r));
}

static void on_conn(ap_loop *l, struct epoll_be *be, ap_io_conn *c, uint32_t ev)
{
	if (ev & EPOLLOUT) {
		ctl(be, EPOLL_CTL_MOD, c->fd, EPOLLIN | EPOLLRDHUP, (uint64_t)(uintptr_t)c);
		e_start_send(l, c);
	}
	if (ev & (EPOLLIN | EPOLLRDHUP | EPOLLHUP | EPOLLERR)) {
		for (int i = 0; i < READS_PER_EVENT && !c->closing; i++) {
			ssize_t n = recv(c->fd, be->rbuf, RECV_SIZE, 0);
			if (n > 0) {
				ap_io_data(l, c, be->rbuf, (size_t)n);
				if ((size_t)n < RECV_SIZE)
					break; /* drained: level-triggered epoll tells us when more comes */
				continue;
			}
			if (n < 0 && (errno == EAGAIN || errno == EINTR))
				break;
			ap_loop_close(l, c, n == 0 ? 0 : errno);
		}
	}
}

static int e_wait(ap_loop *l, int timeout_ms)
{
	struct epoll_be *be = l->be;
	struct epoll_event evs[MAX_EVENTS];
	if (ap_io_coalesce_check(l) && timeout_ms != 0)
		ap_io_pause();
	int64_t now = ap_mono_us();
	if (timeout_ms == 0 && now - be->looked_us < BUSY_LOOK_US && !l->look_now)
		return 0;
	l->look_now = 0;
	int n = epoll_wait(be->epfd, evs, MAX_EVENTS, timeout_ms);
	be->looked_us = timeout_ms == 0 ? now : ap_mono_us();
	if (n < 0)
		return errno == EINTR ? 0 : -errno;
	for (int i = 0; i < n; i++) {
		uint64_t k = evs[i].data.u64;
		switch (k & 3) {
		case K_CONN: {
			ap_io_conn *c = (ap_io_conn *)(uintptr_t)k;
			if (!c->closing)
				on_conn(l, be, c, evs[i].events);
			break;
		}
		case K_LISTEN:
			on_listen(l, be);
			break;
		case K_READER:
			l->cbs.on_readable(l->arg, (int)(k >> 2));
			break;
		}
	}
	return 0;
}

const struct ap_io_ops ap_io_epoll_ops = {
	.name = "epoll",
	.init = e_init,
	.fini = e_fini,
	.listen = e_listen,
	.add_conn = e_add_conn,
	.start_send = e_start_send,
	.close = e_close,
	.add_reader = e_add_reader,
	.wait = e_wait,
	.accept_pause = e_accept_pause,
	.accept_resume = e_accept_resume,
};
