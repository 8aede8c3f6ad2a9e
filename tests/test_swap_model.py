"""The planner's model of block-major's swapped activations (sizing/swap_model.py on
iteration.py's timeline; attach(swap_blocks=N)): the bytes it moves, where they spill,
what a swapped block's backward costs, and that the search weighs swapping against
recomputation under the host's memory and links. Pure arithmetic; no timing asserted."""
from __future__ import annotations

import dataclasses
import math

import pytest

from fuyou_client import sizing
from fuyou_proto.units import format_size
from fuyou_client.blockmajor.swapped import swapped_blocks
from fuyou_client.memory.device_plan import SAVED_ACTIVATIONS
from fuyou_client.sizing import hardware, iteration, kernels
from fuyou_client.sizing import shape as S
from fuyou_client.sizing.estimate import Settings, arenas, estimate, kept_inputs, swapped_activations
from fuyou_client.sizing.plan_search import swap_counts
from fuyou_client.sizing.swap_model import activation_bytes, spilled

GPT3_13B = {"model_type": "gpt2", "n_embd": 5120, "n_layer": 40, "n_head": 40, "vocab_size": 50257,
            "n_positions": 2048, "tie_word_embeddings": True}
GPT3_175B = dict(GPT3_13B, n_embd=12288, n_layer=96, n_head=96)
SHAPE = S.from_config(GPT3_13B)


def papers_host(ssds: int = 12, **kw) -> sizing.Host:
    return sizing.host("rtx4090", ram="768GiB", ssd=f"{ssds}x6.5/3.4GB/s", cores=32, **kw)


def rates(host=None, **changes) -> iteration.Rates:
    from fuyou_client.sizing.estimate import rates as of
    return dataclasses.replace(of(host or papers_host(), "fp16"), **changes)


def schedule(**kw) -> iteration.Schedule:
    return iteration.Schedule(seq=1024, micro=32, accum=2, weights="host", grad_bytes=2, **kw)


def test_a_swapped_blocks_backward_is_the_recomputed_one_less_its_forward():
    """The kernel model's "backward only" is the gradients' kernels alone: a recomputed
    backward is exactly the forward plus it (no fitted factor)."""
    k = hardware.PROFILES["rtx4090"].kernels_for("fp16")
    parts = {w: k.block_seconds(SHAPE, 32, 1024, w, "fp16") for w in ("forward", "backward", "backward only")}
    assert parts["backward"] == pytest.approx(parts["forward"] + parts["backward only"])
    assert parts["backward only"] > parts["forward"]
    flat = iteration.Rates(ssd_read=1, ssd_write=1, kernel_tflops=100.0, pass_gap_s=0.0)
    f = SHAPE.flops(1024, 32)
    assert flat.block_s(SHAPE, schedule(), "backward only") == pytest.approx(f["block_bwd"] / 100e12)


def test_the_activations_move_once_each_way_and_the_earliest_blocks_spill():
    """Every swapped block's activations (what autograd saves: a GPT-2 block's 18.04 x width
    + 10.02 x MLP bytes per token at 16 bits) go down once and up once; beyond their arena
    they go to the SSD array and come back, the earliest blocks' first; none of a swapped
    block's kept input comes up in backward."""
    each = activation_bytes(SHAPE, 32 * 1024, 2)
    a, b = SAVED_ACTIVATIONS["gpt2"]
    assert each == 32 * 1024 * math.ceil(a * 5120 + b * 4 * 5120)  # (per token, rounded up)
    plain = iteration.simulate(SHAPE, schedule(), rates())
    arena = 5.5 * 2 * each  # five and a half blocks' of the ten swapped
    out = iteration.simulate(SHAPE, schedule(swapped=10, swap_arena=arena), rates())
    assert out["swapped_blocks"] == 10
    assert out["bytes"]["d2h: activations"] == out["bytes"]["h2d: activations"] == 10 * 2 * each
    assert out["activation_bytes"] == {"pcie": 2 * 10 * 2 * each, "ssd": 2 * 4.5 * 2 * each}
    assert out["bytes"]["ssd: write activations"] == out["bytes"]["ssd: read activations"] == 4.5 * 2 * each
    ckpt = 32 * 1024 * 5120 * 2
    assert plain["bytes"]["h2d: checkpoints"] - out["bytes"]["h2d: checkpoints"] == 10 * 2 * ckpt
    blocks = swapped_blocks(40, 10)
    spill = spilled(blocks, 2, each, arena)
    assert [spill[b] for b in sorted(blocks)] == [each] * 4 + [each / 2] + [0.0] * 5
    assert out["pcie_weights_and_gradients_bytes"] == plain["pcie_weights_and_gradients_bytes"]


def test_a_slow_link_makes_swapping_lose_and_the_gpu_wait_for_it():
    """The activations' transfers bound a swapped block's micro-batch: on the profile's
    PCIe 4.0 swapping every block of 13B with its GELU as one operator (5.7 GB a
    micro-batch) gains; with GELU written out (9.75 GB), or at a tenth of the link, the GPU
    waits for the downloads and uploads and recomputing is faster."""
    fused = S.from_config({**GPT3_13B, "activation_function": "gelu_pytorch_tanh"})
    fast, slow = rates(), rates(pcie_h2d=2.5, pcie_d2h=2.5)
    for shape, r, gains in ((fused, fast, True), (SHAPE, fast, False), (fused, slow, False)):
        base = iteration.simulate(shape, schedule(), r)["iteration_seconds"]
        out = iteration.simulate(shape, schedule(swapped=40), r)
        assert (out["iteration_seconds"] < base) == gains
    stalls = iteration.simulate(SHAPE, schedule(swapped=40), slow)["seconds"]
    assert stalls["gpu stalled: activation downloads"] > 0 and stalls["gpu stalled: activations upload"] > 0


def test_settings_split_the_arena_and_pass_swap_blocks_to_attach():
    """train_step's split: with swapped blocks the kept inputs take what they need of
    host_budget, at most half, and the activations the rest; a swapped block's input leaves
    after its forward. swap_blocks is in attach's options only when blocks swap."""
    s = Settings(seq=1024, micro_batch=32, micro_batches=2, offload="host")
    assert "swap_blocks" not in s.attach_options() and arenas(s, 10, 3) == (10, 0)
    w = dataclasses.replace(s, swap_blocks=10, host_budget=11)
    assert w.attach_options()["swap_blocks"] == 10 and w.attach_options()["host_budget"] == 11
    assert arenas(w, 11, 3) == (3, 8) and arenas(w, 11, 9) == (5, 6)
    assert kept_inputs(SHAPE, s, 2) - kept_inputs(SHAPE, w, 2) == 10 * 2 * 32 * 1024 * 5120 * 2
    assert swapped_activations(SHAPE, w, 2) == 10 * 2 * activation_bytes(SHAPE, 32 * 1024, 2)
    with pytest.raises(ValueError, match="swap_blocks must be an integer of at least 0"):
        Settings(seq=1024, swap_blocks=-1)


def test_the_plan_holds_what_it_assumed_and_reports_it():
    """The search weighs none, quarters of the blocks and the most whose activations host
    memory holds; the plan it picks gives attach a host_budget whose split it assumed (no
    activation goes through the SSD array), and its text and JSON say how many blocks swap
    and their bytes on PCIe."""
    assert swap_counts(40) == [10, 20, 30, 40] and swap_counts(3) == [1, 2, 3]
    plan = sizing.plan(GPT3_13B, on=papers_host(), seq=1024, tokens_per_step=64 * 1024, compute="fp16")
    e = plan.best
    opts = plan.attach_options()
    n = opts["swap_blocks"]
    assert n == e.settings.swap_blocks == e.activations["swapped_blocks"] > 0
    hb = opts["host_budget"]
    assert hb == e.plan.host_budget
    acts = swapped_activations(plan.shape, e.settings, 2)
    inputs = min(kept_inputs(plan.shape, e.settings, 2), hb // 2)
    assert acts <= hb - inputs and e.ssd["spilled activations written"] == 0
    assert e.memory["ssd_capacity_parts"]["spilled activations"] == e.ssd["spilled activations written"]
    assert e.needs["pinned budget"] <= e.has["pinned budget"]
    text = str(plan)
    assert f"swap_blocks={n}" in text and f"{n} of 40 blocks' activations swapped, not recomputed" in text
    assert f"swap    activations of {n} of 40 blocks, not recomputed" in text
    # the arena it names is the activations' part of host_budget as train_step splits it (it
    # said half of host_budget, whatever the kept inputs took)
    assert e.activations["arena"] == hb - inputs
    assert f"beyond their host arena ({format_size(hb - inputs)}: what the kept inputs leave of host_budget)" in text
    js = plan.to_dict()["plan"]
    assert js["swapped_activations_per_step"] == e.activations and js["settings"]["swap_blocks"] == n
    assert js["attach_options"]["swap_blocks"] == n


def test_no_swapping_where_it_does_not_pay_or_there_is_no_gpu():
    """One SSD at 32 sequences a step: the SSD array binds and the planner recomputes (the
    issue's check: another SSD helps); with no GPU it never swaps (the CPU computes)."""
    plan = sizing.plan(GPT3_13B, on=papers_host(1), seq=1024, tokens_per_step=32 * 1024, compute="fp16")
    assert plan.best.binds == "SSD" and plan.best.settings.swap_blocks == 0 and dict(plan.advice)["another SSD"] > 1.0
    cpu = sizing.Host(None, 16 << 30, sizing.Disks(1, 10**12, sizing.Rate(2, "g"), sizing.Rate(2, "g")), 2)
    small = {"model_type": "gpt2", "n_embd": 64, "n_layer": 4, "n_head": 4, "vocab_size": 256, "n_positions": 64}
    assert sizing.plan(small, on=cpu, seq=32, tokens_per_step=256).best.settings.swap_blocks == 0
    assert estimate(S.from_config(small), Settings(seq=32, swap_blocks=2), cpu).activations["swapped_blocks"] == 2
    with pytest.raises(ValueError, match="swap_blocks is engine.train_step's"):
        Settings(seq=32, swap_blocks=2, schedule="loop")


@pytest.mark.slow  # (6-11 s: the default suite's 10 minutes)
def test_the_planner_names_the_pinned_budget_where_it_binds():
    """On the paper's box the daemon's default pinned budget (half of 768 GiB) holds none of
    GPT-3 175B's blocks' activations beside its weights; the advice names the budget that
    lets a plan swap some (an operator's change: [memory] pinned_budget, up to what the plan
    lets a process use), what that plan pins and its speed-up, which is the plan the planner
    makes when given that budget. Where the budget does not bind (the SSD array does, and
    nothing swaps), no such advice."""
    plan = sizing.plan(GPT3_175B, on=papers_host(), seq=1024, tokens_per_step=16 * 1024, compute="fp16")
    [(what, ratio)] = [(w, r) for w, r in plan.advice if w.startswith("a pinned budget of")]
    most = plan.best.has["host memory"]
    assert what.startswith(f"a pinned budget of {format_size(most)} ([memory] pinned_budget; the plan pins ")
    assert ratio > 1.0
    wider = sizing.plan(GPT3_175B, on=papers_host(pinned_budget=most), seq=1024, tokens_per_step=16 * 1024,
                        compute="fp16")
    assert plan.best.settings.swap_blocks == 0 < wider.best.settings.swap_blocks
    assert wider.best.tokens_per_second / plan.best.tokens_per_second == pytest.approx(ratio)
    assert f"the plan pins {format_size(wider.best.needs['pinned budget'])} of it)" in what
    assert plan.host.pinned < wider.best.needs["pinned budget"] <= most
    ssd_bound = sizing.plan(GPT3_13B, on=papers_host(1), seq=1024, tokens_per_step=32 * 1024, compute="fp16")
    assert not [w for w, _ in ssd_bound.advice if w.startswith("a pinned budget")]


@pytest.mark.slow  # (6-11 s: the default suite's 10 minutes)
def test_a_gelu_written_out_is_counted_and_the_planner_names_the_one_operator_gelu():
    """GPT-2 configs train with HF's gelu_new, six elementwise operators each saving a tensor
    of the MLP's width: the planner reads the config's activation_function (GPT-2's default
    gelu_new, GPT-NeoX's gelu, OPT's relu) and counts those bytes, and names
    gelu_pytorch_tanh (the same tanh GELU as one operator) with the speed-up it would give,
    the plan of that config. On the paper's box 13B's swapped activations fall from 9.75 GB
    a micro-batch to 5.7, and swapping pays: more blocks swap and the step is faster."""
    assert S.from_config(GPT3_13B).activation == "gelu_new"
    assert S.from_config({**GPT3_13B, "activation_function": "relu"}).activation == "relu"
    neox = {"model_type": "gpt_neox", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
            "intermediate_size": 256, "vocab_size": 100}
    assert S.from_config(neox).activation == "gelu" and kernels.layout(S.from_config(neox)) == "gpt2-fused"
    written = sizing.plan(GPT3_13B, on=papers_host(), seq=1024, tokens_per_step=64 * 1024, compute="fp16")
    fused_cfg = {**GPT3_13B, "activation_function": "gelu_pytorch_tanh"}
    fused = sizing.plan(fused_cfg, on=papers_host(), seq=1024, tokens_per_step=64 * 1024, compute="fp16")
    [(what, ratio)] = [(w, r) for w, r in written.advice if w.startswith("activation_function=")]
    assert what.startswith("activation_function='gelu_pytorch_tanh' (gelu_new's tanh GELU as one operator")
    assert ratio == pytest.approx(fused.best.tokens_per_second / written.best.tokens_per_second) and ratio > 1.15
    assert not [w for w, _ in fused.advice if w.startswith("activation_function=")]
    a_w, b_w = SAVED_ACTIVATIONS["gpt2"]
    a_f, b_f = SAVED_ACTIVATIONS["gpt2-fused"]
    assert a_f == a_w and b_f < b_w / 2  # (the MLP's share: one tensor saved for the GELU, not five more)
    per = {name: activation_bytes(S.from_config(cfg), 32 * 1024, 2) for name, cfg in
           (("written", GPT3_13B), ("fused", fused_cfg))}
    assert 9.8e9 > per["written"] > 9.7e9 > 5.8e9 > per["fused"] > 5.7e9
    assert fused.best.settings.swap_blocks > written.best.settings.swap_blocks
