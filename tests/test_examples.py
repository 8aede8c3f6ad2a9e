"""The README's main jobs, run as a user would (small settings)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_finetune_demo_trains_and_saves_a_loadable_model(short_tmp):
    transformers = pytest.importorskip("transformers")
    out = short_tmp / "finetuned"
    run = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "finetune.py"), "--layers", "2", "--width", "128", "--steps", "8",
         "--seq", "64", "--lr", "3e-3", "--out", str(out), "--state-dir", str(short_tmp / "state")],
        capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "saved to" in run.stdout
    model = transformers.GPT2LMHeadModel.from_pretrained(out)
    assert (out / "model.safetensors.index.json").exists() and (out / "config.json").exists()
    assert sum(p.numel() for p in model.parameters()) > 0


def test_swap_roundtrip_example(short_tmp):
    run = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "swap_roundtrip.py"), "--size", "64MiB", "--rounds", "1",
         "--state-dir", str(short_tmp / "state")], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "every byte verified" in run.stdout
