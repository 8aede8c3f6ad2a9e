"""Faults under load (bench/soak.py, bounded): several training jobs on one fuyoud, the
faults an operator meets at random points, nothing lost; and the seam it injects I/O
faults through in a real daemon process (FUYOUD_IO_FAULTS, fuyoud/io/faults.py)."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

import fuyou_client
from conftest import SMALL

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import soak  # noqa: E402

MiB = 1 << 20


def arm(path: Path, faults: list[dict]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"faults": faults}))
    os.replace(tmp, path)


def test_faults_written_to_a_file_reach_a_running_daemon(short_tmp):
    """A daemon started with FUYOUD_IO_FAULTS=FILE says so in its engine's reason; a file
    that is no fault list arms nothing (and says why in the log); from the moment the file
    changes it injects what it lists (EIO: DataLoss naming the errno; ENOSPC: a full disk,
    ResourceExhausted; reads: each attempt fails), logs each fault it injects, and nothing
    once the file lists none: a committed object is kept through it all."""
    faults = short_tmp / "faults.json"
    faults.write_text('{"faults": [{"kind": "meteor"}]}')
    d = fuyou_client.start_daemon(short_tmp / "state", config=SMALL, env=dict(os.environ, FUYOUD_IO_FAULTS=str(faults)))
    try:
        assert f"faults injected from {faults}" in d.status().io_engine_reason
        with fuyou_client.connect(d.socket) as s:
            buf, back = s.allocate(MiB), s.allocate(MiB)
            buf.view[:] = os.urandom(MiB)
            s.swap_out("kept", buf, persistent=True)  # (the file is no fault list: nothing armed)
            assert "not a fault list" in d.log() and "unknown fault kind 'meteor'" in d.log()
            arm(faults, [{"kind": "eio", "op": "write", "count": -1}])
            with pytest.raises(fuyou_client.DataLoss, match=r"errno 5"):
                s.swap_out("a", buf, persistent=True)
            arm(faults, [{"kind": "enospc", "op": "write", "count": -1}])
            with pytest.raises(fuyou_client.ResourceExhausted):
                s.swap_out("a", buf, persistent=True)
            arm(faults, [{"kind": "eio", "op": "read", "count": -1}])  # (a read and its retry)
            with pytest.raises(fuyou_client.DataLoss, match=r"errno 5"):
                s.swap_in("kept", back)
            arm(faults, [])
            s.swap_out("a", buf, persistent=True)
            s.swap_in("kept", back)
            assert bytes(back.view) == bytes(buf.view)
        log = d.log()
        for what in ("fault injected: eio into a write", "fault injected: enospc into a write",
                     "fault injected: eio into a read"):
            assert what in log
    finally:
        assert d.stop() == 0


@pytest.mark.slow  # (three jobs, a reference run and a run with every kind of fault: about 4 min)
def test_several_jobs_survive_every_kind_of_fault_bitwise(tmp_path):
    """bench/soak.py bounded: three jobs (AdamW fp32 offloaded; bf16 state with clipping; SGD
    with momentum, resident, two micro-batches a step) share one daemon while at least one
    fault of every kind strikes. Every job ends bitwise the run without faults (each loss
    each time it was computed, the final optimizer state and weights), each life resumed
    from the newest checkpoint acknowledged, a damaged checkpoint refused naming it and the
    previous one used, every death explained by a fault, the array's usage after the end's
    restart the reference's, no extent held by no object or snapshot before or after a
    restart, and nothing once everything is deleted."""
    r = soak.soak(jobs=3, steps=300, every=10, faults=len(soak.KINDS), seeds=[0], directory=tmp_path,
                  budget_s=900, restart_s=0.5)
    run = r["runs"][0]
    assert run["error"] is None, run["error"]
    assert run["unexpected"] == [], run["unexpected"]
    for kind, k in r["by_kind"].items():
        assert k["injected"] >= 1, (kind, r["by_kind"])
        assert k["fired"] == k["injected"], (kind, k)
        assert k["survived"] == k["injected"] and k["lost"] == 0, (kind, k)
    for name, job in run["jobs"].items():
        assert job["bitwise"], (name, job)
        assert job["bad_resumes"] == [], (name, job["bad_resumes"])
    assert r["jobs_lost"] == 0 and r["all_bitwise"]
    damaged = [(f["detail"], run["jobs"][f["target"]]["refusals"]) for f in run["faults"] if f["kind"] == "damaged_checkpoint"]
    assert r["damaged_checkpoints"] >= 1 and r["damaged_refused_and_previous_used"] == r["damaged_checkpoints"], damaged
    assert r["final_used_bytes_equal_reference"], (r["reference_used_bytes_after_restart"], run["array"])
    assert r["unreferenced_bytes_after_restart_max"] == 0, run["usage_after_restart"]
    assert r["emptied_used_bytes"] == 0
    # Every error a fault gave a job is one a caller can act on: none internal.
    errors = {e for f in run["faults"] for _, e, _ in f["errors"]}
    assert "InternalError" not in errors, [(f["kind"], f["detail"], e) for f in run["faults"] for e in f["errors"]
                                           if e[1] == "InternalError"]
    # Within a daemon's life too, no extent outlives every object and snapshot holding it
    # (a copy checkpoint pins only what it copies: 047c9cb).
    assert r["unreferenced_bytes_before_restart_max"] == 0, (r["used_bytes_before_restart_max"], run["array"])
