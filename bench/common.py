"""Helpers the benchmarks share: units, files, summaries and what host they ran on."""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path

import torch


STATE_DTYPES = ("fp32", "bf16", "int8")


def parse_state_dtypes(text: str) -> list[str]:
    """``--state-dtypes``: a comma-separated subset of STATE_DTYPES, in that order."""
    out = [t.strip() for t in text.split(",") if t.strip()]
    bad = [t for t in out if t not in STATE_DTYPES]
    if not out or bad or len(set(out)) != len(out):
        raise argparse.ArgumentTypeError(f"want a comma-separated subset of {','.join(STATE_DTYPES)}, got {text!r}")
    return sorted(out, key=STATE_DTYPES.index)


def gbps(nbytes: int, seconds: float) -> float:
    """GB/s with GB = 1e9 bytes."""
    return nbytes / seconds / 1e9


def preallocate(path: Path, size: int) -> None:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.posix_fallocate(fd, 0, size)
    finally:
        os.close(fd)


def summarize(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "rounds": values}


def host_info(directory: Path) -> dict:
    """CPU, memory, kernel, versions and the file system under ``directory``."""
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    mem = next(int(line.split()[1]) * 1024 for line in Path("/proc/meminfo").read_text().splitlines()
               if line.startswith("MemTotal"))
    fs = subprocess.run(["findmnt", "-n", "-o", "SOURCE,FSTYPE", "--target", str(directory)],
                        capture_output=True, text=True).stdout.split()
    return {"cpu": cpu, "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(), "mem_total_bytes": mem,
            "kernel": platform.release(), "python": platform.python_version(), "torch": torch.__version__,
            "fs_source": fs[0] if fs else None, "fs_type": fs[1] if len(fs) > 1 else None}


def quiet_counters(session, stable: int = 3, wait: float = 0.1, tries: int = 100) -> tuple[int, int]:
    """The daemon's (bytes_read, bytes_written) once it is quiet: unchanged over ``stable``
    waits of ``wait`` seconds (a step's read-ahead of the next group may trail
    ``engine.step()``, and the daemon counts a read when it completes)."""
    prev, same = None, 0
    for _ in range(tries):
        st = session.status()
        cur = (st.bytes_read, st.bytes_written)
        same = same + 1 if cur == prev else 0
        if same == stable:
            break
        prev = cur
        time.sleep(wait)
    return cur


class BareLoop:
    """The disk as a bare loop sees it: fuyoud's engine called directly (no daemon, no
    gRPC) over a private 2 MiB-aligned huge-page buffer, O_DIRECT, on a preallocated file
    of ``size`` bytes in ``block_size`` requests, ``depth`` deep."""

    def __init__(self, path: Path, size: int, block_size: int, depth: int):
        from fuyoud.io import uring
        from fuyoud.io.engine import IORequest, Op
        from fuyoud.io.threadpool import ThreadPoolEngine
        from fuyoud.memory.hugepages import huge_page_buffer

        ok, self.engine_reason = uring.available()
        self.engine = uring.UringEngine(depth) if ok else ThreadPoolEngine(depth)
        self.size, self.path = size, path
        preallocate(path, size)
        self.fd = os.open(path, os.O_RDWR | os.O_DIRECT)
        self.map, self.view = huge_page_buffer(size)
        self.tensor = torch.frombuffer(self.view, dtype=torch.uint8)
        self.requests = {op: [IORequest(op, self.fd, o, self.view[o:o + block_size])
                              for o in range(0, size, block_size)] for op in (Op.READ, Op.WRITE)}
        self.READ, self.WRITE = Op.READ, Op.WRITE

    def run(self, op, requests=None, durable: bool = False) -> float:
        """Seconds to run ``requests`` (default: the whole file in direction ``op``); with
        ``durable``, until an ``fdatasync`` after them has returned too: what a write that
        must survive a crash costs (fuyoud syncs every persistent version before its
        commit). A virtual disk whose host caches writes acknowledges them far faster than
        it can keep them: on the reference machine 3.7-4.2 GB/s written, 0.55-0.8 GB/s
        written and synced (2026-11-24)."""
        requests = self.requests[op] if requests is None else requests
        t = time.perf_counter()
        results = self.engine.execute(requests)
        if durable:
            os.fdatasync(self.fd)
        dt = time.perf_counter() - t
        bad = [r for r in results if not r.ok or r.nbytes != len(requests[0].buf)]
        if bad:
            raise RuntimeError(f"bare loop {op.name}: {bad[0]}")
        return dt

    def close(self) -> None:
        self.engine.close()
        os.close(self.fd)
        del self.tensor, self.requests
        self.view.release()
        self.map.close()


def write_result(path: Path | None, result: dict) -> None:
    """Write a benchmark's result to ``path`` (its folder made) as indented JSON; no path, nothing."""
    import json

    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(result, indent=1) + "\n")
