"""A hostile tenant beside a training job on one fuyoud: does the job keep its share?

    python bench/hostile.py [--json PATH] [--rounds 2] [--steps 8] [--seconds 20] [--dir DIR]

One private fuyoud on a shared host (``allow_uids``: two users besides root, so [limits]
"auto": one user may hold 75% of the pinned budget and of the array, and 64 sessions), a
1 GiB pinned budget in 8 MiB segments, two 1 GiB data files, sockets of group nogroup.

The victim, a training process of root (uid 0): a ``GPT2LMHeadModel`` (4 layers, width
256, vocabulary 4096, no dropout, one torch thread), ``attach`` with the defaults, ``--steps``
steps; it records each step's time, its losses, its memory plan and any error.

The attacker is uid ``nobody``, another user (a process group of its own, killed with
SIGKILL at the end: it dies holding everything). It opens sessions until refused, has
them reserve all they may (the whole budget asked, halved on each refusal), gives 32 MiB
back for its children, then until stopped floods: Status and ListObjects from two
threads; two threads that swap 8 MiB buffers out under new names until the array or
``user_ssd`` refuses, then overwrite them, and ask for 64 MiB more pinned memory now and
then; and a forked child at a time (also ``nobody``) that connects, calls Allocate,
SwapOut and Reserve in a loop and is SIGKILLed 0-50 ms after its first call began; all counted.

In each of ``--rounds`` interleaved rounds: the victim alone, then the victim beside the
attacker (started once the attacker ramped up; the attacker floods at least
``--seconds`` and until the victim ends). Reported per round and as medians: the
victim's median step time alone and together (first step, a warm-up, left out) and their
ratio (with two users its fair share is a ratio <= 2), its worst step, whether its losses
are bitwise those alone and its plan the one alone, its errors; the attacker's counts.
The daemon's pinned memory, threads, descriptors, SSD bytes, objects and sessions before
the first round, after the first victim alone and after each round (the attacker's
sessions reclaimed); its refusal counters (metrics endpoint).
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import random
import select
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from datetime import datetime, timezone
from pathlib import Path

HERE = Path(__file__).resolve().parent
MiB = 1 << 20
NOBODY = 65534
KINDS = ("user_sessions", "user_pinned", "user_ssd")


def kind(exc: BaseException) -> str:
    """What refused a call: the [limits] key its message names, else its class."""
    msg = str(exc)
    return next((k for k in KINDS if f"[limits] {k}" in msg),
                "connections" if "session-socket connections" in msg else type(exc).__name__)


def write_json(path: Path, data: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


# -- the victim (a training process of root) -----------------------------------------------
def victim(args) -> int:
    import torch
    import transformers

    import fuyou_client

    torch.set_num_threads(1)
    torch.manual_seed(0)
    out = {"steps": [], "losses": [], "errors": []}
    try:
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            n_layer=4, n_embd=256, n_head=4, vocab_size=4096, n_positions=128,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))
        engine = fuyou_client.attach(model, fuyou_client.AdamW(lr=1e-4, weight_decay=0.1), socket=args.socket)
        plan = engine.memory_plan()
        out["plan"] = {k: getattr(plan, k) for k in ("prefetch", "keep", "weight_slots", "slot_bytes", "grad_buffers",
                                                   "grad_bytes", "staging_buffers", "staging_bytes", "host_budget",
                                                   "total")}
        out.update(plan_text=plan.describe(), session_pinned_bytes=engine.session.pinned_bytes,
                   session_budget_bytes=plan.limits.session_budget)
        out["plan"]["shrunk"] = list(plan.shrunk)
        gen = torch.Generator().manual_seed(1000)
        batches = [torch.randint(0, 4096, (4, 128), generator=gen) for _ in range(args.steps)]
        for x in batches:
            t0 = time.perf_counter()
            loss = model(x, labels=x).loss
            loss.backward()
            engine.step()
            engine.zero_grad()
            out["steps"].append(time.perf_counter() - t0)
            out["losses"].append(loss.item().hex())
        engine.close(materialize=False)
    except Exception as exc:  # (reported: the benchmark's point is that there is none)
        out["errors"].append(f"{type(exc).__name__}: {exc}"[:1000])
    write_json(Path(args.out), out)
    return 0


# -- the attacker (uid nobody) -------------------------------------------------------------
def child(socket_path: str, w: int) -> None:
    """A forked child of the forker: connect, say so, call until killed."""
    import fuyou_client

    rng = random.Random(os.getpid())
    try:
        s = fuyou_client.connect(socket_path)
    except Exception as exc:
        os.write(w, b"S" if kind(exc) == "user_sessions" else b"r")
        os._exit(0)
    os.write(w, b"c")
    i = 0
    while True:
        i += 1
        try:
            op = rng.randrange(3)
            if op == 0:
                s.swap_out(f"k{i % 4}", s.allocate(8 * MiB))
            elif op == 1:
                s.reserve(rng.choice((8, 16, 64)) * MiB)
            else:
                s.allocate(rng.choice((1, 8, 16)) * MiB)
        except Exception:
            pass


def forker(args) -> int:
    """Fork a child, let it connect and begin calling, SIGKILL it 0-50 ms later; again.
    Imports fuyou_client once and makes no channel itself, so its children fork clean."""
    import fuyou_client  # noqa: F401

    rng = random.Random(args.seed)
    counts = collections.Counter()
    out, stop = Path(args.out), Path(args.stop)
    assert sys.stdin.readline().strip() == "go"
    last = 0.0
    while not stop.exists():
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            try:
                child(args.socket, w)
            finally:
                os._exit(0)
        os.close(w)
        said = os.read(r, 1) if select.select([r], [], [], 10.0)[0] else b""
        if said == b"c":
            time.sleep(rng.uniform(0, 0.05))
            counts["children_killed_mid_call"] += 1
        elif said == b"S":
            counts["children_refused:user_sessions"] += 1
        else:
            counts[f"children_refused:{'other' if said else 'no answer'}"] += 1
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(r)
        if time.monotonic() - last > 0.5:
            write_json(out, dict(counts))
            last = time.monotonic()
    write_json(out, dict(counts))
    return 0


def attacker(args) -> int:
    import fuyou_client
    from fuyou_client import errors

    work = Path(args.out).parent
    stop, ready = work / "stop", work / "ready"
    counts, messages, lock = collections.Counter(), {}, threading.Lock()

    def note(key: str) -> None:
        with lock:
            counts[key] += 1

    def refused(exc: BaseException) -> None:
        note(f"refused:{kind(exc)}")
        messages.setdefault(kind(exc), str(exc)[:400])

    fork = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--forker", "--socket", args.socket,
                             "--out", str(work / "forker.json"), "--stop", str(stop), "--seed", str(args.seed),
                             "--site", args.site], stdin=subprocess.PIPE, text=True)
    sessions = []
    while len(sessions) < 4096:
        try:
            sessions.append(fuyou_client.connect(args.socket))
        except errors.FuyouClientError as exc:
            refused(exc)
            break
    counts["sessions_admitted"] = len(sessions)
    st = sessions[0].status()
    budget, seg = st.pinned_budget_bytes, st.segment_bytes
    reserved = []
    for s in sessions:
        ask, got = budget, 0
        while ask >= seg and not got:
            try:
                got = s.reserve(ask)
            except errors.FuyouClientError as exc:
                refused(exc)
                ask //= 2
        if not got:
            break
        reserved.append((s, got))
    counts["reserved_bytes"] = sum(g for _, g in reserved)
    slack = 4 * seg  # (room for the forked children's calls within the user's share)
    s0, g0 = max(reserved, key=lambda sg: sg[1])
    s0.reserve(g0 - slack)
    counts["reserved_bytes_flooding"] = counts["reserved_bytes"] - slack
    for s in sessions[-4:]:  # (room for the children's sessions)
        s.close()
    sessions = sessions[:-4]
    done = threading.Event()

    def control(s) -> None:
        while not done.is_set():
            try:
                s.status() if counts["control_requests"] % 4 else s.objects()
                note("control_requests")
            except errors.FuyouClientError as exc:
                refused(exc)

    def data(t: int, s, spare) -> None:
        buf, written, full, i = s.allocate(8 * MiB), [], False, 0
        while not done.is_set():
            i += 1
            name = written[i % len(written)] if full and written else f"t{t}.{i}"
            try:
                s.swap_out(name, buf)
                note("swap_outs")
                if not full:
                    written.append(name)
            except errors.FuyouClientError as exc:
                refused(exc)
                full = True  # (the array or user_ssd: overwrite what was written from now on)
            if i % 10 == 0:
                try:
                    spare.allocate(64 * MiB)
                    note("extra_allocations")
                except errors.FuyouClientError as exc:
                    refused(exc)

    threads = [threading.Thread(target=control, args=(sessions[k],), daemon=True) for k in (2, 3)]
    threads += [threading.Thread(target=data, args=(t, reserved[t % len(reserved)][0], sessions[-1 - t]), daemon=True)
                for t in range(2)]
    for t in threads:
        t.start()
    fork.stdin.write("go\n")
    fork.stdin.flush()
    ready.write_text("ready")
    deadline = time.monotonic() + args.deadline
    while not stop.exists() and time.monotonic() < deadline:
        with lock:
            write_json(Path(args.out), {"counts": dict(counts), "messages": dict(messages)})
        time.sleep(0.5)
    done.set()
    with lock:
        write_json(Path(args.out), {"counts": dict(counts), "messages": dict(messages), "final": True})
    (work / "final").touch()
    if stop.exists():
        time.sleep(3600)  # (the benchmark kills this process group: the attacker dies holding everything)
    stop.touch()  # (past its deadline, no benchmark to stop it: the forker stops too)
    return 0


# -- the benchmark -------------------------------------------------------------------------
def read(path: str, link: bool = False) -> str:
    """A descriptor's kind or a thread's name; "gone" where it ended meanwhile."""
    with contextlib.suppress(OSError):
        text = os.readlink(path) if link else Path(path).read_text().strip()
        return text if not link or text.startswith("anon_inode") else next(
            (k for k in ("socket", "pipe", "memfd") if text.lstrip("/").startswith(k)), "file")
    return "gone"


def snapshot(daemon) -> dict:
    st = daemon.status()
    proc = f"/proc/{daemon.pid}"
    names = collections.Counter(read(f"{proc}/task/{t}/comm") for t in os.listdir(f"{proc}/task"))
    kinds = collections.Counter(read(f"{proc}/fd/{fd}", link=True) for fd in os.listdir(f"{proc}/fd"))
    return {"pinned_used_bytes": st.pinned_used_bytes, "pinned_reserved_bytes": st.pinned_reserved_bytes,
            "threads": sum(names.values()), "descriptors": sum(kinds.values()),  # (iou-wrk: io_uring's, come and go)
            "threads_but_io_uring": sum(n for k, n in names.items() if not k.startswith("iou-wrk")),
            "ssd_used_bytes": sum(d.used_bytes for d in st.devices), "objects": st.objects, "sessions": st.sessions,
            "thread_names": dict(names), "descriptor_kinds": dict(kinds)}


def attacker_python() -> tuple[str, str]:
    """The interpreter uid nobody runs: this one if it may, else (a virtual environment
    whose interpreter lies under a home only root may enter) the system's python of the
    same version with this environment's packages."""
    try:
        subprocess.run([sys.executable, "-c", "import fuyou_client"], user=NOBODY, group=NOBODY, extra_groups=[],
                       cwd="/", check=True, capture_output=True)
        return sys.executable, ""
    except (PermissionError, subprocess.CalledProcessError):
        import sysconfig
        other = shutil.which(f"python{sys.version_info.major}.{sys.version_info.minor}", path="/usr/bin:/usr/local/bin")
        if other is None:
            raise SystemExit(f"uid nobody cannot run {sys.executable} and there is no system python of its version")
        return other, sysconfig.get_paths()["purelib"]


def run_victim(args, daemon, out: Path) -> dict:
    p = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--victim", "--socket", daemon.socket,
                        "--steps", str(args.steps), "--out", str(out)], timeout=900)
    if p.returncode != 0:
        return {"steps": [], "losses": [], "errors": [f"the victim exited {p.returncode}"]}
    return json.loads(out.read_text())


def together(args, daemon, work: Path, r: int) -> tuple[dict, dict]:
    att = work / f"attacker-{r}"
    att.mkdir()
    os.chown(att, NOBODY, NOBODY)
    python, site = args.attacker_python
    cmd = [python, str(Path(__file__).resolve()), "--attacker", "--socket", daemon.socket, "--site", site,
           "--out", str(att / "attacker.json"), "--seed", str(r), "--deadline", str(args.seconds + 900)]
    proc = subprocess.Popen(cmd, user=NOBODY, group=NOBODY, extra_groups=[], process_group=0, cwd="/",
                            stdin=subprocess.DEVNULL)
    try:
        t0 = time.monotonic()
        while not (att / "ready").exists():
            if proc.poll() is not None or time.monotonic() - t0 > 300:
                raise SystemExit(f"the attacker did not ramp up (exit {proc.poll()})")
            time.sleep(0.1)
        ramp = time.monotonic() - t0
        go = time.monotonic()
        v = run_victim(args, daemon, work / f"together-{r}.json")
        time.sleep(max(0.0, args.seconds - (time.monotonic() - go)))
        flood = time.monotonic() - go
        (att / "stop").touch()
        t1 = time.monotonic()
        while not (att / "final").exists() and time.monotonic() - t1 < 15:
            time.sleep(0.1)
        time.sleep(0.6)  # (the forker's last counts)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # the attacker, its forker, its children: mid-call, holding it all
        proc.wait()
    a = json.loads((att / "attacker.json").read_text())
    try:
        a["counts"].update(json.loads((att / "forker.json").read_text()))
    except (OSError, ValueError):
        a["counts"]["forker_counts_missing"] = 1
    a.update(ramp_seconds=ramp, flood_seconds=flood)
    return v, a


def buffers(plan: dict | None) -> dict | None:
    """A plan's shared buffers, less the host arena (what a plan gives up first to fit)."""
    return None if plan is None else {k: v for k, v in plan.items() if k not in ("host_budget", "total", "shrunk")}


def measure(args, daemon, work: Path, r: int, snaps: dict) -> dict:
    alone = run_victim(args, daemon, work / f"alone-{r}.json")
    if r == 0:
        snaps["warm"] = snapshot(daemon)
    tog, att = together(args, daemon, work, r)
    a, t = alone["steps"][1:] or [float("nan")], tog["steps"][1:] or [float("nan")]
    a_med, t_med = statistics.median(a), statistics.median(t)
    return {"alone_step_s": a_med, "together_step_s": t_med, "ratio": t_med / a_med,
            "worst_step_alone_s": max(a), "worst_step_together_s": max(t),
            "losses_bitwise_as_alone": bool(alone["losses"]) and alone["losses"] == tog["losses"],
            "plan_as_alone": alone.get("plan") is not None and alone.get("plan") == tog.get("plan"),
            "buffers_as_alone": alone.get("plan") is not None and buffers(alone["plan"]) == buffers(tog.get("plan")),
            "errors_alone": alone["errors"], "errors_together": tog["errors"],
            "plan_alone": alone.get("plan"), "plan_together": tog.get("plan"), "plan_text": tog.get("plan_text"),
            "session_budget_bytes_alone": alone.get("session_budget_bytes"),
            "session_budget_bytes_together": tog.get("session_budget_bytes"),
            "losses": tog["losses"], "steps_alone_s": alone["steps"], "steps_together_s": tog["steps"],
            "attacker": att}


def settle(daemon, base: dict, timeout: float = 120.0) -> float:
    """Wait until the daemon reclaimed the dead attacker's sessions (and their memory and
    objects); the seconds it took."""
    t0 = time.monotonic()
    keys = ("sessions", "pinned_used_bytes", "pinned_reserved_bytes", "objects", "ssd_used_bytes")
    while time.monotonic() - t0 < timeout:
        s = snapshot(daemon)
        if all(s[k] <= base[k] for k in keys):
            break
        time.sleep(0.2)
    return time.monotonic() - t0


def metrics(daemon) -> dict:
    """The daemon's refusal counters, from its metrics endpoint."""
    text = urllib.request.urlopen(daemon.status().metrics_url, timeout=10).read().decode()
    return {k: float(v) for k, v in (line.rsplit(" ", 1) for line in text.splitlines() if line.startswith(
        ("fuyoud_user_limit_refusals_total{", "fuyoud_session_connections_refused_total{")))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=20.0, help="the least the attacker floods per together-run")
    ap.add_argument("--dir", type=Path, help="parent of the run's directory (default: the temporary directory)")
    for flag in ("--victim", "--attacker", "--forker"):
        ap.add_argument(flag, action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--socket", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--stop", help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--deadline", type=float, default=900.0, help=argparse.SUPPRESS)
    ap.add_argument("--site", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.site:  # (an interpreter outside the project's virtual environment: its packages)
        import site
        site.addsitedir(args.site)
    for flag, fn in (("victim", victim), ("attacker", attacker), ("forker", forker)):
        if getattr(args, flag):
            return fn(args)
    if os.geteuid() != 0:
        raise SystemExit("bench/hostile.py runs as root: the attacker is uid nobody, another user")
    sys.path.insert(0, str(HERE))
    import fuyou_client
    from common import host_info

    args.attacker_python = attacker_python()

    root = Path(tempfile.mkdtemp(prefix="fy-hostile-", dir=args.dir))
    os.chmod(root, 0o755)  # (the attacker, uid nobody, reaches the sockets and its own directory)
    (root / "run").mkdir(mode=0o755)
    (root / "work").mkdir(mode=0o755)
    daemon = fuyou_client.start_daemon(root / "state", config={
        "daemon": {"runtime_dir": str(root / "run"), "allow_uids": [NOBODY, 64299], "socket_group": "nogroup"},
        "memory": {"pinned_budget": "1GiB", "segment_size": "8MiB"},
        "storage": {"data_dirs": [str(root / "d0"), str(root / "d1")], "capacity_per_device": "1GiB"},
        "metrics": {"listen": "127.0.0.1:0"}})
    t_start = time.monotonic()
    try:
        snaps = {"before": snapshot(daemon)}
        rounds = []
        for r in range(args.rounds):
            got = measure(args, daemon, root / "work", r, snaps)
            got["reclaim_seconds"] = settle(daemon, snaps["before"])
            snaps[f"after_round_{r}"] = snapshot(daemon)  # (round 0's: every worker pool started)
            rounds.append(got)
            print(f"round {r}: victim {got['alone_step_s']:.3f} s alone, {got['together_step_s']:.3f} s together "
                  f"(ratio {got['ratio']:.2f}, fair share <= 2); losses bitwise {got['losses_bitwise_as_alone']}; "
                  f"errors {got['errors_together']}; attacker {got['attacker']['counts']}", flush=True)
        snaps["after"] = snapshot(daemon)
        back = {k: snaps["after"][k] <= v for k, v in snaps["before"].items() if not k.endswith(("names", "kinds"))}
        back_warm = {f"{k}_{w}": snaps["after"][k] <= snaps[w][k] for w in ("warm", "after_round_0")
                     for k in ("threads", "threads_but_io_uring", "descriptors")}
        refusals = sum((collections.Counter({k: v for k, v in r["attacker"]["counts"].items() if "refused" in k})
                        for r in rounds), collections.Counter())

        med = lambda key: statistics.median(r[key] for r in rounds)  # noqa: E731
        summary = {"alone_step_s": med("alone_step_s"), "together_step_s": med("together_step_s"),
                   "ratio": med("ratio"), "fair_share_ratio": 2, "within_fair_share": med("ratio") <= 2,
                   "worst_step_together_s": max(r["worst_step_together_s"] for r in rounds),
                   "losses_bitwise_as_alone": all(r["losses_bitwise_as_alone"] for r in rounds),
                   "losses_same_every_round": len({tuple(r["losses"]) for r in rounds}) == 1,
                   "plan_as_alone": all(r["plan_as_alone"] for r in rounds),
                   "buffers_as_alone": all(r["buffers_as_alone"] for r in rounds),
                   "victim_errors": [e for r in rounds for e in r["errors_alone"] + r["errors_together"]],
                   "attacker_refusals": dict(refusals),
                   "attacker_refused_by": sorted({k.split(":", 1)[1] for k in refusals if k.split(":", 1)[1] in KINDS}),
                   "reclaim_seconds_max": max(r["reclaim_seconds"] for r in rounds),
                   "resources": snaps, "resources_back": back, "threads_descriptors_back_to": back_warm}
        result = {
            "command": "python bench/hostile.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "host": host_info(root),
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "args": {k: getattr(args, k) for k in ("rounds", "steps", "seconds")},
            "attacker_python": {"interpreter": args.attacker_python[0], "site": args.attacker_python[1]},
            "config": {"pinned_budget": "1GiB", "segment_size": "8MiB", "data_files": "2 x 1GiB",
                       "allow_uids": [NOBODY, 64299], "limits": "defaults (auto: 75%, 64 sessions)"},
            "summary": summary, "metrics": metrics(daemon), "rounds": rounds,
        }
        result["wall_seconds"] = time.monotonic() - t_start
        print(json.dumps({k: v for k, v in summary.items() if k != "resources"}, indent=1))
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(result, indent=1) + "\n")
    finally:
        daemon.stop()
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
