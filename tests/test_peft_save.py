"""PEFT adapters trained through Fuyou are saved as PEFT saves them: FuyouTrainer.save_model
writes adapter_config.json and adapter_model.safetensors that PeftModel.from_pretrained loads
equal to the plain Trainer's trained adapters; get_peft_model_state_dict and the model's own
save_pretrained give them too; save_merged_model equals PEFT's merge_and_unload."""
from __future__ import annotations

import pytest
import torch

from conftest import STREAMING, TokenRows, private_daemon, tiny_gpt2, tiny_llama

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
pytest.importorskip("accelerate")
from fuyou_client.integrations.transformers import FuyouTrainer  # noqa: E402


@pytest.fixture(scope="module")
def daemon():
    with private_daemon(STREAMING, "fy-peft-") as d:
        yield d


LORA = {"gpt2": dict(target_modules=["c_attn", "c_proj"], fan_in_fan_out=True),
        "llama": dict(target_modules=["q_proj", "v_proj", "down_proj"])}


def base(family):
    torch.manual_seed(0)
    return tiny_gpt2() if family == "gpt2" else tiny_llama()


def lora_model(family, base_dir):
    """The base model saved (what PeftModel.from_pretrained starts from) and wrapped with a
    LoRA adapter whose B is not zero (so merging changes the weights from the first step)."""
    model = base(family)
    model.save_pretrained(base_dir)
    torch.manual_seed(1)
    return peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                                      init_lora_weights="gaussian", **LORA[family]))


def arguments(out, **kw):
    base = dict(output_dir=str(out), per_device_train_batch_size=2, learning_rate=1e-2, weight_decay=0.1, max_steps=3,
                logging_steps=1, save_strategy="no", report_to="none", use_cpu=True, seed=0, optim="adamw_torch_fused",
                disable_tqdm=True, max_grad_norm=1.0)
    return transformers.TrainingArguments(**{**base, **kw})


@pytest.fixture(scope="module", params=["gpt2", pytest.param("llama", marks=pytest.mark.slow)])  # (10 s each)
def trained(request, daemon, tmp_path_factory):
    """The plain Trainer and FuyouTrainer after the same three steps of the same LoRA model."""
    family, root = request.param, tmp_path_factory.mktemp(f"peft-{request.param}")
    ref = transformers.Trainer(model=lora_model(family, root / "base"), args=arguments(root / "ref"),
                               train_dataset=TokenRows())
    ref.train()
    ours = FuyouTrainer(model=lora_model(family, root / "base"), args=arguments(root / "ours"), train_dataset=TokenRows(),
                        fuyou={"socket": daemon.socket})
    ours.train()
    yield family, root, ref, ours
    ours.engine.close()


def adapters(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def test_save_model_writes_the_adapter_as_peft_does(trained):
    family, root, ref, ours = trained
    want = adapters(ref.model)
    assert want and all(p.numel() == 0 for n, p in ours.model.named_parameters() if "layers" in n or ".h." in n)
    ours.save_model(root / "adapter")
    assert (root / "adapter" / "adapter_config.json").is_file()
    assert (root / "adapter" / "adapter_model.safetensors").is_file()
    assert not list((root / "adapter").glob("model*.safetensors"))  # (not the whole model under PEFT's names)
    loaded = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(root / "base"),
                                            root / "adapter")
    got = {n: p for n, p in loaded.named_parameters() if "lora_" in n}
    assert set(got) == set(want)
    for name, p in want.items():
        assert torch.equal(got[name], p), name


def test_peft_reads_the_trained_adapters_from_the_attached_model(trained):
    """get_peft_model_state_dict and PeftModel.save_pretrained on the attached model read
    state_dict(), which gives the trained values of every offloaded block."""
    family, root, ref, ours = trained
    want = peft.get_peft_model_state_dict(ref.model)
    got = peft.get_peft_model_state_dict(ours.model)
    assert set(got) == set(want)
    for name, t in want.items():
        assert torch.equal(got[name], t), name
    ours.model.save_pretrained(root / "direct")
    loaded = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(root / "base"),
                                            root / "direct")
    assert all(torch.equal(p, adapters(ref.model)[n]) for n, p in loaded.named_parameters() if "lora_" in n)


def test_the_merged_model_is_what_peft_merges(trained):
    family, root, ref, ours = trained
    ours.save_merged_model(root / "merged")
    merged = ref.model.merge_and_unload()
    loaded = transformers.AutoModelForCausalLM.from_pretrained(root / "merged")
    want = merged.state_dict()
    got = loaded.state_dict()
    assert set(got) == set(want)
    for name, t in want.items():
        assert torch.equal(got[name], t), name


@pytest.mark.slow  # (two Trainer runs with evaluations: about 15 s)
def test_the_best_adapter_is_loaded_at_the_end(daemon, tmp_path):
    """load_best_model_at_end with a PEFT model: the engine is attached again from the best
    checkpoint, its offloaded frozen base weights held for that moment; the adapters equal the
    plain Trainer's best ones."""
    best = dict(eval_strategy="steps", eval_steps=2, save_strategy="steps", save_steps=2, load_best_model_at_end=True,
                metric_for_best_model="eval_loss", greater_is_better=True)
    ref = transformers.Trainer(model=lora_model("llama", tmp_path / "base"),
                               args=arguments(tmp_path / "ref", max_steps=6, **best),
                               train_dataset=TokenRows(), eval_dataset=TokenRows(4))
    ref.train()
    ours = FuyouTrainer(model=lora_model("llama", tmp_path / "base"), args=arguments(tmp_path / "ours", max_steps=6,
                                                                                     **best),
                        train_dataset=TokenRows(), eval_dataset=TokenRows(4), fuyou={"socket": daemon.socket})
    ours.train()
    name = lambda t: t.state.best_model_checkpoint.rsplit("/", 1)[1]  # noqa: E731
    assert name(ours) == name(ref) != "checkpoint-6"  # (not the last: loading it changes the model)
    got = peft.get_peft_model_state_dict(ours.model)
    want = peft.get_peft_model_state_dict(ref.model)
    assert set(got) == set(want) and all(torch.equal(got[n], t) for n, t in want.items())
    ours.close()
