"""The planner reads mixtures of experts (client/fuyou_client/sizing/experts.py): any family
transformers builds is counted on its meta-device model (width, layers and parameters
those of the model), compute is priced by the parameters a token passes through, and no
plan for any family on any GPU predicts more than that GPU's peak."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import transformers

import fuyou_client
from fuyou_client.sizing import experts as moe
from fuyou_client.sizing import shape as S

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from sizing import MIXTURES  # noqa: E402 - bench/sizing.py: the sizing page's mixtures of experts

# Tiny configs of the families people fine-tune as mixtures of experts (2026).
TINY = {
    "qwen3_moe": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      intermediate_size=128, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                      vocab_size=256),
    "qwen2_moe": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                      intermediate_size=128, moe_intermediate_size=32, shared_expert_intermediate_size=64,
                      num_experts=8, num_experts_per_tok=2, vocab_size=256),
    "olmoe": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                  intermediate_size=32, num_experts=8, num_experts_per_tok=2, vocab_size=256),
    "deepseek_v3": dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
                        q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                        intermediate_size=128, moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=1,
                        num_experts_per_tok=2, first_k_dense_replace=1, vocab_size=256, n_group=2, topk_group=1),
    "llama4_text": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=16, intermediate_size=32, intermediate_size_mlp=128, num_local_experts=4,
                        num_experts_per_tok=1, vocab_size=256),
    "glm4_moe": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                     intermediate_size=128, moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=1,
                     num_experts_per_tok=2, first_k_dense_replace=1, vocab_size=256, n_group=1, topk_group=1),
    "gpt_oss": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                    intermediate_size=32, num_local_experts=8, num_experts_per_tok=2, vocab_size=256),
}
# Their real shapes (config.json's fields), for the planner at width: Qwen3-30B-A3B here, the
# three the sizing page plans on the workstation from bench/sizing.py.
REAL = {
    "Qwen3-30B-A3B": {"model_type": "qwen3_moe", "hidden_size": 2048, "num_hidden_layers": 48,
                      "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 6144,
                      "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8,
                      "vocab_size": 151936},
    **MIXTURES,
}


def built(cfg: dict):
    config = transformers.AutoConfig.for_model(cfg["model_type"], **{k: v for k, v in cfg.items() if k != "model_type"})
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("family", sorted(TINY))
def test_a_mixture_of_experts_config_counts_what_transformers_builds(family):
    cfg = {"model_type": family, **TINY[family]}
    shape, model = S.from_config(cfg), built(cfg)
    assert shape.params == sum(p.numel() for p in model.parameters())
    assert (shape.width, shape.layers, shape.vocab) == (64, cfg["num_hidden_layers"], 256)
    routing = moe.of_config(cfg)
    assert (shape.experts, shape.experts_per_token) == (routing.experts, routing.per_token)
    # Of the routed experts a token passes through its share; every dense parameter in full.
    routed = sum(p.numel() for n, p in model.named_parameters() if "experts" in n.split(".") and ".layers." in n)
    assert shape.active_params == pytest.approx(shape.params - routed * (1 - routing.share))


def test_qwen3_moe_flops_are_what_torch_counts():
    """A forward through the block's routed experts multiplies only the chosen ones: the
    FLOPs torch counts are the active share's (its attention over the whole S x S)."""
    from torch.utils.flop_counter import FlopCounterMode

    cfg = {"model_type": "qwen3_moe", **TINY["qwen3_moe"]}
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model("qwen3_moe", **TINY["qwen3_moe"])
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"  # (a loop of matmuls: torch's FLOP counter does not count _grouped_mm)
    model = transformers.AutoModelForCausalLM.from_config(config)
    shape = S.from_config(cfg)
    micro, seq = 2, 32
    x = torch.randn(micro, seq, 64)
    pos = torch.arange(seq)[None]
    with FlopCounterMode(display=False) as count:
        model.model.layers[0](x, position_embeddings=model.model.rotary_emb(x, pos), attention_mask=None)
    # (the router's softmax and top-k are not matmuls; its gate is, and counted)
    assert count.get_total_flops() == pytest.approx(shape.flops(seq, micro)["block_fwd"], rel=0.02)


@pytest.mark.parametrize("name", sorted(REAL))
def test_the_real_shapes_read_right(name):
    shape = S.from_config(REAL[name])
    cfg = REAL[name]
    assert shape.width == cfg["hidden_size"] and shape.layers == cfg["num_hidden_layers"]
    # The published sizes: total, and active per token (embeddings included here).
    total, active = {"Qwen3-30B-A3B": (30.5e9, 3.3e9), "gpt-oss-120b": (116.8e9, 5.7e9),
                     "Qwen3-235B-A22B": (235e9, 22e9), "DeepSeek-V3": (671.0e9, 37.5e9)}[name]
    assert shape.params == pytest.approx(total, rel=0.005) and shape.active_params == pytest.approx(active, rel=0.03)


@pytest.mark.slow  # (plans with their timelines, five GPUs: about a minute)
@pytest.mark.parametrize("gpu", sorted(fuyou_client.sizing.PROFILES))
def test_no_plan_predicts_more_than_the_gpus_peak(gpu):
    """For every family (dense and mixtures of experts at their real widths) on every GPU
    profile: the model TFLOPS and the hardware TFLOPS a plan predicts are at most the
    GPU's dense peak in the compute dtype."""
    from fuyou_client import sizing

    host = sizing.host(gpu, ram="128GiB", ssd="2x7GB/s", ssd_size="4TB", cores=16)
    shapes = {name: S.from_config(cfg) for name, cfg in REAL.items()}
    shapes["Llama-2-7B"] = S.from_config({"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32,
                                          "num_attention_heads": 32, "intermediate_size": 11008, "vocab_size": 32000})
    peak, checked = host.gpu.gemms("bf16").peak_tflops, set()
    for name, shape in shapes.items():
        p = sizing.plan(shape, seq=4096, on=host)
        for e in (p.best, p.smallest):  # (the smallest: what a host that cannot hold it is told)
            if e is not None and e.time:
                t = e.time
                assert 0 < t["model_tflops"] <= peak and 0 < t["hardware_tflops"] <= peak, (name, gpu, t)
                checked.add(name)
    assert checked == set(shapes), checked  # (every one fits: the widest by expert parts, model/experts.py)


@pytest.mark.parametrize("name", ["gpt-oss-120b", pytest.param("Qwen3-235B-A22B", marks=pytest.mark.slow),
                                  pytest.param("DeepSeek-V3", marks=pytest.mark.slow)])
def test_experts_cut_below_one_block_fit_a_24_gb_gpu(name):
    """A block of these is past a 24 GB GPU by its modules (one fused experts tensor of
    gpt-oss-120b's is 3.2B parameters, DeepSeek-V3's 11.3B); cut into 16 parts of experts
    (model/experts.py, by the rule attach cuts by) the device plan holds it."""
    from fuyou_client import sizing

    host = sizing.host("rtx4090", ram="128GiB", ssd="2x7GB/s", ssd_size="4TB", cores=16)
    shape = S.from_config(REAL[name])
    largest_module = max(n for n, _ in shape.block_atoms)
    assert largest_module * 2 > 3e9  # (in bf16 alone: the 24 GB GPU holds few, with slots and gradients)
    assert max(n for n, _ in shape.expert_atoms) * 16 == largest_module
    p = sizing.plan(shape, seq=4096, on=host)
    assert p.best is not None and p.best.settings.granularity == "expert", str(p)
