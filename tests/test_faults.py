"""Injected I/O faults through the engine seam, seen by a client over real sockets."""
from __future__ import annotations

import pytest

import fuyou_client
from conftest import ENGINES, in_process_config, make_engine, random_bytes, scrape
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
        with pytest.raises(fuyou_client.ResourceExhausted,
                           match=r"no space left on device \d .*writing object .*/obj.*: the file system holding the "
                                 r"data file is full"):
            s.swap_out("obj", buf, persistent=True)
        s.swap_in("obj", buf)
        assert bytes(buf.view) == good  # the committed version is intact
        engine.arm(Fault("eio", op=Op.READ))  # once: reads are retried
        s.swap_in("obj", buf)
        assert bytes(buf.view) == good and engine.injected == 4
        engine.arm(Fault("eio", op=Op.READ, count=-1))
        with pytest.raises(fuyou_client.DataLoss, match="reading object"):
            s.swap_in("obj", buf)
        engine.clear()
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


def test_a_flipped_byte_on_the_ssd_never_reaches_the_model(short_tmp):
    """Real corruption, in the data file: the optimizer refuses the state, the client's
    training stops with DATA_LOSS naming the object; the other groups are untouched."""
    import torch
    from torch import nn

    from fuyoud.storage.index import IndexDB

    cfg = {"daemon": {"state_dir": str(short_tmp / "state"), "runtime_dir": str(short_tmp / "run")},
           "storage": {"data_dirs": [str(short_tmp / "ssd0")], "capacity_per_device": "64MiB",
                       "direct_io": True}}
    d = fuyou_client.start_daemon(short_tmp / "state", config=cfg)
    model = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 256))
    engine = fuyou_client.attach(model, socket=d.socket, namespace="flip", blocks=[model[0], model[1]],
                                 offload=False)
    model(torch.randn(4, 256)).sum().backward()
    engine.step()
    engine.zero_grad()
    assert d.stop() == 0
    index = IndexDB(short_tmp / "state" / "index.sqlite")
    meta = next(m for m in index.load() if m.name == "optim/block0001")
    index.close()
    extent = meta.layout.extents[0]
    with open(short_tmp / "ssd0" / "fuyou.data", "r+b") as f:  # a byte of the master weights
        f.seek(extent.offset + 4096 + 100)
        byte = f.read(1)
        f.seek(extent.offset + 4096 + 100)
        f.write(bytes([byte[0] ^ 0x01]))
    d = fuyou_client.start_daemon(short_tmp / "state", config=cfg)
    try:
        with fuyou_client.connect(d.socket, namespace="flip") as s:
            buf = s.allocate(meta.size)
            with pytest.raises(fuyou_client.DataLoss, match="checksum mismatch in object flip/optim/block0001"):
                s.swap_in("optim/block0001", buf)
            s.swap_in("optim/block0000", buf, length=s.stat("optim/block0000").size)  # the other is fine
            grads = s.allocate(256 * 257 * 4)
            with pytest.raises(fuyou_client.DataLoss, match="checksum mismatch"):
                s.step_group("block0001", grads, lr=1e-3)
            assert s.stat("optim/block0001").version == meta.version  # nothing was stepped or committed
        m = scrape(d.status().metrics_url)
        assert m['fuyoud_errors_total{kind="checksum"}'] >= 2
    finally:
        assert d.stop() == 0, d.log()
