"""One reading of the daemon's state, taken by ``Daemon.snapshot()``: what ``Status``
answers and what the metrics collector exports, gathered in one place."""
from __future__ import annotations

from dataclasses import dataclass, field

from fuyoud.memory.pool import PoolUsage
from fuyoud.storage.store import StoreUsage


@dataclass(frozen=True)
class Snapshot:
    version: str
    pid: int
    started: float  # Unix time
    io_engine: str
    io_engine_reason: str
    metrics_url: str
    session_socket: str
    draining: bool
    sessions: int  # live sessions
    pool: PoolUsage  # shared pinned memory
    staging_bytes: int
    optimizer_buffer_bytes: int  # the optimizer's buffers, mapped
    optimizer_cached_bytes: int  # state the state cache holds
    optimizer_buffer_budget: int  # [optimizer] buffer_budget and buffers
    optimizer_buffers: int
    store: StoreUsage  # objects, devices, bytes moved, requests in flight, lifetime counters
    read_bytes_per_second: float  # over the last seconds (housekeeping's sampling)
    write_bytes_per_second: float
    session_namespaces: dict[int, str] = field(default_factory=dict)  # live session id -> its namespace
    optimizer_buffers_held: dict[str, int] = field(default_factory=dict)  # namespace -> optimizer buffers it holds
    store_outlives_daemon: bool = True  # False: --remove-when-stopped deletes the store
