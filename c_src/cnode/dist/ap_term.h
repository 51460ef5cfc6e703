/* ap_term: bounds-checked walk over the external term format.
 *
 * ei's decoders take no buffer length, so nothing from the wire reaches them
 * before ap_term_skip has proved that the whole term lies inside the buffer.
 */
#ifndef AP_TERM_H
#define AP_TERM_H

#include <stddef.h>
#include <stdint.h>

/* Containers (tuples, lists, maps, funs) nested deeper than this are refused
 * as malformed: ei's skip and decoders recurse once per level, and a term
 * nested a million deep would overflow a thread's stack. */
#define AP_TERM_MAX_DEPTH 1024

/* Skip one term (no version byte) starting at buf[*idx], never reading at or
 * past buf[len]. On success advances *idx past the term and returns 0; on a
 * truncated, unknown or malformed term returns -1 and leaves *idx alone.
 * Every term it accepts is one ei_skip_term skips to the same end, element by
 * element (fuzz_decode checks this against libei): a fun ends exactly at its
 * Size, and fields ei would refuse are refused here. */
int ap_term_skip(const char *buf, size_t len, int *idx);

/* ap_term_skip that also reports the largest map arity in the term. */
int ap_term_scan(const char *buf, size_t len, int *idx, uint64_t *max_map);

/* The index just past the term at buf[i], or -1: ap_term_skip for call sites
 * that want the end. Consumers of wire bytes find ends with this, never with
 * ei_skip_term, so what they copy is what the walk vouched for. */
static inline int ap_term_end(const char *buf, size_t len, int i)
{
	return ap_term_skip(buf, len, &i) ? -1 : i;
}

/* A whole message: version byte 131, one term, and nothing after it. */
int ap_term_validate_msg(const char *buf, size_t len);

#endif
