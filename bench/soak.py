"""Faults under load: several training jobs share one fuyoud for many steps while the faults
an operator meets hit them at random points; nothing may be lost.

    python bench/soak.py [--jobs 4] [--steps 1000] [--every 20] [--faults 30] [--seeds 0,1,2]
                         [--restart-s 1] [--budget-s 3600] [--dir DIR] [--json PATH] [--keep-files]

(A job's steps are ``--steps`` times its kind's pace: soak_run.JOBS.)

First the jobs run together on a daemon without faults: the reference. Then, per seed, the
same jobs run again on a fresh daemon while faults come one after another, each at a
random moment once every job is training again after the previous one (a random pause of
0.3-2 s), the kind drawn so that the kinds come about equally often:

* ``trainer_sigkill``: a training process SIGKILLed (restarted, as a scheduler would);
* ``trainer_sigkill_in_checkpoint``: a training process SIGKILLed while it waits on a
  checkpoint;
* ``daemon_sigkill``: fuyoud SIGKILLed and restarted after ``--restart-s`` (systemd's
  Restart=on-failure);
* ``daemon_sigterm``: fuyoud stopped with SIGTERM and started again (an operator's
  ``systemctl restart``);
* ``daemon_kill_in_checkpoint``: fuyoud SIGKILLed while a job's checkpoint is being
  written (the daemon pauses inside every checkpoint, between linking or copying the
  objects and publishing the directory, at a failpoint: FUYOUD_FAILPOINTS);
* ``write_eio``, ``read_eio``: a write failing with EIO, or 2 or 64 read requests in a row
  (a read is retried once: 2 are mostly absorbed), through the daemon's fault-injecting
  engine (FUYOUD_IO_FAULTS: fuyoud/io/faults.py);
* ``disk_full``: every write failing with ENOSPC until 0.5-2 s after the first one did,
  then room again;
* ``damaged_checkpoint``: a job SIGKILLed and one byte of its newest checkpoint (a copy)
  flipped: its next life must refuse it, naming it, and resume the previous one.

A job that dies (killed, or failing on the error a fault gave it) is started again and
resumes from its newest good checkpoint (bench/soak_job.py). Checked for every job, per
seed: it finished; each step's loss, every time it was computed, equals the reference's;
its final optimizer state (masters, moments, step counts) and weights are bitwise the
reference's; each life resumed from the newest checkpoint acknowledged before it (or a
newer one the interrupted save completed), except a damaged one, which was refused with
a message naming it, the previous one used. The array: right after each restart, no
extent held by no object or snapshot; at the end (after one more restart) its used bytes
equal to the reference's; once every checkpoint and namespace is deleted, nothing (and,
reported, what it held beyond its objects and snapshots before that last restart). Reported per fault kind: injected, fired
(I/O faults: the daemon's log says so), jobs it stopped, survived, lost (jobs that did not
end bitwise equal: 0), and recovery time (from the fault until every job it stopped is
training again: a step done in a new life).

Bounded: ``--budget-s`` for the whole run; faults stop once the jobs are near their end.
"""
from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import host_info  # noqa: E402
from soak_run import CHECKPOINT_PAUSE_S, JOBS, KINDS, Fault, Run, daemon_config  # noqa: E402



def judge(run: Run, reference: dict) -> dict:
    """Each job against the reference: finished, losses, final state and weights; its
    lives' resumes; the damaged checkpoints refused."""
    jobs = {}
    damaged = {f.detail["checkpoint"]: f for f in run.faults if f.kind == "damaged_checkpoint"}
    for job in run.jobs:
        ev = job.events()
        ref = reference[job.name]
        done = [e for e in ev if e["event"] == "done"]
        losses: dict[int, set] = {}
        for e in ev:
            if e["event"] == "step":
                losses.setdefault(e["step"], set()).add(tuple(e["loss"]))
        wrong_losses = [s for s, v in losses.items() if v != {tuple(ref["losses"][s])}]
        # Resumes: each life from the newest checkpoint acknowledged before it (not a damaged one).
        acked, bad_resumes, refusals = [], [], []
        for e in ev:
            if e["event"] == "checkpointed":
                acked.append((e["step"], e["checkpoint"]))
            elif e["event"] == "refused":
                refusals.append(e)
                acked = [a for a in acked if a[1] != e["checkpoint"]]
            elif e["event"] == "resumed":
                newest = max((s for s, _ in acked), default=0)
                if e["step"] < newest:
                    bad_resumes.append({"life": e["life"], "resumed": e["step"], "newest_acknowledged": newest})
        refused_ok = []
        for path, f in damaged.items():
            # Refused naming it; the first resume after that, from the checkpoint before it.
            at = next((i for i, e in enumerate(ev) if e["event"] == "refused" and e["checkpoint"] == path), None)
            nxt = next((e for e in ev[at:] if e["event"] == "resumed"), None) if at is not None else None
            refused_ok.append(at is not None and path in ev[at]["message"] and nxt is not None
                              and nxt["step"] == f.detail["previous_step"])
        jobs[job.name] = {
            "finished": bool(done),
            "lives": sum(1 for e in ev if e["event"] == "start"),
            "steps_computed": sum(1 for e in ev if e["event"] == "step"),
            "losses_bitwise": not wrong_losses and len(losses) == job.spec["steps"],
            "wrong_loss_steps": wrong_losses[:10],
            "state_bitwise": bool(done) and done[-1]["state"] == ref["state"],
            "weights_bitwise": bool(done) and done[-1]["weights"] == ref["weights"],
            "bad_resumes": bad_resumes,
            "refusals": [{"checkpoint": e["checkpoint"], "error": e["error"], "message": e["message"][:300]}
                         for e in refusals],
            "damaged_refused_and_previous_used": [ok for path, ok in zip(damaged, refused_ok)
                                                  if damaged[path].target == job.name],
        }
        j = jobs[job.name]
        j["bitwise"] = j["finished"] and j["losses_bitwise"] and j["state_bitwise"] and j["weights_bitwise"]
    return jobs


def reference_of(run: Run) -> dict:
    out = {}
    for job in run.jobs:
        ev = job.events()
        done = [e for e in ev if e["event"] == "done"][-1]
        losses = {}
        for e in ev:
            if e["event"] == "step":
                losses[e["step"]] = e["loss"]
        out[job.name] = {"losses": losses, "state": done["state"], "weights": done["weights"]}
    return out


def by_kind(faults: list[Fault], jobs: dict) -> dict:
    """Per kind: injected, fired, the jobs they stopped; survived: faults whose stopped jobs
    all trained again and ended bitwise; lost: jobs one of them stopped that did not."""
    out = {}
    for kind in KINDS:
        fs = [f for f in faults if f.kind == kind]
        rec = [f.recovery_s for f in fs if f.stopped and f.recovery_s is not None]
        out[kind] = {"injected": len(fs), "fired": sum(f.fired for f in fs),
                     "stopped_jobs": sum(len(f.stopped) for f in fs),
                     "survived": sum(f.recovery_s is not None and all(jobs[n]["bitwise"] for n in f.stopped)
                                     for f in fs),
                     "lost": len({n for f in fs for n in f.stopped if not jobs[n]["bitwise"]}),
                     "recovery_s_median": statistics.median(rec) if rec else None,
                     "recovery_s_max": max(rec) if rec else None,
                     "client_errors": sorted({e[1] for f in fs for e in f.errors})}
    return out


def soak(jobs: int, steps: int, every: int, faults: int, seeds: list[int], directory: Path | None,
         budget_s: float, restart_s: float = 1.0, keep: int = 2, keep_files: bool = False) -> dict:
    deadline = time.monotonic() + budget_s
    root = Path(tempfile.mkdtemp(prefix="fy-soak-", dir=directory or "/tmp"))
    specs = [dict(JOBS[i % len(JOBS)], seed=100 + i, every=every, keep=keep) for i in range(jobs)]
    for spec in specs:
        spec["steps"] = max(every, round(steps * spec.pop("pace") / every) * every)
    result: dict = {"jobs": specs, "steps": steps, "every": every, "keep": keep, "restart_s": restart_s,
                    "config": daemon_config(jobs), "checkpoint_pause_s": CHECKPOINT_PAUSE_S, "runs": []}
    try:
        t = time.monotonic()
        clean = Run(root / "clean", specs, None, 0, restart_s, deadline)
        try:
            clean.go()
            result["reference"] = {"wall_s": time.monotonic() - t, "array": clean.finish()}
        finally:
            clean.close()
        reference = reference_of(clean)
        for seed in seeds:
            t = time.monotonic()
            run = Run(root / f"seed{seed}", specs, random.Random(seed), faults, restart_s, deadline)
            try:
                error = None
                try:
                    run.go()
                except TimeoutError as exc:
                    error = str(exc)
                jobs_judged = judge(run, reference)
                array = run.finish() if error is None else None
            finally:
                run.close()
            result["runs"].append({
                "seed": seed, "wall_s": time.monotonic() - t, "error": error,
                "faults": [f.__dict__ for f in run.faults], "by_kind": by_kind(run.faults, jobs_judged),
                "jobs": jobs_judged, "unexpected": run.unexpected, "timeline": run.timeline,
                "usage_after_restart": run.usage_after_restart, "array": array,
            })
    finally:
        if keep_files:
            print(f"(the soak's files are kept in {root})", file=sys.stderr)
        else:
            shutil.rmtree(root, ignore_errors=True)
    return summarize(result)


def summarize(result: dict) -> dict:
    ref = result["reference"]["array"]["after_restart"]["used_bytes"]
    runs = result["runs"]
    faults = [f for r in runs for f in r["faults"]]
    rec = [f["recovery_s"] for f in faults if f["stopped"] and f["recovery_s"] is not None]
    jobs = [j for r in runs for j in r["jobs"].values()]
    kinds = {}
    for kind in KINDS:
        per = [r["by_kind"][kind] for r in runs]
        krec = [f["recovery_s"] for f in faults if f["kind"] == kind and f["stopped"] and f["recovery_s"] is not None]
        kinds[kind] = {"injected": sum(p["injected"] for p in per), "fired": sum(p["fired"] for p in per),
                       "stopped_jobs": sum(p["stopped_jobs"] for p in per), "survived": sum(p["survived"] for p in per),
                       "lost": sum(p["lost"] for p in per),
                       "recovery_s_median": statistics.median(krec) if krec else None,
                       "recovery_s_max": max(krec) if krec else None,
                       "client_errors": sorted({e for p in per for e in p["client_errors"]})}
    used_after = [u["used_bytes"] for r in runs for u in r["usage_after_restart"]]
    arrays = [result["reference"]["array"]] + [r["array"] for r in runs if r["array"]]
    result.update({
        "faults_injected": len(faults), "faults_survived": sum(k["survived"] for k in kinds.values()),
        "jobs_lost": sum(not j["bitwise"] for j in jobs), "jobs_total": len(jobs),
        "all_bitwise": all(j["bitwise"] for j in jobs) and all(r["error"] is None for r in runs),
        "bad_resumes": sum(len(j["bad_resumes"]) for j in jobs),
        "damaged_checkpoints": sum(len(j["damaged_refused_and_previous_used"]) for j in jobs),
        "damaged_refused_and_previous_used": sum(sum(j["damaged_refused_and_previous_used"]) for j in jobs),
        "recovery_s_median": statistics.median(rec) if rec else None, "recovery_s_max": max(rec) if rec else None,
        "by_kind": kinds, "restarts": sum(len(r["usage_after_restart"]) for r in runs),
        "reference_used_bytes_after_restart": ref,
        "used_bytes_after_restart_max": max(used_after, default=0),
        # Extents no object or snapshot holds: right after each restart (recovery must have
        # freed them), and at the end of a daemon's life, before its restart.
        "unreferenced_bytes_after_restart_max": max([u["unreferenced_bytes"] for r in runs
                                                     for u in r["usage_after_restart"]]
                                                    + [a["after_restart"]["unreferenced_bytes"] for a in arrays]),
        "unreferenced_bytes_before_restart_max": max(a["before_restart"]["unreferenced_bytes"] for a in arrays),
        "used_bytes_before_restart_max": max(a["before_restart"]["used_bytes"] for a in arrays),
        "final_used_bytes_equal_reference": all(r["array"] and r["array"]["after_restart"]["used_bytes"] == ref
                                                for r in runs),
        "emptied_used_bytes": max([result["reference"]["array"]["emptied"]["used_bytes"]]
                                  + [r["array"]["emptied"]["used_bytes"] for r in runs if r["array"]]),
        "unexpected": sum(len(r["unexpected"]) for r in runs),
    })
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", type=int, default=4)
    ap.add_argument("--steps", type=int, default=1000, help="steps of a job of pace 1 (soak_run.JOBS)")
    ap.add_argument("--every", type=int, default=20, help="a checkpoint every so many steps")
    ap.add_argument("--faults", type=int, default=30, help="faults per seed")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--restart-s", type=float, default=1.0, help="pause before fuyoud is started again")
    ap.add_argument("--budget-s", type=float, default=3600)
    ap.add_argument("--dir", type=Path, help="parent of the work directory (default /tmp)")
    ap.add_argument("--keep-files", action="store_true", help="keep the work directory (logs, checkpoints)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    t0 = time.time()
    seeds = [int(s) for s in args.seeds.split(",") if s]
    result = soak(args.jobs, args.steps, args.every, args.faults, seeds, args.dir, args.budget_s, args.restart_s,
                  keep_files=args.keep_files)
    result.update({"command": " ".join(["python bench/soak.py", *(argv if argv is not None else sys.argv[1:])]),
                   "date": time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime()),
                   "host": host_info(args.dir or Path("/tmp")), "wall_s": time.time() - t0})
    print(f"{result['faults_injected']} faults over {len(seeds)} seed(s), {result['jobs_total']} job runs: "
          f"lost {result['jobs_lost']}, all bitwise {result['all_bitwise']}, recovery median "
          f"{result['recovery_s_median']} s, max {result['recovery_s_max']} s")
    for kind, k in result["by_kind"].items():
        print(f"  {kind:30} injected {k['injected']:3} fired {k['fired']:3} stopped {k['stopped_jobs']:3} "
              f"survived {k['survived']:3} lost {k['lost']} recovery {k['recovery_s_median']} / {k['recovery_s_max']} s "
              f"{k['client_errors']}")
    print(f"array: reference {result['reference_used_bytes_after_restart']} B after restart; faulty runs equal: "
          f"{result['final_used_bytes_equal_reference']}; unreferenced after restarts "
          f"{result['unreferenced_bytes_after_restart_max']} B, before a restart up to "
          f"{result['unreferenced_bytes_before_restart_max']} B; emptied {result['emptied_used_bytes']} B; "
          f"{result['unexpected']} unexpected deaths; {result['bad_resumes']} bad resumes")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1, default=str) + "\n")
    return 0 if result["all_bitwise"] and result["final_used_bytes_equal_reference"] else 1


if __name__ == "__main__":
    sys.exit(main())
