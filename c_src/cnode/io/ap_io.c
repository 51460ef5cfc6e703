/* ap_io: backend choice, the flush list and connection teardown, shared by
 * both backends. */
#include "ap_io_int.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "ap_log.h"
#include "ap_time.h"

ap_loop *ap_loop_new(const char *want, const ap_io_cbs *cbs, void *arg)
{
	ap_loop *l = calloc(1, sizeof *l);
	if (!l)
		return NULL;
	l->cbs = *cbs;
	l->arg = arg;
	l->lfd = -1;
	l->reserve_fd = -1;
	int r = -ENOSYS;
	if (!want || strcmp(want, "epoll") != 0) {
		l->ops = &ap_io_uring_ops;
		r = l->ops->init(l);
		if (r)
			ap_log(AP_LOG_WARNING, "io_uring unavailable (%s), falling back to epoll", strerror(-r));
	}
	if (r) {
		l->ops = &ap_io_epoll_ops;
		r = l->ops->init(l);
	}
	if (r) {
		ap_log(AP_LOG_ERROR, "no event loop backend could start: %s", strerror(-r));
		free(l);
		return NULL;
	}
	ap_log(AP_LOG_INFO, "event loop backend: %s", l->ops->name);
	return l;
}

void ap_loop_free(ap_loop *l)
{
	if (!l)
		return;
	l->ops->fini(l);
	if (l->reserve_fd >= 0)
		close(l->reserve_fd);
	free(l);
}

const char *ap_loop_backend(const ap_loop *l) { return l->ops->name; }

int ap_loop_listen(ap_loop *l, int lfd)
{
	l->lfd = lfd;
	if (l->reserve_fd < 0)
		l->reserve_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
	return l->ops->listen(l, lfd);
}

int ap_loop_add_reader(ap_loop *l, int fd, int id) { return l->ops->add_reader(l, fd, id); }

int ap_loop_futex_supported(const ap_loop *l) { return l->ops->futex_supported && l->ops->futex_supported(l); }

int ap_loop_futex_wait(ap_loop *l, ap_io_futex *f, uint32_t *word, uint32_t expected, int timeout_ms)
{
	if (!ap_loop_futex_supported(l))
		return -ENOTSUP;
	return l->ops->futex_wait(l, f, word, expected, timeout_ms);
}

void ap_loop_futex_cancel(ap_loop *l, ap_io_futex *f)
{
	if (ap_loop_futex_supported(l))
		l->ops->futex_cancel(l, f);
}

ap_io_conn *ap_loop_add_conn(ap_loop *l, int fd, void *owner)
{
	ap_io_conn *c = calloc(1, sizeof *c);
	int fl = fcntl(fd, F_GETFL);
	if (!c || fl < 0 || fcntl(fd, F_SETFL, fl | O_NONBLOCK) < 0) {
		free(c);
		close(fd);
		return NULL;
	}
	c->fd = fd;
	c->owner = owner;
	if (l->ops->add_conn(l, c)) {
		close(fd);
		free(c);
		return NULL;
	}
	return c;
}

void ap_loop_flush(ap_loop *l, ap_io_conn *c)
{
	if (c->dirty || c->closing || c->out.len == 0)
		return;
	c->dirty = 1;
	c->next_dirty = l->dirty;
	l->dirty = c;
}

/* Hand c->out to the kernel if nothing is in flight: the buffers swap, so
 * whatever accumulated while the last send was running goes out in one. */
static void start_send(ap_loop *l, ap_io_conn *c)
{
	if (c->sending || c->closing || c->out.len == 0)
		return;
	ap_buf t = c->inflight;
	c->inflight = c->out;
	c->out = t;
	c->out.len = 0;
	c->inflight_off = 0;
	c->sending = 1;
	c->sends++;
	l->ops->start_send(l, c);
}

void ap_io_sent(ap_loop *l, ap_io_conn *c, long res)
{
	if (res < 0) {
		c->sending = 0;
		if (!c->closing)
			ap_loop_close(l, c, (int)-res);
		return;
	}
	c->inflight_off += (size_t)res;
	c->bytes_out += (uint64_t)res;
	if (c->closing) {
		c->sending = 0;
		return;
	}
	if (c->inflight_off < c->inflight.len) {
		l->ops->start_send(l, c); /* short send: the rest, still one in flight */
		return;
	}
	c->sending = 0;
	c->inflight.len = 0;
	start_send(l, c);
}

void ap_io_data(ap_loop *l, ap_io_conn *c, const uint8_t *data, size_t n)
{
	if (c->closing)
		return;
	c->bytes_in += n;
	l->win_recvs++;
	l->win_bytes += n;
	if (l->cbs.on_data(l->arg, c, data, n))
		ap_loop_close(l, c, 0);
}

void ap_loop_close(ap_loop *l, ap_io_conn *c, int err)
{
	if (c->closing)
		return;
	c->closing = 1;
	c->close_err = err;
	/* Wakes a pending receive and fails a pending send, so their
	 * completions arrive and the refs drop to zero. */
	shutdown(c->fd, SHUT_RDWR);
	l->ops->close(l, c);
}

void ap_io_finished(ap_loop *l, ap_io_conn *c)
{
	c->next_closed = l->closed;
	l->closed = c;
}

void ap_io_accepted(ap_loop *l, int fd)
{
	if (l->accept_backoff_ms) {
		ap_log(AP_LOG_NOTICE, "accepting connections again after %llu failed accepts (%llu connections shed)",
		       (unsigned long long)l->accept_failed, (unsigned long long)l->accept_shed);
		l->accept_backoff_ms = 0;
		l->accept_failed = l->accept_shed = 0;
	}
	l->cbs.on_accept(l->arg, fd);
}

/* Out of fds: free the reserve, and accept and close what waits in the
 * backlog with it, so those clients see a close now rather than a hang
 * until fds come back, and the listener stops being readable. */
static void shed_backlog(ap_loop *l)
{
	if (l->reserve_fd < 0)
		return;
	close(l->reserve_fd);
	l->reserve_fd = -1;
	for (int i = 0; i < AP_IO_ACCEPT_SHED_MAX; i++) {
		/* The uring listener blocks: accept only what is there. */
		struct pollfd p = { .fd = l->lfd, .events = POLLIN };
		if (poll(&p, 1, 0) <= 0)
			break;
		int fd = accept4(l->lfd, NULL, NULL, SOCK_CLOEXEC);
		if (fd < 0)
			break; /* another thread took the fd; nothing to lose */
		close(fd);
		l->accept_shed++;
	}
	/* If another thread took the slot, the reserve comes back at a
	 * later failure. */
	l->reserve_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
}

int ap_io_accept_error(ap_loop *l, int err, int can_shed)
{
	switch (err) {
	case EAGAIN:
	case EINTR:
	case ECONNABORTED:
	case EPROTO:
	case EPERM:
	case ENETDOWN:
	case ENOPROTOOPT:
	case EHOSTDOWN:
	case ENONET:
	case EHOSTUNREACH:
	case EOPNOTSUPP:
	case ENETUNREACH:
		/* That connection's trouble (accept(2)): take the next. */
		return 0;
	default:
		break;
	}
	l->accept_failed++;
	if ((err == EMFILE || err == ENFILE) && can_shed)
		shed_backlog(l);
	if (!l->accept_backoff_ms) {
		l->accept_backoff_ms = AP_IO_ACCEPT_PAUSE_MIN_MS;
		ap_log(AP_LOG_WARNING, "accept failed: %s; pausing accepts, backlog shed while it lasts",
		       strerror(err));
	} else if (l->accept_backoff_ms < AP_IO_ACCEPT_PAUSE_MAX_MS) {
		l->accept_backoff_ms *= 2;
		if (l->accept_backoff_ms > AP_IO_ACCEPT_PAUSE_MAX_MS)
			l->accept_backoff_ms = AP_IO_ACCEPT_PAUSE_MAX_MS;
	}
	l->accept_paused = 1;
	l->accept_resume_us = ap_mono_us() + (int64_t)l->accept_backoff_ms * 1000;
	l->ops->accept_pause(l);
	return 1;
}

int ap_io_coalesce_check(ap_loop *l)
{
	int64_t t = ap_mono_us();
	if (t - l->win_start_us < AP_IO_RATE_WINDOW_US)
		return l->coalesce;
	/* Start on many small receives; keep going while each pause still
	 * finds a good batch waiting. */
	if (!l->coalesce)
		l->coalesce = l->win_recvs >= AP_IO_COALESCE_RECVS;
	else
		l->coalesce = l->win_recvs > 0 && l->win_bytes / l->win_recvs >= AP_IO_COALESCE_KEEP_BYTES;
	l->win_recvs = 0;
	l->win_bytes = 0;
	l->win_start_us = t;
	return l->coalesce;
}

void ap_io_pause(void)
{
	struct timespec ts = { .tv_sec = 0, .tv_nsec = AP_IO_COALESCE_US * 1000L };
	nanosleep(&ts, NULL);
}

void ap_loop_look_now(ap_loop *l) { l->look_now = 1; }

int ap_loop_run_once(ap_loop *l, int timeout_ms)
{
	while (l->dirty) {
		ap_io_conn *c = l->dirty;
		l->dirty = c->next_dirty;
		c->dirty = 0;
		start_send(l, c);
	}
	if (l->accept_paused) {
		/* Wake for the end of the accept pause. */
		int64_t left = (l->accept_resume_us - ap_mono_us() + 999) / 1000;
		if (left < 0)
			left = 0;
		if (timeout_ms < 0 || timeout_ms > left)
			timeout_ms = (int)left;
	}
	/* Something closed while flushing: report it before sleeping. */
	int r = l->ops->wait(l, l->closed ? 0 : timeout_ms);
	if (l->accept_paused && ap_mono_us() >= l->accept_resume_us) {
		l->accept_paused = 0;
		l->ops->accept_resume(l);
	}
	ap_log_flush();
	while (l->closed) {
		ap_io_conn *c = l->closed;
		l->closed = c->next_closed;
		if (c->dirty) {
			ap_io_conn **pp = &l->dirty;
			while (*pp != c)
				pp = &(*pp)->next_dirty;
			*pp = c->next_dirty;
		}
		l->cbs.on_closed(l->arg, c);
		close(c->fd);
		ap_buf_free(&c->out);
		ap_buf_free(&c->inflight);
		free(c);
	}
	return r;
}
