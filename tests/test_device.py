"""The compute-device path: a device with its own memory, copies on side streams.

Everything the CUDA path does (device copies of parameters, gradients downloaded before
a step is submitted, new weights uploaded after it, weight slots and activations moving
both ways, every shared segment registered) runs here on a stand-in whose copies run
late on worker threads (tests/discrete_device.py), so a missing wait or an early reuse
shows up as a bitwise difference from torch. The same tests run on a real GPU where
CUDA is available (skipped otherwise): fp32 within 1e-5 relative of torch's AdamW on
the GPU (the daemon steps on the CPU: the kernels differ in rounding), bf16 within
bf16's resolution.
"""
from __future__ import annotations

import threading

import pytest
import torch

import fuyou_client
from discrete_device import LateCopyDevice
from test_activations import gpt2 as small_gpt2
from test_activations import llama as small_llama
from test_activations import train
from test_attach import (MLP, assert_same, attached_pair, daemon, gpt2, llama,  # noqa: F401 (daemon: a fixture)
                         train_pair, train_with_torch_zero_grad)

transformers = pytest.importorskip("transformers")
CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
MiB = 1 << 20


CASES = {
    "gpt2": dict(make_model=gpt2),
    "llama": dict(make_model=llama),
    "gpt2-resident": dict(make_model=gpt2, offload=False),
    "bf16": dict(make_model=gpt2, dtype=torch.bfloat16, steps=3),
    "mlp": dict(make_model=MLP),
    "accumulate-clip-keep": dict(make_model=gpt2, steps=3, accumulation=2, clip=0.05, keep=3),
    "host-accumulate": dict(make_model=gpt2, steps=2, accumulation=3, grad_accumulation="host"),
    "host-resident-clip": dict(make_model=llama, offload=False, steps=3, accumulation=2, clip=0.05,
                               grad_accumulation="host"),
    "weights-on-host": dict(make_model=gpt2, offload="host"),
    "weights-on-host-bf16-accumulate": dict(make_model=llama, offload="host", dtype=torch.bfloat16, accumulation=2,
                                            steps=2),
}


SLOW_CASES = ("bf16", "weights-on-host-bf16-accumulate")  # (bf16 matmuls are slow on the CPU: `-m slow`)


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c in SLOW_CASES else c for c in CASES])
def test_late_copies_train_bitwise_like_torch(daemon, case):
    """Bitwise equal to in-process torch AdamW, whatever the copies' timing."""
    kwargs = dict(CASES[case])
    steps = kwargs.pop("steps", 3)
    device = LateCopyDevice(seed=len(case))
    engine, ours, ref, _ = train_pair(device=device, daemon=daemon, steps=steps, **kwargs)
    assert device.uploads and device.downloads
    engine.close()
    assert device.registered == {}  # unregistered before unmapping
    assert_same(ours, ref)


def test_device_memory_is_its_own_and_every_segment_is_registered(daemon):
    device = LateCopyDevice()
    engine, ours, _, _ = train_pair(gpt2, daemon, steps=2, device=device)
    segments = engine.session._segments.values()
    assert segments and all(seg.device is device for seg in segments)
    assert set(device.registered) == {seg.address for seg in segments}
    for p in ours.parameters():  # nothing the model computes with is shared memory
        assert not device.is_registered(p) or p.numel() == 0
        assert p.grad is None or not device.is_registered(p.grad)
    engine.close()
    assert device.registered == {} and device.ever_registered >= len(segments)


def test_host_accumulation_keeps_no_gradients_on_the_device(daemon):
    """grad_accumulation="host": between backward passes no gradient stays on the device,
    whether weights are resident or offloaded."""
    for offload in (False, True):
        device = LateCopyDevice()
        model = gpt2()
        engine = fuyou_client.attach(model, socket=daemon.socket, device=device, accumulation_steps=2,
                                     offload=offload, grad_accumulation="host")
        assert all(g.device_grads is None and g.strategy.name == "host" for g in engine.groups)
        x = torch.randint(0, 512, (2, 32))
        for _ in range(2):
            before = device.downloads
            model(x, labels=x).loss.backward()
            assert all(p.grad is None for p in model.parameters())
            assert device.downloads - before >= len(engine.groups)
        engine.step()
        engine.close()


def test_weights_on_the_host_are_uploaded_per_use_and_never_read_from_ssd(daemon):
    device = LateCopyDevice()
    engine, _, _, _ = train_pair(gpt2, daemon, steps=2, device=device, offload="host")
    blocks = [g for g in engine.groups if g.offloaded is not None]
    assert blocks and all(g.offloaded.host is not None and g.device_weights is None for g in blocks)
    # each block, forward and backward, each step (or used again from its slot, still there)
    assert device.uploads + engine.offloader.reuses >= 2 * 2 * len(blocks)
    assert engine.offloader.fetched_bytes == 0 and engine.offloader.served_bytes == 0
    assert engine.session.objects("weights/") == []
    engine.close()
    cpu = fuyou_client.attach(gpt2(), socket=daemon.socket, offload="host")  # the CPU: simply resident
    assert all(g.offloaded is None for g in cpu.groups)
    cpu.close()


def test_host_accumulation_bounds_the_gradients_waiting_to_leave(daemon):
    """Backward can outrun the download stream; each group's gradients waiting for it hold
    their device memory, so no more than two groups' may wait (the H100 ran out of memory
    before this bound: every group of a backward queued at once). Counted per group: its
    parameters' downloads, pending while its last one is."""
    device = LateCopyDevice(max_delay=0.01)  # copies much slower than this backward
    waiting = []
    from fuyou_client.gradients.host import HostAccumulation
    add = HostAccumulation.add

    def counted(self, group, first):
        add(self, group, first)
        waiting.append(self._last[group.spec.name])
        device.peak_waiting = max(getattr(device, "peak_waiting", 0), sum(not e.query() for e in waiting))

    HostAccumulation.add = counted
    model = gpt2()
    engine = fuyou_client.attach(model, socket=daemon.socket, device=device, accumulation_steps=2,
                                 offload=False, grad_accumulation="host")
    x = torch.randint(0, 512, (2, 32))
    try:
        for _ in range(2):
            model(x, labels=x).loss.backward()
        engine.step()
    finally:
        HostAccumulation.add = add
    engine.close()
    assert len(waiting) >= 2 * len(engine.groups)
    assert device.peak_waiting <= 3  # two waiting and the one just queued


def test_a_failed_host_addition_fails_its_groups_step(daemon):
    """An addition into a host accumulator that fails: no step of that iteration goes with
    a partial sum (engine.step() raises), and the next iteration steps normally."""
    device = LateCopyDevice()
    then, calls = device.then, []

    def first_fails(event, fn):
        calls.append(fn)
        if len(calls) == 1:  # the first call on the helper: the first group's addition

            def fail():
                raise RuntimeError("injected addition failure")

            return then(event, fail)
        return then(event, fn)

    device.then = first_fails
    model = gpt2()
    engine = fuyou_client.attach(model, socket=daemon.socket, device=device, accumulation_steps=2, offload=False,
                                 grad_accumulation="host")
    x = torch.randint(0, 512, (2, 32))
    for _ in range(2):
        model(x, labels=x).loss.backward()
    with pytest.raises(RuntimeError, match="injected addition failure"):
        engine.step()
    # The failed one was the first group of the last backward: no step went.
    assert [engine.session.group(g.spec.name).step for g in engine.groups] == [0] * len(engine.groups)
    engine.zero_grad()
    for _ in range(2):
        model(x, labels=x).loss.backward()
    engine.step()
    assert [engine.session.group(g.spec.name).step for g in engine.groups] == [1] * len(engine.groups)
    engine.close()


def test_the_cuda_helper_thread_outlives_a_failing_call():
    from fuyou_client.device.devices import _Thread
    helper, done = _Thread("test-helper"), threading.Event()

    def fail():
        raise RuntimeError("a call that fails")

    helper.submit(fail)
    helper.submit(done.set)
    assert done.wait(10)  # (a thread that died would never get here)
    helper.drain()
    helper.close()


def test_torch_zero_grad_with_gradients_on_the_device(daemon):
    """model.zero_grad() (torch's) with gradients accumulating in the device's buffers."""
    _, ours, ref = train_with_torch_zero_grad(daemon, offload=False, device=LateCopyDevice(seed=5))
    assert_same(ours, ref)


@pytest.mark.parametrize("where", ["stand-in", pytest.param("cuda", marks=needs_cuda)])
def test_gradients_discarded_mid_accumulation_are_gone(daemon, where):
    """zero_grad() between two micro-batches throws their gradients away, also while the
    host's additions of them are still queued (they must not land in the next sum)."""
    at = "cuda" if where == "cuda" else "cpu"
    device = "cuda" if where == "cuda" else LateCopyDevice(seed=3, helper_delay=0.05)  # additions that run late
    ours, engine, ref, opt = attached_pair(lambda: gpt2().to(at), daemon, device=device, accumulation_steps=3,
                                           offload=False, grad_accumulation="host")
    gen = torch.Generator().manual_seed(1)
    for x in [torch.randint(0, 512, (2, 32), generator=gen).to(at) for _ in range(2)]:
        ours(x, labels=x).loss.backward()  # a bad batch, say: discarded
    engine.zero_grad()
    for x in [torch.randint(0, 512, (2, 32), generator=gen).to(at) for _ in range(3)]:
        ours(x, labels=x).loss.backward()
        ref(x, labels=x).loss.backward()
    engine.step()
    opt.step()
    engine.close()
    if where == "cuda":  # (the daemon steps on the CPU, the reference on the GPU: kernels round apart)
        assert_close(ours, ref, rtol=1e-5, atol=1e-6)
    else:
        assert_same(ours, ref)


@needs_cuda
def test_cuda_close_between_micro_batches_lets_host_additions_land_first(daemon):
    """close() in the middle of an accumulation: the host's additions still queued write
    into shared memory, which goes with the session, so close waits for them."""
    model = gpt2().cuda()
    engine = fuyou_client.attach(model, socket=daemon.socket, accumulation_steps=3, offload=False,
                                 grad_accumulation="host")
    for _ in range(2):
        x = torch.randint(0, 512, (2, 32), device="cuda")
        model(x, labels=x).loss.backward()
    additions = [fut for fut, _ in engine.host_grads._busy]
    engine.close()
    assert additions and all(fut.done() for fut in additions)  # landed before the memory went
    assert not engine.device._registered
    assert all(p.is_cuda and p.numel() for p in model.parameters())


@pytest.mark.slow  # (five treatments of activations, each a training run: about 13 s per model)
@pytest.mark.parametrize("make_model", [small_gpt2, small_llama], ids=["gpt2", "llama"])
def test_activations_cross_on_side_streams_bitwise_alike(small_daemon, make_model):
    """Kept, swapped to the host arena, spilled to SSD, recomputed, planned: the same
    bits, with every activation leaving and returning through late copies."""
    runs = {}
    for name, kwargs in {"keep": {}, "host": dict(activations="swap", host_budget=64 * MiB),
                         "ssd": dict(activations="swap", host_budget=256 << 10),
                         "recompute": dict(activations="recompute"),
                         "auto": dict(activations="auto", host_budget=4 * MiB, device_budget=6 * MiB)}.items():
        device = LateCopyDevice(seed=len(name))
        model, engine, losses = train(make_model, small_daemon, steps=3, device=device, **kwargs)
        runs[name] = (losses, engine.activations.stats, engine.session.objects("act/"))
        if name in ("host", "ssd"):
            assert device.downloads > 0 and engine.activations.stats.copied > 0
        engine.close()
        runs[name] += ({k: v.clone() for k, v in model.state_dict().items()},)
    base_losses, keep_stats, _, base = runs["keep"]
    for name, (losses, stats, leftovers, state) in runs.items():
        assert losses == base_losses, name
        for key, value in state.items():
            assert torch.equal(value, base[key]), (name, key)
        assert leftovers == [], name
    assert runs["ssd"][1].spilled > 0
    assert runs["host"][1].device_peak < keep_stats.device_peak / 20


# -- a real GPU ---------------------------------------------------------------------------

def assert_close(ours, ref, rtol, atol):
    for (name, a), b in zip(ours.state_dict().items(), ref.state_dict().values()):
        torch.testing.assert_close(a.float(), b.float(), rtol=rtol, atol=atol, msg=name)


@needs_cuda
@pytest.mark.parametrize("case", ["gpt2", "llama", "gpt2-resident", "mlp", "accumulate-clip-keep", "host-accumulate",
                                  "host-resident-clip", "weights-on-host"])
def test_cuda_fp32_matches_torch_adamw(daemon, case):
    """fp32 compute on the GPU, AdamW in the daemon on the CPU: within 1e-5 relative of
    torch's fused AdamW on the GPU (same arithmetic, different kernels)."""
    kwargs = dict(CASES[case])
    steps = kwargs.pop("steps", 10)
    engine, ours, ref, losses = train_pair(device="cuda", daemon=daemon, steps=steps, **kwargs)
    assert engine.device.torch_device.type == "cuda"
    assert all(seg.device is engine.device for seg in engine.session._segments.values())
    engine.close()
    assert_close(ours, ref, rtol=1e-5, atol=1e-6)


@needs_cuda
@pytest.mark.parametrize("grad_accumulation", ["device", "host"])
def test_cuda_bf16_with_fp32_masters(daemon, grad_accumulation):
    """bf16 compute on the GPU, fp32 masters stepped by the daemon (torch's fused AdamW on
    the CPU). The reference steps its fp32 masters with the same kernel on the CPU, so
    the gradients and weights are the GPU's own and the two runs are bitwise alike. (Against
    AdamW on the GPU they are not: one master rounding differently to bf16 changes later
    gradients, and Adam turns a tiny gradient's sign into a whole lr step.)"""
    accumulation = 2 if grad_accumulation == "host" else 1
    engine, ours, ref, _ = train_pair(gpt2, daemon, steps=4, dtype=torch.bfloat16, device="cuda",
                                      accumulation=accumulation, grad_accumulation=grad_accumulation,
                                      master_device="cpu")
    engine.close()
    assert_same(ours, ref)


@needs_cuda
def test_cuda_activation_peak_falls_with_swapping(small_daemon):
    peaks = {}
    for name, kwargs in {"keep": {}, "swap": dict(activations="swap", host_budget=64 * MiB)}.items():
        torch.manual_seed(0)
        model = small_gpt2().cuda()
        engine = fuyou_client.attach(model, socket=small_daemon.socket, **kwargs)
        x = torch.randint(0, 256, (8, 64), device="cuda")
        model(x, labels=x).loss.backward()  # warm-up: allocations, fetches
        engine.step()
        engine.zero_grad()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        model(x, labels=x).loss.backward()
        engine.step()
        torch.cuda.synchronize()
        peaks[name] = torch.cuda.max_memory_allocated() - base
        engine.close()
    assert peaks["swap"] < 0.7 * peaks["keep"], peaks


@pytest.mark.skipif(CUDA, reason="checks the error where CUDA is absent")
def test_cuda_without_cuda_is_refused_before_any_work(daemon):
    model = MLP()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        fuyou_client.attach(model, socket=daemon.socket, device="cuda")
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_unsupported_devices_are_refused_by_name(daemon):
    with pytest.raises(ValueError, match="not meta"):
        fuyou_client.attach(MLP(), socket=daemon.socket, device="meta")
    with pytest.raises(ValueError, match="True, False or 'host', not 'ssd'"):
        fuyou_client.attach(MLP(), socket=daemon.socket, offload="ssd")
    with pytest.raises(ValueError, match="'device' or 'host', not 'gpu'"):
        fuyou_client.attach(MLP(), socket=daemon.socket, grad_accumulation="gpu")
    model = MLP()
    model.out.to("meta")
    with pytest.raises(ValueError, match="several devices"):
        fuyou_client.attach(model, socket=daemon.socket)
