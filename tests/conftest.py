"""Shared fixtures: real daemons (child processes or in-process), real files in tmp dirs."""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
from pathlib import Path

import pytest
import torch

import fuyou_client
from fuyoud import config as config_mod
from fuyoud.io import uring
from fuyoud.io.threadpool import ThreadPoolEngine

URING_OK, URING_WHY = uring.available()
ENGINES = [
    pytest.param("io_uring", marks=pytest.mark.skipif(not URING_OK, reason=f"io_uring unusable: {URING_WHY}")),
    "threadpool",
]

# Small enough for a 2-core CI machine, large enough to exercise several segments,
# stripes and chunks.
SMALL = {
    "storage": {"capacity_per_device": "256MiB", "stripe_size": "1MiB"},
    "memory": {"pinned_budget": "256MiB", "segment_size": "8MiB", "staging_size": "4MiB"},
    "io": {"chunk_size": "256KiB", "queue_depth": 16, "threads": 8},
}


def merge(base: dict, extra: dict) -> dict:
    out = {k: dict(v) for k, v in base.items()}
    for section, values in extra.items():
        out.setdefault(section, {}).update(values)
    return out


def make_engine(name: str):
    return uring.UringEngine(16) if name == "io_uring" else ThreadPoolEngine(8)


@pytest.fixture
def short_tmp():
    """A short directory path (unix socket paths must stay under 108 bytes)."""
    with tempfile.TemporaryDirectory(prefix="fy-", dir="/tmp") as d:
        yield Path(d)


@pytest.fixture
def daemon(short_tmp):
    """fuyoud as a child process with small limits, 3 data directories."""
    dirs = [str(short_tmp / f"ssd{i}") for i in range(3)]
    d = fuyou_client.start_daemon(short_tmp / "state", config=merge(SMALL, {"storage": {"data_dirs": dirs}}))
    yield d
    code = d.stop()
    assert code == 0, d.log()


@pytest.fixture
def small_daemon(short_tmp):
    """fuyoud as a child process with small limits, one data directory."""
    d = fuyou_client.start_daemon(short_tmp / "state", config=SMALL)
    yield d
    assert d.stop() == 0, d.log()


@pytest.fixture
def session(daemon):
    with fuyou_client.connect(daemon.socket) as s:
        yield s


@contextlib.contextmanager
def private_daemon(config: dict, prefix: str = "fy-", data_dirs: int = 0):
    """fuyoud as a child process in a new directory under /tmp (short socket paths), for a
    module's tests to share (``data_dirs``: that many data directories in it, as the
    ``daemon`` fixture has); the directory goes when it has stopped."""
    root = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    if data_dirs:
        config = merge(config, {"storage": {"data_dirs": [str(root / f"ssd{i}") for i in range(data_dirs)]}})
    d = fuyou_client.start_daemon(root / "state", config=config)
    try:
        yield d
    finally:
        code = d.stop()
        shutil.rmtree(root, ignore_errors=True)
    assert code == 0, d.log()


def in_process_config(root: Path, ndirs: int = 2, **overrides) -> config_mod.Config:
    cfg = merge(SMALL, {
        "daemon": {"state_dir": str(root / "state"), "runtime_dir": str(root / "run")},
        "storage": {"data_dirs": [str(root / f"ssd{i}") for i in range(ndirs)]},
        "metrics": {"enabled": False},
    })
    for key, value in overrides.items():
        section, name = key.split("__")
        cfg.setdefault(section, {})[name] = value
    return config_mod.from_dict(cfg)


def scrape(url: str) -> dict[str, float]:
    """A Prometheus text endpoint as {'name{labels}': value}."""
    import urllib.request

    text = urllib.request.urlopen(url, timeout=5).read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


def random_bytes(n: int, seed: int = 0) -> bytes:
    import random

    return random.Random(seed).randbytes(n)


os.environ.setdefault("FUYOU_TEST", "1")


def tiny_gpt2(layers: int = 4, width: int = 64, vocab: int = 256, positions: int = 32):
    """A GPT-2 architecture small enough for the suite, without dropout (runs compare bitwise)."""
    import transformers

    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=layers, n_embd=width, n_head=4, vocab_size=vocab, n_positions=positions, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))


def tiny_llama(layers: int = 4, width: int = 64, vocab: int = 256, positions: int = 32):
    import transformers

    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        num_hidden_layers=layers, hidden_size=width, intermediate_size=2 * width, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=positions, bos_token_id=0, eos_token_id=0,
        pad_token_id=0))


# AdamW hyperparameters that are not torch's defaults (a default silently taken shows),
# and a daemon whose optimizer buffers (3 x 4 MiB) are smaller than the test models'
# state, which really streams from SSD.
HYPER = dict(lr=3e-3, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1)
STREAMING = merge(SMALL, {"optimizer": {"buffer_budget": "12MiB", "buffers": 3},
                          "storage": {"capacity_per_device": "1GiB"}})


def step_pair(ours, engine, ref, opt, x) -> None:
    """One iteration of a causal LM through ``engine`` and of its reference under ``opt``."""
    ours(x, labels=x).loss.backward()
    engine.step()
    engine.zero_grad()
    ref(x, labels=x).loss.backward()
    opt.step()
    opt.zero_grad()


def wait_until(cond, what: str, seconds: float = 30.0, poll: float = 0.02) -> None:
    """Poll for a state the code under test reaches on its own (a liveness bound, not a
    timing assertion)."""
    deadline = time.monotonic() + seconds
    while not cond():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(poll)


class TokenRows(torch.utils.data.Dataset):
    """A causal LM's dataset for the Trainer's tests: ``n`` rows of random tokens below
    256, each its own labels."""

    def __init__(self, n=16, length=16):
        self.rows = torch.randint(0, 256, (n, length), generator=torch.Generator().manual_seed(7))

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return {"input_ids": self.rows[i], "labels": self.rows[i]}
