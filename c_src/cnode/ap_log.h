/* ap_log: one logging call for every C node; lines go to stderr, or to the
 * owning BEAM as {log, Level, Msg} packets when the node runs under a port. */
#ifndef AP_LOG_H
#define AP_LOG_H

enum ap_log_level { AP_LOG_ERROR, AP_LOG_WARNING, AP_LOG_NOTICE, AP_LOG_INFO, AP_LOG_DEBUG };

/* Where lines go: fd < 0 means stderr as text; otherwise {packet,4} frames
 * holding term_to_binary({log, Level, Bin}) written to fd (thread-safe). */
void ap_log_set_port_fd(int fd);
void ap_log_set_level(enum ap_log_level max);
void ap_log(enum ap_log_level lvl, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* Write one {packet,4} frame to the port fd under the log lock, so log lines
 * and status packets never interleave. Returns 0 or -1. */
int ap_port_write_packet(const void *data, int len);

#endif
