/* ap_io_uring: the io_uring backend of ap_io.
 *
 * Multishot accept on the listener, paused by ap_io when accepts fail for
 * want of fds; receives into a ring of provided buffers (built by hand:
 * liburing 2.3 has no io_uring_setup_buf_ring), recycled as soon as their
 * bytes are consumed. Receives are single-shot
 * and re-armed after each completion: under a flood of small messages the
 * re-arm is deferred by COALESCE_US, so one completion carries hundreds of
 * messages instead of one each (a multishot receive cannot be paused);
 * one send in flight per socket, its remainder resubmitted after a short
 * send; readers as one-shot polls re-armed after each wakeup; waits bounded
 * by the caller's next timer through the EXT_ARG timeout; futex waits
 * (IORING_OP_FUTEX_WAIT, 6.7+, probed at init) with a linked timeout, for
 * doorbells in shared memory.
 */
#include "ap_io_int.h"

#include <errno.h>
#include <liburing.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>

#include "ap_log.h"
#include "ap_ring_uring.h"

#define SQ_ENTRIES 256
#define CQ_ENTRIES 8192
#define BUF_COUNT 64          /* power of two */
#define BUF_SIZE (64 * 1024)
#define BGID 1
#define MAX_READERS 8

/* user_data: a pointer (8-byte aligned) or a reader id, tagged in the low bits. */
enum { TAG_ACCEPT = 1, TAG_RECV = 2, TAG_SEND = 3, TAG_POLL = 4, TAG_CANCEL = 5, TAG_FUTEX = 6, TAG_FTMO = 7 };
#define UD(p, tag) ((uint64_t)(uintptr_t)(p) | (tag))
#define UD_TAG(u) ((int)((u) & 7))
#define UD_PTR(u) ((void *)(uintptr_t)((u) & ~(uint64_t)7))

struct uring_be {
	struct io_uring ring;
	struct io_uring_buf_ring *br;
	size_t br_bytes;
	uint8_t *bufs;
	int lfd;
	int accepting;            /* a multishot accept is armed */
	int readers[MAX_READERS]; /* fd by id, -1 when unused */
	ap_io_conn *rearm;        /* receives to arm after the coalescing pause */
	int futex_ok;             /* IORING_OP_FUTEX_WAIT and _WAKE are supported */
	int taskrun_flag;         /* the kernel flags pending completions (TASKRUN_FLAG) */
};


static struct io_uring_sqe *get_sqe(struct uring_be *be)
{
	struct io_uring_sqe *sqe = io_uring_get_sqe(&be->ring);
	if (!sqe) {
		/* The SQ is full: push it to the kernel and take a fresh slot. */
		io_uring_submit(&be->ring);
		sqe = io_uring_get_sqe(&be->ring);
	}
	return sqe;
}

static int u_init(ap_loop *l)
{
	struct uring_be *be = calloc(1, sizeof *be);
	if (!be)
		return -ENOMEM;
	/* COOP_TASKRUN (5.19): completions wait for our next enter instead of
	 * interrupting the loop thread (and its coalescing pause).
	 * TASKRUN_FLAG (same kernel) says in the ring when they wait, so a
	 * busy loop's look for new completions costs no enter when none do
	 * (u_wait): an enter is a few microseconds here, paid per look. */
	struct io_uring_params p = { .flags = IORING_SETUP_CQSIZE | IORING_SETUP_COOP_TASKRUN | IORING_SETUP_TASKRUN_FLAG,
				     .cq_entries = CQ_ENTRIES };
	int r = io_uring_queue_init_params(SQ_ENTRIES, &be->ring, &p);
	be->taskrun_flag = r == 0;
	if (r == -EINVAL) {
		p = (struct io_uring_params){ .flags = IORING_SETUP_CQSIZE | IORING_SETUP_COOP_TASKRUN,
					      .cq_entries = CQ_ENTRIES };
		r = io_uring_queue_init_params(SQ_ENTRIES, &be->ring, &p);
	}
	if (r == -EINVAL) {
		p = (struct io_uring_params){ .flags = IORING_SETUP_CQSIZE, .cq_entries = CQ_ENTRIES };
		r = io_uring_queue_init_params(SQ_ENTRIES, &be->ring, &p);
	}
	if (r < 0) {
		free(be);
		return r;
	}
	struct io_uring_probe *probe = io_uring_get_probe_ring(&be->ring);
	int ok = probe && io_uring_opcode_supported(probe, IORING_OP_RECV) &&
		 io_uring_opcode_supported(probe, IORING_OP_SEND) &&
		 io_uring_opcode_supported(probe, IORING_OP_ACCEPT) &&
		 io_uring_opcode_supported(probe, IORING_OP_POLL_ADD) &&
		 (p.features & IORING_FEAT_EXT_ARG);
	if (probe)
		io_uring_free_probe(probe);
	if (!ok) {
		io_uring_queue_exit(&be->ring);
		free(be);
		return -ENOTSUP;
	}

	/* Provided-buffer ring: page-aligned entries, registered, then filled. */
	be->br_bytes = BUF_COUNT * sizeof(struct io_uring_buf);
	be->br = mmap(NULL, be->br_bytes, PROT_READ | PROT_WRITE, MAP_ANONYMOUS | MAP_PRIVATE, -1, 0);
	be->bufs = malloc((size_t)BUF_COUNT * BUF_SIZE);
	if (be->br == MAP_FAILED || !be->bufs) {
		r = -ENOMEM;
		goto err;
	}
	struct io_uring_buf_reg reg = { .ring_addr = (unsigned long)be->br, .ring_entries = BUF_COUNT, .bgid = BGID };
	r = io_uring_register_buf_ring(&be->ring, &reg, 0);
	if (r) {
		/* Before 5.19: no buffer rings, and no multishot receive either. */
		goto err;
	}
	io_uring_buf_ring_init(be->br);
	for (int i = 0; i < BUF_COUNT; i++)
		io_uring_buf_ring_add(be->br, be->bufs + (size_t)i * BUF_SIZE, BUF_SIZE, (unsigned short)i,
				      io_uring_buf_ring_mask(BUF_COUNT), i);
	io_uring_buf_ring_advance(be->br, BUF_COUNT);
	be->lfd = -1;
	be->futex_ok = ap_ring_uring_futex_supported(&be->ring);
	for (int i = 0; i < MAX_READERS; i++)
		be->readers[i] = -1;
	l->be = be;
	return 0;
err:
	if (be->br != MAP_FAILED && be->br)
		munmap(be->br, be->br_bytes);
	free(be->bufs);
	io_uring_queue_exit(&be->ring);
	free(be);
	return r;
}

static void u_fini(ap_loop *l)
{
	struct uring_be *be = l->be;
	io_uring_unregister_buf_ring(&be->ring, BGID);
	io_uring_queue_exit(&be->ring);
	munmap(be->br, be->br_bytes);
	free(be->bufs);
	free(be);
}

static void arm_accept(struct uring_be *be)
{
	struct io_uring_sqe *sqe = get_sqe(be);
	io_uring_prep_multishot_accept(sqe, be->lfd, NULL, NULL, SOCK_CLOEXEC);
	io_uring_sqe_set_data64(sqe, UD(NULL, TAG_ACCEPT));
	be->accepting = 1;
}

/* A failed accept ends the multishot one (no F_MORE), so pausing is not
 * re-arming it; should one still be pending, cancel it. */
static void u_accept_pause(ap_loop *l)
{
	struct uring_be *be = l->be;
	if (!be->accepting)
		return;
	struct io_uring_sqe *sqe = get_sqe(be);
	io_uring_prep_cancel64(sqe, UD(NULL, TAG_ACCEPT), 0);
	io_uring_sqe_set_data64(sqe, UD(NULL, TAG_CANCEL));
}

static void u_accept_resume(ap_loop *l)
{
	struct uring_be *be = l->be;
	if (be->lfd >= 0 && !be->accepting)
		arm_accept(be);
}

static int u_listen(ap_loop *l, int lfd)
{
	struct uring_be *be = l->be;
	be->lfd = lfd;
	arm_accept(be);
	return 0;
}

static void arm_recv(struct uring_be *be, ap_io_conn *c)
{
	struct io_uring_sqe *sqe = get_sqe(be);
	io_uring_prep_recv(sqe, c->fd, NULL, BUF_SIZE, 0);
	sqe->flags |= IOSQE_BUFFER_SELECT;
	sqe->buf_group = BGID;
	io_uring_sqe_set_data64(sqe, UD(c, TAG_RECV));
	c->refs++;
}

static int u_add_conn(ap_loop *l, ap_io_conn *c)
{
	arm_recv(l->be, c);
	return 0;
}

static void u_start_send(ap_loop *l, ap_io_conn *c)
{
	struct uring_be *be = l->be;
	struct io_uring_sqe *sqe = get_sqe(be);
	io_uring_prep_send(sqe, c->fd, c->inflight.data + c->inflight_off, c->inflight.len - c->inflight_off,
			   MSG_NOSIGNAL);
	io_uring_sqe_set_data64(sqe, UD(c, TAG_SEND));
	c->refs++;
}

static void u_close(ap_loop *l, ap_io_conn *c)
{
	struct uring_be *be = l->be;
	if (c->refs == 0) {
		ap_io_finished(l, c);
		return;
	}
	/* shutdown() already woke the receive; cancel covers anything else. */
	struct io_uring_sqe *sqe = get_sqe(be);
	io_uring_prep_cancel_fd(sqe, c->fd, IORING_ASYNC_CANCEL_ALL);
	io_uring_sqe_set_data64(sqe, UD(NULL, TAG_CANCEL));
}

static void arm_poll(struct uring_be *be, int id)
{
	struct io_uring_sqe *sqe = get_sqe(be);
	io_uring_prep_poll_add(sqe, be->readers[id], POLLIN);
	io_uring_sqe_set_data64(sqe, ((uint64_t)id << 3) | TAG_POLL);
}

static int u_add_reader(ap_loop *l, int fd, int id)
{
	struct uring_be *be = l->be;
	if (id < 0 || id >= MAX_READERS)
		return -EINVAL;
	be->readers[id] = fd;
	arm_poll(be, id);
	return 0;
}

static int u_futex_supported(const ap_loop *l)
{
	const struct uring_be *be = l->be;
	return be->futex_ok;
}

/* The wait and its timeout go in one submit (the next enter): the timeout
 * SQE must directly follow the wait, so both slots are taken first. */
static int u_futex_wait(ap_loop *l, ap_io_futex *f, uint32_t *word, uint32_t expected, int timeout_ms)
{
	struct uring_be *be = l->be;
	if (io_uring_sq_space_left(&be->ring) < 2)
		io_uring_submit(&be->ring);
	struct io_uring_sqe *w = io_uring_get_sqe(&be->ring);
	struct io_uring_sqe *t = w ? io_uring_get_sqe(&be->ring) : NULL;
	if (!w || !t)
		return -EBUSY; /* not after the submit above: it freed the SQ */
	f->ts.tv_sec = timeout_ms / 1000;
	f->ts.tv_nsec = (long long)(timeout_ms % 1000) * 1000000LL;
	ap_ring_uring_prep_futex_wait(w, word, expected, UD(f, TAG_FUTEX));
	ap_ring_uring_link_timeout(w, t, &f->ts, UD(NULL, TAG_FTMO));
	return 0;
}

static void u_futex_cancel(ap_loop *l, ap_io_futex *f)
{
	struct uring_be *be = l->be;
	struct io_uring_sqe *sqe = get_sqe(be);
	io_uring_prep_cancel64(sqe, UD(f, TAG_FUTEX), 0);
	io_uring_sqe_set_data64(sqe, UD(NULL, TAG_CANCEL));
}

static void put_ref(ap_loop *l, ap_io_conn *c)
{
	if (--c->refs == 0 && c->closing)
		ap_io_finished(l, c);
}

static void on_cqe(ap_loop *l, struct uring_be *be, struct io_uring_cqe *cqe)
{
	uint64_t ud = io_uring_cqe_get_data64(cqe);
	int more = cqe->flags & IORING_CQE_F_MORE;
	ap_io_conn *c = UD_PTR(ud);

	switch (UD_TAG(ud)) {
	case TAG_ACCEPT:
		if (!more)
			be->accepting = 0;
		if (cqe->res >= 0)
			ap_io_accepted(l, cqe->res);
		else if (cqe->res == -ECANCELED && l->accept_paused)
			break;
		else if (cqe->res == -ECANCELED)
			; /* the pause that cancelled it is over already */
		else if (ap_io_accept_error(l, -cqe->res, !more))
			break; /* paused: the loop re-arms it when the pause ends */
		if (!more && be->lfd >= 0)
			arm_accept(be);
		break;
	case TAG_RECV:
		if (cqe->flags & IORING_CQE_F_BUFFER) {
			unsigned bid = cqe->flags >> IORING_CQE_BUFFER_SHIFT;
			uint8_t *b = be->bufs + (size_t)bid * BUF_SIZE;
			if (cqe->res > 0)
				ap_io_data(l, c, b, (size_t)cqe->res);
			/* The frame codec copied any partial frame: recycle now. */
			io_uring_buf_ring_add(be->br, b, BUF_SIZE, (unsigned short)bid, io_uring_buf_ring_mask(BUF_COUNT), 0);
			io_uring_buf_ring_advance(be->br, 1);
		}
		if (!more) {
			if (cqe->res == 0)
				ap_loop_close(l, c, 0);                /* peer closed */
			else if (cqe->res < 0 && cqe->res != -ENOBUFS)
				ap_loop_close(l, c, -cqe->res);
			if (!c->closing && l->coalesce && cqe->res > 0) {
				c->refs++; /* the deferred receive holds its ref already */
				c->rearm_pending = 1;
				c->next_rearm = be->rearm;
				be->rearm = c;
			} else if (!c->closing) {
				arm_recv(be, c);
			}
			put_ref(l, c);
		}
		break;
	case TAG_SEND:
		ap_io_sent(l, c, cqe->res);
		put_ref(l, c);
		break;
	case TAG_FUTEX: {
		ap_io_futex *f = UD_PTR(ud);
		f->done(f, cqe->res);
		break;
	}
	case TAG_POLL: {
		int id = (int)(ud >> 3);
		if (cqe->res >= 0 || cqe->res == -EINTR)
			l->cbs.on_readable(l->arg, id);
		if (be->readers[id] >= 0)
			arm_poll(be, id);
		break;
	}
	default:
		break;
	}
}

static int u_wait(ap_loop *l, int timeout_ms)
{
	struct uring_be *be = l->be;
	struct io_uring_cqe *cqe;
	int r;
	if (ap_io_coalesce_check(l) && timeout_ms != 0) {
		/* Let a flood accumulate: with COOP_TASKRUN the kernel queues
		 * completions without interrupting us, and one enter reaps them. */
		io_uring_submit(&be->ring);
		ap_io_pause();
	}
	while (be->rearm) {
		ap_io_conn *c = be->rearm;
		be->rearm = c->next_rearm;
		c->rearm_pending = 0;
		if (c->closing) {
			put_ref(l, c);
		} else {
			arm_recv(be, c);
			c->refs--; /* arm_recv took its own */
		}
	}
	if (timeout_ms == 0 && be->taskrun_flag && io_uring_sq_ready(&be->ring) == 0 &&
	    !(IO_URING_READ_ONCE(*be->ring.sq.kflags) & (IORING_SQ_TASKRUN | IORING_SQ_CQ_OVERFLOW))) {
		r = 0; /* a look only: nothing to submit, no completion waits for an enter */
	} else if (timeout_ms < 0) {
		r = io_uring_submit_and_wait(&be->ring, 1);
	} else {
		struct __kernel_timespec ts = { .tv_sec = timeout_ms / 1000, .tv_nsec = (timeout_ms % 1000) * 1000000L };
		r = io_uring_submit_and_wait_timeout(&be->ring, &cqe, 1, &ts, NULL);
	}
	if (r < 0 && r != -ETIME && r != -EINTR && r != -EBUSY)
		return r;
	/* Take completions in batches; callbacks may queue new SQEs, which go
	 * in with the next submit. */
	for (;;) {
		unsigned head, n = 0;
		io_uring_for_each_cqe(&be->ring, head, cqe) {
			on_cqe(l, be, cqe);
			n++;
		}
		if (n == 0)
			break;
		io_uring_cq_advance(&be->ring, n);
	}
	return 0;
}

const struct ap_io_ops ap_io_uring_ops = {
	.name = "uring",
	.init = u_init,
	.fini = u_fini,
	.listen = u_listen,
	.add_conn = u_add_conn,
	.start_send = u_start_send,
	.close = u_close,
	.add_reader = u_add_reader,
	.wait = u_wait,
	.accept_pause = u_accept_pause,
	.accept_resume = u_accept_resume,
	.futex_supported = u_futex_supported,
	.futex_wait = u_futex_wait,
	.futex_cancel = u_futex_cancel,
};
