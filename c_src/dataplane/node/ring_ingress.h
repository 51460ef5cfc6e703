/* ring_ingress.h: what the pool node's main (pool_node.c) needs of the
 * same-host data plane (dataplane/node/). */
#ifndef AP_RING_INGRESS_H
#define AP_RING_INGRESS_H

#include <ei.h>

#include "ap_node.h"
#include "pool_limits.h"

/* At start, before the loop runs: the listen socket, the token, the
 * attach thread, the loop's idle hook. enabled 0 (--no-fast-path): none
 * of it, and dp_info answers {error, disabled}. A failure to listen is
 * logged and leaves the node on distribution only. poll_us
 * (--ring-poll-us): how long the loop yields instead of sleeping after
 * ring records, while they come at least that often; 0 never. 0, or -1
 * (no random bytes: the node should not start). */
#define AP_DP_POLL_US_DEFAULT 300
/* lone_us (--ring-lone-poll-us): after an ask that was the only one its
 * BEAM waited for (the segment's req_lone hint), the loop yields this
 * long, whatever the gap before it and whatever came by distribution
 * since: a lone caller's next ask finds the loop awake instead of paying
 * for waking it. 0 never. */
#define AP_DP_LONE_US_DEFAULT 1000
/* nap_us (--ring-nap-us): while reads find records densely, the loop
 * sleeps this long between them instead of spinning or being rung; 0
 * never. */
#define AP_DP_NAP_US_DEFAULT 100
/* ask_nap_us (--ring-ask-nap-us): the same nap after a dense read that
 * had asks (their callers wait for the answers); 0: such reads never nap. */
#define AP_DP_ASK_NAP_US_DEFAULT 20
int ap_dp_start(ap_node *n, int enabled, int poll_us, int lone_us, int nap_us, int ask_nap_us);
/* How many times the loop napped between dense reads, and how many of
 * those naps followed a read with asks (node_stats). */
unsigned long long ap_dp_naps(void);
unsigned long long ap_dp_ask_naps(void);
/* How many reads found a lone ask and so kept the loop awake after it
 * (node_stats). */
unsigned long long ap_dp_lone_windows(void);
/* How many times the loop waited before a nap for the answers of worker
 * processes and caught them all, and how many such waits ran out
 * (node_stats). */
unsigned long long ap_dp_iso_waits(void);
unsigned long long ap_dp_iso_waits_missed(void);
/* Loop thread: a message came by distribution (dist_ingress.c), so the
 * loop stops yielding for ring records (ring_poll_us) until the next ones
 * come: a loop that spins takes the CPU a distribution round trip on this
 * host needs. */
void ap_dp_poll_cancel(void);
/* The answer to the manager's dp_info: {ok, #{socket => <<0, Name/binary>>,
 * token => <<_:16/binary>>}} or {error, disabled}. */
void ap_dp_encode_info(ei_x_buff *x);

#endif
