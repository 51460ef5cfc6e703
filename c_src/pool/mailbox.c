/* mailbox: each worker's queue of jobs (single producer, the loop; single
 * consumer, the worker) and the jobs' recycling. */
#include <stdlib.h>

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
