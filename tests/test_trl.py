"""TRL's trainers through Fuyou (integrations/trl.py): SFT, DPO and GRPO each train bitwise as
the plain TRL trainer with optim="adamw_torch_fused", with TRL's own defaults
(gradient_checkpointing=True becomes Fuyou's recomputation, bf16=True its autocast), save
what from_pretrained loads, and resume bitwise from a checkpoint; DPO's and GRPO's reference
model is streamed from the SSD array, not a second copy in memory."""
from __future__ import annotations

import pytest
import torch

import fuyou_client
from conftest import STREAMING, private_daemon

transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")
tokenizers = pytest.importorskip("tokenizers")
from fuyou_client.integrations.trl import FuyouDPOTrainer, FuyouGRPOTrainer, FuyouSFTTrainer  # noqa: E402

CORPUS = [line for line in (__import__("pathlib").Path(__file__).resolve().parent.parent / "examples" / "data" /
                            "corpus.txt").read_text().splitlines() if line.strip()][:32]


@pytest.fixture(scope="module")
def daemon():
    with private_daemon(STREAMING, "fy-trl-") as d:
        yield d


def tokenizer():
    """A byte-level BPE tokenizer trained here on the example corpus (nothing from a hub)."""
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, tokenizers.trainers.BpeTrainer(
        vocab_size=256, special_tokens=["<unk>", "<eos>", "<pad>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>",
                                                unk_token="<unk>")


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A tiny GPT-2 and its tokenizer saved as from_pretrained reads them (TRL loads the
    reference model of DPO and GRPO from the policy's directory)."""
    where = tmp_path_factory.mktemp("trl-base")
    tok = tokenizer()
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=3, n_embd=64, n_head=4, vocab_size=len(tok), n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, bos_token_id=1, eos_token_id=1, pad_token_id=2)).save_pretrained(where)
    tok.save_pretrained(where)
    return where


def reward(completions, **_):
    return [float(len(set(c))) for c in completions]


KINDS = {
    "sft": (trl.SFTConfig, trl.SFTTrainer, FuyouSFTTrainer, dict(max_length=32),
            lambda: datasets.Dataset.from_dict({"text": CORPUS})),
    "dpo": (trl.DPOConfig, trl.DPOTrainer, FuyouDPOTrainer, dict(max_length=48),
            lambda: datasets.Dataset.from_dict({"prompt": CORPUS[:16], "chosen": CORPUS[16:32],
                                                "rejected": CORPUS[::-1][:16]})),
    "grpo": (trl.GRPOConfig, trl.GRPOTrainer, FuyouGRPOTrainer, dict(num_generations=2, max_completion_length=8,
                                                                     beta=0.1),
             lambda: datasets.Dataset.from_dict({"prompt": CORPUS[:16]})),
}


def config(kind, out, **kw):
    """TRL's ``kind`` config with TRL's defaults for everything the test does not set:
    gradient_checkpointing=True and bf16=True among them."""
    cls, _, _, extra, _ = KINDS[kind]
    return cls(**{**dict(output_dir=str(out), max_steps=4, per_device_train_batch_size=2, learning_rate=1e-3,
                         optim="adamw_torch_fused", report_to="none", use_cpu=True, logging_steps=1,
                         save_strategy="steps", save_steps=2, seed=0, disable_tqdm=True), **extra, **kw})


def trainer(kind, base, out, fuyou=None, peft_config=None, **kw):
    """TRL's ``kind`` trainer (``fuyou``: Fuyou's) on the base model, TRL's defaults otherwise."""
    _, plain, ours, _, data = KINDS[kind]
    args = config(kind, out, **kw)
    cls = plain if fuyou is None else ours
    more = {"fuyou": fuyou} if fuyou is not None else {}
    if peft_config is not None:
        more["peft_config"] = peft_config
    if kind == "grpo":
        more["reward_funcs"] = reward
    model = transformers.AutoModelForCausalLM.from_pretrained(base)
    return cls(model=model, args=args, train_dataset=data(),
               processing_class=transformers.AutoTokenizer.from_pretrained(base), **more)


def logs(t):
    return [(e["loss"], e["grad_norm"], e["learning_rate"]) for e in t.state.log_history if "loss" in e]


@pytest.mark.parametrize("kind", ["sft", pytest.param("dpo", marks=pytest.mark.slow),
                                  pytest.param("grpo", marks=pytest.mark.slow)])  # (about 20 s each)
def test_bitwise_the_plain_trainer_with_save_and_resume(kind, base, daemon, tmp_path):
    ref = trainer(kind, base, tmp_path / "ref")
    assert ref.args.bf16 and ref.args.gradient_checkpointing  # (TRL's defaults, on both sides)
    ref.train()
    ours = trainer(kind, base, tmp_path / "ours", fuyou={"socket": daemon.socket})
    assert ours.fuyou_options.activations == "recompute" and not ours.args.gradient_checkpointing
    if kind != "sft":  # the reference model: streamed, its blocks not in memory
        assert ours.reference_engine is not None and ours.ref_model is ours.reference_engine.model
        assert all(p.numel() == 0 for p in ours.ref_model.transformer.h.parameters())
    ours.train()
    assert logs(ours) == logs(ref) and len(logs(ours)) == 4  # loss, gradient norm, learning rate of every step
    ours.save_model(tmp_path / "saved")
    want = ref.model.state_dict()
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
    for name, p in loaded.state_dict().items():
        assert torch.equal(p, want[name]), name
    ours.close()
    resumed = trainer(kind, base, tmp_path / "ours", fuyou={"socket": daemon.socket})
    resumed.train(resume_from_checkpoint=str(tmp_path / "ours" / "checkpoint-2"))
    assert logs(resumed)[-2:] == logs(ref)[-2:]
    resumed.save_model(tmp_path / "resumed")
    got = fuyou_client.load_exported(tmp_path / "resumed")
    for name, p in got.items():
        assert torch.equal(p, want[name]), name
    resumed.close()


def test_what_does_not_go_with_fuyou_is_refused_naming_the_argument(base, daemon, tmp_path):
    with pytest.raises(ValueError, match=r"gradient_checkpointing=True .*activations='swap'.*"
                                         r"gradient_checkpointing=False"):
        trainer("sft", base, tmp_path, fuyou={"socket": daemon.socket, "activations": "swap"})
    with pytest.raises(ValueError, match="sync_ref_model=True.*sync_ref_model=False"):
        trainer("dpo", base, tmp_path, fuyou={"socket": daemon.socket}, sync_ref_model=True)


@pytest.mark.slow  # (two DPO runs: about 15 s)
def test_preference_tuning_of_a_model_never_whole_in_memory(base, daemon, tmp_path):
    """The policy built on the meta device (attach streams its weights in from its directory,
    one layer group at a time) and the reference streamed from the same directory: neither is
    ever whole in memory, and DPO trains bitwise as the plain trainer with both in memory."""
    ref = trainer("dpo", base, tmp_path / "ref")
    ref.train()
    with torch.device("meta"):
        policy = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(base))
    ours = FuyouDPOTrainer(model=policy, args=config("dpo", tmp_path / "ours", save_strategy="no"),
                           train_dataset=KINDS["dpo"][4](),
                           processing_class=transformers.AutoTokenizer.from_pretrained(base),
                           fuyou={"socket": daemon.socket, "weights": str(base)})
    assert all(p.is_meta for p in policy.parameters()) and ours.reference_engine is not None
    ours.train()
    assert logs(ours) == logs(ref)
    assert all(p.numel() == 0 for p in policy.transformer.h.parameters())  # (offloaded: placeholders between uses)
    ours.close()


@pytest.mark.slow  # (two SFT runs: about 10 s)
def test_sft_with_a_peft_config_saves_the_adapter_as_peft_does(base, daemon, tmp_path):
    """TRL's peft_config (LoRA, TRL's defaults otherwise): bitwise the plain SFTTrainer, and
    save_model writes the adapter that PeftModel.from_pretrained loads equal to its adapters."""
    peft = pytest.importorskip("peft")
    lora = dict(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["c_attn", "c_proj"], fan_in_fan_out=True,
                init_lora_weights="gaussian")
    torch.manual_seed(1)
    ref = trainer("sft", base, tmp_path / "ref", peft_config=peft.LoraConfig(**lora))
    ref.train()
    torch.manual_seed(1)
    ours = trainer("sft", base, tmp_path / "ours", fuyou={"socket": daemon.socket}, peft_config=peft.LoraConfig(**lora))
    ours.train()
    assert logs(ours) == logs(ref)
    ours.save_model(tmp_path / "adapter")
    loaded = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(base),
                                            tmp_path / "adapter")
    want = {n: p for n, p in ref.model.named_parameters() if "lora_" in n}
    got = {n: p for n, p in loaded.named_parameters() if "lora_" in n}
    assert want and set(got) == set(want) and all(torch.equal(got[n], p) for n, p in want.items())
    ours.close()
