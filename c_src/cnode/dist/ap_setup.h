/* ap_setup: distribution handshakes through ei over sockets we own
 * (ei_socket_callbacks with EI_SCLBK_FLG_FULL_IMPL). A finished handshake is
 * handed to the loop as an AP_Q_CONN_UP item on the node's sendq; ei keeps
 * no record of the fd afterwards. Private.
 *
 * Nobody needs the cookie to open a socket, so no peer may hold the
 * machinery: every handshake has one deadline for all its reads and writes;
 * a gate thread waits (poll, no thread per socket) for the first packet of
 * each accepted socket and refuses one that announces more than a name
 * packet needs; only a socket whose whole first packet arrived goes to the
 * small pool of handshake threads. The pending handshakes are capped overall
 * and per source address. At the per-address cap a new one makes room by
 * dropping its address's oldest; at the overall cap, the oldest of the
 * address holding the most (its own when it holds as many), so an address
 * holding no more than its fair share (max_pending / addresses) keeps what
 * it holds. A running handshake goes only after the grace below; with
 * nothing that may go, the new one is refused. Threads are shared fairly by
 * source address: a free thread takes a ready socket of the address
 * running the fewest handshakes, of those the address holding the fewest
 * pending, its oldest; one address holds at most threads - 1. A handshake
 * that sent its name and stalls is dropped after a short grace when a ready
 * one waits for a thread, taken from the address holding the most threads.
 * So a flood from other addresses, each holding more than a node's one
 * connection, neither pushes that connection out nor queues ahead of it:
 * the node waits one grace at most. The bounds are per address, not per
 * identity: addresses that each hold a single stalled handshake queue
 * ahead of a node (a grace per thread round), and as many of them as the
 * overall cap push it out. Outgoing connects run on a thread of their own
 * and look the peer up in epmd themselves, so that a stop never waits on
 * them. */
#ifndef AP_SETUP_H
#define AP_SETUP_H

#include <ei.h>

#include "ap_sendq.h"

enum { AP_Q_FRAME = 1, AP_Q_CONN_UP = 2, AP_Q_CONN_FAILED = 3, AP_Q_CALL = 4 };

/* The first handshake packet (the peer's name) is refused above this. */
#define AP_SETUP_MAX_NAME_PKT 1024

typedef struct ap_setup_result {
	int fd;       /* AP_Q_CONN_UP: the connected socket, blocking */
	int tag;      /* what the caller passed to ap_setup_connect (0 for accepts) */
} ap_setup_result;

typedef struct ap_setup_cfg {
	int handshake_ms;    /* the whole handshake, accept to hand-over; <= 0: 5000 */
	int max_pending;     /* accepted, not yet handed over; <= 0: 256 */
	int max_per_source;  /* the same, per peer address; <= 0: 64 */
	int threads;         /* handshake threads; <= 0: 4 */
	int grace_ms;        /* a running handshake this old may be dropped for a
			      * ready one; <= 0: 250 */
	int max_run_per_source; /* handshake threads one source address may hold;
				 * <= 0: threads - 1 (at least 1) */
} ap_setup_cfg;

typedef struct ap_setup_stats {
	unsigned long long accepted, handed_over;
	unsigned long long timed_out, capped, too_large, evicted, failed, closed;
	int pending;         /* now */
} ap_setup_stats;

typedef struct ap_setup ap_setup;

/* ei_connect_xinit_ussi with our callbacks. Returns 0 or -1. */
int ap_ei_init(ei_cnode *ec, const char *node, const char *cookie, unsigned creation);
/* Listen on addr (dotted IPv4; NULL or "" for every interface), an
 * ephemeral port, through ei (so ei_accept can run on accepted fds).
 * Returns the listen fd and sets *port, or -1 (logged). */
int ap_ei_listen(ei_cnode *ec, const char *addr, int *port);
/* 0 if addr is an address ap_ei_listen takes (NULL and "" included). */
int ap_listen_addr_ok(const char *addr);

ap_setup *ap_setup_start(ei_cnode *ec, ap_sendq *q, const ap_setup_cfg *cfg);
void ap_setup_set_listener(ap_setup *s, int lfd);
void ap_setup_stop(ap_setup *s);
/* Hand over an accepted socket (any thread); the result arrives on q. */
void ap_setup_accept(ap_setup *s, int fd);
void ap_setup_connect(ap_setup *s, const char *node, int tag);
void ap_setup_get_stats(ap_setup *s, ap_setup_stats *out);
/* For ap_sendq's dispose: closes the socket of an AP_Q_CONN_UP item
 * nobody took (a handshake that finished as the node stopped). */
void ap_setup_dispose(ap_sendq_item *it);

#endif
