"""What this host has, found rather than told: memory, cores, the GPU if there is one,
and the daemon's disks: their capacity and their bandwidth, measured with a short
O_DIRECT write (synced) and read of a file beside the daemon's data."""
from __future__ import annotations

import mmap
import os
import time
from pathlib import Path

from fuyou_client.sizing.hardware import GpuProfile, HostError, PROFILES, Rate, gpu_profile

PROBE_BYTES = 256 << 20
CHUNK = 8 << 20


def memory() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def gpu() -> GpuProfile | None:
    """The first CUDA device's profile (its memory as the device reports it), or None."""
    try:
        import torch
        if not torch.cuda.is_available():
            return None
        props = torch.cuda.get_device_properties(0)
    except Exception:  # noqa: BLE001 (no usable CUDA: plan for the CPU)
        return None
    name = props.name
    for key in PROFILES:
        if key in name.lower().replace(" ", "").replace("-", ""):
            import dataclasses
            return dataclasses.replace(gpu_profile(key), memory=props.total_memory)
    raise HostError(f"this host's GPU, {name}, has no profile: name the closest with --gpu "
                    f"({', '.join(PROFILES)}) or --gpu-from a bench/gpu.py result measured on it")


def _existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def disk_bandwidth(directory: Path, nbytes: int = PROBE_BYTES) -> tuple[float, float]:
    """(read, write) GB/s of a file in ``directory``: written with O_DIRECT and synced, then
    read back with O_DIRECT, ``CHUNK`` bytes a request, one at a time (a lower bound on what
    the daemon's deeper queues get)."""
    path = _existing(directory) / f".fuyou-probe-{os.getpid()}"
    buf = mmap.mmap(-1, CHUNK)  # (page-aligned, as O_DIRECT needs)
    buf.write(os.urandom(1 << 20) * (CHUNK >> 20))
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_DIRECT", 0), 0o600)
    except OSError as exc:
        raise HostError(f"cannot measure the disk under {directory}: {exc}; give --ssd COUNTxGB/s") from None
    try:
        t = time.perf_counter()
        for off in range(0, nbytes, CHUNK):
            os.pwritev(fd, [buf], off)
        os.fdatasync(fd)
        write = nbytes / (time.perf_counter() - t) / 1e9
        t = time.perf_counter()
        for off in range(0, nbytes, CHUNK):
            os.preadv(fd, [buf], off)
        read = nbytes / (time.perf_counter() - t) / 1e9
    finally:
        os.close(fd)
        path.unlink(missing_ok=True)
        buf.close()
    return read, write


def disks(directories: list[Path]) -> tuple[int, int, Rate, Rate]:
    """(count, free bytes of the smallest, read, write) of the file systems under these
    directories, each measured; the rates are the slowest device's. Free now: what a run
    may still take (what fuyoud already holds there is not counted)."""
    seen = {}
    for d in directories:
        root = _existing(Path(d))
        seen.setdefault(os.stat(root).st_dev, root)
    capacity, reads, writes = [], [], []
    for root in seen.values():
        st = os.statvfs(root)
        capacity.append(st.f_bavail * st.f_frsize)
        r, w = disk_bandwidth(root)
        reads.append(r)
        writes.append(w)
    src = (f"measured: {PROBE_BYTES >> 20} MiB O_DIRECT, {CHUNK >> 20} MiB requests one at a time, under "
           f"{', '.join(str(p) for p in seen.values())} ({time.strftime('%Y-%m-%d')}); a lower bound")
    return len(seen), min(capacity), Rate(min(reads), src), Rate(min(writes), src)
