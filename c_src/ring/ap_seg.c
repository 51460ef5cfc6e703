/* ap_seg: the data plane's segment (layout, doorbells: see ap_seg.h). */
#include "ap_time.h"
#include "ap_seg.h"

#include <errno.h>
#include <string.h>
#include <sys/uio.h>
#include <time.h>

#define LOAD(p, mo) __atomic_load_n((p), __ATOMIC_##mo)
#define STORE(p, v, mo) __atomic_store_n((p), (v), __ATOMIC_##mo)

_Static_assert(offsetof(struct ap_seg_hdr, req_bell) == AP_RING_LINE, "req bell starts line 1");
_Static_assert(offsetof(struct ap_seg_hdr, rep_bell) == 2 * AP_RING_LINE, "rep bell starts line 2");
_Static_assert(offsetof(struct ap_seg_hdr, closed) == 3 * AP_RING_LINE, "closed starts line 3");

static int valid_cap(uint64_t cap)
{
	return cap >= AP_RING_MIN_CAP && cap <= AP_RING_MAX_CAP && !(cap & (cap - 1));
}

size_t ap_seg_size(uint32_t n_req, uint64_t req_cap, uint32_t n_rep, uint64_t rep_cap)
{
	if (n_req < 1 || n_req > AP_SEG_MAX_REQ || n_rep < 1 || n_rep > AP_SEG_MAX_REP || !valid_cap(req_cap) ||
	    !valid_cap(rep_cap))
		return 0;
	/* No overflow: at most 1024 * (2^30 + 256) + 64 * (2^30 + 256). */
	uint64_t total = AP_SEG_HDR_SIZE + (uint64_t)n_req * ap_ring_size(req_cap) +
			 (uint64_t)n_rep * ap_ring_size(rep_cap);
	return total > AP_SEG_MAX_BYTES || total > SIZE_MAX ? 0 : (size_t)total;
}

int ap_seg_format(void *mem, size_t size, uint32_t n_req, uint64_t req_cap, uint32_t n_rep, uint64_t rep_cap)
{
	size_t need = ap_seg_size(n_req, req_cap, n_rep, rep_cap);
	struct ap_seg_hdr *h = mem;

	if (!mem || ((uintptr_t)mem & (AP_RING_LINE - 1)) || !need || size < need)
		return -EINVAL;
	STORE(&h->magic, 0, RELAXED);
	memset((uint8_t *)mem + sizeof h->magic, 0, AP_SEG_HDR_SIZE - sizeof h->magic);
	h->version = AP_SEG_VERSION;
	h->hdr_size = AP_SEG_HDR_SIZE;
	h->total_size = need;
	h->n_req = n_req;
	h->n_rep = n_rep;
	h->req_cap = req_cap;
	h->rep_cap = rep_cap;
	uint8_t *p = (uint8_t *)mem + AP_SEG_HDR_SIZE;
	for (uint32_t i = 0; i < n_req; i++, p += ap_ring_size(req_cap))
		if (ap_ring_format(p, ap_ring_size(req_cap), req_cap))
			return -EINVAL;
	for (uint32_t i = 0; i < n_rep; i++, p += ap_ring_size(rep_cap))
		if (ap_ring_format(p, ap_ring_size(rep_cap), rep_cap))
			return -EINVAL;
	/* Last: a reader that sees the magic sees everything above. */
	STORE(&h->magic, AP_SEG_MAGIC, RELEASE);
	return 0;
}

int ap_seg_parse(struct ap_seg *s, void *mem, size_t size)
{
	struct ap_seg_hdr *h = mem;

	memset(s, 0, sizeof *s);
	if (!mem || ((uintptr_t)mem & (AP_RING_LINE - 1)) || size < AP_SEG_HDR_SIZE)
		return -EINVAL;
	/* Each field once, into locals: the peer may change them meanwhile. */
	uint64_t magic = LOAD(&h->magic, ACQUIRE);
	uint32_t version = LOAD(&h->version, RELAXED), hdr_size = LOAD(&h->hdr_size, RELAXED);
	uint64_t total = LOAD(&h->total_size, RELAXED);
	uint32_t n_req = LOAD(&h->n_req, RELAXED), n_rep = LOAD(&h->n_rep, RELAXED);
	uint64_t req_cap = LOAD(&h->req_cap, RELAXED), rep_cap = LOAD(&h->rep_cap, RELAXED);
	if (magic != AP_SEG_MAGIC || version != AP_SEG_VERSION || hdr_size != AP_SEG_HDR_SIZE)
		return -EINVAL;
	size_t need = ap_seg_size(n_req, req_cap, n_rep, rep_cap);
	if (!need || total != need || need > size)
		return -EINVAL;
	s->hdr = h;
	s->base = mem;
	s->size = need;
	s->n_req = n_req;
	s->n_rep = n_rep;
	s->req_cap = req_cap;
	s->rep_cap = rep_cap;
	return 0;
}

void *ap_seg_req(const struct ap_seg *s, uint32_t i)
{
	if (!s->base || i >= s->n_req)
		return NULL;
	return s->base + AP_SEG_HDR_SIZE + (size_t)i * ap_ring_size(s->req_cap);
}

void *ap_seg_rep(const struct ap_seg *s, uint32_t i)
{
	if (!s->base || i >= s->n_rep)
		return NULL;
	return s->base + AP_SEG_HDR_SIZE + (size_t)s->n_req * ap_ring_size(s->req_cap) +
	       (size_t)i * ap_ring_size(s->rep_cap);
}

/* ---- doorbells -------------------------------------------------------------- */

static uint32_t *bell_of(struct ap_seg_hdr *h, enum ap_seg_bell b)
{
	return b == AP_SEG_BELL_REQ ? &h->req_bell : &h->rep_bell;
}

static uint32_t *flag_of(struct ap_seg_hdr *h, enum ap_seg_bell b)
{
	return b == AP_SEG_BELL_REQ ? &h->req_sleeping : &h->rep_sleeping;
}

void ap_seg_ring_pipe(int bell)
{
	/* RWF_NOWAIT: never blocks, whatever anyone did to the write end's
	 * flags; EAGAIN means the pipe is full, so the loop is rung. */
	char c = 'b';
	struct iovec iov = { .iov_base = &c, .iov_len = 1 };
	(void)pwritev2(bell, &iov, 1, -1, RWF_NOWAIT);
}

int ap_seg_notify_fd(struct ap_seg_hdr *h, enum ap_seg_bell b, int bell)
{
	uint32_t *flag = flag_of(h, b);

	/* Orders the caller's tail store before the flag load (Dekker, as in
	 * ap_ring.h "Wake-ups"). */
	__atomic_thread_fence(__ATOMIC_SEQ_CST);
	if (LOAD(flag, RELAXED) && __atomic_exchange_n(flag, 0, __ATOMIC_RELAXED)) {
		__atomic_fetch_add(bell_of(h, b), 1, __ATOMIC_RELEASE);
		if (bell >= 0)
			ap_seg_ring_pipe(bell);
		else
			ap_ring_futex_wake(bell_of(h, b), 1);
		return 1;
	}
	return 0;
}

int ap_seg_notify(struct ap_seg_hdr *h, enum ap_seg_bell b) { return ap_seg_notify_fd(h, b, -1); }

void ap_seg_sleep_begin(struct ap_seg_hdr *h, enum ap_seg_bell b, uint32_t **word, uint32_t *expected)
{
	*expected = LOAD(bell_of(h, b), ACQUIRE);
	STORE(flag_of(h, b), 1, RELAXED);
	__atomic_thread_fence(__ATOMIC_SEQ_CST);
	*word = bell_of(h, b);
}

int ap_seg_flag_take(struct ap_seg_hdr *h, enum ap_seg_bell b)
{
	uint32_t *flag = flag_of(h, b);
	return LOAD(flag, RELAXED) && __atomic_exchange_n(flag, 0, __ATOMIC_RELAXED);
}

void ap_seg_flag_raise(struct ap_seg_hdr *h, enum ap_seg_bell b)
{
	STORE(flag_of(h, b), 1, RELAXED);
	__atomic_thread_fence(__ATOMIC_SEQ_CST);
}

void ap_seg_sleep_end(struct ap_seg_hdr *h, enum ap_seg_bell b)
{
	STORE(flag_of(h, b), 0, RELAXED);
}

int ap_seg_wait(struct ap_seg_hdr *h, enum ap_seg_bell b, int (*ready)(void *), void *arg, unsigned spin,
		int timeout_ms)
{
	int64_t deadline = timeout_ms >= 0 ? ap_mono_ms() + timeout_ms : 0;

	for (unsigned i = 0; i < spin; i++) {
		if (ready(arg) > 0)
			return 0;
		ap_ring_cpu_relax();
	}
	/* Every turn sleeps at most until the one deadline: a peer that rings
	 * at will costs syscalls, never a wait past it. */
	for (;;) {
		uint32_t *word, expected;
		if (ready(arg) > 0)
			return 0;
		ap_seg_sleep_begin(h, b, &word, &expected);
		if (ready(arg) > 0) {
			ap_seg_sleep_end(h, b);
			return 0;
		}
		int left = -1;
		if (timeout_ms >= 0) {
			int64_t now = ap_mono_ms();
			if (now >= deadline) {
				ap_seg_sleep_end(h, b);
				return -ETIMEDOUT;
			}
			left = (int)(deadline - now);
		}
		int rc = ap_ring_futex_wait(word, expected, left);
		ap_seg_sleep_end(h, b);
		if (rc == -ETIMEDOUT)
			return ready(arg) > 0 ? 0 : -ETIMEDOUT;
		if (rc < 0)
			return rc;
		/* A kick (the bell moved with no flag taken down by a producer)
		 * ends the wait, so a closing side is heard at once. */
		if (LOAD(&h->closed, ACQUIRE))
			return 0;
	}
}

void ap_seg_kick(struct ap_seg_hdr *h, enum ap_seg_bell b)
{
	__atomic_fetch_add(bell_of(h, b), 1, __ATOMIC_RELEASE);
	ap_ring_futex_wake(bell_of(h, b), 1 << 30);
}

void ap_seg_close(struct ap_seg_hdr *h, uint32_t side)
{
	__atomic_fetch_or(&h->closed, side, __ATOMIC_RELEASE);
	ap_seg_kick(h, AP_SEG_BELL_REQ);
	ap_seg_kick(h, AP_SEG_BELL_REP);
}

uint32_t ap_seg_closed(const struct ap_seg_hdr *h)
{
	return LOAD(&h->closed, ACQUIRE);
}
