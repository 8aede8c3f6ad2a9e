"""The store over real files, with both engines: striping, alignment, persistence, faults."""
from __future__ import annotations

import mmap

import pytest

from conftest import ENGINES, make_engine, random_bytes
from fuyoud.errors import ChecksumMismatch, QuotaExceeded, DataLoss, NotFound, StorageFull
from fuyoud.io.engine import Op
from fuyoud.io.faults import Fault, FaultyEngine
from fuyoud.memory.staging import StagingPool
from fuyoud.storage.device import Device, DeviceError
from fuyoud.storage.index import IndexDB
from fuyoud.storage.store import ReadItem, Store, WriteItem

MiB = 1 << 20


def open_store(root, engine, ndirs=3, capacity=64 * MiB, stripe=1 * MiB, chunk=256 * 1024):
    devices = [Device(i, root / f"ssd{i}", capacity) for i in range(ndirs)]
    return Store(devices, IndexDB(root / "index.sqlite"), engine, StagingPool(2 * MiB, chunk + 8192),
                 chunk_size=chunk, stripe_size=stripe)


def buffer(data: bytes, pad: int = 0) -> memoryview:
    """Page-aligned memory (like a shared segment) holding ``data`` at offset ``pad``."""
    m = mmap.mmap(-1, max(4096, len(data) + pad))
    m[pad:pad + len(data)] = data
    return memoryview(m)[pad:pad + len(data)]


def empty(n: int, pad: int = 0) -> memoryview:
    return memoryview(mmap.mmap(-1, max(4096, n + pad)))[pad:pad + n]


@pytest.fixture(params=ENGINES)
def engine(request):
    e = make_engine(request.param)
    yield e
    e.close()


SIZES = [0, 1, 511, 4095, 4096, 4097, 12345, 1 * MiB, 3 * MiB + 17, 5 * MiB]


@pytest.mark.parametrize("pad", [0, 1, 4096 - 7])
def test_round_trips_of_many_sizes_and_alignments(tmp_path, engine, pad):
    store = open_store(tmp_path, engine)
    for i, size in enumerate(SIZES):
        data = random_bytes(size, seed=i)
        store.write([WriteItem("ns", f"obj{i}", buffer(data, pad))])
        out = empty(size, pad)
        store.read([ReadItem("ns", f"obj{i}", out)])
        assert bytes(out) == data, f"size {size} pad {pad}"
    store.close()


def test_large_objects_are_striped_over_every_device(tmp_path, engine):
    store = open_store(tmp_path, engine)
    data = random_bytes(7 * MiB + 100)
    meta = store.write([WriteItem("ns", "big", buffer(data))])[0]
    assert sorted(e.device for e in meta.layout.extents) == [0, 1, 2]
    # Each device's file really holds its share.
    assert all(d.used >= 2 * MiB for d in store.usage().devices)
    out = empty(len(data))
    store.read([ReadItem("ns", "big", out)])
    assert bytes(out) == data
    # Ranges that cross stripe boundaries at odd offsets.
    for start, n in [(1 * MiB - 3, 10), (123, 5 * MiB), (7 * MiB, 100), (0, 1)]:
        part = empty(n, 5)
        store.read([ReadItem("ns", "big", part, start)])
        assert bytes(part) == data[start:start + n]
    store.close()


def test_persistent_objects_survive_reopen_and_transient_ones_do_not(tmp_path, engine):
    store = open_store(tmp_path, engine)
    a, b = random_bytes(3 * MiB, 1), random_bytes(5000, 2)
    store.write([WriteItem("ns", "keep", buffer(a), persistent=True), WriteItem("ns", "tmp", buffer(b))])
    store.write([WriteItem("ns", "keep", buffer(a[::-1]), persistent=True)])  # overwrite: new version
    used = store.usage().devices
    store.close()
    store = open_store(tmp_path, engine)
    out = empty(len(a))
    store.read([ReadItem("ns", "keep", out)])
    assert bytes(out) == a[::-1]
    with pytest.raises(NotFound):
        store.stat("ns", "tmp")
    assert sum(d.used for d in store.usage().devices) < sum(d.used for d in used)  # tmp's space is free again
    store.delete("ns", ["keep"])
    store.close()
    store = open_store(tmp_path, engine)
    assert store.list("ns") == []
    store.close()


def test_a_changed_array_is_refused_while_persistent_objects_exist(tmp_path, engine):
    store = open_store(tmp_path, engine, ndirs=2)
    store.write([WriteItem("ns", "p", buffer(b"x" * 10), persistent=True)])
    store.close()
    with pytest.raises(RuntimeError, match="data directories changed"):
        open_store(tmp_path, engine, ndirs=3)


def test_a_second_store_cannot_open_the_same_directory(tmp_path, engine):
    dev = Device(0, tmp_path / "ssd", 1 * MiB)
    with pytest.raises(DeviceError, match="in use by another fuyoud"):
        Device(0, tmp_path / "ssd", 1 * MiB)
    dev.close()


@pytest.mark.parametrize("kind, error, words", [
    ("eio", DataLoss, "Input/output error"),
    ("short", DataLoss, "short write"),
    ("enospc", StorageFull, "the file system holding the data file is full"),
])
def test_failed_writes_are_never_committed(tmp_path, engine, kind, error, words):
    faulty = FaultyEngine(engine)
    store = open_store(tmp_path, faulty)
    old = random_bytes(2 * MiB, 1)
    store.write([WriteItem("ns", "obj", buffer(old), persistent=True)])
    used_before = store.usage().devices
    faulty.arm(Fault(kind, op=Op.WRITE, skip=1))  # the second piece of the first item
    with pytest.raises(error, match=words) as err:
        store.write([WriteItem("ns", "obj", buffer(random_bytes(2 * MiB, 2)), persistent=True),
                     WriteItem("ns", "other", buffer(b"fine"))])
    assert "object ns/obj at device offset" in str(err.value) and "device " in str(err.value)
    # The previous version is intact, the other item committed, no space leaked.
    out = empty(len(old))
    store.read([ReadItem("ns", "obj", out)])
    assert bytes(out) == old
    assert store.stat("ns", "other").size == 4
    assert sum(d.used for d in store.usage().devices) == sum(d.used for d in used_before) + 4096
    store.close()


@pytest.mark.parametrize("kind", ["eio", "short"])
def test_failed_reads_are_retried_then_reported_with_device_and_object(tmp_path, engine, kind):
    faulty = FaultyEngine(engine)
    store = open_store(tmp_path, faulty)
    data = random_bytes(3 * MiB + 5)
    store.write([WriteItem("ns", "obj", buffer(data))])
    faulty.arm(Fault(kind, op=Op.READ))  # one failure: the retry succeeds
    out = empty(3 * MiB + 5)
    store.read([ReadItem("ns", "obj", out)])
    assert bytes(out) == data and faulty.injected == 1
    faulty.arm(Fault(kind, op=Op.READ, count=-1))  # the retry fails too: reported
    with pytest.raises(DataLoss, match=r"device \d .* reading object ns/obj"):
        store.read([ReadItem("ns", "obj", empty(3 * MiB + 5))])
    faulty.clear()
    store.read([ReadItem("ns", "obj", out)])
    assert bytes(out) == data
    store.close()


@pytest.mark.parametrize("start, length", [(0, 3 * MiB + 5), (4096, MiB), (MiB - 7, 2 * MiB + 12), (3 * MiB, 5)])
def test_corruption_of_persistent_objects_is_detected_never_returned(tmp_path, engine, start, length):
    faulty = FaultyEngine(engine)
    store = open_store(tmp_path, faulty)
    data = random_bytes(3 * MiB + 5)
    store.write([WriteItem("ns", "obj", buffer(data), persistent=True)])
    out = empty(length)
    faulty.arm(Fault("corrupt", op=Op.READ))  # once: the re-read is clean
    store.read([ReadItem("ns", "obj", out, start)])
    assert bytes(out) == data[start:start + length]
    faulty.arm(Fault("corrupt", op=Op.READ, count=-1))
    with pytest.raises(ChecksumMismatch, match=r"checksum mismatch in object ns/obj, bytes \[\d+, \d+\) on device"):
        store.read([ReadItem("ns", "obj", empty(length), start)])
    faulty.clear()
    store.close()
    store = open_store(tmp_path, engine)  # the checksums are in the index: still checked after a restart
    store.read([ReadItem("ns", "obj", out, start)])
    assert bytes(out) == data[start:start + length]
    store.close()


def test_a_full_array_is_reported_before_any_io(tmp_path, engine):
    store = open_store(tmp_path, engine, ndirs=2, capacity=4 * MiB)
    store.write([WriteItem("ns", "a", buffer(random_bytes(6 * MiB)))])
    with pytest.raises(StorageFull, match="SSD array full"):
        store.write([WriteItem("ns", "b", buffer(random_bytes(3 * MiB)))])
    store.delete("ns", ["a"])
    store.write([WriteItem("ns", "b", buffer(random_bytes(3 * MiB)))])  # space is back
    store.close()


def test_a_device_too_large_for_its_disk_is_refused_at_start(tmp_path):
    import os

    free = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
    with pytest.raises(DeviceError, match="not enough space"):
        Device(0, tmp_path / "ssd", (free // 4096 + 1024 * 1024) * 4096)


def test_a_namespace_quota_holds_and_rewrites_at_the_limit_still_work(tmp_path, engine):
    store = open_store(tmp_path, engine)
    store.namespace_quota = 4 * MiB
    store.write([WriteItem("greedy", "a", buffer(random_bytes(3 * MiB)), persistent=True)])
    store.write([WriteItem("greedy", "a", buffer(random_bytes(3 * MiB)), persistent=True)])  # a new version
    with pytest.raises(QuotaExceeded, match=r"namespace 'greedy' would hold 5.0 MiB .* quota is 4.0 MiB"):
        store.write([WriteItem("greedy", "b", buffer(random_bytes(2 * MiB)))])
    with pytest.raises(QuotaExceeded):
        store.link("greedy", "greedy", [("a", "snapshots/s/a")])
    store.write([WriteItem("modest", "b", buffer(random_bytes(2 * MiB)))])  # others are not starved
    store.delete("greedy", ["a"])
    store.write([WriteItem("greedy", "b", buffer(random_bytes(2 * MiB)))])  # space came back
    store.close()


def test_a_read_of_part_of_a_block_reads_only_the_rest_of_it_for_its_check(tmp_path):
    """Checking a read that covers a checksum block (1 MiB) in part reads the block's
    other bytes, not the whole block again: a 2 MiB read starting 4 KiB into a 3 MiB
    object moves 3 MiB in all (4 MiB when partial blocks were read whole, as a weight
    fetch out of an optimizer state object did at both ends); and the check still covers
    every byte of the block: one flipped outside the read is found."""
    store = open_store(tmp_path, make_engine("threadpool"), ndirs=1)
    data = random_bytes(3 * MiB, 5)
    store.write([WriteItem("ns", "obj", buffer(data), persistent=True)])
    before = store.usage().bytes_read
    dst = empty(2 * MiB)
    store.read([ReadItem("ns", "obj", dst, 4096)])
    assert bytes(dst) == data[4096:2 * MiB + 4096]
    assert store.usage().bytes_read - before == 3 * MiB
    where = store.stat("ns", "obj").layout.extents[0].offset + 100  # in block 0, before the read's start
    with open(tmp_path / "ssd0" / "fuyou.data", "r+b") as f:  # (not through the O_DIRECT descriptor)
        f.seek(where)
        byte = f.read(1)
        f.seek(where)
        f.write(bytes([byte[0] ^ 1]))
    with pytest.raises(ChecksumMismatch):
        store.read([ReadItem("ns", "obj", empty(2 * MiB), 4096)])


def test_an_auto_data_file_grows_as_objects_need_it_and_leaves_keep_free(tmp_path, engine):
    """capacity_per_device = "auto" (0): the data file starts empty and grows by what the
    objects need (at least GROW_STEP when the disk allows), never into the last
    ``keep_free`` bytes of the file system: past that a write is refused (StorageFull,
    naming what to do) and commits nothing; the objects so far stay, also after a reopen,
    which takes the file at the size it grew to."""
    import os

    def fs_free() -> int:
        st = os.statvfs(tmp_path)
        return st.f_bavail * st.f_frsize

    root = tmp_path / "ssd0"
    store = Store([Device(0, root, 0, keep_free=fs_free() - 40 * MiB)], IndexDB(tmp_path / "index.sqlite"), engine,
                  StagingPool(2 * MiB, 256 * 1024 + 8192), chunk_size=256 * 1024, stripe_size=MiB)
    assert store.usage().devices[0].capacity == 0 and 0 < store.usage().devices[0].available <= 40 * MiB
    written = []
    with pytest.raises(StorageFull, match="free space on the disks"):
        for i in range(12):  # 96 MiB: more than the 40 MiB the file may grow by
            data = random_bytes(8 * MiB, seed=i)
            store.write([WriteItem("ns", f"o{i}", buffer(data), persistent=True)])
            written.append(data)
    usage = store.usage().devices[0]
    assert 2 <= len(written) <= 5 and usage.capacity >= len(written) * 8 * MiB
    assert usage.capacity == os.path.getsize(root / "fuyou.data")  # (the file is as large as the allocator's space)
    with pytest.raises(NotFound):
        store.stat("ns", f"o{len(written)}")  # (the refused write committed nothing)
    store.close()
    store = Store([Device(0, root, 0, keep_free=1 << 30)], IndexDB(tmp_path / "index.sqlite"), engine,
                  StagingPool(2 * MiB, 256 * 1024 + 8192), chunk_size=256 * 1024, stripe_size=MiB)
    assert store.usage().devices[0].capacity == usage.capacity
    for i, data in enumerate(written):
        out = empty(len(data))
        store.read([ReadItem("ns", f"o{i}", out)])
        assert bytes(out) == data
    store.close()
