/* fy_uring.c - see fy_uring.h. */
#include "fy_uring.h"

#include <errno.h>
#include <liburing.h>
#include <stdlib.h>

/* Per-SQE length cap: the kernel moves at most ~2 GiB per read/write anyway, and a
 * power of two keeps the remainder of an O_DIRECT transfer aligned. */
#define FY_MAX_CHUNK (1u << 30)

/* `err` of a request that has not finished yet (errnos are positive). */
#define FY_PENDING (-1)

struct fy_ring {
    struct io_uring ring;
    int dead; /* 0, or the errno that made the ring unusable */
};

struct fy_ring *fy_ring_open(unsigned entries, int *err_out)
{
    struct fy_ring *r = calloc(1, sizeof(*r));
    if (!r) {
        *err_out = ENOMEM;
        return NULL;
    }
    int ret = io_uring_queue_init(entries, &r->ring, 0);
    if (ret < 0) {
        free(r);
        *err_out = -ret;
        return NULL;
    }
    *err_out = 0;
    return r;
}

void fy_ring_close(struct fy_ring *r)
{
    if (!r)
        return;
    io_uring_queue_exit(&r->ring);
    free(r);
}

/* Queues the rest of request i. An SQE is always free here: every request in flight
 * holds at most one SQE and depth <= SQ entries. */
static void queue(struct io_uring *ring, struct fy_req *reqs, size_t i)
{
    struct fy_req *q = &reqs[i];
    struct io_uring_sqe *sqe = io_uring_get_sqe(ring);
    uint64_t left = q->len - (uint64_t)q->done;
    unsigned len = left > FY_MAX_CHUNK ? FY_MAX_CHUNK : (unsigned)left;
    char *buf = (char *)q->buf + q->done;
    uint64_t off = (uint64_t)q->offset + (uint64_t)q->done;

    if (q->op == FY_OP_READ)
        io_uring_prep_read(sqe, q->fd, buf, len, off);
    else
        io_uring_prep_write(sqe, q->fd, buf, len, off);
    io_uring_sqe_set_data64(sqe, i);
}

/* Consumes every available completion. With `requeue`, a request that needs more
 * transfers is queued again; without (draining a dead ring), it stays FY_PENDING.
 * Returns how many requests left flight. */
static unsigned reap(struct io_uring *ring, struct fy_req *reqs, int requeue)
{
    struct io_uring_cqe *cqe;
    unsigned head, seen = 0, left_flight = 0;

    io_uring_for_each_cqe(ring, head, cqe) {
        size_t i = (size_t)io_uring_cqe_get_data64(cqe);
        struct fy_req *q = &reqs[i];
        int res = cqe->res;

        seen++;
        if (res > 0)
            q->done += res;
        if (res == -EINTR || (res > 0 && (uint64_t)q->done < q->len)) {
            if (requeue) {
                queue(ring, reqs, i);
                continue;
            }
        } else {
            /* Complete, failed, or no progress (EOF on a read): it stops here. A write
             * that moves 0 bytes also stops short rather than spin. */
            q->err = res < 0 ? -res : 0;
        }
        left_flight++;
    }
    io_uring_cq_advance(ring, seen);
    return left_flight;
}

int fy_ring_run(struct fy_ring *r, struct fy_req *reqs, size_t n, unsigned depth)
{
    struct io_uring *ring = &r->ring;
    size_t next = 0;       /* first request not started yet */
    unsigned inflight = 0; /* requests with a queued SQE or an operation in the kernel */
    int fatal = 0;

    for (size_t i = 0; i < n; i++) {
        reqs[i].done = 0;
        reqs[i].err = r->dead ? r->dead : FY_PENDING;
    }
    if (r->dead)
        return -r->dead;

    if (depth < 1)
        depth = 1;
    if (depth > ring->sq.ring_entries)
        depth = ring->sq.ring_entries; /* also keeps the CQ (2x entries) from overflowing */

    while (next < n || inflight > 0) {
        for (; next < n && inflight < depth; next++) {
            struct fy_req *q = &reqs[next];
            if ((q->op != FY_OP_READ && q->op != FY_OP_WRITE) || q->offset < 0) {
                q->err = EINVAL;
            } else if (q->len == 0) {
                q->err = 0;
            } else {
                queue(ring, reqs, next);
                inflight++;
            }
        }
        if (inflight == 0)
            break;

        /* One syscall submits everything queued and waits for a completion. SQEs the
         * kernel did not take stay in the ring and go out with the next call. */
        int ret = io_uring_submit_and_wait(ring, 1);
        if (ret < 0 && ret != -EINTR && ret != -EAGAIN && ret != -EBUSY) {
            fatal = -ret;
            break;
        }
        inflight -= reap(ring, reqs, 1);
    }
    if (!fatal)
        return 0;

    /* The ring failed. SQEs the kernel never took will never run (a dead ring is not
     * submitted to again); operations it took may still write into the caller's
     * buffers, so wait for every one of them before returning. */
    r->dead = fatal;
    inflight -= io_uring_sq_ready(ring);
    while (inflight > 0) {
        struct io_uring_cqe *cqe;
        int ret = io_uring_wait_cqe(ring, &cqe);
        if (ret == -EINTR || ret == -EAGAIN)
            continue;
        if (ret < 0)
            break; /* cannot even wait on it: nothing more can be done */
        inflight -= reap(ring, reqs, 0);
    }
    for (size_t i = 0; i < n; i++)
        if (reqs[i].err == FY_PENDING)
            reqs[i].err = fatal;
    return -fatal;
}
