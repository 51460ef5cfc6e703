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

/* ---- the strict check: what a BEAM's decoder accepts ----------------------
 * ap_term_skip vouches that a term is well formed as ei reads it; a BEAM
 * refuses more, and a BEAM that refuses a term from a distribution peer
 * drops the whole connection (every ask in flight to that node fails). So
 * whatever a plugin makes goes through ap_term_check before it leaves the
 * pool node: the same walk, plus what OTP 25's decoder (dec_term and the
 * helpers around it in erts/emulator/beam/external.c) refuses, checked
 * against binary_to_term/1 on OTP 25.2.3 term by term
 * (test/actor_pool_bad_reply_tests.erl runs the comparison):
 *
 *  - NEW_FLOAT_EXT: NaN and the infinities (the decoder's isfinite check).
 *  - Atoms (terms, and the node of a pid, port or reference, the module
 *    and function of an export): at most 255 characters; a UTF-8 one must
 *    be valid UTF-8 as erts_analyze_utf8 has it (no overlong forms, no
 *    surrogates, nothing past U+10FFFF, no stray or missing continuation
 *    byte); a Latin-1 one is any 255 bytes. Each atom's name is also
 *    handed to the caller (`atom'), which may refuse it: a new atom is
 *    never freed, and the BEAM aborts when its table is full.
 *  - Maps: no two keys equal as =:= has them, whatever their encoding
 *    (erts_validate_and_sort_flatmap, and the hashmap builder's duplicate
 *    check): 1 as SMALL_INTEGER_EXT, INTEGER_EXT or a big; an atom as
 *    Latin-1 or UTF-8; "ab" as STRING_EXT or a list of integers, split
 *    anywhere; a tuple small or large; a binary or a bitstring of whole
 *    bytes (and a bitstring's unused bits ignored); maps in any key order;
 *    0.0 and -0.0 (equal on OTP 25). Each key gets a hash of a canonical
 *    form of it, computed in the same pass, and each map's hashes are
 *    sorted: O(bytes + n log n per map). Two different keys with the same
 *    hash are taken for a duplicate: that refuses one reply (its asker's),
 *    it cannot let a duplicate through. A pid, port or reference is its
 *    node, numbers and creation (old and new formats alike; OTP 25 makes
 *    no creation stand for another), a reference's trailing zero words
 *    ignored as the BEAM ignores them.
 *  - PID_EXT, PORT_EXT, REFERENCE_EXT and NEW_REFERENCE_EXT: a creation
 *    of at most 3 (their 8-bit creation is the old two-bit one); the old
 *    references' first word under 2^18.
 *  - The receiving node's own pids, ports and references (self_node: the
 *    decoder makes local ones of those with its own name and creation,
 *    and checks their numbers): a pid's number under 2^15 and serial
 *    under 2^13, a port's number under 2^28, a reference of 1 to 3 words
 *    whose first is under 2^18. Checked whatever the creation: a pid of
 *    another incarnation of that node was made under the same limits.
 *  - Integers (LARGE_BIG_EXT) of at most 4194296 bytes (BIG_ARITY_MAX
 *    words of 8 bytes).
 *  - Funs (NEW_FUN_EXT) are refused outright: the BEAM takes them, but no
 *    handler has a closure of the caller's to give back, and one naming a
 *    module the caller lacks only fails later. Exports (fun M:F/A) pass.
 * What the walk itself refuses stays refused (atom cache references,
 * compressed terms, FLOAT_EXT, old FUN_EXT, nesting past
 * AP_TERM_MAX_DEPTH, and a few forms the BEAM would take, such as a
 * big's sign byte over 1, which no encoder writes). The limits are OTP
 * 25's: a newer receiving node may take more (more words in its own
 * references); none takes less than what this check lets through.
 */
struct ap_term_map;

typedef struct ap_term_strict {
	/* In. The receiving node's name (UTF-8), or NULL: its own pids,
	 * ports and references are checked as it checks them. */
	const char *self_node;
	size_t self_node_len;
	/* Every atom's name, as UTF-8, as the walk meets it; non-zero
	 * refuses the term. May be NULL. */
	int (*atom)(void *arg, const uint8_t *name, size_t len);
	void *arg;
	/* Out: what a refusal refused (a static string). */
	const char *why;
	/* Scratch, reused from call to call (ap_term_strict_free). */
	uint64_t *keys;
	size_t keys_cap, keys_used;
	struct ap_term_map *maps;
	size_t maps_cap, nmaps;
	uint64_t *cur;
	uint8_t kind[AP_TERM_MAX_DEPTH + 1];
} ap_term_strict;

/* ap_term_skip with the checks above: 0 and *idx past the term, or -1
 * with st->why set (and *idx left alone). st's inputs set by the caller,
 * the rest zeroed before its first use. */
int ap_term_check(const char *buf, size_t len, int *idx, ap_term_strict *st);
/* st->why when st->atom refused an atom. */
extern const char ap_term_why_atom[];
void ap_term_strict_free(ap_term_strict *st);

#endif
