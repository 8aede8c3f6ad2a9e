"""Deaths: a training client SIGKILLed mid-step is reclaimed within 5 s while another
session trains on bit-identically; a daemon that dies at any point of an iteration
(forward, backward, step) makes the client raise DaemonUnavailable within 5 s, with a
message that says how to resume."""
from __future__ import annotations

import copy
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
from torch import nn

import fuyou_client
from conftest import SMALL, merge, scrape

LIMIT_S = 5.0
HYPER = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.05)


class Blocks(nn.Module):
    def __init__(self, width=128, depth=4):
        super().__init__()
        self.embed = nn.Linear(width, width)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(depth))

    def forward(self, x):
        h = self.embed(x)
        for b in self.blocks:
            h = h + b(h)
        return h.square().mean()


# The victim: bf16 compute (so it also holds transient weight objects), steps forever.
VICTIM = textwrap.dedent("""
    import sys, torch
    sys.path.insert(0, {tests!r})
    import fuyou_client
    from test_death import Blocks
    model = Blocks().to(torch.bfloat16)
    engine = fuyou_client.attach(model, socket={socket!r})
    x = torch.randn(16, 128, dtype=torch.bfloat16)
    step = 0
    while True:
        model(x).backward()
        engine.step()
        engine.zero_grad()
        step += 1
        print(step, flush=True)
""")


@pytest.mark.slow  # (two training clients, one killed: about 13 s; reclaiming is tested in test_daemon.py)
def test_a_client_killed_mid_step_is_reclaimed_while_another_trains_on(short_tmp):
    d = fuyou_client.start_daemon(short_tmp / "state", config=SMALL)
    try:
        url = d.status().metrics_url
        victim = subprocess.Popen([sys.executable, "-c", VICTIM.format(tests=os.path.dirname(__file__),
                                                                       socket=d.socket)],
                                  stdout=subprocess.PIPE, text=True)
        # The survivor trains in this process, across the kill, against torch's AdamW.
        torch.manual_seed(0)
        ours = Blocks()
        ref = copy.deepcopy(ours)
        engine = fuyou_client.attach(ours, fuyou_client.AdamW(**HYPER), socket=d.socket)
        opt = torch.optim.AdamW(ref.parameters(), **HYPER, fused=True)
        data = [torch.randn(16, 128, generator=torch.Generator().manual_seed(i)) for i in range(12)]
        killed = threading.Event()

        def survive():
            for i, x in enumerate(data):
                if i == 6:
                    killed.wait(60)
                ours(x).backward()
                engine.step()
                engine.zero_grad()

        trainer = threading.Thread(target=survive)
        trainer.start()
        for _ in range(3):  # the victim is well into training
            assert victim.stdout.readline()
        before = scrape(url)
        assert before["fuyoud_sessions"] == 2 and before['fuyoud_objects{kind="transient"}'] > 0
        time.sleep(0.05)  # somewhere inside an iteration
        victim.send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        victim.wait()
        killed.set()
        reclaimed_before = before.get("fuyoud_reclaimed_pinned_bytes_total", 0)
        while True:  # (the daemon drops the session, then its objects, then its memory)
            m = scrape(url)
            if m["fuyoud_sessions"] == 1 and m['fuyoud_objects{kind="transient"}'] == 0 \
                    and m["fuyoud_reclaimed_pinned_bytes_total"] > reclaimed_before:
                break
            assert time.monotonic() - t0 < LIMIT_S, m
            time.sleep(0.05)
        reclaimed_s = time.monotonic() - t0
        victims = [k for k in before if k.startswith("fuyoud_session_pinned_bytes")]
        assert len([k for k in m if k.startswith("fuyoud_session_pinned_bytes")]) == len(victims) - 1
        trainer.join()
        for x in data:
            ref(x).backward()
            opt.step()
            opt.zero_grad()
        engine.close()
        for (name, a), b in zip(ours.state_dict().items(), ref.state_dict().values()):
            assert torch.equal(a, b), name
        print(f"reclaimed {reclaimed_s:.2f} s after SIGKILL")
    finally:
        assert d.stop() == 0, d.log()


@pytest.mark.parametrize("point, rpc", [pytest.param("forward", "SwapIn", marks=pytest.mark.slow),
                                        pytest.param("backward", "FetchWeights", marks=pytest.mark.slow),
                                        ("step", "StepGroup")])  # (a daemon each: the step's in the default suite)
def test_a_dead_daemon_raises_within_seconds_at_any_point(short_tmp, point, rpc):
    # fp32 offload: forward fetches weights with SwapIn, backward asks FetchWeights, the
    # steps go out during backward and are waited for in engine.step().
    env = dict(os.environ, FUYOUD_FAILPOINTS=f"rpc.{rpc}=kill")
    d = fuyou_client.start_daemon(short_tmp / "state", config=merge(SMALL, {}), env=env)
    # (more blocks than the weight slots: backward fetches those whose slots forward's later
    # blocks took; it finds the last ones still in theirs)
    model = Blocks(depth=16)
    engine = fuyou_client.attach(model, socket=d.socket, prefetch=1)
    x = torch.randn(8, 128)
    t0 = time.monotonic()
    with pytest.raises(fuyou_client.DaemonUnavailable, match="resume=DIR") as err:
        for _ in range(3):
            loss = model(x)
            loss.backward()
            engine.step()
            engine.zero_grad()
    assert time.monotonic() - t0 < LIMIT_S
    assert "engine.save_checkpoint" in str(err.value)
    d.process.wait(10)
    assert d.process.returncode == -signal.SIGKILL
    engine.session.close()
