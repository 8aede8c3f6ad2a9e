"""A mixture of experts' fused experts cut into parts (model/experts.py): the cut model
computes and trains bitwise as the uncut one, keeps the model's own names, and comes back
whole.

The families are test_families.py's tiny random models (4 experts; gpt-oss 16, with
biases and its interleaved, clamped gate), cut into 3 parts (unequal: 1+1+2 and 5+5+6
experts) so that a part boundary falls inside the top-2 of many tokens.
"""
from __future__ import annotations

import copy

import pytest
import torch

import fuyou_client
from fuyou_client.model.experts import ExpertPart, ExpertsNotCut, cut_experts, fused_names, uncut_experts
from test_families import build, daemon, train_pair  # noqa: F401 - daemon: the fixture

transformers = pytest.importorskip("transformers")

CUT = ("qwen3-moe", "deepseek-v3", "gpt-oss", "olmoe", "qwen2-moe", "glm4-moe", "qwen3-next")
DEFAULT_TIER = ("qwen3-moe", "gpt-oss")


def _family(f):
    return pytest.param(f, id=f, marks=() if f in DEFAULT_TIER else pytest.mark.slow)


@pytest.mark.parametrize("family", [_family(f) for f in CUT])
def test_cut_experts_compute_bitwise_as_the_fused_ones(family):
    torch.manual_seed(0)
    whole = build(family)
    cut = copy.deepcopy(whole)
    names = cut_experts(cut, 3)
    assert names and all(isinstance(m, ExpertPart) for n in names for m in cut.get_submodule(n).parts)
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    loss, ref = cut(x, labels=x).loss, whole(x, labels=x).loss
    loss.backward()
    ref.backward()
    assert loss.item() == ref.item()
    rows, grads = fused_names(cut), dict(whole.named_parameters())
    assert rows
    for name, p in cut.named_parameters():
        r = rows.get(id(p))
        expected = grads[r.name].grad[r.start:r.stop] if r else grads[name].grad
        assert torch.equal(p.grad, expected), name
    # the model's own names and values, either way
    mine, theirs = cut.state_dict(), whole.state_dict()
    assert list(mine) == list(theirs)
    assert all(torch.equal(mine[k], theirs[k]) for k in theirs)


def test_fused_tensors_load_into_the_parts_and_come_back_whole():
    torch.manual_seed(0)
    source, target = build("gpt-oss"), build("gpt-oss")
    cut_experts(target, 3)
    target.load_state_dict(source.state_dict())
    uncut_experts(target, values=True)
    assert not any(isinstance(m, ExpertPart) for m in target.modules())
    names = [n for n, _ in source.named_parameters()]
    assert [n for n, _ in target.named_parameters()] == names
    assert all(torch.equal(a, b) for a, b in zip(source.state_dict().values(), target.state_dict().values()))


def test_experts_computed_otherwise_than_grouped_mm_are_not_cut():
    model = build("qwen3-moe")
    model.set_experts_implementation("eager")
    with pytest.raises(ExpertsNotCut, match="'eager'.*grouped_mm"):
        cut_experts(model)
    assert not any(isinstance(m, ExpertPart) for m in model.modules())  # (nothing changed)


@pytest.mark.parametrize("family", [_family(f) for f in ("qwen3-moe", "gpt-oss", "deepseek-v3", "gpt-oss-60")])
def test_cut_experts_train_bitwise_as_torch_adamw(daemon, family):
    """Offloaded with each part a sub-block of its own: clipped, accumulated, 3 steps, every
    loss and parameter as torch's fused AdamW on the uncut model; whole again after close.
    gpt-oss-60: an expert's down-projection bias is 60 elements, so a part starts inside
    torch's vector loop of the fused tensor and fuyoud steps each element in the lane torch
    does (the part's offset in the fused tensor, model/blocks.py ROWS_OF)."""
    ours, ref, losses, ref_losses, norms = train_pair(family, daemon, True, granularity="expert")
    assert losses == ref_losses
    assert not any(isinstance(m, ExpertPart) for m in ours.modules())  # (close joined the parts)
    mine, theirs = ours.state_dict(), ref.state_dict()
    assert list(mine) == list(theirs)
    for k in theirs:
        assert torch.equal(mine[k], theirs[k]), k


def test_an_engine_fetches_each_part_around_its_use(daemon):
    torch.manual_seed(0)
    model = build("gpt-oss")
    engine = fuyou_client.attach(model, socket=daemon.socket, offload=True, granularity="expert")
    try:
        names = {og.name: og for og in engine.offloader.groups}
        parts = [og for og in names.values() if any(isinstance(m, ExpertPart) for m in og.uses)]
        assert len(parts) == 2 * 16  # 2 blocks of 16 experts, 16 parts each
        x = torch.randint(0, 256, (2, 16))
        model(x, labels=x).loss.backward()
        engine.step()
    finally:
        engine.close()
    assert not any(isinstance(m, ExpertPart) for m in model.modules())


def _steps(model, engine, steps=2, shape=(2, 16)):
    """``steps`` steps of one seeded micro-batch each: their losses (the engine left open)."""
    gen, losses = torch.Generator().manual_seed(1), []
    for _ in range(steps):
        x = torch.randint(0, 256, shape, generator=gen)
        loss = model(x, labels=x).loss
        loss.backward()
        losses.append(loss.item())
        engine.step()
        engine.zero_grad()
    return losses


@pytest.mark.parametrize("weights", ["init", "dir"])
def test_a_meta_model_is_made_real_whole_and_trained_in_parts(daemon, tmp_path, weights):
    """From the meta device, by the model's init (bitwise the values of a CPU build) or from
    a safetensors checkpoint: the fused experts are made real whole, by their own names, the
    parts view their rows; training is bitwise the CPU-built model's by whole blocks."""
    torch.manual_seed(0)
    cpu = build("gpt-oss")
    if weights == "dir":
        cpu.save_pretrained(tmp_path / "ckpt")
    torch.manual_seed(0)
    with torch.device("meta"):
        meta = type(cpu)(cpu.config).float().train()
    meta.config._experts_implementation = cpu.config._experts_implementation
    source = "init" if weights == "init" else str(tmp_path / "ckpt")
    engine = fuyou_client.attach(meta, fuyou_client.AdamW(lr=3e-3), socket=daemon.socket, offload=True,
                                 granularity="expert", weights=source)
    assert any(isinstance(m, ExpertPart) for m in meta.modules())
    losses = _steps(meta, engine)
    engine.close()
    ref = copy.deepcopy(cpu) if weights == "dir" else cpu
    ref_engine = fuyou_client.attach(ref, fuyou_client.AdamW(lr=3e-3), socket=daemon.socket, offload=True,
                                     granularity="block")
    ref_losses = _steps(ref, ref_engine)
    ref_engine.close()
    assert losses == ref_losses
    mine, theirs = meta.state_dict(), ref.state_dict()
    assert list(mine) == list(theirs)
    for k in theirs:
        assert torch.equal(mine[k], theirs[k]), k


def test_auto_cuts_the_experts_where_their_module_does_not_fit_the_device(daemon):
    """A stand-in device capped below one block's fused experts: "auto" tries whole blocks,
    then modules (the experts module alone is past the cap), then expert parts, and trains
    bitwise as whole blocks on an uncapped one, within the cap; the plan says so."""
    from discrete_device import LateCopyDevice
    torch.manual_seed(0)
    experts = sum(p.numel() * p.element_size() for p in build("gpt-oss").model.layers[0].mlp.experts.parameters())
    runs = []
    for device, options in ((LateCopyDevice(seed=3, capacity=experts - 1), {}),
                            (LateCopyDevice(seed=4), {"granularity": "block"})):
        torch.manual_seed(0)
        model = build("gpt-oss")
        engine = fuyou_client.attach(model, fuyou_client.AdamW(lr=3e-3, weight_decay=0.1), socket=daemon.socket,
                                     device=device, max_grad_norm=0.05, grad_accumulation="host", **options)
        losses = _steps(model, engine, shape=(1, 8))
        plan = engine.memory_plan().device
        engine.close()
        runs.append((model, losses, plan, device))
    (cut, cut_losses, cut_plan, capped), (whole, whole_losses, whole_plan, _) = runs
    assert cut_plan.granularity == "expert" and whole_plan.granularity == "block"
    assert "by expert" in cut_plan.describe()
    assert capped.peak <= cut_plan.total(8, activations=False) <= experts - 1  # (what the engine allocated)
    assert cut_losses == whole_losses
    for (name, a), b in zip(cut.state_dict().items(), whole.state_dict().values()):
        assert torch.equal(a, b), name


def test_an_export_writes_the_fused_tensors_by_their_names(daemon, tmp_path):
    """engine.export of a model trained in expert parts: the fused tensors under the
    model's own names, loadable by from_pretrained into the uncut model, equal to what
    close gives back."""
    torch.manual_seed(0)
    model = build("qwen3-moe")
    engine = fuyou_client.attach(model, fuyou_client.AdamW(lr=3e-3), socket=daemon.socket, offload=True,
                                 granularity="expert")
    x = torch.randint(0, 256, (2, 16))
    model(x, labels=x).loss.backward()
    engine.step()
    engine.export(tmp_path / "out")
    engine.close()
    loaded = type(model).from_pretrained(tmp_path / "out")
    mine, theirs = loaded.state_dict(), model.state_dict()
    assert list(mine) == list(theirs)
    for k in theirs:
        assert torch.equal(mine[k], theirs[k]), k


def test_auto_takes_expert_parts_where_whole_blocks_give_up_their_read_ahead():
    """A pinned budget that holds whole blocks only without read-ahead (each weight slot one
    block, most of it its experts): "auto" takes expert parts, whose plan keeps it; with
    room for whole blocks' read-ahead, whole blocks (tests the rule both ways)."""
    from conftest import SMALL, merge, private_daemon

    seen = {}
    for budget in ("170MiB", "260MiB"):
        config = merge(SMALL, {"storage": {"capacity_per_device": "1GiB"},
                               "memory": {"pinned_budget": budget, "segment_size": "2MiB", "staging_size": "1MiB"}})
        with private_daemon(config, "fy-ra-") as d:
            for granularity in ("block", "auto"):
                model = build("gpt-oss-wide")
                engine = fuyou_client.attach(model, socket=d.socket, offload=True, granularity=granularity)
                plan = engine.memory_plan()
                parts = any(isinstance(m, ExpertPart) for m in model.modules())
                seen[budget, granularity] = (parts, plan.prefetch, "prefetch" in plan.shrunk)
                engine.close()
    assert seen["170MiB", "block"] == (False, 0, True)
    parts, prefetch, gave_up = seen["170MiB", "auto"]
    assert parts and prefetch >= 1 and not gave_up
    assert seen["260MiB", "block"][2] is False and seen["260MiB", "auto"] == seen["260MiB", "block"]


def test_the_planners_expert_parts_are_attachs(daemon):
    """The planner (sizing/) cuts a block's experts by attach's rule: for a model and a device
    it only describes, its device plan by expert parts holds the bytes attach's does."""
    import dataclasses

    from discrete_device import LateCopyDevice
    from fuyou_client.sizing import estimate as E, hardware, shape as S

    torch.manual_seed(0)
    model = build("gpt-oss-wide").to(torch.bfloat16)  # (the planner plans bf16 on a GPU)
    shape = S.from_model(model)
    assert len(shape.expert_atoms) == len(shape.block_atoms) - 1 + 16
    engine = fuyou_client.attach(model, socket=daemon.socket, device=LateCopyDevice(capacity=1 << 30),
                                 granularity="expert")
    st = engine.session.status()
    gpu = dataclasses.replace(hardware.gpu_profile("h100"), memory=1 << 30)
    host = hardware.Host(gpu, 24 << 30, hardware.Disks(1, 1 << 40, hardware.Rate(1, "x"), hardware.Rate(1, "x")), 2,
                         pinned_budget=st.session_budget_bytes or st.pinned_budget_bytes,
                         buffer_budget=st.optimizer_buffer_budget_bytes, buffers=st.optimizer_buffers,
                         segment=st.segment_bytes)
    est = E.estimate(shape, E.Settings(seq=16, micro_batch=2, granularity="expert", offload=True,
                                       state_dtype="fp32"), host, simulate_time=False)
    ours = engine.memory_plan().device
    theirs = E.device_plan(shape, est.settings, host, E.groups(shape, est.settings, host), est.plan)
    engine.close()
    assert (theirs.fixed_bytes, theirs.granularity) == (ours.fixed_bytes, ours.granularity), f"{theirs}\n{ours}"


def test_a_head_larger_than_the_parts_gets_buffers_of_its_own_size(daemon):
    """Experts cut in parts leave the vocabulary-sized embeddings and head the largest
    groups: they get a slot and gradient buffers of their own size, every other slot and
    buffer a part's (not a head's); trained bitwise as torch's fused AdamW."""
    torch.manual_seed(0)
    model = build("gpt-oss-vocab")
    engine = fuyou_client.attach(model, socket=daemon.socket, offload=True, granularity="expert")
    plan = engine.memory_plan()
    part = max(og.nbytes for og in engine.offloader.groups if any(isinstance(m, ExpertPart) for m in og.uses))
    head = max(og.nbytes for og in engine.offloader.groups)
    engine.close()
    assert head > 4 * part
    assert plan.slot_bytes == part and plan.rest_slot_bytes == head and plan.rest_slots >= 1
    assert plan.grad_bytes == part and plan.rest_grad_bytes == head
    ours, ref, losses, ref_losses, _ = train_pair("gpt-oss-vocab", daemon, True, granularity="expert")
    assert losses == ref_losses
    for (name, a), b in zip(ours.state_dict().items(), ref.state_dict().values()):
        assert torch.equal(a, b), name


def test_each_byte_of_expert_parts_on_each_link_has_its_cause(daemon):
    """Expert parts on the stand-in, train_step over three micro-batches: every weight byte
    uploaded was fetched from the SSD array or served from a step's read-ahead, every
    gradient leaves once at its step and once more for each time its sum waited on the host
    between micro-batches (coming back up as often), and the resident rest's new weights go
    up once: nothing moves that no cause names (as tests/test_subblocks.py for modules)."""
    from discrete_device import LateCopyDevice
    torch.manual_seed(0)
    model = build("qwen3-moe")
    layers, k, shape = 2, 3, (1, 8)
    hidden = shape[0] * shape[1] * 64 * 4
    all_bytes = sum(p.numel() * 4 for p in model.parameters())
    device = LateCopyDevice(seed=9)
    engine = fuyou_client.attach(model, fuyou_client.AdamW(lr=1e-3), socket=daemon.socket, device=device,
                                 granularity="expert")
    off, pool = engine.offloader, engine.gradients
    gen = torch.Generator().manual_seed(1)
    for _ in range(2):
        micro_batches = [torch.randint(0, 256, shape, generator=gen) for _ in range(k)]
        up, down = device.bytes_up, device.bytes_down
        fetched, served, parked = off.fetched_bytes, off.served_bytes, pool.parked_bytes
        engine.train_step(micro_batches, lambda x: model(x, labels=x).loss / k)
        weights_up = (off.fetched_bytes - fetched) + (off.served_bytes - served)
        parked = pool.parked_bytes - parked
        assert parked > 0  # (each part's sum waited between the micro-batches)
        checkpoints_down = ((layers + 1) + 1 + layers) * k * hidden
        checkpoints_up = (layers + 2 * layers + 2) * k * hidden
        assert device.bytes_down - down == all_bytes + parked + checkpoints_down
        resident = sum(g.numel * 4 for g in engine.groups if g.offloaded is None)
        assert device.bytes_up - up == weights_up + resident + parked + checkpoints_up
    engine.close()
