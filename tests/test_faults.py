"""Injected I/O faults through the engine seam, seen by a client over real sockets."""
from __future__ import annotations

import pytest

import fuyou_client
from conftest import ENGINES, in_process_config, make_engine, random_bytes
from fuyoud.io.engine import Op
from fuyoud.io.faults import Fault, FaultyEngine
from fuyoud.server import Daemon

MiB = 1 << 20


@pytest.fixture(params=ENGINES)
def faulty_daemon(request, short_tmp):
    engine = FaultyEngine(make_engine(request.param))
    daemon = Daemon(in_process_config(short_tmp, ndirs=2, storage__capacity_per_device="16MiB"), engine=engine)
    daemon.start()
    yield daemon, engine
    daemon.stop()


def test_io_errors_reach_the_client_and_nothing_half_written_is_committed(faulty_daemon):
    daemon, engine = faulty_daemon
    with fuyou_client.connect(str(daemon.config.daemon.control_path)) as s:
        buf = s.allocate(3 * MiB)
        good = random_bytes(3 * MiB, 1)
        buf.view[:] = good
        s.swap_out("obj", buf, persistent=True)
        buf.view[:] = random_bytes(3 * MiB, 2)
        engine.arm(Fault("eio", op=Op.WRITE, skip=2))
        with pytest.raises(fuyou_client.DataLoss, match=r"I/O error on device \d .*writing object .*/obj"):
            s.swap_out("obj", buf, persistent=True)
        engine.arm(Fault("short", op=Op.WRITE))
        with pytest.raises(fuyou_client.DataLoss, match="short write"):
            s.swap_out("obj", buf, persistent=True)
        engine.arm(Fault("enospc", op=Op.WRITE))
        with pytest.raises(fuyou_client.ResourceExhausted, match="No space left"):
            s.swap_out("obj", buf, persistent=True)
        s.swap_in("obj", buf)
        assert bytes(buf.view) == good  # the committed version is intact
        engine.arm(Fault("eio", op=Op.READ))
        with pytest.raises(fuyou_client.DataLoss, match="reading object"):
            s.swap_in("obj", buf)
        assert engine.injected == 4
        s.swap_in("obj", buf)
        assert bytes(buf.view) == good


def test_a_full_array_is_resource_exhausted_and_others_keep_going(faulty_daemon):
    daemon, _ = faulty_daemon
    sock = str(daemon.config.daemon.control_path)
    with fuyou_client.connect(sock) as greedy, fuyou_client.connect(sock) as other:
        big = greedy.allocate(24 * MiB)
        greedy.swap_out("fill", big)
        with pytest.raises(fuyou_client.ResourceExhausted, match="SSD array full"):
            greedy.swap_out("more", big, length=16 * MiB)
        small = other.allocate(MiB)
        small.view[:] = random_bytes(MiB, 3)
        other.swap_out("fits", small)  # still room for this
        greedy.delete("fill")
        greedy.swap_out("more", big, length=16 * MiB)  # space came back
        other.swap_in("fits", small)
        assert bytes(small.view) == random_bytes(MiB, 3)
