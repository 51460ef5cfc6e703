/* ap_skip: a costly wait that keeps missing is skipped for a while (the
 * NIF's await/2 spin for a lone ask's answer, the pool node's loop kept
 * awake for a lone caller's next ask). Two misses in a row make the next
 * 4 uses skip it, then 8, ... up to max while the misses go on; one miss
 * alone (a thread preempted once, a caller held up once) makes no gap. A
 * hit resets it. Not thread-safe: its owner's lock or thread guards it. */
#ifndef AP_SKIP_H
#define AP_SKIP_H

#define AP_SKIP_MIN 4u

struct ap_skip {
	unsigned misses; /* in a row */
	unsigned gap;    /* the last gap, 0 after a hit */
	unsigned left;   /* uses still to skip */
};

/* Whether this use waits: 0 while a gap is being skipped. */
static inline int ap_skip_wait(struct ap_skip *k)
{
	if (!k->left)
		return 1;
	k->left--;
	return 0;
}

/* The wait caught what it waited for. (A wait happens only with no gap
 * left, so there is none to clear.) */
static inline void ap_skip_hit(struct ap_skip *k)
{
	k->misses = 0;
	k->gap = 0;
}

/* The wait ran out with nothing. */
static inline void ap_skip_miss(struct ap_skip *k, unsigned max)
{
	if (++k->misses < 2)
		return;
	k->gap = k->gap ? k->gap * 2 : AP_SKIP_MIN;
	if (k->gap > max)
		k->gap = max;
	k->left = k->gap;
}

#endif
