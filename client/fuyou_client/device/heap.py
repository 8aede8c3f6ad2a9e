"""Giving the training process's freed heap memory back to the system.

Training on the CPU allocates a block's activations and temporaries (megabytes each)
with malloc; glibc keeps freed chunks for reuse, and chunks still in use (the inputs a
recomputed block keeps for backward) pin the ones freed around them, so the heap of a
forward over N blocks grows with N although only the kept inputs are live: measured on
a GPT-2 of width 2048 with recomputation, about 20 MB retained per block (250 MB at 16
blocks, 0.8 GB at 41), against 1 MB kept. ``malloc_trim`` returns free pages anywhere in
the heap; the engine asks for it after each block when glibc holds more than ``SLACK``
free, which costs well under a millisecond then and nothing otherwise. Elsewhere than
glibc this does nothing.
"""
from __future__ import annotations

import ctypes
import ctypes.util

SLACK = 64 << 20  # free heap bytes glibc may keep before a trim


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def _libc():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallinfo2.restype = _Mallinfo2
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
        return libc
    except (OSError, AttributeError):  # not glibc (or older than 2.33, without mallinfo2)
        return None


_LIBC = _libc()


def free_bytes() -> int:
    """Bytes glibc's main heap holds free (0 where unknown)."""
    return _LIBC.mallinfo2().fordblks if _LIBC is not None else 0


def trim(slack: int = SLACK) -> bool:
    """Return free heap pages to the system if more than ``slack`` bytes are free;
    whether it trimmed."""
    if _LIBC is None or _LIBC.mallinfo2().fordblks <= slack:
        return False
    _LIBC.malloc_trim(0)
    return True
