/* ap_hist: a latency histogram with fixed buckets, kept in relaxed atomics.
 *
 * The pool node times each ask's handler call with it (per worker: the worker
 * thread, or the loop running a message inline, or a worker process in its
 * channel page) and the stats map carries the sum over a pool's workers
 * (stats.c). The bounds are 1, 2.5 and 5 per decade from 1 us to 10 s,
 * the same as the BEAM's ask histograms (src/actor_pool_latency.erl);
 * counts are per bucket (not cumulative), the last one past 10 s. */
#ifndef AP_HIST_H
#define AP_HIST_H

#include <stdatomic.h>
#include <stdint.h>

#define AP_HIST_BOUNDS 22
#define AP_HIST_BUCKETS (AP_HIST_BOUNDS + 1)

static const uint64_t ap_hist_bounds_ns[AP_HIST_BOUNDS] = {
	1000,	    2500,	5000,	    10000,	25000,	    50000,	100000,	    250000,
	500000,	    1000000,	2500000,    5000000,	10000000,   25000000,	50000000,   100000000,
	250000000,  500000000,	1000000000, 2500000000, 5000000000, 10000000000,
};

typedef struct ap_hist {
	_Atomic uint64_t n[AP_HIST_BUCKETS];
	_Atomic uint64_t sum_ns;
} ap_hist;

/* The bucket of ns: the first bound at or above it. Most handler calls
 * are under the first bound: one comparison. */
static inline unsigned ap_hist_bucket(uint64_t ns)
{
	if (ns <= ap_hist_bounds_ns[0])
		return 0;
	unsigned lo = 1, hi = AP_HIST_BOUNDS; /* the answer is in [lo, hi] */
	while (lo < hi) {
		unsigned mid = (lo + hi) / 2;
		if (ns <= ap_hist_bounds_ns[mid])
			hi = mid;
		else
			lo = mid + 1;
	}
	return lo;
}

/* Any number of writers. */
static inline void ap_hist_add(ap_hist *h, uint64_t ns)
{
	atomic_fetch_add_explicit(&h->n[ap_hist_bucket(ns)], 1, memory_order_relaxed);
	atomic_fetch_add_explicit(&h->sum_ns, ns, memory_order_relaxed);
}

/* One writer (readers anywhere): no locked instruction. */
static inline void ap_hist_add_1w(ap_hist *h, uint64_t ns)
{
	_Atomic uint64_t *b = &h->n[ap_hist_bucket(ns)];
	atomic_store_explicit(b, atomic_load_explicit(b, memory_order_relaxed) + 1, memory_order_relaxed);
	atomic_store_explicit(&h->sum_ns, atomic_load_explicit(&h->sum_ns, memory_order_relaxed) + ns,
			      memory_order_relaxed);
}

/* d += s, bucket by bucket. */
static inline void ap_hist_sum_into(uint64_t d[AP_HIST_BUCKETS + 1], ap_hist *s)
{
	for (unsigned i = 0; i < AP_HIST_BUCKETS; i++)
		d[i] += atomic_load_explicit(&s->n[i], memory_order_relaxed);
	d[AP_HIST_BUCKETS] += atomic_load_explicit(&s->sum_ns, memory_order_relaxed);
}

#endif
