"""Checksums of persistent objects: CRC32C (hardware-accelerated, ~15 GB/s on the
reference machine, GIL released) of every 1 MiB block of the object, kept in its index
row and committed with it.

Every read of a persistent object is checked block by block before the caller sees it:
blocks the read covers whole are checked in place; for a block it covers only in part,
the block's bytes outside the read are read into a scratch buffer (only those: the
part already read is not read again, which for a weight fetch out of an optimizer state
object, one partial block at each end, was up to 2 MiB more per fetch) and the CRC is
computed over the head, the bytes read and the tail in turn. A
mismatch (a flipped bit on the SSD, a misdirected write) is reported as DATA_LOSS naming
the object, the block and the device - never handed to a client or the optimizer.
Transient objects (short-lived, rewritten constantly) carry none.
"""
from __future__ import annotations

import array
import mmap

from crc32c import crc32c

from fuyoud.errors import ChecksumMismatch

BLOCK = 1 << 20


def block_checksums(data: memoryview) -> bytes:
    """CRC32C of each BLOCK of ``data`` (the last one may be short), packed uint32."""
    return array.array("I", (crc32c(data[i:i + BLOCK]) for i in range(0, len(data), BLOCK))).tobytes()


def block_range(start: int, end: int, size: int) -> tuple[int, int]:
    """Indices [first, last) of the blocks overlapping bytes [start, end)."""
    return start // BLOCK, -(-min(end, size) // BLOCK)


def block_span(index: int, size: int) -> tuple[int, int]:
    """Bytes [start, end) of block ``index`` of an object of ``size`` bytes."""
    return index * BLOCK, min((index + 1) * BLOCK, size)


def expected(sums: bytes, index: int) -> int:
    return array.array("I", sums[index * 4:index * 4 + 4])[0]


def matches(sums: bytes, index: int, data: memoryview) -> bool:
    return crc32c(data) == expected(sums, index)


def verify(meta, start: int, dst: memoryview, read_raw, where) -> Exception | None:
    """Check the bytes of ``meta``'s object just read into ``dst`` (from object offset
    ``start``); for blocks ``dst`` covers only in part, the rest of the block (its head
    before ``start``, its tail after the end of ``dst``) is read with ``read_raw(meta,
    offset, buffer) -> error | None`` and checked with the bytes in ``dst``. Returns the
    error to report, or None. ``where(meta, offset)`` names the device of an offset."""
    end = start + len(dst)
    first, last = block_range(start, end, meta.size)
    scratch = None
    try:
        for k in range(first, last):
            lo, hi = block_span(k, meta.size)
            a, b = max(start, lo), min(end, hi)  # the block's bytes that dst holds
            if a == lo and b == hi:
                ok = matches(meta.checksums, k, dst[a - start:b - start])
            else:
                if scratch is None:
                    scratch = mmap.mmap(-1, BLOCK)  # page-aligned: O_DIRECT reads land in place
                with memoryview(scratch) as block:  # the block at its own offsets: same alignment
                    for x, y in ((lo, a), (b, hi)):
                        if x < y:
                            exc = read_raw(meta, x, block[x - lo:y - lo])
                            if exc is not None:
                                return exc
                    crc = crc32c(block[:a - lo])
                    crc = crc32c(dst[a - start:b - start], crc)
                    ok = crc32c(block[b - lo:hi - lo], crc) == expected(meta.checksums, k)
            if not ok:
                return ChecksumMismatch(
                    f"checksum mismatch in object {meta.namespace}/{meta.name}, bytes [{lo}, {hi}) on "
                    f"{where(meta, lo)}: the SSD returned data other than what was written; the object's "
                    "bytes were not used (restore it from a checkpoint)")
        return None
    finally:
        if scratch is not None:
            scratch.close()
