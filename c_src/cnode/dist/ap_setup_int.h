/* ap_setup_int: what the parts of ap_setup share (ap_setup.c says which
 * part is where): the table of pending handshakes, the socket callbacks'
 * per-thread state, and each part's calls into the others. Private to
 * ap_setup. */
#ifndef AP_SETUP_INT_H
#define AP_SETUP_INT_H

#include "ap_setup.h"

#include <pthread.h>
#include <stdint.h>
#include <sys/socket.h>

#define DEF_HANDSHAKE_MS 5000
#define DEF_MAX_PENDING 256
#define DEF_MAX_PER_SOURCE 64
#define DEF_THREADS 4
#define DEF_GRACE_MS 250
#define SUMMARY_MS 1000
#define EPMD_PORT 4369

/* One accepted socket from accept to hand-over. The gate thread owns it in
 * P_GATE and P_READY (only it frees those), a handshake thread in P_RUN.
 * fd is -1 once ei closed it or handed it over: other threads may
 * shutdown() it, under s->mu, only while it is >= 0. */
enum pend_state { P_GATE, P_READY, P_RUN };

/* One peer address with pending handshakes: what the caps and the
 * fairness rules count. Lives while a pend points at it. */
struct src {
	struct src *next;
	int refs;                  /* pends pointing here, dropped ones too */
	int npend;                 /* of them, not dropped */
	int nrun;                  /* of them, running and not dropped */
	uint8_t addr[16];
	uint8_t len;               /* 4, 16, or 0: unknown (all unknown are one) */
};

struct pend {
	struct pend *prev, *next;  /* every pending handshake, oldest first */
	int fd;
	enum pend_state st;
	int dropped;               /* capped, evicted or stopping: no longer counted */
	struct src *src;           /* the peer's address */
	int64_t deadline, t_run;
	uint32_t need;             /* the first packet with its 2-byte header, once known */
	uint32_t got;              /* bytes of it read by the gate */
	uint32_t off;              /* bytes of it ei has read */
	uint8_t pkt[2 + AP_SETUP_MAX_NAME_PKT];
};

struct cjob {
	struct cjob *next;
	int tag;
	char node[MAXNODELEN + 1];
};

struct ap_setup {
	ei_cnode *ec;
	ap_sendq *q;
	int lfd;
	ap_setup_cfg cfg;
	pthread_mutex_t mu;
	pthread_cond_t ready_cv;   /* handshake threads: a P_READY entry, or stop */
	pthread_cond_t conn_cv;    /* connect thread: a job, or stop */
	struct pend *head, *tail;
	struct src *srcs;          /* the addresses of the entries */
	int npend;                 /* entries not dropped */
	int nready;                /* P_READY entries not dropped */
	int nrun;                  /* P_RUN entries, dropped too: each holds a thread */
	int nevict;                /* P_RUN entries dropped, their thread not yet back */
	int run_cap;               /* running handshakes per source address */
	int wake_fd;               /* eventfd: wakes the gate */
	int conn_fd;               /* the socket of the connect in progress, or -1 */
	struct cjob *cj_head, *cj_tail;
	int stop;
	ap_setup_stats st, logged; /* counters, and their values at the last summary */
	int64_t last_summary;
	pthread_t gate, connector;
	pthread_t *workers;
	int nworkers;
};


struct sctx;

/* The socket callbacks' state per thread (ap_setup_sock.c): each thread
 * runs one handshake at a time, so these pass state between our calls into
 * ei and its callbacks. */
extern __thread ap_setup *tl_setup;
extern __thread struct pend *tl_parked;  /* the socket the next accept adopts */
extern __thread int64_t tl_deadline;     /* of the handshake under way; 0: none */
extern __thread struct sctx *last_ctx;   /* the ctx the last handshake used */

/* ap_setup_sock.c: the ei socket callbacks and their helpers. */
int wait_fd(int fd, short ev, unsigned tmo);
int claim_conn_fd(ap_setup *s, int fd);
void release_conn_fd(ap_setup *s, int fd);
int connect_nb(int fd, const void *addr, socklen_t len, unsigned tmo);
void disown(int fd);

/* ap_setup_gate.c: the pending handshakes and the gate thread. */
void wake_gate(ap_setup *s);
void unlink_pend(ap_setup *s, struct pend *p);
void pend_free(ap_setup *s, struct pend *p);
struct pend *take_ready(ap_setup *s);
void *gate_main(void *arg);

#endif
