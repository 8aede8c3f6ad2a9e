"""A training loop written for Accelerate (prepare, backward, accumulate, a scheduler) runs
through Fuyou with one line changed, the optimizer's: bitwise the same loop with torch's
fused AdamW."""
from __future__ import annotations

import pytest
import torch

import fuyou_client
from conftest import HYPER, SMALL, merge, private_daemon, tiny_gpt2

transformers = pytest.importorskip("transformers")
accelerate = pytest.importorskip("accelerate")



@pytest.fixture(scope="module")
def daemon():
    with private_daemon(merge(SMALL, {"storage": {"capacity_per_device": "1GiB"}}), "fy-ac-") as d:
        yield d


def gpt2():
    torch.manual_seed(0)
    return tiny_gpt2(layers=3)


def loop(make_optimizer, accumulation=2):
    """The Accelerate loop of its documentation, the optimizer made by ``make_optimizer``."""
    accelerate.state.AcceleratorState._reset_state(True)
    accelerator = accelerate.Accelerator(gradient_accumulation_steps=accumulation, cpu=True)
    model = gpt2()
    optimizer = make_optimizer(model, accelerator)  # <- the line that changes
    scheduler = transformers.get_linear_schedule_with_warmup(optimizer, 2, 8)
    rows = torch.randint(0, 256, (24, 16), generator=torch.Generator().manual_seed(3))
    data = torch.utils.data.DataLoader([{"input_ids": r, "labels": r} for r in rows], batch_size=2)
    model, optimizer, data, scheduler = accelerator.prepare(model, optimizer, data, scheduler)
    losses = []
    for batch in data:
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            losses.append(loss.item())
    return model, losses


@pytest.mark.parametrize("offload", [True, False], ids=["offload", "resident"])
def test_an_accelerate_loop_runs_through_fuyou_bitwise(daemon, offload):
    ref, ref_losses = loop(lambda m, a: torch.optim.AdamW(m.parameters(), **HYPER, fused=True))
    engines = []

    def fuyou(m, a):
        engines.append(fuyou_client.attach(m, fuyou_client.AdamW(**HYPER), socket=daemon.socket, offload=offload,
                                           accumulation_steps=a.gradient_accumulation_steps))
        return engines[0].optimizer

    ours, losses = loop(fuyou)
    assert losses == ref_losses and len(losses) == 12
    engines[0].close()
    for (name, a), b in zip(ours.named_parameters(), ref.parameters()):
        assert torch.equal(a, b), name
