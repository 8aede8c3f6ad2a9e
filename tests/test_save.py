"""No save of an attached model is silently empty: state_dict(), save_pretrained and the plain
Trainer's own checkpoints give the trained values (offloaded blocks' read from the SSD array),
engine.gathered() puts them in named_parameters(), and what would not fit in memory or comes
mid-iteration is refused, naming the way that works."""
from __future__ import annotations

import copy

import pytest
import torch

import fuyou_client
from conftest import HYPER, STREAMING, TokenRows, private_daemon, tiny_gpt2, tiny_llama

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def daemon():
    with private_daemon(STREAMING, "fy-save-") as d:
        yield d


def trained(daemon, make=tiny_gpt2, steps=2, dtype=torch.float32, **options):
    """An attached model after ``steps`` steps, and its reference trained in-process with
    torch's fused AdamW on fp32 masters (its parameters: the masters cast to ``dtype``)."""
    torch.manual_seed(0)
    ours = make().to(dtype)
    ref = copy.deepcopy(ours)
    engine = fuyou_client.attach(ours, fuyou_client.AdamW(**HYPER), socket=daemon.socket, **options)
    masters = [p.detach().float().clone().requires_grad_() for p in ref.parameters()]
    opt = torch.optim.AdamW(masters, **HYPER, fused=True)
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randint(0, 256, (2, 16), generator=gen)
        ours(x, labels=x).loss.backward()
        engine.step()
        engine.zero_grad()
        ref(x, labels=x).loss.backward()
        for m, p in zip(masters, ref.parameters()):
            m.grad = p.grad.float()
            p.grad = None
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for m, p in zip(masters, ref.parameters()):
                p.copy_(m)
    return ours, ref, engine


def assert_equal_to(state: dict, ref, skip=()):
    want = ref.state_dict()
    assert set(state) == set(want)
    for name, value in want.items():
        if name not in skip:
            assert state[name].shape == value.shape and torch.equal(state[name], value), name


@pytest.mark.parametrize("make, dtype, granularity", [(tiny_gpt2, torch.float32, "block"),
                                                      (tiny_llama, torch.bfloat16, "block"),
                                                      (tiny_gpt2, torch.float32, "module")],
                         ids=["gpt2-fp32", "llama-bf16", "gpt2-sub-blocks"])
def test_state_dict_and_save_pretrained_give_the_trained_weights(daemon, tmp_path, make, dtype, granularity):
    """Offloaded blocks (tied embeddings: GPT-2; untied, bf16: Llama; cut into sub-blocks, the
    tied embeddings one of them: granularity="module"): state_dict() holds every trained value,
    and save_pretrained -> from_pretrained gives them back."""
    ours, ref, engine = trained(daemon, make, dtype=dtype, granularity=granularity)
    assert any(p.numel() == 0 for p in ours.parameters())  # (offloaded: placeholders between uses)
    assert_equal_to(ours.state_dict(), ref)
    ours.save_pretrained(tmp_path / "saved")
    loaded = type(ref).from_pretrained(tmp_path / "saved", dtype=dtype)
    assert_equal_to(loaded.state_dict(), ref)
    # A block's own state_dict, and keep_vars=True (the parameters themselves, as torch gives them).
    block = ours.model.layers[1] if make is tiny_llama else ours.transformer.h[1]
    ref_block = ref.model.layers[1] if make is tiny_llama else ref.transformer.h[1]
    assert_equal_to(block.state_dict(), ref_block)
    kept = ours.state_dict(keep_vars=True)
    assert all(kept[n] is p for n, p in ours.named_parameters())
    engine.close()


def test_gathered_puts_the_trained_values_in_the_parameters(daemon):
    ours, ref, engine = trained(daemon)
    want = dict(ref.named_parameters())
    with engine.gathered():
        for name, p in ours.named_parameters():
            assert torch.equal(p, want[name]), name
    assert any(p.numel() == 0 for p in ours.parameters())  # placeholders again
    with engine.gathered(ours.transformer.h[2]):  # one block
        assert all(torch.equal(p, want[f"transformer.h.2.{n}"]) for n, p in ours.transformer.h[2].named_parameters())
        assert ours.transformer.h[1].attn.c_attn.weight.numel() == 0
    # The model still trains on after it (the placeholders and slots as they were).
    x = torch.randint(0, 256, (2, 16))
    ours(x, labels=x).loss.backward()
    engine.step()
    engine.close()


def test_what_would_not_fit_or_comes_mid_iteration_is_refused(daemon):
    ours, _, engine = trained(daemon, steps=1)
    engine.values_limit = 1000  # bytes: less than one block
    with pytest.raises(MemoryError, match=r"state_dict\(\) .* more than .*engine.values_limit.*engine.export\(DIR\)"):
        ours.state_dict()
    with pytest.raises(MemoryError, match=r"engine.gathered\(\).*engine.export"):
        with engine.gathered():
            pass
    engine.values_limit = None
    x = torch.randint(0, 256, (2, 16))
    ours(x, labels=x).loss.backward()  # (the groups' steps are under way until step())
    with pytest.raises(RuntimeError, match=r"state_dict\(\)"):
        ours.state_dict()
    engine.step()
    assert ours.state_dict()["transformer.h.0.attn.c_attn.weight"].shape == (64, 192)
    engine.close()


def test_the_plain_trainers_own_checkpoint_holds_the_trained_weights(daemon, tmp_path):
    """The plain Trainer given attach's optimizer saves its checkpoint through state_dict():
    checkpoint-N/model.safetensors holds the weights of step N (as engine.export has them),
    not empty tensors."""
    pytest.importorskip("accelerate")
    torch.manual_seed(0)
    model = tiny_gpt2()
    # (max_grad_norm: the steps wait for the barrier, so the Trainer's clipping may write the gradients)
    engine = fuyou_client.attach(model, fuyou_client.AdamW(lr=3e-3), socket=daemon.socket, max_grad_norm=1.0)
    args = transformers.TrainingArguments(output_dir=str(tmp_path / "run"), per_device_train_batch_size=2,
                                          max_steps=2, save_strategy="steps", save_steps=2,
                                          report_to="none", use_cpu=True, disable_tqdm=True, logging_steps=1)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=TokenRows(), optimizers=(engine.optimizer, None))
    trainer.train()
    engine.export(tmp_path / "exported")
    want = fuyou_client.load_exported(tmp_path / "exported")
    loaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "run" / "checkpoint-2")
    for name, p in loaded.named_parameters():
        assert torch.equal(p, want[name]), name
    engine.close()
