/* rcpt_log: the receptionist node's rate-limited log lines (rcpt_log.h). */
#include "rcpt_log.h"

static struct {
	ap_node *n;
	int64_t window;
	unsigned count;
	uint64_t dropped;
} lg;

void rcpt_log_init(ap_node *n) { lg.n = n; }

int rcpt_log_ok(void)
{
	int64_t now = lg.n ? ap_node_now_ms(lg.n) : 0;
	if (now - lg.window >= RCPT_LOG_WINDOW_MS) {
		if (lg.dropped)
			ap_log(AP_LOG_WARNING, "receptionist: %llu more log lines suppressed",
			       (unsigned long long)lg.dropped);
		lg.window = now;
		lg.count = 0;
		lg.dropped = 0;
	}
	if (lg.count >= RCPT_LOG_PER_WINDOW) {
		lg.dropped++;
		return 0;
	}
	lg.count++;
	return 1;
}
