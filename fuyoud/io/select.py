"""Choosing the I/O engine: io_uring where it works, the thread pool everywhere else."""
from __future__ import annotations

from fuyoud.config import IOSection
from fuyoud.io.engine import IOEngine
from fuyoud.io.threadpool import ThreadPoolEngine
from fuyoud.io import uring


def choose_engine(cfg: IOSection) -> tuple[IOEngine, str]:
    """Return the engine and a sentence saying why it was chosen (logged and exported)."""
    if cfg.engine == "threadpool":
        return ThreadPoolEngine(cfg.threads), "configured: [io.engine] = \"threadpool\""
    ok, why = uring.available()
    if ok:
        reason = "configured" if cfg.engine == "io_uring" else "auto: io_uring is available"
        return uring.UringEngine(cfg.queue_depth), reason
    if cfg.engine == "io_uring":
        raise RuntimeError(f"[io.engine] = \"io_uring\" but io_uring is not usable here: {why}")
    return ThreadPoolEngine(cfg.threads), f"auto: io_uring unavailable ({why})"
