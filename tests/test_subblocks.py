"""Layer groups finer than a block (``granularity="module"``: model/cuts.py) and the compute
device's memory plan (memory/device_plan.py).

The spec: a model whose block does not fit the device trains bitwise as the whole-block
path does, by its modules: the ordinary loop (with accumulation and clipping) and
``train_step``, GPT-2 (tied embeddings: one group used at both ends) and Llama, fp32 and
bf16 compute, on the CPU (sub-blocks asked for) and on the late-copy stand-in with its
memory capped below one block's bytes (``granularity="auto"`` chooses them); what cannot fit
is refused before any work, naming the bytes and what would fit; a device that runs out
anyway (something else took memory) says so with the plan's figures, and the state stays
resumable. The planner's GPU memory is this plan.
"""
from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import transformers
from torch import nn

import fuyou_client
from conftest import HYPER, tiny_gpt2, tiny_llama
from discrete_device import LateCopyDevice
from fuyou_client.errors import DeviceOutOfMemory, ResourceExhausted
from fuyou_client.memory import DeviceDoesNotFit
from test_attach import daemon  # noqa: F401 (a module-scoped fuyoud)

pytest.importorskip("transformers")
K, STEPS, SHAPE = 3, 2, (1, 8)  # (a micro-batch small beside a block: a device below one block holds it)


def batches(k: int = K, steps: int = STEPS, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randint(0, 256, SHAPE, generator=gen) for _ in range(k)] for _ in range(steps)]


def block_bytes(model) -> int:
    blocks = model.transformer.h if hasattr(model, "transformer") else model.model.layers
    return sum(p.numel() * p.element_size() for p in blocks[0].parameters())


def train(make_model, daemon, dtype, schedule: str, device, **options):
    """``STEPS`` iterations of ``K`` micro-batches: by ``train_step`` or by the ordinary loop
    (accumulation ``K``); the model, its losses and the engine's groups' names."""
    torch.manual_seed(0)
    model = make_model().to(dtype)
    if schedule == "loop":
        options["accumulation_steps"] = K
    engine = fuyou_client.attach(model, fuyou_client.AdamW(**HYPER), socket=daemon.socket, device=device, **options)
    losses = []
    for micro_batches in batches():
        if schedule == "step":
            losses.append(engine.train_step(micro_batches, lambda x: model(x, labels=x).loss / K))
        else:
            for x in micro_batches:
                loss = model(x, labels=x).loss / K
                loss.backward()
                losses.append(loss.detach())
            engine.step()
            engine.zero_grad()
    dplan = engine.memory_plan().device
    names = [g.spec.name for g in engine.groups]
    engine.close()
    return (model, torch.stack([torch.as_tensor(x).reshape(-1) for x in losses]).flatten(), names,
            dplan.granularity if dplan else None, dplan)


def gpt2():
    return tiny_gpt2(width=128)  # (a block several times the kept inputs of a micro-batch: a cap below it holds them)


def llama():
    return tiny_llama(width=128)


CASES = {  # (model, dtype, schedule, options): on a capped device, gradients kept for a step go to the host
    "gpt2-step": (gpt2, torch.float32, "step", {}),
    "llama-step-bf16": (llama, torch.bfloat16, "step", {}),
    "gpt2-loop-clip": (gpt2, torch.float32, "loop", {"max_grad_norm": 0.05}),
    "llama-loop": (llama, torch.float32, "loop", {}),
    "gpt2-step-bf16-clip": (gpt2, torch.bfloat16, "step", {"max_grad_norm": 0.05}),
}
CHEAP = {("gpt2-step", "stand-in"), ("llama-loop", "cpu")}


def params():
    return [pytest.param(case, where, id=f"{case}-{where}",
                         marks=() if (case, where) in CHEAP else pytest.mark.slow)
            for case in CASES for where in ("cpu", "stand-in")]


@pytest.mark.parametrize("case, where", params())
def test_sub_blocks_train_bitwise_as_whole_blocks(daemon, case, where):
    make_model, dtype, schedule, options = CASES[case]
    if where == "stand-in":
        cap = block_bytes(make_model().to(dtype)) - 1  # below one block's weights
        capped, whole = LateCopyDevice(seed=3, capacity=cap), LateCopyDevice(seed=4)
        if schedule == "loop" or "max_grad_norm" in options:  # (kept until the step: on the host, fp32 sums)
            options = options | {"grad_accumulation": "host"}
        a = train(make_model, daemon, dtype, schedule, capped, **options)
        b = train(make_model, daemon, dtype, schedule, whole, granularity="block", **options)
        assert a[3] == "module" and b[3] == "block"  # (auto chose sub-blocks: a block does not fit)
        # what the engine allocated on the device: within the plan (its fixed part and the kept inputs it
        # counts per token), and all of the fixed part where autograd makes no gradients there itself (as
        # .grad, the stand-in does not count: host accumulation's)
        assert capped.peak <= a[4].total(SHAPE[0] * SHAPE[1], activations=False) <= cap
        if "grad_accumulation" not in options:
            assert a[4].fixed_bytes <= capped.peak
    else:
        a = train(make_model, daemon, dtype, schedule, None, granularity="module", **options)
        b = train(make_model, daemon, dtype, schedule, None, granularity="block", **options)
    assert any(".m" in n for n in a[2]) and not any(".m" in n for n in b[2])
    assert torch.equal(a[1], b[1]), "losses"
    for (name, x), y in zip(a[0].state_dict().items(), b[0].state_dict().values()):
        assert torch.equal(x, y), f"{name}: max diff {(x.float() - y.float()).abs().max().item()}"


def test_the_cut_follows_the_modules():
    """GPT-2: each projection and MLP matrix a sub-block fetched around itself; the norms in
    the block's own group; the tied embedding and head one group with both modules as its
    uses, the position embeddings with it (their gradients are final together); the final
    norm resident. Llama with narrow key and value projections (GQA): those stay in the
    block's own group. A weight two norms share is one group; a frozen weight goes with its
    module. The planner's shapes cut the same modules."""
    from fuyou_client.model import cut, split
    from fuyou_client.sizing import shape as S

    torch.manual_seed(0)
    gpt2 = tiny_gpt2()
    groups = {g.name: g for g in cut(split(gpt2), gpt2)}
    h0 = gpt2.transformer.h[0]
    assert [n for n, _ in groups["block0000"].params] == ["ln_1.weight", "ln_1.bias", "ln_2.weight", "ln_2.bias"]
    assert groups["block0000"].uses == (h0,)
    assert [g.uses for n, g in groups.items() if n.startswith("block0000.")] == \
        [(h0.attn.c_attn,), (h0.attn.c_proj,), (h0.mlp.c_fc,), (h0.mlp.c_proj,)]
    emb = groups["rest.m1"]
    assert set(map(id, emb.uses)) == {id(gpt2.transformer.wte), id(gpt2.lm_head), id(gpt2.transformer.wpe)}
    assert emb.early and emb.is_rest and [n for n, _ in groups["rest"].params] == ["transformer.ln_f.weight",
                                                                                  "transformer.ln_f.bias"]
    assert sorted(n for n, _ in S.from_model(gpt2).block_atoms) == \
        sorted(n for n, _ in S.from_config(gpt2.config.to_dict()).block_atoms)

    llama = tiny_llama()
    llama_gqa = type(llama)(type(llama.config)(**(llama.config.to_dict() | {"num_key_value_heads": 1})))
    for model, own in ((llama, ["input_layernorm.weight", "post_attention_layernorm.weight"]),
                       (llama_gqa, ["self_attn.k_proj.weight", "self_attn.v_proj.weight", "input_layernorm.weight",
                                    "post_attention_layernorm.weight"])):
        groups = {g.name: g for g in cut(split(model), model)}
        assert [n for n, _ in groups["block0000"].params] == own
        assert sorted(n for n, _ in S.from_model(model).block_atoms) == \
            sorted(n for n, _ in S.from_config(model.config.to_dict()).block_atoms)

    class Block(nn.Module):  # (two norms sharing a weight; a frozen projection)
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.LayerNorm(32), nn.LayerNorm(32)
            self.b.weight = self.a.weight
            self.up, self.down = nn.Linear(32, 128), nn.Linear(128, 32)
            self.up.weight.requires_grad_(False)

    model = nn.Sequential(nn.ModuleList([Block(), Block()]))
    groups = {g.name: g for g in cut(split(model, list(model[0])), model)}
    assert [n for n, _ in groups["block0000"].params] == ["a.weight", "a.bias", "b.bias"]  # (the shared one once)
    up = next(g for n, g in groups.items() if n.startswith("block0000.") and g.uses == (model[0][0].up,))
    assert [n for n, _ in up.frozen] == ["up.weight"] and [n for n, _ in up.params] == ["up.bias"]


def test_what_does_not_fit_is_refused_before_any_work(daemon):
    """A device budget below the largest sub-block, one above what the device has, whole
    blocks asked for on a device that holds only sub-blocks, device_memory on the CPU, a
    granularity that does not exist: each refused at attach, the model as it came, with the
    numbers. Micro-batches larger than the plan's room: refused by train_step before any work."""
    torch.manual_seed(0)
    model = tiny_gpt2()
    before = copy.deepcopy(model.state_dict())
    block = block_bytes(model)
    attach = lambda **kw: fuyou_client.attach(model, fuyou_client.AdamW(**HYPER), socket=daemon.socket, **kw)  # noqa: E731
    with pytest.raises(DeviceDoesNotFit, match=r"by module, the device plan holds .* and the budget is 1000 B; its "
                                               r"largest module alone is 72\.0 KiB"):
        attach(device=LateCopyDevice(capacity=1 << 20), device_memory=1000)
    with pytest.raises(DeviceDoesNotFit, match=r"device_memory=2097152 \(2\.0 MiB\) is more than the compute device "
                                               r"has for this process \(1\.0 MiB free"):
        attach(device=LateCopyDevice(capacity=1 << 20), device_memory=2 << 20)
    with pytest.raises(DeviceDoesNotFit, match=r"by block, .*its largest block alone is 195\.2 KiB.*To fit: .*"
                                               r"granularity=\"module\""):
        attach(device=LateCopyDevice(capacity=block - 1), granularity="block")
    with pytest.raises(ValueError, match="the model computes on the CPU"):
        attach(device_memory=1 << 30)
    with pytest.raises(ValueError, match="granularity must be one of"):
        attach(granularity="layer")
    for name, value in before.items():  # (nothing was taken: the parameters are as they came)
        assert torch.equal(model.state_dict()[name], value), name
    engine = attach(device=LateCopyDevice(capacity=block - 1))
    with pytest.raises(ResourceExhausted, match=r"train_step's micro-batches do not fit the device plan: .* for 4096 "
                                                r"tokens a micro-batch.* pass micro-batches of at most \d+ tokens"):
        engine.train_step([torch.randint(0, 256, (2, 2048))], lambda x: model(x, labels=x).loss)
    assert engine.part_steps() == {0: 0}  # (nothing ran)
    engine.close()


def test_a_device_that_runs_out_anyway_names_the_plan_and_the_state_resumes(daemon, tmp_path):
    """Something else takes the device's memory after attach (here: the stand-in's capacity
    shrinks mid-run): train_step fails with DeviceOutOfMemory (a torch.OutOfMemoryError
    too) naming the plan's figures and what is allocated; the steps already sent landed,
    the others were not taken; the memory back, training goes on, and a checkpoint taken
    then resumes bitwise."""
    torch.manual_seed(0)
    model = tiny_gpt2()
    cap = block_bytes(model) - 1
    device = LateCopyDevice(seed=5, capacity=cap)
    engine = fuyou_client.attach(model, fuyou_client.AdamW(**HYPER), socket=daemon.socket, device=device)
    loss = lambda x: model(x, labels=x).loss  # noqa: E731
    first, second = batches(k=1)
    engine.train_step(first, loss)
    device.capacity = device.live_bytes() + 100  # (another process took the rest)
    with pytest.raises(DeviceOutOfMemory, match=r"ran out of memory during train_step .* allocated now; the device "
                                                r"plan counted on .* fixed within a budget of") as caught:
        engine.train_step(second, loss)
    assert isinstance(caught.value, torch.OutOfMemoryError)
    device.capacity = cap
    engine.train_step(second, loss)
    engine.save_checkpoint(tmp_path / "ckpt")
    engine.train_step(first, loss)
    engine.close()
    torch.manual_seed(1)
    again = tiny_gpt2()
    resumed = fuyou_client.attach(again, fuyou_client.AdamW(**HYPER), socket=daemon.socket,
                                  device=LateCopyDevice(seed=6, capacity=cap), resume=tmp_path / "ckpt")
    resumed.train_step(first, lambda x: again(x, labels=x).loss)
    resumed.close()
    for (name, x), y in zip(model.state_dict().items(), again.state_dict().values()):
        assert torch.equal(x, y), name
    # ("auto" takes the checkpoint's groups, on the CPU too; whole blocks asked for are refused, named)
    with pytest.raises(ValueError, match=r"the checkpoint's layer groups are by module .* resume with "
                                         r"granularity='module' or 'auto'"):
        fuyou_client.attach(tiny_gpt2(), fuyou_client.AdamW(**HYPER), socket=daemon.socket, granularity="block",
                            resume=tmp_path / "ckpt")


def test_memory_plan_shows_the_device_beside_the_pinned_side(daemon):
    torch.manual_seed(0)
    model = tiny_gpt2()
    block = block_bytes(model)
    engine = fuyou_client.attach(model, fuyou_client.AdamW(**HYPER), socket=daemon.socket,
                                 device=LateCopyDevice(capacity=block - 1))
    text = str(engine.memory_plan())
    assert "memory plan:" in text and "device plan:" in text and "weights come to it by module" in text
    dplan = engine.memory_plan().device
    assert dplan.fixed_bytes <= dplan.budget < block
    engine.close()


def tiny_gpt2_one_operator_gelu(**kw):
    model = tiny_gpt2(**kw)
    model.config.activation_function = "gelu_pytorch_tanh"  # (the planner reads it; attach, the module)
    for block in model.transformer.h:
        block.mlp.act = transformers.activations.ACT2FN["gelu_pytorch_tanh"]
    return model


@pytest.mark.parametrize("make", [tiny_gpt2, tiny_gpt2_one_operator_gelu, tiny_llama])
def test_the_planners_gpu_memory_is_the_device_plan(daemon, make):
    """The planner (sizing/) and attach make one device plan: for a model and a device the
    planner only describes, its fixed bytes are those attach holds (the same groups, cut
    by the same rule, with the memory plan's counts), and its bytes per token too (a block's
    saved activations by its layout, GPT-2's with its GELU written out or as one operator,
    or Llama's, and its MLP's width: read from the config by the planner, from the block's
    matrices and modules by attach)."""
    from fuyou_client.sizing import estimate as E, hardware, kernels, shape as S

    torch.manual_seed(0)
    model = make(layers=4, width=128, vocab=512).to(torch.bfloat16)  # (the planner plans bf16 on a GPU)
    shape = S.from_model(model)
    st_budget = None
    for granularity in ("block", "module"):
        engine = fuyou_client.attach(copy.deepcopy(model), fuyou_client.AdamW(**HYPER), socket=daemon.socket,
                                     device=LateCopyDevice(capacity=1 << 30), granularity=granularity,
                                     activations="recompute")
        st = engine.session.status()
        st_budget = st.session_budget_bytes or st.pinned_budget_bytes
        gpu = dataclasses.replace(hardware.gpu_profile("h100"), memory=1 << 30)
        host = hardware.Host(gpu, 24 << 30, hardware.Disks(1, 1 << 40, hardware.Rate(1, "x"), hardware.Rate(1, "x")),
                             2, pinned_budget=st_budget, buffer_budget=st.optimizer_buffer_budget_bytes,
                             buffers=st.optimizer_buffers, segment=st.segment_bytes)
        est = E.estimate(shape, E.Settings(seq=16, micro_batch=2, granularity=granularity, offload=True,
                                           state_dtype="fp32"), host, simulate_time=False)
        ours = engine.memory_plan().device
        theirs = E.device_plan(shape, est.settings, host, E.groups(shape, est.settings, host), est.plan)
        engine.close()
        assert (theirs.fixed_bytes, theirs.granularity) == (ours.fixed_bytes, ours.granularity), f"{theirs}\n{ours}"
        assert theirs.per_token == ours.per_token, f"{theirs}\n{ours}"
    assert kernels.layout(shape) == {tiny_gpt2: "gpt2", tiny_llama: "llama"}.get(make, "gpt2-fused")


def test_each_byte_on_each_link_has_its_cause(daemon):
    """Sub-blocks on the stand-in, three micro-batches a step: every weight byte uploaded was
    fetched from the SSD array or served from a step's read-ahead (none for those used again
    from their slots), the resident rest's new weights go up once, every gradient leaves once
    at its step and once more for each time its sum waited on the host between micro-batches
    (coming back up as often), and the kept inputs move as for whole blocks (test_blockmajor.py)."""
    torch.manual_seed(0)
    model = tiny_gpt2(layers=4, width=64)
    layers, hidden = 4, SHAPE[0] * SHAPE[1] * 64 * 4
    all_bytes = sum(p.numel() * 4 for p in model.parameters())
    device = LateCopyDevice(seed=9)
    engine = fuyou_client.attach(model, fuyou_client.AdamW(**HYPER), socket=daemon.socket, device=device,
                                 granularity="module")
    off, pool = engine.offloader, engine.gradients
    for micro_batches in batches():
        up, down = device.bytes_up, device.bytes_down
        fetched, served, parked = off.fetched_bytes, off.served_bytes, pool.parked_bytes
        engine.train_step(micro_batches, lambda x: model(x, labels=x).loss / K)
        weights_up = (off.fetched_bytes - fetched) + (off.served_bytes - served)
        parked = pool.parked_bytes - parked
        assert parked > 0  # (each sub-block's sum waited between the micro-batches)
        checkpoints_down = ((layers + 1) + 1 + layers) * K * hidden
        checkpoints_up = (layers + 2 * layers + 2) * K * hidden
        assert device.bytes_down - down == all_bytes + parked + checkpoints_down
        resident = sum(g.numel * 4 for g in engine.groups if g.offloaded is None)  # (their new weights, up once)
        assert device.bytes_up - up == weights_up + resident + parked + checkpoints_up
    engine.close()


def test_recomputing_a_cut_block_in_the_per_iteration_loop_is_refused_by_name(daemon):  # noqa: F811
    """activations="recompute" (the Trainer's and TRL's gradient_checkpointing=True) with a
    block cut into sub-blocks: torch's checkpoint would keep every recomputed sub-block's
    weights until backward, more than the device holds (and it failed in backward with
    torch's CheckpointError). Refused at the block's first forward with grad, naming the
    ways out; evaluation without grad runs; train_step recomputes cut blocks."""
    torch.manual_seed(0)
    model = tiny_llama(layers=2)
    engine = fuyou_client.attach(model, socket=daemon.socket, granularity="module", activations="recompute")
    try:
        x = torch.randint(0, 256, (2, 16))
        with torch.no_grad():
            assert torch.isfinite(model(input_ids=x).logits).all()
        with pytest.raises(RuntimeError, match="is cut into sub-blocks .* engine.train_step"):
            model(input_ids=x, labels=x)
        engine.train_step([x], lambda b: model(input_ids=b, labels=b).loss)
    finally:
        engine.close(materialize=False)
