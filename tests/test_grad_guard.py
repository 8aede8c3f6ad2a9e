"""A gradient written after its group's step went to fuyoud (clip_grad_norm_ after
backward, as a loop written for torch does) is refused before anything is written; read,
it is the gradient; after zero_grad the next backward is the user's again."""
from __future__ import annotations

import copy

import pytest
import torch

import fuyou_client
from conftest import HYPER, SMALL, merge, private_daemon, tiny_gpt2

transformers = pytest.importorskip("transformers")



@pytest.fixture(scope="module")
def daemon():
    with private_daemon(merge(SMALL, {"storage": {"capacity_per_device": "1GiB"}}), "fy-gg-") as d:
        yield d


def gpt2():
    return tiny_gpt2(layers=3)


@pytest.mark.parametrize("offload", [True, False], ids=["offload", "resident"])
def test_clipping_after_the_steps_went_is_refused(daemon, offload):
    torch.manual_seed(0)
    ours = gpt2()
    ref = copy.deepcopy(ours)
    engine = fuyou_client.attach(ours, fuyou_client.AdamW(**HYPER), socket=daemon.socket, offload=offload)
    opt = torch.optim.AdamW(ref.parameters(), **HYPER, fused=True)
    x = torch.randint(0, 256, (2, 16))
    for step in range(2):
        ours(x, labels=x).loss.backward()
        ref(x, labels=x).loss.backward()
        if step == 0:
            norm = torch.nn.utils.get_total_norm([p.grad for p in ours.parameters() if p.grad is not None])
            assert torch.equal(norm, torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()]))  # reads
            with pytest.raises(RuntimeError, match=r"gradient of .* \(group [a-z0-9]+\) was written after its "
                                                   r"layer group's step went to fuyoud.*attach\(max_grad_norm"):
                torch.nn.utils.clip_grad_norm_(ours.parameters(), 1e-3)
            with pytest.raises(RuntimeError, match="after its layer group's step went"):
                ours.transformer.h[0].mlp.c_fc.bias.grad.mul_(2.0)
        engine.step()
        engine.zero_grad()
        opt.step()  # (unclipped: the refused writes changed nothing)
        opt.zero_grad()
    p = ours.transformer.wte.weight
    assert p.grad is None or type(p.grad) is torch.Tensor  # plain again after zero_grad
    engine.close()
    for (name, a), b in zip(ours.named_parameters(), ref.parameters()):
        assert torch.equal(a, b), name


def test_with_max_grad_norm_the_gradients_are_the_loops_until_step(daemon):
    """Exact clipping: nothing leaves before engine.step(), so the loop may still scale
    gradients (here: a manual unscale) and the step uses what it left."""
    torch.manual_seed(0)
    ours = gpt2()
    ref = copy.deepcopy(ours)
    engine = fuyou_client.attach(ours, fuyou_client.AdamW(**HYPER), socket=daemon.socket, max_grad_norm=1.0)
    opt = torch.optim.AdamW(ref.parameters(), **HYPER, fused=True)
    x = torch.randint(0, 256, (2, 16))
    for model in (ours, ref):
        (model(x, labels=x).loss * 4.0).backward()
        for p in model.parameters():
            p.grad.div_(4.0)
    engine.step()
    torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
    opt.step()
    engine.close()
    for (name, a), b in zip(ours.named_parameters(), ref.parameters()):
        assert torch.equal(a, b), name
