"""Activations kept, swapped to host memory or on to SSD, or recomputed: training is
bitwise the same (dropout included); the compute device's activation peak falls;
nothing is left behind."""
from __future__ import annotations

import pytest
import torch

import fuyou_client
from conftest import SMALL, private_daemon, scrape

transformers = pytest.importorskip("transformers")
MiB = 1 << 20


@pytest.fixture(scope="module")
def daemon():
    """One fuyoud with conftest's small limits for the module (each session has a namespace
    of its own; what a test parks it reads back from its own session): a daemon each cost
    3-4 s a test. The traffic test, which reads the daemon's counters, takes a new one."""
    with private_daemon(SMALL, prefix="fy-act-") as d:
        yield d


def gpt2():
    cfg = transformers.GPT2Config(n_layer=4, n_embd=64, n_head=4, vocab_size=256, n_positions=64, resid_pdrop=0.1,
                                  embd_pdrop=0.1, attn_pdrop=0.1, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg)


def llama():
    cfg = transformers.LlamaConfig(num_hidden_layers=4, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=256, max_position_embeddings=64,
                                   attention_dropout=0.1, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return transformers.LlamaForCausalLM(cfg)


def train(make_model, daemon, steps=3, **kwargs):
    torch.manual_seed(0)
    model = make_model()
    engine = fuyou_client.attach(model, socket=daemon.socket, **kwargs)
    torch.manual_seed(7)  # dropout draws the same masks in every run
    losses = []
    for i in range(steps):
        x = torch.randint(0, 256, (4, 64), generator=torch.Generator().manual_seed(i))
        loss = model(x, labels=x).loss
        loss.backward()
        engine.step()
        engine.zero_grad()
        losses.append(loss.item())
    return model, engine, losses


@pytest.mark.parametrize("make_model", [gpt2, pytest.param(llama, marks=pytest.mark.slow)])
def test_kept_swapped_to_host_and_to_ssd_train_bitwise_alike(daemon, make_model):
    runs = {}
    for name, kwargs in {"keep": {}, "host": dict(activations="swap", host_budget=64 * MiB),
                         "ssd": dict(activations="swap", host_budget=256 << 10),
                         "recompute": dict(activations="recompute"),
                         "mixed": dict(activations={"block0000": "recompute", "block0002": "swap"},
                                       host_budget=256 << 10)}.items():
        model, engine, losses = train(make_model, daemon, **kwargs)
        stats = engine.activations.stats
        runs[name] = (losses, stats.device_peak, stats.host_peak, engine.session.objects("act/"))
        engine.close()
        runs[name] += ({k: v.clone() for k, v in model.state_dict().items()},)
    base_losses, keep_peak, _, _, base = runs["keep"]
    for name in ("host", "ssd", "recompute", "mixed"):
        losses, device_peak, host_peak, leftovers, state = runs[name]
        assert losses == base_losses, name
        for key, value in state.items():
            assert torch.equal(value, base[key]), (name, key)
        assert leftovers == []  # every parked activation was freed after backward used it
        if name in ("host", "ssd"):
            assert device_peak < keep_peak / 20, (name, device_peak, keep_peak)  # only tiny tensors stay
        elif name == "recompute":
            assert device_peak < keep_peak / 5, (name, device_peak, keep_peak)  # block inputs only
        else:
            assert runs["ssd"][1] < device_peak < keep_peak
    assert runs["host"][2] > 256 << 10 >= runs["ssd"][2]  # the small arena spilled to SSD


@pytest.mark.slow  # (four swapped steps for the metrics: about 15 s)
def test_traffic_is_counted_and_reported(small_daemon):
    _, engine, _ = train(gpt2, small_daemon, steps=4, activations="swap", host_budget=256 << 10)
    stats = engine.activations.stats
    assert stats.host_bytes == 0 and stats.device_bytes == 0  # all used by backward
    engine.close()
    import time

    time.sleep(0.3)
    m = scrape(small_daemon.status().metrics_url)
    assert m['fuyoud_activation_bytes_total{tier="ssd"}'] > 0
    assert m['fuyoud_activation_bytes_total{tier="host"}'] >= m['fuyoud_activation_bytes_total{tier="ssd"}']


def test_per_group_treatments_and_a_forward_without_backward(daemon):
    torch.manual_seed(0)
    model = gpt2()
    engine = fuyou_client.attach(model, socket=daemon.socket, activations={"block0000": "swap"},
                                 host_budget=256 << 10)
    x = torch.randint(0, 256, (4, 64))
    model(x, labels=x).loss.backward()
    engine.step()
    one = engine.activations.stats.to_host
    assert one > 0
    model(x, labels=x)  # no backward: what it parked goes at zero_grad
    assert engine.activations.stats.host_bytes > 0 or engine.session.objects("act/")
    engine.zero_grad()
    assert engine.activations.stats.host_bytes == 0 and engine.session.objects("act/") == []
    engine.close()


def test_bad_activation_settings_are_refused_clearly(daemon):
    with pytest.raises(ValueError, match="expected one of"):
        fuyou_client.attach(gpt2(), socket=daemon.socket, activations="sometimes")
    with pytest.raises(ValueError, match=r"unknown groups \['block9'\]"):
        fuyou_client.attach(gpt2(), socket=daemon.socket, activations={"block9": "swap"})
    model = gpt2()
    engine = fuyou_client.attach(model, socket=daemon.socket, activations="swap", host_budget=64 << 10)
    x = torch.randint(0, 256, (4, 64))
    with pytest.raises(ValueError, match="host_budget of at least"):
        model(x, labels=x)
    engine.close()


class Twice(torch.nn.Module):
    """Each block called twice per step (shared weights): every call's activations are
    parked and come back on their own; the weights' storage is never swapped."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(256, 64)
        self.blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(),
                                                              torch.nn.Linear(256, 64)) for _ in range(3))

    def forward(self, x):
        h = self.embed(x)
        for b in self.blocks:
            h = h + b(h)
            h = h + b(h)
        return h.square().mean()


@pytest.mark.slow  # (three runs of three steps per offload setting: 10 s each)
@pytest.mark.parametrize("offload", [True, False])
def test_blocks_called_twice_and_parameter_views(daemon, offload):
    results = []
    for kwargs in ({}, dict(activations="swap", host_budget=1 << 20), dict(activations="recompute")):
        torch.manual_seed(0)
        model = Twice()
        engine = fuyou_client.attach(model, socket=daemon.socket, offload=offload, **kwargs)
        for i in range(3):
            x = torch.randint(0, 256, (8, 64), generator=torch.Generator().manual_seed(i))
            model(x).backward()
            engine.step()
            engine.zero_grad()
        engine.close()
        results.append({k: v.clone() for k, v in model.state_dict().items()})
    for other in results[1:]:
        for key, value in other.items():
            assert torch.equal(value, results[0][key]), key


@pytest.mark.slow  # (two Llama runs of four steps; auto is also planned in test_planner.py)
def test_auto_on_llama_trains_bitwise_like_keep(daemon):
    keep, engine, keep_losses = train(llama, daemon, steps=4)
    budget = engine.activations.stats.device_peak // 3
    engine.close()
    auto, engine, auto_losses = train(llama, daemon, steps=4, activations="auto", device_budget=budget,
                                      host_budget=512 << 10)
    assert engine.plan is not None and engine.plan.fits
    engine.close()
    assert auto_losses == keep_losses
    for (name, a), b in zip(auto.state_dict().items(), keep.state_dict().values()):
        assert torch.equal(a, b), name
