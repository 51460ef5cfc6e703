/* mailbox: each worker's queue of jobs (single producer, the loop; single
 * consumer, the worker), recycled jobs, and the doorbell a worker sleeps on
 * when its queue is empty. */
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
	/* seq_cst: the worker's "going to sleep" flag is checked after this. */
	atomic_store(&m->tail->next, j);
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
	atomic_store_explicit(&m->deq, atomic_load_explicit(&m->deq, memory_order_relaxed) + 1, memory_order_relaxed);
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
		if (j->cap >= need)
			return j;
		free(j);
	}
	size_t cap = need < 256 ? 256 : need;
	j = malloc(sizeof *j + cap);
	if (j)
		j->cap = (uint32_t)cap;
	return j;
}

ap_job *ap_worker_next_job(ap_worker *w)
{
	for (;;) {
		ap_job *j = ap_mbox_pop(&w->mb);
		if (j || atomic_load(&w->stop))
			return j;
		pthread_mutex_lock(&w->mu);
		atomic_store(&w->sleeping, 1);
		/* Checked after the flag (both seq_cst): a push we miss here
		 * sees the flag and signals. */
		if (ap_mbox_empty(&w->mb) && !atomic_load(&w->stop))
			pthread_cond_wait(&w->cv, &w->mu);
		atomic_store(&w->sleeping, 0);
		pthread_mutex_unlock(&w->mu);
	}
}

void ap_worker_wake(ap_worker *w, int always)
{
	if (always || (atomic_load(&w->sleeping) && atomic_exchange(&w->sleeping, 0))) {
		pthread_mutex_lock(&w->mu);
		pthread_cond_signal(&w->cv);
		pthread_mutex_unlock(&w->mu);
	}
}
