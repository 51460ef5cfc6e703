/* mailbox: each worker's queue of jobs (single producer, the loop; single
 * consumer, the worker), recycled jobs, and the doorbell a worker sleeps on
 * when its queue is empty. */
#include <linux/futex.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "ap_ring.h"
#include "isolate.h"
#include "pool_int.h"

int ap_mbox_init(ap_mbox *m)
{
	ap_job *stub = calloc(1, sizeof *stub);
	if (!stub)
		return -1;
	m->head = m->tail = stub;
	atomic_init(&m->recycled, NULL);
	atomic_init(&m->enq, 0);
	atomic_init(&m->deq, 0);
	return 0;
}

void ap_mbox_push(ap_mbox *m, ap_job *j)
{
	atomic_store_explicit(&j->next, NULL, memory_order_relaxed);
	/* One writer per counter: a plain load and store, no locked add. */
	atomic_store_explicit(&m->enq, atomic_load_explicit(&m->enq, memory_order_relaxed) + 1, memory_order_relaxed);
	/* A release, not seq_cst: a locked store here stalled for the line
	 * the consumer had last read (two fifths of the loop's time under a
	 * tell flood). The worker's "going to sleep" flag is checked after
	 * a fence in ap_worker_wake, once per worker and wake pass. */
	atomic_store_explicit(&m->tail->next, j, memory_order_release);
	m->tail = j;
}

/* The job stays the queue's dummy until the next pop; its bytes stay valid
 * until then. */
ap_job *ap_mbox_pop(ap_mbox *m)
{
	ap_job *next = atomic_load_explicit(&m->head->next, memory_order_acquire);
	if (!next)
		return NULL;
	ap_job *old = m->head, *top = atomic_load_explicit(&m->recycled, memory_order_relaxed);
	do
		old->free_next = top;
	while (!atomic_compare_exchange_weak_explicit(&m->recycled, &top, old, memory_order_release,
						     memory_order_relaxed));
	m->head = next;
	return next;
}

/* The consumer finished the job it popped last. Counting here rather than
 * at the pop keeps the message being handled in the depth, so a worker busy
 * on one long message does not look idle to smallest_mailbox. */
void ap_mbox_done(ap_mbox *m)
{
	/* A release: the loop's inline check (ap_pool_can_inline) reads the
	 * depth with an acquire, and then the sleep flag, which must not be
	 * one the worker raised before this job. */
	atomic_store_explicit(&m->deq, atomic_load_explicit(&m->deq, memory_order_relaxed) + 1, memory_order_release);
}

void ap_job_free_list(ap_job *j)
{
	while (j) {
		ap_job *next = j->free_next;
		free(j);
		j = next;
	}
}

void ap_mbox_destroy(ap_mbox *m)
{
	while (ap_mbox_pop(m))
		ap_mbox_done(m);
	free(m->head);
	ap_job_free_list(atomic_exchange(&m->recycled, NULL));
	m->head = m->tail = NULL;
}

/* Producer: a job with room for `need` bytes, reused when one came back. */
ap_job *ap_job_alloc(ap_mbox *m, ap_job **cache, size_t need)
{
	if (!*cache)
		*cache = atomic_exchange_explicit(&m->recycled, NULL, memory_order_acquire);
	ap_job *j = *cache;
	if (j) {
		*cache = j->free_next;
		/* The recycled list is a chain of lines the worker wrote last:
		 * each link a cache miss in turn (a fifth of the loop's time
		 * under a tell flood). Fetch the next one while this job is
		 * filled. */
		if (*cache)
			__builtin_prefetch(*cache, 1);
		if (j->cap >= need) {
			j->is_answer = j->revoked = 0;
			return j;
		}
		free(j);
	}
	size_t cap = need < 256 ? 256 : need;
	j = malloc(sizeof *j + cap);
	if (j) {
		j->cap = (uint32_t)cap;
		/* The flags not every maker sets (answers handed over, jobs
		 * revoked): never a recycled job's or the heap's byte. */
		j->is_answer = j->revoked = 0;
	}
	return j;
}

/* The worker's doorbell is its `sleeping` word, a private futex: the
 * loop wakes it with one FUTEX_WAKE and no lock, so the woken worker never
 * blocks again on a mutex the waker still holds (a mutex and condvar cost
 * 5-6 syscalls and two switches per sleep). Before sleeping the worker
 * spins briefly, so a job that follows the last within a few microseconds
 * (64 callers) costs no sleep and no wake; the spin is short because on a
 * 2-core host it takes the CPU the loop needs to bring that job. */
#define AP_WORKER_SPIN 64

static void futex_wait_private(_Atomic int *w, int expected)
{
	(void)syscall(SYS_futex, (int *)w, FUTEX_WAIT_PRIVATE, expected, NULL, NULL, 0);
}

static void futex_wake_private(_Atomic int *w)
{
	(void)syscall(SYS_futex, (int *)w, FUTEX_WAKE_PRIVATE, 1, NULL, NULL, 0);
}

ap_job *ap_worker_next_job(ap_worker *w)
{
	for (;;) {
		if (atomic_load(&w->crash_pending))
			return NULL; /* an inline run crashed on its behalf */
		ap_job *j = ap_mbox_pop(&w->mb);
		if (j || atomic_load(&w->stop))
			return j;
		for (int k = 0; k < AP_WORKER_SPIN && ap_mbox_empty(&w->mb) && !atomic_load(&w->stop); k++)
			ap_ring_cpu_relax();
		if (!ap_mbox_empty(&w->mb))
			continue;
		atomic_store(&w->sleeping, 1);
		/* Checked after the flag (both seq_cst): a push we miss here
		 * sees the flag, takes it down and wakes us; if that happened
		 * already, the wait returns at once (the word is no longer 1). */
		if (ap_mbox_empty(&w->mb) && !atomic_load(&w->stop) && !atomic_load(&w->crash_pending))
			futex_wait_private(&w->sleeping, 1);
		atomic_store(&w->sleeping, 0);
	}
}

void ap_worker_wake(ap_worker *w, int always, int ask)
{
	if (w->iso) {
		ap_iso_wake(w, always, ask);
		return;
	}
	/* Orders the pushes before (release stores, ap_mbox_push) before
	 * the look at the flag: the Dekker pair of the worker's raising it,
	 * then its look at the mailbox (ap_worker_next_job). */
	atomic_thread_fence(memory_order_seq_cst);
	if (always) {
		atomic_store(&w->sleeping, 0);
		futex_wake_private(&w->sleeping);
	} else if (atomic_load(&w->sleeping) && atomic_exchange(&w->sleeping, 0)) {
		futex_wake_private(&w->sleeping);
	}
}
