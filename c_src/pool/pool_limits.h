/* pool_limits.h: the upper limits of a pool's options, their one source of
 * truth.
 *
 * The pool node checks every start request against them (pool_node.c: any
 * peer of the cluster can send one). The BEAM checks the same before it
 * asks (actor_pool_opts), so that a bad option gets its error without a
 * round trip: it reads them from src/actor_pool_int.hrl, a copy of these
 * lines that test/actor_pool_limits_tests.erl compares with this file,
 * name by name. A checked copy rather than a generated file (which a fresh
 * clone would lack until the C build ran, for the Erlang tools that read
 * src/) or a query to the pool node (the BEAM checks options before it
 * reaches one, and a pool node elsewhere may not answer at all).
 *
 * The lower limits are part of each option's meaning (workers 0 = the
 * host's CPUs on the C side, 1..max from the BEAM; stable_ms may be 0),
 * so they stay where the option is parsed. */
#ifndef AP_POOL_LIMITS_H
#define AP_POOL_LIMITS_H

#define AP_POOL_MAX_WORKERS 1024
#define AP_POOL_MAX_MAILBOX 1048576
#define AP_POOL_MAX_BACKOFF_MS 3600000
#define AP_POOL_MAX_STABLE_MS 86400000
#define AP_POOL_MAX_HANDLER_TIMEOUT_MS 86400000
#define AP_POOL_MAX_STALL_MS 86400000
#define AP_POOL_MAX_MEMORY_MB 1048576
/* The application setting ring_poll_us (--ring-poll-us), microseconds. */
#define AP_POOL_MAX_RING_POLL_US 100000
/* The application settings ring_nap_us (--ring-nap-us) and ring_ask_nap_us
 * (--ring-ask-nap-us), microseconds. */
#define AP_POOL_MAX_RING_NAP_US 10000
/* max_reply_atoms: the distinct atoms a pool's replies may carry. The
 * BEAM's own atom table holds 1048576 by default; the pool keeps a set of
 * twice this many 8-byte slots. */
#define AP_POOL_MAX_REPLY_ATOMS 1048576
/* A plugin's path, in bytes, without its NUL. */
#define AP_POOL_MAX_PATH 4095
/* The sandbox's read and write paths: how many in all, and their bytes
 * with a NUL each. */
#define AP_POOL_MAX_SANDBOX_PATHS 32
#define AP_POOL_MAX_SANDBOX_BYTES 8192

#endif
