"""The Trainer, TRL and PEFT in the user's world (tests/userworld.py): the host's fuyoud as
the shipped unit runs it (its own uid, no checkpoint_dirs), a training user of its group,
its output_dir in its own 0700 home. Saves, rotation (save_total_limit), the best model at
the end, resume in a fresh process (bitwise the uninterrupted run), the adapter and the
merged model: every file the user's, at block and module granularity."""
from __future__ import annotations

import json
import tempfile
import textwrap
from pathlib import Path

import pytest

from userworld import TRAINER, host_daemon, needs_readable_packages, needs_user_world, owners

pytestmark = [needs_user_world, needs_readable_packages]
pytest.importorskip("transformers")
pytest.importorskip("accelerate")

TRAINER_RUN = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    import torch, transformers
    from fuyou_client.integrations.transformers import FuyouTrainer

    socket, granularity, phase = sys.argv[1:4]

    class Tokens(torch.utils.data.Dataset):
        def __init__(self, n=24, length=16):
            self.rows = torch.randint(0, 256, (n, length), generator=torch.Generator().manual_seed(7))
        def __len__(self):
            return len(self.rows)
        def __getitem__(self, i):
            return {"input_ids": self.rows[i], "labels": self.rows[i]}

    torch.manual_seed(0 if phase == "run" else 123)  # (resumed: every weight must come from the checkpoint)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))
    args = transformers.TrainingArguments(
        output_dir=str(Path.home() / "run"), per_device_train_batch_size=2, learning_rate=3e-3, max_steps=6,
        logging_steps=1, save_strategy="steps", save_steps=2, save_total_limit=2, eval_strategy="steps",
        eval_steps=2, load_best_model_at_end=phase == "run", metric_for_best_model="loss",
        greater_is_better=False, report_to="none", use_cpu=True, seed=0, optim="adamw_torch_fused",
        dataloader_num_workers=0, disable_tqdm=True)
    trainer = FuyouTrainer(model=model, args=args, train_dataset=Tokens(), eval_dataset=Tokens(4),
                           fuyou={"socket": socket, "granularity": granularity})
    resume = None
    if phase == "resume":
        kept = sorted(int(p.name.split("-")[1]) for p in (Path.home() / "run").glob("checkpoint-*"))
        resume = str(Path.home() / "run" / f"checkpoint-{kept[0]}")
    trainer.train(resume_from_checkpoint=resume)
    trainer.save_model(str(Path.home() / f"saved-{phase}"))
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    out = {"losses": losses, "best": trainer.state.best_model_checkpoint, "resumed_from": resume,
           "checkpoints": sorted(p.name for p in (Path.home() / "run").glob("checkpoint-*"))}
    trainer.close(materialize=False)
    print(json.dumps(out))
""")

SFT_PEFT = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    import datasets, peft, tokenizers, torch, transformers, trl
    from fuyou_client.integrations.trl import FuyouSFTTrainer

    socket, granularity = sys.argv[1:3]
    text = [f"line {i} of a small corpus, written here and nowhere else" for i in range(64)]
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    tok.train_from_iterator(text, tokenizers.trainers.BpeTrainer(
        vocab_size=256, special_tokens=["<unk>", "<eos>", "<pad>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>",
                                               unk_token="<unk>")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=len(tok), max_position_embeddings=64, bos_token_id=1, eos_token_id=1, pad_token_id=2))
    config = trl.SFTConfig(output_dir=str(Path.home() / "sft"), max_steps=4, per_device_train_batch_size=2,
                           learning_rate=1e-3, optim="adamw_torch_fused", report_to="none", use_cpu=True,
                           logging_steps=1, save_strategy="steps", save_steps=2, save_total_limit=2, seed=0,
                           disable_tqdm=True, max_length=32,
                           gradient_checkpointing=False)  # (recomputing cut blocks: refused, test_subblocks.py)
    lora = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"], use_dora=True)
    trainer = FuyouSFTTrainer(model=model, args=config, train_dataset=datasets.Dataset.from_dict({"text": text}),
                              processing_class=tok, peft_config=lora,
                              fuyou={"socket": socket, "granularity": granularity})
    trainer.train()
    trainer.save_model(str(Path.home() / "adapter"))
    trainer.save_merged_model(str(Path.home() / "merged"))
    merged = transformers.AutoModelForCausalLM.from_pretrained(str(Path.home() / "merged"))
    torch.manual_seed(0)  # (the same base, frozen: what PEFT merges the saved adapter into)
    base = transformers.LlamaForCausalLM(model.config)
    want = peft.PeftModel.from_pretrained(base, str(Path.home() / "adapter")).merge_and_unload().state_dict()
    same = set(want) == set(merged.state_dict()) and all(
        torch.equal(merged.state_dict()[n], t) for n, t in want.items())
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    trainer.close(materialize=False)
    torch.manual_seed(0)  # (the same frozen base: a checkpoint holds what trains)
    again = transformers.LlamaForCausalLM(model.config)
    resumed = FuyouSFTTrainer(model=again, args=config, train_dataset=datasets.Dataset.from_dict({"text": text}),
                              processing_class=tok, peft_config=lora,
                              fuyou={"socket": socket, "granularity": granularity})
    resumed.train(resume_from_checkpoint=str(Path.home() / "sft" / "checkpoint-2"))
    again_losses = [e["loss"] for e in resumed.state.log_history if "loss" in e]
    resumed.close(materialize=False)
    print(json.dumps({"losses": losses, "resumed": again_losses, "merged_is_peft_merge": same,
                      "kept": sorted(p.name for p in (Path.home() / "sft").glob("checkpoint-*"))}))
""")


@pytest.fixture(scope="module")
def host():
    root = Path(tempfile.mkdtemp(prefix="fyuw-", dir="/tmp"))
    with host_daemon(root) as d:
        yield d
        assert d.stop() == 0, d.log()


def last_json(out: str):
    return json.loads(out.strip().splitlines()[-1])


def all_the_users(host, path: Path) -> None:
    for name, (uid, gid, _mode) in owners(path).items():
        assert (uid, gid) == (TRAINER.uid, TRAINER.gid), f"{path.name}/{name} is {uid}:{gid}'s"


@pytest.mark.slow  # (two Trainer runs as another uid: about 25 s a granularity; test_user_world.py's checkpoint test is the default suite's)
@pytest.mark.parametrize("granularity", ["block", "module"])
def test_a_trainer_saves_rotates_and_resumes_in_the_users_output_dir(host, granularity):
    """FuyouTrainer with ordinary arguments (save_steps=2, save_total_limit=2,
    load_best_model_at_end) under the host's daemon: it saves in the user's output_dir (it
    died at the first save before), rotates, loads the best checkpoint; a fresh process of
    the user resumes from the oldest checkpoint kept and its losses from there are the
    uninterrupted run's; every file is the user's."""
    _, out, _ = host.run_as(TRAINER, TRAINER_RUN, args=[host.socket, granularity, "run"], timeout=400)
    run = last_json(out)
    assert len(run["losses"]) == 6
    assert len(run["checkpoints"]) == 2 and "checkpoint-6" in run["checkpoints"]  # (rotated: limit 2)
    assert run["best"] is not None and Path(run["best"]).name in run["checkpoints"]
    home = host.home(TRAINER)
    assert all((home / "run" / c / "fuyou" / "manifest.json").is_file() for c in run["checkpoints"])
    _, out, _ = host.run_as(TRAINER, TRAINER_RUN, args=[host.socket, granularity, "resume"], timeout=400)
    resumed = last_json(out)
    step = int(resumed["resumed_from"].rsplit("-", 1)[1])
    assert resumed["losses"][step:] == run["losses"][step:]
    all_the_users(host, home / "run")
    all_the_users(host, home / "saved-run")


@pytest.mark.slow  # (an SFT run with DoRA, the merged export, in a process of another uid: about 40 s)
def test_sft_with_dora_saves_and_merges_in_the_users_home_at_module_granularity(host):
    """TRL's SFTTrainer with a DoRA peft_config, cut by module: its checkpoints go in the
    user's output_dir and resume bitwise, the adapter saves as PEFT saves it, and the merged export is PEFT's
    own merge of the trained values; every file the user's."""
    _, out, _ = host.run_as(TRAINER, SFT_PEFT, args=[host.socket, "module"], timeout=400)
    got = last_json(out)
    assert len(got["losses"]) == 4 and got["merged_is_peft_merge"] is True
    assert got["resumed"][-2:] == got["losses"][-2:]  # (resumed from checkpoint-2: bitwise)
    assert got["kept"] == ["checkpoint-2", "checkpoint-4"]
    home = host.home(TRAINER)
    assert (home / "adapter" / "adapter_model.safetensors").is_file()
    for path in ("sft", "adapter", "merged"):
        all_the_users(host, home / path)
