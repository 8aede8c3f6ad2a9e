"""The shared-memory pool: budgets, handle validation, segments given back."""
import os

import pytest

from fuyoud.errors import InvalidArgument, OutOfMemoryBudget
from fuyoud.memory.pool import BufferRef, Pool

MiB = 1 << 20


@pytest.fixture
def pool():
    return Pool(budget=64 * MiB, session_budget=32 * MiB, segment_size=8 * MiB, lock=False)


def test_buffers_are_page_aligned_views_of_a_shared_memfd(pool):
    ref, seg = pool.allocate(1, 5000)
    assert seg is not None and ref.length == 8192 and ref.offset % 4096 == 0
    pool.view(1, ref, 0, 5000)[:5] = b"hello"
    # The client maps the same fd: it sees the daemon's bytes.
    import mmap

    m = mmap.mmap(seg.fd, seg.size, flags=mmap.MAP_SHARED)
    assert m[ref.offset:ref.offset + 5] == b"hello"
    m.close()
    ref2, seg2 = pool.allocate(1, 4096)
    assert seg2 is None and ref2.segment == ref.segment  # fits in the same segment


def test_session_and_daemon_budgets(pool):
    pool.allocate(1, 30 * MiB)
    with pytest.raises(OutOfMemoryBudget, match="session pinned-memory budget"):
        pool.allocate(1, 8 * MiB)
    pool.allocate(2, 30 * MiB)
    with pytest.raises(OutOfMemoryBudget, match="daemon pinned-memory budget"):
        pool.allocate(3, 8 * MiB)
    assert pool.release_session(1) == 30 * MiB
    pool.allocate(3, 8 * MiB)


def test_stale_foreign_and_forged_handles_are_refused(pool):
    ref, _ = pool.allocate(1, 4096)
    keep, _ = pool.allocate(1, 4096)  # keeps the segment alive
    with pytest.raises(InvalidArgument, match="not one of this session's"):
        pool.view(2, ref, 0, 10)
    with pytest.raises(InvalidArgument, match="outside the buffer"):
        pool.view(1, ref, 4000, 200)
    with pytest.raises(InvalidArgument, match="outside the buffer"):
        pool.view(1, ref, 1 << 62, 1)
    pool.free(1, ref)
    again, _ = pool.allocate(1, 4096)
    assert (again.segment, again.offset) == (ref.segment, ref.offset) and again.generation != ref.generation
    with pytest.raises(InvalidArgument, match="stale"):
        pool.view(1, ref, 0, 10)
    with pytest.raises(InvalidArgument, match="stale"):
        pool.free(1, ref)
    with pytest.raises(InvalidArgument):
        pool.view(1, BufferRef(keep.segment, keep.offset, keep.length * 2, keep.generation), 0, 10)
    with pytest.raises(InvalidArgument):
        pool.allocate(1, 0)


def test_empty_segments_are_given_back(pool):
    ref, seg = pool.allocate(1, 4096)
    pool.free(1, ref)
    assert pool.usage().segments == 0
    with pytest.raises(OSError):
        os.fstat(seg.fd)  # closed


def test_a_refused_mlock_is_an_error_with_lock_yes_and_a_warning_once_with_auto(monkeypatch, caplog):
    """[memory] lock = "yes" means locked or nothing: a refusal (RLIMIT_MEMLOCK) is refused
    with the limit to raise; "auto" carries on unlocked and says so once, at warning."""
    import errno
    import logging

    from fuyoud.errors import FailedPrecondition
    from fuyoud.memory import segment

    monkeypatch.setattr(segment, "mlock", lambda m: errno.ENOMEM)  # (as with a low memlock limit)
    monkeypatch.setattr(segment, "_warned", False)
    strict = Pool(budget=64 * MiB, session_budget=32 * MiB, segment_size=8 * MiB, lock="yes")
    with pytest.raises(FailedPrecondition, match=r'lock = "yes" and mlock of a 8388608-byte segment was refused.*'
                                                 r"LimitMEMLOCK="):
        strict.allocate(1, 5000)
    relaxed = Pool(budget=64 * MiB, session_budget=32 * MiB, segment_size=8 * MiB, lock="auto")
    with caplog.at_level(logging.WARNING, logger="fuyoud.memory.segment"):
        for session in (1, 2):
            _, seg = relaxed.allocate(session, 5000)
            assert seg is not None and not seg.locked
    assert [r.levelno for r in caplog.records].count(logging.WARNING) == 1
    assert "stay unlocked" in caplog.text
