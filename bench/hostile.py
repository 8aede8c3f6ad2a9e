"""A hostile tenant beside a training job on one fuyoud: does the job keep its share?

    python bench/hostile.py [--json PATH] [--rounds 2] [--steps 8] [--seconds 20] [--dir DIR]

One private fuyoud on a shared host (``allow_uids``: two users besides root, so [limits]
"auto": one user may hold 75% of the pinned budget and of the array, and 64 sessions), a
1 GiB pinned budget in 8 MiB segments, two 1 GiB data files, sockets of group nogroup.

The victim, root's training process: a ``GPT2LMHeadModel`` (4 layers, width 256, vocabulary
4096, no dropout, one torch thread), ``attach`` with the defaults (its memory plan reserved
in the daemon), ``--steps`` steps; it records step times, losses, plan and errors.

The attacker, uid ``nobody`` (a process group of its own, SIGKILLed at the end: it dies
holding everything), opens sessions until refused, has them reserve all they may (asking
the budget, halved on each refusal), gives 32 MiB back for its children, then floods:
Status and ListObjects from two threads; two threads that swap 8 MiB out under new names
until refused (the array or ``user_ssd``), then overwrite them, and ask for 64 MiB more
now and then; a forked child at a time that connects, calls Allocate, SwapOut and Reserve
in a loop and is SIGKILLed 0-50 ms after its first call began; all counted.

Each of ``--rounds`` rounds runs the victim alone, then together: the victim attaches (its
plan reserved), the attacker ramps up (at most 75% of the budget and what the victim's plan
left), then the victim runs its steps; the attacker floods ``--seconds`` at least. A plan
admitted is a plan held: the victim's plan together is its plan alone and nothing it planned
is refused. Reported: the victim's median step alone and together (the first left out),
their ratio (two users: a fair share is <= 2), its worst step, whether losses and plan are
those alone, its errors; what the attacker got (sessions, pinned memory reserved, SSD bytes
at the flood's end) and its refusals by limit ("pinned_budget": none left). First a warm-up
starts the pools the daemon grows once and keeps (32 threads of root call Status, Allocate,
SwapOut, SwapIn, StepGroup for 2 s: gRPC's 16 workers, each with an io_uring ring and an
OpenMP pool whose threads are named "grpc" too); then the daemon's memory, SSD bytes,
objects, sessions, threads by name (iou-wrk-*, io_uring's transient workers, only counted)
and descriptors by kind before the rounds and after each (``above_before``: each name or
kind above its count before); its refusal counters (metrics endpoint).
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import importlib
import itertools
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
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path

SELF = str(Path(__file__).resolve())
MiB = 1 << 20
NOBODY = 65534
BUDGET, ARRAY = 1 << 30, 2 << 30  # (the daemon's pinned budget; its two data files)
KINDS = ("user_sessions", "user_pinned", "user_ssd")
PLAN = ("prefetch", "keep", "weight_slots", "slot_bytes", "grad_buffers", "grad_bytes", "staging_buffers",
        "staging_bytes", "host_budget", "total")
HELD = ("pinned_used_bytes", "pinned_reserved_bytes", "ssd_used_bytes", "objects", "sessions")


def kind(exc: BaseException) -> str:
    """What refused a call: the [limits] key its message names, the pinned budget, else its class."""
    msg = str(exc)
    return next((k for k in KINDS if f"[limits] {k}" in msg), "pinned_budget" if "pinned-memory budget" in msg else
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
        out["plan"] = {k: getattr(plan, k) for k in PLAN} | {"shrunk": list(plan.shrunk)}
        out.update(plan_text=plan.describe(), session_budget_bytes=plan.limits.session_budget,
                   reserved_bytes=plan.limits.held + plan.total)
        if args.attached:  # (together: its plan held in the daemon, it waits until the attacker ramped up)
            Path(args.attached).write_text("attached")
            while not Path(args.go).exists():  # (the benchmark kills it if the attacker does not ramp up)
                time.sleep(0.05)
        gen = torch.Generator().manual_seed(1000)
        for x in [torch.randint(0, 4096, (4, 128), generator=gen) for _ in range(args.steps)]:
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
    for i in itertools.count():
        with contextlib.suppress(Exception):
            (lambda: s.swap_out(f"k{i % 4}", s.allocate(8 * MiB)), lambda: s.reserve(rng.choice((8, 16, 64)) * MiB),
             lambda: s.allocate(rng.choice((1, 8, 16)) * MiB))[rng.randrange(3)]()


def become_nobody() -> None:
    """Import what the attacker's calls will need, then drop from root to uid nobody (the
    checkout and its environment may lie where nobody cannot read: a private clone)."""
    import fuyou_client  # noqa: F401
    for name in ("grpc._channel", "grpc._interceptor", "concurrent.futures.thread", "encodings.idna",
                 "fuyou_client.connection.session", "fuyou_client.errors"):
        importlib.import_module(name)
    os.setgroups([]), os.setgid(NOBODY), os.setuid(NOBODY), os.chdir("/")


def forker(args) -> int:
    """Fork a child, let it connect and begin calling, SIGKILL it 0-50 ms later; again.
    Imports fuyou_client once and makes no channel itself, so its children fork clean."""
    become_nobody()
    rng, counts, out, stop = random.Random(args.seed), collections.Counter(), Path(args.out), Path(args.stop)
    assert sys.stdin.readline().strip() == "go"
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
        counts[{b"c": "children_killed_mid_call", b"S": "children_refused:user_sessions",
                b"": "children_refused:no answer"}.get(said, "children_refused:other")] += 1
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(r)
        write_json(out, dict(counts))
    return 0


def attacker(args) -> int:
    fork = subprocess.Popen([sys.executable, SELF, "--forker", "--socket", args.socket,  # (as root: it drops itself)
                             "--out", str(Path(args.out).parent / "forker.json"), "--stop",
                             str(Path(args.out).parent / "stop"), "--seed", str(args.seed)], stdin=subprocess.PIPE,
                            text=True)
    become_nobody()
    import fuyou_client
    from fuyou_client import errors

    work = Path(args.out).parent
    stop, counts, messages, lock, done = work / "stop", collections.Counter(), {}, threading.Lock(), threading.Event()

    def note(key: str) -> None:
        with lock:
            counts[key] += 1

    def refused(exc: BaseException) -> None:
        note(f"refused:{kind(exc)}")
        messages.setdefault(kind(exc), str(exc)[:400])

    def attempt(call, key: str) -> bool:
        """``call()``, counted under ``key``, or its refusal by what refused it; whether it went."""
        try:
            call()
        except errors.FuyouClientError as exc:
            refused(exc)
            return False
        note(key)
        return True

    sessions, reserved = [], []
    while len(sessions) < 4096 and attempt(lambda: sessions.append(fuyou_client.connect(args.socket)),
                                           "sessions_admitted"):
        pass
    st = sessions[0].status()
    budget, seg = st.pinned_budget_bytes, st.segment_bytes
    for s in sessions:
        ask = budget
        while ask >= seg and not attempt(lambda: reserved.append((s, s.reserve(ask))), "reservations"):
            ask //= 2
        if ask < seg:
            break
    counts["reserved_bytes"] = sum(g for _, g in reserved)
    slack = 4 * seg  # (room for the forked children's calls within the user's share)
    s0, g0 = max(reserved, key=lambda sg: sg[1])
    s0.reserve(g0 - slack)
    counts["reserved_bytes_flooding"] = counts["reserved_bytes"] - slack
    for s in sessions[-4:]:  # (room for the children's sessions)
        s.close()
    del sessions[-4:]

    def control(s) -> None:
        while not done.is_set():
            attempt(s.status if counts["control_requests"] % 4 else s.objects, "control_requests")

    def data(t: int, s, spare) -> None:
        buf, written, full, i = s.allocate(8 * MiB), [], False, 0
        while not done.is_set():
            i += 1
            name = written[i % len(written)] if full and written else f"t{t}.{i}"
            if not attempt(lambda: s.swap_out(name, buf), "swap_outs"):
                full = True  # (the array or user_ssd: overwrite what was written from now on)
            elif not full:
                written.append(name)
            if i % 10 == 0:
                attempt(lambda: spare.allocate(64 * MiB), "extra_allocations")

    for target, a in [(control, (sessions[2],)), (control, (sessions[3],))] + [
            (data, (t, reserved[t % len(reserved)][0], sessions[-1 - t])) for t in range(2)]:
        threading.Thread(target=target, args=a, daemon=True).start()
    print("go", file=fork.stdin, flush=True)
    (work / "ready").write_text("ready")
    deadline = time.monotonic() + args.deadline
    while not done.is_set():
        if stop.exists() or time.monotonic() > deadline:
            done.set()
        with lock:
            write_json(Path(args.out), {"counts": dict(counts), "messages": dict(messages), "final": done.is_set()})
        done.wait(0.5)
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
    """The daemon's memory, SSD bytes, objects, sessions, threads by name, descriptors by kind."""
    st, proc = daemon.status(), f"/proc/{daemon.pid}"
    names = collections.Counter(read(f"{proc}/task/{t}/comm") for t in os.listdir(f"{proc}/task"))
    kinds, t0 = None, time.monotonic()
    while True:  # (the connection of the Status call just made closes on the daemon's side meanwhile: settled)
        time.sleep(0.2)
        now = collections.Counter(read(f"{proc}/fd/{fd}", link=True) for fd in os.listdir(f"{proc}/fd"))
        if now == kinds or time.monotonic() - t0 > 3:
            break
        kinds = now
    return {"pinned_used_bytes": st.pinned_used_bytes, "pinned_reserved_bytes": st.pinned_reserved_bytes,
            "ssd_used_bytes": sum(d.used_bytes for d in st.devices), "objects": st.objects, "sessions": st.sessions,
            "threads": {k: n for k, n in sorted(names.items()) if not k.startswith(("iou-wrk", "gone"))},
            "io_uring_workers": sum(n for k, n in names.items() if k.startswith("iou-wrk")),
            "descriptors": {k: n for k, n in sorted(kinds.items()) if k != "gone"}}


def above(after: dict, before: dict) -> dict:
    """Each thread name and descriptor kind ``after`` holds more of than ``before``: [before, after]."""
    return {f"{part}:{k}": [before[part].get(k, 0), n] for part in ("threads", "descriptors")
            for k, n in after[part].items() if n > before[part].get(k, 0)}


def warm_up(daemon, threads: int = 32, sessions: int = 4, seconds: float = 2.0) -> None:
    """Start the pools the daemon grows once and keeps (see the module's doc): ``threads``
    threads call at once for ``seconds`` through ``sessions`` sessions, which then end."""
    import fuyou_client

    conns, end = [fuyou_client.connect(daemon.socket) for _ in range(sessions)], time.monotonic() + seconds

    def work(t: int) -> None:
        s = conns[t % sessions]
        buf = s.allocate(MiB)
        s.create_group(f"warm{t}", buf, fuyou_client.AdamW(lr=1e-4))
        while time.monotonic() < end:  # (gRPC's workers, their io_uring rings, their OpenMP pools)
            s.status(), s.swap_out(f"warm{t}", buf), s.swap_in(f"warm{t}", buf), s.step_group(f"warm{t}", buf, 1e-4)
        s.delete(f"optim/warm{t}", missing_ok=True)

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(work, range(threads)))
    for s in conns:
        s.close()


def start_victim(args, daemon, out: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, SELF, "--victim", "--socket", daemon.socket,
                             "--steps", str(args.steps), "--out", str(out), *extra])


def victim_result(p: subprocess.Popen, out: Path) -> dict:
    if p.wait(timeout=900) != 0:
        return {"steps": [], "losses": [], "errors": [f"the victim exited {p.returncode}"]}
    return json.loads(out.read_text())


def wait_for(path: Path, proc: subprocess.Popen, what: str, timeout: float = 300.0) -> float:
    """Seconds until ``path`` exists; SystemExit(``what``) if ``proc`` ends or ``timeout`` passes first."""
    t0 = time.monotonic()
    while not path.exists():
        if proc.poll() is not None or time.monotonic() - t0 > timeout:
            raise SystemExit(f"{what} (exit {proc.poll()})")
        time.sleep(0.05)
    return time.monotonic() - t0


def together(args, daemon, work: Path, r: int) -> tuple[dict, dict]:
    """The victim attaches (its plan reserved), the attacker ramps up, then the victim's steps."""
    att, out = work / f"attacker-{r}", work / f"together-{r}.json"
    att.mkdir()
    os.chown(att, NOBODY, NOBODY)
    vic = start_victim(args, daemon, out, "--attached", str(work / f"attached-{r}"), "--go", str(att / "ready"))
    proc = None
    try:
        wait_for(work / f"attached-{r}", vic, "the victim did not attach")
        proc = subprocess.Popen([sys.executable, SELF, "--attacker", "--socket", daemon.socket,  # (it drops itself)
                                 "--out", str(att / "attacker.json"), "--seed", str(r),
                                 "--deadline", str(int(args.seconds) + 900)], process_group=0, cwd="/",
                                stdin=subprocess.DEVNULL)
        ramp, go = wait_for(att / "ready", proc, "the attacker did not ramp up"), time.monotonic()
        v = victim_result(vic, out)
        time.sleep(max(0.0, args.seconds - (time.monotonic() - go)))
        flood, held = time.monotonic() - go, snapshot(daemon)  # (the victim gone: what the attacker holds)
        (att / "stop").touch()
        with contextlib.suppress(SystemExit):
            wait_for(att / "final", proc, "", timeout=15)
        time.sleep(0.6)  # (the forker's last counts)
    finally:
        vic.kill()  # (only a victim left waiting: it ended otherwise)
        vic.wait()
        with contextlib.suppress(ProcessLookupError, AttributeError):
            os.killpg(proc.pid, signal.SIGKILL)  # the attacker, its forker, its children: mid-call, holding it all
            proc.wait()
    a = json.loads((att / "attacker.json").read_text())
    try:
        a["counts"].update(json.loads((att / "forker.json").read_text()))
    except (OSError, ValueError):
        a["counts"]["forker_counts_missing"] = 1
    a.update(ramp_seconds=ramp, flood_seconds=flood, got={
        "sessions": a["counts"]["sessions_admitted"], "pinned_reserved_bytes": a["counts"]["reserved_bytes"],
        "ssd_used_bytes": held["ssd_used_bytes"], "sessions_at_flood_end": held["sessions"],
        "pinned_reserved_bytes_at_flood_end": held["pinned_reserved_bytes"]})
    return v, a


def measure(args, daemon, work: Path, r: int) -> dict:
    alone = victim_result(start_victim(args, daemon, work / f"alone-{r}.json"), work / f"alone-{r}.json")
    tog, att = together(args, daemon, work, r)
    a, t = alone["steps"][1:] or [float("nan")], tog["steps"][1:] or [float("nan")]
    a_med, t_med = statistics.median(a), statistics.median(t)
    return {"alone_step_s": a_med, "together_step_s": t_med, "ratio": t_med / a_med,
            "worst_step_alone_s": max(a), "worst_step_together_s": max(t),
            "losses_bitwise_as_alone": bool(alone["losses"]) and alone["losses"] == tog["losses"],
            "plan_as_alone": alone.get("plan") is not None and alone.get("plan") == tog.get("plan"),
            **{f"{k}_{w}": v.get(k) for w, v in (("alone", alone), ("together", tog))
               for k in ("plan", "reserved_bytes", "session_budget_bytes", "errors", "steps")},
            "plan_text": tog.get("plan_text"), "losses": tog["losses"], "attacker": att}


def settle(daemon, base: dict, timeout: float = 120.0, grace: float = 10.0) -> float:
    """Seconds until the daemon reclaimed the dead attacker's sessions (their memory and
    objects) and, up to ``grace`` seconds more, their threads and descriptors ended."""
    t0, back = time.monotonic(), 0.0
    while time.monotonic() - t0 < timeout:
        s = snapshot(daemon)
        if all(s[k] <= base[k] for k in HELD):
            back = back or time.monotonic()
            if not above(s, base) or time.monotonic() - back > grace:
                break
        time.sleep(0.2)
    return time.monotonic() - t0


def metrics(daemon) -> dict:
    """The daemon's refusal counters, from its metrics endpoint."""
    text = urllib.request.urlopen(daemon.status().metrics_url, timeout=10).read().decode()
    return {k: float(v) for k, v in (line.rsplit(" ", 1) for line in text.splitlines() if line.startswith(
        ("fuyoud_user_limit_refusals_total{", "fuyoud_session_connections_refused_total{")))}


def summarize(rounds: list[dict], snaps: dict) -> dict:
    """Medians and totals over the rounds; what the attacker got at most; resources."""
    refusals = sum((collections.Counter({k: v for k, v in r["attacker"]["counts"].items() if "refused" in k})
                    for r in rounds), collections.Counter())
    got = {k: max(r["attacker"]["got"][k] for r in rounds) for k in rounds[0]["attacker"]["got"]}
    got.update(pinned_share_of_budget=got["pinned_reserved_bytes"] / BUDGET,
               ssd_share_of_array=got["ssd_used_bytes"] / ARRAY)
    med = lambda key: statistics.median(r[key] for r in rounds)  # noqa: E731
    return {"alone_step_s": med("alone_step_s"), "together_step_s": med("together_step_s"),
            "ratio": med("ratio"), "fair_share_ratio": 2, "within_fair_share": med("ratio") <= 2,
            "worst_step_together_s": max(r["worst_step_together_s"] for r in rounds),
            "losses_bitwise_as_alone": all(r["losses_bitwise_as_alone"] for r in rounds),
            "losses_same_every_round": len({tuple(r["losses"]) for r in rounds}) == 1,
            "plan_as_alone": all(r["plan_as_alone"] for r in rounds),
            "victim_reserved_bytes": max(r["reserved_bytes_together"] or 0 for r in rounds),
            "victim_errors": [e for r in rounds for e in r["errors_alone"] + r["errors_together"]],
            "attacker_got": got, "attacker_refusals": dict(refusals),
            "attacker_refused_by": sorted({k.split(":", 1)[1] for k in refusals} & {*KINDS, "pinned_budget"}),
            "reclaim_seconds_max": max(r["reclaim_seconds"] for r in rounds), "resources": snaps,
            "resources_back": {k: snaps["after"][k] == snaps["before"][k] for k in HELD},
            "above_before": above(snaps["after"], snaps["before"])}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path)
    ap.add_argument("--dir", type=Path, help="parent of the run's directory (default: the temporary directory)")
    ap.add_argument("--seconds", type=float, default=20.0, help="the least the attacker floods per together-run")
    for opt, default in (("--rounds", 2), ("--steps", 8), ("--seed", 0), ("--deadline", 900)):
        ap.add_argument(opt, type=int, default=default, help=argparse.SUPPRESS if opt in ("--seed", "--deadline")
                        else None)
    for flag in ("--victim", "--attacker", "--forker"):
        ap.add_argument(flag, action="store_true", help=argparse.SUPPRESS)
    for opt in ("--socket", "--out", "--stop", "--attached", "--go"):
        ap.add_argument(opt, default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    for flag, fn in (("victim", victim), ("attacker", attacker), ("forker", forker)):
        if getattr(args, flag):
            return fn(args)
    if os.geteuid() != 0:
        raise SystemExit("bench/hostile.py runs as root: the attacker is uid nobody, another user")
    sys.path.insert(0, str(Path(SELF).parent))
    import fuyou_client
    from common import host_info, write_result

    root = Path(tempfile.mkdtemp(prefix="fy-hostile-", dir=args.dir))
    os.chmod(root, 0o755)  # (the attacker, uid nobody, reaches the sockets and its own directory)
    for sub in ("run", "work"):
        (root / sub).mkdir(mode=0o755)
    daemon = fuyou_client.start_daemon(root / "state", config={
        "daemon": {"runtime_dir": str(root / "run"), "allow_uids": [NOBODY, 64299], "socket_group": "nogroup"},
        "memory": {"pinned_budget": "1GiB", "segment_size": "8MiB"},
        "storage": {"data_dirs": [str(root / "d0"), str(root / "d1")], "capacity_per_device": "1GiB"},
        "metrics": {"listen": "127.0.0.1:0"}})
    t_start = time.monotonic()
    try:
        snaps, rounds = {"cold": snapshot(daemon)}, []
        warm_up(daemon)
        settle(daemon, snaps["cold"], grace=2.0)
        snaps["before"] = snapshot(daemon)
        for r in range(args.rounds):
            rounds.append(measure(args, daemon, root / "work", r))
            rounds[-1]["reclaim_seconds"] = settle(daemon, snaps["before"])
            snaps[f"after_round_{r}"] = snapshot(daemon)
            print(f"round {r}:", {k: rounds[-1][k] for k in ("alone_step_s", "together_step_s", "ratio",
                                                           "plan_as_alone", "losses_bitwise_as_alone")}, flush=True)
        snaps["after"] = snapshot(daemon)
        summary = summarize(rounds, snaps)
        result = {"command": "python bench/hostile.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                  "host": host_info(root), "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                  "args": {k: getattr(args, k) for k in ("rounds", "steps", "seconds")},
                  "config": {"pinned_budget": "1GiB", "segment_size": "8MiB", "data_files": "2 x 1GiB",
                             "allow_uids": [NOBODY, 64299], "limits": "defaults (auto: 75%, 64 sessions)"},
                  "summary": summary, "metrics": metrics(daemon), "rounds": rounds,
                  "wall_seconds": time.monotonic() - t_start}
        print(json.dumps({k: v for k, v in summary.items() if k != "resources"}, indent=1))
        write_result(args.json, result)
    finally:
        daemon.stop()
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
