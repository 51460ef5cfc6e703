/* rcpt_proto: the receptionist's protocol: what the process
 * `actor_receptionist` does with each message, on the registry it owns.
 * Messages are one table (commands[]); calls are few and fixed.
 *
 * Protocol (one BEAM-side gen_server talks to it; Key is a binary of
 * 1..1024 bytes, refs and subscribers are pids):
 *   info/cast {register, Key, Ref, ReplyTo | undefined}
 *               ReplyTo ! {registered, {service_key, Key}, Ref}, also when
 *               it was there already; {register_failed, {service_key, Key},
 *               Ref, too_many_refs} when the key's
 *               listing would exceed --max-listing-bytes (16 MiB: about
 *               700K refs on a short node name): the ref is not added.
 *             {deregister, Key, Ref, ReplyTo | undefined}
 *               ReplyTo ! {deregistered, {service_key, Key}, Ref}, always.
 *             {rregister, Origin, Key, Ref}
 *               a registration made on the receptionist of node Origin (an
 *               atom), learnt by gossip; no reply (the origin acknowledged
 *               it). Refused (logged) like a register past the limit;
 *               malformed while MAX_ORIGINS other origins are held.
 *             {rderegister, Origin, Key, Ref}
 *               Ref leaves Key whatever its origin; no reply.
 *             {retag, Key, Ref, Origin | undefined}
 *               Ref under Key is held for Origin from now on (undefined:
 *               for this node's own BEAM), because the origin it was held
 *               for let go of it while another still holds it. No listing:
 *               what it shows is unchanged.
 *             {drop_origin, Origin}
 *               Origin left the cluster: every ref learnt from it goes,
 *               each changed key reported once, and its origin id is free
 *               for the next origin.
 *             {find, Key, ReplyTo}       ReplyTo ! {listing, {service_key, Key}, Refs}
 *             {subscribe, Key, Pid}      Pid ! the listing now, and on every change
 *             {unsubscribe, Key, Pid}
 *             {unsubscribe_all, Pid}
 *             {send, Pid, Term}          Pid ! Term, in order with the rest
 *             {batch, [Msg]}             each in order
 *   call      {lookup, Key} -> Refs; sync -> ok; pid -> this process's pid;
 *             stats -> #{...};
 *             {dump, Max} -> [{Key, Refs}] (at most Max keys);
 *             anything else -> {error, badarg}.
 *
 * Ordering: a change reaches the snapshot (ap_shm_put, in rcpt_snap.c)
 * before any listing or reply about it is sent, so a lookup from the
 * snapshot reflects every registration whose `registered` has been sent.
 * Everything goes out from the loop thread through ap_send, so what one
 * pid gets arrives in order.
 */
#include "ap_dec.h"
#include "rcpt_proto.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ap_shm.h"
#include "ap_term.h"
#include "origins.h"
#include "rcpt_log.h"
#include "rcpt_snap.h"
#include "registry.h"

#define PROC_NAME "actor_receptionist"
#define MAX_BATCH_DEPTH 4 /* a batch inside a batch: fine; deeper: malformed */
/* Origin nodes a receptionist holds ids for at once. */
#define MAX_ORIGINS 65536u

_Static_assert(REGISTRY_MAX_KEY == AP_SHM_MAX_KEY, "key limits differ");

struct rcpt {
	ap_node *n;
	ap_proc *self;
	registry *reg;
	ei_x_buff x;       /* replies, reused */
	uint64_t registers, deregisters, finds, subscribes, unsubscribes, malformed, refused, remote_ops,
		origin_drops;
	/* Origins learnt by gossip: node names, interned to registry origin
	 * ids (REGISTRY_ORIGIN_LOCAL is 0). Every rregister looks one up, so
	 * in a hash table: its cost does not grow with the origins; a dropped
	 * origin's id is reused. */
	origins *origins;
	size_t max_listing;
	int depth; /* batches around the message being handled */
};

static struct rcpt st;

/* ---- logging --------------------------------------------------------------- */

static void malformed(const char *what)
{
	st.malformed++;
	RLOG(AP_LOG_WARNING, "receptionist: malformed %s ignored (%llu so far)", what,
	     (unsigned long long)st.malformed);
}

/* ---- decoding ------------------------------------------------------------------ */

/* A binary key of 1..1024 bytes, by reference into b[0..len). */
static int get_key(const char *b, size_t len, int *i, const char **key, size_t *klen)
{
	int type, size;
	if (ei_get_type(b, i, &type, &size) || type != ERL_BINARY_EXT || (unsigned char)b[*i] != 109 || size < 1 ||
	    (unsigned)size > REGISTRY_MAX_KEY)
		return -1;
	*key = b + *i + 5;
	*klen = (size_t)size;
	return ap_term_skip(b, len, i);
}

/* A pid, which must encode again: everything sent names pids, and ei
 * takes a node name in that it cannot write back (not UTF-8), which would
 * leave a reply cut short. */
static int get_pid(const char *b, int *i, erlang_pid *p)
{
	int type, size, n = 0;
	if (ei_get_type(b, i, &type, &size) || type != ERL_PID_EXT || ei_decode_pid(b, i, p))
		return -1;
	return ei_encode_pid(NULL, &n, p) ? -1 : 0;
}

/* A pid, or `undefined` (*has 0). */
static int get_reply_to(const char *b, int *i, erlang_pid *p, int *has)
{
	char a[16];
	int j = *i;
	if (ap_get_atom(b, &j, a, sizeof a) == 0) {
		*has = 0;
		*i = j;
		return strcmp(a, "undefined") ? -1 : 0;
	}
	*has = 1;
	return get_pid(b, i, p);
}

/* ---- sending ---------------------------------------------------------------------- */

static void send_x(const erlang_pid *to)
{
	ap_send(st.n, st.self, to, st.x.buff, st.x.index);
}

static void x_reset(void)
{
	st.x.index = 0;
	ei_x_encode_version(&st.x);
}

/* {Tag, {service_key, Key}, Ref} */
static void send_ack(const erlang_pid *to, const char *tag, const char *key, size_t klen, const erlang_pid *ref)
{
	x_reset();
	ei_x_encode_tuple_header(&st.x, 3);
	ei_x_encode_atom(&st.x, tag);
	ei_x_encode_tuple_header(&st.x, 2);
	ei_x_encode_atom(&st.x, "service_key");
	ei_x_encode_binary(&st.x, key, (long)klen);
	ei_x_encode_pid(&st.x, ref);
	send_x(to);
}

/* {register_failed, {service_key, Key}, Ref, Reason}: names what failed, so a
 * ReplyTo with several registrations in flight can tell which. */
static void send_error(const erlang_pid *to, const char *key, size_t klen, const erlang_pid *ref,
		       const char *reason)
{
	x_reset();
	ei_x_encode_tuple_header(&st.x, 4);
	ei_x_encode_atom(&st.x, "register_failed");
	ei_x_encode_tuple_header(&st.x, 2);
	ei_x_encode_atom(&st.x, "service_key");
	ei_x_encode_binary(&st.x, key, (long)klen);
	ei_x_encode_pid(&st.x, ref);
	ei_x_encode_atom(&st.x, reason);
	send_x(to);
}

/* ---- messages --------------------------------------------------------------------- */

static void handle(const char *b, size_t len, int i);

static void do_register(const char *b, size_t len, int i, int reg)
{
	const char *key;
	size_t klen;
	erlang_pid ref, to;
	int has_to;
	if (get_key(b, len, &i, &key, &klen) || get_pid(b, &i, &ref) || get_reply_to(b, &i, &to, &has_to)) {
		malformed(reg ? "register" : "deregister");
		return;
	}
	if (!reg) {
		st.deregisters++;
		registry_deregister(st.reg, key, klen, &ref);
		if (has_to) {
			registry_flush(st.reg); /* the ack follows the snapshot write */
			send_ack(&to, "deregistered", key, klen, &ref);
		}
		return;
	}
	st.registers++;
	int rc = registry_register(st.reg, key, klen, &ref, REGISTRY_ORIGIN_LOCAL);
	if (has_to)
		registry_flush(st.reg);
	if (rc >= 0) {
		if (has_to)
			send_ack(&to, "registered", key, klen, &ref);
		return;
	}
	st.refused++;
	if (rc == -E2BIG) {
		RLOG(AP_LOG_WARNING,
		     "receptionist: register refused: the listing of key '%.*s' (%zu refs) would exceed %zu bytes",
		     (int)(klen > 64 ? 64 : klen), key, registry_count(st.reg, key, klen), st.max_listing);
		if (has_to)
			send_error(&to, key, klen, &ref, "too_many_refs");
	} else {
		RLOG(AP_LOG_ERROR, "receptionist: register failed: %s", strerror(-rc));
		if (has_to)
			send_error(&to, key, klen, &ref, rc == -ENOMEM ? "enomem" : "badarg");
	}
}

/* The registry origin id of node `name`, interned on first use if add; 0
 * when it is not held (add 0) or cannot be (MAX_ORIGINS held, no memory):
 * the message is then refused as malformed. */
static uint32_t origin_id(const char *name, int add)
{
	return origins_get(st.origins, name, add);
}

/* {rregister | rderegister, OriginNode, Key, Ref}: a change made on another
 * receptionist, learnt by gossip. No reply: the origin acknowledged it. */
static void do_remote(const char *b, size_t len, int i, int reg)
{
	char origin[MAXATOMLEN_UTF8];
	const char *key;
	size_t klen;
	erlang_pid ref;
	uint32_t id;
	if (ap_get_atom(b, &i, origin, sizeof origin) || get_key(b, len, &i, &key, &klen) || get_pid(b, &i, &ref)) {
		malformed(reg ? "rregister" : "rderegister");
		return;
	}
	/* A deregistration needs no id: it removes the ref whatever its origin. */
	id = origin_id(origin, reg);
	if (reg && !id) {
		malformed("rregister: too many origins");
		return;
	}
	st.remote_ops++;
	if (!reg) {
		registry_deregister(st.reg, key, klen, &ref);
		return;
	}
	int rc = registry_register(st.reg, key, klen, &ref, id);
	if (rc < 0) {
		st.refused++;
		RLOG(AP_LOG_WARNING, "receptionist: a registration from %s under '%.*s' refused: %s", origin,
		     (int)(klen > 64 ? 64 : klen), key, rc == -E2BIG ? "listing too large" : strerror(-rc));
	}
}

/* {retag, Key, Ref, OriginNode | undefined}: Ref under Key is now held for
 * that origin (undefined: this node's own), because the origin it was held
 * for let go of it while another still holds it. No listing: no change. */
static void do_retag(const char *b, size_t len, int i, int unused)
{
	char origin[MAXATOMLEN_UTF8];
	const char *key;
	size_t klen;
	erlang_pid ref;
	(void)unused;
	if (get_key(b, len, &i, &key, &klen) || get_pid(b, &i, &ref) || ap_get_atom(b, &i, origin, sizeof origin)) {
		malformed("retag");
		return;
	}
	uint32_t id = strcmp(origin, "undefined") ? origin_id(origin, 1) : REGISTRY_ORIGIN_LOCAL;
	if (strcmp(origin, "undefined") && !id) {
		malformed("retag: too many origins");
		return;
	}
	st.remote_ops++;
	int rc = registry_set_origin(st.reg, key, klen, &ref, id);
	if (rc < 0)
		RLOG(AP_LOG_ERROR, "receptionist: retag failed: %s", strerror(-rc));
}

static void do_find(const char *b, size_t len, int i, int unused)
{
	const char *key;
	size_t klen;
	erlang_pid to;
	const uint8_t *msg;
	size_t mlen;
	(void)unused;
	if (get_key(b, len, &i, &key, &klen) || get_pid(b, &i, &to)) {
		malformed("find");
		return;
	}
	st.finds++;
	if (registry_listing(st.reg, key, klen, &msg, &mlen) == 0)
		ap_send(st.n, st.self, &to, (const char *)msg, (int)mlen);
}

static void do_subscribe(const char *b, size_t len, int i, int sub)
{
	const char *key;
	size_t klen;
	erlang_pid pid;
	if (get_key(b, len, &i, &key, &klen) || get_pid(b, &i, &pid)) {
		malformed(sub ? "subscribe" : "unsubscribe");
		return;
	}
	if (sub) {
		st.subscribes++;
		int rc = registry_subscribe(st.reg, key, klen, &pid);
		if (rc < 0)
			RLOG(AP_LOG_ERROR, "receptionist: subscribe failed: %s", strerror(-rc));
	} else {
		st.unsubscribes++;
		registry_unsubscribe(st.reg, key, klen, &pid);
	}
}

static void do_batch(const char *b, size_t len, int i, int unused)
{
	int n, type, size;
	(void)unused;
	if (st.depth >= MAX_BATCH_DEPTH || ei_get_type(b, &i, &type, &size) ||
	    (type != ERL_LIST_EXT && type != ERL_NIL_EXT) || ei_decode_list_header(b, &i, &n)) {
		malformed("batch");
		return;
	}
	/* A batch is a burst: a key changed several times in it is written
	 * once (registry_defer). A lone change gains nothing from it. */
	if (st.depth == 0)
		registry_defer(st.reg, 1);
	st.depth++;
	for (int k = 0; k < n; k++) {
		int end = ap_term_end(b, len, i);
		if (end < 0)
			break;
		handle(b, len, i);
		i = end;
	}
	st.depth--;
	if (st.depth == 0)
		registry_defer(st.reg, 0);
}

/* Messages that change refs only: their changes are reported once per key
 * at the end of the message (see registry_defer). Any other message sends,
 * or depends on what was sent (an unsubscribe), so the changes before it
 * are reported first. */
#define DEFERS 1

static void do_drop_origin(const char *b, size_t len, int i, int unused)
{
	char origin[MAXATOMLEN_UTF8];
	(void)len, (void)unused;
	if (ap_get_atom(b, &i, origin, sizeof origin)) {
		malformed("drop_origin");
		return;
	}
	uint32_t id = origin_id(origin, 0);
	st.origin_drops++;
	if (id) {
		/* It reports each key once already, and may rebuild the
		 * snapshot instead of writing per key. */
		int deferring = registry_deferring(st.reg);
		registry_defer(st.reg, 0);
		rcpt_snap_drop_origin(id);
		registry_defer(st.reg, deferring);
		/* No ref holds the id now: the next origin may have it. */
		if (!registry_origin_refs(st.reg, id))
			origins_release(st.origins, id);
	}
}

static void do_unsubscribe_all(const char *b, size_t len, int i, int unused)
{
	erlang_pid pid;
	(void)len, (void)unused;
	if (get_pid(b, &i, &pid)) {
		malformed("unsubscribe_all");
		return;
	}
	st.unsubscribes++;
	registry_unsubscribe_all(st.reg, &pid);
}

/* {send, Pid, Term}: the BEAM's own messages to a subscriber (a rejection)
 * go out in order with our listings to it. */
static void do_send(const char *b, size_t len, int i, int unused)
{
	erlang_pid to;
	(void)unused;
	if (get_pid(b, &i, &to)) {
		malformed("send");
		return;
	}
	/* Term's end by the walk: ei_skip_term would trust a fun's Size and
	 * carry on into whatever follows. */
	int t0 = i;
	if (ap_term_skip(b, len, &i)) {
		malformed("send");
		return;
	}
	ap_send(st.n, st.self, &to, b + t0, i - t0);
}

/* Every message of the protocol (the comment at the top says what each
 * does): its tag, its tuple's arity, whether it only changes refs, and
 * what runs it on the rest of the tuple (i past the tag), with arg. Tags
 * are unique. */
static const struct command {
	const char *op;
	int arity;
	int flags;
	void (*fn)(const char *b, size_t len, int i, int arg);
	int arg;
} commands[] = {
	{ "register", 4, DEFERS, do_register, 1 },
	{ "deregister", 4, DEFERS, do_register, 0 },
	{ "rregister", 4, DEFERS, do_remote, 1 },
	{ "rderegister", 4, DEFERS, do_remote, 0 },
	{ "retag", 4, DEFERS, do_retag, 0 },
	{ "batch", 2, DEFERS, do_batch, 0 },
	{ "drop_origin", 2, 0, do_drop_origin, 0 },
	{ "find", 3, 0, do_find, 0 },
	{ "subscribe", 3, 0, do_subscribe, 1 },
	{ "unsubscribe", 3, 0, do_subscribe, 0 },
	{ "unsubscribe_all", 2, 0, do_unsubscribe_all, 0 },
	{ "send", 3, 0, do_send, 0 },
};

static void handle(const char *b, size_t len, int i)
{
	int arity;
	char op[24];
	if (ei_decode_tuple_header(b, &i, &arity) || arity < 2 || ap_get_atom(b, &i, op, sizeof op)) {
		malformed("message");
		return;
	}
	const struct command *c = NULL;
	for (size_t k = 0; k < sizeof commands / sizeof commands[0] && !c; k++)
		if (!strcmp(op, commands[k].op))
			c = &commands[k];
	/* The tag alone decides the flush, whatever the arity. */
	if (!c || !(c->flags & DEFERS))
		registry_flush(st.reg);
	if (!c || arity != c->arity) {
		malformed("message");
		return;
	}
	c->fn(b, len, i, c->arg);
}

/* ---- calls ---------------------------------------------------------------------------- */

static void reply_badarg(ap_node *n, ap_proc *self, const ap_msg *m, const char *what)
{
	malformed(what);
	x_reset();
	ei_x_encode_tuple_header(&st.x, 2);
	ei_x_encode_atom(&st.x, "error");
	ei_x_encode_atom(&st.x, "badarg");
	ap_reply(n, self, m, st.x.buff, st.x.index);
}

static void x_counter(const char *name, uint64_t v)
{
	ei_x_encode_atom(&st.x, name);
	ei_x_encode_ulonglong(&st.x, v);
}

static void reply_stats(ap_node *n, ap_proc *self, const ap_msg *m)
{
	registry_stats rs;
	struct rcpt_snap_stats ss;
	registry_get_stats(st.reg, &rs);
	rcpt_snap_get_stats(&ss);
	x_reset();
	ei_x_encode_map_header(&st.x, 28);
	x_counter("keys", rs.keys);
	x_counter("refs", rs.refs);
	x_counter("subscriptions", rs.subscriptions);
	x_counter("subscribers", rs.subscribers);
	x_counter("listings_sent", rs.listings_sent);
	x_counter("registers", st.registers);
	x_counter("deregisters", st.deregisters);
	x_counter("finds", st.finds);
	x_counter("subscribes", st.subscribes);
	x_counter("unsubscribes", st.unsubscribes);
	x_counter("malformed", st.malformed);
	x_counter("refused", st.refused);
	x_counter("remote_ops", st.remote_ops);
	x_counter("origin_drops", st.origin_drops);
	x_counter("origins", origins_count(st.origins));
	x_counter("oversized", ap_node_get_stats(n)->oversized);
	x_counter("entries", rs.entries);
	x_counter("nodes", rs.nodes);
	x_counter("memory", registry_mem_bytes(st.reg));
	ei_x_encode_atom(&st.x, "shm_state");
	ei_x_encode_atom(&st.x, rcpt_snap_state());
	x_counter("shm_keys", ss.keys);
	x_counter("shm_used", ss.used);
	x_counter("shm_compactions", ss.compactions);
	x_counter("shm_errors", ss.errors);
	x_counter("shm_rebuilds", ss.rebuilds);
	x_counter("shm_size", ss.size);
	ei_x_encode_atom(&st.x, "shm_name");
	ei_x_encode_binary(&st.x, ss.name, (long)strlen(ss.name));
	ei_x_encode_atom(&st.x, "io");
	ei_x_encode_atom(&st.x, ap_node_backend(n));
	ap_reply(n, self, m, st.x.buff, st.x.index);
}

static void reply_dump(ap_node *n, ap_proc *self, const ap_msg *m, long long max)
{
	registry_stats rs;
	registry_get_stats(st.reg, &rs);
	uint64_t count = (uint64_t)max < rs.keys ? (uint64_t)max : rs.keys;
	size_t cursor = 0;
	x_reset();
	if (count)
		ei_x_encode_list_header(&st.x, (long)count);
	for (uint64_t k = 0; k < count; k++) {
		const uint8_t *key, *val;
		size_t klen, vlen;
		if (registry_next(st.reg, &cursor, &key, &klen, &val, &vlen) != 1)
			break; /* cannot happen: count keys exist */
		ei_x_encode_tuple_header(&st.x, 2);
		ei_x_encode_binary(&st.x, key, (long)klen);
		ei_x_append_buf(&st.x, (const char *)val + 1, (int)vlen - 1);
	}
	ei_x_encode_empty_list(&st.x);
	ap_reply(n, self, m, st.x.buff, st.x.index);
}

static void handle_call(ap_node *n, ap_proc *self, const ap_msg *m)
{
	const char *b = m->buf;
	size_t len = (size_t)m->len;
	int i = m->index, arity;
	char op[16];
	if (ap_get_atom(b, &i, op, sizeof op) == 0) {
		if (!strcmp(op, "sync")) {
			ap_reply_atom(n, self, m, "ok");
		} else if (!strcmp(op, "pid")) {
			/* The BEAM addresses this incarnation by pid: a message meant
			 * for an earlier one is then dropped, not applied here. */
			x_reset();
			ei_x_encode_pid(&st.x, &self->pid);
			ap_reply(n, self, m, st.x.buff, st.x.index);
		} else if (!strcmp(op, "stats")) {
			reply_stats(n, self, m);
		} else {
			reply_badarg(n, self, m, "call");
		}
		return;
	}
	i = m->index;
	if (ei_decode_tuple_header(b, &i, &arity) || arity != 2 || ap_get_atom(b, &i, op, sizeof op)) {
		reply_badarg(n, self, m, "call");
		return;
	}
	if (!strcmp(op, "lookup")) {
		const char *key;
		size_t klen;
		const uint8_t *val;
		size_t vlen;
		if (get_key(b, len, &i, &key, &klen) || registry_value(st.reg, key, klen, &val, &vlen)) {
			reply_badarg(n, self, m, "lookup");
			return;
		}
		ap_reply(n, self, m, (const char *)val, (int)vlen);
	} else if (!strcmp(op, "dump")) {
		long long max;
		if (ei_decode_longlong(b, &i, &max) || max < 0) {
			reply_badarg(n, self, m, "dump");
			return;
		}
		reply_dump(n, self, m, max);
	} else {
		reply_badarg(n, self, m, "call");
	}
}

static void rcpt_fn(ap_node *n, ap_proc *self, const ap_msg *m)
{
	switch (m->kind) {
	case AP_MSG_CALL:
		handle_call(n, self, m);
		break;
	case AP_MSG_INFO:
	case AP_MSG_CAST:
		handle(m->buf, (size_t)m->len, m->index);
		break;
	case AP_MSG_EXIT:
		break;
	}
}

/* ---- life cycle ------------------------------------------------------------------------ */

ap_proc *rcpt_proto_start(ap_node *n, size_t max_listing)
{
	st.n = n;
	st.max_listing = max_listing;
	if (ei_x_new(&st.x) || !(st.reg = registry_new(&rcpt_snap_ops, NULL, max_listing)) ||
	    !(st.origins = origins_new(MAX_ORIGINS)))
		return NULL;
	st.self = ap_proc_spawn(n, PROC_NAME, rcpt_fn, &st);
	if (!st.self)
		return NULL;
	rcpt_snap_init(n, st.self, st.reg);
	return st.self;
}

void rcpt_proto_free(void)
{
	registry_free(st.reg);
	origins_free(st.origins);
	st.reg = NULL;
	st.origins = NULL;
	ei_x_free(&st.x);
}
