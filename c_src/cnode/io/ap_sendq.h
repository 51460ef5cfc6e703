/* ap_sendq: the hand-off from any thread to the loop thread.
 *
 * Only the loop thread writes sockets. A worker that has something to send
 * (or any other work for the loop) pushes an item here; the first push into
 * an empty queue writes the eventfd, which wakes the loop, and the loop takes
 * the whole list at once, in push order.
 */
#ifndef AP_SENDQ_H
#define AP_SENDQ_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

typedef struct ap_sendq_item {
	struct ap_sendq_item *next;
	int kind;        /* what the loop should do with it; the owner defines kinds */
	uint32_t len;    /* bytes in data */
	char node[256];  /* destination node, when the item is a send */
	uint8_t data[];  /* a whole encoded frame, or other payload */
} ap_sendq_item;

typedef struct ap_sendq {
	pthread_mutex_t mu;
	ap_sendq_item *head, *tail;
	size_t count;
	int efd;         /* eventfd, non-blocking; readable while items wait */
	/* The owner's: releases what an item holds (an fd, say) when
	 * ap_sendq_destroy drops it unread; NULL: nothing to release. */
	void (*dispose)(ap_sendq_item *it);
} ap_sendq;

int ap_sendq_init(ap_sendq *q);          /* 0 or -errno */
void ap_sendq_destroy(ap_sendq *q);      /* disposes of and frees anything still queued */
ap_sendq_item *ap_sendq_item_new(int kind, const char *node, size_t len);
/* Any thread. Wakes the loop only on the empty -> non-empty edge. */
void ap_sendq_push(ap_sendq *q, ap_sendq_item *it);
/* Loop thread: take every queued item, oldest first (NULL when empty), and
 * clear the eventfd. The caller frees each item with free(). */
ap_sendq_item *ap_sendq_drain(ap_sendq *q);
static inline int ap_sendq_fd(const ap_sendq *q) { return q->efd; }

#endif
