/* ap_log: stderr or port-packet logging, safe from any thread, rate-limited
 * per message kind. */
#include "ap_log.h"

#include <ei.h>
#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "ap_time.h"

/* Kinds are format strings, so a handful per node; a format that finds no
 * free slot shares the last one with the others that did not. */
#define KINDS 128 /* power of two */
#define MILLI 1000 /* tokens are kept in thousandths of a line */

struct kind {
	const char *fmt;     /* the key; NULL while the slot is free */
	int lvl;             /* level of the last suppressed line */
	int64_t at_ms;       /* last refill */
	int64_t tokens;      /* thousandths of a line */
	uint64_t suppressed; /* dropped since the last line of this kind */
};

static int port_fd = -1;
static enum ap_log_level max_level = AP_LOG_INFO;
static pthread_mutex_t log_mu = PTHREAD_MUTEX_INITIALIZER;

/* Under log_mu. */
static struct kind kinds[KINDS + 1];
static unsigned burst = AP_LOG_BURST, per_sec = AP_LOG_PER_SEC;
static int64_t (*clock_ms)(void);
/* Some kind holds a count to report: lets ap_log_flush skip the lock. */
static atomic_int pending;

static const char *const level_names[] = { "error", "warning", "notice", "info", "debug" };

void ap_log_set_port_fd(int fd) { port_fd = fd; }
void ap_log_set_level(enum ap_log_level max) { max_level = max; }

void ap_log_set_limits(unsigned b, unsigned ps)
{
	pthread_mutex_lock(&log_mu);
	burst = b ? b : AP_LOG_BURST;
	per_sec = b ? ps : AP_LOG_PER_SEC;
	memset(kinds, 0, sizeof kinds);
	atomic_store(&pending, 0);
	pthread_mutex_unlock(&log_mu);
}

void ap_log_set_clock(int64_t (*now_ms)(void))
{
	pthread_mutex_lock(&log_mu);
	clock_ms = now_ms;
	pthread_mutex_unlock(&log_mu);
}

static int64_t now_ms(void)
{
	return clock_ms ? clock_ms() : ap_mono_ms();
}

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

static void emit_locked(int lvl, const char *msg, int n)
{
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
}

static struct kind *find_kind(const char *fmt, int64_t now)
{
	uintptr_t h = (uintptr_t)fmt;
	h = (h ^ h >> 7 ^ h >> 17) * 0x9e3779b1u;
	for (unsigned i = 0; i < KINDS; i++) {
		struct kind *k = &kinds[(h + i) & (KINDS - 1)];
		if (k->fmt == fmt)
			return k;
		if (!k->fmt) {
			*k = (struct kind){ .fmt = fmt, .at_ms = now, .tokens = (int64_t)burst * MILLI };
			return k;
		}
	}
	struct kind *k = &kinds[KINDS];
	if (!k->fmt)
		*k = (struct kind){ .fmt = "(other messages)", .at_ms = now, .tokens = (int64_t)burst * MILLI };
	return k;
}

static void refill(struct kind *k, int64_t now)
{
	if (now > k->at_ms) {
		k->tokens += (now - k->at_ms) * (int64_t)per_sec;
		if (k->tokens > (int64_t)burst * MILLI)
			k->tokens = (int64_t)burst * MILLI;
		k->at_ms = now;
	}
}

/* The count a kind dropped, as one line at the level it dropped them. */
static void report_locked(struct kind *k)
{
	char msg[256];
	int n = snprintf(msg, sizeof msg, "suppressed %llu similar messages: %s", (unsigned long long)k->suppressed,
			 k->fmt);
	if (n < 0)
		return;
	if ((size_t)n >= sizeof msg)
		n = sizeof msg - 1;
	emit_locked(k->lvl, msg, n);
	k->suppressed = 0;
}

int ap_log(enum ap_log_level lvl, const char *fmt, ...)
{
	if (lvl > max_level)
		return 0;
	pthread_mutex_lock(&log_mu);
	int64_t now = now_ms();
	struct kind *k = find_kind(fmt, now);
	refill(k, now);
	if (k->tokens < MILLI) {
		/* Dropped before formatting: a flood costs a count, not a line. */
		k->suppressed++;
		k->lvl = (int)lvl;
		atomic_store(&pending, 1);
		pthread_mutex_unlock(&log_mu);
		return 0;
	}
	k->tokens -= MILLI;
	if (k->suppressed)
		report_locked(k);

	char msg[1024];
	va_list ap;
	va_start(ap, fmt);
	int n = vsnprintf(msg, sizeof msg, fmt, ap);
	va_end(ap);
	if (n >= 0) {
		if ((size_t)n >= sizeof msg)
			n = sizeof msg - 1;
		emit_locked((int)lvl, msg, n);
	}
	pthread_mutex_unlock(&log_mu);
	return 1;
}

void ap_log_flush(void)
{
	if (!atomic_load_explicit(&pending, memory_order_relaxed))
		return;
	pthread_mutex_lock(&log_mu);
	int64_t now = now_ms();
	int left = 0;
	atomic_store(&pending, 0);
	for (unsigned i = 0; i <= KINDS; i++) {
		struct kind *k = &kinds[i];
		if (!k->suppressed)
			continue;
		refill(k, now);
		/* The summary costs a line, so a kind still flooding gets at
		 * most its rate of lines, summaries included. */
		if (k->tokens < MILLI) {
			left = 1;
			continue;
		}
		k->tokens -= MILLI;
		report_locked(k);
	}
	if (left)
		atomic_store(&pending, 1);
	pthread_mutex_unlock(&log_mu);
}

/* Bytes of the well-formed UTF-8 sequence at s, if it is no C1 control;
 * else 0. Stops at the first byte that is no continuation (the NUL too). */
static size_t utf8_seq(const unsigned char *s)
{
	size_t n;
	unsigned min;
	if (s[0] >= 0xc2 && s[0] <= 0xdf)
		n = 2, min = 0x80;
	else if (s[0] >= 0xe0 && s[0] <= 0xef)
		n = 3, min = 0x800;
	else if (s[0] >= 0xf0 && s[0] <= 0xf4)
		n = 4, min = 0x10000;
	else
		return 0;
	unsigned cp = s[0] & (0x3fu >> (n - 1));
	for (size_t i = 1; i < n; i++) {
		if ((s[i] & 0xc0) != 0x80)
			return 0;
		cp = cp << 6 | (s[i] & 0x3fu);
	}
	if (cp < min || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff) || cp <= 0x9f)
		return 0;
	return n;
}

const char *ap_log_escape(char *out, size_t cap, const char *in)
{
	const unsigned char *s = (const unsigned char *)in;
	size_t o = 0;
	while (*s) {
		size_t n = *s >= 0x80 ? utf8_seq(s) : (*s >= 0x20 && *s < 0x7f && *s != '\\' && *s != '\'');
		/* Room for this, then "..." and the NUL. */
		if (o + (n ? n : 4) + 4 > cap) {
			memcpy(out + o, "...", 3);
			o += 3;
			break;
		}
		if (n) {
			memcpy(out + o, s, n);
			s += n;
			o += n;
		} else {
			snprintf(out + o, 5, "\\x%02x", *s++);
			o += 4;
		}
	}
	out[o] = 0;
	return out;
}
