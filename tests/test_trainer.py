"""Hugging Face's Trainer through FuyouTrainer: its arguments honoured, bitwise Trainer with
optim="adamw_torch_fused" (groups, warmup and a linear schedule, accumulation, clipping);
a resumed run equals an uninterrupted one; save_model loads with from_pretrained; what it
cannot honour is refused by name."""
from __future__ import annotations

import pytest
import torch

import fuyou_client
from conftest import STREAMING, private_daemon, tiny_gpt2

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
from fuyou_client.integrations.transformers import FuyouTrainer  # noqa: E402



@pytest.fixture(scope="module")
def daemon():
    with private_daemon(STREAMING, "fy-tr-") as d:
        yield d


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n=32, length=16):
        gen = torch.Generator().manual_seed(7)
        self.rows = torch.randint(0, 256, (n, length), generator=gen)

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


def model():
    torch.manual_seed(0)
    return tiny_gpt2()


def arguments(out, **kw):
    base = dict(output_dir=str(out), per_device_train_batch_size=2, gradient_accumulation_steps=2, learning_rate=3e-3,
                weight_decay=0.1, adam_beta1=0.8, adam_beta2=0.95, adam_epsilon=1e-6, max_grad_norm=0.5,
                lr_scheduler_type="linear", warmup_steps=2, max_steps=6, logging_steps=1, save_strategy="no",
                report_to="none", use_cpu=True, seed=0, optim="adamw_torch_fused", dataloader_num_workers=0,
                disable_tqdm=True)
    base.update(kw)
    return transformers.TrainingArguments(**base)


def weights(trainer, where):
    trainer.save_model(where)
    return fuyou_client.load_exported(where) if isinstance(trainer, FuyouTrainer) else \
        {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


def logs(trainer):
    return [(e["loss"], e["learning_rate"], e["grad_norm"]) for e in trainer.state.log_history if "loss" in e]


@pytest.mark.parametrize("offload", [True, False], ids=["offload", "resident"])
def test_fuyou_trainer_is_bitwise_the_trainer(daemon, tmp_path, offload):
    ref = transformers.Trainer(model=model(), args=arguments(tmp_path / "ref"), train_dataset=Tokens())
    ref.train()
    ours = FuyouTrainer(model=model(), args=arguments(tmp_path / "ours"), train_dataset=Tokens(),
                        fuyou={"socket": daemon.socket, "offload": offload})
    ours.train()
    assert logs(ours) == logs(ref) and len(logs(ours)) == 6  # loss, learning rate and grad norm of every step
    assert [len(g["params"]) for g in ours.optimizer.param_groups] == [len(g["params"])
                                                                      for g in ref.optimizer.param_groups]
    got, want = weights(ours, tmp_path / "ours-out"), weights(ref, tmp_path / "ref-out")
    for name, p in want.items():
        assert torch.equal(got[name], p), name
    loaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "ours-out")
    for name, p in loaded.named_parameters():
        assert torch.equal(p, want[name]), name
    ours.engine.close()


@pytest.mark.slow  # (three Trainer runs: about 10 s)
def test_a_resumed_run_equals_an_uninterrupted_one(daemon, tmp_path):
    """Checkpoints every 2 steps, at most 2 kept (the oldest deleted through fuyoud); a
    new trainer resumes from step 4 and ends where the uninterrupted one did."""
    save = dict(save_strategy="steps", save_steps=2, save_total_limit=2)
    whole = FuyouTrainer(model=model(), args=arguments(tmp_path / "run", **save), train_dataset=Tokens(),
                         fuyou={"socket": daemon.socket})
    whole.train()
    assert sorted(p.name for p in (tmp_path / "run").glob("checkpoint-*")) == ["checkpoint-4", "checkpoint-6"]
    assert all((tmp_path / "run" / c / "fuyou" / "manifest.json").is_file() for c in ("checkpoint-4", "checkpoint-6"))
    # Three were taken; the rotated one's snapshot went through fuyoud, not left on the SSD array.
    snapshots = {o.name.split("/")[1] for o in whole.engine.session.objects("snapshots/")}
    assert len(snapshots) == 2, snapshots
    want = weights(whole, tmp_path / "whole-out")
    whole.engine.close()
    resumed = FuyouTrainer(model=model(), args=arguments(tmp_path / "run", **save), train_dataset=Tokens(),
                           fuyou={"socket": daemon.socket})
    resumed.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-4"))
    assert resumed.state.global_step == 6
    assert logs(resumed)[-2:] == logs(whole)[-2:]
    got = weights(resumed, tmp_path / "resumed-out")
    for name, p in want.items():
        assert torch.equal(got[name], p), name
    resumed.engine.close()


@pytest.mark.parametrize("kw, fuyou, message", [
    (dict(optim="adafactor"), None, "optim='adafactor' is not available"),
    (dict(activation_checkpointing=True), {"activations": "swap"}, "activations='swap'.*gradient_checkpointing=False"),
    ({}, {"max_grad_norm": 1.0}, "sets max_grad_norm .*TrainingArguments.max_grad_norm"),
    ({}, {"accumulation_steps": 2}, "sets accumulation_steps"),
    (dict(torch_compile_mode="reduce-overhead"), None, "torch_compile_mode='reduce-overhead' captures CUDA graphs"),
], ids=["optim", "checkpointing", "clipping-twice", "accumulation", "cuda-graphs"])
def test_what_it_cannot_honour_is_refused(tmp_path, kw, fuyou, message):
    with pytest.raises(ValueError, match=message):
        FuyouTrainer(model=model(), args=arguments(tmp_path, **kw), train_dataset=Tokens(), fuyou=fuyou)
    with pytest.raises(Exception, match="state_dtype"):
        FuyouTrainer(model=model(), args=arguments(tmp_path), train_dataset=Tokens(), state_dtype="fp8")


def test_a_plain_trainer_clipping_after_the_steps_went_is_refused(daemon, tmp_path):
    """The plain Trainer given attach's optimizer, attached without max_grad_norm (the
    steps leave during backward): its clip_grad_norm_ after backward is refused, not a
    silent race with the steps reading those gradients."""
    m = model()
    engine = fuyou_client.attach(m, fuyou_client.AdamW(lr=3e-3), socket=daemon.socket)
    trainer = transformers.Trainer(model=m, args=arguments(tmp_path, max_grad_norm=1.0, gradient_accumulation_steps=1),
                                   train_dataset=Tokens(),
                                   optimizers=(engine.optimizer, None))
    with pytest.raises(RuntimeError, match="after its layer group's step went to fuyoud.*max_grad_norm"):
        trainer.train()
    engine.close()


def test_the_best_checkpoint_is_loaded_at_the_end_and_early_stopping_stops(daemon, tmp_path):
    """load_best_model_at_end with EarlyStoppingCallback, bitwise the plain Trainer: the best
    checkpoint (here the first: a metric made to prefer a higher eval loss) is loaded into the
    engine at the end, and early stopping ends the run where the plain one ends."""
    best = dict(eval_strategy="steps", eval_steps=2, save_strategy="steps", save_steps=2, load_best_model_at_end=True,
                metric_for_best_model="eval_loss", greater_is_better=True, max_steps=8)
    stop = lambda: [transformers.EarlyStoppingCallback(early_stopping_patience=1)]  # noqa: E731
    ref = transformers.Trainer(model=model(), args=arguments(tmp_path / "ref", **best), train_dataset=Tokens(),
                               eval_dataset=Tokens(4), callbacks=stop())
    ref.train()
    ours = FuyouTrainer(model=model(), args=arguments(tmp_path / "ours", **best), train_dataset=Tokens(),
                        eval_dataset=Tokens(4), callbacks=stop(), fuyou={"socket": daemon.socket})
    ours.train()
    assert ours.state.global_step == ref.state.global_step < 8  # stopped early, at the same step
    assert ours.state.best_model_checkpoint.endswith("checkpoint-2")
    assert logs(ours) == logs(ref)
    got, want = weights(ours, tmp_path / "ours-out"), weights(ref, tmp_path / "ref-out")
    for name, p in want.items():
        assert torch.equal(got[name], p), name
    ours.close()


# What inductor may change against the plain compiled Trainer: the order of a few floating-point
# sums in the graphs it generates (its block graphs here are cut at attach's hooks). Measured on
# this model over 4 steps: identical, or a relative 1e-7 on a loss (docs/guide/trl.md).
INDUCTOR_RTOL = 1e-5


@pytest.mark.slow  # (compiling: 20-60 s each)
@pytest.mark.parametrize("backend, recompute", [("aot_eager", False), ("inductor", True)])
def test_torch_compile_with_offloaded_weights(daemon, tmp_path, backend, recompute):
    """torch_compile=True with offloaded blocks: the Trainer compiles the whole model, attach's
    fetches stay out of the graph (they were traced: an assertion in inductor's generated code).
    aot_eager: bitwise the plain compiled Trainer; inductor (with gradient checkpointing,
    Fuyou's recomputation): within INDUCTOR_RTOL."""
    kw = dict(torch_compile_backend=backend, max_steps=4, activation_checkpointing=recompute)
    ref = transformers.Trainer(model=model(), args=arguments(tmp_path / "ref", **kw), train_dataset=Tokens())
    ref.train()
    ours = FuyouTrainer(model=model(), args=arguments(tmp_path / "ours", **kw), train_dataset=Tokens(),
                        fuyou={"socket": daemon.socket})
    ours.train()
    got, want = weights(ours, tmp_path / "ours-out"), weights(ref, tmp_path / "ref-out")
    if backend == "aot_eager":
        assert logs(ours) == logs(ref)
        assert all(torch.equal(got[n], p) for n, p in want.items())
    else:
        assert len(logs(ours)) == len(logs(ref)) == 4
        for a, b in zip(logs(ours), logs(ref)):
            assert a == pytest.approx(b, rel=INDUCTOR_RTOL)
        for name, p in want.items():
            assert torch.allclose(got[name], p, rtol=INDUCTOR_RTOL, atol=1e-7), name
    ours.close()
