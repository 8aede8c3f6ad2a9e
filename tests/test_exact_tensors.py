"""A group's elements stepped as the tensors they are (fuyoud/optimizer/tensors.py): torch's
fused CPU kernels step a tensor's last ``numel % width`` elements in a scalar loop that
rounds otherwise than their vector loop; given the tensors behind a flat group, the
daemon's kernel puts each element through the loop torch.optim's per-tensor step does,
whole or cut into chunks anywhere, for AdamW and SGD with momentum."""
from __future__ import annotations

import random

import pytest
import torch
from torch import nn
from torch.optim.adamw import adamw

import fuyou_client
from fuyou_client import AdamW
from test_chunked import CONFIG, HYPER, new_group, state_of
from conftest import private_daemon
from fuyoud.optimizer import kernels, tensors
from fuyoud.optimizer.kernels import OptimizerSpec

rng = random.Random(0)
SIZES = [rng.choice([1, 3, 4, 5, 7, 9, 12, 20, 31, 64, 100, 1003]) for _ in range(300)]
N = sum(SIZES)
torch.manual_seed(1)
INIT = [torch.randn(n) * 0.02 for n in SIZES]
GRADS = [[torch.randn(n) * 1e-3 for n in SIZES] for _ in range(3)]
SPECS = {"adamw": (OptimizerSpec("adamw", weight_decay=0.1), 3, 1e-3),
         "sgd": (OptimizerSpec("sgd", weight_decay=0.1, momentum=0.9), 2, 1e-2)}


def torch_per_tensor(kind: str) -> torch.Tensor:
    w = [t.clone() for t in INIT]
    m, v, steps = [torch.zeros_like(t) for t in w], [torch.zeros_like(t) for t in w], [torch.tensor(0.0) for _ in w]
    for i in range(3):
        if kind == "adamw":
            adamw(w, GRADS[i], m, v, [], steps, fused=True, amsgrad=False, beta1=0.9, beta2=0.999, lr=1e-3,
                  weight_decay=0.1, eps=1e-8, maximize=False)
        else:
            torch._fused_sgd_(w, GRADS[i], m, weight_decay=0.1, momentum=0.9, lr=1e-2, dampening=0.0, nesterov=False,
                              maximize=False, is_first_step=i == 0)
    return torch.cat(w)


def fuyoud_flat(kind: str, chunk: int | None, named: bool) -> torch.Tensor:
    spec, nslots, lr = SPECS[kind]
    state = torch.zeros(nslots * N)
    slots = [state[k * N:(k + 1) * N] for k in range(nslots)]
    slots[0].copy_(torch.cat(INIT))
    pieces = [tensors.Piece(n, 0, n) for n in SIZES] if named else []
    for i in range(3):
        grad = torch.cat(GRADS[i])
        for a in range(0, N, chunk or N):
            b = min(N, a + (chunk or N))
            kernels.step(spec, i, [s[a:b] for s in slots], grad[a:b], lr, pieces=tensors.within(pieces, a, b))
    return slots[0].clone()


def test_the_vector_width_is_found():
    assert tensors.vector_width() in (None, 2, 4, 8, 16, 32, 64)


@pytest.mark.parametrize("kind", sorted(SPECS))
def test_named_tensors_step_bitwise_as_torch_whole_and_in_chunks(kind):
    want = torch_per_tensor(kind)
    for chunk in (None, 97, 1024):
        assert torch.equal(fuyoud_flat(kind, chunk, named=True), want), chunk
    if tensors.vector_width() is not None:  # (the flat step is what differed)
        assert not torch.equal(fuyoud_flat(kind, None, named=False), want)


def test_pieces_of_a_chunk():
    pieces = [tensors.Piece(5, 0, 5), tensors.Piece(3, 2, 10), tensors.Piece(4, 0, 4)]
    assert tensors.within(pieces, 3, 9) == [tensors.Piece(2, 3, 5), tensors.Piece(3, 2, 10), tensors.Piece(1, 0, 4)]


@pytest.mark.slow  # (a daemon of its own with small optimizer buffers: about 7 s)
def test_a_group_of_tensors_in_chunks_steps_each_as_torch_does():
    """A group of tensors whose sizes are not multiples of torch's vector width, stepped in
    chunks that cut them anywhere: with the tensors named (StepGroup's ``tensors``) every
    element takes the loop torch.optim's per-tensor step gives it, so weights and moments
    are bitwise torch's (fuyoud/optimizer/tensors.py); tensors that do not add up to the
    group are refused."""
    with private_daemon(CONFIG, "fy-ex-") as d, fuyou_client.connect(d.socket) as session:
        check_named_tensors_in_chunks(session)


def check_named_tensors_in_chunks(session):
    sizes = [500_003, 4, 700_001, 12, 299_987]
    n = sum(sizes)
    w, init = new_group(session, "odd", AdamW(**HYPER), n, seed=3)
    refs = [nn.Parameter(t.clone()) for t in init.split(sizes)]
    opt = torch.optim.AdamW(refs, lr=1e-2, **HYPER, fused=True)
    named = [x for s in sizes for x in (s, 0, s)]
    g = session.allocate(n * 4)
    gen = torch.Generator().manual_seed(2)
    for lr in (1e-2, 5e-3, 2e-3):
        grad = torch.randn(n, generator=gen) * 1e-2
        for r, part in zip(refs, grad.split(sizes)):
            r.grad = part.clone()
        opt.param_groups[0]["lr"] = lr
        opt.step()
        g.tensor(torch.float32)[:n].copy_(grad)
        session.step_group_async("odd", g, lr, out=w, tensors=named).result(60)
        assert torch.equal(w.tensor(torch.float32)[:n], torch.cat([r.data for r in refs]))
    _, _, (weights, exp_avg, exp_avg_sq) = state_of(session, "odd", n, 3)
    assert torch.equal(exp_avg, torch.cat([opt.state[r]["exp_avg"] for r in refs]))
    assert torch.equal(exp_avg_sq, torch.cat([opt.state[r]["exp_avg_sq"] for r in refs]))
    with pytest.raises(fuyou_client.FuyouClientError, match="tensors: the pieces hold"):
        session.step_group_async("odd", g, lr, out=w, tensors=named[:-3]).result(60)
    with pytest.raises(fuyou_client.FuyouClientError, match="do not fit a tensor"):
        session.step_group_async("odd", g, lr, out=w, tensors=[n, 1, n]).result(60)
