/* ap_node: a C node. ei does the handshakes (on a helper thread) and the
 * term codec; after a handshake the socket belongs to the event loop, which
 * reassembles frames, decodes control messages, answers ticks, drops silent
 * peers, and dispatches messages to local processes. Only the loop thread
 * writes sockets; other threads hand frames over through ap_node_post.
 */
#ifndef AP_NODE_H
#define AP_NODE_H

#include <ei.h>
#include <stdint.h>

#include "ap_buf.h"
#include "ap_ctrl.h" /* the reply encoders (ap_encode_reply), for code replying from other threads */
#include "ap_io.h"

typedef struct ap_node ap_node;
typedef struct ap_proc ap_proc;
typedef struct ap_conn ap_conn;

typedef struct ap_node_cfg {
	const char *node;          /* "alive@host" */
	const char *cookie;
	unsigned creation;         /* non-zero, fresh per start */
	const char *parent;        /* node to connect to at start, or NULL */
	uint32_t max_frame;        /* 0: 64 MiB */
	int idle_timeout_ms;       /* a peer silent this long is dropped; 0: 60000 */
	const char *io;            /* "auto", "uring", "epoll"; NULL: $ACTOR_POOL_IO or auto */
	int port_mode;             /* report to the owning BEAM over stdout, exit on stdin EOF */
	const char *listen;        /* dotted IPv4 address to listen on; NULL: every interface */
	int handshake_timeout_ms;  /* one whole handshake, in or out; 0: 5000 */
	int max_handshakes;        /* incoming handshakes pending at once; 0: 256 */
	int max_handshakes_per_source; /* the same, per peer address; 0: 64 */
} ap_node_cfg;

enum ap_msg_kind {
	AP_MSG_INFO,  /* a plain message */
	AP_MSG_CALL,  /* gen_server:call: answer with ap_reply */
	AP_MSG_CAST,  /* gen_server:cast */
	AP_MSG_EXIT,  /* a linked process died, or exit/2 (exit2 set) */
};

typedef struct ap_msg {
	enum ap_msg_kind kind;
	const char *buf;     /* the encoded message or reason; ei decoders may read from index */
	int len;
	int index;           /* the request (call, cast), the message (info), the reason (exit) */
	erlang_pid from;     /* call: the caller; exit: the process that died / sent exit/2 */
	const char *tag;     /* call: the reply tag, copied verbatim into the reply */
	int tag_len;
	int exit2;
	ap_conn *conn;       /* the connection it came in on */
} ap_msg;

typedef void (*ap_proc_fn)(ap_node *n, ap_proc *p, const ap_msg *m);

struct ap_proc {
	erlang_pid pid;
	char name[MAXATOMLEN_UTF8]; /* registered name, or "" */
	ap_proc_fn fn;
	void *state;
	erlang_pid *links;
	int nlinks, caplinks;
	struct ap_proc *next;       /* hash chain */
};

typedef struct ap_node_stats {
	uint64_t received;      /* messages delivered to a local process */
	uint64_t unknown_name;  /* messages to a name or pid that does not exist */
	uint64_t bad_frames;    /* connections closed for bad input */
	uint64_t dropped;       /* messages to a node with no connection */
	uint64_t oversized;     /* frames over max_frame, passed over (a call among them answered) */
	int connections;
} ap_node_stats;

ap_node *ap_node_new(const ap_node_cfg *cfg);  /* NULL on failure (logged) */
void ap_node_free(ap_node *n);
/* Publish, connect to the parent, report ready, and serve until
 * ap_node_stop or (port mode) stdin EOF. Returns 0 or a negative errno. */
int ap_node_run(ap_node *n);
void ap_node_stop(ap_node *n);

const char *ap_node_name(const ap_node *n);
const char *ap_node_backend(const ap_node *n);
const ap_node_stats *ap_node_get_stats(const ap_node *n);
uint32_t ap_node_max_frame(const ap_node *n); /* the frame limit in force */
ei_cnode *ap_node_ei(ap_node *n);

/* Processes (loop thread). name may be NULL. */
ap_proc *ap_proc_spawn(ap_node *n, const char *name, ap_proc_fn fn, void *state);
/* Stop p: every linked process gets an EXIT with `reason` (an atom). */
void ap_proc_exit(ap_node *n, ap_proc *p, const char *reason_atom);
ap_proc *ap_proc_whereis(ap_node *n, const char *name);

/* Sending (loop thread). Terms are encoded, with or without the 131 byte.
 * They return 0, or -1 when there is no connection to the target's node
 * (counted as dropped) or no memory. */
int ap_send(ap_node *n, const ap_proc *from, const erlang_pid *to, const char *term, int len);
int ap_reply(ap_node *n, const ap_proc *self, const ap_msg *call, const char *term, int len);
/* Send to the process registered as `name` on `node` (REG_SEND); the same
 * results as ap_send. */
int ap_send_named(ap_node *n, const ap_proc *from, const char *node, const char *name, const char *term,
		  int len);
/* Reply with an atom, the common case. */
int ap_reply_atom(ap_node *n, const ap_proc *self, const ap_msg *call, const char *atom);
int ap_link(ap_node *n, ap_proc *p, const erlang_pid *remote);

/* Any thread: queue a whole frame for `node`; the loop sends it in order
 * with everything else for that node. Returns 0 or -1 (no memory). */
int ap_node_post(ap_node *n, const char *node, const uint8_t *frame, size_t len);

/* Any thread: run fn(n, arg) on the loop thread, in order with frames
 * posted by the same thread. Returns 0 or -1 (no memory). */
typedef void (*ap_loop_fn)(ap_node *n, void *arg);
int ap_node_call_on_loop(ap_node *n, ap_loop_fn fn, void *arg);
/* Any thread but the loop: the same, for a call that must not be lost (a
 * worker's start or exit: without it its slot is never routed again, or
 * never replaced). Out of memory, it logs once and tries again every
 * millisecond until the call is queued. */
void ap_node_call_on_loop_sure(ap_node *n, ap_loop_fn fn, void *arg);

/* Loop thread: do now what other threads queued (frames, calls), as the
 * loop does when they wake it; tests drive a node without its loop so. */
void ap_node_run_queued(ap_node *n);

/* Loop thread: fn(n, arg) runs each time the connection to the parent
 * node (--connect) comes up, after the node reported ready. */
void ap_node_on_parent_up(ap_node *n, ap_loop_fn fn, void *arg);
/* The parent node's name, or NULL. */
const char *ap_node_parent(const ap_node *n);

/* Loop thread: run fn(n, arg) once, delay_ms from now. */
int ap_node_timer(ap_node *n, int delay_ms, ap_loop_fn fn, void *arg);

/* Loop thread: messages to a name or pid that does not exist go to fn
 * (after being counted) before the runtime's own handling, with the peer's
 * node name and the name it was sent to (NULL: a pid). fn returns 1 when
 * it took the message whole (answered what needed an answer, logged what
 * it wanted logged); 0 leaves the rest to the runtime: a log line
 * (rate-limited) and a call answered {error, noproc}. `self` is a local
 * process usable as a sender. */
typedef int (*ap_dead_letter_fn)(ap_node *n, ap_proc *self, const ap_msg *m, const char *peer,
				 const char *toname);
void ap_node_set_dead_letter(ap_node *n, ap_dead_letter_fn fn);

/* Before ap_node_run: threads of the service outlive the node, so
 * ap_node_free closes the node (connections, epmd, listener) but leaves
 * the memory those threads reach (the node, its queue, its loop) to the
 * process's exit. For a service whose threads are not joined when it
 * stops (a pool worker may be seconds into a handler; the ring attach
 * thread polls its sockets) and may still queue a call to the loop
 * (ap_node_call_on_loop) while main returns. */
void ap_node_outlived_by_threads(ap_node *n);

/* Loop thread: fn(n, arg) runs before every wait of the loop; it returns
 * 1 when it found work (the loop then only polls, without sleeping), 2
 * when it found none but keeps the loop awake (it polls the sockets now,
 * ap_loop_look_now), 0 when the loop may sleep. For ingresses that are
 * not sockets (the same-host rings), with a bounded spin. One hook. */
typedef int (*ap_idle_fn)(ap_node *n, void *arg);
void ap_node_set_idle(ap_node *n, ap_idle_fn fn, void *arg);

/* Loop thread: fn(n, arg) runs on the loop each time fd is readable (it
 * reads fd). Two such readers per node (the pool node's child-exit
 * signalfd and, on epoll, its ring bell). 0, -EBUSY (all taken) or -errno. */
int ap_node_add_reader(ap_node *n, int fd, ap_loop_fn fn, void *arg);

/* Loop thread: futex waits inside the event loop (ap_io.h). */
int ap_node_futex_supported(const ap_node *n);
int ap_node_futex_wait(ap_node *n, ap_io_futex *f, uint32_t *word, uint32_t expected, int timeout_ms);
void ap_node_futex_cancel(ap_node *n, ap_io_futex *f);
int64_t ap_node_now_ms(const ap_node *n);

#endif
