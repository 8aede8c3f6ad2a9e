"""A checkpoint never silently depends on storage that is going away: a temporary daemon's
(start_daemon() without a state_dir, which deletes its store when it stops) are
self-contained copies, which a new daemon in a new process resumes (checkpoints/durability.py;
that a daemon whose store persists still takes snapshots: test_checkpoint.py's
test_snapshots_share_extents_and_deleting_one_frees_them)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import fuyou_client
from conftest import SMALL, STREAMING, tiny_gpt2

TESTS = Path(__file__).resolve().parent


def one_step(model, engine):
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(3))
    model(x, labels=x).loss.backward()
    engine.step()
    engine.zero_grad()


def test_a_temporary_daemons_checkpoint_is_a_copy_that_outlives_it(tmp_path):
    first = fuyou_client.start_daemon(config=SMALL)  # (temporary: its store goes when it stops)
    torch.manual_seed(0)
    model = tiny_gpt2()
    engine = fuyou_client.attach(model, fuyou_client.AdamW(lr=1e-3), socket=first.socket)
    one_step(model, engine)
    reply = engine.save_checkpoint(tmp_path / "ckpt")
    assert reply.mode == "copy"
    engine.export(tmp_path / "want")
    engine.close()
    state = first.state_dir
    assert first.stop() == 0
    assert not state.exists()  # (the store went with it; the checkpoint did not)
    second = fuyou_client.start_daemon(config=SMALL)
    try:
        torch.manual_seed(5)  # (other initial weights: the checkpoint's must replace them)
        again = tiny_gpt2()
        engine = fuyou_client.attach(again, fuyou_client.AdamW(lr=1e-3), socket=second.socket, resume=tmp_path / "ckpt")
        engine.export(tmp_path / "got")
        engine.close()
    finally:
        assert second.stop() == 0
    want, got = fuyou_client.load_exported(tmp_path / "want"), fuyou_client.load_exported(tmp_path / "got")
    assert all(torch.equal(got[n], t) for n, t in want.items())


RESUME = textwrap.dedent("""
    import sys, fuyou_client
    sys.path.insert(0, {tests!r})
    from conftest import STREAMING
    from test_trainer import FuyouTrainer, Tokens, arguments, model
    daemon = fuyou_client.start_daemon(config=STREAMING)      # a new, temporary daemon
    trainer = FuyouTrainer(model=model(), args=arguments({run!r}, save_strategy="steps", save_steps=2),
                           train_dataset=Tokens(), fuyou={{"socket": daemon.socket}})
    trainer.train(resume_from_checkpoint={checkpoint!r})
    trainer.save_model({out!r})
    print("LOGS", [e["loss"] for e in trainer.state.log_history if "loss" in e])
    trainer.engine.close()
    assert daemon.stop() == 0
""")


@pytest.mark.slow  # (two Trainer runs and a new Python: about 15 s)
def test_a_trainer_checkpoint_resumes_in_a_new_process_under_a_new_daemon(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from test_trainer import FuyouTrainer, Tokens, arguments, model

    daemon = fuyou_client.start_daemon(config=STREAMING)  # temporary, as the docs' examples start one
    run = tmp_path / "run"
    trainer = FuyouTrainer(model=model(), args=arguments(run, save_strategy="steps", save_steps=2),
                           train_dataset=Tokens(), fuyou={"socket": daemon.socket})
    trainer.train()
    trainer.save_model(tmp_path / "whole")
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    trainer.engine.close()
    assert daemon.stop() == 0
    proc = subprocess.run([sys.executable, "-c", RESUME.format(tests=str(TESTS), run=str(run),
                                                               checkpoint=str(run / "checkpoint-4"),
                                                               out=str(tmp_path / "resumed"))],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path, env=dict(os.environ))
    assert proc.returncode == 0, proc.stderr[-4000:]
    resumed = eval(next(line for line in proc.stdout.splitlines() if line.startswith("LOGS"))[5:])
    assert resumed[-2:] == losses[-2:]  # (its log history has the first four from the checkpoint)
    want, got = fuyou_client.load_exported(tmp_path / "whole"), fuyou_client.load_exported(tmp_path / "resumed")
    assert set(got) == set(want) and all(torch.equal(got[n], t) for n, t in want.items())
