/* fy_uring.h - a small batch runner over liburing for Fuyou's io_uring engine.
 *
 * A ring belongs to one thread at a time. fy_ring_run() takes a batch of positioned
 * reads and writes, keeps up to `depth` of them in flight, continues short transfers
 * and reports per request how many bytes moved and which errno (if any) stopped it.
 */
#ifndef FY_URING_H
#define FY_URING_H

#include <stddef.h>
#include <stdint.h>

/* native/build_uring.py feeds the text between the cdef markers to cffi verbatim:
 * keep it to plain declarations and integer #defines. */
/* cdef-begin */
#define FY_OP_READ 0
#define FY_OP_WRITE 1

struct fy_req {
    int32_t fd;
    int32_t op;      /* FY_OP_READ or FY_OP_WRITE */
    int64_t offset;  /* file offset; negative is rejected with EINVAL */
    void *buf;
    uint64_t len;
    int64_t done;    /* out: bytes transferred */
    int32_t err;     /* out: 0, or the errno that stopped the request */
};

struct fy_ring;

/* Opens a ring with `entries` submission slots (rounded up to a power of two by the
 * kernel). Returns NULL and sets *err_out to the errno on failure. */
struct fy_ring *fy_ring_open(unsigned entries, int *err_out);

/* Closes the ring. Never call it while fy_ring_run() runs on the ring. */
void fy_ring_close(struct fy_ring *ring);

/* Runs every request and fills in `done` and `err`. Keeps at most `depth` requests in
 * flight (clamped to [1, ring entries]). A short transfer is continued with the
 * remainder; a transfer of 0 bytes (end of file on a read) stops the request short with
 * err 0; a failed transfer stops it with err = errno.
 *
 * Returns 0, or -errno when the ring itself failed. In that case every request that did
 * not finish gets that errno, all operations the kernel accepted have been waited for,
 * and the ring is dead: later calls fail at once with the same errno, so close it. */
int fy_ring_run(struct fy_ring *ring, struct fy_req *reqs, size_t n, unsigned depth);
/* cdef-end */

#endif /* FY_URING_H */
