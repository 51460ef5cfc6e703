/* ap_io: backend choice, the flush list and connection teardown, shared by
 * both backends. */
#include "ap_io_int.h"

#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "ap_log.h"

ap_loop *ap_loop_new(const char *want, const ap_io_cbs *cbs, void *arg)
{
	ap_loop *l = calloc(1, sizeof *l);
	if (!l)
		return NULL;
	l->cbs = *cbs;
	l->arg = arg;
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
	free(l);
}

const char *ap_loop_backend(const ap_loop *l) { return l->ops->name; }

int ap_loop_listen(ap_loop *l, int lfd) { return l->ops->listen(l, lfd); }

int ap_loop_add_reader(ap_loop *l, int fd, int id) { return l->ops->add_reader(l, fd, id); }

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

static int64_t now_us(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (int64_t)ts.tv_sec * 1000000 + ts.tv_nsec / 1000;
}

int ap_io_coalesce_check(ap_loop *l)
{
	int64_t t = now_us();
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

int ap_loop_run_once(ap_loop *l, int timeout_ms)
{
	while (l->dirty) {
		ap_io_conn *c = l->dirty;
		l->dirty = c->next_dirty;
		c->dirty = 0;
		start_send(l, c);
	}
	/* Something closed while flushing: report it before sleeping. */
	int r = l->ops->wait(l, l->closed ? 0 : timeout_ms);
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
