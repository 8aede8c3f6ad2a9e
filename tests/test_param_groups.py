"""Torch-style parameter groups through attach: bitwise torch.optim.AdamW(fused=True) with
the same groups, each group's hyperparameters (and a scheduler's changes to them) in its
parts' steps, and every bad group refused, named, before anything starts."""
from __future__ import annotations

import copy

import pytest
import torch

import fuyou_client
from conftest import HYPER, STREAMING, private_daemon, tiny_gpt2, tiny_llama
from fuyou_client.errors import InvalidArgument
from fuyou_client.model.param_groups import resolve

transformers = pytest.importorskip("transformers")



@pytest.fixture(scope="module")
def daemon():
    with private_daemon(STREAMING, "fy-pg-") as d:
        yield d


def gpt2():
    return tiny_gpt2()


def llama():
    return tiny_llama()


def hf_groups(model, lrs=(3e-3, 1e-3)):
    """Hugging Face Trainer's recipe (its own decay names), the no-decay group with another lr and betas."""
    decay = set(transformers.Trainer.get_decay_parameter_names(None, model))
    return [{"params": [p for n, p in model.named_parameters() if n in decay], "lr": lrs[0]},
            {"params": [p for n, p in model.named_parameters() if n not in decay], "weight_decay": 0.0,
             "lr": lrs[1], "betas": (0.7, 0.9)}]


def train(make_model, daemon, groups_of, steps=4, accumulation=1, clip=None, offload=True):
    """The model through attach and its deepcopy under torch's fused AdamW, the same groups,
    a scheduler with one lambda per group that also changes the second group's betas;
    returns (engine, ours, ref)."""
    torch.manual_seed(0)
    ours = make_model()
    ref = copy.deepcopy(ours)
    engine = fuyou_client.attach(ours, fuyou_client.AdamW(**HYPER), socket=daemon.socket,
                                 param_groups=groups_of(ours), max_grad_norm=clip,
                                 accumulation_steps=accumulation, offload=offload)
    opt = torch.optim.AdamW(groups_of(ref), **HYPER, fused=True)
    lambdas = [lambda s: 1.0 / (1 + s), lambda s: 0.5 ** s]
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, lambdas) for o in (engine.optimizer, opt)]
    gen = torch.Generator().manual_seed(1)
    for step in range(steps):
        for _ in range(accumulation):
            x = torch.randint(0, 256, (2, 16), generator=gen)
            ours(x, labels=x).loss.backward()
            ref(x, labels=x).loss.backward()
        engine.step()
        engine.zero_grad()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
        opt.step()
        opt.zero_grad()
        for o, s in zip((engine.optimizer, opt), scheds):
            s.step()
            o.param_groups[-1]["betas"] = (0.7 + 0.05 * step, 0.9)  # a scheduler of betas (cycle_momentum)
    return engine, ours, ref


def assert_bitwise(engine, ours, ref):
    engine.close()  # (materializes the offloaded weights)
    for (name, a), b in zip(ours.named_parameters(), ref.parameters()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("make_model", [gpt2, llama], ids=["gpt2", "llama"])
@pytest.mark.parametrize("offload", [True, pytest.param(False, marks=pytest.mark.slow)], ids=["offload", "resident"])
def test_groups_are_bitwise_torch(daemon, make_model, offload):
    engine, ours, ref = train(make_model, daemon, hf_groups, offload=offload)
    parts = [part for g in engine.groups for part in g.spec.parts]
    assert {p.index for p in parts} == {0, 1} and len(parts) > len(engine.groups)  # blocks stepped in two parts
    assert [g["lr"] for g in engine.optimizer.param_groups] == [3e-3 / 5, 1e-3 * 0.5 ** 4]
    assert_bitwise(engine, ours, ref)


@pytest.mark.parametrize("clip, accumulation", [(0.05, 1), pytest.param(None, 2, marks=pytest.mark.slow),
                                                 pytest.param(0.05, 2, marks=pytest.mark.slow)],
                         ids=["clip", "accum", "both"])
def test_groups_with_clipping_and_accumulation(daemon, clip, accumulation):
    engine, ours, ref = train(gpt2, daemon, hf_groups, clip=clip, accumulation=accumulation)
    assert_bitwise(engine, ours, ref)


def test_no_decay_auto_is_the_trainers_recipe(daemon):
    """no_decay="auto" picks what Trainer.get_decay_parameter_names leaves out; names too."""
    for make_model in (gpt2, llama):
        model = make_model()
        decay = set(transformers.Trainer.get_decay_parameter_names(None, model))
        names = {id(p): n for n, p in model.named_parameters()}
        groups = resolve(model, fuyou_client.AdamW(**HYPER), no_decay="auto").groups
        assert {names[id(p)] for p in groups[0]["params"]} == decay & set(names.values())  # (tied: one name)
        assert groups[0]["weight_decay"] == 0.1 and groups[1]["weight_decay"] == 0.0
        by_names = resolve(model, fuyou_client.AdamW(), no_decay=["bias"]).groups
        assert all(names[id(p)].endswith("bias") for p in by_names[1]["params"])
        assert bool(by_names[1]["params"]) == (make_model is gpt2)  # (Llama has no biases: an empty group)
        pred = resolve(model, fuyou_client.AdamW(), no_decay=lambda n, p: p.ndim < 2).groups
        assert all(p.ndim < 2 for p in pred[1]["params"])
    engine, ours, ref = train(gpt2, daemon, lambda m: resolve(m, fuyou_client.AdamW(**HYPER), no_decay="auto").groups)
    assert_bitwise(engine, ours, ref)


def test_resume_restores_every_groups_hyperparameters(daemon, tmp_path):
    """A checkpoint keeps each group's lr and betas; the resumed run continues bitwise."""
    engine, ours, ref = train(gpt2, daemon, hf_groups, steps=2)
    engine.save_checkpoint(tmp_path / "ck")
    saved = [dict(g) for g in engine.optimizer.param_groups]
    steps = engine.optimizer.state_dict()["state"]
    assert {float(s["step"]) for s in steps.values()} == {2.0}
    engine.close()
    torch.manual_seed(5)
    again = gpt2()
    engine2 = fuyou_client.attach(again, fuyou_client.AdamW(**HYPER), socket=daemon.socket,
                                  param_groups=hf_groups(again, lrs=(1.0, 1.0)), resume=tmp_path / "ck")
    for a, b in zip(engine2.optimizer.param_groups, saved):
        assert (a["lr"], tuple(a["betas"]), a["weight_decay"]) == (b["lr"], tuple(b["betas"]), b["weight_decay"])
    engine2.close()
    for a, b in zip(again.parameters(), ours.parameters()):
        assert torch.equal(a, b)


def test_optimizer_state_dict_round_trip(daemon):
    """state_dict: hyperparameters and step counts, no moments; load_state_dict takes it
    back (a changed lr reaches the next step) and refuses a torch optimizer's moments."""
    engine, ours, ref = train(gpt2, daemon, hf_groups, steps=1)
    sd = engine.optimizer.state_dict()
    assert len(sd["param_groups"]) == 2 and all(set(s) == {"step"} for s in sd["state"].values())
    sd["param_groups"][1]["lr"] = 0.25
    engine.optimizer.load_state_dict(sd)
    assert engine.optimizer.param_groups[1]["lr"] == 0.25
    torch_sd = torch.optim.AdamW(hf_groups(ref), fused=True)
    ref(torch.zeros(1, 4, dtype=torch.long), labels=torch.zeros(1, 4, dtype=torch.long)).loss.backward()
    torch_sd.step()
    with pytest.raises(ValueError, match="exp_avg.*resume=DIR"):
        engine.optimizer.load_state_dict(torch_sd.state_dict())
    wrong = copy.deepcopy(sd)
    for s in wrong["state"].values():
        s["step"] = torch.tensor(7.0)
    with pytest.raises(ValueError, match="at step 7 .* step 1"):
        engine.optimizer.load_state_dict(wrong)
    with pytest.raises(ValueError, match="closures"):
        engine.optimizer.step(lambda: 0.0)
    engine.close()


def test_a_scheduler_out_of_range_is_refused_at_the_step(daemon):
    torch.manual_seed(0)
    model = gpt2()
    engine = fuyou_client.attach(model, fuyou_client.AdamW(**HYPER), socket=daemon.socket, param_groups=hf_groups(model))
    engine.optimizer.param_groups[1]["betas"] = (1.5, 0.9)
    x = torch.zeros(1, 8, dtype=torch.long)
    with pytest.raises(InvalidArgument, match=r"param_groups\[1\].*betas\[0\]"):
        model(x, labels=x).loss.backward()
    engine.close()


def bad(model, *extra):
    p = dict(model.named_parameters())
    blocks = [v for k, v in p.items() if k.startswith("transformer.h.")]
    rest = [v for k, v in p.items() if not k.startswith("transformer.h.")]
    return [{"params": blocks}, {"params": rest}, *extra]


@pytest.mark.parametrize("groups, message", [
    (lambda m: bad(m, {"params": [m.transformer.wte.weight]}), r"'transformer.wte.weight' is in param_groups\[1\] "
                                                                r"and param_groups\[2\]"),
    (lambda m: [{"params": list(m.parameters()), "momentum": 0.9}], r"has 'momentum', which AdamW has not"),
    (lambda m: [{"params": list(m.parameters()), "lr": -1.0}], r"param_groups\[0\].*lr must be >= 0"),
    (lambda m: [{"params": list(m.parameters()), "amsgrad": True}], r"amsgrad=True is not supported"),
    (lambda m: [{"params": list(m.parameters()), "foreach": False}], r"foreach=False is not supported"),
    (lambda m: [{"params": list(m.parameters()), "maximize": True}], r"maximize=True is not supported"),
    (lambda m: [{"params": list(m.parameters())[1:]}], r"'transformer.wte.weight' \(1 in all\) requires grad but is "
                                                       r"in no param group"),
    (lambda m: [{"params": list(m.parameters()) + [torch.zeros(3, requires_grad=True)]}],
     r"shape \(3,\) that is not a parameter of this model"),
    (lambda m: [{"params": "transformer"}], r"must be parameters"),
], ids=["twice", "unknown-key", "negative-lr", "amsgrad", "foreach", "maximize", "missing", "foreign", "not-params"])
def test_bad_groups_are_refused_before_anything_starts(groups, message):
    model = gpt2()
    with pytest.raises(InvalidArgument, match=message):
        fuyou_client.attach(model, fuyou_client.AdamW(), socket="/nonexistent/fuyoud.sock", param_groups=groups(model))
    model.transformer.wte.weight.requires_grad_(False)
    with pytest.raises(InvalidArgument, match="'transformer.wte.weight', which is frozen"):
        fuyou_client.attach(model, socket="/nonexistent/fuyoud.sock", param_groups=[{"params": list(model.parameters())}])
    with pytest.raises(InvalidArgument, match="pass one"):
        fuyou_client.attach(model, socket="/nonexistent/fuyoud.sock", param_groups=[], no_decay="auto")
    assert all(p.device.type == "cpu" and p.numel() for p in model.parameters())  # untouched


def test_a_steps_hyperparameters_become_the_groups(daemon):
    """StepGroup(hyper=...): the step runs with them (bitwise torch with those values) and
    they are the group's from its commit on; another layout is refused; a refused step
    leaves the group's own."""
    with fuyou_client.connect(daemon.socket) as s:
        n = 10_000
        torch.manual_seed(3)
        init = torch.randn(n)
        w, g = s.allocate(n * 4), s.allocate(n * 4)
        w.tensor(torch.float32)[:n].copy_(init)
        s.create_group("h", w, fuyou_client.AdamW(**HYPER))
        ref = torch.nn.Parameter(init.clone())
        opt = torch.optim.AdamW([ref], **HYPER, fused=True)
        for betas, wd in (((0.8, 0.95), 0.1), ((0.5, 0.9), 0.0), ((0.6, 0.99), 0.2)):
            grad = torch.randn(n)
            g.tensor(torch.float32)[:n].copy_(grad)
            opt.param_groups[0].update(betas=betas, weight_decay=wd)
            ref.grad = grad.clone()
            opt.step()
            s.step_group("h", g, HYPER["lr"], out=w,
                         hyper=fuyou_client.AdamW(**{**HYPER, "betas": betas, "weight_decay": wd}))
            assert torch.equal(w.tensor(torch.float32)[:n], ref.data)
            assert s.group("h").optimizer.betas == betas and s.group("h").optimizer.weight_decay == wd
        with pytest.raises(InvalidArgument, match="state dtype and state layout"):
            s.step_group("h", g, 1e-3, hyper=fuyou_client.AdamW(state_dtype="bf16"))
        with pytest.raises(InvalidArgument, match="state dtype and state layout"):
            s.step_group("h", g, 1e-3, hyper=fuyou_client.SGD(momentum=0.9))
        g.tensor(torch.float32)[0] = float("nan")
        with pytest.raises(fuyou_client.NonFinite):
            s.step_group("h", g, 1e-3, hyper=fuyou_client.AdamW(**{**HYPER, "betas": (0.1, 0.2)}))
        info = s.group("h")
        assert info.step == 3 and info.optimizer.betas == (0.6, 0.99)
