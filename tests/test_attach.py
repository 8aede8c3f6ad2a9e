"""attach(model): training through fuyoud equals training in-process with torch.optim."""
from __future__ import annotations

import copy
import gc
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from torch import nn

import fuyou_client
from conftest import SMALL, merge, scrape, step_pair, tiny_gpt2, tiny_llama
from fuyou_client.offload import SavedCast

transformers = pytest.importorskip("transformers")

# The optimizer's daemon buffers (3 x 4 MiB) are smaller than the models' state
# (12 bytes per parameter, 1.4-1.7M parameters): the state really streams from SSD.
TIGHT = merge(SMALL, {"optimizer": {"buffer_budget": "12MiB", "buffers": 3}})
HYPER = dict(lr=3e-3, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1)


@pytest.fixture(scope="module")
def daemon():
    """One fuyoud per test module (tight optimizer buffers; every session has a namespace
    of its own, so the tests do not meet): a daemon per test cost a minute of the suite."""
    root = Path(tempfile.mkdtemp(prefix="fy-mod-", dir="/tmp"))
    d = fuyou_client.start_daemon(root / "state", config=merge(TIGHT, {"storage": {"capacity_per_device": "1GiB"}}))
    yield d
    code = d.stop()
    shutil.rmtree(root, ignore_errors=True)
    assert code == 0, d.log()


def gpt2():
    return tiny_gpt2(layers=8, width=128, vocab=512, positions=64)


def llama():
    return tiny_llama(layers=8, width=128, vocab=512, positions=64)


def train_pair(make_model, daemon, steps=10, accumulation=1, clip=None, dtype=torch.float32, offload=True, keep=0,
               device=None, grad_accumulation="device", master_device=None):
    """``device``: attach's (a Device at the seam, or "cuda": both models and the batches
    move there). ``master_device``: where the reference keeps and steps its fp32 masters
    (default: with the model). With ``grad_accumulation="host"`` the reference too sums
    each micro-batch's gradients in fp32."""
    torch.manual_seed(0)
    where = "cuda" if device == "cuda" else "cpu"
    ours = make_model().to(dtype).to(where)
    ref = copy.deepcopy(ours)
    engine = fuyou_client.attach(ours, fuyou_client.AdamW(**HYPER), socket=daemon.socket, device=device,
                                 max_grad_norm=clip, accumulation_steps=accumulation, offload=offload, keep=keep,
                                 grad_accumulation=grad_accumulation)
    masters = [p.detach().float().to(master_device or p.device, copy=True).requires_grad_() for p in ref.parameters()]
    opt = torch.optim.AdamW(masters, **HYPER, fused=True)
    sched_ours = torch.optim.lr_scheduler.LambdaLR(engine.optimizer, lambda s: 1.0 / (1 + s))
    sched_ref = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    gen = torch.Generator().manual_seed(1)
    losses = []
    fp32_sums = [torch.zeros_like(m) for m in masters] if grad_accumulation == "host" else None
    for _ in range(steps):
        for _ in range(accumulation):
            x = torch.randint(0, 512, (2, 32), generator=gen).to(where)
            loss = ours(x, labels=x).loss if hasattr(ours, "config") else ours(x).square().mean()
            loss.backward()
            ref_loss = ref(x, labels=x).loss if hasattr(ref, "config") else ref(x).square().mean()
            ref_loss.backward()
            losses.append(loss.item())
            if fp32_sums is not None:
                for acc, p in zip(fp32_sums, ref.parameters()):
                    acc += p.grad.float().to(acc.device)
                    p.grad = None
        engine.step()
        engine.all_infos = getattr(engine, "all_infos", []) + engine.last_step_infos
        engine.zero_grad()
        sched_ours.step()
        # The reference: fp32 masters stepped by torch, copied into the (maybe bf16) model.
        for i, (m, p) in enumerate(zip(masters, ref.parameters())):
            m.grad = fp32_sums[i].clone() if fp32_sums is not None else p.grad.float().to(m.device)
            if fp32_sums is not None:
                fp32_sums[i].zero_()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(masters, clip)
        opt.step()
        sched_ref.step()
        with torch.no_grad():
            for m, p in zip(masters, ref.parameters()):
                p.copy_(m)
                p.grad = None
    return engine, ours, ref, losses


def attached_pair(make_model, daemon, **kwargs):
    """A model attached with HYPER and its deepcopy under torch's fused AdamW, made before
    attach: (ours, engine, ref, opt)."""
    torch.manual_seed(0)
    ours = make_model()
    ref = copy.deepcopy(ours)
    engine = fuyou_client.attach(ours, fuyou_client.AdamW(**HYPER), socket=daemon.socket, **kwargs)
    return ours, engine, ref, torch.optim.AdamW(ref.parameters(), **HYPER, fused=True)


def assert_same(ours, ref):
    for (name, a), b in zip(ours.state_dict().items(), ref.state_dict().values()):
        assert torch.equal(a, b), f"{name}: max diff {(a.float() - b.float()).abs().max().item()}"


def train_with_torch_zero_grad(daemon, offload, device=None, accumulation=2, steps=3):
    """Training that zeroes gradients with torch's own ``model.zero_grad()`` (``.grad`` set
    to None), against torch's AdamW: (engine, ours, ref)."""
    ours, engine, ref, opt = attached_pair(gpt2, daemon, offload=offload, device=device,
                                           accumulation_steps=accumulation)
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        ours.zero_grad()
        opt.zero_grad()
        for _ in range(accumulation):
            x = torch.randint(0, 512, (2, 32), generator=gen)
            ours(x, labels=x).loss.backward()
            ref(x, labels=x).loss.backward()
        engine.step()
        opt.step()
    engine.close()
    return engine, ours, ref


def test_a_gradient_after_the_step_went_is_refused(daemon):
    """With accumulation_steps=1 each group's step goes as soon as backward finishes it; a
    second backward before engine.step() would write the buffer that step reads: refused
    before autograd writes it, and the step that went takes the first backward's."""
    model, engine, ref, opt = attached_pair(MLP, daemon)
    x = torch.randint(0, 512, (2, 8))
    model(x).square().mean().backward()
    ref(x).square().mean().backward()
    opt.step()
    with pytest.raises(RuntimeError, match="got a gradient after its step was submitted"):
        model.out(torch.randn(2, 8, 64)).sum().backward()  # only the head: a partial backward
    engine.step()
    assert torch.equal(model.out.weight, ref.out.weight)  # (the rest group: resident)
    engine.zero_grad()
    model(x).square().mean().backward()  # and training goes on
    engine.step()
    engine.close()


def test_an_eval_under_inference_mode_between_steps(daemon):
    """Evaluation under torch.inference_mode() between steps (offloaded weights fetched in
    it must stay ordinary tensors, or the next training forward cannot save them)."""
    ours, engine, ref, opt = attached_pair(gpt2, daemon)
    gen = torch.Generator().manual_seed(1)
    for _ in range(2):
        x = torch.randint(0, 512, (2, 32), generator=gen)
        step_pair(ours, engine, ref, opt, x)
        with torch.inference_mode():
            assert torch.equal(ours(x).logits, ref(x).logits)
    engine.close()
    assert not any(p.is_inference() for p in ours.parameters())
    assert_same(ours, ref)


def test_what_would_silently_diverge_from_torch_is_refused(daemon):
    """Changes after attach that the daemon's state cannot follow get a clear error
    instead of training differently from torch."""
    x = torch.randint(0, 512, (2, 32))
    model = gpt2()
    engine = fuyou_client.attach(model, socket=daemon.socket)
    with pytest.raises(RuntimeError, match="load_state_dict.. on an attached model"):
        model.load_state_dict(gpt2().state_dict())
    model.transformer.wpe.weight.requires_grad_(False)  # frozen after attach: its group still trains
    model(x, labels=x).loss.backward()
    with pytest.raises(RuntimeError, match="transformer.wpe.weight was frozen .* after attach"):
        engine.step()
    engine.close()
    model.load_state_dict(gpt2().state_dict())  # (detached: an ordinary model again)

    model = gpt2()
    model.transformer.h[0].requires_grad_(False)
    engine = fuyou_client.attach(model, socket=daemon.socket)
    model.transformer.h[0].requires_grad_(True)  # unfrozen after attach: no group has it
    model(x, labels=x).loss.backward()
    with pytest.raises(RuntimeError, match="transformer.h.0.* was unfrozen .* after attach"):
        engine.step()
    engine.close()

    model = gpt2()
    enable, disable = ((model.activation_checkpointing_enable, model.activation_checkpointing_disable)
                       if hasattr(model, "activation_checkpointing_enable")  # (transformers >= 5)
                       else (model.gradient_checkpointing_enable, model.gradient_checkpointing_disable))
    enable()
    with pytest.raises(ValueError, match="activations=.recompute."):
        fuyou_client.attach(model, socket=daemon.socket)
    disable()
    engine = fuyou_client.attach(model, socket=daemon.socket)
    enable()
    with pytest.raises(RuntimeError, match="gradient checkpointing"):
        model(x, labels=x)
    engine.close()


@pytest.mark.parametrize("offload", [pytest.param(True, marks=pytest.mark.slow), False], ids=["offloaded", "resident"])
def test_torch_zero_grad_on_the_model_trains_like_torch(daemon, offload):
    """``model.zero_grad()``, torch's (what Hugging Face's Trainer calls), in place of
    ``engine.zero_grad()``: autograd then makes gradients outside the shared buffers, and
    the steps take them all the same (they used to step the stale buffers)."""
    _, ours, ref = train_with_torch_zero_grad(daemon, offload)
    assert_same(ours, ref)


@pytest.mark.parametrize("make_model, offload",
                         [(gpt2, True), (llama, True), pytest.param(gpt2, False, marks=pytest.mark.slow)],
                         ids=["gpt2", "llama", "gpt2-resident-weights"])
def test_hf_causal_lms_train_bitwise_like_torch_adamw(daemon, make_model, offload):
    engine, ours, ref, losses = train_pair(make_model, daemon, offload=offload)
    blocks = ours.base_model.h if hasattr(ours.base_model, "h") else ours.model.layers
    assert len(engine.groups) == len(blocks) + 1
    state = sum(g.spec.numel for g in engine.groups) * 12
    assert state > 12 << 20  # larger than all optimizer buffers together
    assert engine.state_dict()["group_steps"] == {g.spec.name: 10 for g in engine.groups}
    assert len(engine.last_step_infos) == len(engine.groups)
    if offload:  # blocks' weights are not in memory between uses
        # backward's weight fetches come with a read-ahead of the state the step then uses
        assert any(i.prefetched for i in engine.all_infos), "the daemon never read a group's state ahead"
        assert all(p.numel() == 0 for p in blocks[0].parameters())
        block_bytes = engine.groups[0].spec.numel * 4
        # per iteration: every block for forward and again for backward, but the last;
        # backward's fetches mostly come with the daemon's read-ahead of the state, and a
        # block still in the slot forward released it to is used again, read no more
        off = engine.offloader
        assert off.fetched_bytes + off.served_bytes + off.reused_bytes == 10 * (2 * len(blocks) - 1) * block_bytes
        assert off.served_bytes > 0 and off.reused_bytes > 0
    engine.close()  # materialises the weights
    assert_same(ours, ref)


@pytest.mark.slow  # (about 20 s; accumulation and clipping also in test_param_groups.py, test_grad_guard.py)
def test_gradient_accumulation_and_exact_clipping(daemon):
    engine, ours, ref, _ = train_pair(gpt2, daemon, steps=4, accumulation=2, clip=0.05, keep=3)
    block_bytes = engine.groups[0].spec.numel * 4
    off = engine.offloader
    # kept blocks: one fetch; blocks still in their slots: none
    assert off.fetched_bytes + off.served_bytes + off.reused_bytes == 4 * 2 * (8 + 8 - 1 - 3) * block_bytes
    engine.close()
    assert_same(ours, ref)


@pytest.mark.slow  # (bf16 matmuls are slow on the CPU: about 15 s; bf16 also in test_blockmajor.py, test_optimizer.py)
def test_bf16_compute_with_fp32_masters(daemon):
    """bf16 parameters and gradients, fp32 master weights and moments in the daemon: the
    same recipe done by hand with torch gives the same bits (so the tolerance is zero;
    against an fp32 run the difference is bf16 rounding, about 1e-2 relative)."""
    engine, ours, ref, losses = train_pair(gpt2, daemon, steps=4, dtype=torch.bfloat16)
    engine.close()
    assert_same(ours, ref)


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(512, 64)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64)) for _ in range(3))
        self.out = nn.Linear(64, 8)

    def forward(self, x):
        h = self.embed(x)
        for layer in self.layers:
            h = h + layer(h)
        return self.out(h)


def test_autocast_keeps_no_copy_of_offloaded_weights_and_trains_like_torch(daemon):
    """Under torch.autocast (fp32 parameters, bf16 compute: the usual mixed-precision
    recipe), the bf16 copies of offloaded weights that matmuls save for backward are
    markers, cast again in backward, and autocast's cache of them goes with each block:
    both held 2 bytes per parameter of every block until backward (measured in the
    closing note of the change). Training is bitwise torch's under the same autocast."""
    ours, engine, ref, opt = attached_pair(gpt2, daemon, offload=True)
    weights = {tuple(p.shape) for p in ref.transformer.h.parameters() if p.dim() == 2}
    gen = torch.Generator().manual_seed(1)
    for step in range(2):
        x = torch.randint(0, 512, (2, 32), generator=gen)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = ours(x, labels=x).loss
        if step == 0:
            gc.collect()
            live = gc.get_objects()
            markers = [o for o in live if type(o) is SavedCast]
            copies = [o for o in live if type(o) is torch.Tensor and o.dtype == torch.bfloat16
                      and tuple(o.shape) in weights]
            assert len(markers) == 4 * len(ref.transformer.h) and not copies  # (4 matmuls a block)
            del live, markers, copies
        loss.backward()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            ref(x, labels=x).loss.backward()
        engine.step()
        engine.zero_grad()
        opt.step()
        opt.zero_grad()
    engine.close()
    assert_same(ours, ref)


def test_plain_module_with_a_module_list(daemon):
    engine, ours, ref, losses = train_pair(MLP, daemon, steps=6, clip=1.0)
    assert [g.spec.name for g in engine.groups] == ["block0000", "block0001", "block0002", "rest"]
    engine.close()
    assert_same(ours, ref)
    assert losses[-1] < losses[0]


def test_bad_models_and_daemons(daemon, short_tmp):
    bad = MLP()
    bad.out.weight.data = bad.out.weight.data.double()
    with pytest.raises(TypeError, match="torch.float64"):
        fuyou_client.attach(bad, socket=daemon.socket)
    shared = MLP()
    shared.layers[1][0].weight = shared.layers[0][0].weight
    with pytest.raises(ValueError, match="shared between groups block0000 and block0001"):
        fuyou_client.attach(shared, socket=daemon.socket)
    with pytest.raises(fuyou_client.DaemonUnavailable, match="no fuyoud answers"):
        fuyou_client.attach(MLP(), socket=str(short_tmp / "nobody.sock"))
    # torch's habits, refused before anything starts, with the way to say them here
    model = MLP()
    with pytest.raises(TypeError, match=r"not parameter groups: pass torch-style groups as attach\(model, optimizer, "
                                        r"param_groups=\[\.\.\.\]\)"):
        fuyou_client.attach(model, [{"params": list(model.parameters())}], socket=daemon.socket)
    with pytest.raises(TypeError, match="not torch.optim.adamw.AdamW: use fuyou_client.AdamW"):
        fuyou_client.attach(model, torch.optim.AdamW(model.parameters()), socket=daemon.socket)
    with pytest.raises(TypeError, match="not float"):
        fuyou_client.attach(model, 1e-3, socket=daemon.socket)
    tiny = fuyou_client.start_daemon(short_tmp / "tiny", config=merge(SMALL, {"storage": {"capacity_per_device": "1MiB"}}))
    try:
        with pytest.raises(RuntimeError, match=r"SSD array of fuyoud has 1\.0 MiB free but this model needs 2\d\.\d MiB"):
            fuyou_client.attach(gpt2(), socket=tiny.socket)
    finally:
        tiny.stop()


@pytest.mark.parametrize("offload", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_a_dead_daemon_is_a_clear_error_not_a_hang(short_tmp, offload):
    d = fuyou_client.start_daemon(short_tmp / "state", config=TIGHT)
    model = MLP()
    engine = fuyou_client.attach(model, socket=d.socket, offload=offload)
    x = torch.randint(0, 512, (2, 8))
    model(x).square().mean().backward()
    engine.step()
    d.kill()
    with pytest.raises(fuyou_client.DaemonUnavailable, match="fuyoud is not reachable"):
        model(x).square().mean().backward()
        engine.step()


class Sometimes(nn.Module):
    """Blocks with a parameter forward never uses, called twice per step."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(512, 32)
        self.blocks = nn.ModuleList(nn.Linear(32, 32) for _ in range(6))
        for b in self.blocks:
            b.unused = nn.Parameter(torch.ones(3))
        self.out = nn.Linear(32, 4)

    def forward(self, x):
        h = self.embed(x)
        for b in self.blocks:
            h = h + torch.tanh(b(h))
        return self.out(h)


def test_unused_parameters_and_a_model_called_twice(daemon):
    """More groups stay resident than there are weight slots (their unused parameters
    keep them from completing, the second call keeps the first's): slots are reused, the
    arithmetic stays torch's (weight decay 0: a zero gradient on fresh moments is no step)."""
    torch.manual_seed(0)
    ours = Sometimes()
    ref = copy.deepcopy(ours)
    engine = fuyou_client.attach(ours, fuyou_client.AdamW(lr=1e-2, weight_decay=0.0), socket=daemon.socket)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.0, fused=True)
    gen = torch.Generator().manual_seed(2)
    for _ in range(3):
        a, b = (torch.randint(0, 512, (2, 8), generator=gen) for _ in range(2))
        (ours(a).square().mean() + ours(b).abs().mean()).backward()
        engine.step()
        engine.zero_grad()
        (ref(a).square().mean() + ref(b).abs().mean()).backward()
        opt.step()
        opt.zero_grad()
    engine.close()
    ref_state = ref.state_dict()
    for name, value in ours.state_dict().items():
        if "unused" not in name:
            assert torch.equal(value, ref_state[name]), name
    other = Sometimes()
    engine = fuyou_client.attach(other, socket=daemon.socket)
    with pytest.raises(RuntimeError, match="accumulation_steps"):
        other(a).sum().backward()
        other(b).sum().backward()  # a second backward before step(): its steps may be reading the grads
    engine.step()
    engine.close()


class Chain(nn.Module):
    """Blocks fed straight from the input: the first saves no weight for backward (its
    input needs no gradient), so nothing fetches it there; its gradients must still land."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(4))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def test_a_block_whose_input_needs_no_gradient(daemon):
    torch.manual_seed(0)
    ours = Chain()
    ref = copy.deepcopy(ours)
    engine = fuyou_client.attach(ours, fuyou_client.AdamW(**HYPER), socket=daemon.socket)
    opt = torch.optim.AdamW(ref.parameters(), **HYPER, fused=True)
    gen = torch.Generator().manual_seed(3)
    for _ in range(3):
        x = torch.randn(4, 32, generator=gen)
        ours(x).square().mean().backward()
        engine.step()
        engine.zero_grad()
        ref(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    engine.close()
    assert_same(ours, ref)


def test_options_are_checked_once_before_anything_starts(short_tmp):
    """Every option of attach is a field of AttachOptions, validated before a daemon is
    even looked for: a misspelt or invalid one is refused by name."""
    nowhere = str(short_tmp / "no.sock")
    with pytest.raises(TypeError, match="unexpected keyword argument 'ofload'"):
        fuyou_client.attach(MLP(), socket=nowhere, ofload=True)
    for bad, match in [({"accumulation_steps": 0}, "accumulation_steps must be an integer >= 1"),
                       ({"prefetch": -1}, "prefetch must be an integer >= 0"),
                       ({"max_grad_norm": float("nan")}, "max_grad_norm must be a number > 0"),
                       ({"offload": "ssd"}, "offload must be True, False or 'host'"),
                       ({"offload": 1.0}, "offload must be True, False or 'host'"),
                       ({"grad_accumulation": "gpu"}, "grad_accumulation must be 'device' or 'host'"),
                       ({"activations": "swapp"}, "activations='swapp': expected one of"),
                       ({"activations": {"block0000": "drop"}}, "activations treatments must be one of"),
                       ({"host_budget": 0}, "host_budget must be an integer >= 1")]:
        with pytest.raises(ValueError, match=match):
            fuyou_client.attach(MLP(), socket=nowhere, **bad)
    opts = fuyou_client.AttachOptions(offload="host", grad_accumulation="host", prefetch=1)
    assert opts.for_device(shares_host_memory=True) == fuyou_client.AttachOptions(prefetch=1, offload=False)
    assert opts.for_device(shares_host_memory=False) == opts


def test_options_can_be_given_as_one_object(daemon):
    opts = fuyou_client.AttachOptions(socket=daemon.socket, offload="host", max_grad_norm=1.0)
    model = MLP()
    with fuyou_client.attach(model, fuyou_client.AdamW(), options=opts, accumulation_steps=2) as engine:
        assert engine.options.offload is False  # "host" is resident weights on the CPU
        assert (engine.max_grad_norm, engine.accumulation_steps) == (1.0, 2)


@pytest.mark.slow  # (a daemon of its own: about 6 s)
def test_a_group_the_daemon_refuses_mid_attach_stops_it_and_leaves_the_model(short_tmp):
    """attach has the daemon create a group's state while it makes the next group's values
    (groups/creation.py Scratch): a group refused halfway (a namespace quota that holds the first
    blocks' state only) stops attach at the refusal, with the daemon's error, the model as
    it came and nothing left held."""
    torch.manual_seed(0)
    model = tiny_llama(layers=6, width=128, vocab=256)
    before = [p.detach().clone() for p in model.parameters()]
    with fuyou_client.start_daemon(short_tmp / "state", config=merge(SMALL, {"storage": {"namespace_quota": "4MiB"}})
                                   ) as d:
        with pytest.raises(fuyou_client.ResourceExhausted, match="quota"):
            fuyou_client.attach(model, fuyou_client.AdamW(), socket=d.socket, namespace="quota")
        with fuyou_client.connect(d.socket) as s:
            status = s.status()
            assert status.pinned_used_bytes == 0
            creates = scrape(status.metrics_url)['fuyoud_requests_total{method="CreateGroup"}']
        assert creates <= 4, creates  # (two blocks fit, the third is refused: not all seven were tried)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before))
