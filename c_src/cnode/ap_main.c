/* ap_main: settings and start-up shared by every C node. */
#include "ap_main.h"

#include <arpa/inet.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <sys/prctl.h>
#include <unistd.h>

#include "ap_log.h"
#include "ap_setup.h"
#include "ap_term.h"

#define MAX_ARGS 64
#define MAX_CONFIG (1 << 20)
/* Upper bounds of the handshake settings (actor_cnode checks the same). */
#define MAX_HANDSHAKE_MS 3600000LL
#define MAX_HANDSHAKES 65536LL

struct settings {
	char node[MAXNODELEN + 1];
	char cookie[EI_MAX_COOKIE_SIZE + 1];
	char parent[MAXNODELEN + 1];
	char io[16];
	char listen[INET_ADDRSTRLEN];
	long long creation, max_frame, idle_ms;
	long long hs_ms, max_hs, max_hs_src;  /* 0: the runtime's default */
	int argc;
	char *argv[MAX_ARGS];
};

static int read_full(int fd, void *p, size_t n)
{
	char *c = p;
	while (n) {
		ssize_t r = read(fd, c, n);
		if (r < 0 && errno == EINTR)
			continue;
		if (r <= 0)
			return -1;
		c += r;
		n -= (size_t)r;
	}
	return 0;
}

static int dec_string(const char *b, int *i, char *out, size_t cap)
{
	int type, size;
	long len;
	if (ei_get_type(b, i, &type, &size) || type != ERL_BINARY_EXT || (size_t)size >= cap)
		return -1;
	if (ei_decode_binary(b, i, out, &len))
		return -1;
	/* C would read only up to a NUL: "127.0.0.1\0x" is no address. */
	if (memchr(out, 0, (size_t)len))
		return -1;
	out[len] = 0;
	return 0;
}

/* The config packet: term_to_binary(#{node => Bin, cookie => Bin, ...}). */
static int read_port_config(struct settings *s)
{
	uint8_t hdr[4];
	if (read_full(STDIN_FILENO, hdr, 4))
		return -1;
	uint32_t len = ap_get32be(hdr);
	if (len == 0 || len > MAX_CONFIG)
		return -1;
	char *b = malloc(len);
	if (!b || read_full(STDIN_FILENO, b, len) || ap_term_validate_msg(b, len)) {
		free(b);
		return -1;
	}
	int i = 1, arity, r = 0;
	if (ei_decode_map_header(b, &i, &arity))
		r = -1;
	for (int k = 0; r == 0 && k < arity; k++) {
		char key[MAXATOMLEN_UTF8];
		if (ei_decode_atom(b, &i, key)) {
			r = -1;
			break;
		}
		if (!strcmp(key, "node"))
			r = dec_string(b, &i, s->node, sizeof s->node);
		else if (!strcmp(key, "cookie"))
			r = dec_string(b, &i, s->cookie, sizeof s->cookie);
		else if (!strcmp(key, "parent"))
			r = dec_string(b, &i, s->parent, sizeof s->parent);
		else if (!strcmp(key, "io"))
			r = dec_string(b, &i, s->io, sizeof s->io);
		else if (!strcmp(key, "creation"))
			r = ei_decode_longlong(b, &i, &s->creation);
		else if (!strcmp(key, "max_frame"))
			r = ei_decode_longlong(b, &i, &s->max_frame);
		else if (!strcmp(key, "idle_timeout_ms"))
			r = ei_decode_longlong(b, &i, &s->idle_ms);
		else if (!strcmp(key, "listen"))
			r = dec_string(b, &i, s->listen, sizeof s->listen);
		else if (!strcmp(key, "handshake_timeout_ms"))
			r = ei_decode_longlong(b, &i, &s->hs_ms);
		else if (!strcmp(key, "max_handshakes"))
			r = ei_decode_longlong(b, &i, &s->max_hs);
		else if (!strcmp(key, "max_handshakes_per_source"))
			r = ei_decode_longlong(b, &i, &s->max_hs_src);
		else if (!strcmp(key, "args")) {
			int n, type, size;
			if (ei_get_type(b, &i, &type, &size) == 0 && type == ERL_NIL_EXT) {
				r = ap_term_skip(b, len, &i);
				continue;
			}
			if (ei_decode_list_header(b, &i, &n) || n > MAX_ARGS) {
				r = -1;
				break;
			}
			for (int a = 0; a < n && r == 0; a++) {
				if (ei_get_type(b, &i, &type, &size) || type != ERL_BINARY_EXT || size > 4096) {
					r = -1;
					break;
				}
				s->argv[a] = calloc(1, (size_t)size + 1);
				r = s->argv[a] ? dec_string(b, &i, s->argv[a], (size_t)size + 1) : -1;
				s->argc = a + 1;
			}
			if (r == 0 && n > 0)
				r = ap_term_skip(b, len, &i); /* the list tail */
		} else {
			r = ap_term_skip(b, len, &i); /* unknown keys: newer owners */
		}
	}
	free(b);
	return r ? -1 : 0;
}

static int read_cookie_file(const char *path, char *out, size_t cap)
{
	FILE *f = fopen(path, "r");
	if (!f)
		return -1;
	size_t n = fread(out, 1, cap - 1, f);
	fclose(f);
	out[n] = 0;
	out[strcspn(out, "\r\n")] = 0; /* a trailing newline is not part of it */
	return out[0] ? 0 : -1;
}

static void usage(const char *prog)
{
	fprintf(stderr,
		"usage: %s --port\n"
		"       %s --name alive@host --cookie-file FILE [--connect node@host]\n"
		"          [--io auto|uring|epoll] [--max-frame BYTES] [--idle-timeout-ms MS]\n"
		"          [--listen IPV4] [--handshake-timeout-ms MS] [--max-handshakes N]\n"
		"          [--max-handshakes-per-source N]\n"
		"          [--SERVICE-OPTION VALUE]... [-- ARGS...]\n",
		prog, prog);
}

/* A whole decimal number in 1..max, or -1. */
static long long parse_pos(const char *v, long long max)
{
	char *end;
	errno = 0;
	long long x = strtoll(v, &end, 10);
	if (errno || end == v || *end || x < 1 || x > max)
		return -1;
	return x;
}

/* The handshake settings, from the port or the command line: 0 (unset) or
 * in range, and a listen address we can bind. */
static int check_settings(const struct settings *s)
{
	if (s->hs_ms < 0 || s->hs_ms > MAX_HANDSHAKE_MS || s->max_hs < 0 || s->max_hs > MAX_HANDSHAKES ||
	    s->max_hs_src < 0 || s->max_hs_src > MAX_HANDSHAKES)
		return -1;
	return ap_listen_addr_ok(s->listen);
}

static int parse_cli(int argc, char **argv, struct settings *s)
{
	for (int i = 1; i < argc; i++) {
		const char *a = argv[i];
		const char *v = i + 1 < argc ? argv[i + 1] : NULL;
		if (!strcmp(a, "--")) {
			for (i++; i < argc && s->argc < MAX_ARGS; i++)
				s->argv[s->argc++] = strdup(argv[i]);
			break;
		}
		if (!strncmp(a, "--no-", 5) && s->argc < MAX_ARGS) {
			/* A service's switch without a value (--no-fast-path). */
			s->argv[s->argc++] = strdup(a);
			continue;
		}
		if (!v)
			return -1;
		if (!strcmp(a, "--name"))
			snprintf(s->node, sizeof s->node, "%s", v);
		else if (!strcmp(a, "--cookie-file")) {
			if (read_cookie_file(v, s->cookie, sizeof s->cookie)) {
				fprintf(stderr, "cannot read a cookie from %s\n", v);
				return -1;
			}
		} else if (!strcmp(a, "--connect"))
			snprintf(s->parent, sizeof s->parent, "%s", v);
		else if (!strcmp(a, "--io"))
			snprintf(s->io, sizeof s->io, "%s", v);
		else if (!strcmp(a, "--max-frame"))
			s->max_frame = atoll(v);
		else if (!strcmp(a, "--idle-timeout-ms"))
			s->idle_ms = atoll(v);
		else if (!strcmp(a, "--listen")) {
			if (strlen(v) >= sizeof s->listen || ap_listen_addr_ok(v)) {
				fprintf(stderr, "bad --listen '%s': want a dotted IPv4 address\n", v);
				return -1;
			}
			snprintf(s->listen, sizeof s->listen, "%s", v);
		} else if (!strcmp(a, "--handshake-timeout-ms") || !strcmp(a, "--max-handshakes") ||
			   !strcmp(a, "--max-handshakes-per-source")) {
			int ms = !strcmp(a, "--handshake-timeout-ms");
			long long x = parse_pos(v, ms ? MAX_HANDSHAKE_MS : MAX_HANDSHAKES);
			if (x < 0) {
				fprintf(stderr, "bad %s '%s': want 1..%lld\n", a, v, ms ? MAX_HANDSHAKE_MS : MAX_HANDSHAKES);
				return -1;
			}
			*(ms ? &s->hs_ms : !strcmp(a, "--max-handshakes") ? &s->max_hs : &s->max_hs_src) = x;
		}
		else if (!strncmp(a, "--", 2) && s->argc + 2 <= MAX_ARGS) {
			/* A service option (say --pool spec): the service reads it. */
			s->argv[s->argc++] = strdup(a);
			s->argv[s->argc++] = strdup(v);
		} else
			return -1;
		i++;
	}
	return s->node[0] && s->cookie[0] ? 0 : -1;
}

int ap_cnode_main(int argc, char **argv, const char *service, ap_service_init init)
{
	struct settings s = { 0 };
	int port_mode = argc == 2 && !strcmp(argv[1], "--port");
	/* Not dumpable, before the cookie is read: a process of our uid (a
	 * plugin's worker process among them) can then open neither our
	 * memory (the cookie) nor our fds (every data-plane segment) in
	 * /proc, nor ptrace us. Its cost: no core dumps. */
	prctl(PR_SET_DUMPABLE, 0, 0, 0, 0);
	ei_init();
	if (port_mode) {
		ap_log_set_port_fd(STDOUT_FILENO);
		if (read_port_config(&s) || !s.node[0] || !s.cookie[0] || check_settings(&s)) {
			ap_log(AP_LOG_ERROR, "%s: bad or missing configuration packet", service);
			return 2;
		}
	} else if (parse_cli(argc, argv, &s)) {
		usage(argv[0]);
		return 2;
	}
	if (s.creation <= 0 || s.creation > 0xFFFFFFFFLL) {
		/* Standalone: a fresh creation per start from the clock. */
		struct timespec ts;
		clock_gettime(CLOCK_REALTIME, &ts);
		s.creation = (long long)((ts.tv_sec ^ ts.tv_nsec ^ getpid()) & 0x7FFFFFFF) | 4;
	}
	if (s.max_frame < 0 || s.max_frame > 0xFFFFFFFFLL)
		s.max_frame = 0;
	ap_node_cfg cfg = {
		.node = s.node,
		.cookie = s.cookie,
		.creation = (unsigned)s.creation,
		.parent = s.parent[0] ? s.parent : NULL,
		.max_frame = (uint32_t)s.max_frame,
		.idle_timeout_ms = (int)s.idle_ms,
		.io = s.io[0] && strcmp(s.io, "auto") ? s.io : NULL,
		.port_mode = port_mode,
		.listen = s.listen[0] ? s.listen : NULL,
		.handshake_timeout_ms = (int)s.hs_ms,
		.max_handshakes = (int)s.max_hs,
		.max_handshakes_per_source = (int)s.max_hs_src,
	};
	ap_node *n = ap_node_new(&cfg);
	int rc = 1;
	if (n && init(n, s.argc, s.argv) == 0)
		rc = ap_node_run(n) == 0 ? 0 : 1;
	ap_node_free(n);
	for (int i = 0; i < s.argc; i++)
		free(s.argv[i]);
	return rc;
}
