/* rcpt_log: the receptionist node's rate-limited log lines. Its input comes
 * from the network, so a flood of bad messages must not flood the log: at
 * most RCPT_LOG_PER_WINDOW lines per RCPT_LOG_WINDOW_MS go out, then one
 * line counts what was suppressed. Loop thread only. */
#ifndef RCPT_LOG_H
#define RCPT_LOG_H

#include "ap_log.h"
#include "ap_node.h"

#define RCPT_LOG_WINDOW_MS 10000
#define RCPT_LOG_PER_WINDOW 20

/* The node whose loop clock times the windows (before it: time 0). */
void rcpt_log_init(ap_node *n);
/* 1: log this line; 0: suppressed (and counted). */
int rcpt_log_ok(void);

#define RLOG(lvl, ...)                                                                             \
	do {                                                                                       \
		if (rcpt_log_ok())                                                                 \
			ap_log(lvl, __VA_ARGS__);                                                  \
	} while (0)

#endif
