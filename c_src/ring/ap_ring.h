/* ap_ring: a single-producer / single-consumer ring of variable-length
 * records in shared memory, for the same-host data plane (issue 13).
 *
 * Layout. A ring is a header of AP_RING_HDR_SIZE bytes followed by `cap`
 * data bytes (a power of two, AP_RING_MIN_CAP..AP_RING_MAX_CAP). The caller
 * provides the memory (a segment may hold several rings); ap_ring_map_*
 * create and map segments. Native endianness: both sides share the host.
 *
 *   line 0  magic, version, hdr_size, cap, nonce: written once by
 *           ap_ring_format (magic last, release), never again; each side
 *           reads it once, at attach.
 *   line 1  the producer's: `tail` (the producer index), `data_bell`
 *           (futex word), `prod_waiting` (it sleeps for space; the
 *           consumer clears it when it wakes the producer).
 *   line 2  the consumer's: `head` (the consumer index), `space_bell`
 *           (futex word), `cons_waiting` (it sleeps for data; the
 *           producer clears it when it wakes the consumer).
 *
 * Indexes are byte counts since the ring was formatted: 64 bits, only ever
 * growing (they never wrap: at most AP_RING_MAX_INDEX), always multiples
 * of 8, and head <= tail <= head + cap. The byte of index i is
 * data[i & (cap - 1)]. Each side has its own cache line: the peer writes
 * it only to wake.
 *
 * Records. An 8-byte record header word (len in its low 32 bits, the stamp
 * in its high 32 bits), then len payload bytes, padded to 8. A record
 * never wraps: when it does not fit before the end of the data area, the
 * producer writes a pad record filling the rest
 * (its len is the bytes up to the end minus 8) and puts the record at
 * offset 0, so a reader always gets one contiguous slice. A record takes at
 * most cap / 2 bytes (payload up to ap_ring_max_payload()), so an empty
 * ring always has room for any record, pad included. The stamp
 * (ap_ring_stamp) is the kind (AP_RING_STAMP_DATA or _PAD) xor the low 32
 * bits of index / 8 xor the ring's nonce, with bit 0 forced to 1. The
 * nonce is a random 32-bit value drawn at every format (never the one the
 * memory held before), so:
 *  - a record left from an earlier lap is refused (until 2^35 bytes
 *    later: 32 GiB, a chance the consumer accepts);
 *  - a record left from an earlier format of the same memory is refused
 *    (the nonce differs; a reformat resets the indexes to 0, so without
 *    it old records would be valid again);
 *  - a stamp of 0 is never written and always refused, so zeroed memory
 *    (fresh memfd or tmpfs pages) published without a write is an error
 *    at every index, not a zero-length record at index 8 * kind.
 * Bit 0 of index / 8 carries no lap information (laps are multiples of
 * cap >= 64 bytes), so forcing it costs nothing.
 *
 * Memory ordering (GCC __atomic builtins on naturally aligned words, which
 * are lock-free and address-free, so they work across processes):
 *  - The producer writes record headers and payloads with plain stores,
 *    then publishes them all with one release store of `tail`. The consumer
 *    loads `tail` with acquire, so everything before it is visible.
 *  - The consumer loads record headers once (one relaxed 64-bit load: a
 *    hostile producer cannot change a length between check and use), and
 *    publishes what it has finished with a release store of `head`, so its
 *    reads happen before the producer (acquire load of `head`) reuses the
 *    bytes.
 *  - Each side keeps its own index privately and never reads it back from
 *    the segment; the peer's index is read once per call into a local and
 *    validated: the consumer checks old tail <= tail <= head + cap and
 *    tail % 8 == 0; the producer checks old head <= head <= its committed
 *    tail and head % 8 == 0; attach checks both and refuses indexes over
 *    AP_RING_MAX_INDEX, so no index arithmetic overflows. Every record header is checked against cap, the end of
 *    the data area, `tail` and the stamp before its payload is handed out.
 *    A failed check makes the ring broken (sticky -EPROTO): no access out
 *    of the data area, no loop that depends on shared values (a read skips
 *    at most one pad record).
 *
 * Torn writes. A record becomes visible only through the release of `tail`
 * after it is complete, so a producer killed mid-write leaves `tail` before
 * the record: the consumer sees nothing (an empty ring), never a partial
 * record. A producer that publishes without writing (buggy) leaves a stale
 * stamp: -EPROTO. Payload bytes handed out point into shared memory that a
 * hostile producer may still change: copy them (as the NIF must before
 * decoding) or treat them as untrusted while reading; lengths handed out
 * were read once and checked, so they are safe to use.
 *
 * Wake-ups. Cross-process futex words (no FUTEX_PRIVATE_FLAG). A waiter
 * (the consumer for data; the producer for space) spins a bounded number of
 * rounds with a pause instruction (a long spin takes the CPU the peer
 * needs, see the notes: ~200 rounds is about right on 2 cores), then:
 *   1. loads the bell (acquire), 2. sets its waiting flag, 3. full fence,
 *   4. re-checks the ring, and if still nothing, 5. FUTEX_WAIT(bell, the
 *   value of step 1), 6. clears its flag.
 * The other side, after its release store of the index: full fence, loads
 * the flag, and only if it is set takes it down (exchange; so one wake per
 * sleep, not one per commit until the sleeper runs), bumps the bell and
 * issues FUTEX_WAKE. The two fences order "flag store, index load" against
 * "index store, flag load" (Dekker), so at least one side sees the other: either the waiter
 * finds the new index in step 4, or the waker sees the flag and bumps the
 * bell, which makes the FUTEX_WAIT of step 5 return at once (its expected
 * value is stale) if it had not slept yet. A busy ring thus costs no
 * syscall per message. A hostile peer can only make a wait last until its
 * timeout (it can clear the flag or never ring), so a side that reads a
 * hostile peer's ring gives every wait a timeout; it can also make us
 * issue wake-ups we did not need (it can set the flag), which costs
 * syscalls, nothing else.
 * Bounded waits. A wake-up proves nothing: the peer can bump the bell at
 * will (say, whenever our flag is up), so ap_ring_wait and
 * ap_ring_wait_space loop inside: they return 0 only when the condition
 * holds (or on a local kick, ap_ring_wake on the waiter's own view), and
 * sleep again otherwise, against one absolute CLOCK_MONOTONIC deadline
 * (FUTEX_WAIT_BITSET), so a hostile peer costs us syscalls until the
 * timeout, never a wait past it. A futex error other than EAGAIN / EINTR
 * is returned, not taken for a wake-up. The spin before the first sleep
 * is bounded by its count (`spin` loads and pauses, microseconds) and is
 * not counted in timeout_ms. With no timeout (timeout_ms < 0) a hostile
 * peer can keep a wait going for ever: whoever reads a ring the peer may
 * scribble on passes a timeout.
 * ap_ring_prepare_sleep / ap_ring_end_sleep split steps 1-4 and 6 out, so
 * an event loop can do step 5 itself (io_uring IORING_OP_FUTEX_WAIT, see
 * ap_ring_uring.h, with a linked timeout); such a loop must re-check the
 * ring on every completion, as the waits here do.
 *
 * Failed attach. It zeroes the view: every call on it returns -EINVAL (or
 * does nothing, for the void ones), never touches memory.
 *
 * Segments: who attaches how (a design decision). A shm object can be
 * shrunk by anyone who can open it (ftruncate), and a mapping of a shrunk
 * object raises SIGBUS on touch: in the BEAM that is a VM crash. So:
 *  - the NIF side (the BEAM) attaches ONLY through a sealed memfd
 *    (F_SEAL_SHRINK | F_SEAL_GROW, checked by ap_ring_map_open_fd),
 *    received over a connected AF_UNIX socket with SCM_RIGHTS
 *    (ap_ring_send_fd / ap_ring_recv_fd); the NIF may just as well be the
 *    creator and pass the fd the other way. Seals cannot be removed, so
 *    the peer cannot shrink it later.
 *  - shm names (ap_ring_map_create_shm / _open_shm) are only for the side
 *    that created the segment, or for a rendezvous; ap_ring_map_open_shm
 *    refuses what is not a regular file, not owned by geteuid(), open to
 *    group or others, or not fully allocated (st_blocks * 512 < st_size:
 *    sparse, SIGBUS on a full tmpfs), but it cannot stop a same-uid peer
 *    from shrinking the object later.
 *
 * Errors: negative errno values. -EAGAIN empty (read) or full (reserve),
 * -EMSGSIZE a record over ap_ring_max_payload(), -EPROTO the ring is broken
 * (a check failed; it stays broken), -ETIMEDOUT a wait ended by its timeout,
 * -EINVAL bad arguments or a header that is not a ring.
 */
#ifndef AP_RING_H
#define AP_RING_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#define AP_RING_MAGIC 0x31474e4952504100ULL /* "\0APRING1" */
#define AP_RING_VERSION 2u /* 2: the nonce in line 0 and in every stamp */
#define AP_RING_LINE 64u
#define AP_RING_HDR_SIZE (4u * AP_RING_LINE)
#define AP_RING_MIN_CAP 64u
#define AP_RING_MAX_CAP (1u << 30)
#define AP_RING_ALIGN 8u
#define AP_RING_REC_HDR 8u
#define AP_RING_STAMP_DATA 0x44434552u /* "RECD" */
#define AP_RING_STAMP_PAD 0x44444150u  /* "PADD" */
#define AP_RING_DEFAULT_SPIN 200u
/* Indexes above this are hostile (146 years at 1 GB/s): refused at attach,
 * so index arithmetic never overflows. */
#define AP_RING_MAX_INDEX (1ULL << 62)

struct ap_ring_hdr {
	/* line 0: immutable once formatted */
	uint64_t magic;
	uint32_t version;
	uint32_t hdr_size;
	uint64_t cap;
	uint32_t nonce; /* random per format, mixed into every stamp */
	uint32_t reserved0;
	uint8_t pad0[AP_RING_LINE - 32];
	/* line 1: the producer's */
	uint64_t tail;
	uint32_t data_bell;
	uint32_t prod_waiting;
	uint8_t pad1[AP_RING_LINE - 16];
	/* line 2: the consumer's */
	uint64_t head;
	uint32_t space_bell;
	uint32_t cons_waiting;
	uint8_t pad2[AP_RING_LINE - 16];
	/* line 3: reserved, zero */
	uint8_t pad3[AP_RING_LINE];
};

/* One side's private view of a ring. Never shared: each process (or
 * thread) attached to a ring has its own. */
struct ap_ring {
	struct ap_ring_hdr *hdr;
	uint8_t *data;
	uint64_t cap;
	uint64_t mask;
	uint64_t head;   /* consumer: published head; producer: last head read (validated) */
	uint64_t tail;   /* producer: committed tail; consumer: last tail read (validated) */
	uint64_t pos;    /* producer: end of reservations; consumer: end of records read */
	uint32_t nonce;  /* line 0's, read once at attach */
	int kick;        /* set by ap_ring_wake on this view: ends one wait */
	int role;        /* AP_RING_PRODUCER or AP_RING_CONSUMER */
	int broken;      /* a check failed: every call returns -EPROTO */
	/* local counters, for tests and stats */
	uint64_t n_wake;  /* FUTEX_WAKE calls issued */
	uint64_t n_sleep; /* FUTEX_WAIT calls issued */
	uint64_t n_timeout; /* of those, ended by their timeout (a lost wake-up, or a stalled peer) */
};

#define AP_RING_PRODUCER 1
#define AP_RING_CONSUMER 2

/* The stamp of a record of `kind` at index idx in a ring formatted with
 * `nonce`; never 0. */
static inline uint32_t ap_ring_stamp(uint32_t nonce, uint32_t kind, uint64_t idx)
{
	return (kind ^ (uint32_t)(idx >> 3) ^ nonce) | 1u;
}

/* Bytes a ring of `cap` data bytes needs. */
static inline size_t ap_ring_size(size_t cap) { return AP_RING_HDR_SIZE + cap; }

/* The largest payload a record may carry in a ring of `cap` bytes. */
static inline size_t ap_ring_max_payload(uint64_t cap) { return (size_t)(cap / 2 - AP_RING_REC_HDR); }

/* Formats a ring of `cap` bytes (power of two) at mem (8-aligned, at least
 * ap_ring_size(cap) bytes, zeroed by the caller or not), with a fresh
 * nonce. Nobody may be attached while it runs. 0 or -EINVAL. */
int ap_ring_format(void *mem, size_t mem_size, size_t cap);

/* Attach to a formatted ring at mem as its one producer or its one
 * consumer. Validates the header (magic, version, sizes against mem_size)
 * and the indexes. 0, -EINVAL (not a ring) or -EPROTO (bad indexes). */
int ap_ring_attach_producer(struct ap_ring *r, void *mem, size_t mem_size);
int ap_ring_attach_consumer(struct ap_ring *r, void *mem, size_t mem_size);

/* ---- producer ------------------------------------------------------------- */

/* Reserves a record of `len` payload bytes after the previous reservations
 * and sets *p to its payload (8-aligned, contiguous). Invisible to the
 * consumer until ap_ring_commit. 0, -EAGAIN (no room now: commit what is
 * reserved, wait, retry), -EMSGSIZE, -EPROTO. */
int ap_ring_reserve(struct ap_ring *r, size_t len, void **p);

/* Publishes every reservation made since the last commit (one release
 * store), then wakes the consumer if it may be asleep. 1 when it had to
 * wake the consumer, 0 when not (or nothing was reserved), or -EPROTO.
 * A hint for a caller about to wait for an answer from that consumer: the
 * answer is then at least a wake-up away, and spinning for it takes the
 * CPU the consumer needs (bench_ring, 2 cores: an idle round trip is 7 us
 * with no spin, 18 us with 200 rounds). Not a policy by itself: a
 * ping-pong whose two sides skip the spin after every wake stays asleep
 * (45 us back to back, against 0.16 us spinning 200 rounds). */
int ap_ring_commit(struct ap_ring *r);

/* Publishes without the wake-up check; a later ap_ring_notify rings once
 * (and returns 1 if it woke the consumer). */
int ap_ring_publish(struct ap_ring *r);
int ap_ring_notify(struct ap_ring *r);

/* Drops every reservation made since the last commit. */
void ap_ring_abort(struct ap_ring *r);

/* 1 if a record of `len` payload bytes can be reserved now, 0 if not,
 * -EMSGSIZE or -EPROTO. Reads the consumer's head. */
int ap_ring_has_room(struct ap_ring *r, size_t len);

/* Waits until a record of `len` payload bytes fits: spins `spin` rounds
 * (not counted in timeout_ms), then sleeps on the space bell until it
 * fits, at most timeout_ms (< 0: no timeout; see "Bounded waits"). 0,
 * -ETIMEDOUT, -EMSGSIZE, -EPROTO, or a futex error. Commit first: the
 * consumer cannot free what it has not been given. */
int ap_ring_wait_space(struct ap_ring *r, size_t len, unsigned spin, int timeout_ms);

/* ---- consumer ------------------------------------------------------------- */

/* The next record after those already read: *p and *len describe its
 * payload, which stays valid (the producer does not reuse it) until
 * ap_ring_release. 0, -EAGAIN (nothing committed), -EPROTO. At most one
 * pad record is skipped per call. */
int ap_ring_read(struct ap_ring *r, const void **p, size_t *len);

/* Consumer: where the next read starts, and a way back to it. Records
 * read after `mark` and not released since are read again by the next
 * ap_ring_read (a reader that finds one it must leave to someone else). */
static inline uint64_t ap_ring_mark(const struct ap_ring *r) { return r->pos; }
static inline void ap_ring_unread(struct ap_ring *r, uint64_t mark) { r->pos = mark; }

/* Gives every record read so far back to the producer (one release
 * store), and wakes it if it may be asleep waiting for space. Does nothing
 * on a broken ring (what was refused is not given back). */
void ap_ring_release(struct ap_ring *r);

/* 1 if a committed record is there to read, 0 if not (an invalid tail
 * counts as 1: the next read reports it), -EINVAL if r is not a consumer
 * (a failed attach). */
int ap_ring_readable(struct ap_ring *r);

/* Waits for data: spins `spin` rounds (not counted in timeout_ms), then
 * sleeps on the data bell until something is there to read, at most
 * timeout_ms (< 0: no timeout; see "Bounded waits"). 0 (something to read,
 * or a kick by ap_ring_wake on this view), -ETIMEDOUT, -EPROTO, -EINVAL, or
 * a futex error. */
int ap_ring_wait(struct ap_ring *r, unsigned spin, int timeout_ms);

/* Wakes the consumer whatever its flag says (shutdown, tests): sets the
 * kick of this view, bumps the data bell and issues FUTEX_WAKE for every
 * waiter. A wait on this same view (another thread of ours) returns 0
 * once for the kick; a waiter with another view (the peer) only looks
 * again, so the peer cannot end our waits this way. No-op after a failed
 * attach. */
void ap_ring_wake(struct ap_ring *r);

/* ---- sleeping in an event loop -------------------------------------------- */

/* Steps 1-4 of the protocol for the caller's side (consumer: data;
 * producer: space for `len`). Returns 1 with *word and *expected set: the
 * caller may now wait on *word for a value other than *expected (futex or
 * IORING_OP_FUTEX_WAIT) and must call ap_ring_end_sleep when woken. Returns
 * 0 when there is no need to sleep (the flag is cleared again), or a
 * negative errno. */
int ap_ring_prepare_sleep(struct ap_ring *r, size_t len, uint32_t **word, uint32_t *expected);
void ap_ring_end_sleep(struct ap_ring *r);

/* ---- futex words ------------------------------------------------------------ */

/* FUTEX_WAIT on a shared word while it holds `expected`, at most
 * timeout_ms (< 0: no timeout). 0 (woken, or the value differed, or a
 * signal), -ETIMEDOUT, or another -errno (a failed call is not a
 * wake-up). One sleep: the caller re-checks and loops. */
int ap_ring_futex_wait(uint32_t *word, uint32_t expected, int timeout_ms);
/* FUTEX_WAKE up to n waiters on a shared word; the number woken. */
int ap_ring_futex_wake(uint32_t *word, int n);

static inline void ap_ring_cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
	__builtin_ia32_pause();
#elif defined(__aarch64__)
	__asm__ __volatile__("yield" ::: "memory");
#else
	__asm__ __volatile__("" ::: "memory");
#endif
}

/* ---- segments ------------------------------------------------------------- */

struct ap_ring_map {
	void *mem;
	size_t size;
	int fd; /* the shm or memfd object, or -1 */
};

/* Creates a shm object (shm_open name, "/x", O_CREAT | O_EXCL, mode 0600
 * whatever the umask), reserves all its bytes with posix_fallocate (a
 * sparse object on a full tmpfs would SIGBUS on first touch), maps it
 * shared. A name that exists is -EEXIST: sweep it first if its owner is
 * dead. On error nothing is left behind. 0 or -errno (-ENOSPC: no room). */
int ap_ring_map_create_shm(struct ap_ring_map *m, const char *name, size_t size);

/* Opens and maps an existing shm object read-write; its size is fstat's,
 * which must be at least min_size. Refuses what is not a regular file
 * (-EINVAL), not owned by geteuid() or with any group/other mode bit
 * (-EPERM), or not fully allocated (-EINVAL). 0 or -errno. A peer with the
 * same uid could still shrink it under the mapping (SIGBUS): only for the
 * creator's side or a rendezvous; the NIF uses a sealed memfd. */
int ap_ring_map_open_shm(struct ap_ring_map *m, const char *name, size_t min_size);

/* Creates an anonymous memfd of `size` bytes, reserved with
 * posix_fallocate and sealed against shrinking and growing, mapped shared.
 * The fd (m->fd) is what is passed to the peer (SCM_RIGHTS). 0 or -errno. */
int ap_ring_map_create_memfd(struct ap_ring_map *m, const char *tag, size_t size);

/* Maps a memfd received from a peer; it must carry the shrink and grow
 * seals (so it cannot SIGBUS us), be a fully allocated regular file and
 * at least min_size bytes. Takes the fd on success. 0 or -errno (-EPERM:
 * not sealed). */
int ap_ring_map_open_fd(struct ap_ring_map *m, int fd, size_t min_size);

/* Passes fd (one SCM_RIGHTS message with one data byte) over a connected
 * AF_UNIX socket. 0 or -errno. */
int ap_ring_send_fd(int sock, int fd);

/* Receives one fd sent by ap_ring_send_fd (close-on-exec). A message with
 * no fd, more than one, or truncated control data is -EPROTO, and every
 * fd it carried is closed; -ECONNRESET at end of stream. 0 or -errno;
 * *fd is -1 on error. Map it with ap_ring_map_open_fd, which checks it. */
int ap_ring_recv_fd(int sock, int *fd);

/* Passes fd with len bytes of data (one sendmsg, MSG_DONTWAIT: for small
 * answers into an empty socket). 0, or -errno (-EAGAIN: not all sent). */
int ap_ring_send_with_fd(int sock, const void *buf, size_t len, int fd);

/* One recvmsg of up to len bytes: the first fd that rides on them goes
 * into *fd when it is -1 (close-on-exec), every other one is closed.
 * Bytes read, 0 at end of stream, or -errno. */
ssize_t ap_ring_recv_some(int sock, void *buf, size_t len, int *fd);

/* Unmaps and closes; does not unlink. */
void ap_ring_map_close(struct ap_ring_map *m);

/* shm_unlink; 0, or -errno (-ENOENT when already gone). */
int ap_ring_shm_unlink(const char *name);

#endif
