/* ap_log: stderr or port-packet logging, safe from any thread. */
#include "ap_log.h"

#include <ei.h>
#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

static int port_fd = -1;
static enum ap_log_level max_level = AP_LOG_INFO;
static pthread_mutex_t log_mu = PTHREAD_MUTEX_INITIALIZER;

static const char *const level_names[] = { "error", "warning", "notice", "info", "debug" };

void ap_log_set_port_fd(int fd) { port_fd = fd; }
void ap_log_set_level(enum ap_log_level max) { max_level = max; }

static int write_all(int fd, const void *p, size_t n)
{
	const char *c = p;
	while (n) {
		ssize_t w = write(fd, c, n);
		if (w < 0) {
			if (errno == EINTR)
				continue;
			return -1;
		}
		c += w;
		n -= (size_t)w;
	}
	return 0;
}

static int write_packet_locked(const void *data, int len)
{
	unsigned char hdr[4] = { (unsigned char)(len >> 24), (unsigned char)(len >> 16),
				 (unsigned char)(len >> 8), (unsigned char)len };
	if (write_all(port_fd, hdr, 4) || write_all(port_fd, data, (size_t)len))
		return -1;
	return 0;
}

int ap_port_write_packet(const void *data, int len)
{
	if (port_fd < 0)
		return -1;
	pthread_mutex_lock(&log_mu);
	int r = write_packet_locked(data, len);
	pthread_mutex_unlock(&log_mu);
	return r;
}

void ap_log(enum ap_log_level lvl, const char *fmt, ...)
{
	if (lvl > max_level)
		return;
	char msg[1024];
	va_list ap;
	va_start(ap, fmt);
	int n = vsnprintf(msg, sizeof msg, fmt, ap);
	va_end(ap);
	if (n < 0)
		return;
	if ((size_t)n >= sizeof msg)
		n = sizeof msg - 1;

	pthread_mutex_lock(&log_mu);
	if (port_fd >= 0) {
		ei_x_buff x;
		if (ei_x_new_with_version(&x) == 0) {
			ei_x_encode_tuple_header(&x, 3);
			ei_x_encode_atom(&x, "log");
			ei_x_encode_atom(&x, level_names[lvl]);
			ei_x_encode_binary(&x, msg, n);
			write_packet_locked(x.buff, x.index);
			ei_x_free(&x);
		}
	} else {
		fprintf(stderr, "[%s] %.*s\n", level_names[lvl], n, msg);
	}
	pthread_mutex_unlock(&log_mu);
}
