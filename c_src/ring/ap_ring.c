/* ap_ring: single-producer / single-consumer record ring in shared memory
 * (design and ordering rules in ap_ring.h). */
#include "ap_ring.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <linux/futex.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "ap_rand.h"

_Static_assert(sizeof(struct ap_ring_hdr) == AP_RING_HDR_SIZE, "ring header is 4 cache lines");
_Static_assert(offsetof(struct ap_ring_hdr, tail) == AP_RING_LINE, "tail starts line 1");
_Static_assert(offsetof(struct ap_ring_hdr, head) == 2 * AP_RING_LINE, "head starts line 2");
_Static_assert(__atomic_always_lock_free(sizeof(uint64_t), 0), "64-bit atomics must be lock-free");
_Static_assert(__atomic_always_lock_free(sizeof(uint32_t), 0), "32-bit atomics must be lock-free");

#define LOAD(p, mo) __atomic_load_n((p), __ATOMIC_##mo)
#define STORE(p, v, mo) __atomic_store_n((p), (v), __ATOMIC_##mo)

static int r_broken(struct ap_ring *r)
{
	r->broken = 1;
	return -EPROTO;
}

static uint64_t rec_size(uint64_t len)
{
	return AP_RING_REC_HDR + ((len + AP_RING_ALIGN - 1) & ~(uint64_t)(AP_RING_ALIGN - 1));
}

static uint32_t stamp_at(const struct ap_ring *r, uint32_t kind, uint64_t idx)
{
	return ap_ring_stamp(r->nonce, kind, idx);
}

static uint64_t *rec_word(const struct ap_ring *r, uint64_t off) { return (uint64_t *)(void *)(r->data + off); }

/* Bytes a record of sz bytes takes at index pos: sz, or the rest of the
 * data area (a pad record) plus sz when it would cross the end. */
static uint64_t need_at(const struct ap_ring *r, uint64_t pos, uint64_t sz)
{
	uint64_t to_end = r->cap - (pos & r->mask);
	return sz <= to_end ? sz : to_end + sz;
}

/* A fresh random 32-bit value. Without the entropy pool (early boot) a
 * mix of the clock, the pid and the address still differs per format,
 * which is all the nonce must do; only a hostile peer could guess it, and
 * it can write any record it likes anyway. */
static uint32_t new_nonce(const void *mem)
{
	return (uint32_t)ap_rand_seed(mem);
}

int ap_ring_format(void *mem, size_t mem_size, size_t cap)
{
	struct ap_ring_hdr *h = mem;
	uint32_t old = 0, nonce;

	if (!mem || ((uintptr_t)mem & (AP_RING_ALIGN - 1)) || cap < AP_RING_MIN_CAP || cap > AP_RING_MAX_CAP ||
	    (cap & (cap - 1)) || mem_size < ap_ring_size(cap))
		return -EINVAL;
	/* A new nonce per format, never the one the memory had: records of
	 * an earlier format carry the old one, so they are refused. */
	if (LOAD(&h->magic, RELAXED) == AP_RING_MAGIC)
		old = LOAD(&h->nonce, RELAXED);
	do
		nonce = new_nonce(mem);
	while (nonce == old);
	STORE(&h->magic, 0, RELAXED);
	memset((uint8_t *)mem + sizeof h->magic, 0, AP_RING_HDR_SIZE - sizeof h->magic);
	h->version = AP_RING_VERSION;
	h->hdr_size = AP_RING_HDR_SIZE;
	h->cap = cap;
	h->nonce = nonce;
	/* The magic last: whoever sees it sees the sizes. */
	STORE(&h->magic, AP_RING_MAGIC, RELEASE);
	return 0;
}

static int r_attach(struct ap_ring *r, void *mem, size_t mem_size, int role)
{
	struct ap_ring_hdr *h = mem;
	uint64_t cap, head, tail;

	memset(r, 0, sizeof *r);
	if (!mem || ((uintptr_t)mem & (AP_RING_ALIGN - 1)) || mem_size < AP_RING_HDR_SIZE)
		return -EINVAL;
	if (LOAD(&h->magic, ACQUIRE) != AP_RING_MAGIC || LOAD(&h->version, RELAXED) != AP_RING_VERSION ||
	    LOAD(&h->hdr_size, RELAXED) != AP_RING_HDR_SIZE)
		return -EINVAL;
	cap = LOAD(&h->cap, RELAXED);
	if (cap < AP_RING_MIN_CAP || cap > AP_RING_MAX_CAP || (cap & (cap - 1)) || cap > mem_size - AP_RING_HDR_SIZE)
		return -EINVAL;
	head = LOAD(&h->head, ACQUIRE);
	tail = LOAD(&h->tail, ACQUIRE);
	/* The bound on tail keeps pos + a record's size from overflowing. */
	if (head > tail || tail - head > cap || tail > AP_RING_MAX_INDEX || ((head | tail) & (AP_RING_ALIGN - 1)))
		return -EPROTO;
	r->hdr = h;
	r->data = (uint8_t *)mem + AP_RING_HDR_SIZE;
	r->cap = cap;
	r->mask = cap - 1;
	r->nonce = LOAD(&h->nonce, RELAXED); /* read once: line 0 is immutable to us */
	r->head = head;
	r->tail = tail;
	r->pos = role == AP_RING_PRODUCER ? tail : head;
	r->role = role;
	return 0;
}

int ap_ring_attach_producer(struct ap_ring *r, void *mem, size_t mem_size)
{
	return r_attach(r, mem, mem_size, AP_RING_PRODUCER);
}

int ap_ring_attach_consumer(struct ap_ring *r, void *mem, size_t mem_size)
{
	return r_attach(r, mem, mem_size, AP_RING_CONSUMER);
}

/* ---- producer ------------------------------------------------------------- */

/* The consumer's head, read once and checked: it only grows, and never
 * passes what we committed. */
static int p_load_head(struct ap_ring *r)
{
	uint64_t h = LOAD(&r->hdr->head, ACQUIRE);

	if (h < r->head || h > r->tail || (h & (AP_RING_ALIGN - 1)))
		return r_broken(r);
	r->head = h;
	return 0;
}

static int p_check(struct ap_ring *r, size_t len)
{
	if (r->broken)
		return -EPROTO;
	if (r->role != AP_RING_PRODUCER)
		return -EINVAL;
	if (len > ap_ring_max_payload(r->cap))
		return -EMSGSIZE;
	return 0;
}

/* 1 if `need` more bytes fit after pos, reading head only when the cached
 * one says no. */
static int p_fits(struct ap_ring *r, uint64_t need)
{
	if (r->pos + need - r->head <= r->cap)
		return 1;
	if (p_load_head(r))
		return -EPROTO;
	return r->pos + need - r->head <= r->cap;
}

int ap_ring_reserve(struct ap_ring *r, size_t len, void **p)
{
	uint64_t sz, need, off;
	int rc = p_check(r, len);

	*p = NULL;
	if (rc)
		return rc;
	if (r->pos > AP_RING_MAX_INDEX)
		return r_broken(r);
	sz = rec_size(len);
	need = need_at(r, r->pos, sz);
	rc = p_fits(r, need);
	if (rc <= 0)
		return rc < 0 ? rc : -EAGAIN;
	off = r->pos & r->mask;
	if (need != sz) {
		uint64_t to_end = r->cap - off;
		STORE(rec_word(r, off), (uint64_t)stamp_at(r, AP_RING_STAMP_PAD, r->pos) << 32 | (to_end - AP_RING_REC_HDR),
		      RELAXED);
		r->pos += to_end;
		off = 0;
	}
	STORE(rec_word(r, off), (uint64_t)stamp_at(r, AP_RING_STAMP_DATA, r->pos) << 32 | len, RELAXED);
	r->pos += sz;
	*p = r->data + off + AP_RING_REC_HDR;
	return 0;
}

int ap_ring_publish(struct ap_ring *r)
{
	if (r->broken)
		return -EPROTO;
	if (r->role != AP_RING_PRODUCER)
		return -EINVAL;
	if (r->pos != r->tail) {
		STORE(&r->hdr->tail, r->pos, RELEASE);
		r->tail = r->pos;
	}
	return 0;
}

int ap_ring_notify(struct ap_ring *r)
{
	if (r->broken)
		return -EPROTO;
	if (r->role != AP_RING_PRODUCER)
		return -EINVAL;
	/* Orders our tail store before the flag load (see "Wake-ups"). */
	__atomic_thread_fence(__ATOMIC_SEQ_CST);
	/* Taking the flag down makes this the one wake of that sleep: commits
	 * until the sleeper runs again cost no syscall. */
	if (LOAD(&r->hdr->cons_waiting, RELAXED) && __atomic_exchange_n(&r->hdr->cons_waiting, 0, __ATOMIC_RELAXED)) {
		__atomic_fetch_add(&r->hdr->data_bell, 1, __ATOMIC_RELEASE);
		ap_ring_futex_wake(&r->hdr->data_bell, 1);
		r->n_wake++;
		return 1;
	}
	return 0;
}

int ap_ring_commit(struct ap_ring *r)
{
	uint64_t before = r->tail;
	int rc = ap_ring_publish(r);

	if (rc == 0 && r->tail != before)
		rc = ap_ring_notify(r);
	return rc;
}

void ap_ring_abort(struct ap_ring *r)
{
	if (r->role == AP_RING_PRODUCER)
		r->pos = r->tail;
}

int ap_ring_has_room(struct ap_ring *r, size_t len)
{
	int rc = p_check(r, len);

	if (rc)
		return rc;
	return p_fits(r, need_at(r, r->pos, rec_size(len)));
}

/* ---- consumer ------------------------------------------------------------- */

/* The producer's tail, read once and checked: it only grows, stays
 * 8-aligned and never gets more than cap ahead of our head. */
static int c_load_tail(struct ap_ring *r)
{
	uint64_t t = LOAD(&r->hdr->tail, ACQUIRE);

	if (t < r->tail || t - r->head > r->cap || (t & (AP_RING_ALIGN - 1)))
		return r_broken(r);
	r->tail = t;
	return 0;
}

int ap_ring_read(struct ap_ring *r, const void **p, size_t *len)
{
	*p = NULL;
	*len = 0;
	if (r->broken)
		return -EPROTO;
	if (r->role != AP_RING_CONSUMER)
		return -EINVAL;
	/* Two rounds at most: a pad record, then the record at offset 0. */
	for (int round = 0; round < 2; round++) {
		if (r->pos == r->tail) {
			if (c_load_tail(r))
				return -EPROTO;
			if (r->pos == r->tail)
				return -EAGAIN;
		}
		uint64_t off = r->pos & r->mask, to_end = r->cap - off, avail = r->tail - r->pos;
		uint64_t w = LOAD(rec_word(r, off), RELAXED);
		uint32_t l = (uint32_t)w, stamp = (uint32_t)(w >> 32);

		if (stamp == stamp_at(r, AP_RING_STAMP_PAD, r->pos)) {
			/* A pad fills the data area to its end, never from 0
			 * (a record that does not fit at 0 is too big), and
			 * is committed with the record after it. */
			if (off == 0 || l != to_end - AP_RING_REC_HDR || to_end >= avail)
				return r_broken(r);
			r->pos += to_end;
			continue;
		}
		if (stamp != stamp_at(r, AP_RING_STAMP_DATA, r->pos) || l > ap_ring_max_payload(r->cap))
			return r_broken(r);
		uint64_t sz = rec_size(l);
		if (sz > to_end || sz > avail)
			return r_broken(r);
		*p = r->data + off + AP_RING_REC_HDR;
		*len = l;
		r->pos += sz;
		return 0;
	}
	return r_broken(r);
}

void ap_ring_release(struct ap_ring *r)
{
	/* Broken: the ring is no longer read, so nothing is given back
	 * (publishing a head past bytes we refused would tell the producer
	 * they were consumed). */
	if (r->role != AP_RING_CONSUMER || r->broken || r->pos == r->head)
		return;
	STORE(&r->hdr->head, r->pos, RELEASE);
	r->head = r->pos;
	/* Orders our head store before the flag load (see "Wake-ups"). */
	__atomic_thread_fence(__ATOMIC_SEQ_CST);
	if (LOAD(&r->hdr->prod_waiting, RELAXED) && __atomic_exchange_n(&r->hdr->prod_waiting, 0, __ATOMIC_RELAXED)) {
		__atomic_fetch_add(&r->hdr->space_bell, 1, __ATOMIC_RELEASE);
		ap_ring_futex_wake(&r->hdr->space_bell, 1);
		r->n_wake++;
	}
}

int ap_ring_readable(struct ap_ring *r)
{
	if (r->role != AP_RING_CONSUMER)
		return -EINVAL; /* a failed attach leaves no header to read */
	if (r->broken || r->pos != r->tail)
		return 1;
	return LOAD(&r->hdr->tail, ACQUIRE) != r->pos;
}

/* ---- waiting -------------------------------------------------------------- */

int ap_ring_prepare_sleep(struct ap_ring *r, size_t len, uint32_t **word, uint32_t *expected)
{
	struct ap_ring_hdr *h = r->hdr;
	int rc;

	if (r->broken)
		return -EPROTO;
	if (r->role == AP_RING_CONSUMER) {
		*expected = LOAD(&h->data_bell, ACQUIRE);
		STORE(&h->cons_waiting, 1, RELAXED);
		__atomic_thread_fence(__ATOMIC_SEQ_CST);
		if (ap_ring_readable(r)) {
			STORE(&h->cons_waiting, 0, RELAXED);
			return 0;
		}
		*word = &h->data_bell;
		return 1;
	}
	if ((rc = p_check(r, len)))
		return rc;
	*expected = LOAD(&h->space_bell, ACQUIRE);
	STORE(&h->prod_waiting, 1, RELAXED);
	__atomic_thread_fence(__ATOMIC_SEQ_CST);
	rc = ap_ring_has_room(r, len);
	if (rc) {
		STORE(&h->prod_waiting, 0, RELAXED);
		return rc < 0 ? rc : 0;
	}
	*word = &h->space_bell;
	return 1;
}

void ap_ring_end_sleep(struct ap_ring *r)
{
	if (r->role == AP_RING_CONSUMER)
		STORE(&r->hdr->cons_waiting, 0, RELAXED);
	else if (r->role == AP_RING_PRODUCER)
		STORE(&r->hdr->prod_waiting, 0, RELAXED);
}

static int r_ready(struct ap_ring *r, size_t len)
{
	return r->role == AP_RING_CONSUMER ? ap_ring_readable(r) : ap_ring_has_room(r, len);
}

static void deadline_after(struct timespec *ts, int ms)
{
	clock_gettime(CLOCK_MONOTONIC, ts);
	ts->tv_sec += ms / 1000;
	ts->tv_nsec += (long)(ms % 1000) * 1000000L;
	if (ts->tv_nsec >= 1000000000L) {
		ts->tv_sec++;
		ts->tv_nsec -= 1000000000L;
	}
}

/* FUTEX_WAIT_BITSET takes an absolute CLOCK_MONOTONIC deadline, so a wait
 * that is woken and sleeps again never stretches the timeout. 0 (woken, or
 * the value differed, or a signal), -ETIMEDOUT, or another -errno (a real
 * error, not a wake-up). */
static int futex_wait_until(uint32_t *word, uint32_t expected, const struct timespec *deadline)
{
	if (syscall(SYS_futex, word, FUTEX_WAIT_BITSET, expected, deadline, NULL, FUTEX_BITSET_MATCH_ANY) == 0)
		return 0;
	if (errno == EAGAIN || errno == EINTR)
		return 0;
	return -errno;
}

/* The common tail of both waits: spin, then sleep until the condition
 * holds, a local kick (ap_ring_wake on this view) or the deadline. A
 * wake-up alone proves nothing (the peer can ring the bell at will), so
 * it only makes us look again. */
static int r_wait(struct ap_ring *r, size_t len, unsigned spin, int timeout_ms)
{
	struct timespec deadline;
	uint32_t *word, expected;
	int rc;

	if (r->broken)
		return -EPROTO;
	for (unsigned i = 0; i < spin; i++) {
		rc = r_ready(r, len);
		if (rc)
			return rc < 0 ? rc : 0;
		ap_ring_cpu_relax();
	}
	if (timeout_ms >= 0)
		deadline_after(&deadline, timeout_ms);
	for (;;) {
		if (__atomic_exchange_n(&r->kick, 0, __ATOMIC_ACQUIRE))
			return 0;
		rc = ap_ring_prepare_sleep(r, len, &word, &expected);
		if (rc <= 0)
			return rc;
		r->n_sleep++;
		rc = futex_wait_until(word, expected, timeout_ms >= 0 ? &deadline : NULL);
		ap_ring_end_sleep(r);
		if (rc == -ETIMEDOUT) {
			r->n_timeout++;
			if (__atomic_exchange_n(&r->kick, 0, __ATOMIC_ACQUIRE))
				return 0;
			/* The last look: a wake-up may have raced the timeout. */
			int now = r_ready(r, len);
			return now > 0 ? 0 : now < 0 ? now : -ETIMEDOUT;
		}
		if (rc < 0)
			return rc;
	}
}

int ap_ring_wait(struct ap_ring *r, unsigned spin, int timeout_ms)
{
	if (r->role != AP_RING_CONSUMER)
		return -EINVAL;
	return r_wait(r, 0, spin, timeout_ms);
}

int ap_ring_wait_space(struct ap_ring *r, size_t len, unsigned spin, int timeout_ms)
{
	int rc = p_check(r, len);

	return rc ? rc : r_wait(r, len, spin, timeout_ms);
}

void ap_ring_wake(struct ap_ring *r)
{
	if (!r->hdr)
		return; /* a failed attach */
	__atomic_store_n(&r->kick, 1, __ATOMIC_RELEASE);
	__atomic_fetch_add(&r->hdr->data_bell, 1, __ATOMIC_RELEASE);
	ap_ring_futex_wake(&r->hdr->data_bell, INT_MAX);
	__atomic_fetch_add(&r->n_wake, 1, __ATOMIC_RELAXED); /* may be another thread's view */
}

/* Shared futexes (no FUTEX_PRIVATE_FLAG): the words live in MAP_SHARED
 * memory that other processes wait on. */
int ap_ring_futex_wait(uint32_t *word, uint32_t expected, int timeout_ms)
{
	struct timespec ts, *tsp = NULL;

	if (timeout_ms >= 0) {
		ts.tv_sec = timeout_ms / 1000;
		ts.tv_nsec = (long)(timeout_ms % 1000) * 1000000L;
		tsp = &ts;
	}
	if (syscall(SYS_futex, word, FUTEX_WAIT, expected, tsp, NULL, 0) == 0 || errno == EAGAIN || errno == EINTR)
		return 0;
	return -errno;
}

int ap_ring_futex_wake(uint32_t *word, int n)
{
	long rc = syscall(SYS_futex, word, FUTEX_WAKE, n, NULL, NULL, 0);
	return rc < 0 ? 0 : (int)rc;
}

/* ---- segments ------------------------------------------------------------- */

static int map_fd(struct ap_ring_map *m, int fd, size_t size)
{
	void *p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);

	if (p == MAP_FAILED)
		return -errno;
	m->mem = p;
	m->size = size;
	m->fd = fd;
	return 0;
}

/* Reserves every byte (tmpfs returns ENOSPC now rather than SIGBUS on a
 * later first touch). posix_fallocate returns the error, not errno. */
static int reserve_all(int fd, size_t size)
{
	int e = posix_fallocate(fd, 0, (off_t)size);
	return e ? -e : 0;
}

static int valid_shm_name(const char *name)
{
	size_t n = name ? strnlen(name, NAME_MAX + 1) : 0;
	return n >= 2 && n <= NAME_MAX && name[0] == '/' && !strchr(name + 1, '/');
}

int ap_ring_map_create_shm(struct ap_ring_map *m, const char *name, size_t size)
{
	int fd, rc;

	m->mem = NULL;
	m->size = 0;
	m->fd = -1;
	if (!valid_shm_name(name) || size < AP_RING_HDR_SIZE || size > (size_t)1 << 40)
		return -EINVAL;
	fd = shm_open(name, O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, 0600);
	if (fd < 0)
		return -errno;
	/* 0600 whatever the umask. */
	if (fchmod(fd, 0600) < 0 || ftruncate(fd, (off_t)size) < 0)
		rc = -errno;
	else if (!(rc = reserve_all(fd, size)))
		rc = map_fd(m, fd, size);
	if (rc) {
		close(fd);
		shm_unlink(name);
	}
	return rc;
}

int ap_ring_map_open_shm(struct ap_ring_map *m, const char *name, size_t min_size)
{
	struct stat st;
	int fd, rc;

	m->mem = NULL;
	m->size = 0;
	m->fd = -1;
	if (!valid_shm_name(name))
		return -EINVAL;
	/* O_NONBLOCK: a FIFO planted under the name must not block us; it
	 * is refused below. */
	fd = shm_open(name, O_RDWR | O_CLOEXEC | O_NONBLOCK, 0);
	if (fd < 0)
		return -errno;
	if (fstat(fd, &st) < 0)
		rc = -errno;
	else if (!S_ISREG(st.st_mode))
		rc = -EINVAL;
	else if (st.st_uid != geteuid() || (st.st_mode & 077))
		rc = -EPERM; /* made by someone else, or open to others */
	else if (st.st_size < 0 || (uint64_t)st.st_blocks * 512 < (uint64_t)st.st_size)
		rc = -EINVAL; /* sparse: a first touch on a full tmpfs is SIGBUS */
	else if ((uint64_t)st.st_size < min_size || (uint64_t)st.st_size < AP_RING_HDR_SIZE)
		rc = -EINVAL;
	else
		rc = map_fd(m, fd, (size_t)st.st_size);
	if (rc)
		close(fd);
	return rc;
}

int ap_ring_map_create_memfd(struct ap_ring_map *m, const char *tag, size_t size)
{
	int fd, rc;

	m->mem = NULL;
	m->size = 0;
	m->fd = -1;
	if (size < AP_RING_HDR_SIZE || size > (size_t)1 << 40)
		return -EINVAL;
	fd = memfd_create(tag ? tag : "ap_ring", MFD_CLOEXEC | MFD_ALLOW_SEALING);
	if (fd < 0)
		return -errno;
	if (ftruncate(fd, (off_t)size) < 0)
		rc = -errno;
	else if ((rc = reserve_all(fd, size)))
		;
	else if (fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) < 0)
		rc = -errno;
	else
		rc = map_fd(m, fd, size);
	if (rc)
		close(fd);
	return rc;
}

int ap_ring_map_open_fd(struct ap_ring_map *m, int fd, size_t min_size)
{
	struct stat st;
	int seals;

	m->mem = NULL;
	m->size = 0;
	m->fd = -1;
	seals = fcntl(fd, F_GET_SEALS);
	if (seals < 0)
		return -errno;
	if ((seals & (F_SEAL_SHRINK | F_SEAL_GROW)) != (F_SEAL_SHRINK | F_SEAL_GROW))
		return -EPERM;
	if (fstat(fd, &st) < 0)
		return -errno;
	/* Sealed but sparse would still fault pages in on first touch, which
	 * can fail (SIGBUS) under a memory limit: the creator reserves all. */
	if (!S_ISREG(st.st_mode) || st.st_size < 0 || (uint64_t)st.st_blocks * 512 < (uint64_t)st.st_size)
		return -EINVAL;
	if ((uint64_t)st.st_size < min_size || (uint64_t)st.st_size < AP_RING_HDR_SIZE)
		return -EINVAL;
	return map_fd(m, fd, (size_t)st.st_size);
}

void ap_ring_map_close(struct ap_ring_map *m)
{
	if (m->mem)
		munmap(m->mem, m->size);
	if (m->fd >= 0)
		close(m->fd);
	m->mem = NULL;
	m->size = 0;
	m->fd = -1;
}

int ap_ring_shm_unlink(const char *name)
{
	if (!valid_shm_name(name))
		return -EINVAL;
	return shm_unlink(name) < 0 ? -errno : 0;
}
