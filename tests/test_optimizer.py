"""The daemon's out-of-core optimizer against torch.optim, over real sockets and files."""
from __future__ import annotations

import pytest
import torch

import fuyou_client
from conftest import SMALL, merge, private_daemon, scrape
from fuyou_proto import pb
from fuyou_client import SGD, AdamW

@pytest.fixture(scope="module")
def daemon():
    """One fuyoud for this module's session tests (conftest's session takes it; every session
    has a namespace of its own, so the tests do not meet): a daemon each cost 3-4 s a test."""
    with private_daemon(SMALL, prefix="fy-opt-") as d:
        yield d


SIZES = [1000, 4097, 123457]  # odd sizes: tails that are not multiples of a page or a vector


def make_groups(session, sizes, spec, seed=0):
    torch.manual_seed(seed)
    init = [torch.randn(n) for n in sizes]
    weights, grads = [], []
    for i, (n, w0) in enumerate(zip(sizes, init)):
        w = session.allocate(n * 4)
        w.tensor(torch.float32).copy_(w0)
        session.create_group(f"g{i}", w, spec)
        weights.append(w)
        grads.append(session.allocate(n * 4))
    return init, weights, grads


def run_steps(session, weights, grads, ref_params, ref_opt, steps, lrs, seed=1, clip=None):
    gen = torch.Generator().manual_seed(seed)
    infos = []
    for step in range(steps):
        gs = [torch.randn(p.numel(), generator=gen) for p in ref_params]
        for p, g in zip(ref_params, gs):
            p.grad = g.clone()
        scale = None
        if clip is not None:
            total = torch.nn.utils.clip_grad_norm_(ref_params, clip)
            scale = float(torch.clamp(clip / (total + 1e-6), max=1.0))
        for group in ref_opt.param_groups:
            group["lr"] = lrs[step]
        ref_opt.step()
        for buf, g in zip(grads, gs):
            buf.tensor(torch.float32).copy_(g)
        # Submitted as backward would: last group first, all in flight at once.
        futs = [session.step_group_async(f"g{i}", grads[i], lrs[step], out=weights[i], grad_scale=scale)
                for i in reversed(range(len(weights)))]
        infos.extend(f.result(60) for f in futs)
    return infos


LRS = [1e-2 * (0.8 ** i) for i in range(10)]  # a non-default schedule, changed every step


@pytest.mark.parametrize("fused", [True, False])
def test_adamw_matches_torch(session, fused):
    spec = AdamW(betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1)
    url = session.admin_stub.Status(pb.StatusRequest()).metrics_url
    steps_before = scrape(url).get("fuyoud_optimizer_group_steps_total", 0.0)  # (the module's daemon: other tests')
    init, weights, grads = make_groups(session, SIZES, spec)
    ref = [torch.nn.Parameter(w.clone()) for w in init]
    opt = torch.optim.AdamW(ref, lr=LRS[0], betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1, fused=fused)
    run_steps(session, weights, grads, ref, opt, 10, LRS)
    for w, p in zip(weights, ref):
        got = w.tensor(torch.float32)
        if fused:  # the same kernel: bitwise
            assert torch.equal(got, p.data)
        else:  # torch's default single-tensor path rounds differently in the last bit
            assert (got - p.data).abs().max().item() <= 1e-6
    assert [session.group(f"g{i}").step for i in range(3)] == [10, 10, 10]
    m = scrape(url)
    assert m["fuyoud_optimizer_group_steps_total"] - steps_before == 30
    # Optimizer memory is bounded by its buffers, whatever the model size.
    assert 0 < m['fuyoud_pinned_bytes{state="optimizer"}'] <= 3 * (2 << 20)


def test_the_next_group_is_read_ahead(short_tmp):
    """Groups stepped one after the other, in backward order: from the second iteration
    on, each step finds its state already read (the daemon learned the order)."""
    cfg = merge(SMALL, {"optimizer": {"state_cache": False}})
    with fuyou_client.start_daemon(short_tmp / "state", config=cfg) as d, fuyou_client.connect(d.socket) as session:
        init, weights, grads = make_groups(session, SIZES, AdamW())
        infos = []
        for _ in range(3):
            for i in reversed(range(3)):
                infos.append(session.step_group(f"g{i}", grads[i], 1e-3, out=weights[i]))
        assert [i.prefetched for i in infos[3:]] == [False, True, True] * 2  # the first of each iteration is not
        m = scrape(session.admin_stub.Status(pb.StatusRequest()).metrics_url)
        assert m["fuyoud_optimizer_cache_bytes_total"] == 0


def state_reads(m: dict) -> float:
    return sum(v for k, v in m.items() if k.startswith("fuyoud_io_bytes_total") and 'direction="read"' in k)


@pytest.mark.parametrize("buffers, cached", [(4, 1), pytest.param(6, 3, marks=pytest.mark.slow)])
def test_the_state_cache_serves_steps_from_memory(short_tmp, buffers, cached):
    """Buffers beyond three free ones keep the state of the groups stepped in them: from
    the second iteration on those groups' steps read nothing (counted), the others still
    read theirs; every byte of state a step uses comes from the SSD or from the cache
    once; and the steps stay bitwise torch's, also with all groups in flight at once."""
    sizes = [65536 * (k + 1) for k in range(5)]  # 3 x 4 KiB-aligned slots: no padding
    cfg = merge(SMALL, {"optimizer": {"buffers": buffers, "buffer_budget": f"{buffers * 8}MiB"}})
    with fuyou_client.start_daemon(short_tmp / "state", config=cfg) as d, fuyou_client.connect(d.socket) as session:
        spec = AdamW(betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1)
        init, weights, grads = make_groups(session, sizes, spec)
        url = session.admin_stub.Status(pb.StatusRequest()).metrics_url
        before = state_reads(scrape(url))
        ref = [torch.nn.Parameter(w.clone()) for w in init]
        opt = torch.optim.AdamW(ref, lr=LRS[0], betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1, fused=True)
        gen = torch.Generator().manual_seed(1)
        infos = []
        for it in range(4):  # one group at a time, in backward order
            for p, buf in zip(ref, grads):
                p.grad = torch.randn(p.numel(), generator=gen)
                buf.tensor(torch.float32).copy_(p.grad)
            for group in opt.param_groups:
                group["lr"] = LRS[it]
            opt.step()
            infos.append([session.step_group(f"g{i}", grads[i], LRS[it], out=weights[i])
                          for i in reversed(range(len(sizes)))])
        for w, p in zip(weights, ref):
            assert torch.equal(w.tensor(torch.float32), p.data)
        state = [12 * n + 4096 for n in reversed(sizes)]  # each group's state object, in step order
        served = [info.cached_bytes for info in infos[-1]]
        assert sum(1 for b in served if b) == cached
        assert all(b in (0, s) for b, s in zip(served, state))
        m = scrape(url)
        total_cached = m["fuyoud_optimizer_cache_bytes_total"]
        assert total_cached == sum(i.cached_bytes for step in infos for i in step) > 0
        assert state_reads(m) - before + total_cached == 4 * sum(state)
        assert m["fuyoud_optimizer_cached_state_bytes"] > 0
        # All groups in flight at once (steps wait for buffers and take the cache's back):
        run_steps(session, weights, grads, ref, opt, 3, LRS[4:])
        for w, p in zip(weights, ref):
            assert torch.equal(w.tensor(torch.float32), p.data)


@pytest.mark.parametrize("momentum, dampening, nesterov", [(0.0, 0.0, False), (0.9, 0.0, False),
                                                            (0.9, 0.3, False), (0.9, 0.0, True)])
def test_sgd_matches_torch(session, momentum, dampening, nesterov):
    spec = SGD(momentum=momentum, dampening=dampening, weight_decay=0.01, nesterov=nesterov)
    init, weights, grads = make_groups(session, SIZES[:2], spec)
    ref = [torch.nn.Parameter(w.clone()) for w in init]
    fused = [torch.nn.Parameter(w.clone()) for w in init]
    opt = torch.optim.SGD(ref, lr=0.1, momentum=momentum, dampening=dampening, weight_decay=0.01, nesterov=nesterov)
    opt_fused = torch.optim.SGD(fused, lr=0.1, momentum=momentum, dampening=dampening, weight_decay=0.01,
                                nesterov=nesterov, fused=True)
    lrs = [0.1, 0.05, 0.05, 0.02, 0.01]
    run_steps(session, weights, grads, ref, opt, 5, lrs)
    run_steps(session, [session.allocate(w.size) for w in weights], grads, fused, opt_fused, 0, lrs)
    gen = torch.Generator().manual_seed(1)  # replay the same gradients into the fused reference
    for step in range(5):
        for p in fused:
            p.grad = torch.randn(p.numel(), generator=gen)
        for group in opt_fused.param_groups:
            group["lr"] = lrs[step]
        opt_fused.step()
    for w, p, pf in zip(weights, ref, fused):
        assert torch.equal(w.tensor(torch.float32), pf.data)  # the same kernel: bitwise
        assert (w.tensor(torch.float32) - p.data).abs().max().item() <= 1e-6


def test_global_norm_clipping_is_exact(session):
    init, weights, grads = make_groups(session, SIZES, AdamW())
    ref = [torch.nn.Parameter(w.clone()) for w in init]
    opt = torch.optim.AdamW(ref, lr=1e-3, fused=True)
    run_steps(session, weights, grads, ref, opt, 4, [1e-3] * 4, clip=0.5)
    for w, p in zip(weights, ref):
        assert torch.equal(w.tensor(torch.float32), p.data)


def test_bf16_gradients_and_weights_with_fp32_master(session):
    """bf16 compute: gradients arrive in bf16, new weights leave in bf16, the master
    weights and moments stay fp32 in the daemon: identical to AdamW on fp32 masters fed
    the same bf16 gradients, then rounded to bf16."""
    n = 50_001
    torch.manual_seed(3)
    master = torch.randn(n)
    w = session.allocate(n * 4)
    w.tensor(torch.float32).copy_(master)
    session.create_group("bf", w, AdamW(weight_decay=0.05))
    g, out = session.allocate(n * 2), session.allocate(n * 2)
    ref = torch.nn.Parameter(master.clone())
    opt = torch.optim.AdamW([ref], lr=1e-3, weight_decay=0.05, fused=True)
    for _ in range(5):
        grad = torch.randn(n).bfloat16()
        g.tensor(torch.bfloat16).copy_(grad)
        ref.grad = grad.float()
        opt.step()
        session.step_group("bf", g, 1e-3, grad_dtype=torch.bfloat16, out=out, out_dtype=torch.bfloat16)
    assert torch.equal(out.tensor(torch.bfloat16), ref.data.bfloat16())


@pytest.mark.slow  # (two daemons: about 8 s; state across a restart also in test_checkpoint.py's snapshot resume)
def test_state_survives_a_daemon_restart(short_tmp):
    cfg = merge(SMALL, {"storage": {"data_dirs": [str(short_tmp / "a"), str(short_tmp / "b")]}})
    spec = AdamW(betas=(0.85, 0.99), weight_decay=0.02)
    with fuyou_client.start_daemon(short_tmp / "state", config=cfg) as d, \
            fuyou_client.connect(d.socket, namespace="run") as s:
        init, weights, grads = make_groups(s, SIZES, spec)
        ref = [torch.nn.Parameter(w.clone()) for w in init]
        opt = torch.optim.AdamW(ref, lr=1e-2, betas=(0.85, 0.99), weight_decay=0.02, fused=True)
        run_steps(s, weights, grads, ref, opt, 3, LRS[:3], seed=7)
    gen_state = torch.Generator().manual_seed(7)
    for _ in range(3):  # the reference's generator must skip the gradients already used
        [torch.randn(n, generator=gen_state) for n in SIZES]
    with fuyou_client.start_daemon(short_tmp / "state", config=cfg) as d, \
            fuyou_client.connect(d.socket, namespace="run") as s:
        assert [s.group(f"g{i}").step for i in range(3)] == [3, 3, 3]
        weights = [s.allocate(n * 4) for n in SIZES]
        grads = [s.allocate(n * 4) for n in SIZES]
        for step in range(3, 6):
            gs = [torch.randn(n, generator=gen_state) for n in SIZES]
            for p, g in zip(ref, gs):
                p.grad = g.clone()
            for group in opt.param_groups:
                group["lr"] = LRS[step]
            opt.step()
            for i, g in enumerate(gs):
                grads[i].tensor(torch.float32).copy_(g)
                s.step_group(f"g{i}", grads[i], LRS[step], out=weights[i])
        for w, p in zip(weights, ref):
            assert torch.equal(w.tensor(torch.float32), p.data)


def test_bad_optimizer_requests(short_tmp):
    cfg = merge(SMALL, {"optimizer": {"buffer_budget": "6MiB", "buffers": 3}})
    with fuyou_client.start_daemon(short_tmp / "state", config=cfg) as d, fuyou_client.connect(d.socket) as s:
        big = s.allocate(1 << 20)  # 256Ki params: 3 MiB of AdamW state > one 2 MiB buffer
        with pytest.raises(fuyou_client.ResourceExhausted, match="optimizer buffer"):
            s.create_group("big", big, AdamW())
        w = s.allocate(8192)
        s.create_group("ok", w, AdamW())
        with pytest.raises(fuyou_client.InvalidArgument, match="belong to optimizer groups"):
            s.swap_out("optim/ok", w)
        with pytest.raises(fuyou_client.ObjectNotFound, match="no optimizer group 'nope'"):
            s.step_group("nope", w, 1e-3)
        small = s.allocate(100)  # one page: 1024 floats, the group has 2048
        with pytest.raises(fuyou_client.InvalidArgument, match="outside the buffer"):
            s.step_group("ok", small, 1e-3)
        with pytest.raises(fuyou_client.InvalidArgument, match="learning rate"):
            s.step_group("ok", w, float("nan"))
        with pytest.raises(fuyou_client.InvalidArgument, match="betas"):
            s.create_group("bad", w, AdamW(betas=(1.5, 0.9)))
        s.delete("optim/ok")
        with pytest.raises(fuyou_client.ObjectNotFound):
            s.group("ok")


def test_a_weight_fetch_takes_a_buffer_back_from_a_smaller_cached_state(short_tmp):
    """With no buffer spare, FetchWeights would decline and the client read the weights
    from the SSD itself; a state the cache keeps that is smaller than those weights gives
    its buffer back instead (its next step reads fewer bytes than the decline costs)."""
    from conftest import in_process_config
    from fuyoud.server import Daemon

    daemon = Daemon(in_process_config(short_tmp, optimizer__buffers=5, optimizer__buffer_budget="40MiB"))
    daemon.start()
    held = []
    try:
        with fuyou_client.connect(str(daemon.config.daemon.control_path)) as s:
            init, weights, grads = make_groups(s, [1000, 100_000], AdamW())
            s.step_group("g0", grads[0], 1e-3, out=weights[0])  # g0's state stays in the cache
            assert daemon.optimizer.cached_bytes() > 0
            while daemon.optimizer.buffers.spare() > 1:  # the others busy: none spare for a read-ahead
                held.append(daemon.optimizer.buffers.acquire_blocking(4096))
            assert s.fetch_weights_async("g1", weights[1], torch.float32).result(30)
            assert daemon.optimizer.cached_bytes() == 0
            assert torch.equal(weights[1].tensor(torch.float32)[:100_000], init[1])
    finally:
        for buf in held:
            daemon.optimizer.buffers.release(buf)
        daemon.stop()
