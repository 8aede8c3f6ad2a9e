"""Nothing non-finite reaches the optimizer state: NaN or infinite hyperparameters,
learning rates, gradient scales, gradients and updates are refused (by the daemon, and
sooner by the client where it can tell), and a refused step leaves no trace."""
from __future__ import annotations

import copy

import grpc
import pytest
import torch
from torch import nn

import fuyou_client
from fuyou_client.gradients import clipping
from conftest import SMALL, private_daemon
from fuyou_client import SGD, AdamW
from fuyou_proto import pb
from fuyoud.optimizer.kernels import all_finite

NAN, INF = float("nan"), float("inf")
HYPER = dict(lr=1e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1)
N = 3000  # not a multiple of a page: the state's slots have padding between them


@pytest.fixture(scope="module")
def daemon():
    """One fuyoud for the module (each session has a namespace of its own)."""
    with private_daemon(SMALL, "fy-nf-") as d:
        yield d


@pytest.fixture
def session(daemon):
    with fuyou_client.connect(daemon.socket) as s:
        yield s


def raw(session, method: str, request):
    """A request straight to the daemon (no client-side validation); the RpcError."""
    with pytest.raises(grpc.RpcError) as info:
        getattr(session.stub, method)(request, metadata=session.metadata, timeout=30)
    return info.value


def state_bytes(session, name: str) -> bytes:
    """The group's committed state object (header, weights, moments), as stored."""
    info = session.stat(f"optim/{name}")
    buf = session.allocate(info.size)
    session.swap_in(f"optim/{name}", buf)
    return bytes(buf.tensor(torch.uint8).numpy())


def test_all_finite_is_exact_when_the_sum_overflows():
    big = torch.full((1000,), 3e38)  # finite, but its sum is inf: the exact check decides
    assert all_finite(big)
    assert all_finite(torch.zeros(0))
    for bad in (NAN, INF, -INF):
        t = torch.randn(10_001)
        t[7777] = bad
        assert not all_finite(t)
        big[3] = bad
        assert not all_finite(big)
    mixed = torch.tensor([INF, -INF, 1.0])  # inf + -inf: NaN
    assert not all_finite(mixed)
    padded = torch.cat([torch.randn(5), torch.full((3,), NAN)])  # parts: the checked elements only
    assert all_finite(padded, [padded[:5]])


def test_the_daemon_refuses_non_finite_hyperparameters(session):
    w = session.allocate(N * 4)
    cases = [  # (field named in the refusal, spec)
        ("eps", dict(kind="adamw", beta1=0.9, beta2=0.999, eps=NAN)),
        ("eps", dict(kind="adamw", beta1=0.9, beta2=0.999, eps=INF)),
        ("weight_decay", dict(kind="adamw", beta1=0.9, beta2=0.999, weight_decay=INF)),
        ("weight_decay", dict(kind="adamw", beta1=0.9, beta2=0.999, weight_decay=NAN)),
        ("beta1", dict(kind="adamw", beta1=NAN, beta2=0.999)),
        ("beta2", dict(kind="adamw", beta1=0.9, beta2=NAN)),
        ("weight_decay", dict(kind="sgd", weight_decay=INF)),
        ("momentum", dict(kind="sgd", momentum=INF)),
        ("dampening", dict(kind="sgd", momentum=0.9, dampening=NAN)),
        ("dampening", dict(kind="sgd", momentum=0.9, dampening=-0.5)),
    ]
    for field, spec in cases:
        req = pb.CreateGroupRequest(name="bad", optimizer=pb.OptimizerSpec(**spec), weights=w.ref, numel=N)
        err = raw(session, "CreateGroup", req)
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (spec, err.details())
        assert field in err.details(), (spec, err.details())
    with pytest.raises(fuyou_client.ObjectNotFound):
        session.group("bad")  # nothing was created


def test_the_daemon_refuses_non_finite_learning_rates_and_scales(session):
    torch.manual_seed(0)
    w, g = session.allocate(N * 4), session.allocate(N * 4)
    w.tensor(torch.float32).copy_(torch.randn(N))
    session.create_group("h.0", w, AdamW(**HYPER))
    g.tensor(torch.float32).copy_(torch.randn(N))
    session.step_group("h.0", g, 1e-2, out=w)
    before, weights = state_bytes(session, "h.0"), w.tensor(torch.float32).clone()
    for lr, scale, what in [(INF, None, "learning rate"), (NAN, None, "learning rate"), (-1.0, None, "learning rate"),
                            (1e-2, NAN, "grad_scale"), (1e-2, INF, "grad_scale"), (1e-2, -1.0, "grad_scale")]:
        req = pb.StepGroupRequest(name="h.0", grads=g.ref, grad_dtype=pb.FLOAT32, lr=lr, weights_out=w.ref,
                                  out_dtype=pb.FLOAT32)
        if scale is not None:
            req.grad_scale = scale
        err = raw(session, "StepGroup", req)
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (lr, scale, err.details())
        assert what in err.details(), (lr, scale, err.details())
        assert session.group("h.0").step == 1
    assert state_bytes(session, "h.0") == before
    assert torch.equal(w.tensor(torch.float32), weights)


@pytest.mark.parametrize("bad", [NAN, INF], ids=["nan", "inf"])
def test_a_non_finite_gradient_is_refused_and_leaves_no_trace(session, bad):
    """Two groups stepped in backward order (so the second's state is read ahead when it
    steps); the NaN or inf step of one is refused with its state, step count and output
    untouched, and the steps after it are torch's AdamW as if it never happened."""
    torch.manual_seed(1)
    init = [torch.randn(N), torch.randn(N + 11)]
    ws, gs = [], []
    for i, w0 in enumerate(init):
        ws.append(session.allocate(w0.numel() * 4))
        ws[i].tensor(torch.float32).copy_(w0)
        session.create_group(f"h.{i}", ws[i], AdamW(**HYPER))
        gs.append(session.allocate(w0.numel() * 4))
    ref = [nn.Parameter(w0.clone()) for w0 in init]
    opt = torch.optim.AdamW(ref, **HYPER, fused=True)
    gen = torch.Generator().manual_seed(2)
    infos = []
    for it in range(4):
        grads = [torch.randn(w0.numel(), generator=gen) for w0 in init]
        poisoned = it == 2
        for i in (1, 0):  # backward's order: the daemon reads h.0's state ahead while h.1 steps
            gs[i].tensor(torch.float32).copy_(grads[i])
            if poisoned and i == 0:
                gs[i].tensor(torch.float32)[1234] = bad
                before, out_before = state_bytes(session, "h.0"), ws[0].tensor(torch.float32).clone()
                with pytest.raises(fuyou_client.NonFinite) as info:
                    session.step_group("h.0", gs[0], HYPER["lr"], out=ws[0])
                assert "group 'h.0'" in str(info.value) and "gradients" in str(info.value)
                assert "(step 2) kept" in str(info.value)
                assert isinstance(info.value, FloatingPointError)
                assert session.group("h.0").step == 2
                assert state_bytes(session, "h.0") == before  # weights and both moments
                assert torch.equal(ws[0].tensor(torch.float32), out_before)
                continue
            infos.append(session.step_group(f"h.{i}", gs[i], HYPER["lr"], out=ws[i]))
        for p, g in zip(ref, grads):
            p.grad = None if (poisoned and p is ref[0]) else g  # torch skips a parameter without .grad
        opt.step()
    assert any(i.prefetched for i in infos)  # (the refused step, too, may have used a read-ahead)
    assert [session.group(f"h.{i}").step for i in range(2)] == [3, 4]
    for w, p in zip(ws, ref):
        assert torch.equal(w.tensor(torch.float32), p.data)
    state = state_bytes(session, "h.0")  # the moments too: [header][weights][exp_avg][exp_avg_sq]
    slot = -(-N * 4 // 4096) * 4096
    st = opt.state[ref[0]]
    for k, expect in enumerate([ref[0].data, st["exp_avg"], st["exp_avg_sq"]]):
        got = torch.frombuffer(bytearray(state[4096 + k * slot:4096 + k * slot + N * 4]), dtype=torch.float32)
        assert torch.equal(got, expect), k


def test_an_update_that_overflows_is_refused(session):
    """Finite gradients, but a learning rate (or a gradient scale) so large that the new
    weights (or the scaled gradients) overflow float32: refused, naming the cause."""
    torch.manual_seed(3)
    w, g = session.allocate(N * 4), session.allocate(N * 4)
    w.tensor(torch.float32).copy_(torch.randn(N))
    session.create_group("huge", w, AdamW(**HYPER))
    g.tensor(torch.float32).copy_(torch.randn(N))
    before, weights = state_bytes(session, "huge"), w.tensor(torch.float32).clone()
    with pytest.raises(fuyou_client.NonFinite, match="group 'huge': its gradients are finite but its update is not"):
        session.step_group("huge", g, 1e38, out=w)
    g.tensor(torch.float32).mul_(1e10)
    with pytest.raises(fuyou_client.NonFinite, match="group 'huge': its gradients times grad_scale"):
        session.step_group("huge", g, 1e-3, out=w, grad_scale=1e30)
    assert session.group("huge").step == 0
    assert state_bytes(session, "huge") == before
    assert torch.equal(w.tensor(torch.float32), weights)
    session.step_group("huge", g, 1e-3, out=w)  # and a sane step goes on
    assert session.group("huge").step == 1


def test_sgd_with_a_nan_gradient_is_refused(session):
    """SGD without momentum: the state is the weights alone."""
    w, g = session.allocate(N * 4), session.allocate(N * 4)
    w.tensor(torch.float32).fill_(1.0)
    session.create_group("sgd", w, SGD(lr=0.1))
    g.tensor(torch.float32).fill_(NAN)
    with pytest.raises(fuyou_client.NonFinite, match="group 'sgd': its gradients hold non-finite"):
        session.step_group("sgd", g, 0.1, out=w)
    assert session.group("sgd").step == 0
    assert torch.equal(w.tensor(torch.float32), torch.ones(N))


def test_the_client_refuses_non_finite_settings():
    for kwargs in [dict(eps=NAN), dict(eps=-1.0), dict(weight_decay=INF), dict(weight_decay=NAN), dict(lr=INF),
                   dict(lr=NAN), dict(lr=-1e-3), dict(betas=(NAN, 0.9)), dict(betas=(0.9, 1.0)), dict(betas=(0.9,)),
                   dict(betas=0.9)]:
        with pytest.raises(ValueError, match=next(iter(kwargs))):
            AdamW(**kwargs)
    for kwargs in [dict(lr=INF), dict(momentum=NAN), dict(dampening=INF), dict(weight_decay=-0.1)]:
        with pytest.raises(ValueError, match=next(iter(kwargs))):
            SGD(**kwargs)
    with pytest.raises(ValueError, match="Nesterov"):
        SGD(nesterov=True)
    AdamW(lr=0.0, betas=(0.0, 0.0), eps=0.0, weight_decay=0.0)  # the bounds themselves are fine
    for bad in (NAN, 0.0, -1.0):
        with pytest.raises(ValueError, match="max_grad_norm"):
            fuyou_client.attach(Tiny(), max_grad_norm=bad, socket="/nonexistent")  # refused before connecting


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(16, 32)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(3))
        self.out = nn.Linear(32, 4)

    def forward(self, x):
        h = self.embed(x)
        for layer in self.layers:
            h = h + layer(h)
        return self.out(h)


def poison(param: nn.Parameter, when: list[bool]):
    """A NaN in one element of ``param``'s gradient whenever ``when[0]``."""
    def hook(grad):
        if not when[0]:
            return grad
        grad = grad.clone()
        grad.view(-1)[0] = NAN
        return grad
    return param.register_hook(hook)


def run(daemon, offload, max_grad_norm):
    """Three iterations against torch's fused AdamW, the second with a NaN in block0001's
    gradients. Returns (engine, ours, ref, what engine.step() raised in the second)."""
    torch.manual_seed(0)
    ours = Tiny()
    ref = copy.deepcopy(ours)
    engine = fuyou_client.attach(ours, AdamW(**HYPER), socket=daemon.socket, offload=offload,
                                 max_grad_norm=max_grad_norm)
    opt = torch.optim.AdamW(ref.parameters(), **HYPER, fused=True)
    when = [False]
    poison(ours.layers[1][0].weight, when)
    gen = torch.Generator().manual_seed(4)
    raised = None
    for it in range(3):
        x = torch.randn(4, 16, generator=gen)
        when[0] = it == 1
        ours(x).square().mean().backward()
        if max_grad_norm is not None and it == 0:
            assert clipping.Clipper(ours, engine.groups).coefficient(max_grad_norm) == 1.0  # exactly: no scaling then
        try:
            engine.step()
        except fuyou_client.NonFinite as exc:
            raised = exc
        engine.zero_grad()
        ref(x).square().mean().backward()
        if it == 1:
            if max_grad_norm is not None:  # nothing steps
                opt.zero_grad()
                continue
            for p in ref.layers[1].parameters():  # only block0001's step is refused
                p.grad = None
        opt.step()
        opt.zero_grad()
    return engine, ours, ref, raised


@pytest.mark.parametrize("offload", [True, False], ids=["offloaded", "resident"])
def test_attach_with_max_grad_norm_inf_checks_before_any_step(daemon, offload):
    """max_grad_norm=inf: no clipping (bitwise torch without clipping), but every
    gradient checked before any group steps: a NaN steps nothing, and after zero_grad()
    training goes on as if that iteration never happened."""
    engine, ours, ref, raised = run(daemon, offload, max_grad_norm=INF)
    assert raised is not None, "the NaN iteration was not refused"
    assert "'block0001'" in str(raised) and "no group was stepped" in str(raised)
    assert "'block0000'" not in str(raised) and "'rest'" not in str(raised)
    assert engine.state_dict()["group_steps"] == {g.spec.name: 2 for g in engine.groups}
    engine.close()
    for (name, a), b in zip(ours.state_dict().items(), ref.state_dict().values()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("offload", [True, False], ids=["offloaded", "resident"])
def test_attach_without_clipping_refuses_only_the_nan_group(daemon, offload):
    """Each group steps during backward: block0001's NaN step is refused by the daemon
    (its state kept), the others step, engine.step() names it; training then goes on."""
    engine, ours, ref, raised = run(daemon, offload, max_grad_norm=None)
    assert raised is not None, "the NaN step was not refused"
    assert "group 'block0001': its gradients hold non-finite values" in str(raised)
    assert "1 of 4 groups refused" in str(raised)
    steps = engine.state_dict()["group_steps"]
    assert steps == {"block0000": 3, "block0001": 2, "block0002": 3, "rest": 3}
    engine.close()
    for (name, a), b in zip(ours.state_dict().items(), ref.state_dict().values()):
        assert torch.equal(a, b), name
