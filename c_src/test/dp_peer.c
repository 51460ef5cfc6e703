/* actor_dp_peer: a pool node's end of the data plane for actor_dp_tests,
 * built on the real ring library and t_dp_peer.h: listens on an abstract
 * socket, takes attaches, reads request rings, answers asks.
 *
 * stdout: "ready <socket name hex> <token hex>" once listening, then
 * "attached <node name>", "detached", "tell <n> ring <r> fence <f> <pos>"
 * (per tell: its count, the request ring it came on, its fence or
 * "fence none"),
 * "bad <n>" (a request record that failed the checks).
 * stdin (one command a line; EOF: exit): "pause" / "resume" (stop / go on
 * reading the request rings), "mode M" (how asks are answered:
 * echo {ok, Msg}; bad_term: bytes that are no term; bad_len: a header
 * that lies about its length; twice: the answer twice; silent: none;
 * compressed: a compressed term claiming 4 GiB inflated; raw: the ask's
 * message, a binary, is the answer's term, its bytes unchecked, as a pool
 * node that checks nothing would send its plugin's reply),
 * "refuse" (the next attach gets status EPERM), "quit".
 * Asks to a name other than "echo" are answered {error, noproc}; STATS
 * with #{tells => N, asks => M}. Fences are not followed (one request
 * ring in the tests that need order). */
#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <unistd.h>

#include "dp_core.h"
#include "t_dp_peer.h"

enum mode { M_ECHO, M_BAD_TERM, M_BAD_LEN, M_TWICE, M_SILENT, M_COMPRESSED, M_RAW };

static struct t_dp_peer peer;
static int attached, paused, refuse;
static enum mode mode = M_ECHO;
static uint64_t n_tells, n_asks;
static char line[256];
static size_t line_len;

static void hex(const uint8_t *p, size_t n)
{
	for (size_t i = 0; i < n; i++)
		printf("%02x", p[i]);
}

/* The reply ring is full only when the BEAM's reply thread is stuck: wait
 * a bounded time, then drop, as the pool node does. */
static void reply(uint64_t id, const uint8_t *t, uint32_t len, uint32_t hdr_len)
{
	struct ap_ring *r = &peer.rep[id % peer.seg.n_rep];

	if (t_dp_reply(&peer, (uint32_t)(id % peer.seg.n_rep), id, t, len, hdr_len) == -EAGAIN &&
	    ap_ring_wait_space(r, sizeof(struct ap_dp_rep) + len, 0, 1000) == 0)
		t_dp_reply(&peer, (uint32_t)(id % peer.seg.n_rep), id, t, len, hdr_len);
}

static void put_be32(uint8_t *p, uint32_t v)
{
	p[0] = (uint8_t)(v >> 24);
	p[1] = (uint8_t)(v >> 16);
	p[2] = (uint8_t)(v >> 8);
	p[3] = (uint8_t)v;
}

static void handle(uint32_t ring, const uint8_t *p, size_t len)
{
	static uint8_t out[1 << 20];
	struct ap_dp_req h;
	const uint8_t *dest, *msg;
	size_t n = 0;

	if (len < sizeof h)
		goto bad;
	memcpy(&h, p, sizeof h);
	if (dp_req_len(h.dest_len, h.msg_len) != len || h.reserved)
		goto bad;
	dest = p + sizeof h;
	msg = dest + h.dest_len;
	if (h.kind == AP_DP_TELL) {
		if (h.fence_ring == AP_DP_NO_FENCE)
			printf("tell %llu ring %u fence none\n", (unsigned long long)++n_tells, ring);
		else
			printf("tell %llu ring %u fence %u %llu\n", (unsigned long long)++n_tells, ring, h.fence_ring,
			       (unsigned long long)h.fence_pos);
		return;
	}
	if (h.kind == AP_DP_STATS) {
		static const uint8_t m[] = { 116, 0, 0, 0, 2, 119, 5, 't', 'e', 'l', 'l', 's', 98, 0, 0, 0, 0,
					     119, 4, 'a', 's', 'k', 's', 98, 0, 0, 0, 0 };
		memcpy(out, m, sizeof m);
		put_be32(out + 13, (uint32_t)n_tells);
		put_be32(out + 24, (uint32_t)n_asks);
		reply(h.ask_id, out, sizeof m, sizeof m);
		return;
	}
	if (h.kind != AP_DP_ASK)
		goto bad;
	n_asks++;
	if (!(h.dest_kind == AP_DP_DEST_PID || (h.dest_len == 4 && !memcmp(dest, "echo", 4)))) {
		static const uint8_t e[] = { 104, 2, 119, 5, 'e', 'r', 'r', 'o', 'r', 119, 6, 'n', 'o', 'p', 'r', 'o', 'c' };
		reply(h.ask_id, e, sizeof e, sizeof e);
		return;
	}
	if (h.msg_len + 6 > sizeof out)
		goto bad;
	memcpy(out, (const uint8_t[]){ 104, 2, 119, 2, 'o', 'k' }, 6);
	memcpy(out + 6, msg, h.msg_len);
	n = 6 + h.msg_len;
	switch (mode) {
	case M_ECHO:
		reply(h.ask_id, out, (uint32_t)n, (uint32_t)n);
		break;
	case M_TWICE:
		reply(h.ask_id, out, (uint32_t)n, (uint32_t)n);
		reply(h.ask_id, out, (uint32_t)n, (uint32_t)n);
		break;
	case M_BAD_TERM:
		reply(h.ask_id, (const uint8_t *)"\xff\xfe\xfd", 3, 3);
		break;
	case M_BAD_LEN:
		reply(h.ask_id, out, (uint32_t)n, (uint32_t)n + 1);
		break;
	case M_SILENT:
		break;
	case M_COMPRESSED:
		reply(h.ask_id, (const uint8_t *)"\x50\xff\xff\xff\xf0\x78\x9c\x03\x00", 9, 9);
		break;
	case M_RAW:
		/* BINARY_EXT: its 5-byte head, then the bytes */
		if (h.msg_len < 5 || msg[0] != 109)
			goto bad;
		reply(h.ask_id, msg + 5, h.msg_len - 5, h.msg_len - 5);
		break;
	}
	return;
bad:
	printf("bad %zu\n", len);
}

static int req_ready(void *arg)
{
	(void)arg;
	for (uint32_t i = 0; i < peer.seg.n_req; i++)
		if (ap_ring_readable(&peer.req[i]) > 0)
			return 1;
	return 0;
}

static void drain(void)
{
	for (uint32_t i = 0; i < peer.seg.n_req; i++) {
		for (int k = 0; k < 256; k++) {
			const void *p;
			size_t len;
			int rc = ap_ring_read(&peer.req[i], &p, &len);
			if (rc == -EAGAIN)
				break;
			if (rc < 0) {
				printf("broken %u\n", i);
				break;
			}
			handle(i, p, len);
		}
		ap_ring_release(&peer.req[i]);
	}
}

static void command(const char *c)
{
	if (!strcmp(c, "pause"))
		paused = 1;
	else if (!strcmp(c, "resume"))
		paused = 0;
	else if (!strcmp(c, "refuse"))
		refuse = 1;
	else if (!strcmp(c, "quit"))
		exit(0);
	else if (!strcmp(c, "mode echo"))
		mode = M_ECHO;
	else if (!strcmp(c, "mode bad_term"))
		mode = M_BAD_TERM;
	else if (!strcmp(c, "mode bad_len"))
		mode = M_BAD_LEN;
	else if (!strcmp(c, "mode twice"))
		mode = M_TWICE;
	else if (!strcmp(c, "mode silent"))
		mode = M_SILENT;
	else if (!strcmp(c, "mode compressed"))
		mode = M_COMPRESSED;
	else if (!strcmp(c, "mode raw"))
		mode = M_RAW;
	printf("ok %s\n", c);
}

static void read_stdin(void)
{
	char b[256];
	ssize_t n = read(0, b, sizeof b);

	if (n <= 0)
		exit(0); /* the test (the port) is gone */
	for (ssize_t i = 0; i < n; i++) {
		if (b[i] == '\n') {
			line[line_len] = 0;
			command(line);
			line_len = 0;
		} else if (line_len < sizeof line - 1) {
			line[line_len++] = b[i];
		}
	}
}

int main(void)
{
	uint8_t token[AP_SEG_TOKEN_LEN];
	char name[108];
	size_t nlen;
	int lfd;

	setvbuf(stdout, NULL, _IOLBF, 0);
	if (getrandom(token, sizeof token, 0) != sizeof token)
		return 1;
	lfd = t_dp_listen(name, &nlen);
	if (lfd < 0)
		return 1;
	printf("ready ");
	hex((const uint8_t *)name, nlen);
	printf(" ");
	hex(token, sizeof token);
	printf("\n");
	for (;;) {
		struct pollfd pf[2] = { { .fd = 0, .events = POLLIN }, { .fd = attached ? peer.sock : lfd, .events = POLLIN } };

		if (attached && !paused) {
			drain();
			ap_seg_wait(peer.seg.hdr, AP_SEG_BELL_REQ, req_ready, NULL, 200, 20);
		}
		if (poll(pf, 2, attached && !paused ? 0 : 50) <= 0)
			continue;
		if (pf[0].revents)
			read_stdin();
		if (!pf[1].revents)
			continue;
		if (!attached) {
			if (t_dp_accept(lfd, token, refuse ? EPERM : 0, -1, &peer) == 0) {
				attached = 1;
				printf("attached %s\n", peer.name);
			} else {
				printf("refused\n");
			}
			refuse = 0;
			continue;
		}
		char junk[64];
		if (read(peer.sock, junk, sizeof junk) <= 0) {
			if (!paused)
				drain();
			t_dp_peer_close(&peer);
			attached = 0;
			printf("detached\n");
		}
	}
}
