"""A recomputed block whose frozen parameters come before its trained ones (a PEFT base, a frozen
layer norm: what TRL's default gradient_checkpointing=True meets with LoRA) trains bitwise as torch
does: its recomputed graph keeps the frozen parameters themselves, so their slot stays until
backward is past the block (steps/coordinator.py); it was given back when the trained ones were
final, and the layer norm's backward read an empty placeholder."""
from __future__ import annotations

import copy

import pytest
import torch

import fuyou_client
from conftest import HYPER, STREAMING, private_daemon, step_pair, tiny_gpt2

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def daemon():
    with private_daemon(STREAMING, "fy-recf-") as d:
        yield d


@pytest.mark.parametrize("activations", ["recompute", "keep"])
def test_a_block_frozen_before_its_trained_parameters_trains_bitwise(daemon, activations):
    torch.manual_seed(0)
    ours = tiny_gpt2()
    for block in ours.transformer.h:
        block.ln_1.requires_grad_(False)
        block.attn.c_attn.requires_grad_(False)
    ref = copy.deepcopy(ours)
    engine = fuyou_client.attach(ours, fuyou_client.AdamW(**HYPER), socket=daemon.socket, activations=activations)
    opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], **HYPER, fused=True)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        step_pair(ours, engine, ref, opt, torch.randint(0, 256, (2, 16), generator=gen))
    got = ours.state_dict()
    for name, p in ref.state_dict().items():
        assert torch.equal(got[name], p), name
    engine.close()
