/* actor_pool_node: the pool C node. It hosts any number of stateless worker
 * pools (pool.c, pool_int.h) and a manager process, registered as
 * `actor_pool_node`, that starts (the options it checks: pool_opts.c), stops
 * and lists them (docs/pool-protocol.md).
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
 * same-host ring segment (dataplane/node/), unless --no-fast-path.
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
#include "pool_opts.h"
#include "ring_ingress.h"

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
	char name[MAXATOMLEN_UTF8], desc[AP_POOL_HANDLER_DESC];
	const actor_pool_handler *h;
	void *dl;
	const char *config;
	int config_len;
	ap_pool_opts o;
	struct ap_badarg ba;
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
	if (ap_pool_parse_opts(b, (size_t)m->len, &i, &o, &ba)) {
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
	char spec[AP_POOL_SPEC_MAX];
	if (ap_pool_resolve_handler(b, (size_t)m->len, &i, o.isolation == AP_ISO_PROCESS, &h, &dl, &config, &config_len, desc,
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
	if (routing && ap_pool_parse_routing(routing, &o.routing)) {
		ap_log(AP_LOG_ERROR, "bad routing in --pool '%s'", spec);
		return -1;
	}
	const actor_pool_handler *h = ap_builtin_handler(handler);
	void *dl = NULL;
	char desc[AP_POOL_HANDLER_DESC];
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
