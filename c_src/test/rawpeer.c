/* actor_rawpeer: a test peer that completes a real distribution handshake
 * with ei, then writes raw bytes (say, a malformed frame) and reports
 * whether the other side closed the connection.
 *
 * usage: actor_rawpeer [-N SELF@HOST] [-m MARKERHEX] [-r COUNT] [-n] NODE COOKIEFILE HEXBYTES|@HEXFILE [hold]
 *   prints "closed" or "open"; with -m, "closed|open BYTES SEEN": the bytes
 *   it read back (ticks and replies) and whether MARKER was among them.
 *   -N sets this peer's own node name, so frames can carry pids of it and
 *   replies to them come back here.
 *   With "hold": prints "sent" once the bytes are written, then keeps the
 *   connection until stdin closes ("open") or the node closes it
 *   ("closed"): for tests that look at the node meanwhile.
 *   -r writes the bytes COUNT times (more than a command line holds).
 *   -n (with hold): never read from the node, a peer that stopped reading;
 *   only stdin closing ends it ("open").
 */
#include <arpa/inet.h>
#include <ei.h>
#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static int hexval(char c)
{
	if (c >= '0' && c <= '9') return c - '0';
	if (c >= 'a' && c <= 'f') return c - 'a' + 10;
	if (c >= 'A' && c <= 'F') return c - 'A' + 10;
	return -1;
}

/* Decodes hex into a fresh buffer; its length in *n. NULL if not hex. */
static unsigned char *unhex(const char *h, size_t *n)
{
	size_t hl = strlen(h);
	if (hl % 2)
		return NULL;
	unsigned char *b = malloc(hl / 2 + 1);
	for (size_t i = 0; b && i < hl / 2; i++) {
		int hi = hexval(h[2 * i]), lo = hexval(h[2 * i + 1]);
		if (hi < 0 || lo < 0) {
			free(b);
			return NULL;
		}
		b[i] = (unsigned char)(hi << 4 | lo);
	}
	*n = hl / 2;
	return b;
}

/* HEXBYTES as "@PATH": the hex is read from that file (at most this
 * much), for frames larger than one argument may be. */
#define HEXFILE_MAX (64u << 20)

static char *read_hexfile(const char *path)
{
	FILE *f = fopen(path, "r");
	if (!f)
		return NULL;
	char *h = malloc(HEXFILE_MAX + 1);
	size_t n = h ? fread(h, 1, HEXFILE_MAX, f) : 0;
	fclose(f);
	if (!h)
		return NULL;
	h[n] = 0;
	h[strcspn(h, "\r\n")] = 0;
	return h;
}

/* What is read back is kept up to this much for the marker search. */
#define KEEP_MAX (16u << 20)

int main(int argc, char **argv)
{
	const char *selfname = NULL;
	unsigned char *marker = NULL;
	size_t marker_len = 0;
	int opt, noread = 0;
	long repeat = 1;
	while ((opt = getopt(argc, argv, "N:m:r:n")) != -1) {
		if (opt == 'N') {
			selfname = optarg;
		} else if (opt == 'r' && (repeat = atol(optarg)) > 0) {
			continue;
		} else if (opt == 'n') {
			noread = 1;
		} else if (opt == 'm' && (marker = unhex(optarg, &marker_len)) && marker_len > 0) {
			continue;
		} else {
			fprintf(stderr, "bad option\n");
			return 2;
		}
	}
	argc -= optind - 1;
	argv += optind - 1;
	int hold = argc == 5 && !strcmp(argv[4], "hold");
	if (argc != 4 && !hold) {
		fprintf(stderr, "usage: %s [-N SELF@HOST] [-m MARKERHEX] NODE COOKIEFILE HEXBYTES [hold]\n", argv[0]);
		return 2;
	}
	char cookie[512] = { 0 };
	FILE *f = fopen(argv[2], "r");
	if (!f || !fgets(cookie, sizeof cookie, f)) {
		fprintf(stderr, "cannot read cookie\n");
		return 2;
	}
	fclose(f);
	cookie[strcspn(cookie, "\r\n")] = 0;

	size_t nbytes;
	char *hexfile = argv[3][0] == '@' ? read_hexfile(argv[3] + 1) : NULL;
	unsigned char *bytes = unhex(hexfile ? hexfile : argv[3], &nbytes);
	free(hexfile);
	if (!bytes) {
		fprintf(stderr, "bad hex\n");
		return 2;
	}

	const char *at = strchr(argv[1], '@');
	if (!at) {
		fprintf(stderr, "bad node name\n");
		return 2;
	}
	char self[300];
	snprintf(self, sizeof self, "rawpeer%d", (int)getpid());
	ei_init();
	ei_cnode ec;
	int ir;
	if (selfname) {
		const char *sat = strchr(selfname, '@');
		char alive[256];
		struct in_addr lo;
		if (!sat || (size_t)(sat - selfname) >= sizeof alive) {
			fprintf(stderr, "bad -N\n");
			return 2;
		}
		memcpy(alive, selfname, (size_t)(sat - selfname));
		alive[sat - selfname] = 0;
		inet_aton("127.0.0.1", &lo);
		ir = ei_connect_xinit(&ec, sat + 1, alive, selfname, &lo, cookie, (unsigned)time(NULL) | 4);
	} else {
		ir = ei_connect_init(&ec, self, cookie, (unsigned)time(NULL) | 4);
	}
	if (ir < 0) {
		fprintf(stderr, "ei_connect_init failed\n");
		return 2;
	}
	int fd = ei_connect_tmo(&ec, argv[1], 5000);
	if (fd < 0) {
		fprintf(stderr, "connect failed: erl_errno %d\n", erl_errno);
		return 3;
	}
	unsigned char *kept = marker ? malloc(KEEP_MAX) : NULL;
	size_t got = 0;
	const char *state = "open";
	for (long k = 0; k < repeat && nbytes; k++)
		for (size_t off = 0; off < nbytes;) {
			ssize_t w = write(fd, bytes + off, nbytes - off);
			if (w < 0 && errno == EINTR)
				continue;
			if (w <= 0) {
				state = "closed";
				goto out;
			}
			off += (size_t)w;
		}
	if (hold) {
		printf("sent\n");
		fflush(stdout);
		for (;;) {
			struct pollfd p[2] = { { .fd = noread ? -1 : fd, .events = POLLIN },
					       { .fd = STDIN_FILENO, .events = POLLIN } };
			if (poll(p, 2, -1) < 0 && errno != EINTR)
				return 3;
			char buf[4096];
			if (p[0].revents) {
				ssize_t r = read(fd, buf, sizeof buf);
				if (r == 0 || (r < 0 && errno != EINTR && errno != EAGAIN)) {
					printf("closed\n");
					return 0;
				}
			}
			if (p[1].revents && read(STDIN_FILENO, buf, sizeof buf) <= 0) {
				printf("open\n");
				close(fd);
				return 0;
			}
		}
	}
	/* Read until EOF (closed) or 5 s of no EOF (open). Ticks may arrive. */
	struct timespec t0, t;
	clock_gettime(CLOCK_MONOTONIC, &t0);
	for (;;) {
		clock_gettime(CLOCK_MONOTONIC, &t);
		long left = 5000 - ((t.tv_sec - t0.tv_sec) * 1000 + (t.tv_nsec - t0.tv_nsec) / 1000000);
		if (left <= 0)
			break;
		struct pollfd p = { .fd = fd, .events = POLLIN };
		if (poll(&p, 1, (int)left) <= 0)
			continue;
		char buf[65536];
		ssize_t r = read(fd, buf, sizeof buf);
		if (r == 0 || (r < 0 && errno != EINTR && errno != EAGAIN)) {
			state = "closed";
			break;
		}
		if (r > 0) {
			if (kept && got < KEEP_MAX)
				memcpy(kept + got, buf, (size_t)r < KEEP_MAX - got ? (size_t)r : KEEP_MAX - got);
			got += (size_t)r;
		}
	}
out:
	if (marker) {
		size_t kn = got < KEEP_MAX ? got : KEEP_MAX;
		int seen = kept && memmem(kept, kn, marker, marker_len) != NULL;
		printf("%s %zu %d\n", state, got, seen);
	} else {
		printf("%s\n", state);
	}
	close(fd);
	free(kept);
	free(marker);
	free(bytes);
	return 0;
}
