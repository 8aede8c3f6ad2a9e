"""The parts of bench/soak.py that run it: fuyoud restarted as systemd would (``Daemon``),
the training jobs (``Job``, each life a bench/soak_job.py process), and ``Run``: the jobs on
one daemon to their end, tending them (a job that dies is started again; a daemon that dies
on its own too, counted as unexpected) and, with a random generator, injecting the faults
one after another (``inject``: what each kind does, bench/soak.py's docstring lists them).
A death is put down to the last fault that struck before it, if it came before that fault
was over (every job it stopped training again) or within a few seconds after; else it is
unexpected."""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from soak_job import checkpoints, read_events  # noqa: E402

import fuyou_client  # noqa: E402
from fuyou_proto import ADMIN_METADATA_KEY, pb, rpc  # noqa: E402

KINDS = ("trainer_sigkill", "trainer_sigkill_in_checkpoint", "daemon_sigkill", "daemon_sigterm",
         "daemon_kill_in_checkpoint", "write_eio", "read_eio", "disk_full", "damaged_checkpoint")
# The jobs: each a different way of training (optimizer, state dtype, offload, accumulation, clipping).
# ``pace``: its steps are --steps times this, so that the jobs take about as long (alone on this
# machine a step took 46, 41, 13 and 128 ms).
JOBS = [
    dict(width=128, depth=4, optimizer="adamw", state_dtype="fp32", offload=True, accumulation=1, clip=None, pace=1),
    dict(width=96, depth=6, optimizer="adamw", state_dtype="bf16", offload=True, accumulation=1, clip=1.0, pace=1),
    dict(width=128, depth=3, optimizer="sgd", state_dtype="fp32", offload=False, accumulation=2, clip=None, pace=3),
    dict(width=64, depth=8, optimizer="adamw", state_dtype="int8", offload=True, accumulation=1, clip=None,
         pace=0.4),
]
MiB = 1 << 20
PINNED_MIB = 512
CONFIG = {  # small buffers, two data directories (the array stripes over both), data files that grow
    "storage": {"stripe_size": "1MiB"},
    "memory": {"pinned_budget": f"{PINNED_MIB}MiB", "segment_size": "8MiB", "staging_size": "4MiB"},
    "io": {"chunk_size": "256KiB", "queue_depth": 16, "threads": 4},
    "optimizer": {"buffer_budget": "48MiB", "buffers": 6},
}
CHECKPOINT_PAUSE_S = 0.25  # (fault runs: the daemon pauses this long inside every checkpoint)
SETTLE_S = 5.0  # (a failed transfer can reach its job a few seconds after the fault is over)



@dataclass
class Fault:
    kind: str
    at: float  # seconds since the run began
    t_wall: float = 0.0  # when it struck (time.time(), the clock of the jobs' events)
    t_end: float | None = None  # when every job it stopped was training again
    target: str = ""  # a job's name, or "daemon"
    detail: dict = field(default_factory=dict)
    fired: bool = True
    stopped: list = field(default_factory=list)  # jobs whose process died of it
    errors: list = field(default_factory=list)  # (job, error type, message) the jobs saw
    recovery_s: float | None = None


def daemon_config(jobs: int) -> dict:
    """CONFIG, each of ``jobs`` jobs given its part of the pinned budget, as an operator
    sharing a daemon among N jobs sets it: a job's memory plan is held from its attach, so
    the first jobs' default plans would leave the last too little (refused at attach until
    one ends)."""
    out = {k: dict(v) for k, v in CONFIG.items()}
    out["memory"]["session_budget"] = f"{PINNED_MIB // max(1, jobs)}MiB"
    return out


class Daemon:
    """fuyoud under the soak, restarted as systemd would: same state, same config."""

    def __init__(self, root: Path, env: dict | None, jobs: int):
        self.root, self.env, self.proc, self.jobs = root, env, None, jobs
        self.restarts: list[dict] = []

    def start(self) -> float:
        if self.proc is not None:
            self.proc.stop()  # (exited: closes its log)
        t0 = time.monotonic()
        self.proc = fuyou_client.start_daemon(self.root / "state", config=self.config(), env=self.env)
        return time.monotonic() - t0

    def config(self) -> dict:
        out = daemon_config(self.jobs)
        out["storage"]["data_dirs"] = [str(self.root / "ssd0"), str(self.root / "ssd1")]
        return out

    @property
    def socket(self) -> str:
        return self.proc.socket

    def alive(self) -> bool:
        return self.proc is not None and self.proc.process.poll() is None

    def signal(self, sig: int) -> None:
        self.proc.process.send_signal(sig)

    def wait(self, timeout: float = 120) -> int:
        return self.proc.process.wait(timeout)

    def log(self) -> str:
        return (self.root / "state" / "fuyoud.log").read_text(errors="replace")

    def usage(self) -> dict:
        """The array's used bytes, its data files' sizes, and what the namespaces hold."""
        st = self.proc.status()
        token = (Path(self.socket).parent / "admin.token").read_text().strip()
        with grpc.insecure_channel(f"unix:{self.socket}") as ch:
            names = rpc.FuyouAdminStub(ch).ListNamespaces(pb.Empty(), metadata=((ADMIN_METADATA_KEY, token),),
                                                          timeout=10).namespaces
        files = [p for d in ("ssd0", "ssd1") for p in (self.root / d).glob("*") if p.is_file()]
        used = sum(d.used_bytes for d in st.devices)
        # What no object or snapshot holds: extents leaked. (A snapshot's extents shared with
        # the state count in both, so the sum is an upper bound of what is referenced.)
        referenced = sum(n.bytes + n.snapshot_bytes for n in names)
        return {"used_bytes": used, "unreferenced_bytes": max(0, used - referenced),
                "data_file_bytes": sum(p.stat().st_size for p in files),
                "data_file_allocated_bytes": sum(p.stat().st_blocks * 512 for p in files),
                "namespaces": {n.name: {"bytes": n.bytes, "snapshot_bytes": n.snapshot_bytes,
                                        "checkpoints": n.checkpoints} for n in names}}

    def stop(self) -> int:
        return self.proc.stop() if self.proc is not None else 0


class Job:
    def __init__(self, name: str, spec: dict, root: Path):
        self.name, self.dir = name, root / name
        self.dir.mkdir(parents=True)
        self.spec = dict(spec, name=name, dir=str(self.dir))
        self.proc: subprocess.Popen | None = None
        self.exits: list[tuple[float, int]] = []
        self.done = False

    def start(self, socket: str) -> None:
        self.spec["socket"] = socket
        out = open(self.dir / "output.log", "ab")
        self.proc = subprocess.Popen([sys.executable, str(HERE / "soak_job.py"), json.dumps(self.spec)],
                                     stdout=out, stderr=subprocess.STDOUT,
                                     env=dict(os.environ, OMP_NUM_THREADS="1"))
        out.close()

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def events(self) -> list[dict]:
        return read_events(self.dir / "events.jsonl")

    def kill(self) -> None:
        if self.running():
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()


class Run:
    """The jobs on one daemon, to the end; with ``rng``, faults while they train."""

    def __init__(self, root: Path, specs: list[dict], rng: random.Random | None, faults: int, restart_s: float,
                 deadline: float):
        self.root, self.rng, self.faults_wanted, self.restart_s = root, rng, faults, restart_s
        self.deadline = deadline
        root.mkdir(parents=True, exist_ok=True)
        self.fault_file = root / "faults.json"
        env = None
        if rng is not None:
            env = dict(os.environ, FUYOUD_IO_FAULTS=str(self.fault_file),
                       FUYOUD_FAILPOINTS=f"checkpoint.linked=sleep({CHECKPOINT_PAUSE_S}),"
                                         f"checkpoint.copied=sleep({CHECKPOINT_PAUSE_S})")
        self.daemon = Daemon(root, env, len(specs))
        self.jobs = [Job(f"job{i}", spec, root) for i, spec in enumerate(specs)]
        self.faults: list[Fault] = []
        self.t0 = time.monotonic()
        self.unexpected: list[str] = []  # deaths no fault explains
        self.usage_after_restart: list[dict] = []
        self.timeline: list[tuple[float, str]] = []

    # -- the daemon's life -------------------------------------------------------------
    def now(self) -> float:
        return time.monotonic() - self.t0

    def restart_daemon(self, why: str) -> None:
        """Wait for the daemon to be gone, then start it again (after ``restart_s``, as
        systemd's RestartSec); sample the array before any job reconnects."""
        code = self.daemon.wait()
        time.sleep(self.restart_s)
        ready_s = self.daemon.start()
        self.note(f"fuyoud started again ({why}; it exited {code}), ready in {ready_s:.2f} s")
        usage = self.daemon.usage()
        self.usage_after_restart.append({"at": self.now(), "why": why, "exit_code": code, "ready_s": ready_s,
                                         **usage})

    def arm(self, faults: list[dict]) -> None:
        tmp = self.fault_file.with_suffix(".tmp")
        tmp.write_text(json.dumps({"faults": faults}))
        os.replace(tmp, self.fault_file)

    def injected(self) -> int:
        return self.daemon.log().count("fault injected:")

    # -- the jobs -----------------------------------------------------------------------
    def tend(self) -> None:
        """One look at everything: restart a daemon that died on its own, restart jobs that
        ended without finishing (each death put down to a fault: ``blame``)."""
        if not self.daemon.alive():
            code = self.daemon.proc.process.poll()
            self.unexpected.append(f"{self.now():.1f}s: fuyoud exited ({code}) on its own; log tail: "
                                   f"{self.daemon.log()[-1500:]}")
            self.restart_daemon("exited on its own")
        for job in self.jobs:
            if job.done or job.running() or job.proc is None:
                continue
            code = job.proc.returncode
            job.exits.append((self.now(), code))
            events = job.events()
            life = max((e["life"] for e in events if e["event"] == "start"), default=None)
            last = [e for e in events if e["event"] in ("failed", "done") and e["life"] == life]
            if code == 0 and last and last[-1]["event"] == "done":
                job.done = True
                continue
            failure = last[-1] if last and last[-1]["event"] == "failed" else {
                "error": "SIGKILL" if code == -signal.SIGKILL else f"exit {code}", "message": "", "t": time.time()}
            fault = self.blame(failure["t"])
            if fault is not None:
                if job.name not in fault.stopped:
                    fault.stopped.append(job.name)
                fault.errors.append((job.name, failure["error"], failure["message"][:300]))
            else:
                self.unexpected.append(f"{self.now():.1f}s: {job.name} ended, {failure['error']}: "
                                       f"{failure['message'][:300]}")
            time.sleep(0.2)  # (a scheduler's pause before it starts the job again)
            job.start(self.daemon.socket)

    def strike(self, fault: Fault) -> None:
        """The moment ``fault`` strikes: recorded, and deaths from now on may be its."""
        fault.t_wall = time.time()
        self.faults.append(fault)

    def blame(self, t: float) -> Fault | None:
        """The fault a death at ``t`` (time.time()) is put down to: the last that struck
        before it, unless it was over more than SETTLE_S before."""
        struck = [f for f in self.faults if f.t_wall <= t]
        if not struck:
            return None
        fault = struck[-1]
        return fault if fault.t_end is None or t <= fault.t_end + SETTLE_S else None

    def back_at(self, job: Job, since: float) -> float | None:
        """When ``job`` first stepped in a life begun after ``since`` (None: not yet; a
        job that finished meanwhile: its end)."""
        events = job.events()
        lives = {e["life"] for e in events if e["event"] == "start" and e["t"] >= since}
        steps = [e["t"] for e in events if e["event"] in ("step", "done") and e["life"] in lives]
        return min(steps) if steps else None

    def training_again(self, names: list[str], since: float) -> bool:
        """Every job named has done a step in a life that started after ``since``."""
        return all(self.back_at(job, since) is not None for job in self.jobs if job.name in names)

    def all_training(self) -> bool:
        """Every unfinished job is running and has stepped in its current life."""
        for job in self.jobs:
            if job.done:
                continue
            if not job.running():
                return False
            events = job.events()
            life = max((e["life"] for e in events if e["event"] == "start"), default=None)
            if not any(e["event"] == "step" and e["life"] == life for e in events):
                return False
        return True

    def progress(self) -> float:
        """The least advanced job's share of its steps."""
        shares = []
        for job in self.jobs:
            steps = [e["step"] for e in job.events() if e["event"] == "step"]
            shares.append(1.0 if job.done else (max(steps) + 1) / job.spec["steps"] if steps else 0.0)
        return min(shares)

    def wait_until(self, predicate, timeout: float) -> bool:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            self.tend()
            if predicate():
                return True
            time.sleep(0.05)
        return False

    # -- the faults ---------------------------------------------------------------------
    def in_checkpoint(self, names: list[str], timeout: float = 30) -> Job | None:
        """A job of ``names`` whose checkpoint has begun and not returned (None: none came)."""
        def begun():
            for job in self.jobs:
                if job.name in names and job.running():
                    ev = [e for e in job.events() if e["event"] in ("checkpoint", "checkpointed")]
                    if ev and ev[-1]["event"] == "checkpoint" and time.time() - ev[-1]["t"] < 0.1:
                        return job
            return None
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            self.tend()
            job = begun()
            if job is not None:
                return job
            time.sleep(0.01)
        return None

    @staticmethod
    def busy(job: Job) -> bool:
        """Running, and its life has logged neither its end nor a failure (it is training)."""
        if not job.running() or job.done:
            return False
        events = job.events()
        life = max((e["life"] for e in events if e["event"] == "start"), default=None)
        return not any(e["event"] in ("done", "failed") and e["life"] == life for e in events)

    def inject(self, kind: str) -> Fault | None:
        rng = self.rng
        running = [j for j in self.jobs if self.busy(j)]
        if not running:
            return None
        fault = Fault(kind, self.now())
        if kind == "trainer_sigkill":
            job = rng.choice(running)
            time.sleep(rng.uniform(0, 0.5))
            fault.target = job.name
            self.strike(fault)
            job.kill()
        elif kind == "trainer_sigkill_in_checkpoint":
            job = self.in_checkpoint([rng.choice(running).name])
            if job is None:
                return None
            time.sleep(rng.uniform(0.02, 0.8 * CHECKPOINT_PAUSE_S))
            fault.target, fault.detail = job.name, {"checkpoint_returned_first": self._returned(job)}
            self.strike(fault)
            job.kill()
        elif kind in ("daemon_sigkill", "daemon_sigterm", "daemon_kill_in_checkpoint"):
            if kind == "daemon_kill_in_checkpoint":
                job = self.in_checkpoint([j.name for j in running])
                if job is None:
                    return None
                time.sleep(rng.uniform(0.02, 0.8 * CHECKPOINT_PAUSE_S))
                fault.detail = {"job": job.name, "checkpoint_returned_first": self._returned(job)}
            else:
                time.sleep(rng.uniform(0, 0.5))
            fault.target = "daemon"
            self.strike(fault)
            self.daemon.signal(signal.SIGTERM if kind == "daemon_sigterm" else signal.SIGKILL)
            self.restart_daemon(kind)
        elif kind in ("write_eio", "read_eio"):
            before = self.injected()
            # (a read is retried once whole: 2 failures are mostly absorbed, 64 reach a job)
            count = 1 if kind == "write_eio" else rng.choice([2, 64])
            spec = {"kind": "eio", "op": kind[:-4], "skip": rng.randrange(0, 40), "count": count}
            fault.target, fault.detail = "daemon", spec
            self.strike(fault)
            self.arm([spec])
            fault.fired = self.wait_until(lambda: self.injected() > before, 30)
            self.arm([])
        elif kind == "disk_full":
            # Full from now until 0.5-2 s after the first write it refused (snapshot
            # checkpoints write nothing to the array: a window alone may see no write).
            seconds = rng.uniform(0.5, 2.0)
            fault.target, fault.detail = "daemon", {"kind": "enospc", "op": "write", "seconds_after_first": seconds}
            before = self.injected()
            self.strike(fault)
            self.arm([{"kind": "enospc", "op": "write", "count": -1}])
            fault.fired = self.wait_until(lambda: self.injected() > before, 30)
            self.wait_until(lambda: False, seconds)
            self.arm([])
        elif kind == "damaged_checkpoint":
            # (a third of the checkpoints are copies: wait for a moment a running job's newest is one)
            if not self.wait_until(lambda: any(self.busy(j) and self._newest_is_a_copy(j) for j in self.jobs), 30):
                return None
            candidates = [j for j in self.jobs if self.busy(j) and self._newest_is_a_copy(j)]
            if not candidates:  # (gone again meanwhile)
                return None
            job = rng.choice(candidates)
            self.strike(fault)
            job.kill()
            # A save the kill interrupted is finished or dropped by the daemon within its pause:
            # then the newest checkpoint is what the next life will find.
            time.sleep(4 * CHECKPOINT_PAUSE_S)
            listed = checkpoints(job.dir)
            if not self._newest_is_a_copy(job, listed):  # (a save the kill interrupted came last, a snapshot)
                fault.kind, fault.target = "trainer_sigkill", job.name
                fault.detail = {"meant": "damaged_checkpoint", "but": "its newest checkpoint was a snapshot"}
                return fault
            newest = listed[0][1]
            victim = rng.choice(sorted(p for p in (newest / "objects").iterdir()))
            data = bytearray(victim.read_bytes())
            where = rng.randrange(len(data))
            data[where] ^= 0x01
            victim.write_bytes(bytes(data))
            fault.target = job.name
            fault.detail = {"checkpoint": str(newest), "file": victim.name, "byte": where,
                            "previous": str(listed[1][1]), "previous_step": listed[1][0]}
        else:
            raise ValueError(kind)
        return fault

    @staticmethod
    def _newest_is_a_copy(job: Job, listed=None) -> bool:
        """The job's newest checkpoint is a copy (files to damage), and there is one before it."""
        listed = checkpoints(job.dir) if listed is None else listed
        if len(listed) < 2:
            return False
        try:
            return json.loads((listed[0][1] / "manifest.json").read_text())["mode"] == "copy"
        except (OSError, ValueError, KeyError):
            return False

    @staticmethod
    def _returned(job: Job) -> bool:
        ev = [e for e in job.events() if e["event"] in ("checkpoint", "checkpointed")]
        return bool(ev) and ev[-1]["event"] == "checkpointed"

    # -- the run ------------------------------------------------------------------------
    def go(self) -> None:
        self.daemon.start()
        for job in self.jobs:
            job.start(self.daemon.socket)
        self.note("jobs started")
        kinds: list[str] = []
        while not all(j.done for j in self.jobs):
            if time.monotonic() > self.deadline:
                raise TimeoutError(f"the soak's budget ran out: {[j.name for j in self.jobs if not j.done]} unfinished")
            # (a fault that became another kind, e.g. a damaged checkpoint whose job's newest
            # checkpoint turned out a snapshot, does not count: its kind comes again)
            if self.rng is None or sum("meant" not in (f.detail or {}) for f in self.faults) >= self.faults_wanted:
                self.wait_until(lambda: all(j.done for j in self.jobs), 1.0)
                continue
            # The next fault once everyone trains again, after a random pause; none near the end.
            if not self.wait_until(self.all_training, 1.0) or self.progress() > 0.9:
                continue
            self.wait_until(lambda: False, self.rng.uniform(0.3, 2.0))
            if not kinds:
                kinds = list(KINDS)
                self.rng.shuffle(kinds)
            kind = kinds.pop()
            fault = self.inject(kind)
            if fault is None:
                self.note(f"{kind}: no occasion now, later")
                kinds.insert(0, kind)
                continue
            if fault.kind != kind:
                kinds.insert(0, kind)  # (it became another kind: this one later)
            self.note(f"{fault.kind} {fault.target} {fault.detail}")
            self.wait_until(lambda: False, 1.0)  # (who it stopped: they die within this, mostly)
            self.wait_until(lambda: self.training_again(fault.stopped, fault.t_wall), 180)
            fault.t_end = time.time()
        for fault in self.faults:  # (from the jobs' own logs: when each it stopped stepped again)
            back = [self.back_at(j, fault.t_wall) for j in self.jobs if j.name in fault.stopped]
            fault.recovery_s = (max(back) - fault.t_wall) if None not in back and back else (
                0.0 if not back else None)

    def note(self, what: str) -> None:
        self.timeline.append((round(self.now(), 2), what))

    def close(self) -> None:
        for job in self.jobs:
            job.kill()
        self.daemon.stop()

    def finish(self) -> dict:
        """The array at the end, before and after one more restart; then every checkpoint
        and namespace deleted: what is left."""
        before = self.daemon.usage()
        self.daemon.signal(signal.SIGTERM)
        self.restart_daemon("the end")
        after = self.usage_after_restart.pop()
        for job in self.jobs:
            with fuyou_client.connect(self.daemon.socket, namespace=job.name) as s:
                for _, path in checkpoints(job.dir):
                    s.delete_checkpoint(path)
                s.delete(*[o.name for o in s.objects()], missing_ok=True)
        emptied = self.daemon.usage()
        return {"before_restart": before, "after_restart": after, "emptied": emptied}
