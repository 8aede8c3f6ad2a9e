"""Choosing the I/O engine: io_uring where it works, the thread pool everywhere else;
wrapped in the fault-injecting engine when ``FUYOUD_IO_FAULTS`` names a fault file
(fuyoud/io/faults.py: soaks and failure tests of a real daemon process)."""
from __future__ import annotations

import os

from fuyoud.config import IOSection
from fuyoud.io import faults
from fuyoud.io.engine import IOEngine
from fuyoud.io.threadpool import ThreadPoolEngine
from fuyoud.io import uring


def choose_engine(cfg: IOSection) -> tuple[IOEngine, str]:
    """Return the engine and a sentence saying why it was chosen (logged and exported)."""
    engine, reason = _choose(cfg)
    path = os.environ.get(faults.ENV)
    if path:
        source = faults.FaultFile(path)
        engine = faults.FaultyEngine(engine, source.changed() or [], source)  # (what the file lists now, armed)
        reason += f"; faults injected from {path} ({faults.ENV})"
    return engine, reason


def _choose(cfg: IOSection) -> tuple[IOEngine, str]:
    if cfg.engine == "threadpool":
        return ThreadPoolEngine(cfg.threads), "configured: [io.engine] = \"threadpool\""
    ok, why = uring.available()
    if ok:
        reason = "configured" if cfg.engine == "io_uring" else "auto: io_uring is available"
        return uring.UringEngine(cfg.queue_depth), reason
    if cfg.engine == "io_uring":
        raise RuntimeError(f"[io.engine] = \"io_uring\" but io_uring is not usable here: {why}")
    return ThreadPoolEngine(cfg.threads), f"auto: io_uring unavailable ({why})"
