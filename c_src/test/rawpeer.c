/* actor_rawpeer: a test peer that completes a real distribution handshake
 * with ei, then writes raw bytes (say, a malformed frame) and reports
 * whether the other side closed the connection.
 *
 * usage: actor_rawpeer NODE COOKIEFILE HEXBYTES  -> prints "closed" or "open"
 *        actor_rawpeer NODE COOKIEFILE HEXBYTES hold
 *            prints "sent" once the bytes are written, then keeps the
 *            connection until stdin closes ("open") or the node closes it
 *            ("closed"): for tests that look at the node meanwhile.
 */
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

int main(int argc, char **argv)
{
	int hold = argc == 5 && !strcmp(argv[4], "hold");
	if (argc != 4 && !hold) {
		fprintf(stderr, "usage: %s NODE COOKIEFILE HEXBYTES [hold]\n", argv[0]);
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

	size_t hl = strlen(argv[3]);
	if (hl % 2) {
		fprintf(stderr, "odd hex length\n");
		return 2;
	}
	unsigned char *bytes = malloc(hl / 2 + 1);
	for (size_t i = 0; i < hl / 2; i++) {
		int hi = hexval(argv[3][2 * i]), lo = hexval(argv[3][2 * i + 1]);
		if (hi < 0 || lo < 0) {
			fprintf(stderr, "bad hex\n");
			return 2;
		}
		bytes[i] = (unsigned char)(hi << 4 | lo);
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
	if (ei_connect_init(&ec, self, cookie, (unsigned)time(NULL) | 4) < 0) {
		fprintf(stderr, "ei_connect_init failed\n");
		return 2;
	}
	int fd = ei_connect_tmo(&ec, argv[1], 5000);
	if (fd < 0) {
		fprintf(stderr, "connect failed: erl_errno %d\n", erl_errno);
		return 3;
	}
	if (hl && write(fd, bytes, hl / 2) != (ssize_t)(hl / 2)) {
		printf("closed\n");
		return 0;
	}
	if (hold) {
		printf("sent\n");
		fflush(stdout);
		for (;;) {
			struct pollfd p[2] = { { .fd = fd, .events = POLLIN }, { .fd = STDIN_FILENO, .events = POLLIN } };
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
		char buf[4096];
		ssize_t r = read(fd, buf, sizeof buf);
		if (r == 0 || (r < 0 && errno != EINTR && errno != EAGAIN)) {
			printf("closed\n");
			return 0;
		}
	}
	printf("open\n");
	close(fd);
	return 0;
}
