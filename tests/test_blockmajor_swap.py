"""train_step's swapped blocks (``attach(swap_blocks=N)``: blockmajor/swapped.py): a block runs
forward once with a graph, what autograd saves for backward goes to a host arena (beyond it,
the SSD array) and comes back for the block's backward, instead of the block being recomputed.

The spec: bitwise the ordinary loop over the same micro-batches (as every train_step is), for
some blocks swapped and for all, GPT-2 (tied) and Llama, fp32 and bf16, clipping, host
accumulation, on the CPU and on the late-copy stand-in; by sub-blocks on the stand-in capped
below one block; with the arena too small, through the SSD array. Every saved activation of a
swapped block leaves the device (the device plan counts one block's activations at a time),
and its kept input leaves host memory after forward.
"""
from __future__ import annotations

import pytest
import torch

import fuyou_client
from conftest import HYPER
from discrete_device import LateCopyDevice
from fuyou_client.blockmajor import swapped_blocks
from fuyou_client.blockmajor.store import Plan, forward_peak, spill_order
from test_attach import daemon  # noqa: F401 (a module-scoped fuyoud)
from test_blockmajor import CASES, K, assert_equal, batches, deterministic_attention, loop_step, needs_cuda, pair

pytest.importorskip("transformers")
CHEAP = {("gpt2", "stand-in", 2), ("llama-clip", "cpu", 9)}


def params():
    marks = {"cpu": pytest.mark.slow, "stand-in": pytest.mark.slow, "cuda": needs_cuda}
    return [pytest.param(case, where, swap, id=f"{case}-{where}-swap{swap}",
                         marks=() if (case, where, swap) in CHEAP else marks[where])
            for case in ("gpt2", "llama-clip", "gpt2-bf16", "llama-host-accumulation", "gpt2-clip-host")
            for where in ("cpu", "stand-in", "cuda") for swap in (2, 9)]


@pytest.mark.parametrize("case, where, swap", params())
def test_swapped_blocks_train_bitwise_as_the_ordinary_loop(daemon, case, where, swap):
    """(On a real GPU: within the compute dtype's rounding, as test_blockmajor.py's.)"""
    kwargs = dict(CASES[case])
    devices = {"cpu": (None, None), "cuda": ("cuda", "cuda"),
               "stand-in": (LateCopyDevice(seed=len(case)), LateCopyDevice(seed=7))}[where]
    a, ours, b, loop = pair(daemon=daemon, device_pair=devices, swap_blocks=swap, **kwargs)
    exact = where != "cuda"
    with deterministic_attention(not exact):
        for micro_batches in batches():
            if not exact:
                micro_batches = [x.cuda() for x in micro_batches]
            got = ours.train_step(micro_batches, lambda x: a(x, labels=x).loss / K)
            want = loop_step(b, loop, micro_batches)
            assert_equal(got, want, "losses", exact=exact)
    stats = ours.train_step_stats
    assert stats.swapped_blocks == min(swap, 4)
    assert stats.activations_to_host > 0 and stats.activations_back == stats.activations_to_host
    ours.close()
    loop.close()
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        assert_equal(x, y, name, exact=exact)


@pytest.mark.parametrize("make, dtype, where", [
    pytest.param("gpt2", torch.float32, "stand-in", id="gpt2-capped-stand-in"),
    pytest.param("llama", torch.float32, "stand-in-modules", id="llama-modules-stand-in", marks=pytest.mark.slow),
    pytest.param("llama", torch.bfloat16, "cpu", id="llama-bf16-cpu", marks=pytest.mark.slow)])
def test_swapped_sub_blocks_train_bitwise_as_whole_blocks(daemon, make, dtype, where, monkeypatch):
    """A cut block's sub-blocks come back for each micro-batch's backward through the saved
    weights' markers (no recomputed forward fetches them), and each one's gradient sum comes
    back from the host before its next micro-batch's gradient."""
    from fuyou_client.blockmajor.swapped import Swapped
    from test_subblocks import K as MICRO_BATCHES, STEPS, block_bytes, gpt2, llama, train
    swapped_backwards = []
    backward = Swapped.backward
    monkeypatch.setattr(Swapped, "backward", lambda self, *a: swapped_backwards.append(a[0]) or backward(self, *a))
    make_model = {"gpt2": gpt2, "llama": llama}[make]
    if where == "stand-in":
        cap = block_bytes(make_model().to(dtype)) - 1  # below one block's weights: auto cuts it
        a = train(make_model, daemon, dtype, "step", LateCopyDevice(seed=3, capacity=cap), swap_blocks=1)
        b = train(make_model, daemon, dtype, "step", LateCopyDevice(seed=4), granularity="block")
        assert a[3] == "module"
    else:  # (Llama's capped plan holds 4 tokens a micro-batch with swapped activations coming back: asked for)
        device = (lambda seed: LateCopyDevice(seed=seed)) if where == "stand-in-modules" else (lambda seed: None)
        a = train(make_model, daemon, dtype, "step", device(3), granularity="module", swap_blocks=1)
        b = train(make_model, daemon, dtype, "step", device(4), granularity="block")
    assert len(swapped_backwards) == STEPS * MICRO_BATCHES  # (one block swapped: its graph, each micro-batch)
    assert torch.equal(a[1], b[1]), "losses"
    for (name, x), y in zip(a[0].state_dict().items(), b[0].state_dict().values()):
        assert torch.equal(x, y), f"{name}: max diff {(x.float() - y.float()).abs().max().item()}"


def test_activations_beyond_their_arena_go_through_the_ssd_array(daemon):
    """What the kept inputs leave of host_budget for swapped activations holds less than a
    step's: the oldest go to the SSD array as they are made and come back, checked, for
    backward."""
    kwargs = dict(CASES["gpt2"])
    devices = (LateCopyDevice(seed=5), LateCopyDevice(seed=6))
    a, ours, b, loop = pair(daemon=daemon, device_pair=devices, swap_blocks=4, host_budget=96 << 10, **kwargs)
    for micro_batches in batches():
        got = ours.train_step(micro_batches, lambda x: a(x, labels=x).loss / K)
        assert_equal(got, loop_step(b, loop, micro_batches), "losses", exact=True)
    stats = ours.train_step_stats
    assert stats.activations_to_ssd > 0 and stats.activations_from_ssd == stats.activations_to_ssd
    # the kept inputs' plan holds at most half of host_budget; the activations' arena is the rest
    held = ours._train_step_store.plan.held
    assert 0 < held <= (96 << 10) // 2 and ours._train_step_swapper.arena.size == (96 << 10) - held
    ours.close()
    loop.close()
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        assert_equal(x, y, name, exact=True)


def test_which_blocks_swap():
    assert swapped_blocks(8, 0) == frozenset()
    assert swapped_blocks(8, 2) == {0, 4}
    assert swapped_blocks(8, 4) == {0, 2, 4, 6}
    assert swapped_blocks(3, 9) == {0, 1, 2}
    with pytest.raises(ValueError, match="swap_blocks must be an integer >= 0"):
        fuyou_client.AttachOptions(swap_blocks=-1)


def test_a_swapped_blocks_inputs_are_not_kept_for_backward():
    """Their kept inputs leave once forward took them: never planned for the SSD array, and
    host memory's peak in forward lower by their count."""
    n, k = 6, 3
    swapped = swapped_blocks(n, 3)
    assert not any(key[1] in swapped for key in spill_order(n, k, True, swapped))
    assert forward_peak(n, k, frozenset(), True, False, swapped) < forward_peak(n, k, frozenset(), True, False)
    budget = 4096 * forward_peak(n, k, frozenset(), True, False, swapped)
    assert not Plan(4096, n, k, budget, swapped=swapped).to_ssd  # (what backward needs fits)
    assert Plan(4096, n, k, budget).to_ssd  # (without swapping, some would go)


@pytest.mark.parametrize("layout", ["gpt2", "gpt2-fused", "llama"])
def test_swapped_blocks_move_what_the_planner_counts_each_saved_tensor_once(daemon, layout):
    """train_step's swapped blocks send the host what the device plan and the planner count
    a block saving (memory.SAVED_ACTIVATIONS by the block's layout, MLP width read from its
    matrices): each tensor once however many operators save it (a Llama block's q, k and v
    projections each save its normed input; without the swapper's identity check it went
    down three times, 35% more than counted); within 1% at this shape (what does not grow
    with the tokens: rotary's per-position tables), and all of it comes back."""
    import transformers

    from fuyou_client.memory.device_plan import activation_bytes
    from fuyou_client.model import mlp_layout

    torch.manual_seed(0)
    width, seq, micro, layers = 128, 64, 2, 2
    if layout == "llama":
        mlp = 352
        cfg = transformers.LlamaConfig(hidden_size=width, intermediate_size=mlp, num_hidden_layers=layers,
                                       num_attention_heads=4, num_key_value_heads=4, vocab_size=256,
                                       max_position_embeddings=seq)
    else:
        mlp = 4 * width
        cfg = transformers.GPT2Config(n_embd=width, n_layer=layers, n_head=4, n_positions=seq, vocab_size=256,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                      activation_function="gelu_pytorch_tanh" if layout == "gpt2-fused" else "gelu_new")
    model = transformers.AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16)
    blocks = model.model.layers if layout == "llama" else model.transformer.h
    assert mlp_layout(blocks[0], width) == (layout, mlp)
    engine = fuyou_client.attach(model, fuyou_client.AdamW(**HYPER), socket=daemon.socket, swap_blocks=layers,
                                 host_budget=64 << 20)
    try:
        xs = [torch.randint(0, 256, (micro, seq)) for _ in range(K)]
        engine.train_step(xs, lambda x: model(x, labels=x).loss / K)
        stats = engine.train_step_stats
        counted = layers * K * micro * seq * activation_bytes(layout, width, mlp, 2)
        assert stats.activations_to_host == stats.activations_back > 0
        assert stats.activations_to_host == pytest.approx(counted, rel=0.01), (stats.activations_to_host, counted)
    finally:
        engine.close()
