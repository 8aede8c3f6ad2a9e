"""What integrations/trl.py refuses before any work, and where DPO's streamed reference
model comes from (docs/guide/trl.md):

* every argument FuyouTrainer refuses (fp16=True, another optim...) is refused before TRL's
  set-up: nothing is written to the daemon (the reference model is not streamed first);
* GRPO's ``use_vllm=True`` with offloaded blocks is refused by name (TRL sends vLLM the
  policy's weights from ``named_parameters()``, empty placeholders for offloaded blocks);
  with ``fuyou={"offload": False}`` what TRL sends is the trained weights;
* a policy loaded from a Hub id has its reference streamed from the local Hugging Face
  cache (nothing fetched: a cache in a temporary directory, offline), one not there is
  refused naming ``ref_model=``; a remote-code policy's reference is built with its code.
"""
from __future__ import annotations

import json
import shutil
import sys

import pytest
import torch

from conftest import STREAMING, private_daemon

transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")
tokenizers = pytest.importorskip("tokenizers")
huggingface_hub = pytest.importorskip("huggingface_hub")
from trl.trainer import grpo_trainer as grpo_module  # noqa: E402

from fuyou_client.integrations.trl import FuyouDPOTrainer, FuyouGRPOTrainer, FuyouSFTTrainer  # noqa: E402

LINES = ["the quick brown fox jumps over the lazy dog", "a stitch in time saves nine",
         "all that glitters is not gold", "the early bird catches the worm"] * 4
HUB_ID = "fuyou-test/tiny-gpt2"  # (only ever in the temporary cache below)
COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def daemon():
    with private_daemon(STREAMING, "fy-trlr-") as d:
        yield d


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A 2-block GPT-2 and a tokenizer trained here, saved as from_pretrained reads them."""
    where = tmp_path_factory.mktemp("trlr-base")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    tok.train_from_iterator(LINES, tokenizers.trainers.BpeTrainer(
        vocab_size=200, special_tokens=["<unk>", "<eos>", "<pad>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>",
                                                     unk_token="<unk>")
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=len(tokenizer), n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, bos_token_id=1, eos_token_id=1, pad_token_id=2)).save_pretrained(where)
    tokenizer.save_pretrained(where)
    return where


def written(daemon) -> tuple[int, int]:
    """The daemon's SSD bytes written since it started, and the objects it holds."""
    status = daemon.status()
    return status.bytes_written, status.objects


COMMON = dict(max_steps=2, per_device_train_batch_size=2, learning_rate=1e-3, optim="adamw_torch_fused",
              report_to="none", use_cpu=True, save_strategy="no", seed=0, disable_tqdm=True)


def dpo(base, out, daemon, model=None, **kw):
    return FuyouDPOTrainer(
        model=model if model is not None else transformers.AutoModelForCausalLM.from_pretrained(base),
        args=trl.DPOConfig(output_dir=str(out), max_length=32, **{**COMMON, **kw}),
        train_dataset=datasets.Dataset.from_dict({"prompt": LINES[:4], "chosen": LINES[4:8],
                                                  "rejected": LINES[8:12]}),
        processing_class=transformers.AutoTokenizer.from_pretrained(base), fuyou={"socket": daemon.socket})


def reward(completions, **_):
    return [float(len(c)) for c in completions]


def grpo(base, out, fuyou, **kw):
    return FuyouGRPOTrainer(
        model=transformers.AutoModelForCausalLM.from_pretrained(base), reward_funcs=reward,
        args=trl.GRPOConfig(output_dir=str(out), num_generations=2, max_completion_length=4, **{**COMMON, **kw}),
        train_dataset=datasets.Dataset.from_dict({"prompt": LINES[:4]}),
        processing_class=transformers.AutoTokenizer.from_pretrained(base), fuyou=fuyou)


def test_trainer_arguments_are_refused_before_anything_is_written(base, daemon, tmp_path):
    """fp16=True (and the other arguments FuyouTrainer refuses) come before TRL's set-up: the
    reference model, TRL's own or one given, is not written to the SSD array first."""
    before = written(daemon)
    with pytest.raises(ValueError, match="fp16=True.*use bf16=True"):
        dpo(base, tmp_path, daemon, fp16=True)
    assert written(daemon) == before
    with pytest.raises(ValueError, match="optim='sgd'.*adamw_torch_fused"):
        FuyouDPOTrainer(model=transformers.AutoModelForCausalLM.from_pretrained(base), ref_model=str(base),
                        args=trl.DPOConfig(output_dir=str(tmp_path), max_length=32, **{**COMMON, "optim": "sgd"}),
                        train_dataset=datasets.Dataset.from_dict({"prompt": LINES[:4], "chosen": LINES[4:8],
                                                                  "rejected": LINES[8:12]}),
                        processing_class=transformers.AutoTokenizer.from_pretrained(base),
                        fuyou={"socket": daemon.socket})
    assert written(daemon) == before
    with pytest.raises(ValueError, match="fp16=True"):
        grpo(base, tmp_path, {"socket": daemon.socket}, beta=0.1, fp16=True)
    assert written(daemon) == before


class FakeVLLM:
    """Stands in for TRL's VLLMGeneration (vLLM is not installed here): its weight sync reads
    the policy's ``named_parameters()`` as TRL's does (``_iter_named_params``); it generates
    completions of two lengths (so that rewards differ within a group)."""
    syncs: list = []

    def __init__(self, model, **_):
        self.model = model

    def sync_weights(self):
        FakeVLLM.syncs.append({n: p.detach().clone() for n, p in self.model.named_parameters()})

    def generate(self, prompts, images, num_generations, profiler=None):
        completions = [[5, 6, 7, 1] if i % 2 else [8, 1] for i in range(len(prompts))]
        return prompts, completions, [[[-1.0]] * len(c) for c in completions], None


def test_grpo_use_vllm_needs_resident_blocks(base, daemon, tmp_path, monkeypatch):
    """use_vllm=True with offloaded blocks: refused by name before any work (vLLM would get the
    placeholders). With fuyou={"offload": False} each sync sends vLLM the trained weights: those
    after the step before it."""
    before = written(daemon)
    with pytest.raises(ValueError, match=r"use_vllm=True.*named_parameters\(\).*placeholders.*use_vllm=False.*"
                                         r"'offload': False"):
        grpo(base, tmp_path, {"socket": daemon.socket}, use_vllm=True, beta=0.1)
    assert written(daemon) == before

    monkeypatch.setattr(grpo_module, "VLLMGeneration", FakeVLLM)
    monkeypatch.setattr(FakeVLLM, "syncs", [])
    initial = transformers.AutoModelForCausalLM.from_pretrained(base).state_dict()
    trainer = grpo(base, tmp_path, {"socket": daemon.socket, "offload": False}, use_vllm=True, beta=0.0,
                   vllm_importance_sampling_correction=False)
    stepped = []  # the trained weights after each step (state_dict: Fuyou's values, whatever the offload)

    class Record(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            stepped.append({n: v.clone() for n, v in trainer.model.state_dict().items()})

    trainer.add_callback(Record())
    trainer.train()
    assert len(FakeVLLM.syncs) == 2 and len(stepped) == 2
    for name, value in FakeVLLM.syncs[0].items():
        assert torch.equal(value, initial[name]), name
    changed = 0
    for name, value in FakeVLLM.syncs[1].items():
        assert torch.equal(value, stepped[0][name]), name
        changed += not torch.equal(value, initial[name])
    assert changed > 0  # (the second sync sent trained weights)
    trainer.close()


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """A Hugging Face cache in a temporary directory, offline: nothing is fetched."""
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    return cache


def place_in_cache(cache, base, repo_id):
    """``base``'s files as the Hub's cache lays out a downloaded snapshot."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    shutil.copytree(base, repo / "snapshots" / COMMIT)


def same_weights(streamed, model) -> bool:
    """The streamed reference's weights (its state_dict reads them from the SSD array) are ``model``'s."""
    got, want = streamed.state_dict(), model.state_dict()
    return set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)


def test_dpo_reference_of_a_policy_loaded_from_a_hub_id(base, daemon, tmp_path, hub_cache):
    """A policy from_pretrained("org/name") out of the local cache: its reference is streamed
    from that snapshot (the same weights); an id not in the cache is refused before anything
    is written, naming ref_model= and snapshot_download."""
    place_in_cache(hub_cache, base, HUB_ID)
    policy = transformers.AutoModelForCausalLM.from_pretrained(HUB_ID)
    assert policy.config._name_or_path == HUB_ID
    trainer = dpo(base, tmp_path, daemon, model=policy)
    assert trainer.reference_engine is not None and trainer.ref_model is trainer.reference_engine.model
    assert all(p.numel() == 0 for p in trainer.ref_model.transformer.h.parameters())  # (streamed)
    assert same_weights(trainer.ref_model, transformers.AutoModelForCausalLM.from_pretrained(base))
    trainer.close()

    before = written(daemon)
    stranger = transformers.AutoModelForCausalLM.from_pretrained(base)
    stranger.config._name_or_path = "fuyou-test/not-in-the-cache"
    with pytest.raises(ValueError, match=r"'fuyou-test/not-in-the-cache', neither a directory nor a model in the "
                                         r"local Hugging Face cache.*is none here: pass ref_model=.*snapshot_download"):
        dpo(base, tmp_path, daemon, model=stranger)
    assert written(daemon) == before


REMOTE_CONFIG = '''from transformers import GPT2Config


class TinyRemoteConfig(GPT2Config):
    model_type = "fuyou-tiny-remote"
'''
REMOTE_MODEL = '''from transformers import GPT2LMHeadModel

from .configuration_tiny_remote import TinyRemoteConfig


class TinyRemoteLM(GPT2LMHeadModel):
    config_class = TinyRemoteConfig
'''


@pytest.fixture
def modules_cache(tmp_path, monkeypatch):
    """transformers' copies of remote code go to a temporary directory, and are forgotten after."""
    dynamic = pytest.importorskip("transformers.dynamic_module_utils")
    monkeypatch.setattr(dynamic, "HF_MODULES_CACHE", str(tmp_path / "modules"))
    monkeypatch.setattr(sys, "path", list(sys.path))
    yield
    for name in [m for m in sys.modules if m.startswith("transformers_modules")]:
        del sys.modules[name]


def test_dpo_reference_of_a_remote_code_policy(base, daemon, tmp_path, modules_cache):
    """A policy whose class is its checkpoint's own code (trust_remote_code=True): its reference
    is built with that code, whether the DPO config says trust_remote_code=True or leaves it
    (the policy's loading trusted it)."""
    where = tmp_path / "remote"
    shutil.copytree(base, where)
    config = json.loads((where / "config.json").read_text())
    config.update(model_type="fuyou-tiny-remote", architectures=["TinyRemoteLM"],
                  auto_map={"AutoConfig": "configuration_tiny_remote.TinyRemoteConfig",
                            "AutoModelForCausalLM": "modeling_tiny_remote.TinyRemoteLM"})
    (where / "config.json").write_text(json.dumps(config))
    (where / "configuration_tiny_remote.py").write_text(REMOTE_CONFIG)
    (where / "modeling_tiny_remote.py").write_text(REMOTE_MODEL)
    for trust in (True, False):
        policy = transformers.AutoModelForCausalLM.from_pretrained(where, trust_remote_code=True)
        assert type(policy).__name__ == "TinyRemoteLM"
        trainer = dpo(base, tmp_path / "out", daemon, model=policy, trust_remote_code=trust)
        assert type(trainer.ref_model).__name__ == "TinyRemoteLM" and trainer.reference_engine is not None
        assert same_weights(trainer.ref_model, policy)
        trainer.close()


def test_sft_arguments_are_refused_before_the_data_is_prepared(base, tmp_path, monkeypatch):
    """SFT too: before TRL tokenizes the data set."""
    prepared = []
    monkeypatch.setattr(trl.SFTTrainer, "_prepare_dataset", lambda self, *a, **k: prepared.append(1))
    with pytest.raises(ValueError, match="fp16=True"):
        FuyouSFTTrainer(model=transformers.AutoModelForCausalLM.from_pretrained(base),
                        args=trl.SFTConfig(output_dir=str(tmp_path), max_length=32, fp16=True, **COMMON),
                        train_dataset=datasets.Dataset.from_dict({"text": LINES}),
                        processing_class=transformers.AutoTokenizer.from_pretrained(base))
    assert not prepared
