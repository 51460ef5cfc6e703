/* actor_pool_node: the pool C node. It hosts any number of stateless worker
 * pools (pool.c, pool_int.h) and a manager process, registered as `actor_pool_node`,
 * that starts, stops and lists them (docs/pool-protocol.md).
 *
 * Run by actor_cnode (--port), or by hand as a hidden node of a cluster:
 *   actor_pool_node --name N@host --cookie-file F --connect app@host \
 *       [--listen IPV4] [--no-fast-path] [--ring-poll-us N]
 *       [--ring-lone-poll-us N] [--ring-nap-us N] [--ring-ask-nap-us N]
 *       [--pool name:handler[:workers[:routing]][:key=ServiceId]]...
 * (the runtime flags, --listen and the handshake limits among them: ap_main.c).
 * A pool given a key is registered with the receptionist of the --connect
 * node (its actor_receptionist_server) each time the connection comes up,
 * so a restarted pool node registers again; the receptionist drops the
 * registration when the connection goes.
 *
 * The manager also answers node_stats (the node-wide counters and
 * max_frame) and dp_info: where a BEAM of this host attaches its
 * same-host ring segment (ring_ingress.c), unless --no-fast-path.
 */
#include <ei.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ap_ctrl.h"
#include "ap_dec.h"
#include "ap_log.h"
#include "ap_main.h"
#include "ap_term.h"
#include "handlers.h"
#include "isolate.h"
#include "pool.h"
#include "pool_limits.h"
#include "ring_ingress.h"

#define HANDLER_DESC 64
#define SPEC_MAX (AP_POOL_MAX_PATH + 1) /* a plugin's path with its NUL, or a built-in's name */

/* ---- decoding the manager's requests ------------------------------------- */

static int get_long(const char *b, int *i, long long *v)
{
	return ei_decode_longlong(b, i, v) ? -1 : 0;
}

static int get_number(const char *b, int *i, double *v)
{
	long long l;
	int j = *i;
	if (ei_decode_double(b, i, v) == 0)
		return 0;
	if (ei_decode_longlong(b, &j, &l) == 0) {
		*i = j;
		*v = (double)l;
		return 0;
	}
	return -1;
}

/* A routing's name, as the manager's options and --pool both give it. */
static int parse_routing(const char *name, ap_routing *out)
{
	if (!strcmp(name, "round_robin"))
		*out = AP_ROUTE_ROUND_ROBIN;
	else if (!strcmp(name, "smallest_mailbox"))
		*out = AP_ROUTE_SMALLEST_MAILBOX;
	else if (!strcmp(name, "random"))
		*out = AP_ROUTE_RANDOM;
	else
		return -1;
	return 0;
}

/* A bad option: {error, {badarg, {Key, Value}}}, Value copied as sent. */
struct badarg {
	const char *key;
	const char *val;
	int val_len;
};

/* Offending values are copied by the walk's end (b[0..len) is the request),
 * never ei's. */
static int bad(struct badarg *ba, const char *key, const char *b, size_t len, int vstart)
{
	int e = ap_term_end(b, len, vstart);
	if (e < 0)
		e = vstart;
	ba->key = key;
	ba->val = b + vstart;
	ba->val_len = e - vstart;
	return -1;
}

static int parse_backoff(const char *b, size_t len, int *i, ap_pool_opts *o, struct badarg *ba)
{
	int v0 = *i, n;
	if (ei_decode_map_header(b, i, &n))
		return bad(ba, "backoff", b, len, v0);
	for (int k = 0; k < n; k++) {
		char key[16];
		long long l;
		double d;
		if (ap_get_atom(b, i, key, sizeof key))
			return bad(ba, "backoff", b, len, v0);
		if (!strcmp(key, "min_ms")) {
			if (get_long(b, i, &l) || l < 1 || l > AP_POOL_MAX_BACKOFF_MS)
				return bad(ba, "backoff", b, len, v0);
			o->backoff_min_ms = (int)l;
		} else if (!strcmp(key, "max_ms")) {
			if (get_long(b, i, &l) || l < 1 || l > AP_POOL_MAX_BACKOFF_MS)
				return bad(ba, "backoff", b, len, v0);
			o->backoff_max_ms = (int)l;
		} else if (!strcmp(key, "jitter")) {
			/* Not d < 0 || d > 1: a NaN (a float a C peer can send,
			 * a BEAM cannot) fails both and would reach backoff_ms. */
			if (get_number(b, i, &d) || !(d >= 0 && d <= 1))
				return bad(ba, "backoff", b, len, v0);
			o->jitter = d;
		} else {
			return bad(ba, "backoff", b, len, v0);
		}
	}
	if (o->backoff_max_ms < o->backoff_min_ms)
		return bad(ba, "backoff", b, len, v0);
	return 0;
}

/* A list of absolute paths (binaries, no NUL) appended to buf at *len,
 * each with its NUL; *count of them. */
static int parse_paths(const char *b, int *i, char *buf, uint32_t *len, uint32_t *count)
{
	int n, type, size;
	if (ei_decode_list_header(b, i, &n) || n < 0)
		return -1;
	for (int k = 0; k < n; k++) {
		if (ei_get_type(b, i, &type, &size) || type != ERL_BINARY_EXT || size < 1 || size > AP_POOL_MAX_PATH ||
		    *count >= AP_SB_MAX_PATHS || *len + (uint32_t)size + 1 > AP_SB_PATHS_BYTES)
			return -1;
		long got;
		char *dst = buf + *len;
		if (ei_decode_binary(b, i, dst, &got) || got != size || dst[0] != '/' || memchr(dst, 0, (size_t)got))
			return -1;
		dst[got] = 0;
		*len += (uint32_t)got + 1;
		(*count)++;
	}
	if (n && (ei_decode_list_header(b, i, &n) || n != 0))
		return -1; /* a proper list's tail: [] */
	return 0;
}

/* sandbox => off | #{read, write, network, fork, uid, gid} (sandbox.h). */
static int parse_sandbox(const char *b, int *i, ap_sandbox_opts *o)
{
	char a[16];
	int n, i0 = *i;
	if (ap_get_atom(b, i, a, sizeof a) == 0) {
		o->off = !strcmp(a, "off");
		return o->off ? 0 : -1;
	}
	*i = i0;
	if (ei_decode_map_header(b, i, &n))
		return -1;
	char wr[AP_SB_PATHS_BYTES];
	uint32_t wlen = 0, nw = 0, total = 0;
	o->paths_len = o->n_read = 0;
	for (int k = 0; k < n; k++) {
		char key[16];
		long long l;
		if (ap_get_atom(b, i, key, sizeof key))
			return -1;
		if (!strcmp(key, "read")) {
			if (parse_paths(b, i, o->paths, &o->paths_len, &total))
				return -1;
			o->n_read = total - nw;
		} else if (!strcmp(key, "write")) {
			uint32_t before = total;
			if (parse_paths(b, i, wr, &wlen, &total))
				return -1;
			nw = total - before;
		} else if (!strcmp(key, "network") || !strcmp(key, "fork")) {
			if (ap_get_atom(b, i, a, sizeof a) || (strcmp(a, "true") && strcmp(a, "false")))
				return -1;
			*(key[0] == 'n' ? &o->network : &o->fork) = a[0] == 't';
		} else if (!strcmp(key, "uid") || !strcmp(key, "gid")) {
			/* Unprivileged ids only: 0 would be no drop at all. */
			if (get_long(b, i, &l) || l < 1 || l > 4294967294LL)
				return -1;
			*(key[0] == 'u' ? &o->uid : &o->gid) = l;
		} else {
			return -1;
		}
	}
	if (o->paths_len + wlen > AP_SB_PATHS_BYTES)
		return -1;
	memcpy(o->paths + o->paths_len, wr, wlen);
	o->paths_len += wlen;
	o->n_write = nw;
	return 0;
}

/* 1..max, or infinity (0: no limit). */
static int get_limit(const char *b, int *i, long long max, int *out)
{
	char a[16];
	long long l;
	int i0 = *i;
	if (ap_get_atom(b, i, a, sizeof a) == 0) {
		if (strcmp(a, "infinity"))
			return -1;
		*out = 0;
		return 0;
	}
	*i = i0;
	if (get_long(b, i, &l) || l < 1 || l > max)
		return -1;
	*out = (int)l;
	return 0;
}

static int parse_opts(const char *b, size_t len, int *i, ap_pool_opts *o, struct badarg *ba)
{
	int n, v0 = *i, mem_vs = 0, sb_vs = 0, tmo_given = 0;
	if (ei_decode_map_header(b, i, &n))
		return bad(ba, "options", b, len, v0);
	for (int k = 0; k < n; k++) {
		char key[32], a[32];
		long long l;
		if (ap_get_atom(b, i, key, sizeof key)) {
			if (ap_term_skip(b, len, i) || ap_term_skip(b, len, i))
				return bad(ba, "options", b, len, v0);
			continue;
		}
		int vs = *i;
		if (!strcmp(key, "workers")) {
			if (get_long(b, i, &l) || l < 0 || l > AP_POOL_MAX_WORKERS)
				return bad(ba, "workers", b, len, vs);
			o->workers = (int)l;
		} else if (!strcmp(key, "routing")) {
			if (ap_get_atom(b, i, a, sizeof a) || parse_routing(a, &o->routing))
				return bad(ba, "routing", b, len, vs);
		} else if (!strcmp(key, "mailbox_limit")) {
			if (get_long(b, i, &l) || l < 1 || l > AP_POOL_MAX_MAILBOX)
				return bad(ba, "mailbox_limit", b, len, vs);
			o->mailbox_limit = (uint32_t)l;
		} else if (!strcmp(key, "stable_ms")) {
			if (get_long(b, i, &l) || l < 0 || l > AP_POOL_MAX_STABLE_MS)
				return bad(ba, "stable_ms", b, len, vs);
			o->stable_ms = (int)l;
		} else if (!strcmp(key, "backoff")) {
			if (parse_backoff(b, len, i, o, ba))
				return -1;
		} else if (!strcmp(key, "isolation")) {
			if (ap_get_atom(b, i, a, sizeof a))
				return bad(ba, "isolation", b, len, vs);
			if (!strcmp(a, "thread"))
				o->isolation = AP_ISO_THREAD;
			else if (!strcmp(a, "process"))
				o->isolation = AP_ISO_PROCESS;
			else
				return bad(ba, "isolation", b, len, vs);
		} else if (!strcmp(key, "handler_timeout_ms")) {
			if (get_limit(b, i, AP_POOL_MAX_HANDLER_TIMEOUT_MS, &o->handler_timeout_ms))
				return bad(ba, "handler_timeout_ms", b, len, vs);
			tmo_given = 1;
		} else if (!strcmp(key, "stall_ms")) {
			if (get_limit(b, i, AP_POOL_MAX_STALL_MS, &o->stall_ms))
				return bad(ba, "stall_ms", b, len, vs);
		} else if (!strcmp(key, "sandbox")) {
			sb_vs = vs;
			if (parse_sandbox(b, i, &o->sandbox))
				return bad(ba, "sandbox", b, len, vs);
		} else if (!strcmp(key, "max_memory_mb")) {
			mem_vs = vs;
			if (get_limit(b, i, AP_POOL_MAX_MEMORY_MB, &o->max_memory_mb))
				return bad(ba, "max_memory_mb", b, len, vs);
		} else if (!strcmp(key, "max_reply_atoms")) {
			/* No infinity: without a bound a handler could fill
			 * the caller's atom table, which aborts the BEAM. */
			if (get_long(b, i, &l) || l < 1 || l > AP_POOL_MAX_REPLY_ATOMS)
				return bad(ba, "max_reply_atoms", b, len, vs);
			o->max_reply_atoms = (uint32_t)l;
		} else {
			/* Options the Erlang side keeps for itself (node, ...). */
			if (ap_term_skip(b, len, i))
				return bad(ba, "options", b, len, v0);
		}
	}
	/* A thread cannot be given a memory limit of its own. */
	if (o->max_memory_mb && o->isolation != AP_ISO_PROCESS)
		return bad(ba, "max_memory_mb", b, len, mem_vs);
	/* ... nor a sandbox: the pool node's own threads would be in it. */
	if (sb_vs && o->isolation != AP_ISO_PROCESS)
		return bad(ba, "sandbox", b, len, sb_vs);
	/* A worker process can be killed: a stuck one is, by default. */
	if (!tmo_given && o->isolation == AP_ISO_PROCESS)
		o->handler_timeout_ms = AP_POOL_DEFAULT_PROCESS_TIMEOUT_MS;
	return 0;
}

/* Handler: echo | json_validate | {plugin, Path} | {plugin, Path, Config}.
 * Returns 0, or an error term appended to err. */
static int resolve_handler(const char *b, size_t blen, int *i, int process, const actor_pool_handler **h, void **dl,
			   const char **config, int *config_len, char *desc, char *spec, ei_x_buff *err)
{
	int v0 = *i, arity, type, size;
	char a[32];
	*dl = NULL;
	*config = NULL;
	*config_len = 0;
	if (ap_get_atom(b, i, a, sizeof a) == 0) {
		*h = ap_builtin_handler(a);
		if (*h) {
			snprintf(desc, HANDLER_DESC, "%s", a);
			snprintf(spec, SPEC_MAX, "%s", a);
			return 0;
		}
	} else if (ei_decode_tuple_header(b, i, &arity) == 0 && (arity == 2 || arity == 3) &&
		   ap_get_atom(b, i, a, sizeof a) == 0 && !strcmp(a, "plugin") && ei_get_type(b, i, &type, &size) == 0 &&
		   type == ERL_BINARY_EXT && size > 0 && size <= AP_POOL_MAX_PATH) {
		/* why: the loader's message or ours, after the whole path */
		char path[AP_POOL_MAX_PATH + 1], why[AP_POOL_MAX_PATH + 256];
		long len;
		ei_decode_binary(b, i, path, &len);
		path[len] = 0;
		if (arity == 3) {
			int ce = ap_term_end(b, blen, *i);
			if (ce < 0)
				goto badarg;
			*config = b + *i;
			*config_len = ce - *i;
			*i = ce;
		}
		uint32_t got = 0;
		/* First that the file is there to be opened, the same in both
		 * modes: a missing one is plugin_load_failed naming why (in
		 * process mode it would otherwise be a sandbox layer failing
		 * in each worker), and a FIFO never holds up the loop in
		 * dlopen. Then a worker process loads it in its sandbox and
		 * says why it cannot (isolate_child.c): loading runs its
		 * code, which is not to run here; a thread's is loaded here. */
		*h = NULL;
		int r = ap_plugin_check(path, why, sizeof why);
		if (r == 0 && !process)
			r = ap_plugin_load(path, h, dl, &got, why, sizeof why);
		if (r == 0) {
			const char *base = strrchr(path, '/');
			snprintf(desc, HANDLER_DESC, "plugin:%.55s", base ? base + 1 : path);
			snprintf(spec, SPEC_MAX, "%s", path);
			return 0;
		}
		/* {abi_mismatch, Got, Want} or {plugin_load_failed, Path, Why} */
		ei_x_encode_tuple_header(err, 3);
		if (r == -2) {
			ei_x_encode_atom(err, "abi_mismatch");
			ei_x_encode_ulong(err, got);
			ei_x_encode_ulong(err, ACTOR_POOL_HANDLER_ABI);
		} else {
			ei_x_encode_atom(err, "plugin_load_failed");
			ei_x_encode_binary(err, path, len);
			ei_x_encode_binary(err, why, (long)strlen(why));
		}
		return -1;
	}
badarg:;
	/* {badarg, {handler, Handler}} */
	int e = ap_term_end(b, blen, v0);
	if (e < 0)
		e = v0;
	ei_x_encode_tuple_header(err, 2);
	ei_x_encode_atom(err, "badarg");
	ei_x_encode_tuple_header(err, 2);
	ei_x_encode_atom(err, "handler");
	ei_x_append_buf(err, b + v0, e - v0);
	return -1;
}

/* ---- the manager ---------------------------------------------------------- */

static void reply_error(ap_node *n, ap_proc *self, const ap_msg *m, ei_x_buff *reason)
{
	ei_x_buff x;
	ei_x_new(&x);
	ei_x_encode_tuple_header(&x, 2);
	ei_x_encode_atom(&x, "error");
	ei_x_append_buf(&x, reason->buff, reason->index);
	ap_reply(n, self, m, x.buff, x.index);
	ei_x_free(&x);
}

static void reply_error_atom(ap_node *n, ap_proc *self, const ap_msg *m, const char *atom)
{
	ei_x_buff r;
	ei_x_new(&r);
	ei_x_encode_atom(&r, atom);
	reply_error(n, self, m, &r);
	ei_x_free(&r);
}

static void start_pool(ap_node *n, ap_proc *self, const ap_msg *m, const char *b, int i)
{
	char name[MAXATOMLEN_UTF8], desc[HANDLER_DESC];
	const actor_pool_handler *h;
	void *dl;
	const char *config;
	int config_len;
	ap_pool_opts o;
	struct badarg ba;
	ei_x_buff err;
	ei_x_new(&err);

	ap_pool_opts_default(&o);
	if (ap_get_atom(b, &i, name, sizeof name)) {
		ei_x_encode_tuple_header(&err, 2);
		ei_x_encode_atom(&err, "badarg");
		ei_x_encode_tuple_header(&err, 2);
		ei_x_encode_atom(&err, "name");
		int e = ap_term_end(b, (size_t)m->len, i);
		ei_x_append_buf(&err, b + i, e < 0 ? 0 : e - i);
		goto fail;
	}
	int hstart = i;
	int he = ap_term_end(b, (size_t)m->len, i);
	if (he < 0) {
		reply_error_atom(n, self, m, "badarg");
		ei_x_free(&err);
		return;
	}
	i = he; /* options first: a bad option must not leave a plugin loaded */
	if (parse_opts(b, (size_t)m->len, &i, &o, &ba)) {
		ei_x_encode_tuple_header(&err, 2);
		ei_x_encode_atom(&err, "badarg");
		ei_x_encode_tuple_header(&err, 2);
		ei_x_encode_atom(&err, ba.key);
		ei_x_append_buf(&err, ba.val, ba.val_len);
		goto fail;
	}
	if (ap_proc_whereis(n, name)) {
		reply_error_atom(n, self, m, "already_started");
		ei_x_free(&err);
		return;
	}
	i = hstart;
	char spec[SPEC_MAX];
	if (resolve_handler(b, (size_t)m->len, &i, o.isolation == AP_ISO_PROCESS, &h, &dl, &config, &config_len, desc,
			    spec, &err))
		goto fail;

	ap_pending_reply *pr = calloc(1, sizeof *pr);
	size_t st = pr ? ap_encode_reply_head(&pr->head, &self->pid, &m->from, m->tag, m->tag_len) : (size_t)-1;
	if (st == (size_t)-1) {
		if (pr)
			ap_buf_free(&pr->head);
		free(pr);
		if (dl)
			ap_plugin_unload(dl);
		reply_error_atom(n, self, m, "enomem");
		ei_x_free(&err);
		return;
	}
	snprintf(pr->node, sizeof pr->node, "%s", m->from.node);
	/* The plugin's Config goes to init with its version byte. */
	uint8_t *cfg = NULL;
	if (config_len) {
		cfg = malloc((size_t)config_len + 1);
		if (cfg) {
			cfg[0] = 131;
			memcpy(cfg + 1, config, (size_t)config_len);
		}
	}
	int r = ap_pool_start(n, name, desc, spec, h, dl, cfg, cfg ? (size_t)config_len + 1 : 0, &o,
			      o.isolation == AP_ISO_PROCESS ? &ap_worker_processes : &ap_worker_threads, ap_pool_process, pr);
	free(cfg);
	if (r) {
		ap_buf_free(&pr->head);
		free(pr);
		if (dl)
			ap_plugin_unload(dl);
		reply_error_atom(n, self, m, r == -EEXIST ? "already_started" : "enomem");
	}
	ei_x_free(&err);
	return;
fail:
	reply_error(n, self, m, &err);
	ei_x_free(&err);
}

static void stop_pool(ap_node *n, ap_proc *self, const ap_msg *m, const char *b, int i)
{
	char name[MAXATOMLEN_UTF8];
	erlang_pid pid;
	int type, size;
	ap_pool *p = NULL;
	if (ap_get_atom(b, &i, name, sizeof name) == 0)
		p = ap_pool_find(n, name, NULL);
	else if (ei_get_type(b, &i, &type, &size) == 0 && type == ERL_PID_EXT && ei_decode_pid(b, &i, &pid) == 0)
		p = ap_pool_find(n, NULL, &pid);
	if (!p) {
		reply_error_atom(n, self, m, "noproc");
		return;
	}
	ap_pool_stop(n, p);
	ap_reply_atom(n, self, m, "ok");
}

static void registered(const char *b, int i);

/* node_stats: the node-wide counters (a frame over max_frame from any peer
 * is counted in `oversized'), and max_frame, so that a BEAM sizes its
 * messages and batches to fit. */
static void reply_node_stats(ap_node *n, ap_proc *self, const ap_msg *m)
{
	const ap_node_stats *s = ap_node_get_stats(n);
	ei_x_buff x;
	ei_x_new(&x);
	ei_x_encode_map_header(&x, 18);
	ei_x_encode_atom(&x, "received");
	ei_x_encode_ulonglong(&x, s->received);
	ei_x_encode_atom(&x, "unknown_name");
	ei_x_encode_ulonglong(&x, s->unknown_name);
	ei_x_encode_atom(&x, "no_pool_tells");
	ei_x_encode_ulonglong(&x, ap_pool_no_pool_tells());
	ei_x_encode_atom(&x, "bad_frames");
	ei_x_encode_ulonglong(&x, s->bad_frames);
	ei_x_encode_atom(&x, "dropped");
	ei_x_encode_ulonglong(&x, s->dropped);
	ei_x_encode_atom(&x, "oversized");
	ei_x_encode_ulonglong(&x, s->oversized);
	ei_x_encode_atom(&x, "connections");
	ei_x_encode_long(&x, s->connections);
	ei_x_encode_atom(&x, "io");
	ei_x_encode_atom(&x, ap_node_backend(n));
	ei_x_encode_atom(&x, "max_frame");
	ei_x_encode_ulong(&x, ap_node_max_frame(n));
	ei_x_encode_atom(&x, "ring_naps");
	ei_x_encode_ulonglong(&x, ap_dp_naps());
	ei_x_encode_atom(&x, "ring_ask_naps");
	ei_x_encode_ulonglong(&x, ap_dp_ask_naps());
	ei_x_encode_atom(&x, "ring_lone_windows");
	ei_x_encode_ulonglong(&x, ap_dp_lone_windows());
	ei_x_encode_atom(&x, "iso_loop_results");
	ei_x_encode_ulonglong(&x, ap_iso_loop_results());
	ei_x_encode_atom(&x, "iso_bare_tells");
	ei_x_encode_ulonglong(&x, ap_iso_bare_tells());
	ei_x_encode_atom(&x, "iso_bare_rehydrated");
	ei_x_encode_ulonglong(&x, ap_iso_bare_rehydrated());
	ei_x_encode_atom(&x, "iso_loop_waits");
	ei_x_encode_ulonglong(&x, ap_dp_iso_waits());
	ei_x_encode_atom(&x, "iso_loop_waits_missed");
	ei_x_encode_ulonglong(&x, ap_dp_iso_waits_missed());
	ei_x_encode_atom(&x, "iso_follows");
	ei_x_encode_ulonglong(&x, ap_iso_follows_all());
	ap_reply(n, self, m, x.buff, x.index);
	ei_x_free(&x);
}

static void manager_fn(ap_node *n, ap_proc *self, const ap_msg *m)
{
	const char *b = m->buf;
	int i = m->index, arity;
	char op[32];
	if (m->kind == AP_MSG_INFO) {
		registered(b, i);
		return;
	}
	if (m->kind != AP_MSG_CALL)
		return;
	if (ap_get_atom(b, &i, op, sizeof op) == 0 && !strcmp(op, "dp_info")) {
		ei_x_buff x;
		ei_x_new(&x);
		ap_dp_encode_info(&x);
		ap_reply(n, self, m, x.buff, x.index);
		ei_x_free(&x);
		return;
	}
	i = m->index;
	if (ap_get_atom(b, &i, op, sizeof op) == 0 && !strcmp(op, "node_stats")) {
		reply_node_stats(n, self, m);
		return;
	}
	i = m->index;
	if (ap_get_atom(b, &i, op, sizeof op) == 0 && !strcmp(op, "which_pools")) {
		ei_x_buff x;
		ei_x_new(&x);
		ap_pool_encode_list(&x);
		ap_reply(n, self, m, x.buff, x.index);
		ei_x_free(&x);
		return;
	}
	i = m->index;
	if (ei_decode_tuple_header(b, &i, &arity) == 0 && ap_get_atom(b, &i, op, sizeof op) == 0) {
		if (arity == 4 && !strcmp(op, "start_pool")) {
			start_pool(n, self, m, b, i);
			return;
		}
		if (arity == 2 && !strcmp(op, "stop_pool")) {
			stop_pool(n, self, m, b, i);
			return;
		}
	}
	reply_error_atom(n, self, m, "unknown_request");
}

/* ---- standalone pools: --pool name:handler[:workers[:routing]][:key=Id] ---- */

#define MAX_KEYED 64
#define MAX_KEY 1024 /* the receptionist's limit on a service id */

static struct keyed {
	char name[MAXATOMLEN_UTF8];
	char key[MAX_KEY + 1];
	int acked; /* the receptionist answered {registered, ...} on this connection */
} keyed[MAX_KEYED];
static int nkeyed;
static ap_proc *manager;
static int retry_armed;

#define REGISTER_RETRY_MS 1000

static void register_keyed(ap_node *n, void *arg);

static void register_retry(ap_node *n, void *arg)
{
	(void)arg;
	retry_armed = 0;
	register_keyed(n, NULL);
}

/* The parent connection came up (again): every keyed pool registers anew
 * (the receptionist dropped them when the connection went). */
static void parent_up(ap_node *n, void *arg)
{
	(void)arg;
	for (int k = 0; k < nkeyed; k++)
		keyed[k].acked = 0;
	register_keyed(n, NULL);
}

/* {'$gen_cast', {register, Id, PoolPid, Manager}} to the parent's
 * receptionist server for every keyed pool not acknowledged yet, again
 * every second until it is: the server may not run yet (the parent's
 * distribution comes up before its application), and a message to a
 * registered name that does not exist is dropped without a word. */
static void register_keyed(ap_node *n, void *arg)
{
	(void)arg;
	const char *parent = ap_node_parent(n);
	int pending = 0;
	for (int k = 0; parent && k < nkeyed; k++) {
		ap_proc *p = ap_proc_whereis(n, keyed[k].name);
		if (!p || keyed[k].acked)
			continue;
		pending = 1;
		ei_x_buff x;
		if (ei_x_new_with_version(&x))
			return;
		ei_x_encode_tuple_header(&x, 2);
		ei_x_encode_atom(&x, AP_GEN_CAST);
		ei_x_encode_tuple_header(&x, 4);
		ei_x_encode_atom(&x, "register");
		ei_x_encode_binary(&x, keyed[k].key, (long)strlen(keyed[k].key));
		ei_x_encode_pid(&x, &p->pid);
		ei_x_encode_pid(&x, &manager->pid);
		(void)ap_send_named(n, manager, parent, "actor_receptionist_server", x.buff, x.index);
		ei_x_free(&x);
	}
	if (pending && !retry_armed && ap_node_timer(n, REGISTER_RETRY_MS, register_retry, NULL) == 0)
		retry_armed = 1;
}

/* {registered, {service_key, Id}, PoolPid}: the receptionist recorded it. */
static void registered(const char *b, int i)
{
	int arity;
	char a[32];
	long len;
	char key[MAX_KEY + 1];
	erlang_pid pid;
	if (ei_decode_tuple_header(b, &i, &arity) || arity != 3 || ap_get_atom(b, &i, a, sizeof a) ||
	    strcmp(a, "registered") || ei_decode_tuple_header(b, &i, &arity) || arity != 2 ||
	    ap_get_atom(b, &i, a, sizeof a) || strcmp(a, "service_key"))
		return;
	int type, size;
	if (ei_get_type(b, &i, &type, &size) || type != ERL_BINARY_EXT || size < 1 || size > MAX_KEY ||
	    ei_decode_binary(b, &i, key, &len) || ei_decode_pid(b, &i, &pid))
		return;
	key[len] = 0;
	for (int k = 0; k < nkeyed; k++)
		if (!keyed[k].acked && !strcmp(keyed[k].key, key)) {
			keyed[k].acked = 1;
			ap_log(AP_LOG_INFO, "pool %s registered under '%s'", keyed[k].name, key);
		}
}

static int start_spec(ap_node *n, const char *spec)
{
	char buf[512 + MAX_KEY], *save = NULL;
	if ((size_t)snprintf(buf, sizeof buf, "%s", spec) >= sizeof buf) {
		ap_log(AP_LOG_ERROR, "--pool '%.64s...': too long", spec);
		return -1;
	}
	/* The key is the rest after ":key=", so it may hold ':' itself. */
	char *key = strstr(buf, ":key=");
	if (key) {
		*key = 0;
		key += 5;
		size_t klen = strlen(key);
		if (klen < 1 || klen > MAX_KEY || nkeyed == MAX_KEYED) {
			ap_log(AP_LOG_ERROR, "bad key in --pool '%s': 1..%d bytes, at most %d keyed pools", spec,
			       MAX_KEY, MAX_KEYED);
			return -1;
		}
	}
	char *name = strtok_r(buf, ":", &save);
	char *handler = strtok_r(NULL, ":", &save);
	char *workers = strtok_r(NULL, ":", &save);
	char *routing = strtok_r(NULL, ":", &save);
	ap_pool_opts o;
	ap_pool_opts_default(&o);
	if (!name || !handler) {
		ap_log(AP_LOG_ERROR, "bad --pool '%s': want name:handler[:workers[:routing]][:key=Id]", spec);
		return -1;
	}
	if (workers) {
		char *end;
		long w = strtol(workers, &end, 10);
		if (*end || w < 0 || w > AP_POOL_MAX_WORKERS) {
			ap_log(AP_LOG_ERROR, "bad worker count in --pool '%s'", spec);
			return -1;
		}
		o.workers = (int)w;
	}
	if (routing && parse_routing(routing, &o.routing)) {
		ap_log(AP_LOG_ERROR, "bad routing in --pool '%s'", spec);
		return -1;
	}
	const actor_pool_handler *h = ap_builtin_handler(handler);
	void *dl = NULL;
	char desc[HANDLER_DESC];
	snprintf(desc, sizeof desc, "%s", handler);
	if (!h) {
		/* Not a built-in: a plugin path. */
		char why[256];
		uint32_t got = 0;
		if (ap_plugin_load(handler, &h, &dl, &got, why, sizeof why)) {
			ap_log(AP_LOG_ERROR, "--pool '%s': cannot load handler: %s", spec, why);
			return -1;
		}
	}
	if (ap_pool_start(n, name, desc, handler, h, dl, NULL, 0, &o, &ap_worker_threads, ap_pool_process, NULL)) {
		if (dl)
			ap_plugin_unload(dl);
		ap_log(AP_LOG_ERROR, "--pool '%s': cannot start (name taken?)", spec);
		return -1;
	}
	if (key) {
		snprintf(keyed[nkeyed].name, sizeof keyed[nkeyed].name, "%s", name);
		snprintf(keyed[nkeyed].key, sizeof keyed[nkeyed].key, "%s", key);
		nkeyed++;
	}
	return 0;
}

/* argv[k + 1] as 0..max microseconds into *v: 0, or 1 (logged) when it
 * is missing or not such a number. */
static int us_arg(int argc, char **argv, int k, long max, int *v)
{
	char *end = NULL;
	long x = k + 1 < argc ? strtol(argv[k + 1], &end, 10) : -1;
	if (!end || x < 0 || x > max || *end || end == argv[k + 1]) {
		ap_log(AP_LOG_ERROR, "%s wants 0..%ld microseconds", argv[k], max);
		return 1;
	}
	*v = (int)x;
	return 0;
}

static int pool_node_init(ap_node *n, int argc, char **argv)
{
	/* Workers and the ring attach thread run until the process exits. */
	ap_node_outlived_by_threads(n);
	if (!(manager = ap_proc_spawn(n, "actor_pool_node", manager_fn, NULL)))
		return 1;
	ap_node_on_parent_up(n, parent_up, NULL);
	ap_node_set_dead_letter(n, ap_pool_dead_letter);
	ap_node_timer(n, 1000, ap_pool_tick, NULL);
	ap_pool_barriers_init();
	if (ap_iso_watch_children(n))
		return 1;
	int fast_path = 1, poll_us = AP_DP_POLL_US_DEFAULT, lone_us = AP_DP_LONE_US_DEFAULT,
	    nap_us = AP_DP_NAP_US_DEFAULT, ask_nap_us = AP_DP_ASK_NAP_US_DEFAULT;
	/* The ring settings, read before the pools start (ap_dp_start) and
	 * passed over with their value after. */
	const struct {
		const char *flag;
		long max;
		int *v;
	} ring_flags[] = { { "--ring-poll-us", AP_POOL_MAX_RING_POLL_US, &poll_us },
			   { "--ring-lone-poll-us", AP_POOL_MAX_RING_POLL_US, &lone_us },
			   { "--ring-nap-us", AP_POOL_MAX_RING_NAP_US, &nap_us },
			   { "--ring-ask-nap-us", AP_POOL_MAX_RING_NAP_US, &ask_nap_us } };
	const size_t n_ring_flags = sizeof ring_flags / sizeof ring_flags[0];
	for (int k = 0; k < argc; k++) {
		if (!strcmp(argv[k], "--no-fast-path"))
			fast_path = 0;
		for (size_t f = 0; f < n_ring_flags; f++)
			if (!strcmp(argv[k], ring_flags[f].flag) && us_arg(argc, argv, k, ring_flags[f].max, ring_flags[f].v))
				return 1;
	}
	if (ap_dp_start(n, fast_path, poll_us, lone_us, nap_us, ask_nap_us))
		return 1;
	for (int k = 0; k < argc; k++) {
		size_t f = 0;
		while (f < n_ring_flags && strcmp(argv[k], ring_flags[f].flag))
			f++;
		if (f < n_ring_flags) {
			k++;
			continue;
		}
		if (!strcmp(argv[k], "--no-fast-path")) {
			continue;
		} else if (!strcmp(argv[k], "--pool") && k + 1 < argc) {
			if (start_spec(n, argv[++k]))
				return 1;
		} else {
			ap_log(AP_LOG_ERROR, "unknown argument '%s'", argv[k]);
			return 1;
		}
	}
	return 0;
}

int main(int argc, char **argv)
{
	if (argc >= 2 && !strcmp(argv[1], "--isolated-worker"))
		return ap_iso_child_main(argc, argv);
	/* Worker processes' exits are read from a signalfd on the loop, so no
	 * thread may take SIGCHLD: block it before the first thread exists
	 * (every later one inherits the mask). */
	sigset_t chld;
	sigemptyset(&chld);
	sigaddset(&chld, SIGCHLD);
	pthread_sigmask(SIG_BLOCK, &chld, NULL);
	return ap_cnode_main(argc, argv, "actor_pool_node", pool_node_init);
}
