/* fuzz_pool_dist: libFuzzer target over what the pool node makes of a
 * distribution frame from a peer: its manager's calls (pool_node.c), a
 * pool's calls, casts, batches and plain messages (dist_ingress.c), and the
 * answers to asks in a batch for a pool that is gone. */
/*
 * The input is one frame as the node reads it after the 4-byte length: the
 * pass-through byte, the control tuple, the message. It goes the node's
 * way: ap_ctrl_decode, then a SEND or REG_SEND to the process it names
 * (ap_node_recv.c's deliver: ap_node_classify, then the process's function, or
 * the dead-letter hook when nobody has the name or pid). A REG_SEND to
 * actor_pool_node reaches the manager, to p (or a SEND to a pid whose
 * number is below 1000, as a live pool's pid) the pool process; any other
 * (a SEND to a higher number stands for a pool that is gone) goes to
 * ap_pool_dead_letter.
 *
 * pool_node.c is compiled into this file (its manager is static), with its
 * main renamed; pool_opts.c, dist_ingress.c, no_pool.c, reply.c and the
 * runtime are linked as they are. The node is a real one (ap_node_new, no listener, no connection).
 * The rest of the pool is stubbed below: one pool, found as p or a pid
 * below 1000;
 * dispatch, start and stop check what they are handed; no plugin is ever
 * loaded (a path is checked and refused, or taken by the name "ok.so").
 * ap_reply and ap_node_post are wrapped (-Wl,--wrap), so every answer the
 * manager, a pool or the dead-letter hook makes is checked here:
 * - a request a pool is handed is one whole term inside the message, and
 *   an ask's tag is one whole term inside it too;
 * - every reply is one whole term, and the frame built from it with the
 *   caller's tag (ap_encode_reply, as the real ap_reply does; the error
 *   reply of an ask, as the pool's overload path does) is one frame that
 *   ap_ctrl_decode takes whole: {Tag, Reply} to the caller, or by alias;
 * - a frame the dead-letter hook posts is such a frame with
 *   {error, noproc}, to the node of the caller it names.
 */
#include <ei.h>
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define main t_pool_node_main
#include "../pool/pool_node.c"
#undef main

#include "ap_ctrl.h"
#include "ap_node_int.h"
#include "pool_int.h"

#include "t_fuzz.h"

#define T_LIVE_PIDS 1000u /* pids below this number are the pool's */

static ap_pool t_pool;              /* the one pool */
static ap_node *t_node;
static ap_proc *t_pool_proc, *t_dead; /* the pool process; the dead-letter hook's self */
static const ap_msg *t_m;           /* the message being handled */
static const actor_pool_handler t_handler;
static volatile unsigned t_sink;

/* ---- checking frames --------------------------------------------------------- */

static int t_pid_same(const erlang_pid *a, const erlang_pid *b)
{
	return a->num == b->num && a->serial == b->serial && a->creation == b->creation &&
	       strcmp(a->node, b->node) == 0;
}

/* b[0..len) lies inside the message being handled. */
static int t_in_msg(const char *b, int len)
{
	return len > 0 && b >= t_m->buf && b + len <= t_m->buf + t_m->len;
}

/* A whole reply frame (4-byte length, then the body) from self: a SEND to
 * the caller or an ALIAS_SEND, whose message is {Tag, Reply}, the tag one
 * whole term. Reply (no 131) is checked when given. Returns where the tag
 * starts in the decoded message's bytes, so the caller can compare it. */
static void t_frame(const uint8_t *fr, size_t len, const erlang_pid *self, const char *node, const char *tag,
		    int tag_len, const char *reply, int reply_len)
{
	t_check(len > 4 && ap_get32be(fr) == len - 4);
	uint8_t *f = malloc(len - 4); /* exact size: ASan sees a read past it */
	t_check(f != NULL);
	memcpy(f, fr + 4, len - 4);
	ap_ctrl c;
	t_check(ap_ctrl_decode(f, len - 4, &c) == 0);
	if (c.op == AP_OP_SEND) {
		t_check(strcmp(c.to.node, node) == 0);
	} else {
		t_check(c.op == AP_OP_ALIAS_SEND);
		t_check(t_pid_same(&c.from, self));
	}
	t_check(c.msg_len > 3 && (uint8_t)c.msg[0] == 131 && c.msg[1] == 104 && c.msg[2] == 2);
	int te = ap_term_end(c.msg, (size_t)c.msg_len, 3);
	t_check(te > 3);
	if (tag) {
		t_check(te - 3 == tag_len && memcmp(c.msg + 3, tag, (size_t)tag_len) == 0);
	}
	t_check(ap_term_end(c.msg, (size_t)c.msg_len, te) == c.msg_len);
	if (reply) {
		t_check(c.msg_len - te == reply_len && memcmp(c.msg + te, reply, (size_t)reply_len) == 0);
	}
	free(f);
}

/* {error, Reason} without the 131 byte. */
static int t_error_term(char *buf, const char *reason)
{
	int i = 0;
	ei_encode_tuple_header(buf, &i, 2);
	ei_encode_atom(buf, &i, "error");
	ei_encode_atom(buf, &i, reason);
	return i;
}

/* ---- the node's sends, wrapped ------------------------------------------------ */

int __wrap_ap_reply(ap_node *n, const ap_proc *self, const ap_msg *call, const char *term, int len);
int __wrap_ap_reply_atom(ap_node *n, const ap_proc *self, const ap_msg *call, const char *atom);
int __wrap_ap_node_post(ap_node *n, const char *node, const uint8_t *frame, size_t len);

/* Every answer to a call: one whole term, to the call being handled; the
 * frame ap_reply would send is built and checked. */
int __wrap_ap_reply(ap_node *n, const ap_proc *self, const ap_msg *call, const char *term, int len)
{
	t_check(n == t_node && call == t_m && call->kind == AP_MSG_CALL);
	t_check(len > 0);
	int t = (uint8_t)term[0] == 131 ? 1 : 0;
	t_check(ap_term_end(term, (size_t)len, t) == len);
	ap_buf b = { 0 };
	if (ap_encode_reply(&b, &self->pid, &call->from, call->tag, call->tag_len, term, len) == 0)
		t_frame(b.data, b.len, &self->pid, call->from.node, call->tag, call->tag_len, term + t, len - t);
	ap_buf_free(&b);
	return 0;
}

int __wrap_ap_reply_atom(ap_node *n, const ap_proc *self, const ap_msg *call, const char *atom)
{
	char buf[MAXATOMLEN_UTF8 + 8];
	int i = 0;
	ei_encode_atom(buf, &i, atom);
	return __wrap_ap_reply(n, self, call, buf, i);
}

/* The answer the dispatch stub sends by an ask's route, as the loop would
 * when the pool is overloaded (see ap_pool_dispatch below), while on. */
static struct {
	int on;
	const char *reply;
	int reply_len;
} t_answer;

/* Posts come from the distribution route (an answer, t_answer) or from the
 * dead-letter hook (no worker runs): {error, noproc} to an ask of the
 * batch, whose tag is in the message. */
int __wrap_ap_node_post(ap_node *n, const char *node, const uint8_t *frame, size_t len)
{
	if (t_answer.on) {
		t_check(n == t_node && t_m);
		t_check(memchr(node, 0, MAXATOMLEN_UTF8) != NULL);
		t_frame(frame, len, &t_pool_proc->pid, node, NULL, 0, t_answer.reply, t_answer.reply_len);
		t_answer.on = 0;
		return 0;
	}
	char err[64];
	int el = t_error_term(err, "noproc");
	t_check(n == t_node && t_m && t_m->kind == AP_MSG_INFO);
	t_check(memchr(node, 0, MAXATOMLEN_UTF8) != NULL);
	t_frame(frame, len, &t_dead->pid, node, NULL, 0, err, el);
	return 0;
}

/* ---- the rest of the pool node, stubbed ------------------------------------------ */

int ap_cnode_main(int argc, char **argv, const char *service, ap_service_init init)
{
	(void)argc, (void)argv, (void)service, (void)init;
	t_check(0);
	return 1;
}

int ap_dp_start(ap_node *n, int enabled, int poll_us, int lone_us, int nap_us, int ask_nap_us)
{
	(void)n, (void)enabled, (void)poll_us, (void)lone_us, (void)nap_us, (void)ask_nap_us;
	t_check(0);
	return -1;
}

unsigned long long ap_dp_naps(void) { return 0; }
unsigned long long ap_dp_ask_naps(void) { return 0; }
unsigned long long ap_dp_lone_windows(void) { return 0; }
unsigned long long ap_dp_iso_waits(void) { return 0; }
unsigned long long ap_dp_iso_waits_missed(void) { return 0; }
unsigned long long ap_iso_loop_results(void) { return 0; }
unsigned long long ap_iso_bare_tells(void) { return 0; }
unsigned long long ap_iso_bare_rehydrated(void) { return 0; }
unsigned long long ap_iso_follows_all(void) { return 0; }

/* The kinds of workers: never run here (the start stub below checks
 * which one the manager picked). */
const ap_worker_ops ap_worker_threads, ap_worker_processes;

void ap_dp_encode_info(ei_x_buff *x)
{
	ei_x_encode_atom(x, "undefined");
}

void ap_dp_poll_cancel(void)
{
}

void ap_pool_opts_default(ap_pool_opts *o)
{
	*o = (ap_pool_opts){ .workers = 0, .routing = AP_ROUTE_ROUND_ROBIN, .mailbox_limit = 10000,
			     .backoff_min_ms = 10, .backoff_max_ms = 5000, .jitter = 0.2, .stable_ms = 5000,
			     .max_reply_atoms = 1024 };
}

ap_pool *ap_pool_find(ap_node *n, const char *name, const erlang_pid *pid)
{
	t_check(n == t_node);
	if (name) {
		t_check(memchr(name, 0, MAXATOMLEN_UTF8) != NULL);
		return strcmp(name, "p") == 0 ? (ap_pool *)&t_pool : NULL;
	}
	t_check(pid);
	return pid->num < T_LIVE_PIDS ? (ap_pool *)&t_pool : NULL;
}

void ap_pool_stop(ap_node *n, ap_pool *p)
{
	t_check(n == t_node && p == (ap_pool *)&t_pool);
}

/* What the manager hands a new pool: what it checked, and a reply head
 * for the caller. Nothing starts; the pending reply is freed here. */
int ap_pool_start(ap_node *n, const char *name, const char *handler_desc, const char *spec,
		  const actor_pool_handler *h, void *dl, const uint8_t *config, size_t config_len, const ap_pool_opts *o,
		  const ap_worker_ops *kind, ap_proc_fn ingress, ap_pending_reply *reply)
{
	t_check(n == t_node && h == &t_handler && dl == NULL);
	t_check(kind == (o->isolation == AP_ISO_PROCESS ? &ap_worker_processes : &ap_worker_threads));
	t_check(ingress == ap_pool_process);
	t_check(memchr(name, 0, MAXATOMLEN_UTF8) != NULL && memchr(handler_desc, 0, AP_POOL_HANDLER_DESC) != NULL);
	t_check(spec && memchr(spec, 0, AP_POOL_SPEC_MAX) != NULL);
	t_check(o->isolation == AP_ISO_THREAD || o->isolation == AP_ISO_PROCESS);
	t_check(o->handler_timeout_ms >= 0 && o->handler_timeout_ms <= 86400000);
	t_check(o->stall_ms >= 0 && o->stall_ms <= 86400000);
	t_check(o->max_memory_mb >= 0 && o->max_memory_mb <= 1048576);
	t_check(o->max_memory_mb == 0 || o->isolation == AP_ISO_PROCESS);
	t_check(o->workers >= 0 && o->workers <= MAX_WORKERS);
	t_check(o->mailbox_limit >= 1 && o->jitter >= 0 && o->jitter <= 1);
	t_check(o->backoff_min_ms >= 0 && o->backoff_max_ms >= o->backoff_min_ms);
	if (config) {
		/* The plugin's Config: its version byte, then one whole term. */
		t_check(config_len > 1 && config[0] == 131);
		t_check(ap_term_end((const char *)config, config_len, 1) == (int)config_len);
	} else {
		t_check(config_len == 0);
	}
	t_check(reply && strcmp(reply->node, t_m->from.node) == 0);
	char err[64];
	int el = t_error_term(err, "stub");
	/* The answer the pool would send: the head plus {error, stub}. */
	t_check(ap_buf_append(&reply->head, err, (size_t)el) == 0 && ap_frame_end(&reply->head, 0) == 0);
	t_frame(reply->head.data, reply->head.len, &manager->pid, reply->node, t_m->tag, t_m->tag_len, err, el);
	ap_buf_free(&reply->head);
	free(reply);
	return 0;
}

int ap_pool_encode_list(ei_x_buff *x)
{
	ei_x_encode_list_header(x, 1);
	ei_x_encode_tuple_header(x, 2);
	ei_x_encode_atom(x, "p");
	ei_x_encode_pid(x, &t_pool_proc->pid);
	ei_x_encode_empty_list(x);
	return 0;
}

void ap_pool_tick(ap_node *n, void *arg)
{
	(void)n, (void)arg;
}

void ap_pool_barriers_init(void)
{
}

int ap_iso_watch_children(struct ap_node *n)
{
	(void)n;
	return 0;
}

int ap_iso_child_main(int argc, char **argv)
{
	(void)argc, (void)argv;
	abort(); /* the fuzzer never starts with --isolated-worker */
}

const actor_pool_handler *ap_builtin_handler(const char *name)
{
	return strcmp(name, "echo") == 0 || strcmp(name, "json_validate") == 0 ? &t_handler : NULL;
}

/* No plugin is loaded: the path (a NUL-terminated string of what the
 * peer sent) is refused, but for "ok.so", which stands for one that loads. */
int ap_plugin_load(const char *path, const actor_pool_handler **out, void **dl_handle, uint32_t *got, char *why,
		   size_t why_len)
{
	t_check(memchr(path, 0, 4096) != NULL);
	t_sink += (unsigned)strlen(path);
	*got = 0;
	if (strcmp(path, "ok.so") == 0) {
		*out = &t_handler;
		*dl_handle = NULL;
		return 0;
	}
	snprintf(why, why_len, "not loaded by the fuzzer");
	return -1;
}

void ap_plugin_unload(void *dl_handle)
{
	t_check(dl_handle == NULL);
}

/* No file is opened either: "ok.so" stands for one that is there. */
int ap_plugin_check(const char *path, char *why, size_t why_len)
{
	t_check(memchr(path, 0, 4096) != NULL);
	t_sink += (unsigned)strlen(path);
	if (strcmp(path, "ok.so") == 0)
		return 0;
	snprintf(why, why_len, "not opened by the fuzzer");
	return -1;
}

/* What an ingress hands on: one whole term inside the message, by the
 * distribution route (its context the node); an ask's route head and
 * address too: the error answer the loop would make to it (the head, then
 * {error, overloaded}) goes by the route and is checked as a frame to the
 * caller's node ({Tag, Reply}, the tag a whole term from the message). */
void ap_pool_dispatch(ap_pool *p, const ap_request *rq)
{
	t_check(p == &t_pool);
	t_check(rq->kind == AP_REQ_TELL || rq->kind == AP_REQ_ASK);
	t_check(rq->route.ops && !rq->route.ops->batched && rq->route.ctx == t_node);
	t_check(t_in_msg(rq->msg, rq->msg_len));
	t_check(ap_term_end(rq->msg, (size_t)rq->msg_len, 0) == rq->msg_len);
	unsigned s = 0;
	for (int i = 0; i < rq->msg_len; i++)
		s += (uint8_t)rq->msg[i];
	t_sink += s;
	if (rq->kind == AP_REQ_TELL)
		return;
	t_check(rq->addr_len >= 1 && rq->addr_len <= MAXATOMLEN_UTF8 && memchr(rq->addr, 0, rq->addr_len) ==
								       rq->addr + rq->addr_len - 1);
	t_check(rq->head && rq->head_len > 4);
	char err[64];
	int el = t_error_term(err, "overloaded");
	ap_buf b = { 0 };
	if (ap_buf_append(&b, rq->head, rq->head_len) == 0 && ap_buf_append(&b, err, (size_t)el) == 0) {
		t_answer.on = 1;
		t_answer.reply = err;
		t_answer.reply_len = el;
		t_check(rq->route.ops->send(&rq->route, rq->addr, b.data, b.len, 0, AP_SEND_LOOP) == 0);
		t_check(!t_answer.on); /* posted, and checked */
	}
	ap_buf_free(&b);
}

void ap_pool_wake_pushed(ap_pool *p)
{
	t_check(p == (ap_pool *)&t_pool);
}

void ap_pool_encode_stats(ap_pool *p, ei_x_buff *x)
{
	t_check(p == (ap_pool *)&t_pool);
	ei_x_encode_map_header(x, 1);
	ei_x_encode_atom(x, "workers");
	ei_x_encode_long(x, 4);
}

/* ---- the target -------------------------------------------------------------- */

static void t_unreachable(ap_node *n, ap_proc *p, const ap_msg *m)
{
	(void)n, (void)p, (void)m;
	t_check(0);
}

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
	(void)argc, (void)argv;
	ap_log_set_level(AP_LOG_ERROR);
	ap_node_cfg cfg = { .node = "fuzz@localhost", .cookie = "fuzz", .creation = 0x1234, .io = "epoll" };
	t_node = ap_node_new(&cfg);
	t_check(t_node);
	manager = ap_proc_spawn(t_node, "actor_pool_node", manager_fn, NULL);
	t_pool_proc = ap_proc_spawn(t_node, "p", ap_pool_process, &t_pool);
	t_dead = ap_proc_spawn(t_node, "t_dead_letter", t_unreachable, NULL);
	t_check(manager && t_pool_proc && t_dead);
	t_pool.n = t_node;
	t_pool.pid = t_pool_proc->pid;
	return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	ap_ctrl ctl;
	if (ap_ctrl_decode(data, size, &ctl) || (ctl.op != AP_OP_SEND && ctl.op != AP_OP_REG_SEND))
		return 0;
	ap_proc *to = NULL;
	if (ctl.op == AP_OP_REG_SEND)
		to = ap_proc_whereis(t_node, ctl.toname);
	else if (ctl.to.num < T_LIVE_PIDS)
		to = t_pool_proc;
	if (to == t_dead)
		to = NULL;
	/* As deliver builds it. */
	ap_msg m = { .kind = AP_MSG_INFO, .buf = ctl.msg, .len = ctl.msg_len, .index = 1 };
	ap_node_classify(&m);
	t_m = &m;
	if (to)
		to->fn(t_node, to, &m);
	else
		ap_pool_dead_letter(t_node, t_dead, &m, "peer@host", ctl.op == AP_OP_REG_SEND ? ctl.toname : NULL);
	t_m = NULL;
	return 0;
}
