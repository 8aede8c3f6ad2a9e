"""Frozen parameters (requires_grad=False at attach): no optimizer state and no SSD writes;
an offloaded block's frozen weights are stored once and fetched for compute with its
trained ones; training equals torch's AdamW on the trainable parameters; export holds
them all."""
from __future__ import annotations

import copy

import pytest
import torch

import fuyou_client
from conftest import HYPER, STREAMING, private_daemon, step_pair, tiny_gpt2

transformers = pytest.importorskip("transformers")



@pytest.fixture(scope="module")
def daemon():
    with private_daemon(STREAMING, "fy-fz-") as d:
        yield d


def gpt2():
    return tiny_gpt2(layers=6)


def freeze(model):
    """A frozen embedding, two frozen lower blocks, a block whose attention is frozen (its
    MLP and norms train: adapters on a frozen base, in miniature)."""
    model.transformer.wpe.weight.requires_grad_(False)
    for block in model.transformer.h[:2]:
        block.requires_grad_(False)
    model.transformer.h[3].attn.requires_grad_(False)
    return model


def one_iteration_bytes(session, step):
    before = session.status()
    step()
    after = session.status()
    return after.bytes_read - before.bytes_read, after.bytes_written - before.bytes_written


@pytest.mark.parametrize("offload", [True, False], ids=["offload", "resident"])
def test_frozen_parameters_train_like_torch_and_write_nothing(daemon, offload, tmp_path):
    torch.manual_seed(0)
    ours = freeze(gpt2())
    ref = copy.deepcopy(ours)
    trained = sum(p.numel() for p in ours.parameters() if p.requires_grad)
    engine = fuyou_client.attach(ours, fuyou_client.AdamW(**HYPER), socket=daemon.socket, offload=offload)
    opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], **HYPER, fused=True)
    session = engine.session
    state_objects = [o.name for o in session.objects("optim/")]
    assert "optim/block0000" not in state_objects and "optim/block0001" not in state_objects  # (frozen blocks)
    assert sum(g.numel for g in engine.groups) == trained
    state = sum(session.stat(name).size for name in state_objects)
    gen = torch.Generator().manual_seed(1)

    def step():
        step_pair(ours, engine, ref, opt, torch.randint(0, 256, (2, 16), generator=gen))

    for _ in range(3):
        read, written = one_iteration_bytes(session, step)
        assert written == state  # every trained group's state, and nothing else (frozen: never written)
    if offload:
        frozen = [o for o in session.objects("frozen/")]
        assert sorted(o.name for o in frozen) == ["frozen/block0000", "frozen/block0001", "frozen/block0003"]
        assert engine.offloader.fetched_bytes > 0
    else:
        assert not session.objects("frozen/")
    engine.export(tmp_path / "out")
    exported = fuyou_client.load_exported(tmp_path / "out")
    engine.close()
    for name, p in ref.named_parameters():
        assert torch.equal(dict(ours.named_parameters())[name], p), name
        assert torch.equal(exported[name], p), name
    assert not ours.transformer.h[0].attn.c_attn.weight.requires_grad


def test_a_frozen_block_is_fetched_not_stepped_and_costs_no_state(daemon):
    """Offloaded, a wholly frozen block's weights are read for its forward (and its
    backward, where an earlier block trains); its state objects and steps are none."""
    torch.manual_seed(0)
    ours = gpt2()
    for block in ours.transformer.h[2:4]:
        block.requires_grad_(False)
    ref = copy.deepcopy(ours)
    engine = fuyou_client.attach(ours, fuyou_client.AdamW(**HYPER), socket=daemon.socket, prefetch=1)
    opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], **HYPER, fused=True)
    names = [g.spec.name for g in engine.groups]
    assert names[:6] == [f"block{i:04d}" for i in range(6)]
    assert [g.spec.numel == 0 for g in engine.groups[:6]] == [False, False, True, True, False, False]
    for _ in range(3):
        step_pair(ours, engine, ref, opt, torch.randint(0, 256, (2, 16)))
    assert {i.step for i in engine.last_step_infos} == {3} and len(engine.last_step_infos) == 5
    engine.close()
    for (name, a), b in zip(ours.named_parameters(), ref.parameters()):
        assert torch.equal(a, b), name
