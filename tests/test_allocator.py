"""The extent allocator under random allocate/free sequences (hypothesis)."""
import pytest
from hypothesis import given, settings, strategies as st

from fuyoud.memory.allocator import ExtentAllocator, OutOfSpace

PAGE = 4096


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 40 * PAGE)), max_size=80))
def test_extents_never_overlap_and_space_is_conserved(ops):
    a = ExtentAllocator(256 * PAGE)
    live: dict[int, int] = {}
    for is_alloc, size in ops:
        if is_alloc or not live:
            try:
                off = a.allocate(size)
            except OutOfSpace as exc:
                assert exc.largest < a.size_of(size)
                continue
            assert off % PAGE == 0
            live[off] = a.size_of(size)
        else:
            off = sorted(live)[size % len(live)]
            a.free(off, live.pop(off))
        spans = sorted(live.items())
        for (o1, l1), (o2, _) in zip(spans, spans[1:]):
            assert o1 + l1 <= o2, "overlapping extents"
        assert a.used_bytes == sum(live.values())
    for off, size in list(live.items()):
        a.free(off, size)
    assert a.free_bytes == a.capacity and a.largest_free == a.capacity  # fully coalesced


def test_double_free_and_bad_reserve_are_refused():
    a = ExtentAllocator(16 * PAGE)
    off = a.allocate(PAGE)
    a.free(off, PAGE)
    with pytest.raises(ValueError, match="double free"):
        a.free(off, PAGE)
    a.reserve(4 * PAGE, 2 * PAGE)
    with pytest.raises(ValueError, match="not free"):
        a.reserve(5 * PAGE, PAGE)
    assert a.used_bytes == 2 * PAGE
