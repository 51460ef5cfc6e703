/* json_simd: a C entry to simdjson's DOM parser, measured against json_validate by bench_json. */
#ifndef AP_JSON_SIMD_H
#define AP_JSON_SIMD_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Not linked into the pool node: bench_json measures it against
 * ap_json_validate, and docs/handlers.md says why the node keeps the latter.
 *
 * 1 when simdjson parses p[0..n) as one JSON document nested at most
 * `max_depth` deep, else 0 (a syntax error, and also anything simdjson
 * cannot judge: no memory, a document above its 4 GiB limit). Only a 1 is
 * a verdict: simdjson refuses numbers that the contract accepts (beyond
 * 64-bit integers or double range), so a caller would run the reference
 * validator on a 0, which also gives the offset and reason.
 *
 * Copies the input into a per-thread buffer with SIMDJSON_PADDING bytes
 * after it (simdjson reads past the end) and keeps one parser per thread:
 * safe from any number of threads, never throws. */
int ap_json_simd_valid(const uint8_t *p, size_t n, unsigned max_depth);

/* Frees the calling thread's parser and buffer (they are also freed at
 * thread exit). */
void ap_json_simd_release(void);

#ifdef __cplusplus
}
#endif

#endif
