/* dp_client: plays the BEAM's side of the same-host data plane against a
 * real pool node, with the real ring library, for
 * test/actor_pool_ring_node_tests.erl (built into c_src/build/, not priv/).
 *
 *   dp_client SOCKET_HEX TOKEN_HEX [N_REQ N_REP REQ_BYTES REP_BYTES] [--stall-after-hello]
 *
 * SOCKET_HEX is the abstract socket name as dp_info gives it (leading 0
 * byte included), TOKEN_HEX the 16-byte token. It creates a sealed memfd,
 * formats the segment, attaches (hello, fd, ack) and prints "attached" or
 * "refused ERRNO" (then exits 1). --stall-after-hello sends the hello,
 * prints "stalled", never sends the fd (a peer stuck mid-handshake) and
 * prints how the node ended it: "refused ERRNO" (its ack) or "not refused".
 *
 * Then one command per stdin line, one answer line each:
 *   tell R DEST MSG [FR FP]      a tell into request ring R (reserved, not
 *   ask R ID DEST MSG [FR FP]    yet published); answers "ok POS": ring R's
 *   stats R ID DEST              tail once it is published (for fences)
 *   raw R HEX                    any payload as one record (bad records)
 *   pub R...                     publishes those rings in that order ("ok")
 *   bell                         rings the request bell ("ok")
 *   wait N MS                    reads reply rings until N replies came or
 *                                MS passed: "reply ID HEX" each, then "done K"
 *   pingpong N GAP_US DEST MSG   N asks one at a time, each waited for, GAP_US
 *                                apart (a gap past the node's spin makes it
 *                                sleep): "pingpong OK P50_US MAX_US"
 *   poke req|rep R head|tail V   writes V into that index of that ring's
 *                                header, as a buggy or hostile BEAM would ("ok")
 *   eof MS                       "eof" if the node closed the socket within MS
 *                                (it detached the segment), else "open"
 *   quit                         exits (the socket closes: EOF for the node)
 * DEST is n:NAME (a registered name) or p:HEX (a pid, external format
 * without the 131 byte); MSG and HEX are hex; FR FP a fence (ring, pos).
 * Stdin EOF exits too.
 */
#include <errno.h>
#include <poll.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "ap_ring.h"
#include "ap_seg.h"

static struct ap_seg seg;
static struct ap_ring req[AP_SEG_MAX_REQ], rep[AP_SEG_MAX_REP];

static int unhex(const char *s, uint8_t *out, size_t cap, size_t *len)
{
	size_t n = strlen(s);
	if (n % 2 || n / 2 > cap)
		return -1;
	for (size_t i = 0; i < n / 2; i++) {
		unsigned v;
		if (sscanf(s + 2 * i, "%2x", &v) != 1)
			return -1;
		out[i] = (uint8_t)v;
	}
	*len = n / 2;
	return 0;
}

static void put_hex(const uint8_t *b, size_t n)
{
	for (size_t i = 0; i < n; i++)
		printf("%02x", b[i]);
}

static int bell_fd = -1; /* an epoll node's bell pipe, if its ack carried one */

static int read_full(int fd, void *p, size_t n, int ms)
{
	size_t got = 0;
	while (got < n) {
		struct pollfd pf = { .fd = fd, .events = POLLIN };
		if (poll(&pf, 1, ms) <= 0)
			return -1;
		ssize_t k = ap_ring_recv_some(fd, (uint8_t *)p + got, n - got, &bell_fd);
		if (k <= 0)
			return -1;
		got += (size_t)k;
	}
	return 0;
}

static uint8_t scratch[1 << 20];

/* Reserve and fill one request record; prints "ok POS". */
static int record(uint32_t r, uint8_t kind, uint64_t id, const char *dest, const char *msg_hex, uint32_t fr,
		  uint64_t fp, int quiet)
{
	static uint8_t d[2048];
	size_t dlen, mlen = 0;
	uint8_t dkind;
	if (r >= seg.n_req)
		return -1;
	if (!strncmp(dest, "n:", 2)) {
		dkind = AP_DP_DEST_NAME;
		dlen = strlen(dest + 2);
		if (dlen > sizeof d)
			return -1;
		memcpy(d, dest + 2, dlen);
	} else if (!strncmp(dest, "p:", 2)) {
		dkind = AP_DP_DEST_PID;
		if (unhex(dest + 2, d, sizeof d, &dlen))
			return -1;
	} else {
		return -1;
	}
	if (msg_hex && unhex(msg_hex, scratch, sizeof scratch, &mlen))
		return -1;
	struct ap_dp_req h = { .kind = kind, .dest_kind = dkind, .dest_len = (uint16_t)dlen, .msg_len = (uint32_t)mlen,
			       .ask_id = id, .fence_ring = fr, .fence_pos = fp };
	void *p;
	int rc = ap_ring_reserve(&req[r], sizeof h + dlen + mlen, &p);
	if (rc) {
		if (!quiet)
			printf("error %d\n", rc);
		return quiet ? -1 : 0;
	}
	memcpy(p, &h, sizeof h);
	memcpy((uint8_t *)p + sizeof h, d, dlen);
	memcpy((uint8_t *)p + sizeof h + dlen, scratch, mlen);
	if (!quiet)
		printf("ok %llu\n", (unsigned long long)req[r].pos);
	return 0;
}

static int rep_ready(void *arg)
{
	(void)arg;
	for (uint32_t i = 0; i < seg.n_rep; i++)
		if (ap_ring_readable(&rep[i]) > 0)
			return 1;
	return 0;
}

static void wait_replies(int want, int ms)
{
	int got = 0;
	int64_t left = ms;
	while (got < want && left > 0) {
		int rc = ap_seg_wait(seg.hdr, AP_SEG_BELL_REP, rep_ready, NULL, AP_RING_DEFAULT_SPIN, 50);
		left -= 50; /* coarse: the test's bound, not a measurement */
		if (rc && rc != -ETIMEDOUT) {
			printf("broken %d\n", rc);
			break;
		}
		for (uint32_t i = 0; i < seg.n_rep; i++) {
			const void *p;
			size_t len;
			int r;
			while ((r = ap_ring_read(&rep[i], &p, &len)) == 0) {
				struct ap_dp_rep h;
				if (len < sizeof h) {
					printf("badreply short\n");
					continue;
				}
				memcpy(&h, p, sizeof h);
				if (len != sizeof h + h.len) {
					printf("badreply length\n");
					continue;
				}
				printf("reply %llu ", (unsigned long long)h.ask_id);
				put_hex((const uint8_t *)p + sizeof h, h.len);
				printf("\n");
				got++;
			}
			if (r == -EPROTO)
				printf("broken ring %u\n", i);
			ap_ring_release(&rep[i]);
		}
	}
	printf("done %d\n", got);
}

static int cmp_u64(const void *a, const void *b)
{
	uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
	return x < y ? -1 : x > y;
}

static uint64_t now_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* One ask at a time on ring 0, its reply awaited before the next. */
static void pingpong(int n, int gap_us, const char *dest, const char *msg_hex)
{
	static uint64_t lat[100000];
	if (n < 1 || n > (int)(sizeof lat / sizeof lat[0])) {
		printf("badcmd\n");
		return;
	}
	int ok = 0;
	for (int i = 0; i < n; i++) {
		if (gap_us > 0)
			usleep((useconds_t)gap_us);
		uint64_t t0 = now_ns();
		if (record(0, AP_DP_ASK, 1000000 + (uint64_t)i, dest, msg_hex, AP_DP_NO_FENCE, 0, 1))
			break;
		ap_ring_publish(&req[0]);
		ap_seg_notify_fd(seg.hdr, AP_SEG_BELL_REQ, bell_fd);
		int got = 0;
		while (!got) {
			if (ap_seg_wait(seg.hdr, AP_SEG_BELL_REP, rep_ready, NULL, AP_RING_DEFAULT_SPIN, 1000) == -ETIMEDOUT)
				break;
			for (uint32_t k = 0; k < seg.n_rep; k++) {
				const void *p;
				size_t len;
				while (ap_ring_read(&rep[k], &p, &len) == 0)
					got++;
				ap_ring_release(&rep[k]);
			}
		}
		if (!got)
			break;
		lat[ok++] = now_ns() - t0;
	}
	if (ok == 0) {
		printf("pingpong 0 0 0\n");
		return;
	}
	qsort(lat, (size_t)ok, sizeof lat[0], cmp_u64);
	printf("pingpong %d %llu %llu\n", ok, (unsigned long long)(lat[ok / 2] / 1000),
	       (unsigned long long)(lat[ok - 1] / 1000));
}

int main(int argc, char **argv)
{
	uint8_t name[128], token[64];
	size_t name_len, token_len;
	int stall = 0;
	uint32_t n_req = 4, n_rep = 2;
	uint64_t req_bytes = 1 << 16, rep_bytes = 1 << 16;
	if (argc > 3 && !strcmp(argv[argc - 1], "--stall-after-hello")) {
		stall = 1;
		argc--;
	}
	if ((argc != 3 && argc != 7) || unhex(argv[1], name, sizeof name, &name_len) ||
	    unhex(argv[2], token, sizeof token, &token_len) || token_len != AP_SEG_TOKEN_LEN) {
		fprintf(stderr, "usage: dp_client SOCKET_HEX TOKEN_HEX [N_REQ N_REP REQ_BYTES REP_BYTES]\n");
		return 2;
	}
	if (argc == 7) {
		n_req = (uint32_t)strtoul(argv[3], NULL, 10);
		n_rep = (uint32_t)strtoul(argv[4], NULL, 10);
		req_bytes = strtoull(argv[5], NULL, 10);
		rep_bytes = strtoull(argv[6], NULL, 10);
	}
	setvbuf(stdout, NULL, _IOLBF, 0);
	size_t size = ap_seg_size(n_req, req_bytes, n_rep, rep_bytes);
	struct ap_ring_map m;
	if (!size || ap_ring_map_create_memfd(&m, "dp_client", size) ||
	    ap_seg_format(m.mem, m.size, n_req, req_bytes, n_rep, rep_bytes) || ap_seg_parse(&seg, m.mem, m.size)) {
		printf("setup failed\n");
		return 1;
	}
	for (uint32_t i = 0; i < n_req; i++)
		if (ap_ring_attach_producer(&req[i], ap_seg_req(&seg, i), ap_seg_req_size(&seg)))
			return 1;
	for (uint32_t i = 0; i < n_rep; i++)
		if (ap_ring_attach_consumer(&rep[i], ap_seg_rep(&seg, i), ap_seg_rep_size(&seg)))
			return 1;

	int s = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
	struct sockaddr_un a = { .sun_family = AF_UNIX };
	if (name_len > sizeof a.sun_path)
		return 2;
	memcpy(a.sun_path, name, name_len);
	if (connect(s, (struct sockaddr *)&a, (socklen_t)(offsetof(struct sockaddr_un, sun_path) + name_len))) {
		printf("refused %d\n", errno);
		return 1;
	}
	const char *me = "dp_client@localhost";
	struct ap_seg_hello h = { .magic = AP_SEG_HELLO_MAGIC, .version = AP_SEG_VERSION,
				  .name_len = (uint32_t)strlen(me), .os_pid = (uint32_t)getpid() };
	memcpy(h.token, token, AP_SEG_TOKEN_LEN);
	/* A node that refuses answers with an ack and closes at once: a write
	 * after that fails (EPIPE), but the ack is there to read. */
	int sent = send(s, &h, sizeof h, MSG_NOSIGNAL) == (ssize_t)sizeof h &&
		   send(s, me, strlen(me), MSG_NOSIGNAL) == (ssize_t)strlen(me);
	if (stall) {
		/* Never sends the fd: the node's deadline must end it. */
		printf("stalled\n");
		struct ap_seg_ack late;
		if (read_full(s, &late, sizeof late, AP_SEG_ATTACH_TIMEOUT_MS * 5) == 0 && late.magic == AP_SEG_HELLO_MAGIC)
			printf("refused %u\n", late.status);
		else
			printf("not refused\n");
		return 1;
	}
	if (sent)
		sent = ap_ring_send_fd(s, m.fd) == 0;
	struct ap_seg_ack ack;
	if (read_full(s, &ack, sizeof ack, AP_SEG_ATTACH_TIMEOUT_MS * 2)) {
		printf("refused %d\n", sent ? ECONNRESET : EPIPE);
		return 1;
	}
	if (ack.magic != AP_SEG_HELLO_MAGIC || ack.status) {
		printf("refused %u\n", ack.status);
		return 1;
	}
	printf("attached\n");

	static char line[(2 << 20) + 256];
	while (fgets(line, sizeof line, stdin)) {
		char *save = NULL, *cmd = strtok_r(line, " \n", &save);
		char *t[8] = { 0 };
		int nt = 0;
		while (nt < 8 && (t[nt] = strtok_r(NULL, " \n", &save)))
			nt++;
		if (!cmd)
			continue;
		int bad = 0;
		if (!strcmp(cmd, "tell") && (nt == 3 || nt == 5)) {
			bad = record((uint32_t)atoi(t[0]), AP_DP_TELL, 0, t[1], t[2],
				     nt == 5 ? (uint32_t)atoi(t[3]) : AP_DP_NO_FENCE, nt == 5 ? strtoull(t[4], NULL, 10) : 0, 0);
		} else if (!strcmp(cmd, "ask") && (nt == 4 || nt == 6)) {
			bad = record((uint32_t)atoi(t[0]), AP_DP_ASK, strtoull(t[1], NULL, 10), t[2], t[3],
				     nt == 6 ? (uint32_t)atoi(t[4]) : AP_DP_NO_FENCE, nt == 6 ? strtoull(t[5], NULL, 10) : 0, 0);
		} else if (!strcmp(cmd, "stats") && nt == 3) {
			bad = record((uint32_t)atoi(t[0]), AP_DP_STATS, strtoull(t[1], NULL, 10), t[2], NULL,
				     AP_DP_NO_FENCE, 0, 0);
		} else if (!strcmp(cmd, "raw") && nt == 2) {
			size_t len;
			uint32_t r = (uint32_t)atoi(t[0]);
			void *p;
			if (r >= seg.n_req || unhex(t[1], scratch, sizeof scratch, &len) ||
			    ap_ring_reserve(&req[r], len, &p)) {
				bad = 1;
			} else {
				memcpy(p, scratch, len);
				printf("ok %llu\n", (unsigned long long)req[r].pos);
			}
		} else if (!strcmp(cmd, "pub")) {
			for (int i = 0; i < nt; i++) {
				uint32_t r = (uint32_t)atoi(t[i]);
				if (r < seg.n_req)
					ap_ring_publish(&req[r]);
			}
			printf("ok\n");
		} else if (!strcmp(cmd, "bell")) {
			ap_seg_notify_fd(seg.hdr, AP_SEG_BELL_REQ, bell_fd);
			printf("ok\n");
		} else if (!strcmp(cmd, "wait") && nt == 2) {
			wait_replies(atoi(t[0]), atoi(t[1]));
		} else if (!strcmp(cmd, "pingpong") && nt == 4) {
			pingpong(atoi(t[0]), atoi(t[1]), t[2], t[3]);
		} else if (!strcmp(cmd, "poke") && nt == 4) {
			uint32_t r = (uint32_t)atoi(t[1]);
			int is_req = !strcmp(t[0], "req");
			struct ap_ring_hdr *rh = NULL;
			if (is_req && r < seg.n_req)
				rh = req[r].hdr;
			else if (!is_req && r < seg.n_rep)
				rh = rep[r].hdr;
			if (!rh) {
				bad = 1;
			} else {
				uint64_t v = strtoull(t[3], NULL, 10);
				__atomic_store_n(!strcmp(t[2], "head") ? &rh->head : &rh->tail, v, __ATOMIC_RELEASE);
				printf("ok\n");
			}
		} else if (!strcmp(cmd, "eof") && nt == 1) {
			struct pollfd pf = { .fd = s, .events = POLLIN };
			char c;
			int closed = poll(&pf, 1, atoi(t[0])) > 0 && recv(s, &c, 1, MSG_DONTWAIT) == 0;
			printf("%s\n", closed ? "eof" : "open");
		} else if (!strcmp(cmd, "quit")) {
			break;
		} else {
			bad = 1;
		}
		if (bad)
			printf("badcmd\n");
	}
	close(s);
	return 0;
}
