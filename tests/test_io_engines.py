"""Both I/O engines against the same expectations (see fuyoud/io/engine.py).

The io_uring cases skip, with the reason from ``uring.available()``, where the
extension is not built or the kernel refuses rings. ENOSPC is not tested here: the
store's tests inject it through a fault engine.
"""
import ctypes
import errno
import mmap
import os
import random
import threading

import pytest

from fuyoud.io import uring
from fuyoud.io.engine import IORequest, IOResult, Op
from fuyoud.io.threadpool import ThreadPoolEngine

BLOCK = 4096
DEPTH = 8  # small, so batches of a few dozen requests exceed it

URING_OK, URING_WHY = uring.available()


@pytest.fixture(params=["threadpool", "io_uring"])
def engine(request):
    if request.param == "io_uring":
        if not URING_OK:
            pytest.skip(URING_WHY)
        eng = uring.UringEngine(queue_depth=DEPTH)
    else:
        eng = ThreadPoolEngine(workers=DEPTH)
    yield eng
    eng.close()


@pytest.fixture
def path(tmp_path):
    return str(tmp_path / "data")


def open_direct(path, flags=os.O_RDWR | os.O_CREAT):
    try:
        return os.open(path, flags | os.O_DIRECT, 0o644)
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            pytest.skip(f"O_DIRECT not supported on {os.path.dirname(path)}")
        raise


def random_mmap(n, seed):
    m = mmap.mmap(-1, n)  # anonymous mappings are page aligned, as O_DIRECT needs
    m[:] = random.Random(seed).randbytes(n)
    return m


def _kernel_gives_a_ring() -> tuple[bool, int]:
    """io_uring_setup(2) called directly, without the extension: (True, 0) where the kernel
    gives this process a ring, else (False, errno) (ENOSYS: an old kernel; EPERM: disabled
    by kernel.io_uring_disabled or a seccomp filter)."""
    libc = ctypes.CDLL(None, use_errno=True)
    params = ctypes.create_string_buffer(120)  # struct io_uring_params, zeroed
    fd = libc.syscall(425, ctypes.c_uint(8), params)  # (__NR_io_uring_setup on x86-64 and arm64)
    if fd < 0:
        return False, ctypes.get_errno()
    os.close(fd)
    return True, 0


def _toolchain_missing() -> list[str]:
    """What the C extensions' build needs that this host lacks (run.sh's native_mode)."""
    import shutil
    import sysconfig

    missing = [] if shutil.which(os.environ.get("CC", "gcc")) else ["a C compiler"]
    if not os.path.exists("/usr/include/liburing.h"):
        missing.append("liburing.h")
    if not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")):
        missing.append("Python.h")
    return missing


def test_the_c_extensions_are_built_where_their_toolchain_is():
    """A host with a compiler and the headers must have both extensions: a build that
    fails there is a failure (setup.py under FUYOU_NATIVE=require), not a reason for the
    io_uring and C-codec tests to skip."""
    missing = _toolchain_missing()
    if missing:
        pytest.skip(f"no toolchain for the C extensions here: {', '.join(missing)}")
    import importlib

    for name in ("fuyoud._uring", "fuyoud._lowp"):
        importlib.import_module(name)  # (ImportError: not built although it could have been)
    from fuyoud.optimizer import lowp

    assert lowp._C is not None  # the int8 codec runs in C, not in its torch fallback


def test_available_agrees_with_the_kernel():
    """``available()`` says yes exactly where the kernel gives a ring (probed here without
    the extension), and otherwise names the errno it got."""
    gives, err = _kernel_gives_a_ring()
    ok, why = uring.available()
    if gives:
        assert (ok, why) == (True, "ok")
        with uring.UringEngine(queue_depth=DEPTH) as eng:  # (and the engine it vouches for works)
            assert eng.execute([IORequest(Op.READ, -1, 0, memoryview(bytearray(1)))]) == [IOResult(0, errno.EBADF)]
    else:
        assert not ok and errno.errorcode[err] in why, why


def test_available_without_the_extension_says_it_is_not_built(monkeypatch):
    import sys

    import fuyoud

    monkeypatch.delattr(fuyoud, "_uring", raising=False)
    monkeypatch.setitem(sys.modules, "fuyoud._uring", None)  # (import now raises ImportError)
    ok, why = uring.available()
    assert not ok and why.startswith("fuyoud._uring not built:"), why
    with pytest.raises(RuntimeError, match="io_uring engine unavailable: fuyoud._uring not built"):
        uring.UringEngine()


def test_the_engine_is_chosen_by_config_and_availability(monkeypatch):
    """auto: io_uring where available, else the thread pool with the reason; "io_uring"
    where it is unavailable: refused with the reason (never a silent fallback)."""
    from fuyoud.config import IOSection
    from fuyoud.io.select import choose_engine

    engine, reason = choose_engine(IOSection(engine="threadpool", threads=3))
    assert isinstance(engine, ThreadPoolEngine) and "configured" in reason
    engine.close()
    engine, reason = choose_engine(IOSection(engine="auto"))
    assert (engine.name == "io_uring") == URING_OK, (engine.name, reason)
    assert reason == ("auto: io_uring is available" if URING_OK else f"auto: io_uring unavailable ({URING_WHY})")
    engine.close()
    monkeypatch.setattr(uring, "available", lambda: (False, "io_uring_queue_init failed: EPERM (refused)"))
    engine, reason = choose_engine(IOSection(engine="auto"))
    assert engine.name == "threadpool" and "EPERM" in reason
    engine.close()
    with pytest.raises(RuntimeError, match=r'\[io.engine\] = "io_uring" but io_uring is not usable here: .*EPERM'):
        choose_engine(IOSection(engine="io_uring"))


def test_direct_round_trip(engine, path):
    sizes = [BLOCK, 2 * BLOCK, 16 * BLOCK, 256 * BLOCK, 3 * BLOCK]
    total = sum(sizes)
    src, dst = random_mmap(total, 1), mmap.mmap(-1, total)
    fd = open_direct(path)
    try:
        # Buffer position p goes to file offset total - p - size: the file layout is
        # reversed, so a mix-up of buffers and offsets shows.
        spans, p = [], 0
        for size in sizes:
            spans.append((p, total - p - size, size))
            p += size
        writes = [IORequest(Op.WRITE, fd, off, memoryview(src)[p : p + n]) for p, off, n in spans]
        assert engine.execute(writes) == [IOResult(n) for _, _, n in spans]
        reads = [IORequest(Op.READ, fd, off, memoryview(dst)[p : p + n]) for p, off, n in spans]
        assert engine.execute(reads) == [IOResult(n) for _, _, n in spans]
    finally:
        os.close(fd)
    assert dst[:] == src[:]


def test_buffered_odd_sizes(engine, path):
    sizes = [1, 7, BLOCK + 1, 12345, 100_000]
    data = [random.Random(i).randbytes(n) for i, n in enumerate(sizes)]
    offsets, off = [], 3
    for n in sizes:
        offsets.append(off)
        off += n + 5  # unaligned, with gaps
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        # bytes are read-only buffers: fine for writes.
        writes = [IORequest(Op.WRITE, fd, o, memoryview(d)) for o, d in zip(offsets, data)]
        assert engine.execute(writes) == [IOResult(n) for n in sizes]
        bufs = [bytearray(n) for n in sizes]
        reads = [IORequest(Op.READ, fd, o, memoryview(b)) for o, b in zip(offsets, bufs)]
        assert engine.execute(reads) == [IOResult(n) for n in sizes]
        assert [bytes(b) for b in bufs] == data
        assert os.pread(fd, sizes[0], offsets[0]) == data[0]
    finally:
        os.close(fd)


def test_batch_larger_than_depth_keeps_order(engine, path):
    count = 10 * DEPTH
    src, dst = random_mmap(count * BLOCK, 2), mmap.mmap(-1, count * BLOCK)
    fd = open_direct(path)
    try:
        blocks = lambda m, i: memoryview(m)[i * BLOCK : (i + 1) * BLOCK]  # noqa: E731
        writes = [IORequest(Op.WRITE, fd, i * BLOCK, blocks(src, i)) for i in range(count)]
        assert engine.execute(writes) == [IOResult(BLOCK)] * count
        order = list(range(count))
        random.Random(3).shuffle(order)
        reads = [IORequest(Op.READ, fd, i * BLOCK, blocks(dst, i)) for i in order]
        assert engine.execute(reads) == [IOResult(BLOCK)] * count
    finally:
        os.close(fd)
    assert dst[:] == src[:]


def test_concurrent_execute(engine, path):
    threads, per_thread = 4, 3 * DEPTH
    region = per_thread * BLOCK
    src, dst = random_mmap(threads * region, 4), mmap.mmap(-1, threads * region)
    fd = open_direct(path)
    start, failures = threading.Barrier(threads), []

    def worker(t):
        try:
            base = t * region
            spans = [base + i * BLOCK for i in range(per_thread)]
            start.wait()
            for op, m in ((Op.WRITE, src), (Op.READ, dst)):
                reqs = [IORequest(op, fd, o, memoryview(m)[o : o + BLOCK]) for o in spans]
                assert engine.execute(reqs) == [IOResult(BLOCK)] * per_thread
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            failures.append(exc)

    try:
        pool = [threading.Thread(target=worker, args=(t,)) for t in range(threads)]
        for th in pool:
            th.start()
        for th in pool:
            th.join()
    finally:
        os.close(fd)
    assert not failures, failures
    assert dst[:] == src[:]


def test_read_past_eof_is_short_without_error(engine, path):
    with open(path, "wb") as f:
        f.write(random.Random(5).randbytes(10_000))
    fd = os.open(path, os.O_RDONLY)
    try:
        results = engine.execute(
            [
                IORequest(Op.READ, fd, 2 * BLOCK, memoryview(bytearray(2 * BLOCK))),
                IORequest(Op.READ, fd, 20_000, memoryview(bytearray(BLOCK))),
            ]
        )
    finally:
        os.close(fd)
    assert results == [IOResult(10_000 - 2 * BLOCK), IOResult(0)]


def test_direct_read_past_eof(engine, path):
    with open(path, "wb") as f:
        f.write(bytes(3 * BLOCK))
    fd = open_direct(path, os.O_RDONLY)
    try:
        buf = mmap.mmap(-1, 2 * BLOCK)
        results = engine.execute([IORequest(Op.READ, fd, 2 * BLOCK, memoryview(buf))])
    finally:
        os.close(fd)
    assert results == [IOResult(BLOCK)]


def test_wrong_access_mode_is_ebadf(engine, path):
    with open(path, "wb") as f:
        f.write(bytes(BLOCK))
    ro = os.open(path, os.O_RDONLY)
    wo = os.open(path, os.O_WRONLY)
    try:
        results = engine.execute(
            [
                IORequest(Op.WRITE, ro, 0, memoryview(bytes(BLOCK))),
                IORequest(Op.READ, wo, 0, memoryview(bytearray(BLOCK))),
            ]
        )
    finally:
        os.close(ro)
        os.close(wo)
    assert results == [IOResult(0, errno.EBADF)] * 2


def test_failures_stay_in_their_slot(engine, path):
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    data = random.Random(6).randbytes(BLOCK)
    try:
        results = engine.execute(
            [
                IORequest(Op.WRITE, fd, 0, memoryview(data)),
                IORequest(Op.WRITE, -1, 0, memoryview(data)),  # bad fd
                IORequest(Op.READ, -1, 0, memoryview(bytearray(BLOCK))),
                IORequest(Op.WRITE, fd, -BLOCK, memoryview(data)),  # negative offset
                IORequest(Op.READ, fd, 0, memoryview(bytearray())),  # empty
                IORequest(Op.WRITE, fd, BLOCK, memoryview(data)),
            ]
        )
        assert os.pread(fd, 2 * BLOCK, 0) == data * 2
    finally:
        os.close(fd)
    assert results == [
        IOResult(BLOCK),
        IOResult(0, errno.EBADF),
        IOResult(0, errno.EBADF),
        IOResult(0, errno.EINVAL),
        IOResult(0),
        IOResult(BLOCK),
    ]


def test_error_after_progress_keeps_the_count(engine, path):
    # The second page of the buffer is inaccessible: the first transfer stops short
    # after one page, and continuing it fails with EFAULT.
    with open(path, "wb") as f:
        f.write(random.Random(7).randbytes(2 * BLOCK))
    buf = mmap.mmap(-1, 2 * BLOCK)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.mprotect(ctypes.c_void_p(addr + BLOCK), BLOCK, 0) == 0  # PROT_NONE
    fd = os.open(path, os.O_RDWR)
    try:
        for op in (Op.READ, Op.WRITE):
            results = engine.execute([IORequest(op, fd, 0, memoryview(buf))])
            assert results == [IOResult(BLOCK, errno.EFAULT)], op
    finally:
        os.close(fd)


def test_execute_after_close_raises(engine):
    engine.close()
    with pytest.raises(RuntimeError):
        engine.execute([IORequest(Op.READ, -1, 0, memoryview(bytearray(1)))])


def _uring_fds():
    fds = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            if "io_uring" in os.readlink(f"/proc/self/fd/{name}"):
                fds.add(int(name))
        except OSError:  # the fd listing the directory itself is gone by now
            pass
    return fds


@pytest.mark.skipif(not URING_OK, reason=URING_WHY)
def test_dead_ring_fails_its_batch_and_is_replaced(path):
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    data = random.Random(8).randbytes(BLOCK)
    writes = [IORequest(Op.WRITE, fd, i * BLOCK, memoryview(data)) for i in range(3)]
    with uring.UringEngine(queue_depth=DEPTH) as eng:
        before = _uring_fds()
        assert eng.execute(writes[:1]) == [IOResult(BLOCK)]  # opens this thread's ring
        (ring_fd,) = _uring_fds() - before
        # Put /dev/null where the ring's fd was: io_uring_enter now fails for the ring.
        null = os.open(os.devnull, os.O_RDWR)
        os.dup2(null, ring_fd)
        os.close(null)
        assert eng.execute(writes) == [IOResult(0, errno.EOPNOTSUPP)] * 3
        assert eng.execute(writes) == [IOResult(BLOCK)] * 3  # on a fresh ring
    os.close(fd)
