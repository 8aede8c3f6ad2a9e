"""The shared-memory pool: budgets, reservations, handle validation, segments given back,
no lock held while a segment is made."""
import os
import threading

import pytest

from fuyoud.errors import InvalidArgument, OutOfMemoryBudget, Unauthenticated
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
    with pytest.raises(OutOfMemoryBudget, match="no room in fuyoud's pinned-memory budget"):
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


def test_a_reservation_is_held_against_the_other_sessions_and_a_refusal_names_them():
    """A plan admitted is a plan held: session 1 reserved 32 MiB and holds 8; session 2 may
    take only what is left, and session 1 then gets all it reserved (it used to be refused:
    the others were admitted against what it had allocated, not what it planned)."""
    pool = Pool(budget=64 * MiB, session_budget=48 * MiB, segment_size=8 * MiB, lock=False,
                describe=lambda holder, asker: f"session {holder} (namespace job{holder})")
    pool.allocate(1, 8 * MiB)
    pool.reserve(1, 32 * MiB)
    pool.allocate(2, 16 * MiB)
    pool.allocate(2, 16 * MiB)
    with pytest.raises(OutOfMemoryBudget, match=r"other sessions hold 32\.0 MiB \(session 1 \(namespace job1\) "
                                                r"32\.0 MiB \(32\.0 MiB reserved by its plan\)\), 0 B is free"):
        pool.allocate(2, 8 * MiB)
    for _ in range(3):
        pool.allocate(1, 8 * MiB)  # (all it reserved)
    usage = pool.usage()
    assert usage.segments == 64 * MiB and usage.reserved == 0 and usage.reserved_by_session == {1: 32 * MiB}
    with pytest.raises(OutOfMemoryBudget, match=r"to allocate 8\.0 MiB beyond the 32\.0 MiB its plan reserved"):
        pool.allocate(1, 8 * MiB)
    with pytest.raises(OutOfMemoryBudget, match=r"to reserve 16\.0 MiB.*session 1 \(namespace job1\) 32\.0 MiB.*"
                                                r"session 2 \(namespace job2\) 32\.0 MiB"):
        pool.reserve(3, 16 * MiB)
    with pytest.raises(OutOfMemoryBudget, match="exceeds the session pinned-memory budget"):
        pool.reserve(3, 56 * MiB)
    pool.release_session(1)  # (its reservation goes with it)
    assert pool.reserve(3, 32 * MiB) == 32 * MiB and pool.usage().reserved == 32 * MiB
    pool.reserve(3, 0)
    assert pool.usage().reserved_by_session == {}


def test_no_lock_is_held_while_a_segment_is_made():
    """Making a segment pre-faults and mlocks it (seconds for GBs): meanwhile every other
    session's buffer lookups, allocations in its segments, frees and usage() (Status) go
    on (they all waited for the pool's one lock)."""
    from fuyoud.memory.segment import Segment

    slow, made = threading.Event(), threading.Event()

    def factory(segment_id, size, session_id, lock, pages):
        if session_id == 2:
            made.set()
            assert slow.wait(60)
        return Segment(segment_id, size, session_id, lock, pages)

    pool = Pool(budget=64 * MiB, session_budget=32 * MiB, segment_size=8 * MiB, lock=False, segment_factory=factory)
    ref, _ = pool.allocate(1, 4096)
    big = threading.Thread(target=pool.allocate, args=(2, 16 * MiB))
    big.start()
    try:
        assert made.wait(30)
        done = threading.Event()

        def others():
            pool.view(1, ref, 0, 10)
            more, seg = pool.allocate(1, 4096)
            assert seg is None
            pool.free(1, more)
            assert pool.usage().segments == 8 * MiB + 16 * MiB  # (the one being made counts)
            done.set()

        threading.Thread(target=others, daemon=True).start()
        assert done.wait(30), "session 1 waited for session 2's segment to be made"
    finally:
        slow.set()
        big.join(30)
    assert pool.usage().by_session == {1: 8 * MiB, 2: 16 * MiB}


def test_a_session_released_while_its_segment_is_made_leaves_nothing():
    from fuyoud.errors import Unauthenticated
    from fuyoud.memory.segment import Segment

    slow, made, closed = threading.Event(), threading.Event(), []

    class Watched(Segment):
        def close(self):
            closed.append(self.id)
            super().close()

    def factory(segment_id, size, session_id, lock, pages):
        made.set()
        assert slow.wait(60)
        return Watched(segment_id, size, session_id, lock, pages)

    pool = Pool(budget=64 * MiB, session_budget=32 * MiB, segment_size=8 * MiB, lock=False, segment_factory=factory)
    errors = []

    def allocate():
        try:
            pool.allocate(1, 4096)
        except Unauthenticated as exc:
            errors.append(exc)

    t = threading.Thread(target=allocate)
    t.start()
    assert made.wait(30)
    pool.release_session(1)
    slow.set()
    t.join(30)
    assert errors and closed and pool.usage().segments == 0


def test_a_new_segments_fd_is_sent_as_a_duplicate_refused_once_its_session_is_released(pool):
    """Allocate sends the client a duplicate of a new segment's fd taken under the pool's
    lock: a release racing in closes the segment's own fd, whose number could then name
    another file by the time it was sent."""
    _, seg = pool.allocate(1, 4096)
    fd = pool.segment_fd(1, seg)
    try:
        assert fd != seg.fd and os.fstat(fd).st_ino == os.fstat(seg.fd).st_ino
    finally:
        os.close(fd)
    pool.release_session(1)
    with pytest.raises(Unauthenticated, match="closing or closed"):
        pool.segment_fd(1, seg)
