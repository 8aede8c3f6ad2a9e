"""The I/O engine seam (``IOEngine``: batches of reads and writes) with its io_uring and
thread-pool engines and a fault-injecting one, chosen by ``choose_engine``."""
from fuyoud.io.engine import IOEngine, IORequest, IOResult, Op
from fuyoud.io.select import choose_engine

__all__ = ["IOEngine", "IORequest", "IOResult", "Op", "choose_engine"]
