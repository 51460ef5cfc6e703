/* fuzz_iso_channel: libFuzzer target over the pool node's side of a worker
 * process's channel (pool/isolate.c, isolate_proxy.c, isolate_loop.c): what
 * the proxy and the loop make of everything a worker process can write,
 * since a plugin runs there and may write anything into the shared memory
 * it maps.
 *
 * The three isolate files are compiled into this file (the proxy's and the
 * loop's reading is static, on the slot's private struct, isolate_node.h);
 * dispatch.c, dist_ingress.c, reply.c, mailbox.c, the ring and the term
 * codec are linked as they are. Nothing of them is changed for the fuzzer.
 * The rest of the pool node is stubbed below, and so is posix_spawn (-Wl,
 * --wrap): a slot's channel is made by ap_iso_slot_init and set up for
 * each input by iso_spawn itself, whose spawn then fails, so no process is
 * ever started; this file plays the worker process, on one thread with the
 * loop and the proxy.
 *
 * Messages come in as the two ingresses hand them on: by distribution,
 * a call or a cast to the pool process (dist_ingress.c, ap_pool_process,
 * whose asks carry the real distribution route: a frame to the caller's
 * node, ap_node_post below); by ring, ap_pool_dispatch with the test's
 * ring route (t_ring_route below: batched as the rings' is, a hold per
 * ask, -EAGAIN to the loop while the reply ring is full). Then the wake
 * pass (ap_pool_wake_pushed), and the proxy, awake, sends what is left.
 *
 * What is driven, all on a real channel: dispatch's routing, overload
 * answers and post_tell (ap_iso_send_tell, bare tells); the loop's wake
 * pass (ap_iso_wake: send_direct, take_done_direct), ap_iso_reclaim,
 * ap_iso_take_direct, ap_iso_harvest and ap_iso_rehydrate; the proxy's
 * iso_send_jobs, drain_results, on_death and take_fail; every answer by
 * reply.c (ap_answer, ap_answer_error, ap_answer_loop) and its route.
 *
 * Input: byte 0 = mode (bit 0: the loop takes the results while the proxy
 * sleeps, else the proxy; bit 1: reply rings are full, so the loop leaves
 * ring answers to the proxy; bit 2: the largest size is, once, a message over
 * one record; bit 3: the mailbox holds T_SMALL_LIMIT, so dispatch finds it
 * full and answers overloaded), byte 1 = jobs (1..24), then a byte per job
 * (bits 0-1: a tell or an ask, by distribution or by ring, a ring tell
 * going bare when the channel lets it; bit 2: a binary; the rest: its
 * size). They are dispatched and sent; then ops until the input ends, a
 * byte each and its arguments:
 *   0 a record of any header and bytes into the result ring;
 *   1 the next message the child read, run as a child runs it: a result
 *     record (status, reply kind, reply bytes), or for a tell run ok no
 *     record but done_seq;
 *   2 done_seq moved anywhere near the front;
 *   3 a word of the run-time histogram, then a harvest;
 *   4 the start-failure report (kind, number, layer, why, unterminated),
 *     then take_fail;
 *   5 the results taken now (the proxy's drain or the loop's take);
 *   6 bytes written anywhere in the result ring, the request ring or the
 *     channel's head;
 *   7 one more job.
 * At the end the child dies (killed), the proxy answers what it died on
 * (on_death), the loop makes jobs of the bare tells it had not run
 * (ap_iso_rehydrate), and what is left in the mailbox is taken out, each
 * ask's route dropped (as a job lost).
 *
 * Checked: no access out of bounds (ASan); every answer is one frame
 * (by distribution: SEND of {Tag, {Status, Reply}} to the caller) or one
 * ring answer whose terms a BEAM takes (ap_term_check, the receiving
 * node's limits); an ask is answered at most once and a tell never; every
 * ring ask's route hold is released once (answered or dropped), and no
 * other; in the end every ask was answered or is still in the mailbox,
 * every route hold was released, the mailbox's depth is 0; the pool's
 * processed count is no more than the messages sent; the run-time
 * histogram only grows; the failure report is NUL-terminated.
 */
#include <spawn.h>

#include "../pool/isolate.c"
#include "../pool/isolate_loop.c"
#include "../pool/isolate_proxy.c"

#include "ap_atomset.h"
#include "ap_ctrl.h"
#include "ring_ingress.h"
#include "sandbox.h"

#include "t_fuzz.h"

#define T_MAX_JOBS 64
#define T_NODE "beam@host"
#define T_SMALL_LIMIT 6 /* mailbox_limit with mode bit 3 */

static ap_pool t_p;
static ap_worker t_w;
static ap_proc t_proc; /* the pool process, for dist_ingress.c */
static int t_wake_list[1];
static int t_full;              /* ring answers find no room (mode bit 1) */
static int t_big;               /* size 31 is a message over a record (mode bit 2) */
static unsigned t_jobs;         /* made this input: job ids are 1..t_jobs */
static uint8_t t_is_ask[T_MAX_JOBS + 1], t_answered[T_MAX_JOBS + 1], t_ring[T_MAX_JOBS + 1];
/* The ring route's holds: one per ring ask, released once (t_held[id]). */
static struct {
	int refs;
} t_seg;
static uint8_t t_held[T_MAX_JOBS + 1];
static struct ap_ring t_creq, t_crsp; /* the child's ends */
static erlang_pid t_caller;
static ap_term_strict t_strict;

/* What the child read from its request ring: each whole message's seq and
 * whether it is an ask, in order; `run` of them done. */
static struct {
	uint64_t seq;
	uint8_t ask;
} t_read[T_MAX_JOBS * 2];
static unsigned t_nread, t_run;
static uint64_t t_part_seq; /* a message read in part */

/* ---- the rest of the pool node, stubbed ------------------------------------------ */

int ap_log(enum ap_log_level lvl, const char *fmt, ...)
{
	(void)lvl, (void)fmt;
	return 1;
}

int __wrap_posix_spawn(pid_t *pid, const char *path, const posix_spawn_file_actions_t *fa,
		       const posix_spawnattr_t *at, char *const argv[], char *const envp[]);
int __wrap_posix_spawn(pid_t *pid, const char *path, const posix_spawn_file_actions_t *fa,
		       const posix_spawnattr_t *at, char *const argv[], char *const envp[])
{
	(void)pid, (void)path, (void)fa, (void)at, (void)argv, (void)envp;
	return ENOSYS; /* the channel is set up; this file is the child */
}

const actor_pool_handler *ap_builtin_handler(const char *name)
{
	static const actor_pool_handler h;
	return strcmp(name, "echo") == 0 ? &h : NULL;
}

void ap_node_call_on_loop_sure(ap_node *n, ap_loop_fn fn, void *arg)
{
	(void)n, (void)fn, (void)arg;
	t_check(0); /* nothing here waits for a reap */
}

int ap_node_add_reader(ap_node *n, int fd, ap_loop_fn fn, void *arg)
{
	(void)n, (void)fd, (void)fn, (void)arg;
	t_check(0); /* no SIGCHLD watch here */
	return -1;
}

ap_pool *ap_pool_all(void)
{
	t_check(0); /* the loop's passes over every pool are not run here */
	return NULL;
}

int ap_pool_barrier_children(void) { return -1; }

/* No stall or timeout here: the watchdog is not run. */
void ap_wd_stalled(ap_worker *w)
{
	(void)w;
	t_check(0);
}

long long ap_wd_move_queue(ap_pool *p, ap_worker *w)
{
	(void)p, (void)w;
	t_check(0);
	return -1;
}

void ap_pool_worker_ready(ap_node *n, void *arg) { (void)n, (void)arg; }
void ap_pool_worker_exited(ap_node *n, void *arg) { (void)n, (void)arg; }

/* What dist_ingress.c reaches besides a pool's messages: the ring
 * ingress's poll (none here), '$ap_stats' and the dead letters (never
 * sent here). */
void ap_dp_poll_cancel(void) {}

void ap_pool_encode_stats(ap_pool *p, ei_x_buff *x)
{
	(void)p, (void)x;
	t_check(0);
}

int ap_reply(ap_node *n, const ap_proc *self, const ap_msg *call, const char *term, int len)
{
	(void)n, (void)self, (void)call, (void)term, (void)len;
	t_check(0);
	return -1;
}

void ap_pool_no_pool(const char *peer, const char *name, size_t name_len, const erlang_pid *pid, uint64_t tells)
{
	(void)peer, (void)name, (void)name_len, (void)pid, (void)tells;
	t_check(0);
}

void ap_sb_cgroup_make(struct ap_sb_cgroup *cg, const ap_sandbox_opts *o, int max_memory_mb)
{
	(void)o, (void)max_memory_mb;
	memset(cg, 0, sizeof *cg);
	cg->v2_procs = cg->v1_procs = -1;
}

void ap_sb_cgroup_kill(const struct ap_sb_cgroup *cg) { (void)cg; }
void ap_sb_cgroup_free(struct ap_sb_cgroup *cg) { (void)cg; }
int ap_sb_fd_above(int fd) { return fd; }

uint32_t ap_sb_layers(const ap_sandbox_opts *o, const struct ap_sb_cgroup *cg)
{
	(void)o, (void)cg;
	return 0;
}

int ap_sb_write(const ap_sandbox_opts *o, uint32_t layers, int plugin_fd, struct iso_sandbox *out, char *paths,
		size_t room)
{
	(void)o, (void)layers, (void)plugin_fd, (void)paths, (void)room;
	memset(out, 0, sizeof *out);
	return 0;
}

/* ---- answers, checked -------------------------------------------------------------- */

/* One answer to job `id`: an ask's, and its first. */
static void t_answer(unsigned id)
{
	t_check(id >= 1 && id <= t_jobs);
	t_check(t_is_ask[id] && !t_answered[id]);
	t_answered[id] = 1;
}

/* {Status, Reply}, no 131, as the receiving node decodes it. */
static void t_result(const char *t, size_t len, const char *node)
{
	int i = 0, arity;
	char status[MAXATOMLEN_UTF8];
	t_check(ei_decode_tuple_header(t, &i, &arity) == 0 && arity == 2);
	t_check(ei_decode_atom(t, &i, status) == 0 && (!strcmp(status, "ok") || !strcmp(status, "error")));
	t_strict.self_node = node;
	t_strict.self_node_len = strlen(node);
	int idx = i;
	t_check(ap_term_check(t, len, &idx, &t_strict) == 0 && (size_t)idx == len);
}

/* The ring ask's route hold r, released: once. */
static void t_release(const ap_route *r)
{
	t_check(r->ctx == &t_seg && r->id >= 1 && r->id <= t_jobs && t_ring[r->id] && t_is_ask[r->id]);
	t_check(t_held[r->id] && t_seg.refs > 0);
	t_held[r->id] = 0;
	t_seg.refs--;
}

/* The test's ring route, for the same-host rings' (ring_seg.c's
 * dp_ring_route): batched, an ask's id and a hold on its segment; no head
 * and no address; the answer is {Status, Reply} alone. A full reply ring
 * (mode bit 1) gives the loop -EAGAIN and keeps the hold; a worker waits
 * for room, and the loop's own errors are written, so every answer given
 * arrives. */
static int t_ring_send(const ap_route *r, const char *addr, uint8_t *b, size_t len, unsigned worker,
		       ap_send_mode mode)
{
	(void)addr;
	t_check(worker == 0);
	if (t_full && mode == AP_SEND_NOWAIT)
		return -EAGAIN;
	t_release(r);
	t_answer((unsigned)r->id);
	t_result((const char *)b, len, T_NODE);
	return 0;
}

static void t_ring_drop(const ap_route *r) { t_release(r); }

static const char *t_ring_peer(const ap_route *r, const char *addr)
{
	(void)addr;
	t_check(r->ctx == &t_seg);
	return T_NODE;
}

static const ap_route_ops t_ring_route = { .send = t_ring_send, .drop = t_ring_drop, .peer = t_ring_peer,
					   .batched = 1 };

/* A distribution answer (dist_ingress.c's route): a whole frame to the
 * caller's node. */
int ap_node_post(ap_node *n, const char *node, const uint8_t *frame, size_t len)
{
	t_check(n == t_p.n);
	t_check(strcmp(node, T_NODE) == 0);
	t_check(len > 4 && ap_get32be(frame) == len - 4);
	uint8_t *f = malloc(len - 4);
	t_check(f != NULL);
	memcpy(f, frame + 4, len - 4);
	ap_ctrl c;
	t_check(ap_ctrl_decode(f, len - 4, &c) == 0);
	t_check(c.op == AP_OP_SEND && c.to.num == t_caller.num);
	/* {Tag, {Status, Reply}}: the tag is the job's id. */
	const char *m = c.msg;
	int i = 1, arity;
	unsigned long id;
	t_check(ei_decode_tuple_header(m, &i, &arity) == 0 && arity == 2 && ei_decode_ulong(m, &i, &id) == 0);
	t_check(id >= 1 && id <= t_jobs && !t_ring[id]);
	t_answer((unsigned)id);
	t_result(m + i, (size_t)(c.msg_len - i), T_NODE);
	free(f);
	return 0;
}

/* ---- the loop's side --------------------------------------------------------------- */

/* A message for this worker as an ingress hands it on: by distribution,
 * the pool process's call or cast (dist_ingress.c); by ring, a request
 * with the test's ring route (a ring tell may go bare: ap_iso_send_tell,
 * while the proxy sleeps and lets the loop hold the channel). Then the
 * wake pass, and the proxy, awake, sends what is left. */
static void t_job(uint8_t kind)
{
	if (t_jobs >= T_MAX_JOBS)
		return;
	unsigned id = ++t_jobs;
	int ask = kind & 1, ring = (kind >> 1) & 1, binary = (kind >> 2) & 1;
	size_t size = (size_t)(kind >> 3) * 97;
	if ((kind >> 3) == 31 && t_big) {
		size = 270000; /* over one record of the request ring: sent in two */
		t_big = 0;     /* once per input: they are slow to make */
	}
	/* The message: a term without 131. */
	uint8_t *msg = malloc(size + 16);
	t_check(msg != NULL);
	int msg_len;
	if (binary) {
		msg[0] = 109;
		ap_put32be(msg + 1, (uint32_t)(size + 4));
		ap_put32be(msg + 5, id);
		memset(msg + 9, 'm', size);
		msg_len = (int)size + 9;
	} else {
		int i = 0;
		ei_encode_tuple_header((char *)msg, &i, 2);
		ei_encode_ulong((char *)msg, &i, id);
		msg[i] = 106; /* [] */
		msg_len = i + 1;
	}
	t_is_ask[id] = (uint8_t)ask;
	t_ring[id] = (uint8_t)ring;
	t_answered[id] = 0;
	t_held[id] = 0;
	if (ring) {
		/* The proxy sleeps in its main loop: the loop may hold its
		 * channel (bare tells; the wake pass sends). */
		atomic_store(&t_w.iso->direct_ok, 1);
		if (ask) {
			t_seg.refs++; /* the ring ingress's hold, before it dispatches */
			t_held[id] = 1;
		}
		ap_pool_dispatch(&t_p, &(ap_request){ .kind = ask ? AP_REQ_ASK : AP_REQ_TELL,
						      .route = { &t_ring_route, ask ? &t_seg : NULL, ask ? id : 0 },
						      .msg = (const char *)msg, .msg_len = msg_len });
		ap_pool_wake_pushed(&t_p);
		atomic_store(&t_w.iso->direct_ok, 0);
	} else {
		char tag[16];
		int tl = 0;
		ei_encode_ulong(tag, &tl, id);
		ap_msg m = { .kind = ask ? AP_MSG_CALL : AP_MSG_CAST, .buf = (const char *)msg, .len = msg_len,
			     .from = t_caller, .tag = ask ? tag : NULL, .tag_len = ask ? tl : 0 };
		ap_pool_process(t_p.n, &t_proc, &m); /* ends with its wake pass */
	}
	free(msg);
	/* The proxy, awake, sends what is queued. */
	pthread_mutex_lock(&t_w.iso->send_mu);
	(void)iso_send_jobs(&t_w);
	pthread_mutex_unlock(&t_w.iso->send_mu);
}

/* ---- the child's side ------------------------------------------------------------ */

/* Reads what was sent, as a child does (whole messages, from their
 * chunks); a ring it cannot read is the proxy's to notice. */
static void t_child_read(void)
{
	const void *p;
	size_t len;
	while (ap_ring_read(&t_creq, &p, &len) == 0) {
		struct iso_rec h;
		if (len < sizeof h)
			break;
		memcpy(&h, p, sizeof h);
		if (h.kind == REC_MSG && h.off + (len - sizeof h) >= h.total && t_nread < T_MAX_JOBS * 2) {
			t_read[t_nread].seq = h.seq;
			t_read[t_nread].ask = h.a;
			t_nread++;
			t_part_seq = 0;
		} else if (h.kind == REC_MSG) {
			t_part_seq = h.seq;
		}
	}
	ap_ring_release(&t_creq);
}

static void t_child_record(const struct iso_rec *h, const uint8_t *bytes, size_t n)
{
	void *rec;
	if (ap_ring_reserve(&t_crsp, sizeof *h + n, &rec))
		return;
	memcpy(rec, h, sizeof *h);
	memcpy((uint8_t *)rec + sizeof *h, bytes, n);
	(void)ap_ring_commit(&t_crsp);
}

/* The input, as it is used up. */
struct t_in {
	const uint8_t *p;
	size_t n;
};

static unsigned t_u8(struct t_in *in)
{
	if (!in->n)
		return 0;
	in->n--;
	return *in->p++;
}

static unsigned t_u16(struct t_in *in) { return t_u8(in) | t_u8(in) << 8; }

static uint64_t t_u64(struct t_in *in)
{
	uint64_t v = 0;
	for (int k = 0; k < 8; k++)
		v |= (uint64_t)t_u8(in) << (8 * k);
	return v;
}

/* Up to want bytes of the input. */
static const uint8_t *t_bytes(struct t_in *in, size_t want, size_t *got)
{
	const uint8_t *p = in->p;
	*got = want < in->n ? want : in->n;
	in->p += *got;
	in->n -= *got;
	return p;
}

static uint64_t t_hist_was[AP_HIST_BUCKETS + 1];

static void t_harvest(void)
{
	ap_iso_harvest(&t_w);
	for (unsigned k = 0; k <= AP_HIST_BUCKETS; k++) {
		uint64_t v = k < AP_HIST_BUCKETS ? atomic_load(&t_w.run_ns.n[k]) : atomic_load(&t_w.run_ns.sum_ns);
		t_check(v >= t_hist_was[k]);
		t_hist_was[k] = v;
	}
}

static int t_op(struct t_in *in, int loop_takes)
{
	ap_iso *s = t_w.iso;
	struct iso_ctl *c = s->ctl;
	size_t n;
	switch (t_u8(in) % 8) {
	case 0: { /* any record */
		struct iso_rec h = { 0 };
		h.seq = s->front_seq + (uint64_t)(int64_t)(int8_t)t_u8(in);
		h.total = t_u16(in);
		h.off = t_u16(in);
		h.kind = (uint8_t)t_u8(in);
		h.a = (uint8_t)t_u8(in);
		h.b = (uint8_t)t_u8(in);
		h.c = (uint8_t)t_u8(in);
		const uint8_t *b = t_bytes(in, t_u16(in), &n);
		t_child_record(&h, b, n);
		break;
	}
	case 1: { /* the next message run */
		unsigned st = t_u8(in) % 3, kind = t_u8(in) % 3;
		const uint8_t *b = t_bytes(in, t_u8(in), &n);
		t_child_read();
		if (t_run >= t_nread)
			break;
		uint64_t seq = t_read[t_run].seq;
		int ask = t_read[t_run].ask;
		t_run++;
		if (!ask && st == AP_HANDLER_OK) {
			atomic_store(&c->done_seq, seq);
		} else {
			struct iso_rec h = { .seq = seq, .total = (uint32_t)n, .kind = REC_RESULT, .a = (uint8_t)st,
					     .b = (uint8_t)kind };
			t_child_record(&h, b, n);
			atomic_store(&c->done_seq, seq);
		}
		break;
	}
	case 2:
		atomic_store(&c->done_seq, s->front_seq + (uint64_t)(int64_t)(int8_t)t_u8(in));
		break;
	case 3: {
		unsigned k = t_u8(in) % (AP_HIST_BUCKETS + 1);
		uint64_t v = t_u64(in);
		atomic_store(k < AP_HIST_BUCKETS ? &c->run_ns.n[k] : &c->run_ns.sum_ns, v);
		t_harvest();
		break;
	}
	case 4: {
		c->fail_kind = (uint32_t)t_u8(in);
		c->fail_num = (int32_t)t_u16(in);
		const uint8_t *b = t_bytes(in, sizeof c->fail_layer, &n);
		memset(c->fail_layer, 'L', sizeof c->fail_layer);
		memcpy(c->fail_layer, b, n);
		b = t_bytes(in, t_u8(in), &n);
		memset(c->fail_why, 'W', sizeof c->fail_why);
		memcpy(c->fail_why, b, n);
		take_fail(&t_w, c);
		t_check(memchr(t_w.init_fail.layer, 0, sizeof t_w.init_fail.layer) != NULL);
		t_check(memchr(t_w.init_fail.why, 0, sizeof t_w.init_fail.why) != NULL);
		break;
	}
	case 5:
		if (loop_takes) {
			/* The proxy sleeps in its main loop: the loop may. */
			atomic_store(&s->direct_ok, 1);
			(void)ap_iso_take_direct(&t_w, 1, 0);
			atomic_store(&s->direct_ok, 0);
		} else {
			int progress = 0;
			pthread_mutex_lock(&s->send_mu);
			int r = drain_results(&t_w, &progress);
			pthread_mutex_unlock(&s->send_mu);
			if (r)
				return -1; /* broken, or a handler crash: the child goes */
		}
		break;
	case 6: { /* anywhere the child can write */
		unsigned where = t_u8(in) % 3, off = t_u16(in);
		const uint8_t *b = t_bytes(in, t_u8(in), &n);
		uint8_t *mem = s->map.mem;
		size_t base, size;
		if (where == 0)
			base = s->layout.rsp_off, size = s->layout.rsp_size;
		else if (where == 1)
			base = s->layout.req_off, size = s->layout.req_size;
		else
			base = 0, size = ISO_CTL_SIZE;
		off %= (unsigned)size;
		if (n > size - off)
			n = size - off;
		memcpy(mem + base + off, b, n);
		break;
	}
	case 7:
		t_job((uint8_t)t_u8(in));
		break;
	}
	return 0;
}

/* ---- the target -------------------------------------------------------------- */

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
	(void)argc, (void)argv;
	ap_pool_opts_default(&t_p.o);
	t_p.o.workers = 1;
	t_p.o.isolation = AP_ISO_PROCESS;
	t_p.o.sandbox.off = 1;
	snprintf(t_p.name, sizeof t_p.name, "fuzz");
	t_p.spec = "echo";
	t_p.atoms = ap_atomset_new(t_p.o.max_reply_atoms);
	t_check(t_p.atoms != NULL);
	t_p.pid = (erlang_pid){ .node = "pool@host", .num = 3, .creation = 1 };
	t_caller = (erlang_pid){ .node = T_NODE, .num = 77, .creation = 1 };
	t_proc.pid = t_p.pid;
	t_proc.state = &t_p;
	t_w.pool = &t_p;
	t_w.ops = &ap_worker_processes;
	t_w.id = 0;
	atomic_store(&t_w.alive, 1);
	t_w.reply.reserve = ap_pool_reply_reserve;
	t_p.w = &t_w;
	t_p.wake_list = t_wake_list;
	t_check(ap_mbox_init(&t_w.mb) == 0);
	t_check(ap_iso_slot_init(&t_w) == 0);
	return 0;
}

/* The defaults a pool starts with (pool.c's, which is not linked). */
void ap_pool_opts_default(ap_pool_opts *o)
{
	memset(o, 0, sizeof *o);
	o->mailbox_limit = 10000;
	o->max_reply_atoms = 1024;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	struct t_in in = { data, size };
	ap_iso *s = t_w.iso;
	unsigned mode = t_u8(&in), jobs = 1 + t_u8(&in) % 24;
	t_full = mode & 2;
	t_big = mode & 4;
	t_p.o.mailbox_limit = mode & 8 ? T_SMALL_LIMIT : 10000;
	t_jobs = t_nread = t_run = 0;
	t_part_seq = 0;
	atomic_store(&t_w.processed, 0);
	atomic_store(&t_w.errors, 0);
	memset(t_hist_was, 0, sizeof t_hist_was);
	memset(&t_w.run_ns, 0, sizeof t_w.run_ns);

	/* A new child's channel, by the proxy's own start (its spawn fails). */
	pthread_mutex_lock(&s->send_mu);
	t_check(iso_spawn(&t_w) == -ENOSYS);
	pthread_mutex_unlock(&s->send_mu);
	struct iso_ctl *l = &s->layout;
	uint8_t *mem = s->map.mem;
	t_check(ap_ring_attach_consumer(&t_creq, mem + l->req_off, l->req_size) == 0);
	t_check(ap_ring_attach_producer(&t_crsp, mem + l->rsp_off, l->rsp_size) == 0);
	atomic_store(&s->ctl->init_state, 1);

	for (unsigned k = 0; k < jobs; k++)
		t_job((uint8_t)t_u8(&in));
	while (in.n)
		if (t_op(&in, mode & 1))
			break;

	/* The child dies; the proxy answers what it died on, the loop makes
	 * jobs of its unrun bare tells. */
	s->how = CLD_KILLED;
	s->code = SIGKILL;
	s->killed = 1;
	atomic_store(&s->dead, 1);
	pthread_mutex_lock(&s->send_mu);
	on_death(&t_w);
	pthread_mutex_unlock(&s->send_mu);
	ap_iso_rehydrate(&t_w);
	t_harvest();
	t_check(atomic_load(&t_w.processed) < s->next_seq); /* no more than were sent */
	t_check(atomic_load(&t_w.errors) <= atomic_load(&t_w.processed));

	/* What is left goes elsewhere (pool.c moves it): each job once, an
	 * ask's route hold with it (dropped here, as a job lost). */
	unsigned left_asks = 0;
	ap_job *j;
	while ((j = ap_mbox_pop(&t_w.mb))) {
		ap_mbox_done(&t_w.mb);
		t_check(!j->revoked && !j->is_answer);
		t_check(j->is_ask ? j->route.ops != NULL : j->route.ops == NULL);
		if (j->is_ask)
			left_asks++;
		ap_route_drop(&j->route);
	}
	t_check(ap_mbox_depth(&t_w.mb) == 0);
	t_check(t_seg.refs == 0);
	unsigned asks = 0, answered = 0;
	for (unsigned id = 1; id <= t_jobs; id++) {
		asks += t_is_ask[id];
		answered += t_answered[id];
		t_check(!t_held[id]);
	}
	t_check(answered + left_asks == asks);
	return 0;
}
