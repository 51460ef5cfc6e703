/* ap_setup_gate: ap_setup's table of pending handshakes, its caps and
 * fairness rules (ap_setup.h), and the gate thread that reads each
 * accepted socket's first packet before a handshake thread may take it. */
#include "ap_setup_int.h"

#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "ap_log.h"
#include "ap_time.h"

/* ---- pending handshakes ------------------------------------------------- */

void wake_gate(ap_setup *s)
{
	uint64_t one = 1;
	ssize_t r = write(s->wake_fd, &one, sizeof one);
	(void)r; /* a full counter (EAGAIN) wakes it all the same */
}

void unlink_pend(ap_setup *s, struct pend *p)
{
	if (p->prev)
		p->prev->next = p->next;
	else
		s->head = p->next;
	if (p->next)
		p->next->prev = p->prev;
	else
		s->tail = p->prev;
	p->prev = p->next = NULL;
}

/* Under s->mu: p no longer counts; its fd is shut down, which wakes a
 * handshake thread blocked on it. Whoever owns p frees it. */
static void drop(ap_setup *s, struct pend *p, unsigned long long *counter)
{
	if (p->dropped)
		return;
	p->dropped = 1;
	s->npend--;
	p->src->npend--;
	if (p->st == P_READY) {
		s->nready--;
	} else if (p->st == P_RUN) {
		s->nevict++;
		p->src->nrun--;
	}
	if (p->fd >= 0)
		shutdown(p->fd, SHUT_RDWR);
	(*counter)++;
}

/* Under s->mu: the source record of addr (new if none), one more
 * reference; NULL if out of memory. */
static struct src *src_get(ap_setup *s, const uint8_t *addr, uint8_t len)
{
	struct src *x = s->srcs;
	while (x && !(x->len == len && !memcmp(x->addr, addr, len)))
		x = x->next;
	if (!x) {
		x = calloc(1, sizeof *x);
		if (!x)
			return NULL;
		memcpy(x->addr, addr, len);
		x->len = len;
		x->next = s->srcs;
		s->srcs = x;
	}
	x->refs++;
	return x;
}

/* Under s->mu: p's reference to its source goes, then p. */
void pend_free(ap_setup *s, struct pend *p)
{
	struct src *x = p->src;
	if (x && --x->refs == 0) {
		struct src **pp = &s->srcs;
		while (*pp != x)
			pp = &(*pp)->next;
		*pp = x->next;
		free(x);
	}
	free(p);
}

/* Under s->mu: the entry of source x to drop for room: its oldest not yet
 * on a handshake thread (those that sent their name are likelier to be
 * nodes, and stalled ones are evicted by the grace rule), else its oldest
 * running one that has had its grace; NULL if none: a handshake under way
 * is never cut short at once. */
static struct pend *oldest_of(ap_setup *s, const struct src *x, int64_t now)
{
	struct pend *run = NULL;
	for (struct pend *o = s->head; o; o = o->next) {
		if (o->dropped || o->src != x)
			continue;
		if (o->st != P_RUN)
			return o;
		if (!run && now - o->t_run >= s->cfg.grace_ms)
			run = o;
	}
	return run;
}

/* Under s->mu, at the pending cap: the entry to drop for newcomer p. It
 * comes from the source holding the most pending handshakes, p counted:
 * p's own when it holds as many, else (or when p's own has nothing that
 * may go) the other that holds the most, the one with the oldest entry of
 * those holding as many. Never from a source holding fewer than p's: a
 * churning flood from many addresses only recycles its own slots, and an
 * address holding its fair share (max_pending / addresses) or less keeps
 * it. NULL: refuse p. */
static struct pend *cap_victim(ap_setup *s, const struct pend *p, int64_t now)
{
	const struct src *most = NULL;
	for (struct pend *o = s->head; o; o = o->next)
		if (!o->dropped && o->src != p->src && (!most || o->src->npend > most->npend))
			most = o->src;
	int n = p->src->npend + 1;
	struct pend *v = NULL;
	if (!most || n >= most->npend)
		v = oldest_of(s, p->src, now);
	if (!v && most && most->npend >= n)
		v = oldest_of(s, most, now);
	return v;
}

static void source_of(int fd, uint8_t *src, uint8_t *srclen)
{
	struct sockaddr_storage ss;
	socklen_t sl = sizeof ss;
	*srclen = 0;
	if (getpeername(fd, (struct sockaddr *)&ss, &sl) < 0)
		return;
	if (ss.ss_family == AF_INET) {
		memcpy(src, &((struct sockaddr_in *)&ss)->sin_addr, 4);
		*srclen = 4;
	} else if (ss.ss_family == AF_INET6) {
		memcpy(src, &((struct sockaddr_in6 *)&ss)->sin6_addr, 16);
		*srclen = 16;
	}
}

void ap_setup_accept(ap_setup *s, int fd)
{
	struct pend *p = s ? calloc(1, sizeof *p) : NULL;
	if (!p) { /* no memory, or stopped (the loop still runs at teardown) */
		close(fd);
		return;
	}
	p->fd = fd;
	p->st = P_GATE;
	uint8_t addr[16];
	uint8_t alen;
	source_of(fd, addr, &alen);
	pthread_mutex_lock(&s->mu);
	s->st.accepted++;
	int64_t now = ap_mono_ms();
	p->deadline = now + s->cfg.handshake_ms;
	p->src = src_get(s, addr, alen);
	/* At a cap with nothing that may go, the newcomer is refused. */
	int refuse = !p->src;
	if (!refuse && p->src->npend >= s->cfg.max_per_source) {
		struct pend *o = oldest_of(s, p->src, now);
		if (o)
			drop(s, o, &s->st.capped);
		else
			refuse = 1;
	}
	if (!refuse && s->npend >= s->cfg.max_pending) {
		struct pend *o = cap_victim(s, p, now);
		if (o)
			drop(s, o, &s->st.capped);
		else
			refuse = 1;
	}
	if (refuse) {
		s->st.capped++;
		pend_free(s, p);
		pthread_mutex_unlock(&s->mu);
		close(fd);
		wake_gate(s); /* for its summary line */
		return;
	}
	p->prev = s->tail;
	if (s->tail)
		s->tail->next = p;
	else
		s->head = p;
	s->tail = p;
	s->npend++;
	p->src->npend++;
	pthread_mutex_unlock(&s->mu);
	wake_gate(s);
}

/* ---- the gate --------------------------------------------------------------- */

/* Read what has arrived of p's first packet without blocking. 1: all of it
 * is here; 0: wait for more; -1: closed or failed; -2: too large. */
static int gate_read(struct pend *p)
{
	for (;;) {
		uint32_t want = p->need ? p->need - p->got : 2 - p->got;
		ssize_t r = recv(p->fd, p->pkt + p->got, want, MSG_DONTWAIT);
		if (r < 0 && errno == EINTR)
			continue;
		if (r < 0)
			return errno == EAGAIN || errno == EWOULDBLOCK ? 0 : -1;
		if (r == 0)
			return -1;
		p->got += (uint32_t)r;
		if (!p->need && p->got == 2) {
			uint32_t len = (uint32_t)p->pkt[0] << 8 | p->pkt[1];
			if (len == 0 || len > AP_SETUP_MAX_NAME_PKT)
				return -2;
			p->need = 2 + len;
		}
		if (p->need && p->got == p->need)
			return 1;
	}
}

/* Under s->mu: close and free the dropped entries the gate owns. */
static void gate_reap(ap_setup *s)
{
	struct pend *p = s->head;
	while (p) {
		struct pend *next = p->next;
		if (p->dropped && p->st != P_RUN) {
			unlink_pend(s, p);
			if (p->fd >= 0)
				close(p->fd);
			pend_free(s, p);
		}
		p = next;
	}
}

/* Under s->mu: the running handshake of source x that has run longest, or
 * NULL. */
static struct pend *oldest_running_of(ap_setup *s, const struct src *x)
{
	struct pend *o = NULL;
	for (struct pend *p = s->head; p; p = p->next)
		if (p->st == P_RUN && !p->dropped && p->src == x && (!o || p->t_run < o->t_run))
			o = p;
	return o;
}

/* Under s->mu: the ready socket a free thread takes: of the sources below
 * their thread cap, the one running the fewest handshakes, then the one
 * holding the fewest pending, then the oldest of that source. Never by age
 * alone: a node's socket from an address of its own goes before the older
 * ones of addresses that hold many, however many addresses the flood
 * comes from. */
struct pend *take_ready(ap_setup *s)
{
	struct pend *best = NULL;
	for (struct pend *p = s->head; p; p = p->next) {
		if (p->st != P_READY || p->dropped || p->src->nrun >= s->run_cap)
			continue;
		if (!best || p->src->nrun < best->src->nrun ||
		    (p->src->nrun == best->src->nrun && p->src->npend < best->src->npend))
			best = p;
	}
	return best;
}

/* Under s->mu: drop running handshakes that have had their grace while
 * ready sockets wait that no free thread will take. The victim comes from
 * the source holding the most threads (its oldest handshake), and only if
 * that is more than the waiting socket's source holds (else from the
 * waiting socket's own source): a flood from one address recycles its own
 * threads, not a lone node's. Ready sockets whose source is at its thread
 * cap only recycle that source's threads. A
 * handshake already dropped frees its thread soon: it counts as free, so
 * one ready socket never costs two handshakes. Returns when to look again
 * (or INT64_MAX; a worker that leaves ready sockets behind wakes the gate). */
static int64_t gate_evict(ap_setup *s, int64_t now)
{
	while (s->nready) {
		int want = 0;
		struct pend *capped = NULL; /* the oldest ready one at its source's cap */
		for (struct pend *p = s->head; p; p = p->next) {
			if (p->st != P_READY || p->dropped)
				continue;
			if (p->src->nrun < s->run_cap)
				want++;
			else if (!capped)
				capped = p;
		}
		int freeing = s->nworkers - s->nrun + s->nevict;
		struct pend *victim = NULL;
		if (want > freeing) {
			/* For the one a thread would take next, from a source that
			 * holds more than its own; else one of its own source's. */
			struct pend *r = take_ready(s);
			int most = r->src->nrun;
			for (struct pend *p = s->head; p; p = p->next) {
				if (p->st != P_RUN || p->dropped)
					continue;
				int c = p->src->nrun;
				if (c > most || (c == most && victim && p->t_run < victim->t_run)) {
					victim = p;
					most = c;
				}
			}
			if (!victim)
				victim = oldest_running_of(s, r->src);
		} else if (!want && capped && !s->nevict) {
			victim = oldest_running_of(s, capped->src);
		}
		if (!victim)
			return INT64_MAX;
		if (now - victim->t_run < s->cfg.grace_ms)
			return victim->t_run + s->cfg.grace_ms;
		drop(s, victim, &s->st.evicted);
		/* Its source may be below the cap now: an idle thread may take
		 * one of its ready sockets without waiting for the victim's. */
		pthread_cond_signal(&s->ready_cv);
	}
	return INT64_MAX;
}

/* Outside s->mu: at most one line a second (force: now, at stop), only
 * when a handshake was refused or a connection closed before its name. */
static void gate_summary(ap_setup *s, int64_t now, int64_t *next, int force)
{
	pthread_mutex_lock(&s->mu);
	ap_setup_stats c = s->st, l = s->logged;
	int64_t since = force ? SUMMARY_MS : now - s->last_summary;
	int refused = c.timed_out != l.timed_out || c.capped != l.capped || c.too_large != l.too_large ||
		      c.evicted != l.evicted || c.failed != l.failed;
	/* Connections closed before their name (port scans, health checks)
	 * are worth a line too, so every connection is accounted for, but
	 * they are no warning. */
	int any = refused || c.closed != l.closed;
	if (any && since >= SUMMARY_MS) {
		s->logged = c;
		s->last_summary = now;
	}
	pthread_mutex_unlock(&s->mu);
	if (!any) {
		*next = INT64_MAX;
		return;
	}
	if (since < SUMMARY_MS) {
		*next = now + (SUMMARY_MS - since);
		return;
	}
	*next = INT64_MAX;
	ap_log(refused ? AP_LOG_WARNING : AP_LOG_NOTICE,
	       "incoming handshakes refused: %llu timed out, %llu dropped at the pending cap, %llu with an "
	       "oversized first packet, %llu stalled and evicted, %llu failed (wrong cookie or not a node); "
	       "%llu closed by the peer",
	       c.timed_out - l.timed_out, c.capped - l.capped, c.too_large - l.too_large, c.evicted - l.evicted,
	       c.failed - l.failed, c.closed - l.closed);
}

void *gate_main(void *arg)
{
	ap_setup *s = arg;
	struct pollfd *pfd = NULL;
	struct pend **pp = NULL;
	size_t cap = 0;
	int64_t next_summary = INT64_MAX;
	pthread_mutex_lock(&s->mu);
	while (!s->stop) {
		int64_t now = ap_mono_ms();
		int64_t due = gate_evict(s, now);
		if (next_summary < due)
			due = next_summary;
		size_t n = 1;
		for (struct pend *p = s->head; p; p = p->next) {
			if (p->dropped || p->st == P_RUN)
				continue;
			if (p->deadline <= now) {
				drop(s, p, &s->st.timed_out);
				continue;
			}
			if (p->deadline < due)
				due = p->deadline;
			if (p->st == P_GATE)
				n++;
		}
		gate_reap(s);
		if (n > cap) {
			size_t nc = n * 2;
			struct pollfd *npfd = realloc(pfd, nc * sizeof *pfd);
			if (npfd)
				pfd = npfd;
			struct pend **npp = realloc(pp, nc * sizeof *pp);
			if (npp)
				pp = npp;
			if (!npfd || !npp) {
				/* Keep going with what fits; the rest time out. */
				n = cap;
			} else {
				cap = nc;
			}
		}
		if (!pfd || !pp) {
			pthread_mutex_unlock(&s->mu);
			poll(NULL, 0, 100);
			pthread_mutex_lock(&s->mu);
			continue;
		}
		pfd[0] = (struct pollfd){ .fd = s->wake_fd, .events = POLLIN };
		size_t k = 1;
		for (struct pend *p = s->head; p && k < n; p = p->next)
			if (!p->dropped && p->st == P_GATE) {
				pfd[k] = (struct pollfd){ .fd = p->fd, .events = POLLIN };
				pp[k++] = p;
			}
		/* Only this thread frees P_GATE entries, so pp stays valid while
		 * the lock is down; one dropped meanwhile is skipped below. */
		pthread_mutex_unlock(&s->mu);
		int tmo = due == INT64_MAX ? -1 : due <= now ? 0 : (int)(due - now);
		int r = poll(pfd, k, tmo);
		now = ap_mono_ms();
		if (r > 0 && (pfd[0].revents & POLLIN)) {
			uint64_t v;
			ssize_t rr = read(s->wake_fd, &v, sizeof v);
			(void)rr;
		}
		if (now >= next_summary || next_summary == INT64_MAX)
			gate_summary(s, now, &next_summary, 0);
		pthread_mutex_lock(&s->mu);
		for (size_t i = 1; r > 0 && i < k; i++) {
			struct pend *p = pp[i];
			if (!pfd[i].revents || p->dropped)
				continue;
			int g = gate_read(p);
			if (g == 1) {
				p->st = P_READY;
				s->nready++;
				pthread_cond_signal(&s->ready_cv);
			} else if (g == -1) {
				drop(s, p, &s->st.closed);
			} else if (g == -2) {
				drop(s, p, &s->st.too_large);
			}
		}
	}
	pthread_mutex_unlock(&s->mu);
	gate_summary(s, ap_mono_ms(), &next_summary, 1);
	free(pfd);
	free(pp);
	return NULL;
}
