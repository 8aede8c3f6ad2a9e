"""Memory claims of attach(): the optimizer state really lives on SSD.

A 100M-parameter model trains in a child process (so its peak resident memory is its
own); with AdamW state on SSD and the blocks' weights offloaded, that peak stays below
the size of the fp32 weights plus both moments (12 bytes per parameter) — which an
in-memory AdamW would need on top of the process itself. The daemon's pinned memory
stays within its budget throughout.
"""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

import fuyou_client
from conftest import SMALL, merge

CHILD = textwrap.dedent("""
    import json, sys, torch
    from torch import nn
    import fuyou_client

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(2048, 2048), nn.GELU(), nn.Linear(2048, 2048))
                                        for _ in range(12))
            self.head = nn.Linear(2048, 16)

        def forward(self, x):
            for b in self.blocks:
                x = x + b(x)
            return self.head(x)

    torch.manual_seed(0)
    model = Net()
    params = sum(p.numel() for p in model.parameters())
    engine = fuyou_client.attach(model, fuyou_client.AdamW(lr=1e-4), socket=sys.argv[1])
    pinned = []
    for _ in range(3):
        loss = model(torch.randn(8, 2048)).square().mean()
        loss.backward()
        engine.step()
        engine.zero_grad()
        st = engine.session.status()
        pinned.append((st.pinned_used_bytes, st.pinned_budget_bytes))
    # VmHWM: this process's own peak (ru_maxrss would include the forking parent's size)
    peak = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM:"))
    print(json.dumps({"params": params, "peak_rss": peak, "pinned": pinned, "loss": loss.item()}))
    engine.close(materialize=False)
""")


@pytest.mark.slow  # (12 s: the default suite's 10 minutes)
def test_peak_memory_stays_below_weights_plus_moments(short_tmp):
    cfg = merge(SMALL, {"storage": {"capacity_per_device": "3GiB"},
                        "memory": {"pinned_budget": "1GiB", "segment_size": "64MiB"},
                        "optimizer": {"buffer_budget": "512MiB", "buffers": 3}})
    with fuyou_client.start_daemon(short_tmp / "state", config=cfg) as d:
        out = subprocess.run([sys.executable, "-c", CHILD, d.socket], capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["params"] > 100_000_000
    weights_and_moments = 12 * r["params"]
    assert r["peak_rss"] < weights_and_moments, (
        f"peak RSS {r['peak_rss'] / 2**20:.0f} MiB >= {weights_and_moments / 2**20:.0f} MiB")
    assert all(used <= budget for used, budget in r["pinned"])
    print(f"peak RSS {r['peak_rss'] / 2**20:.0f} MiB for {r['params'] / 1e6:.0f}M parameters "
          f"(weights + moments: {weights_and_moments / 2**20:.0f} MiB)")
