/* stats: a pool's counters, the stats map, and its throughput over a
 * sliding window. */
#include <string.h>

#include "ap_atomset.h"
#include "ap_time.h"
#include "pool_int.h"
#include "sandbox.h"

static const char *routing_name(ap_routing r)
{
	return r == AP_ROUTE_RANDOM ? "random" : r == AP_ROUTE_SMALLEST_MAILBOX ? "smallest_mailbox" : "round_robin";
}

static void kv_u64(ei_x_buff *x, const char *k, uint64_t v)
{
	ei_x_encode_atom(x, k);
	ei_x_encode_ulonglong(x, v);
}

/* A limit: the number, or infinity when off (0). */
static void kv_limit(ei_x_buff *x, const char *k, int v)
{
	ei_x_encode_atom(x, k);
	if (v > 0)
		ei_x_encode_ulong(x, (unsigned long)v);
	else
		ei_x_encode_atom(x, "infinity");
}

static double throughput(ap_pool *p, uint64_t processed, int64_t now);

void ap_pool_encode_stats(ap_pool *p, ei_x_buff *x)
{
	uint64_t processed = 0, errors = 0, crashes = 0, restarts = 0;
	for (int i = 0; i < p->o.workers; i++) {
		processed += atomic_load(&p->w[i].processed);
		errors += atomic_load(&p->w[i].errors);
		crashes += atomic_load(&p->w[i].crashes);
		restarts += p->w[i].restarts;
	}
	uint64_t by[AP_CRASH_CAUSES] = { 0 };
	for (int i = 0; i < p->o.workers; i++)
		for (int c = 0; c < AP_CRASH_CAUSES; c++)
			by[c] += atomic_load(&p->w[i].crash_by[c]);
	uint64_t stalls = 0;
	for (int i = 0; i < p->o.workers; i++)
		stalls += p->w[i].stalls;
	/* The buckets, then the sum (ns). */
	uint64_t run[AP_HIST_BUCKETS + 1] = { 0 };
	for (int i = 0; i < p->o.workers; i++) {
		if (p->w[i].ops->harvest)
			p->w[i].ops->harvest(&p->w[i]);
		ap_hist_sum_into(run, &p->w[i].run_ns);
	}
	ap_hist_sum_into(run, &p->inline_ns);
	ei_x_encode_map_header(x, 27);
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
	kv_u64(x, "ran_on_loop", p->inline_runs);
	ei_x_encode_atom(x, "throughput_10s");
	ei_x_encode_double(x, throughput(p, processed, ap_node_now_ms(p->n)));
	kv_u64(x, "uptime_ms", (uint64_t)(ap_node_now_ms(p->n) - p->started_ms));
	kv_u64(x, "mailbox_limit", p->o.mailbox_limit);
	ei_x_encode_atom(x, "isolation");
	ei_x_encode_atom(x, p->o.isolation == AP_ISO_PROCESS ? "process" : "thread");
	kv_limit(x, "handler_timeout_ms", p->o.handler_timeout_ms);
	kv_limit(x, "stall_ms", p->o.stall_ms);
	/* The watchdog's (watchdog.c): workers held back for one message. */
	kv_u64(x, "stalls", stalls);
	kv_limit(x, "max_memory_mb", p->o.max_memory_mb);
	ei_x_encode_atom(x, "sandbox");
	ap_sb_encode_stats(x, &p->o.sandbox, p->o.isolation == AP_ISO_PROCESS, p->o.max_memory_mb,
			   p->o.workers && p->w[0].ops->sb_layers ? p->w[0].ops->sb_layers(&p->w[0]) : 0);
	/* reply.c: replies refused, and the atoms replies carried against
	 * their budget. */
	kv_u64(x, "bad_replies", atomic_load_explicit(&p->bad_replies, memory_order_relaxed));
	kv_u64(x, "reply_atoms", ap_atomset_count(p->atoms));
	kv_u64(x, "max_reply_atoms", p->o.max_reply_atoms);
	ei_x_encode_atom(x, "crash_causes");
	ei_x_encode_map_header(x, AP_CRASH_CAUSES);
	kv_u64(x, "signal", by[AP_CRASH_SIGNAL]);
	kv_u64(x, "exit", by[AP_CRASH_EXIT]);
	kv_u64(x, "timeout", by[AP_CRASH_TIMEOUT]);
	kv_u64(x, "handler", by[AP_CRASH_HANDLER]);
	/* How long the handler took on asks (a tell is not timed: two
	 * clock reads cost as much as a whole tell of a flood): the upper
	 * bounds, the count per
	 * bucket (not cumulative; one more, past the last bound), the sum. */
	ei_x_encode_atom(x, "handler_time");
	ei_x_encode_map_header(x, 3);
	ei_x_encode_atom(x, "bounds_ns");
	ei_x_encode_list_header(x, AP_HIST_BOUNDS);
	for (int b = 0; b < AP_HIST_BOUNDS; b++)
		ei_x_encode_ulonglong(x, ap_hist_bounds_ns[b]);
	ei_x_encode_empty_list(x);
	ei_x_encode_atom(x, "counts");
	ei_x_encode_list_header(x, AP_HIST_BUCKETS);
	for (int b = 0; b < AP_HIST_BUCKETS; b++)
		ei_x_encode_ulonglong(x, run[b]);
	ei_x_encode_empty_list(x);
	kv_u64(x, "sum_ns", run[AP_HIST_BUCKETS]);
	/* Messages received (tells and asks) per ingress: stats requests and
	 * control calls are not counted. */
	ei_x_encode_atom(x, "by_path");
	ei_x_encode_map_header(x, 2);
	kv_u64(x, "dist", p->by_dist);
	kv_u64(x, "ring", p->by_ring);
	ei_x_encode_atom(x, "workers");
	ei_x_encode_list_header(x, p->o.workers);
	int64_t now = ap_mono_ms();
	for (int i = 0; i < p->o.workers; i++) {
		ap_worker *w = &p->w[i];
		ei_x_encode_map_header(x, 10);
		kv_u64(x, "id", (uint64_t)i);
		ei_x_encode_atom(x, "alive");
		ei_x_encode_atom(x, ap_worker_alive(w) ? "true" : "false");
		kv_u64(x, "mailbox", ap_mbox_depth(&w->mb));
		kv_u64(x, "processed", atomic_load(&w->processed));
		kv_u64(x, "restarts", w->restarts);
		kv_u64(x, "crashes", atomic_load(&w->crashes));
		kv_u64(x, "next_restart_ms", (uint64_t)w->next_restart_ms);
		ei_x_encode_atom(x, "os_pid");
		int pid = atomic_load(&w->os_pid);
		if (pid > 0)
			ei_x_encode_ulong(x, (unsigned long)pid);
		else
			ei_x_encode_atom(x, "undefined");
		/* The watchdog's verdict first: a stalled worker is not alive. */
		ei_x_encode_atom(x, "state");
		ei_x_encode_atom(x, w->wd_state == W_HUNG	       ? "hung"
				    : w->wd_state != W_RUNNING ? "stalled"
				    : !ap_worker_alive(w)      ? "restarting"
							       : "running");
		/* How long it has been on the message it is held back for, as
		 * the watchdog saw it (up to its period short). */
		kv_u64(x, "busy_ms", w->wd_state != W_RUNNING && w->wd_since ? (uint64_t)(now - w->wd_since) : 0);
	}
	ei_x_encode_empty_list(x);
}

static uint64_t processed_now(ap_pool *p)
{
	uint64_t processed = 0;
	for (int i = 0; i < p->o.workers; i++)
		processed += atomic_load_explicit(&p->w[i].processed, memory_order_relaxed);
	return processed;
}

/* Once a second (ap_pool_tick): a sample of processed. */
void ap_pool_stats_tick(ap_pool *p, int64_t now)
{
	const unsigned n = AP_TP_WINDOW_S + 1;
	p->tp[p->tp_head].processed = processed_now(p);
	p->tp[p->tp_head].ms = now;
	p->tp_head = (p->tp_head + 1) % n;
	if (p->tp_n < n)
		p->tp_n++;
}

/* Messages handled per second over the last AP_TP_WINDOW_S seconds, up to
 * now (not to the last tick: right after a burst it shows the burst). A
 * pool younger than the window is measured from its start. */
static double throughput(ap_pool *p, uint64_t processed, int64_t now)
{
	const unsigned n = AP_TP_WINDOW_S + 1;
	const int64_t window = (int64_t)AP_TP_WINDOW_S * 1000;
	uint64_t from = 0;
	int64_t from_ms = p->started_ms;
	if (now - p->started_ms > window && p->tp_n) {
		/* The oldest sample inside the window; if the ticks stalled and
		 * none is, the newest. */
		unsigned newest = (p->tp_head + n - 1) % n;
		from = p->tp[newest].processed;
		from_ms = p->tp[newest].ms;
		for (unsigned k = p->tp_n; k > 0; k--) {
			unsigned i = (p->tp_head + n - k) % n; /* oldest first */
			if (now - p->tp[i].ms <= window) {
				from = p->tp[i].processed;
				from_ms = p->tp[i].ms;
				break;
			}
		}
	}
	if (now <= from_ms || processed < from)
		return 0.0;
	return (double)(processed - from) * 1000.0 / (double)(now - from_ms);
}
