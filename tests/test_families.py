"""The model families of 2026 train through attach bitwise as torch's fused AdamW.

One tiny random model per family (hidden 64, 2 layers, 4 experts with top-2 where the
family routes, vocabulary 256, dropout off), built from its configuration alone (nothing
from the Hub), trained 3 steps of 2 micro-batches with exact clipping, offloaded and
resident, against the same model under torch's fused AdamW and ``clip_grad_norm_``: every
parameter and every loss equal, bit for bit (the method of ``tests/test_attach.py``).

Sizes that are not a multiple of torch's vector width are included on purpose: torch's
fused CPU AdamW steps a tensor's last ``numel % 8`` elements (its vector width here) in a
scalar loop that rounds otherwise than its vector loop, and fuyoud, which holds a group's
parameters as one flat vector, steps each element in the loop torch steps it in
(fuyoud/optimizer/tensors.py): the 4-head, 4-expert gpt-oss, whose attention sinks and
router bias have 4 elements, trains bitwise too (before, it drifted by an ulp a step).
"""
from __future__ import annotations

import copy

import pytest
import torch

import fuyou_client
from conftest import SMALL, merge, private_daemon

transformers = pytest.importorskip("transformers")

HYPER = dict(lr=3e-3, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1)
VOCAB = 256
CLIP = 0.05  # below every family's gradient norm: each step is clipped
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, attention_dropout=0.0, tie_word_embeddings=False,
            pad_token_id=0, bos_token_id=1, eos_token_id=2)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)
# gpt-oss's YaRN with its factor matching the positions (no warning from transformers)
YARN = dict(rope_type="yarn", rope_theta=150000.0, factor=4.0, original_max_position_embeddings=16, beta_fast=32.0,
            beta_slow=1.0, truncate=False)
GPT_OSS = dict(num_local_experts=16, num_experts_per_tok=2, num_attention_heads=16, head_dim=16, sliding_window=8,
               layer_types=["sliding_attention", "full_attention"], rope_parameters=YARN)

# family -> (configuration class, causal LM class, the configuration's arguments beyond BASE)
FAMILIES = {
    "qwen3-moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(MOE, head_dim=16)),
    "qwen2-moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(MOE, shared_expert_intermediate_size=32)),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(num_experts=4, num_experts_per_tok=2)),
    # first_k_dense_replace=1: a dense first layer, then a routed one with a shared expert
    "deepseek-v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                    dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
                         first_k_dense_replace=1, n_group=1, topk_group=1, kv_lora_rank=16, q_lora_rank=32,
                         qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16)),
    # moe_layers=[1]: a dense layer, then a routed one (the text model alone)
    "llama4-text": ("Llama4TextConfig", "Llama4ForCausalLM",
                    dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size_mlp=128, head_dim=16,
                         moe_layers=[1])),
    "glm4-moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM",
                 dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
                      first_k_dense_replace=1, n_group=1, topk_group=1, head_dim=16)),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", {}),
    # both layer kinds: a gated-delta-net (linear attention) layer, then a full-attention one
    "qwen3-next": ("Qwen3NextConfig", "Qwen3NextForCausalLM",
                   dict(MOE, shared_expert_intermediate_size=32, head_dim=16,
                        layer_types=["linear_attention", "full_attention"], linear_conv_kernel_dim=4,
                        linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=4,
                        linear_num_value_heads=16)),
    # a sliding-window layer and a full one, sinks, fused 3-D experts with biases
    "gpt-oss": ("GptOssConfig", "GptOssForCausalLM", GPT_OSS),
    # sinks and router bias of 4 elements: not a multiple of torch's vector width
    "gpt-oss-4x4": ("GptOssConfig", "GptOssForCausalLM",
                    dict(GPT_OSS, num_local_experts=4, num_attention_heads=4)),
}
# an expert's down-projection bias of 60 elements: not a multiple of torch's vector width
# (test_expert_parts.py; the grouped GEMM wants rows of 16 bytes, so the weights are)
FAMILIES["gpt-oss-60"] = ("GptOssConfig", "GptOssForCausalLM", dict(GPT_OSS, hidden_size=60))
# a block of 32 experts of 128 x 512, 25 MB: its experts most of a block's weight slot (test_expert_parts.py)
FAMILIES["gpt-oss-wide"] = ("GptOssConfig", "GptOssForCausalLM",
                            dict(GPT_OSS, num_local_experts=32, intermediate_size=512, hidden_size=128))
# a 4096-entry vocabulary: its head 10 expert parts (the rest's own buffer class, memory/budget.py)
FAMILIES["gpt-oss-vocab"] = ("GptOssConfig", "GptOssForCausalLM", dict(GPT_OSS, vocab_size=4096))
EXACT = [f for f in FAMILIES if f not in ("gpt-oss-4x4", "gpt-oss-60", "gpt-oss-wide", "gpt-oss-vocab")]  # (that one below, with the reason)
# the cheapest mode of each family in the default tier (3 s offloaded, under 1 s resident)
DEFAULT_TIER = ("qwen3-moe", "deepseek-v3", "gpt-oss")  # (the rest in the slow tier: the default suite's 10 minutes)
CASES = [pytest.param(f, False, id=f"{f}-resident", marks=() if f in DEFAULT_TIER else pytest.mark.slow)
         for f in EXACT] + [pytest.param(f, True, id=f"{f}-offloaded", marks=pytest.mark.slow) for f in EXACT]


def build(family: str):
    config_name, model_name, extra = FAMILIES[family]
    config = getattr(transformers, config_name)(**dict(BASE, **extra))
    return getattr(transformers, model_name)(config).float().train()


@pytest.fixture(scope="module")
def daemon():
    with private_daemon(merge(SMALL, {"storage": {"capacity_per_device": "1GiB"}}), "fy-fam-") as d:
        yield d


def per_tensor(engine, ours, ref):
    """torch's fused AdamW on the reference's parameters, one tensor each: its step()."""
    return torch.optim.AdamW(ref.parameters(), **HYPER, fused=True).step


def train_pair(family, daemon, offload, steps=3, accumulation=2, clip=CLIP, reference=per_tensor, **options):
    """The family's model attached, and its deepcopy under torch's fused AdamW (clipped with
    ``clip_grad_norm_``), trained on the same micro-batches: (ours, ref, our losses, the
    reference's losses, the gradient norms Fuyou clipped with)."""
    torch.manual_seed(0)
    ours = build(family)
    ref = copy.deepcopy(ours)
    engine = fuyou_client.attach(ours, fuyou_client.AdamW(**HYPER), socket=daemon.socket, offload=offload,
                                 max_grad_norm=clip, accumulation_steps=accumulation, **options)
    ref_step = reference(engine, ours, ref)
    gen = torch.Generator().manual_seed(1)
    losses, ref_losses, norms = [], [], []
    for _ in range(steps):
        for _ in range(accumulation):
            x = torch.randint(0, VOCAB, (2, 16), generator=gen)
            loss = ours(x, labels=x).loss
            loss.backward()
            ref_loss = ref(x, labels=x).loss
            ref_loss.backward()
            losses.append(loss.item())
            ref_losses.append(ref_loss.item())
        norms.append(engine.grad_norm())
        engine.step()
        engine.zero_grad()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
        ref_step()
        ref.zero_grad()
    engine.close()  # materialises the offloaded weights
    return ours, ref, losses, ref_losses, norms


def assert_same(ours, ref):
    for (name, a), b in zip(ours.state_dict().items(), ref.state_dict().values()):
        assert torch.equal(a, b), f"{name}: max diff {(a.float() - b.float()).abs().max().item()}"


@pytest.mark.parametrize("family, offload", CASES)
def test_family_trains_bitwise_like_torch_adamw(daemon, family, offload):
    ours, ref, losses, ref_losses, norms = train_pair(family, daemon, offload)
    assert all(n > CLIP for n in norms), norms  # every step clipped
    assert losses == ref_losses
    assert_same(ours, ref)


def test_torchs_fused_adamw_steps_a_tensors_last_elements_otherwise():
    """Why sizes matter (torch alone): the same elements stepped by torch's fused CPU
    AdamW as a tensor of their own and inside a longer tensor (as fuyoud steps a group)
    differ where they are the tensor's last ``numel % 8`` (its scalar loop), and only there."""
    torch.manual_seed(0)
    differ = {}
    for n in (4, 12, 16, 64):
        differ[n] = 0
        for _ in range(50):
            alone = (torch.randn(n) * 0.02).requires_grad_()
            inside = torch.cat([torch.randn(5), alone.detach(), torch.randn(64)]).requires_grad_()
            opts = [torch.optim.AdamW([t], **HYPER, fused=True) for t in (alone, inside)]
            for _ in range(3):
                g = torch.randn(n) * 1e-3
                alone.grad, inside.grad = g.clone(), torch.cat([torch.randn(5), g, torch.randn(64)])
                for opt in opts:
                    opt.step()
            differ[n] += not torch.equal(alone, inside.detach()[5:5 + n])
    assert differ[4] > 0 and differ[12] > 0 and differ[16] == 0 and differ[64] == 0, differ


@pytest.mark.parametrize("offload", [False, pytest.param(True, marks=pytest.mark.slow)],
                         ids=["resident", "offloaded"])
def test_gpt_oss_with_4_element_tensors_trains_bitwise(daemon, offload):
    """gpt-oss with 4 heads and 4 experts: its sinks and router bias (4 elements) are
    stepped in torch's scalar loop (above), by torch and by fuyoud alike: bitwise."""
    ours, ref, losses, ref_losses, _ = train_pair("gpt-oss-4x4", daemon, offload)
    assert losses == ref_losses
    assert_same(ours, ref)


def test_gpt_oss_trains_by_train_step_on_a_device_with_its_own_memory(daemon):
    """gpt-oss's layers take two attention masks (sliding and full); train_step on a device
    with its own memory empties what the model's forward holds before block 0 (blockmajor/
    schedule.py ``_park``) but no mask a later block takes: the stand-in's losses and
    weights are the CPU's, bit for bit (before, block 1 got an emptied mask and failed)."""
    from discrete_device import LateCopyDevice
    runs = []
    for device in (None, LateCopyDevice(seed=9)):
        torch.manual_seed(0)
        model = build("gpt-oss")
        engine = fuyou_client.attach(model, fuyou_client.AdamW(**HYPER), socket=daemon.socket, offload=True,
                                     granularity="block", device=device)
        gen = torch.Generator().manual_seed(1)
        losses = [engine.train_step([torch.randint(0, VOCAB, (1, 8), generator=gen) for _ in range(3)],
                                    lambda x: model(x, labels=x).loss / 3) for _ in range(2)]
        engine.close()
        runs.append((model, torch.cat(losses)))
    (cpu, cpu_losses), (standin, standin_losses) = runs
    assert torch.equal(cpu_losses, standin_losses)
    assert_same(standin, cpu)
