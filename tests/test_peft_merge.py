"""export_merged (integrations/peft.py) writes what PEFT's own merge_and_unload() makes of the
same trained values, tensor by tensor and bitwise (it runs PEFT's merge() on each adapted
layer), at either granularity: "block", and "module", where a LoRA layer's base weight is a
sub-block of its own and its adapters are in the block's group. DoRA, lora_bias, rsLoRA,
modules_to_save (a tied head made a copy of its own: the config written unties it), two
adapters (one active, or both), an embedding adapter, LoHa and LoKr; what it cannot merge
exactly is refused by name before anything is written. save_adapter writes what PEFT saves of
the same values at granularity="module", with DoRA, modules_to_save and an adapter that is not
active (frozen, so kept with the block's frozen parameters)."""
from __future__ import annotations

import copy

import pytest
import torch

import fuyou_client
from conftest import STREAMING, private_daemon, tiny_gpt2

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
safetensors = pytest.importorskip("safetensors.torch")
from fuyou_client.checkpoints.exporter import load_exported  # noqa: E402
from fuyou_client.integrations.peft import export_merged, save_adapter  # noqa: E402


@pytest.fixture(scope="module")
def daemon():
    with private_daemon(STREAMING, "fy-merge-") as d:
        yield d


@pytest.fixture
def attach(daemon):
    """fuyou_client.attach on the module's daemon; the engines closed after the test, passed or not."""
    engines = []

    def attach(model, granularity):
        engines.append(fuyou_client.attach(model, fuyou_client.AdamW(lr=1e-2, weight_decay=0.1),
                                           socket=daemon.socket, granularity=granularity))
        return engines[-1]

    yield attach
    for engine in engines:
        engine.close()


def llama():
    """A tiny Llama whose projections have biases (for lora_bias)."""
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=256, max_position_embeddings=32, bos_token_id=0, eos_token_id=0, pad_token_id=0,
        attention_bias=True, mlp_bias=True))


def lora(**kw):
    defaults = dict(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "down_proj"])
    return peft.LoraConfig(**{**defaults, **kw})


def peft_model(config, make=llama, second=None, both=False):
    """``make()`` with ``config`` as adapter "default" (and ``second`` as "second"; ``both``:
    both active)."""
    torch.manual_seed(0)
    base = make()
    torch.manual_seed(1)
    model = peft.get_peft_model(base, config)
    if second is not None:
        model.add_adapter("second", second)
        if both:
            model.base_model.set_adapter(["default", "second"])
    return model


def train(attach, model, granularity, steps=2):
    """``model`` attached and trained ``steps`` steps, and a copy of it (not attached) that
    holds the trained values (from the attached model's state_dict(): read from the SSD array)."""
    ref = copy.deepcopy(model)
    engine = attach(model, granularity)
    cut = any(".m" in g.spec.name for g in engine.groups)
    assert cut == (granularity == "module")  # (the base weights are sub-blocks of their own)
    gen = torch.Generator().manual_seed(2)
    for _ in range(steps):
        x = torch.randint(0, 256, (2, 16), generator=gen)
        model(input_ids=x, labels=x).loss.backward()
        engine.step()
        engine.zero_grad()
    ref.load_state_dict(model.state_dict())
    return engine, ref


def assert_merged(engine, ref, out, load=False):
    """export_merged(engine, out) holds what ref.merge_and_unload() does, bitwise, under the
    same names (a tied alias written once); ``load``: from_pretrained loads it equal too."""
    before = copy.deepcopy(ref).unload().state_dict()  # (unmerged: the merge changes the adapted weights)
    merged = ref.merge_and_unload()
    want = merged.state_dict()
    trained = {n: t.clone() for n, t in engine.model.state_dict().items()}
    export_merged(engine, out)
    got = load_exported(out)
    after = engine.model.state_dict()  # (the attached model as it was: its values, its layers unmerged)
    assert set(after) == set(trained) and all(torch.equal(after[n], t) for n, t in trained.items())
    assert not any(getattr(m, "merged", False) for m in engine.model.modules())
    first = {}
    for name, t in want.items():
        first.setdefault((t.data_ptr(), t.shape), name)
    assert set(got) == set(first.values())
    changed = 0
    for name in got:
        assert got[name].dtype == want[name].dtype and torch.equal(got[name], want[name]), name
        changed += not torch.equal(want[name], before[name])
    assert changed  # (the adapters moved the weights: a merge that dropped them would show)
    if load:
        loaded = transformers.AutoModelForCausalLM.from_pretrained(out).state_dict()
        assert set(loaded) == set(want)
        for name, t in want.items():
            assert torch.equal(loaded[name], t), name
    return merged


GRANULARITIES = ["block", "module"]
VARIANTS = {
    "lora": dict(),
    "dora": dict(use_dora=True),
    "lora_bias": dict(lora_bias=True),
    "rslora": dict(use_rslora=True, lora_alpha=16),
    "modules_to_save": dict(modules_to_save=["lm_head"]),
    "embedding": dict(target_modules=["embed_tokens", "q_proj"]),
    "head": dict(target_modules=["q_proj", "lm_head"]),  # (the rest's group: resident, or a sub-block of its own)
}


FAST = {("lora", "module"), ("dora", "block"), ("dora", "module")}  # (the default suite's; the rest slow)


@pytest.mark.parametrize("variant, granularity", [
    pytest.param(v, g, id=f"{g}-{v}", marks=() if (v, g) in FAST else pytest.mark.slow)
    for v in VARIANTS for g in GRANULARITIES])
def test_export_merged_is_what_peft_merges(attach, tmp_path, variant, granularity):
    """PEFT's merge of each LoRA option at each granularity, bitwise (the same merge() code on
    the same fp32 values). DoRA: its magnitude vector rescales each row; lora_bias: the base
    bias takes lora_B's bias; modules_to_save: the head is the trained copy."""
    options, steps = VARIANTS[variant], 2
    engine, ref = train(attach, peft_model(lora(**options)), granularity, steps)
    if variant == "dora":
        assert any("lora_magnitude_vector" in n for n, _ in ref.named_parameters())
    assert_merged(engine, ref, tmp_path / "merged", load=granularity == "module")


@pytest.mark.slow  # (four exports of two adapters; the default suite merges DoRA at both granularities)
@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("both", [False, True], ids=["one-active", "both-active"])
def test_two_adapters(attach, tmp_path, both, granularity):
    """Two named adapters on overlapping layers (q_proj has both; one of them DoRA): the active
    one merged and the other dropped, or both active, merged in turn as PEFT merges them."""
    steps = 2
    model = peft_model(lora(),
                       second=lora(r=2, target_modules=["q_proj", "o_proj"], use_dora=True, init_lora_weights=False),
                       both=both)
    assert model.active_adapters == (["default", "second"] if both else ["default"])
    engine, ref = train(attach, model, granularity, steps)
    assert_merged(engine, ref, tmp_path / "merged")


def test_a_tied_head_saved_as_a_copy_is_untied(attach, tmp_path):
    """GPT-2 (tied embeddings, Conv1D: fan_in_fan_out) with modules_to_save=["lm_head"]: PEFT's
    copy of the head trains on its own; merge_and_unload writes tie_word_embeddings=False, and so
    does export_merged (else from_pretrained would tie the head back to the embeddings). The
    attached model's config is as it was."""
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["c_attn"], fan_in_fan_out=True,
                             modules_to_save=["lm_head"], lora_bias=True)
    engine, ref = train(attach, peft_model(config, make=lambda: tiny_gpt2(layers=2)), "module")
    merged = assert_merged(engine, ref, tmp_path / "merged", load=True)
    assert merged.config.tie_word_embeddings is False
    assert engine.model.base_model.model.config.tie_word_embeddings is True


@pytest.mark.slow
@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("kind", ["loha", "lokr"])
def test_loha_and_lokr(attach, tmp_path, kind, granularity):
    config = (peft.LoHaConfig if kind == "loha" else peft.LoKrConfig)(r=4, alpha=8, target_modules=["q_proj", "v_proj"],
                                                                       init_weights=False)
    engine, ref = train(attach, peft_model(config), granularity)
    assert_merged(engine, ref, tmp_path / "merged")


REFUSALS = {
    "ia3": (lambda: peft.IA3Config(target_modules=["q_proj", "down_proj"], feedforward_modules=["down_proj"]),
            r"cannot merge base_model\.model\.model\.layers\.0\.self_attn\.q_proj: "
            r"it is a peft\.tuners\.ia3\.layer\.Linear"),
    "alora": (lambda: lora(alora_invocation_tokens=[5, 6]),
              r"q_proj: its adapter 'default' is the LoRA variant ALoraLinearVariant "
              r"\(LoraConfig\(alora_invocation_tokens=\.\.\.\)\)"),
    "trainable_tokens": (lambda: lora(trainable_token_indices=[1, 2, 3]),
                         r"cannot merge base_model\.model\.model\.embed_tokens: it is a TrainableTokensWrapper"),
    "target_parameters": (lambda: peft.LoraConfig(r=4, target_modules=[], target_parameters=["mlp.down_proj.weight"]),
                          r"down_proj: it is a peft\.tuners\.lora\.layer\.ParamWrapper"),
    "prompt_tuning": (lambda: peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4),
                      r"cannot merge adapter 'default': it is PROMPT_TUNING \(prompt learning\)"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_what_it_cannot_merge_is_refused_before_anything_is_written(attach, tmp_path, case):
    """Each refused by name (the layer, its kind or option), saying what to do instead, and
    the output directory is not created; save_adapter still saves the adapter."""
    config, message = REFUSALS[case]
    model = peft_model(config())
    engine = attach(model, "module")
    out = tmp_path / "merged"
    with pytest.raises(ValueError, match=message) as refused:
        export_merged(engine, out)
    assert "Nothing was written; save the adapter with save_adapter(engine, DIR)" in str(refused.value)
    assert ".merge_and_unload()" in str(refused.value)
    assert not out.exists()
    save_adapter(engine, tmp_path / "adapter")
    assert (tmp_path / "adapter" / "adapter_config.json").is_file()


def test_save_adapter_at_module_granularity(attach, tmp_path):
    """What PEFT saves of the same trained values: the head's copy, and the adapter that is not
    active (frozen: read from the block's frozen parameters, which the trained ones alone do not
    hold; DoRA, its magnitudes too) in its own directory."""
    model = peft_model(lora(modules_to_save=["lm_head"]),
                       second=lora(r=2, target_modules=["q_proj", "o_proj"], use_dora=True, init_lora_weights=False,
                                   modules_to_save=["lm_head"]))
    engine, ref = train(attach, model, "module")
    save_adapter(engine, tmp_path / "adapter")
    for adapter, where in (("default", tmp_path / "adapter"), ("second", tmp_path / "adapter" / "second")):
        want = peft.get_peft_model_state_dict(ref, adapter_name=adapter)
        got = safetensors.load_file(where / "adapter_model.safetensors")
        assert set(got) == set(want) and any("lora_magnitude_vector" in k for k in want) == (adapter == "second")
        for name, t in want.items():
            assert torch.equal(got[name], t), (adapter, name)


@pytest.mark.parametrize("variant", ["dora", pytest.param("embedding", marks=pytest.mark.slow),
                                     pytest.param("loha", marks=pytest.mark.slow)])
def test_a_tuner_layer_that_reads_its_base_weight_trains_bitwise_at_module_granularity(attach, variant):
    """DoRA (its weight norm), an embedding's LoRA and LoHa read the base layer's weight
    outside the base layer's own forward: at granularity="module" a tuner layer is one
    sub-block, base weight and adapters together (model/cuts.py), fetched around the tuner
    layer's forward; trained there it equals torch's fused AdamW in-process, bitwise."""
    config = (peft.LoHaConfig(r=4, alpha=8, target_modules=["q_proj", "v_proj"]) if variant == "loha"
              else lora(**VARIANTS[variant]))
    model = peft_model(config)
    want = copy.deepcopy(model)
    opt = torch.optim.AdamW([p for p in want.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1,
                            fused=True)
    engine = attach(model, "module")
    assert any(".m" in g.spec.name for g in engine.groups)
    gen = torch.Generator().manual_seed(2)
    for _ in range(2):
        x = torch.randint(0, 256, (2, 16), generator=gen)
        model(input_ids=x, labels=x).loss.backward()
        engine.step()
        engine.zero_grad()
        want(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
    got = model.state_dict()
    assert all(torch.equal(got[n], t) for n, t in want.state_dict().items())
