/* ap_log: one logging call for every C node; lines go to stderr, or to the
 * owning BEAM as {log, Level, Msg} packets when the node runs under a port.
 *
 * Every line is rate-limited per kind (its format string): a token bucket
 * lets a burst of AP_LOG_BURST lines through, then AP_LOG_PER_SEC a second;
 * what it drops is counted and reported as one "suppressed N similar
 * messages" line when the kind next logs, or at the next ap_log_flush. So a
 * peer that can make the node log (a failed handshake, a bad frame) cannot
 * turn that into a flood of stderr or of logger events in the BEAM. */
#ifndef AP_LOG_H
#define AP_LOG_H

#include <stddef.h>
#include <stdint.h>

enum ap_log_level { AP_LOG_ERROR, AP_LOG_WARNING, AP_LOG_NOTICE, AP_LOG_INFO, AP_LOG_DEBUG };

#define AP_LOG_BURST 20
#define AP_LOG_PER_SEC 5

/* Where lines go: fd < 0 means stderr as text; otherwise {packet,4} frames
 * holding term_to_binary({log, Level, Bin}) written to fd (thread-safe). */
void ap_log_set_port_fd(int fd);
void ap_log_set_level(enum ap_log_level max);
/* 1 when the line went out, 0 when the level or the rate limit held it
 * back. */
int ap_log(enum ap_log_level lvl, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* Copy a name that came from a peer (an atom, a node name) into out, cap
 * bytes (at least 4), fit for a log line: control bytes, DEL, backslash,
 * quote and bytes that are not well-formed UTF-8 (C1 controls included)
 * become \xNN; a name that does not fit ends in "...". Returns out. */
const char *ap_log_escape(char *out, size_t cap, const char *in);

/* Report the kinds that dropped lines and have tokens again. Cheap when
 * nothing was dropped; the event loop calls it once per turn. */
void ap_log_flush(void);

/* Tests: the limits (burst 0 restores the defaults and forgets every kind)
 * and the clock in ms (NULL: CLOCK_MONOTONIC). */
void ap_log_set_limits(unsigned burst, unsigned per_sec);
void ap_log_set_clock(int64_t (*now_ms)(void));

/* Write one {packet,4} frame to the port fd under the log lock, so log lines
 * and status packets never interleave. Returns 0 or -1. */
int ap_port_write_packet(const void *data, int len);

#endif
