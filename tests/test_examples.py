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


@pytest.mark.slow  # (the demo again with its options: about 14 s)
def test_finetune_demo_takes_a_state_dtype_and_writes_its_losses(short_tmp):
    pytest.importorskip("transformers")
    import json
    losses = short_tmp / "losses.json"
    run = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "finetune.py"), "--layers", "1", "--width", "64", "--steps", "4",
         "--seq", "32", "--lr", "3e-3", "--state-dtype", "int8", "--losses", str(losses), "--block-major", "2",
         "--out", str(short_tmp / "out"), "--state-dir", str(short_tmp / "state")],
        capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "int8 moments, 2 micro-batches per step in block-major order" in run.stdout
    r = json.loads(losses.read_text())
    assert r["state_dtype"] == "int8" and len(r["losses"]) == 4 and r["final_loss"] == r["losses"][-1]


@pytest.mark.slow  # (the demo again, through the Trainer: about 17 s; FuyouTrainer is tested in test_trainer.py)
def test_finetune_demo_through_the_trainer(short_tmp):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    out = short_tmp / "finetuned"
    run = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "finetune.py"), "--trainer", "--layers", "2", "--width", "128",
         "--steps", "8", "--seq", "64", "--lr", "3e-3", "--out", str(out), "--state-dir", str(short_tmp / "state")],
        capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "through FuyouTrainer" in run.stdout and "saved to" in run.stdout
    transformers.GPT2LMHeadModel.from_pretrained(out)
    assert not (short_tmp / "state").exists()  # (the Trainer's folder went with the daemon's state)


@pytest.mark.slow  # (two ranks under torchrun: about 20 s; data parallelism is tested in test_distributed.py)
def test_finetune_demo_under_torchrun(short_tmp):
    """The demo data parallel: two ranks under torchrun share the private daemon local
    rank 0 starts; the export (every rank gathers, rank 0 writes) loads."""
    transformers = pytest.importorskip("transformers")
    out = short_tmp / "finetuned"
    env = dict(__import__("os").environ, OMP_NUM_THREADS="1", TMPDIR=str(short_tmp))  # (torchrun's files too)
    env.pop("FUYOUD_SOCKET", None)
    run = subprocess.run(
        [str(Path(sys.executable).with_name("torchrun")), "--standalone", "--nproc-per-node=2",
         str(ROOT / "examples" / "finetune.py"), "--layers", "2", "--width", "128", "--steps", "6", "--seq", "64",
         "--lr", "3e-3", "--out", str(out), "--state-dir", str(short_tmp / "state")],
        capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "2 ranks, data parallel" in run.stdout and "saved to" in run.stdout
    transformers.GPT2LMHeadModel.from_pretrained(out)
    assert not (short_tmp / "state").exists() or not any((short_tmp / "state").iterdir())
