/* pool_opts: a pool's options and handler as the manager's start_pool
 * gives them (docs/pool-protocol.md), decoded and checked against
 * pool_limits.h: any peer of the cluster can send one. A bad one is
 * {error, {badarg, {Key, Value}}}, Value copied as sent. */
#include <stdio.h>
#include <string.h>

#include "ap_dec.h"
#include "ap_term.h"
#include "handlers.h"
#include "pool_opts.h"

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
int ap_pool_parse_routing(const char *name, ap_routing *out)
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

/* Offending values are copied by the walk's end (b[0..len) is the request),
 * never ei's. */
static int bad(struct ap_badarg *ba, const char *key, const char *b, size_t len, int vstart)
{
	int e = ap_term_end(b, len, vstart);
	if (e < 0)
		e = vstart;
	ba->key = key;
	ba->val = b + vstart;
	ba->val_len = e - vstart;
	return -1;
}

static int parse_backoff(const char *b, size_t len, int *i, ap_pool_opts *o, struct ap_badarg *ba)
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

int ap_pool_parse_opts(const char *b, size_t len, int *i, ap_pool_opts *o, struct ap_badarg *ba)
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
			if (ap_get_atom(b, i, a, sizeof a) || ap_pool_parse_routing(a, &o->routing))
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
int ap_pool_resolve_handler(const char *b, size_t blen, int *i, int process, const actor_pool_handler **h, void **dl,
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
			snprintf(desc, AP_POOL_HANDLER_DESC, "%s", a);
			snprintf(spec, AP_POOL_SPEC_MAX, "%s", a);
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
			snprintf(desc, AP_POOL_HANDLER_DESC, "plugin:%.55s", base ? base + 1 : path);
			snprintf(spec, AP_POOL_SPEC_MAX, "%s", path);
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
