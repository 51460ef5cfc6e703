/* ap_sendq: mutex-guarded FIFO plus an eventfd doorbell. */
#include "ap_sendq.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <unistd.h>

int ap_sendq_init(ap_sendq *q)
{
	memset(q, 0, sizeof *q);
	q->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
	if (q->efd < 0)
		return -errno;
	pthread_mutex_init(&q->mu, NULL);
	return 0;
}

void ap_sendq_destroy(ap_sendq *q)
{
	ap_sendq_item *it = q->head;
	while (it) {
		ap_sendq_item *next = it->next;
		if (q->dispose)
			q->dispose(it);
		free(it);
		it = next;
	}
	q->head = q->tail = NULL;
	if (q->efd >= 0)
		close(q->efd);
	q->efd = -1;
	pthread_mutex_destroy(&q->mu);
}

ap_sendq_item *ap_sendq_item_new(int kind, const char *node, size_t len)
{
	if (len > UINT32_MAX)
		return NULL;
	ap_sendq_item *it = malloc(sizeof *it + len);
	if (!it)
		return NULL;
	it->next = NULL;
	it->kind = kind;
	it->len = (uint32_t)len;
	it->node[0] = 0;
	if (node) {
		strncpy(it->node, node, sizeof it->node - 1);
		it->node[sizeof it->node - 1] = 0;
	}
	return it;
}

void ap_sendq_push(ap_sendq *q, ap_sendq_item *it)
{
	int was_empty;
	it->next = NULL;
	pthread_mutex_lock(&q->mu);
	was_empty = q->head == NULL;
	if (q->tail)
		q->tail->next = it;
	else
		q->head = it;
	q->tail = it;
	q->count++;
	pthread_mutex_unlock(&q->mu);
	if (was_empty) {
		uint64_t one = 1;
		/* EAGAIN means the counter is already non-zero: the loop will wake. */
		ssize_t w = write(q->efd, &one, sizeof one);
		(void)w;
	}
}

ap_sendq_item *ap_sendq_drain(ap_sendq *q)
{
	uint64_t v;
	ap_sendq_item *h;
	/* Clear the doorbell first: a push after this read rings it again, so
	 * no item can be left behind without a wakeup. */
	ssize_t r = read(q->efd, &v, sizeof v);
	(void)r;
	pthread_mutex_lock(&q->mu);
	h = q->head;
	q->head = q->tail = NULL;
	q->count = 0;
	pthread_mutex_unlock(&q->mu);
	return h;
}
