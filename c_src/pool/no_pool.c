/* no_pool: tells, by either ingress, to a name or pid with no pool:
 * counted (node_stats no_pool_tells) and logged. */
#include <string.h>

#include "ap_log.h"
#include "ap_rand.h"
#include "ap_siphash.h"
#include "pool.h"

/* Tells, by either ingress, to a name or pid with no pool (node_stats
 * no_pool_tells). Loop thread, as both ingresses. */
static uint64_t no_pool_tells;
/* The names logged already, by keyed hash, one per slot: a misspelt name
 * is logged once, and a sender that misspells without end costs these
 * 8 KiB and no more (a name another pushed out of its slot is logged
 * again). The key is random: nobody picks names that share a slot. */
#define NO_POOL_SEEN 1024
static uint64_t seen[NO_POOL_SEEN], seen_k0, seen_k1;

uint64_t ap_pool_no_pool_tells(void) { return no_pool_tells; }

void ap_pool_no_pool(const char *peer, const char *name, size_t name_len, const erlang_pid *pid, uint64_t tells)
{
	if (!tells)
		return;
	no_pool_tells += tells;
	char p[4 * MAXNODELEN + 8], esc[2 * MAXATOMLEN_UTF8];
	if (!name) {
		/* Pids are not remembered (a stopped pool's are endless): a
		 * line per tell, which ap_log's rate limit thins out. */
		if (pid)
			ap_log(AP_LOG_WARNING, "tell from %s to pid <%u.%u> dropped: no pool has it (%llu tells to no pool so far)",
			       ap_log_escape(p, sizeof p, peer), pid->num, pid->serial, (unsigned long long)no_pool_tells);
		return;
	}
	if (!seen_k0 && !seen_k1) {
		seen_k0 = ap_rand_seed(seen);
		seen_k1 = ap_rand_seed(&seen_k1) | 1;
	}
	uint64_t h = ap_siphash13(seen_k0, seen_k1, name, name_len) | 1;
	uint64_t *slot = &seen[(h >> 1) % NO_POOL_SEEN];
	if (*slot == h)
		return;
	char cname[MAXATOMLEN_UTF8];
	size_t l = name_len < sizeof cname ? name_len : sizeof cname - 1;
	memcpy(cname, name, l);
	cname[l] = 0;
	/* Remembered once logged: a line ap_log's rate limit held back is
	 * logged at a later tell to that name. */
	if (ap_log(AP_LOG_WARNING,
		   "tell from %s to unregistered name '%s' dropped: no pool has that name (each name "
		   "is logged once; %llu tells to no pool so far)",
		   ap_log_escape(p, sizeof p, peer), ap_log_escape(esc, sizeof esc, cname),
		   (unsigned long long)no_pool_tells))
		*slot = h;
}
