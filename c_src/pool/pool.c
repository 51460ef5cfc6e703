/* pool: dispatcher, worker threads, routing, backoff and metrics of the
 * pool node's stateless worker pools.
 *
 * Threads: the loop thread owns every pool and is the only producer into
 * every mailbox; each worker thread is the only consumer of its own. So a
 * mailbox is a single-producer single-consumer linked queue with no lock,
 * and its depth is two counters the loop can read at any time. Workers
 * reply straight to the asker: they encode the reply frame themselves and
 * hand it to the loop (the one writer of sockets) through ap_node_post.
 * Workers tell the loop about their life (init done, exit) with
 * ap_node_call_on_loop, so all pool state changes on the loop thread.
 */
#include "pool.h"

#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "ap_ctrl.h"
#include "ap_log.h"
#include "ap_term.h"
#include "handlers.h"

#define MAX_WORKERS 1024
#define ROUTE_TRIES 3 /* full mailboxes the router tries past before answering overloaded */

/* ---- mailbox: SPSC intrusive queue (Vyukov) ----------------------------- */

typedef struct ap_job {
	struct ap_job *_Atomic next;
	struct ap_job *free_next;  /* on the recycle stack */
	uint32_t cap;              /* bytes of data[] allocated */
	uint8_t is_ask, is_binary;
	uint32_t head_len; /* asks: the reply head (ap_encode_reply_head) */
	uint32_t msg_len;  /* the message: a binary's bytes, or 131 + term */
	uint32_t node_len; /* asks: the caller's node, NUL included */
	uint8_t data[];    /* head, message, node */
} ap_job;

typedef struct ap_mbox {
	ap_job *head; /* consumer: the dummy before the first job */
	ap_job *tail; /* producer: the last job */
	_Atomic uint64_t enq, deq;
	/* Jobs the consumer is done with go back to the producer, which
	 * reuses them: malloc on one thread and free on another would fight
	 * over the allocator's arena lock on every message. */
	ap_job *_Atomic recycled;
} ap_mbox;

static int mbox_init(ap_mbox *m)
{
	ap_job *stub = calloc(1, sizeof *stub);
	if (!stub)
		return -1;
	m->head = m->tail = stub;
	atomic_init(&m->recycled, NULL);
	atomic_init(&m->enq, 0);
	atomic_init(&m->deq, 0);
	return 0;
}

static void mbox_push(ap_mbox *m, ap_job *j)
{
	atomic_store_explicit(&j->next, NULL, memory_order_relaxed);
	/* One writer per counter: a plain load and store, no locked add. */
	atomic_store_explicit(&m->enq, atomic_load_explicit(&m->enq, memory_order_relaxed) + 1, memory_order_relaxed);
	/* seq_cst: the worker's "going to sleep" flag is checked after this. */
	atomic_store(&m->tail->next, j);
	m->tail = j;
}

/* The job stays the queue's dummy until the next pop; its bytes stay valid
 * until then. */
static ap_job *mbox_pop(ap_mbox *m)
{
	ap_job *next = atomic_load_explicit(&m->head->next, memory_order_acquire);
	if (!next)
		return NULL;
	ap_job *old = m->head, *top = atomic_load_explicit(&m->recycled, memory_order_relaxed);
	do
		old->free_next = top;
	while (!atomic_compare_exchange_weak_explicit(&m->recycled, &top, old, memory_order_release,
						     memory_order_relaxed));
	m->head = next;
	return next;
}

/* The consumer finished the job it popped last. Counting here rather than
 * at the pop keeps the message being handled in the depth, so a worker busy
 * on one long message does not look idle to smallest_mailbox. */
static void mbox_done(ap_mbox *m)
{
	atomic_store_explicit(&m->deq, atomic_load_explicit(&m->deq, memory_order_relaxed) + 1, memory_order_relaxed);
}

static int mbox_empty(ap_mbox *m) { return atomic_load(&m->head->next) == NULL; }

static uint64_t mbox_depth(ap_mbox *m)
{
	uint64_t e = atomic_load_explicit(&m->enq, memory_order_relaxed);
	uint64_t d = atomic_load_explicit(&m->deq, memory_order_relaxed);
	return e > d ? e - d : 0;
}

static void free_list(ap_job *j)
{
	while (j) {
		ap_job *next = j->free_next;
		free(j);
		j = next;
	}
}

static void mbox_destroy(ap_mbox *m)
{
	while (mbox_pop(m))
		mbox_done(m);
	free(m->head);
	free_list(atomic_exchange(&m->recycled, NULL));
	m->head = m->tail = NULL;
}

/* Producer: a job with room for `need` bytes, reused when one came back. */
static ap_job *job_alloc(ap_mbox *m, ap_job **cache, size_t need)
{
	if (!*cache)
		*cache = atomic_exchange_explicit(&m->recycled, NULL, memory_order_acquire);
	ap_job *j = *cache;
	if (j) {
		*cache = j->free_next;
		if (j->cap >= need)
			return j;
		free(j);
	}
	size_t cap = need < 256 ? 256 : need;
	j = malloc(sizeof *j + cap);
	if (j)
		j->cap = (uint32_t)cap;
	return j;
}

/* ---- pools and workers --------------------------------------------------- */

enum exit_reason { EXIT_STOP, EXIT_CRASH, EXIT_INIT_FAILED };

typedef struct ap_worker {
	ap_pool *pool;
	int id;
	int gen;                   /* incarnation of this slot: names its thread */
	pthread_t th;
	int thread_live;           /* started and not joined */
	ap_mbox mb;
	_Atomic int alive;         /* routing skips a slot waiting for its replacement */
	_Atomic int sleeping;
	_Atomic int stop;
	int wake_pending;          /* loop: jobs pushed since the last wake pass */
	ap_job *job_cache;         /* loop: recycled jobs taken back, not yet reused */
	pthread_mutex_t mu;
	pthread_cond_t cv;
	_Atomic uint64_t processed, errors, crashes;
	enum exit_reason exit_reason;
	int init_rc;
	/* loop thread only */
	uint64_t restarts;
	int streak;                /* crashes since the slot was last stable */
	int64_t started_ms;
	int next_restart_ms;
	int restart_pending;
	/* worker thread only */
	actor_pool_reply reply;
	ap_buf out;
} ap_worker;

struct ap_pool {
	ap_node *n;
	ap_proc *proc;             /* NULL once stopped */
	erlang_pid pid;
	char name[MAXATOMLEN_UTF8];
	char handler_desc[64];
	const actor_pool_handler *h;
	void *dl;
	uint8_t *config;
	size_t config_len;
	ap_pool_opts o;
	ap_worker *w;
	uint64_t rr, rng;
	uint64_t overloaded, dropped_tells;
	int stopping;
	int freeing;
	int threads;               /* worker threads not yet joined */
	int timers;                /* restart timers not yet fired */
	int starting;              /* workers whose first init has not reported */
	int init_failed;           /* the first failing init code, 0 if none */
	ap_pending_reply *start_reply;
	int64_t started_ms;
	uint64_t tp_last;          /* processed at the last tick */
	int64_t tp_last_ms;
	double throughput;
	ap_buf scratch;            /* reply heads built by the loop */
	int *wake_list;            /* workers with jobs pushed but not yet woken */
	int nwake;
	struct ap_pool *next;
};

static ap_pool *pools; /* the pool node runs one ap_node */

static uint64_t xorshift(uint64_t *s)
{
	uint64_t x = *s;
	x ^= x << 13;
	x ^= x >> 7;
	x ^= x << 17;
	return *s = x;
}

void ap_pool_opts_default(ap_pool_opts *o)
{
	*o = (ap_pool_opts){ .workers = 0, .routing = AP_ROUTE_ROUND_ROBIN, .mailbox_limit = 10000,
			     .backoff_min_ms = 50, .backoff_max_ms = 5000, .jitter = 0.2, .stable_ms = 10000 };
}

static int reply_reserve(actor_pool_reply *r, size_t more)
{
	if (more > SIZE_MAX - r->len)
		return -1;
	size_t need = r->len + more;
	if (need <= r->cap)
		return 0;
	size_t cap = r->cap ? r->cap : 256;
	while (cap < need)
		cap *= 2;
	uint8_t *d = realloc(r->data, cap);
	if (!d)
		return -1;
	r->data = d;
	r->cap = cap;
	return 0;
}

/* ---- replies -------------------------------------------------------------- */

/* Append {Status, Value} (no 131) to b from the handler's reply. Returns 0,
 * or -1 when the reply does not encode a valid term. */
static int enc_result(ap_buf *b, const char *status, const actor_pool_reply *r)
{
	char tmp[MAXATOMLEN_UTF8 + 16];
	int i = 0;
	ei_encode_tuple_header(tmp, &i, 2);
	ei_encode_atom(tmp, &i, status);
	if (ap_buf_append(b, tmp, (size_t)i))
		return -1;
	switch (r->kind) {
	case AP_REPLY_BINARY: {
		uint8_t h[5] = { 109 };
		if (r->len > UINT32_MAX)
			return -1;
		ap_put32be(h + 1, (uint32_t)r->len);
		return ap_buf_append(b, h, 5) || ap_buf_append(b, r->data, r->len) ? -1 : 0;
	}
	case AP_REPLY_ATOM:
		i = 0;
		if (r->len > 255 * 4 ||
		    ei_encode_atom_len_as(tmp, &i, (const char *)r->data, (int)r->len, ERLANG_UTF8, ERLANG_UTF8))
			return -1;
		return ap_buf_append(b, tmp, (size_t)i);
	case AP_REPLY_TERM: {
		const char *t = (const char *)r->data;
		size_t len = r->len;
		if (len > 0 && (uint8_t)t[0] == 131) {
			t++;
			len--;
		}
		/* A plugin's bytes go to a BEAM that would drop the whole
		 * connection over one bad term: check them first. */
		int idx = 0;
		if (len == 0 || len > INT32_MAX || ap_term_skip(t, len, &idx) || (size_t)idx != len)
			return -1;
		return ap_buf_append(b, t, len);
	}
	}
	return -1;
}

static void set_atom_reply(actor_pool_reply *r, const char *atom)
{
	actor_pool_reply_set(r, AP_REPLY_ATOM, atom, strlen(atom));
}

/* Worker thread: answer the ask j with {Status, reply}. */
static void send_result(ap_worker *w, const ap_job *j, const char *status, actor_pool_reply *r)
{
	ap_buf *b = &w->out;
	b->len = 0;
	if (ap_buf_append(b, j->data, j->head_len))
		return;
	if (enc_result(b, status, r)) {
		ap_log(AP_LOG_WARNING, "pool %s: handler %s produced a reply that is not a term", w->pool->name,
		       w->pool->handler_desc);
		b->len = j->head_len;
		set_atom_reply(r, "bad_reply");
		if (enc_result(b, "error", r))
			return;
	}
	if (ap_frame_end(b, 0))
		return;
	ap_node_post(w->pool->n, (const char *)j->data + j->head_len + j->msg_len, b->data, b->len);
}

static void send_error_atom(ap_worker *w, const ap_job *j, const char *reason)
{
	set_atom_reply(&w->reply, reason);
	send_result(w, j, "error", &w->reply);
}

/* Loop thread: answer an ask whose reply head is in p->scratch (from
 * head_start) with {error, Reason}, without a worker. */
static void loop_error_reply(ap_pool *p, size_t head_start, const char *node, const char *reason)
{
	ap_buf *b = &p->scratch;
	char tmp[64];
	int i = 0;
	ei_encode_tuple_header(tmp, &i, 2);
	ei_encode_atom(tmp, &i, "error");
	ei_encode_atom(tmp, &i, reason);
	if (ap_buf_append(b, tmp, (size_t)i) || ap_frame_end(b, head_start))
		return;
	ap_node_post(p->n, node, b->data + head_start, b->len - head_start);
}

/* ---- worker threads -------------------------------------------------------- */

static void worker_exited(ap_node *n, void *arg);
static void worker_ready(ap_node *n, void *arg);

static ap_job *next_job(ap_worker *w)
{
	for (;;) {
		ap_job *j = mbox_pop(&w->mb);
		if (j || atomic_load(&w->stop))
			return j;
		pthread_mutex_lock(&w->mu);
		atomic_store(&w->sleeping, 1);
		/* Checked after the flag (both seq_cst): a push we miss here
		 * sees the flag and signals. */
		if (mbox_empty(&w->mb) && !atomic_load(&w->stop))
			pthread_cond_wait(&w->cv, &w->mu);
		atomic_store(&w->sleeping, 0);
		pthread_mutex_unlock(&w->mu);
	}
}

static void wake(ap_worker *w, int always)
{
	if (always || (atomic_load(&w->sleeping) && atomic_exchange(&w->sleeping, 0))) {
		pthread_mutex_lock(&w->mu);
		pthread_cond_signal(&w->cv);
		pthread_mutex_unlock(&w->mu);
	}
}

static void *worker_main(void *arg)
{
	ap_worker *w = arg;
	ap_pool *p = w->pool;
	void *state = NULL;
	char tname[16];
	/* Replacements get a suffix: pool/slot.incarnation. */
	snprintf(tname, sizeof tname, "%.7s/%d.%d", p->name, w->id, w->gen);
	pthread_setname_np(pthread_self(), tname);

	w->reply.reserve = reply_reserve;
	int rc = p->h->init ? p->h->init(&state, p->config, p->config_len) : 0;
	if (rc) {
		w->init_rc = rc;
		w->exit_reason = EXIT_INIT_FAILED;
		ap_node_call_on_loop(p->n, worker_exited, w);
		return NULL;
	}
	if (w->gen == 0)
		ap_node_call_on_loop(p->n, worker_ready, w);

	w->exit_reason = EXIT_STOP;
	ap_job *j;
	while ((j = next_job(w))) {
		if (atomic_load(&w->stop)) {
			/* Stopping: everything still queued is answered, not run. */
			if (j->is_ask)
				send_error_atom(w, j, "stopped");
			mbox_done(&w->mb);
			continue;
		}
		actor_pool_request req = {
			.data = j->data + j->head_len,
			.len = j->msg_len,
			.is_binary = j->is_binary,
			.is_ask = j->is_ask,
			.worker = (uint32_t)w->id,
		};
		w->reply.len = 0;
		set_atom_reply(&w->reply, "ok");
		actor_pool_status st = p->h->handle(state, &req, &w->reply);
		if (st == AP_HANDLER_CRASH) {
			atomic_fetch_add(&w->crashes, 1);
			if (j->is_ask)
				send_error_atom(w, j, "worker_crashed");
			mbox_done(&w->mb);
			w->exit_reason = EXIT_CRASH;
			break;
		}
		atomic_fetch_add_explicit(&w->processed, 1, memory_order_relaxed);
		if (st != AP_HANDLER_OK)
			atomic_fetch_add_explicit(&w->errors, 1, memory_order_relaxed);
		if (j->is_ask)
			send_result(w, j, st == AP_HANDLER_OK ? "ok" : "error", &w->reply);
		mbox_done(&w->mb);
	}
	if (p->h->terminate)
		p->h->terminate(state);
	ap_node_call_on_loop(p->n, worker_exited, w);
	return NULL;
}

static int worker_start(ap_worker *w)
{
	atomic_store(&w->stop, 0);
	atomic_store(&w->alive, 1);
	w->started_ms = ap_node_now_ms(w->pool->n);
	if (pthread_create(&w->th, NULL, worker_main, w)) {
		atomic_store(&w->alive, 0);
		return -1;
	}
	w->thread_live = 1;
	w->pool->threads++;
	return 0;
}

/* ---- routing ---------------------------------------------------------------- */

static int alive(ap_worker *w) { return atomic_load_explicit(&w->alive, memory_order_relaxed); }

/* Pick a worker with room, or NULL (overloaded). Round robin walks the
 * slots; random starts anywhere; smallest_mailbox compares two random
 * slots (power of two choices): O(1) per message and no lock, yet it keeps
 * the maximum depth within a small factor of the ideal. Dead slots are
 * skipped; full ones are passed over up to ROUTE_TRIES times. */
static ap_worker *route(ap_pool *p)
{
	int nw = p->o.workers;
	uint32_t start;
	switch (p->o.routing) {
	case AP_ROUTE_RANDOM:
		start = (uint32_t)(xorshift(&p->rng) % (uint64_t)nw);
		break;
	case AP_ROUTE_SMALLEST_MAILBOX: {
		uint64_t r = xorshift(&p->rng);
		uint32_t a = (uint32_t)(r % (uint64_t)nw), b = a;
		if (nw > 1) /* two distinct slots: comparing one with itself picks blindly */
			b = (a + 1 + (uint32_t)((r >> 32) % (uint64_t)(nw - 1))) % (uint32_t)nw;
		ap_worker *wa = &p->w[a], *wb = &p->w[b];
		if (!alive(wa) || (alive(wb) && mbox_depth(&wb->mb) < mbox_depth(&wa->mb)))
			a = b;
		start = a;
		break;
	}
	default:
		start = (uint32_t)(p->rr++ % (uint64_t)nw);
		break;
	}
	int tries = 0, any_alive = 0;
	for (int k = 0; k < nw && tries < ROUTE_TRIES; k++) {
		ap_worker *w = &p->w[(start + (uint32_t)k) % (uint32_t)nw];
		if (!alive(w))
			continue;
		any_alive = 1;
		tries++;
		if (mbox_depth(&w->mb) < p->o.mailbox_limit)
			return w;
	}
	if (!any_alive) {
		/* Every slot waits for its replacement: queue for it. */
		ap_worker *w = &p->w[start];
		if (mbox_depth(&w->mb) < p->o.mailbox_limit)
			return w;
	}
	return NULL;
}

/* Wakes are deferred to the end of the message being dispatched (see
 * wake_pushed): a worker woken per job would drain its one job and sleep
 * again while the loop is still unpacking the rest of a batch. */
static void push(ap_worker *w, ap_job *j)
{
	mbox_push(&w->mb, j);
	if (!w->wake_pending) {
		w->wake_pending = 1;
		w->pool->wake_list[w->pool->nwake++] = w->id;
	}
}

static void wake_pushed(ap_pool *p)
{
	for (int k = 0; k < p->nwake; k++) {
		ap_worker *w = &p->w[p->wake_list[k]];
		w->wake_pending = 0;
		wake(w, 0);
	}
	p->nwake = 0;
}

/* Route one message. msg/msg_len: a term without its 131 byte. For an ask,
 * the reply head is in p->scratch from head_start and node names the
 * caller's node. */
static void dispatch(ap_pool *p, const char *msg, int msg_len, int is_ask, size_t head_start, const char *node)
{
	ap_worker *w = route(p);
	if (!w) {
		if (is_ask) {
			p->overloaded++;
			loop_error_reply(p, head_start, node, "overloaded");
		} else {
			p->dropped_tells++;
		}
		return;
	}
	int is_binary = msg_len >= 5 && (uint8_t)msg[0] == 109;
	size_t body = is_binary ? (size_t)msg_len - 5 : (size_t)msg_len + 1;
	size_t head = is_ask ? p->scratch.len - head_start : 0;
	size_t nodelen = is_ask ? strlen(node) + 1 : 0;
	ap_job *j = job_alloc(&w->mb, &w->job_cache, head + body + nodelen);
	if (!j) {
		if (is_ask)
			loop_error_reply(p, head_start, node, "enomem");
		return;
	}
	j->is_ask = (uint8_t)is_ask;
	j->is_binary = (uint8_t)is_binary;
	j->head_len = (uint32_t)head;
	j->msg_len = (uint32_t)body;
	j->node_len = (uint32_t)nodelen;
	uint8_t *d = j->data;
	if (head)
		memcpy(d, p->scratch.data + head_start, head);
	d += head;
	if (is_binary) {
		memcpy(d, msg + 5, body);
	} else {
		d[0] = 131;
		memcpy(d + 1, msg, (size_t)msg_len);
	}
	d += body;
	if (nodelen)
		memcpy(d, node, nodelen);
	push(w, j);
}

/* ---- the pool process ---------------------------------------------------------- */

/* The end of the term at b[i] in a message of len bytes, by the walk: what
 * dispatch copies and what a reply carries never reach past what the walk
 * vouched for (ei_skip_term trusts a fun's Size and a binary's length). */
static int term_end(const char *b, int len, int i)
{
	return len < 0 ? -1 : ap_term_end(b, (size_t)len, i);
}

static void encode_stats(ap_pool *p, ei_x_buff *x);

static void ask(ap_pool *p, const erlang_pid *caller, const char *tag, int tag_len, const char *msg, int msg_len)
{
	p->scratch.len = 0;
	size_t st = ap_encode_reply_head(&p->scratch, &p->pid, caller, tag, tag_len);
	if (st == (size_t)-1)
		return;
	dispatch(p, msg, msg_len, 1, st, caller->node);
}

/* {'$ap_batch', [{tell, Msg} | {ask, Pid, Tag, Msg}]} in b[0..len) */
static int batch(ap_pool *p, const char *b, int len, int i)
{
	int arity, n, type, size;
	if (ei_get_type(b, &i, &type, &size) || (type != ERL_LIST_EXT && type != ERL_NIL_EXT))
		return 0;
	if (type == ERL_NIL_EXT)
		return 1;
	if (ei_decode_list_header(b, &i, &n))
		return 0;
	for (int k = 0; k < n; k++) {
		char tag[8];
		int e = term_end(b, len, i);
		if (e < 0)
			return 1;
		static const char tell_hdr[] = { 104, 2, 119, 4, 't', 'e', 'l', 'l' };
		if (e - i > (int)sizeof tell_hdr && !memcmp(b + i, tell_hdr, sizeof tell_hdr)) {
			/* The common case, {tell, Msg} as a BEAM encodes it. */
			i += sizeof tell_hdr;
			dispatch(p, b + i, e - i, 0, 0, NULL);
			i = e;
			continue;
		}
		if (ei_decode_tuple_header(b, &i, &arity) || ei_get_type(b, &i, &type, &size) ||
		    type != ERL_ATOM_EXT || size >= (int)sizeof tag ||
		    ei_decode_atom_as(b, &i, tag, sizeof tag, ERLANG_UTF8, NULL, NULL)) {
			i = e;
			continue;
		}
		if (arity == 2 && !strcmp(tag, "tell")) {
			dispatch(p, b + i, e - i, 0, 0, NULL);
		} else if (arity == 4 && !strcmp(tag, "ask")) {
			erlang_pid caller;
			if (ei_get_type(b, &i, &type, &size) == 0 && type == ERL_PID_EXT &&
			    ei_decode_pid(b, &i, &caller) == 0) {
				int t0 = i, t1 = term_end(b, e, i);
				if (t1 > 0)
					ask(p, &caller, b + t0, t1 - t0, b + t1, e - t1);
			}
		}
		i = e;
	}
	return 1;
}

static int is_batch(const char *b, int i, int *list)
{
	int arity, type, size;
	char a[16];
	if (ei_decode_tuple_header(b, &i, &arity) || arity != 2 || ei_get_type(b, &i, &type, &size) ||
	    type != ERL_ATOM_EXT || size >= (int)sizeof a ||
	    ei_decode_atom_as(b, &i, a, sizeof a, ERLANG_UTF8, NULL, NULL) || strcmp(a, "$ap_batch"))
		return 0;
	*list = i;
	return 1;
}

static int is_atom(const char *b, int i, const char *want)
{
	int type, size;
	char a[32];
	return ei_get_type(b, &i, &type, &size) == 0 && type == ERL_ATOM_EXT && size < (int)sizeof a &&
	       ei_decode_atom_as(b, &i, a, sizeof a, ERLANG_UTF8, NULL, NULL) == 0 && !strcmp(a, want);
}

static void pool_fn(ap_node *n, ap_proc *self, const ap_msg *m)
{
	ap_pool *p = self->state;
	int e, list;
	switch (m->kind) {
	case AP_MSG_CALL:
		if (is_atom(m->buf, m->index, "$ap_stats")) {
			ei_x_buff x;
			if (ei_x_new(&x))
				return;
			encode_stats(p, &x);
			ap_reply(n, self, m, x.buff, x.index);
			ei_x_free(&x);
			return;
		}
		e = term_end(m->buf, m->len, m->index);
		if (e > 0)
			ask(p, &m->from, m->tag, m->tag_len, m->buf + m->index, e - m->index);
		break;
	case AP_MSG_CAST:
		e = term_end(m->buf, m->len, m->index);
		if (e > 0)
			dispatch(p, m->buf + m->index, e - m->index, 0, 0, NULL);
		break;
	case AP_MSG_INFO:
		if (is_batch(m->buf, m->index, &list) && batch(p, m->buf, m->len, list))
			break;
		dispatch(p, m->buf + 1, m->len - 1, 0, 0, NULL);
		break;
	case AP_MSG_EXIT:
		break;
	}
	wake_pushed(p);
}

/* ---- life cycle ------------------------------------------------------------------ */

static void pool_free(ap_pool *p)
{
	ap_pool **pp = &pools;
	while (*pp && *pp != p)
		pp = &(*pp)->next;
	if (*pp)
		*pp = p->next;
	for (int i = 0; i < p->o.workers; i++) {
		ap_worker *w = &p->w[i];
		if (w->mb.head) {
			/* A slot that never got its replacement: answer what waits. */
			ap_job *j;
			while ((j = mbox_pop(&w->mb))) {
				if (j->is_ask)
					send_error_atom(w, j, "stopped");
				mbox_done(&w->mb);
			}
			mbox_destroy(&w->mb);
		}
		free_list(w->job_cache);
		pthread_mutex_destroy(&w->mu);
		pthread_cond_destroy(&w->cv);
		free(w->reply.data);
		ap_buf_free(&w->out);
	}
	if (p->dl)
		ap_plugin_unload(p->dl);
	free(p->w);
	free(p->wake_list);
	free(p->config);
	ap_buf_free(&p->scratch);
	free(p);
}

static void pool_free_cb(ap_node *n, void *arg)
{
	(void)n;
	pool_free(arg);
}

/* Free once nothing refers to the pool any more; later, from the loop, so
 * no caller up the stack is left holding it. */
static void maybe_free(ap_pool *p)
{
	if (p->stopping && !p->freeing && p->threads == 0 && p->timers == 0) {
		p->freeing = 1;
		if (ap_node_call_on_loop(p->n, pool_free_cb, p))
			p->freeing = 0;
	}
}

static void answer_start(ap_pool *p, int ok)
{
	ap_pending_reply *r = p->start_reply;
	if (!r)
		return;
	p->start_reply = NULL;
	ei_x_buff x;
	if (ei_x_new(&x) == 0) {
		ei_x_encode_tuple_header(&x, 2);
		if (ok) {
			ei_x_encode_atom(&x, "ok");
			ei_x_encode_pid(&x, &p->pid);
		} else {
			ei_x_encode_atom(&x, "error");
			ei_x_encode_tuple_header(&x, 2);
			ei_x_encode_atom(&x, "handler_init_failed");
			ei_x_encode_long(&x, p->init_failed);
		}
		if (ap_buf_append(&r->head, x.buff, (size_t)x.index) == 0 && ap_frame_end(&r->head, 0) == 0)
			ap_node_post(p->n, r->node, r->head.data, r->head.len);
		ei_x_free(&x);
	}
	ap_buf_free(&r->head);
	free(r);
}

static void first_init_reported(ap_pool *p)
{
	if (--p->starting > 0)
		return;
	if (p->init_failed) {
		ap_log(AP_LOG_WARNING, "pool %s: handler %s init failed (%d); not started", p->name, p->handler_desc,
		       p->init_failed);
		answer_start(p, 0);
		ap_pool_stop(p->n, p);
	} else {
		ap_log(AP_LOG_INFO, "pool %s started: %d workers, handler %s", p->name, p->o.workers, p->handler_desc);
		answer_start(p, 1);
	}
}

static void worker_ready(ap_node *n, void *arg)
{
	(void)n;
	ap_worker *w = arg;
	first_init_reported(w->pool);
}

static void restart(ap_node *n, void *arg)
{
	ap_worker *w = arg;
	ap_pool *p = w->pool;
	p->timers--;
	w->restart_pending = 0;
	if (p->stopping) {
		maybe_free(p);
		return;
	}
	(void)n;
	w->gen++;
	w->restarts++;
	if (worker_start(w))
		ap_log(AP_LOG_ERROR, "pool %s: cannot start a thread for worker %d", p->name, w->id);
}

/* Move the jobs of a dead worker to live ones; none is dropped silently. */
static void redistribute(ap_pool *p, ap_worker *dead)
{
	int others = 0;
	for (int i = 0; i < p->o.workers; i++)
		others += &p->w[i] != dead && alive(&p->w[i]);
	if (!others)
		return; /* they wait for the replacement */
	ap_job *j;
	uint64_t moved = 0;
	while (!mbox_empty(&dead->mb)) {
		/* The loop is the consumer now: the worker thread is joined. A
		 * popped job stays the dummy, so copy it before re-queueing. */
		j = mbox_pop(&dead->mb);
		mbox_done(&dead->mb);
		ap_worker *w = route(p);
		if (!w) {
			/* Everyone is full: over the limit rather than lost. */
			for (int i = 0; i < p->o.workers; i++)
				if (&p->w[i] != dead && alive(&p->w[i])) {
					w = &p->w[i];
					break;
				}
		}
		size_t need = (size_t)j->head_len + j->msg_len + j->node_len;
		ap_job *c = job_alloc(&w->mb, &w->job_cache, need);
		if (!c)
			break;
		c->is_ask = j->is_ask;
		c->is_binary = j->is_binary;
		c->head_len = j->head_len;
		c->msg_len = j->msg_len;
		c->node_len = j->node_len;
		memcpy(c->data, j->data, need);
		push(w, c);
		moved++;
	}
	wake_pushed(p);
	if (moved)
		ap_log(AP_LOG_INFO, "pool %s: moved %llu queued messages off crashed worker %d", p->name,
		       (unsigned long long)moved, dead->id);
}

static int backoff_ms(ap_pool *p, ap_worker *w)
{
	double d = p->o.backoff_min_ms;
	for (int i = 1; i < w->streak && d < p->o.backoff_max_ms; i++)
		d *= 2;
	if (d > p->o.backoff_max_ms)
		d = p->o.backoff_max_ms;
	double u = (double)(xorshift(&p->rng) >> 11) / (double)(1ULL << 53);
	d *= 1.0 - p->o.jitter * u;
	return d < 1 ? 1 : (int)d;
}

static void worker_exited(ap_node *n, void *arg)
{
	ap_worker *w = arg;
	ap_pool *p = w->pool;
	pthread_join(w->th, NULL);
	w->thread_live = 0;
	p->threads--;
	atomic_store(&w->alive, 0);

	if (w->exit_reason == EXIT_INIT_FAILED && w->gen == 0) {
		if (!p->init_failed)
			p->init_failed = w->init_rc ? w->init_rc : -1;
		first_init_reported(p);
		maybe_free(p);
		return;
	}
	if (p->stopping) {
		maybe_free(p);
		return;
	}
	/* A crash (or a replacement whose init failed): replace it later. */
	int64_t now = ap_node_now_ms(n);
	if (now - w->started_ms >= p->o.stable_ms)
		w->streak = 0;
	w->streak++;
	w->next_restart_ms = backoff_ms(p, w);
	ap_log(AP_LOG_WARNING, "pool %s: worker %d %s; replacing it in %d ms (crash %d in a row)", p->name, w->id,
	       w->exit_reason == EXIT_CRASH ? "crashed" : "failed its init", w->next_restart_ms, w->streak);
	redistribute(p, w);
	if (ap_node_timer(n, w->next_restart_ms, restart, w) == 0) {
		p->timers++;
		w->restart_pending = 1;
	}
}

static int online_cpus(void)
{
	long c = sysconf(_SC_NPROCESSORS_ONLN);
	return c > 0 ? (int)(c > MAX_WORKERS ? MAX_WORKERS : c) : 4;
}

int ap_pool_start(ap_node *n, const char *name, const char *handler_desc, const actor_pool_handler *h, void *dl,
		  const uint8_t *config, size_t config_len, const ap_pool_opts *o, ap_pending_reply *reply)
{
	if (ap_proc_whereis(n, name))
		return -EEXIST;
	ap_pool *p = calloc(1, sizeof *p);
	if (!p)
		return -ENOMEM;
	p->n = n;
	p->o = *o;
	if (p->o.workers <= 0)
		p->o.workers = online_cpus();
	snprintf(p->name, sizeof p->name, "%s", name);
	snprintf(p->handler_desc, sizeof p->handler_desc, "%s", handler_desc);
	p->w = calloc((size_t)p->o.workers, sizeof *p->w);
	p->wake_list = calloc((size_t)p->o.workers, sizeof *p->wake_list);
	if (config_len) {
		p->config = malloc(config_len);
		if (p->config)
			memcpy(p->config, config, config_len);
	}
	if (!p->w || !p->wake_list || (config_len && !p->config))
		goto nomem;
	for (int i = 0; i < p->o.workers; i++) {
		ap_worker *w = &p->w[i];
		w->pool = p;
		w->id = i;
		pthread_mutex_init(&w->mu, NULL);
		pthread_cond_init(&w->cv, NULL);
		if (mbox_init(&w->mb))
			goto nomem;
	}
	p->proc = ap_proc_spawn(n, name, pool_fn, p);
	if (!p->proc)
		goto nomem;
	p->pid = p->proc->pid;
	p->h = h;
	p->dl = dl;
	p->config_len = config_len;
	p->rng = (uint64_t)time(NULL) * 0x9E3779B97F4A7C15ULL ^ (uint64_t)(uintptr_t)p;
	if (!p->rng)
		p->rng = 1;
	p->started_ms = p->tp_last_ms = ap_node_now_ms(n);
	p->start_reply = reply;
	p->starting = p->o.workers;
	/* Append: which_pools lists in start order. */
	ap_pool **pp = &pools;
	while (*pp)
		pp = &(*pp)->next;
	*pp = p;
	for (int i = 0; i < p->o.workers; i++)
		if (worker_start(&p->w[i])) {
			p->init_failed = -EAGAIN;
			first_init_reported(p);
		}
	return 0;
nomem:
	if (p->w)
		for (int i = 0; i < p->o.workers; i++)
			if (p->w[i].mb.head)
				mbox_destroy(&p->w[i].mb);
	free(p->w);
	free(p->wake_list);
	free(p->config);
	free(p);
	return -ENOMEM;
}

void ap_pool_stop(ap_node *n, ap_pool *p)
{
	if (p->stopping)
		return;
	p->stopping = 1;
	if (p->proc) {
		ap_proc_exit(n, p->proc, "shutdown");
		p->proc = NULL;
	}
	for (int i = 0; i < p->o.workers; i++) {
		ap_worker *w = &p->w[i];
		atomic_store(&w->stop, 1);
		wake(w, 1);
	}
	ap_log(AP_LOG_INFO, "pool %s stopping", p->name);
	maybe_free(p);
}

ap_pool *ap_pool_find(ap_node *n, const char *name, const erlang_pid *pid)
{
	(void)n;
	for (ap_pool *p = pools; p; p = p->next) {
		if (p->stopping)
			continue;
		if (name && !strcmp(p->name, name))
			return p;
		if (pid && pid->num == p->pid.num && pid->serial == p->pid.serial && pid->creation == p->pid.creation &&
		    !strcmp(pid->node, p->pid.node))
			return p;
	}
	return NULL;
}

int ap_pool_encode_list(ei_x_buff *x)
{
	int count = 0;
	for (ap_pool *p = pools; p; p = p->next)
		count += !p->stopping;
	if (count)
		ei_x_encode_list_header(x, count);
	for (ap_pool *p = pools; p; p = p->next) {
		if (p->stopping)
			continue;
		ei_x_encode_tuple_header(x, 2);
		ei_x_encode_atom(x, p->name);
		ei_x_encode_pid(x, &p->pid);
	}
	return ei_x_encode_empty_list(x);
}

static const char *routing_name(ap_routing r)
{
	return r == AP_ROUTE_RANDOM ? "random" : r == AP_ROUTE_SMALLEST_MAILBOX ? "smallest_mailbox" : "round_robin";
}

static void kv_u64(ei_x_buff *x, const char *k, uint64_t v)
{
	ei_x_encode_atom(x, k);
	ei_x_encode_ulonglong(x, v);
}

static void encode_stats(ap_pool *p, ei_x_buff *x)
{
	uint64_t processed = 0, errors = 0, crashes = 0, restarts = 0;
	for (int i = 0; i < p->o.workers; i++) {
		processed += atomic_load(&p->w[i].processed);
		errors += atomic_load(&p->w[i].errors);
		crashes += atomic_load(&p->w[i].crashes);
		restarts += p->w[i].restarts;
	}
	ei_x_encode_map_header(x, 14);
	ei_x_encode_atom(x, "name");
	ei_x_encode_atom(x, p->name);
	kv_u64(x, "size", (uint64_t)p->o.workers);
	ei_x_encode_atom(x, "routing");
	ei_x_encode_atom(x, routing_name(p->o.routing));
	ei_x_encode_atom(x, "handler");
	ei_x_encode_binary(x, p->handler_desc, (long)strlen(p->handler_desc));
	kv_u64(x, "processed", processed);
	kv_u64(x, "errors", errors);
	kv_u64(x, "crashes", crashes);
	kv_u64(x, "restarts", restarts);
	kv_u64(x, "overloaded", p->overloaded);
	kv_u64(x, "dropped_tells", p->dropped_tells);
	ei_x_encode_atom(x, "throughput");
	ei_x_encode_double(x, p->throughput);
	kv_u64(x, "uptime_ms", (uint64_t)(ap_node_now_ms(p->n) - p->started_ms));
	kv_u64(x, "mailbox_limit", p->o.mailbox_limit);
	ei_x_encode_atom(x, "workers");
	ei_x_encode_list_header(x, p->o.workers);
	for (int i = 0; i < p->o.workers; i++) {
		ap_worker *w = &p->w[i];
		ei_x_encode_map_header(x, 7);
		kv_u64(x, "id", (uint64_t)i);
		ei_x_encode_atom(x, "alive");
		ei_x_encode_atom(x, alive(w) ? "true" : "false");
		kv_u64(x, "mailbox", mbox_depth(&w->mb));
		kv_u64(x, "processed", atomic_load(&w->processed));
		kv_u64(x, "restarts", w->restarts);
		kv_u64(x, "crashes", atomic_load(&w->crashes));
		kv_u64(x, "next_restart_ms", (uint64_t)w->next_restart_ms);
	}
	ei_x_encode_empty_list(x);
}

void ap_pool_tick(ap_node *n, void *arg)
{
	int64_t now = ap_node_now_ms(n);
	for (ap_pool *p = pools; p; p = p->next) {
		uint64_t processed = 0;
		for (int i = 0; i < p->o.workers; i++)
			processed += atomic_load_explicit(&p->w[i].processed, memory_order_relaxed);
		if (now > p->tp_last_ms)
			p->throughput = (double)(processed - p->tp_last) * 1000.0 / (double)(now - p->tp_last_ms);
		p->tp_last = processed;
		p->tp_last_ms = now;
	}
	ap_node_timer(n, 1000, ap_pool_tick, arg);
}

int ap_pool_dead_letter(ap_node *n, ap_proc *self, const ap_msg *m)
{
	int list, k, nitems, arity, type, size;
	if (m->kind != AP_MSG_INFO || !is_batch(m->buf, m->index, &list))
		return 0;
	const char *b = m->buf;
	int i = list;
	if (ei_get_type(b, &i, &type, &size) || type != ERL_LIST_EXT || ei_decode_list_header(b, &i, &nitems))
		return 1;
	static const char noproc[] = { 104, 2, 119, 5, 'e', 'r', 'r', 'o', 'r', 119, 6, 'n', 'o', 'p', 'r', 'o', 'c' };
	ap_buf out = { 0 };
	for (k = 0; k < nitems; k++) {
		int e = term_end(b, m->len, i);
		char tag[8];
		erlang_pid caller;
		if (e < 0)
			break;
		if (ei_decode_tuple_header(b, &i, &arity) == 0 && arity == 4 && ei_get_type(b, &i, &type, &size) == 0 &&
		    type == ERL_ATOM_EXT && size < (int)sizeof tag &&
		    ei_decode_atom_as(b, &i, tag, sizeof tag, ERLANG_UTF8, NULL, NULL) == 0 && !strcmp(tag, "ask") &&
		    ei_get_type(b, &i, &type, &size) == 0 && type == ERL_PID_EXT && ei_decode_pid(b, &i, &caller) == 0) {
			int t0 = i, t1 = term_end(b, e, i);
			out.len = 0;
			if (t1 > 0 && ap_encode_reply(&out, &self->pid, &caller, b + t0, t1 - t0, noproc, sizeof noproc) == 0)
				ap_node_post(n, caller.node, out.data, out.len);
		}
		i = e;
	}
	ap_buf_free(&out);
	return 1;
}
