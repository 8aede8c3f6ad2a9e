"""Reduced-precision optimizer state (AdamW(state_dtype="bf16" | "int8")): the daemon's
steps are bitwise equal to a plain torch reference, whole or in chunks; the stored
layout is the size it claims; non-finite steps are refused; old headers still read."""
from __future__ import annotations

import struct

import pytest
import torch
from torch import nn

import fuyou_client
from conftest import SMALL, merge, private_daemon
from fuyou_client import AdamW
from fuyou_client.connection.session import _call
from fuyou_proto import pb
from fuyoud.optimizer.group import Group
from fuyoud.optimizer.kernels import OptimizerSpec
from fuyoud.optimizer.layout import HEADER

MiB = 1 << 20
QB = 256  # parameters per scale of the int8 moments
HYPER = dict(betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1)
# 2 buffers of 40 MiB: N_BIG parameters are chunked in either state dtype
CONFIG = merge(SMALL, {"optimizer": {"buffer_budget": "80MiB", "buffers": 2},
                       "storage": {"capacity_per_device": "1GiB"}})
N_BIG = 5_000_011


# -- the reference: the arithmetic of fuyoud/optimizer/lowp.py, restated in plain torch ------------
def _padded(x: torch.Tensor) -> torch.Tensor:
    nb = -(-x.numel() // QB)
    out = torch.zeros(nb * QB, dtype=x.dtype)
    out[:x.numel()] = x
    return out.view(nb, QB)


def decode(state_dtype, m, v, ms=None, vs=None):
    if state_dtype == "bf16":
        return m.float(), v.float()
    n = m.numel()
    y = m.float() / 127
    m32 = (_padded(y * y.abs()) * ms[:, None]).reshape(-1)[:n]
    y = (v.float() + 1) / 256
    v32 = (_padded((y * y) * (y * y)) * vs[:, None]).reshape(-1)[:n]
    return m32, v32


T_M = torch.tensor([((k - 0.5) / 127) * ((k - 0.5) / 127) for k in range(1, 128)], dtype=torch.float64).float()
T_V = torch.tensor([((k + 0.5) / 256) ** 4 for k in range(1, 256)], dtype=torch.float64).float()  # (exact in float64)


def encode(state_dtype, m32, v32):
    if state_dtype == "bf16":
        return m32.bfloat16(), v32.bfloat16(), None, None
    n = m32.numel()
    tiny = torch.finfo(torch.float32).tiny
    x = _padded(m32)
    ms = x.abs().amax(1)
    r = x / ms.clamp_min(tiny)[:, None]
    count = torch.bucketize(r.abs(), T_M, right=True)  # thresholds at or below |r|
    m = torch.where(r < 0, -count, count).reshape(-1)[:n].to(torch.int8)
    x = _padded(v32)
    vs = x.amax(1) + 0.0
    r = x / vs.clamp_min(tiny)[:, None]
    v = torch.bucketize(r, T_V, right=True).reshape(-1)[:n].to(torch.uint8)
    return m, v, ms, vs


class Reference:
    """torch.optim.AdamW(fused=True) on fp32 weights whose moments are decoded before
    each step and encoded after it."""

    def __init__(self, state_dtype: str, init: torch.Tensor, lr: float):
        self.dtype = state_dtype
        self.p = nn.Parameter(init.clone())
        self.opt = torch.optim.AdamW([self.p], lr=lr, **HYPER, fused=True)
        zeros = torch.zeros_like(init)
        self.stored = encode(state_dtype, zeros, zeros) if state_dtype == "int8" else (
            zeros.bfloat16(), zeros.bfloat16(), None, None)
        self.steps = 0

    def step(self, grad: torch.Tensor, lr: float) -> None:
        m32, v32 = decode(self.dtype, *self.stored)
        self.opt.state[self.p] = {"step": torch.tensor(float(self.steps)), "exp_avg": m32, "exp_avg_sq": v32}
        self.opt.param_groups[0]["lr"] = lr
        self.p.grad = grad
        self.opt.step()
        st = self.opt.state[self.p]
        self.stored = encode(self.dtype, st["exp_avg"], st["exp_avg_sq"])
        self.steps += 1


# -- the daemon ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def daemon():
    with private_daemon(CONFIG, "fy-sd-") as d:
        yield d


@pytest.fixture
def session(daemon):
    with fuyou_client.connect(daemon.socket) as s:
        yield s


def stored_state(session, name, spec: OptimizerSpec, n: int):
    """(step count, [weights, exp_avg, exp_avg_sq, scales...]) of the committed state object."""
    size = session.stat(f"optim/{name}").size
    layout = spec.layout(n)
    assert size == layout.size
    buf = session.allocate(size)
    session.swap_in(f"optim/{name}", buf)
    raw = memoryview(bytearray(buf.tensor(torch.uint8)[:size].numpy()))
    buf.free()
    got, numel, step = OptimizerSpec.parse_header(bytes(raw[:HEADER]))
    assert got == spec and numel == n
    return step, [t.clone() for t in layout.tensors(raw)]


def gradients(n: int, seed: int) -> list[torch.Tensor]:
    """Gradients with what quantization must survive: a block of zeros, outliers, and
    values over many orders of magnitude."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for k in range(4):
        g = torch.randn(n, generator=gen) * torch.logspace(-4, 1, n)[torch.randperm(n, generator=gen)]
        g[QB:2 * QB] = 0  # a block the moments never leave zero in
        g[::997] *= 100.0
        out.append(g)
    return out


@pytest.mark.parametrize("n, state_dtype", [
    pytest.param(n, dt, id=f"{n}-{dt}", marks=pytest.mark.slow if (n, dt) == (N_BIG, "bf16") else ())
    for n in (1000, 3 * 65536 + 300, N_BIG)  # one piece; pieces and a short block; chunks (bf16's: `-m slow`)
    for dt in ("bf16", "int8")])
def test_steps_are_bitwise_the_reference(session, state_dtype, n):
    spec = AdamW(**HYPER, state_dtype=state_dtype)
    torch.manual_seed(n)
    init = torch.randn(n)
    w = session.allocate(n * 4)
    w.tensor(torch.float32)[:n].copy_(init)
    name = f"g-{state_dtype}-{n}"
    full = OptimizerSpec("adamw", 0.8, 0.95, 1e-6, 0.1, state_dtype=state_dtype)
    if n == N_BIG:  # stepped in chunks, several of them
        group = Group("ns", name, full, n, 0)
        assert group.buffer_bytes > 40 * MiB and len(group.chunk_plan(40 * MiB).ranges()) >= 4
    info = session.create_group(name, w, spec)
    assert info.optimizer.state_dtype == state_dtype
    ref = Reference(state_dtype, init, 1e-2)
    g = session.allocate(n * 4)
    for i, grad in enumerate(gradients(n, seed=n)):
        lr = 1e-2 / (1 + i)
        ref.step(grad.clone(), lr)
        g.tensor(torch.float32)[:n].copy_(grad)
        session.step_group(name, g, lr, out=w)
        assert torch.equal(w.tensor(torch.float32)[:n], ref.p.data), f"weights after step {i + 1}"
    step, tensors = stored_state(session, name, full, n)
    assert step == 4
    assert torch.equal(tensors[0], ref.p.data)
    for got, want, what in zip(tensors[1:], ref.stored, ("exp_avg", "exp_avg_sq", "exp_avg scales", "exp_avg_sq scales")):
        assert torch.equal(got, want), what
    for b in (g, w):
        b.free()
    session.delete(f"optim/{name}")


@pytest.mark.parametrize("state_dtype, per_param", [("fp32", 12), ("bf16", 8), ("int8", 6 + 8 / QB)])
def test_the_state_holds_the_bytes_it_claims(state_dtype, per_param):
    """What a step reads and writes per parameter: the object's bytes, padding aside."""
    n = 10 * 1024 * 1024
    layout = OptimizerSpec("adamw", state_dtype=state_dtype).layout(n)
    assert layout.bytes_per_param == per_param
    assert layout.size - HEADER == pytest.approx(n * per_param, abs=4096 * len(layout.slots))
    assert all(off % 4096 == 0 for off in layout.offsets) and layout.offsets[0] == HEADER


def test_int8_second_moments_never_decode_to_zero_in_a_live_block():
    """Zero is not a code of exp_avg_sq: an element whose second moment is far below its
    block's largest decodes to s / 256^4, not 0 (else its update would be m / eps)."""
    v = torch.zeros(2 * QB)
    v[0] = 1.0
    v[1] = 1e-30  # tiny, with a non-zero first moment
    m = torch.zeros(2 * QB)
    m[1] = 1e-15
    codes_m, codes_v, ms, vs = encode("int8", m, v)
    m32, v32 = decode("int8", codes_m, codes_v, ms, vs)
    assert v32[1] == 1.0 / 256 ** 4 and v32[0] == 1.0
    assert torch.all(v32[QB:] == 0)  # the second block is all zeros: it stays zero
    # the error bound of the companding: relative error within half a code step
    x = torch.logspace(-6, 0, QB)
    codes_m, codes_v, ms, vs = encode("int8", x, x)
    m32, v32 = decode("int8", codes_m, codes_v, ms, vs)
    big = x > 1e-2
    assert torch.all((m32[big] - x[big]).abs() / x[big] < 0.1)
    assert torch.all((v32[big] - x[big]).abs() / x[big] < 0.06)


@pytest.mark.parametrize("state_dtype", ["bf16", "int8"])
def test_a_non_finite_step_is_refused_and_the_state_kept(session, state_dtype):
    n = 5000
    spec = AdamW(**HYPER, state_dtype=state_dtype)
    w = session.allocate(n * 4)
    w.tensor(torch.float32)[:n].copy_(torch.randn(n))
    session.create_group("nf", w, spec)
    g = session.allocate(n * 4)
    g.tensor(torch.float32)[:n].normal_()
    session.step_group("nf", g, 1e-3, out=w)
    full = OptimizerSpec("adamw", 0.8, 0.95, 1e-6, 0.1, state_dtype=state_dtype)
    before = stored_state(session, "nf", full, n)
    g.tensor(torch.float32)[1234] = float("nan")
    with pytest.raises(fuyou_client.NonFinite, match="non-finite"):
        session.step_group("nf", g, 1e-3, out=w)
    after = stored_state(session, "nf", full, n)
    assert after[0] == before[0] == 1 and all(torch.equal(a, b) for a, b in zip(after[1], before[1]))


def test_headers_written_before_state_dtype_read_as_fp32():
    """A state object of the first header format (daemons before state_dtype) is fp32."""
    v1 = struct.pack("<8sQQ7dQ", b"FYOPT001", 123, 7, 0.0, 0.9, 0.999, 1e-8, 0.01, 0.0, 0.0, 0)
    spec, numel, step = OptimizerSpec.parse_header(v1.ljust(HEADER, b"\0"))
    assert (spec.state_dtype, numel, step) == ("fp32", 123, 7)
    assert OptimizerSpec("adamw", weight_decay=0.01).header(123, 7) == v1  # fp32 state still writes it
    for dtype in ("bf16", "int8"):
        spec = OptimizerSpec("adamw", 0.8, 0.95, 1e-6, 0.1, state_dtype=dtype)
        assert OptimizerSpec.parse_header(spec.header(5, 2).ljust(HEADER, b"\0")) == (spec, 5, 2)
    with pytest.raises(ValueError, match="state dtype"):
        OptimizerSpec.parse_header(struct.pack("<8sQQ7dQQ", b"FYOPT002", 1, 0, 0.0, 0.9, 0.999, 1e-8, 0, 0, 0, 0, 9))


def test_a_state_dtype_is_checked_by_client_and_daemon(session):
    with pytest.raises(fuyou_client.InvalidArgument, match="state_dtype must be one of fp32, bf16, int8"):
        AdamW(state_dtype="fp16")
    w = session.allocate(4096)
    spec = AdamW().to_pb()
    spec.state_dtype = 7  # (an enum value this version does not know)
    with pytest.raises(fuyou_client.InvalidArgument, match="state dtype 7 is not one of STATE_FP32"):
        _call(session._stub.CreateGroup, pb.CreateGroupRequest(name="x", optimizer=spec, weights=w.ref, numel=1024),
              session._metadata)
    sgd = fuyou_client.SGD(momentum=0.9).to_pb()
    sgd.state_dtype = pb.STATE_BF16
    with pytest.raises(fuyou_client.InvalidArgument, match="SGD keeps its state in fp32"):
        _call(session._stub.CreateGroup, pb.CreateGroupRequest(name="x", optimizer=sgd, weights=w.ref, numel=1024),
              session._metadata)


class Stack(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(nn.Linear(512, 512) for _ in range(4))

    def forward(self, x):
        for b in self.blocks:
            x = torch.relu(b(x))
        return x


def test_attach_counts_the_state_in_its_state_dtype(short_tmp):
    """An SSD array too small for a model's fp32 state takes it in int8 (4 x 263k
    parameters: 12.6 MB of fp32 state and 9.5 MB for the steps in flight, more than 16
    MiB; int8 needs half), and the refusal says how much it needed and what to do."""
    cfg = merge(SMALL, {"storage": {"capacity_per_device": "16MiB"}})
    with fuyou_client.start_daemon(short_tmp / "state", config=cfg) as d:
        with pytest.raises(RuntimeError, match=r"has 1\d\.\d MiB free but this model needs 2\d\.\d MiB there.*state_dtype='bf16' or 'int8'"):
            fuyou_client.attach(Stack(), AdamW(), socket=d.socket)
        model = Stack()
        engine = fuyou_client.attach(model, AdamW(state_dtype="int8"), socket=d.socket)
        model(torch.randn(2, 512)).sum().backward()
        engine.step()
        engine.zero_grad()
        assert all(info.step == 1 for info in engine.last_step_infos)
        engine.close()


@pytest.mark.parametrize("codec", ["c", "torch"])
def test_the_int8_codec_is_the_reference_in_c_and_in_torch(codec, monkeypatch):
    """The C codec (fuyoud._lowp) and the torch fallback give the reference's bits, also
    at the thresholds themselves, for -0, for a short last block, a block of zeros, and
    (scales only: the step is refused) blocks holding NaN or inf."""
    from fuyoud.optimizer import lowp
    if codec == "c" and lowp._C is None:
        pytest.skip("fuyoud._lowp was not built (no compiler at install): the torch codec runs")
    if codec == "torch":
        monkeypatch.setattr(lowp, "_C", None)
    gen = torch.Generator().manual_seed(7)
    n = 40 * QB + 77
    x = torch.randn(n, generator=gen) * torch.logspace(-8, 2, n)[torch.randperm(n, generator=gen)]
    x[QB:2 * QB] = 0.0
    x[2 * QB:3 * QB] = -0.0
    x[3 * QB] = 1.0  # a block whose largest is 1: its values at the thresholds exactly
    x[3 * QB + 1:3 * QB + 128] = T_M
    x[4 * QB] = 1.0
    x[4 * QB + 1:5 * QB] = T_V[:QB - 1]
    x[5 * QB + 3] = float("nan")
    x[6 * QB + 5] = float("inf")
    for signed in (True, False):
        v = x if signed else x.abs()
        codes = torch.empty(n, dtype=torch.int8 if signed else torch.uint8)
        scales = torch.empty(-(-n // QB))
        (lowp.encode_signed if signed else lowp.encode_unsigned)(v, codes, scales, torch.empty(n))
        want_m, want_v, want_ms, want_vs = encode("int8", v, v.abs())
        want_codes, want_scales = (want_m, want_ms) if signed else (want_v, want_vs)
        assert torch.equal(scales.isnan(), want_scales.isnan())
        assert torch.equal(scales.nan_to_num(), want_scales.nan_to_num())
        assert torch.equal(scales.view(torch.int32)[:5], want_scales.view(torch.int32)[:5])  # (+0, not -0)
        live = ~(scales.isnan() | scales.isinf()).repeat_interleave(QB)[:n]
        assert torch.equal(codes[live], want_codes[live])
        out = torch.empty(n)
        (lowp.decode_signed if signed else lowp.decode_unsigned)(codes, scales, out)
        m32, v32 = decode("int8", want_m, want_v, want_ms, want_vs)
        assert torch.equal(out[live], (m32 if signed else v32)[live])


def _blocks(scale: float, values: torch.Tensor) -> torch.Tensor:
    """Blocks of QB whose first element is ``scale`` (the block's largest) and the rest
    ``values`` (|values| <= scale), the last block short."""
    per = QB - 1
    out = []
    for i in range(0, values.numel(), per):
        out.append(torch.tensor([scale]))
        out.append(values[i:i + per])
    return torch.cat(out)


def _next_to(t: torch.Tensor, ulps: int = 3) -> torch.Tensor:
    """Every fp32 within ``ulps`` of each value of t (positive values), t included."""
    bits = t.view(torch.int32)[:, None] + torch.arange(-ulps, ulps + 1, dtype=torch.int32)
    return bits.reshape(-1).view(torch.float32)


@pytest.mark.parametrize("simd", [True, False], ids=["simd", "portable"])
def test_the_c_codec_is_the_reference_next_to_every_threshold(simd):
    """The C codec's two ways to a code (AVX2: a guess and one comparison; portable: a
    table of bins) give the reference's bits for the values next to every threshold (a
    few ulps either side, and after dividing by scales that are not 1, down to a scale
    below FLT_MIN and up to FLT_MAX), for random bit patterns in [-1, 1], denormals,
    ratios far below the first threshold, r = 1 exactly, blocks of zeros and of -0, and
    (their scales, and the same codes from either way) blocks holding NaN or infinity."""
    from fuyoud.optimizer import lowp
    if lowp._C is None:
        pytest.skip("fuyoud._lowp was not built (no compiler at install): the torch codec runs")
    had = lowp._C.fy_lowp_simd(-1)
    if simd and not lowp._C.fy_lowp_simd(1):
        lowp._C.fy_lowp_simd(had)
        pytest.skip("no AVX2 on this CPU (or in this build): the portable code runs")
    tiny = torch.finfo(torch.float32).tiny
    gen = torch.Generator().manual_seed(11)

    def encoded(signed: bool, x: torch.Tensor, use_simd: bool):
        lowp._C.fy_lowp_simd(int(use_simd))
        codes = torch.empty(x.numel(), dtype=torch.int8 if signed else torch.uint8)
        scales = torch.empty(-(-x.numel() // QB))
        (lowp.encode_signed if signed else lowp.encode_unsigned)(x, codes, scales, torch.empty(x.numel()))
        return codes, scales

    try:
        for signed, t in ((True, T_M), (False, T_V)):
            near = _next_to(torch.cat([t, torch.tensor([1.0, 1e-7, 1e-12, 1e-30])]))
            near = near[(near > 0) & (near <= 1)]
            parts = []
            for s in (1.0, 3.0, 0.1, 7.1e-3, 1e-30, 2.0 ** -130, 3e38):  # x = r * s: r comes back within an ulp
                x = (near.double() * s).float()
                parts.append(_blocks(s, torch.cat([x, -x]) if signed else x))
            r = torch.randint(0, 0x3F800001, (20 * QB,), generator=gen, dtype=torch.int32).view(torch.float32)
            if signed:
                r = torch.where(torch.rand(r.numel(), generator=gen) < 0.5, -r, r)
            parts.append(_blocks(1.0, r))  # random patterns, every magnitude in [0, 1]
            denormal = torch.randint(1, 0x800000, (2 * QB,), generator=gen, dtype=torch.int32).view(torch.float32)
            parts.append(denormal)  # blocks whose scale is below FLT_MIN
            parts.append(_blocks(tiny, denormal[:QB - 1]))
            parts.append(torch.zeros(QB))
            parts.append(torch.full((QB,), -0.0) if signed else torch.zeros(QB))
            parts.append(torch.tensor([0.0, -0.0, tiny * 0.5, 1e-45] * (QB // 4)).abs() if not signed else
                         torch.tensor([0.0, -0.0, -tiny * 0.5, 1e-45] * (QB // 4)))
            special = torch.rand(3 * QB, generator=gen)
            special[5] = float("nan")
            special[QB + 9] = float("inf")
            special[2 * QB + 1] = float("inf")
            special[2 * QB + 2] = float("nan")
            parts.append(special)
            parts.append(torch.rand(77, generator=gen))  # a short last block
            x = torch.cat(parts)
            if not signed:
                x = x.abs()
            codes, scales = encoded(signed, x, simd)
            want_m, want_v, want_ms, want_vs = encode("int8", x, x.abs())
            want_codes, want_scales = (want_m, want_ms) if signed else (want_v, want_vs)
            assert torch.equal(scales.view(torch.int32), want_scales.view(torch.int32)) or (
                torch.equal(scales.isnan(), want_scales.isnan())
                and torch.equal(scales.nan_to_num().view(torch.int32), want_scales.nan_to_num().view(torch.int32)))
            live = ~(scales.isnan() | scales.isinf()).repeat_interleave(QB)[:x.numel()]
            bad = (codes != want_codes) & live
            assert not bad.any(), (f"{'signed' if signed else 'unsigned'}: x={x[bad][:5].tolist()} "
                                   f"codes {codes[bad][:5].tolist()}, want {want_codes[bad][:5].tolist()}")
            other_codes, other_scales = encoded(signed, x, not simd)  # where not live too: both ways agree
            if lowp._C.fy_lowp_simd(-1) == int(not simd):
                assert torch.equal(codes, other_codes)
                assert torch.equal(scales.view(torch.int32), other_scales.view(torch.int32))
            out = torch.empty(x.numel())
            (lowp.decode_signed if signed else lowp.decode_unsigned)(codes, scales, out)
            m32, v32 = decode("int8", want_m, want_v, want_ms, want_vs)
            assert torch.equal(out[live], (m32 if signed else v32)[live])
    finally:
        lowp._C.fy_lowp_simd(had)
