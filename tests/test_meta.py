"""A model that never exists whole in memory: built on the meta device and attached with
``weights=`` (a safetensors checkpoint, or "init"), its values streamed into fuyoud one
layer group at a time."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

import fuyou_client
from conftest import SMALL, merge
from discrete_device import LateCopyDevice
from test_attach import HYPER, daemon, gpt2, llama  # noqa: F401 (daemon: a fixture)

transformers = pytest.importorskip("transformers")


def gpt2_dropout():
    cfg = transformers.GPT2Config(n_layer=4, n_embd=64, n_head=4, vocab_size=512, n_positions=64,
                                  bos_token_id=0, eos_token_id=0)  # (dropout on: the generator must agree)
    return transformers.GPT2LMHeadModel(cfg)


def llama_tied():
    cfg = transformers.LlamaConfig(num_hidden_layers=4, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=512, max_position_embeddings=64,
                                   bos_token_id=0, eos_token_id=0, pad_token_id=0, tie_word_embeddings=True)
    return transformers.LlamaForCausalLM(cfg)


class Plain(nn.Module):
    """torch's layers only: an embedding tied to the head, a LayerNorm, attention."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(512, 32)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32), nn.LayerNorm(32))
                                    for _ in range(3))
        self.attn = nn.MultiheadAttention(32, 2, batch_first=True)
        self.head = nn.Linear(32, 512, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, x):
        h = self.embed(x)
        for layer in self.layers:
            h = h + layer(h)
        return self.head(h + self.attn(h, h, h, need_weights=False)[0])


def on_meta(make):
    with torch.device("meta"):
        return make()


def loss_of(model, x):
    return model(x, labels=x).loss if hasattr(model, "config") else model(x).square().mean()


def train(model, engine, steps=3):
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        x = torch.randint(0, 512, (2, 32), generator=gen)
        loss = loss_of(model, x)
        loss.backward()
        engine.step()
        engine.zero_grad()
        losses.append(loss.item())
    return losses


def exported(engine, directory) -> dict[str, torch.Tensor]:
    engine.export(directory)
    return fuyou_client.load_exported(directory)


def assert_equal_dicts(a: dict, b: dict):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k}: max diff {(a[k].float() - b[k].float()).abs().max().item()}"


def attach(model, daemon, **kwargs):
    return fuyou_client.attach(model, fuyou_client.AdamW(**HYPER), socket=daemon.socket, **kwargs)


@pytest.mark.parametrize("make, shard, offload, dtype", [
    pytest.param(gpt2, None, True, None, marks=pytest.mark.slow),
    pytest.param(gpt2, "300KB", True, None, marks=pytest.mark.slow),
    pytest.param(llama, "300KB", True, None, marks=pytest.mark.slow),  # (sharded: also the device test below)
    (llama_tied, None, False, None),
    pytest.param(llama, None, True, torch.bfloat16, marks=pytest.mark.slow)],
    ids=["gpt2", "gpt2-sharded", "llama-sharded", "llama-tied-resident", "llama-bf16-from-fp32"])
def test_a_meta_model_from_safetensors_trains_like_the_loaded_model(daemon, tmp_path, make, shard, offload, dtype):
    """save_pretrained, then the same architecture built on the meta device and attached
    with weights=DIR: bitwise the model from_pretrained loads, attached whole (losses,
    exported weights); GPT-2's lm_head, tied and left out of the checkpoint, is found
    under transformer.wte.weight; Llama's rotary buffers are recomputed; an fp32
    checkpoint fills a model cast to bf16 on the meta device as from_pretrained(...).to(bfloat16)."""
    torch.manual_seed(0)
    source = make()
    kwargs = {"max_shard_size": shard} if shard else {}
    source.save_pretrained(tmp_path / "ckpt", safe_serialization=True, **kwargs)
    assert (tmp_path / "ckpt" / ("model.safetensors.index.json" if shard else "model.safetensors")).is_file()
    ref = type(source).from_pretrained(tmp_path / "ckpt").to(dtype or torch.float32).train()
    ours = on_meta(make) if dtype is None else on_meta(lambda: make().to(dtype))
    engine_ref = attach(ref, daemon, offload=offload)
    engine = attach(ours, daemon, offload=offload, weights=tmp_path / "ckpt")
    assert not any(t.is_meta for t in list(ours.parameters()) + list(ours.buffers()))
    if offload:
        assert all(p.numel() == 0 for p in engine.groups[0].spec.module.parameters())  # (uploaded, not resident)
    if ours.config.tie_word_embeddings:
        assert ours.get_output_embeddings().weight is ours.get_input_embeddings().weight
    assert_equal_dicts(dict(ours.named_buffers()), dict(ref.named_buffers()))
    assert train(ours, engine) == train(ref, engine_ref)
    assert_equal_dicts(exported(engine, tmp_path / "ours"), exported(engine_ref, tmp_path / "ref"))
    engine.close()
    engine_ref.close()


@pytest.mark.parametrize("offload", [True, pytest.param("host", marks=pytest.mark.slow)], ids=["offloaded", "weights-on-host"])
def test_a_meta_model_on_a_device_with_its_own_memory(daemon, tmp_path, offload):
    """The compute device's path (copies late, memory its own): the meta model from a
    checkpoint trains bitwise like the loaded one."""
    torch.manual_seed(0)
    llama().save_pretrained(tmp_path / "ckpt", safe_serialization=True, max_shard_size="300KB")
    ref = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "ckpt").train()
    ours = on_meta(llama)
    engine_ref = attach(ref, daemon, offload=offload, device=LateCopyDevice(seed=1))
    engine = attach(ours, daemon, offload=offload, device=LateCopyDevice(seed=2), weights=tmp_path / "ckpt")
    assert train(ours, engine) == train(ref, engine_ref)
    assert_equal_dicts(exported(engine, tmp_path / "ours"), exported(engine_ref, tmp_path / "ref"))
    engine.close()
    engine_ref.close()


@pytest.mark.parametrize("make", [gpt2_dropout, pytest.param(llama, marks=pytest.mark.slow), llama_tied, Plain])
def test_init_gives_the_values_of_the_model_built_on_the_cpu(daemon, tmp_path, make):
    """weights="init": the masters fuyoud holds are bitwise those of the same model built
    on the CPU after the same torch.manual_seed (constructors' draws, then post_init's
    _init_weights, a head initialised before it was tied...), and the generator is left
    where that construction leaves it (dropout and data order then agree too)."""
    torch.manual_seed(7)
    ref = make()
    after_construction = torch.get_rng_state()
    engine_ref = attach(ref, daemon)
    ours = on_meta(make)
    torch.manual_seed(7)
    engine = attach(ours, daemon, weights="init")
    assert torch.equal(torch.get_rng_state(), after_construction)
    assert_equal_dicts(exported(engine, tmp_path / "ours"), exported(engine_ref, tmp_path / "ref"))
    torch.manual_seed(3)
    losses = train(ours, engine, steps=2)
    torch.manual_seed(3)
    assert losses == train(ref, engine_ref, steps=2)
    engine.close()
    engine_ref.close()


@pytest.mark.slow  # (four Llama steps, a checkpoint and a resume: about 12 s)
def test_resume_into_a_meta_model(daemon, tmp_path):
    """attach(resume=...) of a model built on the meta device takes the checkpoint's masters
    (and recomputes the rotary buffers): it goes on bitwise like the run it came from."""
    ours = on_meta(llama)
    torch.manual_seed(0)
    engine = attach(ours, daemon, weights="init")
    train(ours, engine, steps=2)
    engine.save_checkpoint(tmp_path / "ckpt")
    expected = train(ours, engine, steps=2)
    engine.close()
    again = on_meta(llama)
    engine = attach(again, daemon, resume=tmp_path / "ckpt")
    assert train(again, engine, steps=2) == expected
    engine.close()


CHILD = textwrap.dedent("""
    import json, sys, torch
    from torch import nn
    import fuyou_client
    from fuyou_client.groups.masters import read_masters

    class Net(nn.Module):
        def __init__(self, width, blocks):
            super().__init__()
            self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, width),
                                                      nn.GELU(), nn.Linear(width, width)) for _ in range(blocks))
            self.head = nn.Linear(width, 16)

    def status():
        return {l.split(":")[0]: int(l.split()[1]) * 1024 for l in open("/proc/self/status")
                if l.startswith(("VmRSS:", "VmHWM:"))}

    session = fuyou_client.connect(sys.argv[1])
    with torch.device("meta"):  # (warm-up: what any attach imports and allocates once)
        small = Net(64, 2)
    warm = "init" if sys.argv[2] == "init" else sys.argv[3]
    fuyou_client.attach(small, fuyou_client.SGD(lr=0.1), session=session, weights=warm).close(False)
    with torch.device("meta"):
        model = Net(int(sys.argv[4]), int(sys.argv[5]))
    params = sum(p.numel() for p in model.parameters())
    before = status()["VmRSS"]
    torch.manual_seed(0)
    open("/proc/self/clear_refs", "w").write("5")  # VmHWM := VmRSS: the peak of what follows
    engine = fuyou_client.attach(model, fuyou_client.SGD(lr=0.1), session=session, weights=sys.argv[2])
    peak = status()["VmHWM"]
    g = engine.groups[3]
    masters, _ = read_masters(engine.session, g.spec)
    first = masters.tensor(torch.float32)[:4].tolist()
    if sys.argv[2] == "init":  # what a build on the CPU gives block 3's first weights
        torch.manual_seed(0)
        first = [first == Net(int(sys.argv[4]), 4).blocks[3][0].weight.reshape(-1)[:4].tolist()]
    masters.free()
    print(json.dumps({"params": params, "block": g.spec.numel * 4, "growth": peak - before, "first": first}))
    engine.close(materialize=False)
""")


def write_checkpoint(root: Path, width: int, blocks: int) -> None:
    """Net's weights, one shard per block (each tensor a constant: fast to make)."""
    root.mkdir()
    weight_map = {}
    for i in range(blocks):
        tensors = {}
        for j in (0, 2, 4):
            tensors[f"blocks.{i}.{j}.weight"] = torch.full((width, width), float(i + j))
            tensors[f"blocks.{i}.{j}.bias"] = torch.full((width,), -float(i))
        save_file(tensors, root / f"block{i}.safetensors")
        weight_map.update(dict.fromkeys(tensors, f"block{i}.safetensors"))
    save_file({"head.weight": torch.ones(16, width), "head.bias": torch.zeros(16)}, root / "head.safetensors")
    weight_map.update({"head.weight": "head.safetensors", "head.bias": "head.safetensors"})
    (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


@pytest.mark.slow  # (a 100M-parameter model attached in a child process: 15 s each)
@pytest.mark.parametrize("weights", ["checkpoint", "init"])
def test_attaching_a_meta_model_holds_a_few_blocks_not_the_model(short_tmp, weights):
    """A 100M-parameter model (403 MB of fp32 weights) built on the meta device, attached
    from a sharded checkpoint or with its own init: the client's peak memory grows by
    under three blocks' worth (150 MB) while all of it goes to fuyoud (measured in a child
    process: VmHWM reset before attach)."""
    width, blocks = 2048, 8
    write_checkpoint(short_tmp / "ckpt", width, blocks)
    write_checkpoint(short_tmp / "warm", 64, 2)
    cfg = merge(SMALL, {"storage": {"capacity_per_device": "2GiB"},
                        "memory": {"pinned_budget": "1GiB", "segment_size": "64MiB"}})
    source = str(short_tmp / "ckpt") if weights == "checkpoint" else "init"
    with fuyou_client.start_daemon(short_tmp / "state", config=cfg) as d:
        out = subprocess.run([sys.executable, "-c", CHILD, d.socket, source, str(short_tmp / "warm"),
                              str(width), str(blocks)], capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["params"] > 100_000_000
    bound = 3 * r["block"]
    assert 4 * r["params"] > 2.5 * bound
    assert r["growth"] < bound, f"attach grew the client by {r['growth'] / 2**20:.0f} MiB, >= {bound / 2**20:.0f} MiB"
    assert r["first"] == ([3.0] * 4 if weights == "checkpoint" else [True])  # block 3's first weights, in fuyoud
    print(f"{weights}: peak growth while attaching {r['growth'] / 2**20:.0f} MiB for {4 * r['params'] / 2**20:.0f} "
          f"MiB of weights (a block: {r['block'] / 2**20:.0f} MiB)")


def rewrite(directory: Path, change) -> None:
    """Rewrite a single-file checkpoint with ``change(tensors)`` applied."""
    path = directory / "model.safetensors"
    with safe_open(path, framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
        metadata = f.metadata()
    change(tensors)
    save_file(tensors, path, metadata=metadata)


def assert_back_on_meta(model):
    assert all(p.is_meta for p in model.parameters())
    assert all(b.is_meta for b in model.buffers())


def test_what_cannot_fill_a_meta_model_is_refused_by_name(daemon, tmp_path):
    model = on_meta(llama)
    with pytest.raises(ValueError, match=r"meta device .*weights=DIR.*weights=\"init\""):
        fuyou_client.attach(model, socket=daemon.socket)
    assert_back_on_meta(model)
    with pytest.raises(ValueError, match="already hold values"):
        fuyou_client.attach(llama(), socket=daemon.socket, weights="init")
    with pytest.raises(FileNotFoundError, match="neither model.safetensors.index.json nor model.safetensors"):
        fuyou_client.attach(model, socket=daemon.socket, weights=tmp_path)

    llama().save_pretrained(tmp_path / "missing", safe_serialization=True)
    rewrite(tmp_path / "missing", lambda t: t.pop("model.layers.2.mlp.up_proj.weight"))
    with pytest.raises(ValueError, match="'model.layers.2.mlp.up_proj.weight' of the model is not in the checkpoint"):
        fuyou_client.attach(model, socket=daemon.socket, weights=tmp_path / "missing")
    assert_back_on_meta(model)

    llama().save_pretrained(tmp_path / "shape", safe_serialization=True)
    rewrite(tmp_path / "shape", lambda t: t.update({"model.norm.weight": torch.ones(7)}))
    with pytest.raises(ValueError, match=r"'model.norm.weight' has shape \[7\] .* but \[128\] in the model"):
        fuyou_client.attach(model, socket=daemon.socket, weights=tmp_path / "shape")
    assert_back_on_meta(model)

    # and after all that the model attaches (nothing was left half-materialised)
    llama().save_pretrained(tmp_path / "good", safe_serialization=True)
    engine = fuyou_client.attach(model, socket=daemon.socket, weights=tmp_path / "good")
    engine.close()


class Raw(nn.Module):
    """A parameter that no init writes (made by torch.randn in __init__), a buffer that no
    init computes."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.scale = nn.Parameter(torch.randn(8))
        self.register_buffer("steps", torch.arange(8.0), persistent=False)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x * self.scale + self.steps


def test_an_init_that_leaves_values_unwritten_is_refused_by_name(daemon, tmp_path):
    model = on_meta(Raw)
    with pytest.raises(RuntimeError, match="parameter scale is not .*written by the model's init"):
        fuyou_client.attach(model, socket=daemon.socket, weights="init")
    assert_back_on_meta(model)
    torch.manual_seed(0)
    save_file({k: v for k, v in Raw().state_dict().items()}, tmp_path / "raw.safetensors")
    with pytest.raises(RuntimeError, match="buffer steps is on the meta device, the checkpoint does not have it"):
        fuyou_client.attach(model, socket=daemon.socket, weights=tmp_path / "raw.safetensors")
    assert_back_on_meta(model)
    with torch.device("meta"):  # buffers built on the CPU (accelerate's include_buffers=False) are kept as they are
        model = Raw()
    model.steps = torch.arange(8.0)
    engine = fuyou_client.attach(model, socket=daemon.socket, weights=tmp_path / "raw.safetensors", offload=False)
    torch.manual_seed(0)
    ref = Raw()
    x = torch.randn(3, 8)
    assert torch.equal(model(x), ref(x))
    engine.close()


def test_the_unwritten_value_check_is_exact_where_the_sum_is_not_finite():
    """The init's NaN sentinel is found by one summation, and exactly (element by element)
    where the sum alone cannot tell: infinities, or finite values whose sum overflows."""
    from fuyou_client.model.materialize import _has_nan
    big = torch.full((3 << 21,), 3e38)  # (finite; the sum overflows to infinity)
    assert not _has_nan(big) and not _has_nan(torch.zeros(0))
    assert not _has_nan(torch.tensor([float("inf"), float("-inf"), 1.0]))  # (the sum is NaN, no element is)
    for t in (big.clone(), torch.randn(5 << 20), torch.randn(64, 64).to(torch.bfloat16)):
        t.view(-1)[-1] = float("nan")
        assert _has_nan(t)
    mixed = big.clone()
    mixed[7] = float("nan")
    assert _has_nan(mixed)


def test_attach_reuses_the_memory_of_tensors_gone_and_never_of_one_alive():
    """The init's tensors of 1 MiB and more come from maps reused once nothing holds them
    (a fresh map faults every page in again): a map is handed out again only after its
    tensor and every view of it are gone, and the values written into a live one stay."""
    from fuyou_client.model.weights_file import ReusedMaps
    maps = ReusedMaps()
    a = maps.empty((512, 1024), torch.float32).fill_(1.0)
    where = a.data_ptr()
    view = a[3:]
    del a
    b = maps.empty((256, 1024), torch.float32).fill_(2.0)  # (a's map is held by its view)
    assert b.data_ptr() != where and torch.all(view == 1.0)
    del view
    c = maps.empty((256, 1024), torch.float32)  # (the smallest free map that fits: a's, now free)
    assert c.data_ptr() == where and torch.all(b == 2.0)
    assert maps.empty((4, 4), torch.float32).numel() == 16  # (small tensors: torch's own allocator)
    maps.close()
    assert c.fill_(3.0).sum().item() == 3.0 * c.numel()  # (a map in use outlives the pool)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_meta_init_trains_block_major_as_the_model_built_on_the_cpu(daemon, tmp_path):
    """How a model larger than the host is trained on a GPU: built on the meta device,
    attached to CUDA with weights="init" and its blocks' weights on SSD, trained with
    train_step. It gives the masters of the same model built on the CPU and moved to the
    GPU, and trains as that one does (within fp32 rounding: the same kernels, attention by
    SDPA's math backend)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.manual_seed(7)
    ref = llama().cuda()
    engine_ref = attach(ref, daemon, device="cuda")
    torch.manual_seed(7)
    ours = on_meta(llama)
    engine = attach(ours, daemon, weights="init", device="cuda")
    assert engine.device.torch_device.type == "cuda"
    assert all(p.device.type in ("cuda", "meta") or p.numel() == 0 for p in ours.parameters())
    gen = torch.Generator().manual_seed(1)
    with sdpa_kernel(SDPBackend.MATH):
        for _ in range(2):
            micro = [torch.randint(0, 512, (2, 32), generator=gen).cuda() for _ in range(3)]
            got = engine.train_step(micro, lambda x: ours(x, labels=x).loss / 3)
            want = engine_ref.train_step(micro, lambda x: ref(x, labels=x).loss / 3)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    mine, theirs = exported(engine, tmp_path / "ours"), exported(engine_ref, tmp_path / "ref")
    engine.close()
    engine_ref.close()
    assert mine.keys() == theirs.keys()
    for name in mine:
        torch.testing.assert_close(mine[name], theirs[name], rtol=1e-5, atol=1e-6, msg=name)
