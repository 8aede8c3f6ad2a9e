"""Helpers the benchmarks share: units, files, summaries and what host they ran on."""
from __future__ import annotations

import os
import platform
import statistics
import subprocess
from pathlib import Path

import torch


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
