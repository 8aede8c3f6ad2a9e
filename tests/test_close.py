"""engine.close(): every parameter holds its trained value (bitwise torch's fused AdamW) or,
for an offloaded group's without ``materialize``, an empty placeholder: never the zeros the
session's shared memory reads as once it is gone, nor a stale value. Resident parameters
(the "rest" group, every group with ``offload=False``) keep theirs in every close mode."""
from __future__ import annotations

import copy

import pytest
import torch

import fuyou_client
from conftest import HYPER, SMALL, STREAMING, private_daemon, tiny_gpt2

transformers = pytest.importorskip("transformers")

VOCAB = 64


def model():
    torch.manual_seed(0)
    return tiny_gpt2(layers=2, width=32, vocab=VOCAB, positions=16)


def batches(n):
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (2, 16), generator=gen) for _ in range(n)]


def trained(daemon, steps=2, freeze=(), **options):
    """A tiny GPT-2 attached and trained ``steps`` steps, and its copy trained alike by
    torch.optim.AdamW(fused=True): (ours, engine, ref, ids of offloaded groups' parameters)."""
    ours = model()
    for name, p in ours.named_parameters():
        if name.startswith(freeze):
            p.requires_grad_(False)
    ref = copy.deepcopy(ours)
    engine = fuyou_client.attach(ours, fuyou_client.AdamW(**HYPER), socket=daemon.socket, **options)
    opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], **HYPER, fused=True)
    for x in batches(steps):
        ours(x, labels=x).loss.backward()
        engine.step()
        engine.zero_grad()
        ref(x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
    offloaded = {id(p) for g in engine.groups if g.offloaded is not None for p in g.offloaded.params}
    return ours, engine, ref, offloaded


def check(ours, ref, offloaded, materialize):
    """Resident parameters (and every one with ``materialize``) equal torch's; offloaded ones
    empty without it. No gradient is left a view of shared memory either."""
    for (name, p), r in zip(ours.named_parameters(), ref.parameters()):
        assert p.grad is None, name
        if id(p) in offloaded and not materialize:
            assert p.numel() == 0, f"{name}: offloaded, not materialized, yet holds {p.numel()} values"
        else:
            assert p.shape == r.shape and torch.equal(p, r), \
                f"{name}: max diff {(p.float() - r.float()).abs().max().item() if p.shape == r.shape else p.shape}"


CASES = {
    "block": {},
    "module": {"granularity": "module"},
    "resident": {"offload": False},
    # a frozen parameter in the rest group (left alone), one in an offloaded block (offloaded
    # with it) and a whole frozen block
    "frozen": {"freeze": ("transformer.wpe.", "transformer.h.0.ln_1.", "transformer.h.1.")},
}


# (the default suite: each case without materialize, where resident weights were zeroed; the rest slow)
@pytest.mark.parametrize("case, materialize", [
    pytest.param(c, m, id=f"{c}-{'materialized' if m else 'empty'}", marks=pytest.mark.slow if m else ())
    for c in CASES for m in (False, True)])
def test_close_keeps_every_trained_value(small_daemon, case, materialize):
    ours, engine, ref, offloaded = trained(small_daemon, **CASES[case])
    names = {id(p): n for n, p in ours.named_parameters()}
    resident = [names[id(p)] for p in ours.parameters() if id(p) not in offloaded]
    assert resident and "transformer.ln_f.weight" in resident  # (the rest group's: what used to read zeros)
    if case == "resident":
        assert not offloaded
    else:
        assert offloaded and any(n.startswith("transformer.h.0.") for n in map(names.get, offloaded))
    if case == "block":
        assert {"transformer.wte.weight", "transformer.wpe.weight"} <= set(resident)
    engine.close(materialize=materialize)
    check(ours, ref, offloaded, materialize)
    assert small_daemon.stop() == 0, small_daemon.log()
    check(ours, ref, offloaded, materialize)  # (nothing of the daemon's is read any more)


@pytest.mark.slow  # (two daemons' worth of steps: the default suite has the plain cases)
@pytest.mark.parametrize("materialize", [False, True], ids=["empty", "materialized"])
def test_a_step_the_daemon_refused_in_flight_at_close_leaves_the_committed_weights(small_daemon, materialize):
    """close() between backward and step(), the steps in flight refused (NaN gradients): the
    daemon kept its state, so the weights are those of the last step, and close keeps them."""
    ours, engine, ref, offloaded = trained(small_daemon)
    x = batches(3)[2]
    (ours(x, labels=x).loss * float("nan")).backward()  # (each group's step leaves in backward)
    assert any(g.submitted for g in engine.groups)
    engine.close(materialize=materialize)
    assert small_daemon.stop() == 0, small_daemon.log()
    check(ours, ref, offloaded, materialize)


@pytest.mark.slow  # (a daemon killed per case)
@pytest.mark.parametrize("offload", [False, True], ids=["resident", "offloaded"])
def test_a_step_lost_with_the_daemon_empties_its_group_and_close_says_so(short_tmp, offload):
    """The daemon dies while steps are in flight: what they wrote into the parameters is
    unknown, so those groups' parameters become empty placeholders (as the offloaded ones
    are) and close raises, naming them: never a silently stale or half-written value."""
    daemon = fuyou_client.start_daemon(short_tmp / "state", config=SMALL)
    try:
        ours, engine, _, _ = trained(daemon, steps=1, offload=offload)
        x = batches(2)[1]
        loss = ours(x, labels=x).loss
        daemon.kill()
        loss.backward()  # (the steps go, and fail)
        lost = [g.spec.name for g in engine.groups if g.submitted and g.offloaded is None]
        assert "rest" in lost
        with pytest.raises(RuntimeError, match="empty placeholders") as raised:
            engine.close(materialize=False)
    finally:
        daemon.stop()
    assert isinstance(raised.value.__cause__, fuyou_client.DaemonUnavailable)
    assert all(name in str(raised.value) for name in lost)
    for name, p in ours.named_parameters():
        assert p.numel() == 0 and p.grad is None, name


# -- Hugging Face's Trainer ---------------------------------------------------------------------
class Tokens(torch.utils.data.Dataset):
    def __init__(self, n=8, length=16):
        self.rows = torch.randint(0, VOCAB, (n, length), generator=torch.Generator().manual_seed(7))

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


def arguments(out):
    return transformers.TrainingArguments(
        output_dir=str(out), per_device_train_batch_size=2, learning_rate=3e-3, weight_decay=0.1, adam_beta1=0.8,
        adam_beta2=0.95, adam_epsilon=1e-6, max_grad_norm=0.5, lr_scheduler_type="constant", max_steps=2,
        save_strategy="no", report_to="none", use_cpu=True, seed=0, optim="adamw_torch_fused",
        dataloader_num_workers=0, disable_tqdm=True)


def test_fuyou_trainer_close_without_materialize_keeps_the_resident_weights(tmp_path):
    pytest.importorskip("accelerate")
    from fuyou_client.integrations.transformers import FuyouTrainer

    ref = transformers.Trainer(model=model(), args=arguments(tmp_path / "ref"), train_dataset=Tokens())
    ref.train()
    with private_daemon(STREAMING, "fy-cl-") as daemon:
        ours = FuyouTrainer(model=model(), args=arguments(tmp_path / "ours"), train_dataset=Tokens(),
                            fuyou={"socket": daemon.socket})
        ours.train()
        engine = ours.engine
        offloaded = {id(p) for g in engine.groups if g.offloaded is not None for p in g.offloaded.params}
        assert offloaded and len(offloaded) < len(list(ours.model.parameters()))
        ours.close(materialize=False)
    assert ours.engine is None
    check(ours.model, ref.model, offloaded, materialize=False)
