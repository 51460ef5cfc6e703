/* ap_spin: how long a thread spins for work before it sleeps, adapted to
 * what its spins find (the pool node's loop over its ring segments,
 * dataplane/node/ring_ingress.c; the data plane NIF's reply thread over its
 * reply rings). Work that comes in streams comes again within a spin and
 * costs no sleep and wake-up; a lone caller's next work is a whole round
 * trip away, and spinning for it takes the CPU the other side needs on a
 * small host. So the spin doubles after one that found work (up to
 * max_rounds) and halves after one that did not; work that came without a
 * spin (a wake-up, or the first look) brings it back to min_rounds. Each
 * user keeps its own loop and its own rounds; one thread owns each. */
#ifndef AP_SPIN_H
#define AP_SPIN_H

struct ap_spin {
	unsigned rounds;     /* the pause rounds the next spin takes */
	unsigned min_rounds; /* where work that came without a spin puts it back */
	unsigned max_rounds;
};

/* The spin found work after one pause or more: the next is twice as long. */
static inline void ap_spin_found(struct ap_spin *s)
{
	s->rounds = s->rounds * 2 > s->max_rounds ? s->max_rounds : s->rounds * 2;
}

/* The spin ran out with nothing: the next is half as long. */
static inline void ap_spin_missed(struct ap_spin *s) { s->rounds /= 2; }

/* Work came without a spin: the next spin is worth a try again. */
static inline void ap_spin_again(struct ap_spin *s)
{
	if (s->rounds < s->min_rounds)
		s->rounds = s->min_rounds;
}

#endif
