"""Layer groups larger than an optimizer buffer are stepped in chunks (fuyoud/optimizer/chunks.py):
bitwise like torch, all or nothing, across restarts, checkpoints and attach."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import fuyou_client
from conftest import SMALL, merge, private_daemon, scrape
from fuyou_client import SGD, AdamW
from fuyoud.errors import ResourceExhausted
from fuyou_proto.contract import buffer_address
from fuyoud.optimizer import chunks
from fuyoud.optimizer.group import Group
from fuyoud.optimizer.layout import HEADER
from fuyou_proto.contract import slot_bytes as contract_slot_bytes
from fuyoud.optimizer.kernels import OptimizerSpec
from fuyoud.units import format_size

MiB = 1 << 20
# 2 buffers of 20 MiB: a chunked step holds one (more only when one stays free besides),
# AdamW steps chunks of 86,016 elements (336 KiB per slot, less than a 1 MiB checksum
# block: several chunks take their heads from the same cached block), SGD with momentum
# chunks of 262,144 (1 MiB per slot).
PER_BUFFER = 20 * MiB
CONFIG = merge(SMALL, {"optimizer": {"buffer_budget": f"{2 * PER_BUFFER // MiB}MiB", "buffers": 2},
                       "storage": {"capacity_per_device": "1GiB"}})
N = 1_500_007  # AdamW: 24 MB of state and new weights, more than a buffer; not a multiple of a chunk
HYPER = dict(betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1)


@pytest.fixture(scope="module")
def daemon():
    with private_daemon(CONFIG, "fy-ch-") as d:
        yield d


@pytest.fixture
def session(daemon):
    with fuyou_client.connect(daemon.socket) as s:
        yield s


def chunks_of(spec: OptimizerSpec, numel: int, per_buffer: int, buffers: int = 1) -> int:
    """How many chunks the daemon steps such a group in, holding ``buffers`` buffers (and
    that it is chunked at all)."""
    group = Group("ns", "g", spec, numel, 0)
    assert group.buffer_bytes > per_buffer
    plan = group.chunk_plan(per_buffer, buffers)
    assert numel % plan.chunk
    return len(plan.ranges())


LAYOUTS = {"sgd": OptimizerSpec("sgd"), "sgd+momentum": OptimizerSpec("sgd", momentum=0.9),
           "adamw": OptimizerSpec("adamw"), "adamw-bf16": OptimizerSpec("adamw", state_dtype="bf16"),
           "adamw-int8": OptimizerSpec("adamw", state_dtype="int8")}


@pytest.mark.parametrize("kind", [pytest.param(k, marks=pytest.mark.slow) if k in ("sgd+momentum", "adamw-bf16") else k
                                  for k in LAYOUTS])  # (1-1.5 s each: two of the five layouts with `-m slow`)
def test_the_stages_fit_the_buffers(kind):
    """Scratch and stages, in one to three buffers, never overlap nor leave their buffer,
    and every slot's range of a chunk is 4 KiB aligned in memory and in the object; the
    smallest buffer that can step in chunks is the one the refusal names."""
    layout = LAYOUTS[kind].layout(10 ** 9)
    for per_buffer in (chunks.min_buffer(layout), 42 * MiB, 170 * MiB):
        for buffers in (1, 2, 3):
            plan = chunks.ChunkPlan.make(layout, per_buffer, "g", buffers)
            assert plan.chunk >= chunks.GRANULE and plan.chunk % chunks.granule(layout) == 0
            for i in range(plan.slots):
                lo, n = plan.span(i, plan.chunk, 2 * plan.chunk)
                assert lo % 4096 == 0 and n % 4096 == 0 and plan.region_bytes(i) == n
            mems = [bytearray(per_buffer) for _ in range(buffers)]
            bufs = [memoryview(m) for m in mems]
            spans = [(0, 0, plan.scratch_bytes)]
            for mem in plan.stages(bufs):
                assert len(mem) == plan.stage_bytes
                b = next(i for i, m in enumerate(mems) if mem.obj is m)
                start = buffer_address(mem) - buffer_address(bufs[b])
                assert start % 4096 == 0
                spans.append((b, start, start + len(mem)))
            for i, (b, lo, hi) in enumerate(spans):
                assert hi <= per_buffer and all(b != b2 or hi <= lo2 or hi2 <= lo for b2, lo2, hi2 in spans[i + 1:])
            if buffers > 1:  # more buffers, larger chunks
                one = chunks.ChunkPlan.make(layout, per_buffer, "g")
                assert plan.chunk > one.chunk
    with pytest.raises(ResourceExhausted, match="cannot step it in chunks"):
        chunks.ChunkPlan.make(layout, chunks.min_buffer(layout) - 2 * MiB, "g")


def new_group(session, name, spec, n, seed=0):
    """A group of ``n`` random fp32 weights: (the client's weights buffer, the initial weights)."""
    torch.manual_seed(seed)
    init = torch.randn(n)
    w = session.allocate(n * 4)
    w.tensor(torch.float32)[:n].copy_(init)
    session.create_group(name, w, spec)
    return w, init


def slot_bytes(n: int) -> int:
    """An fp32 slot of the state object, padding included."""
    return contract_slot_bytes("float32", 1, n)


def state_of(session, name, n, slots):
    """The committed state object: (raw bytes, step count, [weights, moments...])."""
    size = session.stat(f"optim/{name}").size
    buf = session.allocate(size)
    session.swap_in(f"optim/{name}", buf)
    raw = bytes(buf.tensor(torch.uint8)[:size].numpy())
    _, numel, step = OptimizerSpec.parse_header(raw[:HEADER])
    assert numel == n
    sb = slot_bytes(n)
    tensors = [torch.frombuffer(bytearray(raw[HEADER + i * sb:HEADER + i * sb + n * 4]), dtype=torch.float32)
               for i in range(slots)]
    return raw, step, tensors


def test_adamw_in_chunks_is_bitwise_torch(session):
    """Weight decay, a clipping coefficient some steps, a changing learning rate; then
    bf16 gradients, bf16 weights out and the bf16 weights object of offloaded training."""
    spec = AdamW(**HYPER)
    assert chunks_of(OptimizerSpec("adamw", 0.8, 0.95, 1e-6, 0.1), N, PER_BUFFER) >= 10
    w, init = new_group(session, "big", spec, N)
    ref = nn.Parameter(init.clone())
    opt = torch.optim.AdamW([ref], lr=1e-2, **HYPER, fused=True)
    g = session.allocate(N * 4)
    gen = torch.Generator().manual_seed(1)
    for lr, scale in [(1e-2, None), (8e-3, 0.5), (6e-3, None), (5e-3, 0.25)]:
        grad = torch.randn(N, generator=gen)
        ref.grad = grad.clone() if scale is None else grad * scale  # (clip_grad_norm_ multiplies in place)
        opt.param_groups[0]["lr"] = lr
        opt.step()
        g.tensor(torch.float32)[:N].copy_(grad)
        info = session.step_group("big", g, lr, out=w, grad_scale=scale)
        assert not info.prefetched
        assert torch.equal(w.tensor(torch.float32)[:N], ref.data)
    _, step, (weights, exp_avg, exp_avg_sq) = state_of(session, "big", N, 3)
    assert step == 4 == session.group("big").step
    st = opt.state[ref]
    assert torch.equal(weights, ref.data) and torch.equal(exp_avg, st["exp_avg"])
    assert torch.equal(exp_avg_sq, st["exp_avg_sq"])
    # bf16 compute: bf16 gradients, the new weights in bf16 to the client and to a weights object
    g16, out16 = session.allocate(N * 2), session.allocate(N * 2)
    for lr in (4e-3, 3e-3):
        grad = torch.randn(N, generator=gen).bfloat16()
        ref.grad = grad.float()
        opt.param_groups[0]["lr"] = lr
        opt.step()
        g16.tensor(torch.bfloat16)[:N].copy_(grad)
        session.step_group_async("big", g16, lr, grad_dtype=torch.bfloat16, out=out16, out_dtype=torch.bfloat16,
                                 weights_object="weights/big").result(60)
        assert torch.equal(out16.tensor(torch.bfloat16)[:N], ref.data.bfloat16())
        back = session.allocate(N * 2)
        session.swap_in("weights/big", back)
        assert torch.equal(back.tensor(torch.bfloat16)[:N], ref.data.bfloat16())


def test_backward_weights_of_a_chunked_group_serve_its_step(session):
    """FetchWeights on a chunked group reads its fp32 master weights into spare optimizer
    buffers and serves the client from them; the group's next step copies them instead of
    reading them again (StepInfo.cached_bytes, the daemon's read counter), bitwise torch.
    Weights larger than the buffers it may take (one always stays free) are covered in
    part: the rest goes straight into an fp32 buffer and the step reads it; a 16-bit
    buffer not wholly covered is declined (the client reads the weights object itself)."""
    per = PER_BUFFER // 4 // chunks.GRANULE * chunks.GRANULE  # elements a buffer holds
    for n in (N, 6_000_011):  # wholly covered; covered in part (two buffers' worth, one may be taken)
        covered = min(n, per)
        name = f"held{n}"
        w, init = new_group(session, name, AdamW(**HYPER), n, seed=4)
        ref = nn.Parameter(init.clone())
        opt = torch.optim.AdamW([ref], lr=1e-2, **HYPER, fused=True)
        g, fetched = session.allocate(n * 4), session.allocate(n * 4)
        gen = torch.Generator().manual_seed(5)
        reads = []
        for fetch in (False, True, True):
            if fetch:
                assert session.fetch_weights_async(name, fetched, torch.float32).result(30) is True
                assert torch.equal(fetched.tensor(torch.float32)[:n], ref.data)
            grad = torch.randn(n, generator=gen)
            ref.grad = grad.clone()
            opt.step()
            g.tensor(torch.float32)[:n].copy_(grad)
            before = session.status().bytes_read
            info = session.step_group(name, g, 1e-2, out=w)
            reads.append(session.status().bytes_read - before)
            assert info.cached_bytes == (4 * covered if fetch else 0)
            assert torch.equal(w.tensor(torch.float32)[:n], ref.data)
        assert reads[0] - reads[1] >= 4 * covered - 2 * MiB and reads[0] - reads[2] >= 4 * covered - 2 * MiB
        if covered < n:
            half = session.allocate(n * 2)
            assert session.fetch_weights_async(name, half, torch.bfloat16).result(30) is False
        _, step, (weights, exp_avg, _) = state_of(session, name, n, 3)
        assert step == 3 and torch.equal(weights, ref.data) and torch.equal(exp_avg, opt.state[ref]["exp_avg"])
        session.delete(f"optim/{name}")


@pytest.mark.parametrize("nesterov", [False, True])
def test_sgd_with_momentum_in_chunks_is_bitwise_torch(session, nesterov):
    n = 2_000_003
    spec = SGD(momentum=0.9, dampening=0.0, weight_decay=0.01, nesterov=nesterov)
    assert chunks_of(OptimizerSpec("sgd", momentum=0.9, weight_decay=0.01, nesterov=nesterov), n, PER_BUFFER) >= 4
    w, init = new_group(session, "sgd", spec, n)
    ref = nn.Parameter(init.clone())
    opt = torch.optim.SGD([ref], lr=0.1, momentum=0.9, weight_decay=0.01, nesterov=nesterov, fused=True)
    g = session.allocate(n * 4)
    gen = torch.Generator().manual_seed(2)
    for lr in (0.1, 0.05, 0.02):
        grad = torch.randn(n, generator=gen)
        ref.grad = grad.clone()
        opt.param_groups[0]["lr"] = lr
        opt.step()
        g.tensor(torch.float32)[:n].copy_(grad)
        session.step_group("sgd", g, lr, out=w)
        assert torch.equal(w.tensor(torch.float32)[:n], ref.data)
    _, step, (weights, momentum) = state_of(session, "sgd", n, 2)
    assert step == 3 and torch.equal(momentum, opt.state[ref]["momentum_buffer"])


@pytest.mark.parametrize("where, bad", [(1_000_000, float("nan")), (N - 1, float("inf")), (5, float("nan"))],
                         ids=["nan-mid", "inf-last-chunk", "nan-first-chunk"])
def test_a_non_finite_chunk_commits_nothing(session, where, bad):
    """A NaN or inf in one chunk's gradients: NonFinite, the committed state (header,
    weights, moments) bitwise unchanged, and the client's weights too (the chunks before
    the bad one had written theirs: they are put back); the next good step is torch's."""
    w, init = new_group(session, "nf", AdamW(**HYPER), N)
    ref = nn.Parameter(init.clone())
    opt = torch.optim.AdamW([ref], lr=1e-2, **HYPER, fused=True)
    g = session.allocate(N * 4)
    gen = torch.Generator().manual_seed(3)
    grad = torch.randn(N, generator=gen)
    ref.grad = grad.clone()
    opt.step()
    g.tensor(torch.float32)[:N].copy_(grad)
    session.step_group("nf", g, 1e-2, out=w)
    before, step, _ = state_of(session, "nf", N, 3)
    weights_before = w.tensor(torch.float32)[:N].clone()
    assert torch.equal(weights_before, ref.data) and step == 1
    g.tensor(torch.float32)[where] = bad
    with pytest.raises(fuyou_client.NonFinite, match="non-finite"):
        session.step_group_async("nf", g, 1e-2, out=w, weights_object="weights/nf").result(60)
    after, step, _ = state_of(session, "nf", N, 3)
    assert after == before and step == 1 == session.group("nf").step
    assert torch.equal(w.tensor(torch.float32)[:N], weights_before)
    with pytest.raises(fuyou_client.ObjectNotFound):  # nor was the weights object written
        session.stat("weights/nf")
    grad = torch.randn(N, generator=gen)
    ref.grad = grad.clone()
    opt.step()
    g.tensor(torch.float32)[:N].copy_(grad)
    assert session.step_group("nf", g, 1e-2, out=w).step == 2
    assert torch.equal(w.tensor(torch.float32)[:N], ref.data)


@pytest.mark.slow  # (a daemon of its own, restarted: about 13 s)
def test_a_chunked_group_survives_a_daemon_restart(short_tmp):
    """Larger buffers here (4 of 32 MiB: a step holds three, one per stage, and steps
    chunks of 626,688 elements, 2.4 MiB per slot, spanning several checksum blocks); the
    state reloads from its header after a restart."""
    n = 2_500_001
    cfg = merge(CONFIG, {"optimizer": {"buffer_budget": "128MiB", "buffers": 4},
                         "storage": {"data_dirs": [str(short_tmp / "a"), str(short_tmp / "b")]}})
    assert chunks_of(OptimizerSpec("adamw", 0.8, 0.95, 1e-6, 0.1), n, 32 * MiB, buffers=3) == 4
    ref = None
    gen = torch.Generator().manual_seed(4)

    def steps(s, w, lrs):
        g = s.allocate(n * 4)
        for lr in lrs:
            grad = torch.randn(n, generator=gen)
            ref.grad = grad.clone()
            opt.param_groups[0]["lr"] = lr
            opt.step()
            g.tensor(torch.float32)[:n].copy_(grad)
            s.step_group("r", g, lr, out=w)
            assert torch.equal(w.tensor(torch.float32)[:n], ref.data)

    with fuyou_client.start_daemon(short_tmp / "state", config=cfg) as d, \
            fuyou_client.connect(d.socket, namespace="run") as s:
        w, init = new_group(s, "r", AdamW(**HYPER), n)
        ref = nn.Parameter(init.clone())
        opt = torch.optim.AdamW([ref], lr=1e-2, **HYPER, fused=True)
        steps(s, w, [1e-2, 9e-3])
        assert scrape(d.status().metrics_url)['fuyoud_pinned_bytes{state="optimizer"}'] == 3 * 32 * MiB
    with fuyou_client.start_daemon(short_tmp / "state", config=cfg) as d, \
            fuyou_client.connect(d.socket, namespace="run") as s:
        assert s.group("r").step == 2
        steps(s, s.allocate(n * 4), [8e-3, 7e-3])
        _, step, (weights, exp_avg, exp_avg_sq) = state_of(s, "r", n, 3)
        assert step == 4 and torch.equal(weights, ref.data)
        assert torch.equal(exp_avg_sq, opt.state[ref]["exp_avg_sq"])


@pytest.mark.slow  # (a daemon of its own: about 10 s)
def test_a_corrupt_chunk_is_refused_and_commits_nothing(short_tmp):
    """A flipped byte in the data file, in the second moment of a chunk mid-way: the step
    reads it again (checked), then fails with DATA_LOSS naming the object; nothing is
    committed and the client's weights, which the earlier chunks had written, are the
    committed ones again."""
    from fuyoud.storage.index import IndexDB

    cfg = merge(CONFIG, {"storage": {"data_dirs": [str(short_tmp / "ssd0")], "direct_io": True}})
    with fuyou_client.start_daemon(short_tmp / "state", config=cfg) as d, \
            fuyou_client.connect(d.socket, namespace="flip") as s:
        w, init = new_group(s, "c", AdamW(**HYPER), N)
        g = s.allocate(N * 4)
        grad = torch.randn(N)
        g.tensor(torch.float32)[:N].copy_(grad)
        s.step_group("c", g, 1e-2, out=w)
        committed = w.tensor(torch.float32)[:N].clone()
    index = IndexDB(short_tmp / "state" / "index.sqlite")
    meta = next(m for m in index.load() if m.name == "optim/c")
    index.close()
    where = meta.layout.extents[0].offset + HEADER + 2 * slot_bytes(N) + 4 * 1_000_000  # exp_avg_sq[1e6]
    with open(short_tmp / "ssd0" / "fuyou.data", "r+b") as f:
        f.seek(where)
        byte = f.read(1)
        f.seek(where)
        f.write(bytes([byte[0] ^ 0x01]))
    with fuyou_client.start_daemon(short_tmp / "state", config=cfg) as d, \
            fuyou_client.connect(d.socket, namespace="flip") as s:
        out, g = s.allocate(N * 4), s.allocate(N * 4)
        out.tensor(torch.float32)[:N].copy_(committed)
        g.tensor(torch.float32)[:N].copy_(grad)
        with pytest.raises(fuyou_client.DataLoss, match="checksum mismatch in object flip/optim/c"):
            s.step_group("c", g, 1e-2, out=out)
        assert s.stat("optim/c").version == meta.version and s.group("c").step == 1
        assert torch.equal(out.tensor(torch.float32)[:N], committed)
        assert "reading it again" in d.log()


def test_read_faults_are_read_again_and_write_faults_commit_nothing(short_tmp, caplog):
    """Through the fault-injecting engine, in-process, over two devices: a read returning
    a flipped bit anywhere in a chunked step (a chunk's ranges, or the checksum block
    the next chunk takes its head from) is read again and the step stays bitwise torch's;
    a failed write mid-step commits nothing and leaves the client's weights as committed."""
    import logging

    from conftest import in_process_config, make_engine
    from fuyoud.io.engine import Op
    from fuyoud.io.faults import Fault, FaultyEngine
    from fuyoud.server import Daemon

    engine = FaultyEngine(make_engine("threadpool"))
    daemon = Daemon(in_process_config(short_tmp, ndirs=2, storage__capacity_per_device="256MiB",
                                      optimizer__buffer_budget=f"{2 * PER_BUFFER // MiB}MiB", optimizer__buffers=2),
                    engine=engine)
    daemon.start()
    caplog.set_level(logging.WARNING, logger="fuyoud.optimizer.chunks")
    try:
        with fuyou_client.connect(str(daemon.config.daemon.control_path)) as s:
            w, init = new_group(s, "f", AdamW(**HYPER), N)
            ref = nn.Parameter(init.clone())
            opt = torch.optim.AdamW([ref], lr=1e-2, **HYPER, fused=True)
            g = s.allocate(N * 4)
            gen = torch.Generator().manual_seed(5)
            skips = [3, 9, 17, 24, 31, 38, 45, 52]  # a step reads ~70 requests of 256 KiB
            for i, skip in enumerate(skips):
                grad = torch.randn(N, generator=gen)
                ref.grad = grad.clone()
                opt.step()
                g.tensor(torch.float32)[:N].copy_(grad)
                engine.arm(Fault("corrupt", op=Op.READ, skip=skip))
                s.step_group("f", g, 1e-2, out=w)
                assert torch.equal(w.tensor(torch.float32)[:N], ref.data), skip
                assert engine.injected == i + 1
            assert len([r for r in caplog.records if "reading it again" in r.getMessage()]) == len(skips)
            version = s.stat("optim/f").version
            engine.arm(Fault("eio", op=Op.WRITE, skip=40))
            with pytest.raises(fuyou_client.DataLoss, match="I/O error"):
                s.step_group("f", g, 1e-2, out=w)
            assert s.stat("optim/f").version == version and s.group("f").step == len(skips)
            assert torch.equal(w.tensor(torch.float32)[:N], ref.data)
            engine.clear()
            grad = torch.randn(N, generator=gen)
            ref.grad = grad.clone()
            opt.step()
            g.tensor(torch.float32)[:N].copy_(grad)
            s.step_group("f", g, 1e-2, out=w)
            assert torch.equal(w.tensor(torch.float32)[:N], ref.data)
    finally:
        daemon.stop()


class Net(nn.Module):
    """Three blocks of 2.1M parameters: 34 MB of AdamW state and new weights each, more
    than one and a half buffers."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(32, 1024)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(1024, 1024), nn.GELU(), nn.Linear(1024, 1024))
                                    for _ in range(3))
        self.out = nn.Linear(1024, 8)

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = h + block(h)
        return self.out(h)


BATCHES = [torch.randn(4, 32, generator=torch.Generator().manual_seed(i)) for i in range(7)]


def train(model, engine, batches):
    for x in batches:
        model(x).square().mean().backward()
        engine.step()
        engine.zero_grad()


def test_attach_with_blocks_larger_than_the_buffers(daemon, short_tmp):
    """Offloaded blocks (forward reads their weights from the state object; backward's
    may be served by the daemon, which then keeps them for the chunked step) train
    bitwise like torch's fused AdamW; a copy checkpoint and its resume continue bitwise."""
    torch.manual_seed(0)
    ours = Net()
    ref = copy.deepcopy(ours)
    engine = fuyou_client.attach(ours, fuyou_client.AdamW(lr=1e-3, **HYPER), socket=daemon.socket, offload=True)
    assert [g.spec.name for g in engine.groups] == ["block0000", "block0001", "block0002", "rest"]
    assert Group("ns", "b", OptimizerSpec("adamw"), engine.groups[0].spec.numel, 0).buffer_bytes > 1.5 * PER_BUFFER
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, **HYPER, fused=True)
    for x in BATCHES[:3]:
        ours(x).square().mean().backward()
        engine.step()
        engine.zero_grad()
        ref(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            assert torch.equal(ours(x), ref(x))  # (the blocks' weights fetched again from the state)
    assert engine.offloader.fetched_bytes > 0  # (backward's are served when a buffer is spare: timing)
    assert engine.save_checkpoint(short_tmp / "ckpt", mode="copy").step == 3
    train(ours, engine, BATCHES[3:])
    engine.close()
    for x in BATCHES[3:]:
        ref(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    for (name, a), b in zip(ours.state_dict().items(), ref.state_dict().values()):
        assert torch.equal(a, b), name

    torch.manual_seed(123)
    resumed = Net()
    engine = fuyou_client.attach(resumed, fuyou_client.AdamW(lr=1e-3, **HYPER), socket=daemon.socket,
                                 resume=short_tmp / "ckpt")
    assert engine.state_dict()["group_steps"] == {g.spec.name: 3 for g in engine.groups}
    train(resumed, engine, BATCHES[3:])
    engine.close()
    for (name, a), b in zip(resumed.state_dict().items(), ref.state_dict().values()):
        assert torch.equal(a, b), name


@pytest.mark.slow  # (a daemon of its own: about 8 s)
def test_a_buffer_too_small_to_chunk_in_is_refused(short_tmp):
    """Chunks need scratch blocks for the checksum blocks' edges and three stages: a group
    larger than buffers too small for that is refused at creation, naming the minimum."""
    cfg = merge(SMALL, {"optimizer": {"buffer_budget": "8MiB", "buffers": 4}})  # 2 MiB buffers
    with fuyou_client.start_daemon(short_tmp / "state", config=cfg) as d, fuyou_client.connect(d.socket) as s:
        w = s.allocate(300_000 * 4)  # 4.8 MB of AdamW state, 2.4 MB of plain SGD's
        for name, spec, kind in (("adamw", AdamW(), "adamw"), ("sgd", SGD(), "sgd"),
                                 ("int8", AdamW(state_dtype="int8"), "adamw-int8")):
            least = format_size(chunks.min_buffer(LAYOUTS[kind].layout(300_000))).replace(".", r"\.")
            with pytest.raises(fuyou_client.ResourceExhausted, match=f"cannot step it in chunks.*at least {least}"):
                s.create_group(name, w, spec)
        s.create_group("fits", w, SGD(), numel=100_000)
        assert s.step_group("fits", w, 0.1).step == 1

