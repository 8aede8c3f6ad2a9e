"""Prometheus metrics: `fuyoud_` prefix, base units in names, bounded labels.

Counters and histograms are updated on the I/O path; gauges (memory, sessions, objects,
devices) are read from the live components at scrape time by a custom collector, so
they are never stale. Each daemon has its own registry (several can run in one test
process).
"""
from __future__ import annotations

import platform
import threading
from typing import Callable
from wsgiref.simple_server import WSGIServer

import torch
from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily

from fuyoud import __version__
from fuyoud.operations.snapshot import Snapshot
from fuyoud.sessions.names import job_rank

LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
CHECKPOINT_BUCKETS = (0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)


class Metrics:
    def __init__(self):
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.io_bytes = Counter("fuyoud_io_bytes", "Bytes moved between memory and the SSD array",
                                ["device", "direction"], registry=r)
        self.io_ops = Counter("fuyoud_io_operations", "I/O requests completed by the engine",
                              ["device", "direction"], registry=r)
        self.io_seconds = Histogram(
            "fuyoud_io_batch_duration_seconds",
            "Time from submitting a batch of requests to a device to the completion of its last one",
            ["device", "direction"], buckets=LATENCY_BUCKETS, registry=r)
        self.requests = Counter("fuyoud_requests", "Control requests served", ["method"], registry=r)
        self.request_seconds = Histogram("fuyoud_request_duration_seconds", "Control request latency",
                                         ["method"], buckets=LATENCY_BUCKETS, registry=r)
        self.errors = Counter("fuyoud_errors", "Errors returned to clients or met internally", ["kind"],
                              registry=r)
        self.sessions_closed = Counter(
            "fuyoud_sessions_closed",
            "Sessions ended, by reason: closed (by the client), killed (the session socket ended without a close: the "
            "process died), reaped (its process is gone, the socket held open by another), stopping (the daemon "
            "stopped)", ["reason"], registry=r)
        self.session_accept_errors = Counter(
            "fuyoud_session_accept_errors",
            "accept() failures of the session socket, by errno (EMFILE: out of file descriptors); the listener "
            "retries", ["errno"], registry=r)
        self.session_close_errors = Counter(
            "fuyoud_session_close_errors",
            "Steps of a session's close that failed, by step (optimizer: forgetting its groups; namespace: deleting "
            "its unnamed namespace's state; transient: dropping its transient objects; pool: releasing its pinned "
            "memory); the later steps ran all the same, and its pinned memory was released unless the step is pool",
            ["step"], registry=r)
        self.session_connections_refused = Counter(
            "fuyoud_session_connections_refused",
            "Session-socket connections refused at accept, by the limit met: per_uid (the connections one user holds "
            "at once), total (all users'); the client is told why", ["limit"], registry=r)
        self.user_limit_refusals = Counter(
            "fuyoud_user_limit_refusals",
            "Requests refused because one user's sessions together would pass a [limits] limit, by limit: sessions "
            "(user_sessions, at the handshake), pinned (user_pinned, at Reserve and Allocate), ssd (user_ssd, at a "
            "write or snapshot); the refusal names the limit and what that user holds", ["limit"], registry=r)
        self.reclaimed_bytes = Counter("fuyoud_reclaimed_pinned_bytes",
                                       "Pinned bytes given back when sessions ended", registry=r)
        self.optimizer_steps = Counter("fuyoud_optimizer_group_steps", "Optimizer steps of parameter groups",
                                       registry=r)
        self.optimizer_seconds = Histogram(
            "fuyoud_optimizer_step_phase_seconds", "Time of each phase of a group's optimizer step",
            ["phase"], buckets=LATENCY_BUCKETS, registry=r)
        self.optimizer_step_seconds = Histogram(
            "fuyoud_optimizer_step_seconds", "Time of a group's whole optimizer step (read, compute, write)",
            buckets=LATENCY_BUCKETS, registry=r)
        self.optimizer_prefetched = Counter("fuyoud_optimizer_prefetched_steps",
                                            "Group steps whose state had been read ahead", registry=r)
        self.optimizer_cache_bytes = Counter(
            "fuyoud_optimizer_cache_bytes", "Optimizer state bytes steps took from the state cache instead of the SSD",
            registry=r)
        self.optimizer_masters_bytes = Counter(
            "fuyoud_optimizer_client_masters_bytes",
            "Master-weight bytes chunked steps took from the client's buffer (read for its backward) instead of the SSD",
            registry=r)
        self.checkpoint_seconds = Histogram("fuyoud_checkpoint_duration_seconds", "Time to take a checkpoint, by mode",
                                            ["mode"], buckets=CHECKPOINT_BUCKETS, registry=r)
        self.checkpoint_bytes = Counter(
            "fuyoud_checkpoint_bytes", "Bytes of the objects checkpointed (copied to files, or shared by a snapshot)",
            ["mode"], registry=r)
        # Reported by clients (fuyou_client's engine, once per engine.step()).
        self.client_iterations = Counter("fuyoud_client_iterations", "Training iterations reported by clients",
                                         registry=r)
        self.client_iteration_seconds = Counter("fuyoud_client_iteration_seconds",
                                                "Wall time of the iterations clients reported", registry=r)
        self.client_exposed_seconds = Counter(
            "fuyoud_client_exposed_optimizer_seconds",
            "Time clients waited for optimizer steps at engine.step() (not hidden behind backward)", registry=r)
        self.activation_bytes = Counter("fuyoud_activation_bytes", "Activation bytes clients swapped out, by tier",
                                        ["tier"], registry=r)
        self._server: WSGIServer | None = None
        self._thread: threading.Thread | None = None

    def session_accept_errors_by(self, errno_name: str) -> None:
        self.session_accept_errors.labels(errno_name).inc()

    def session_connections_refused_by(self, limit: str) -> None:
        self.session_connections_refused.labels(limit).inc()

    def observe_io(self, device: int, direction: str, nbytes: int, ops: int, seconds: float) -> None:
        dev = str(device)
        self.io_bytes.labels(dev, direction).inc(nbytes)
        self.io_ops.labels(dev, direction).inc(ops)
        self.io_seconds.labels(dev, direction).observe(seconds)

    def observe_step(self, result) -> None:
        self.optimizer_steps.inc()
        self.optimizer_prefetched.inc(result.prefetched)
        self.optimizer_cache_bytes.inc(result.cached_bytes)
        self.optimizer_masters_bytes.inc(result.masters_bytes)
        for phase, seconds in (("read", result.read_s), ("compute", result.compute_s), ("write", result.write_s)):
            self.optimizer_seconds.labels(phase).observe(seconds)
        self.optimizer_step_seconds.observe(result.read_s + result.compute_s + result.write_s)

    def observe_checkpoint(self, mode: str, seconds: float, nbytes: int) -> None:
        self.checkpoint_seconds.labels(mode).observe(seconds)
        self.checkpoint_bytes.labels(mode).inc(nbytes)

    def observe_report(self, report) -> None:
        self.client_iterations.inc(report.iterations)
        self.client_iteration_seconds.inc(report.iteration_seconds)
        self.client_exposed_seconds.inc(report.exposed_optimizer_seconds)
        self.activation_bytes.labels("host").inc(report.activation_bytes_to_host)
        self.activation_bytes.labels("ssd").inc(report.activation_bytes_to_ssd)

    def attach(self, snapshot: Callable[[], Snapshot]) -> None:
        """Export the daemon's state at each scrape, as ``snapshot()`` reads it."""
        self.registry.register(_DaemonCollector(snapshot))

    def serve(self, listen: str) -> str:
        """Start the HTTP endpoint; returns its URL (port 0 picks a free one)."""
        host, _, port = listen.rpartition(":")
        self._server, self._thread = start_http_server(int(port), addr=host or "127.0.0.1",
                                                       registry=self.registry)
        return f"http://{host or '127.0.0.1'}:{self._server.server_port}/metrics"

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._thread.join(10)  # (shutdown ends its loop: every thread of the daemon is joined)
            self._server = None


class _DaemonCollector:
    def __init__(self, snapshot: Callable[[], Snapshot]):
        self.snapshot = snapshot

    def describe(self):
        return []

    def collect(self):
        d = self.snapshot()
        info = InfoMetricFamily("fuyoud_build", "Versions of the running daemon and what it runs on")
        info.add_metric([], {"version": __version__, "python": platform.python_version(), "torch": torch.__version__})
        yield info
        yield GaugeMetricFamily("fuyoud_start_time_seconds", "Unix time the daemon started", value=d.started)
        yield GaugeMetricFamily("fuyoud_draining", "1 while the daemon refuses new sessions (fuyouctl drain)",
                                value=int(d.draining))
        engine = GaugeMetricFamily("fuyoud_io_engine", "The I/O engine in use (1 for the active one)",
                                   labels=["engine"])
        engine.add_metric([d.io_engine], 1)
        yield engine

        pool = d.pool
        pinned = GaugeMetricFamily("fuyoud_pinned_bytes",
                                   "Shared pinned memory by state (planned: reserved by sessions' memory plans, not "
                                   "allocated yet, not free for the others)", labels=["state"])
        pinned.add_metric(["allocated"], pool.allocated)
        pinned.add_metric(["reserved"], pool.segments - pool.allocated)
        pinned.add_metric(["planned"], pool.reserved)
        pinned.add_metric(["staging"], d.staging_bytes)
        pinned.add_metric(["optimizer"], d.optimizer_buffer_bytes)
        yield pinned
        yield GaugeMetricFamily("fuyoud_optimizer_cached_state_bytes",
                                "Optimizer state kept in memory between steps by the state cache",
                                value=d.optimizer_cached_bytes)
        pages = GaugeMetricFamily("fuyoud_shared_segment_bytes", "Shared segments by the pages behind them",
                                  labels=["pages"])
        for kind, nbytes in pool.by_pages.items():
            pages.add_metric([kind], nbytes)
        yield pages
        yield GaugeMetricFamily("fuyoud_pinned_budget_bytes", "Pinned-memory budget of the daemon",
                                value=pool.budget)
        yield GaugeMetricFamily("fuyoud_sessions", "Live client sessions", value=d.sessions)
        by_session = GaugeMetricFamily("fuyoud_session_pinned_bytes", "Shared memory held by each live session",
                                       labels=["session"])
        for sid, nbytes in pool.by_session.items():
            by_session.add_metric([str(sid)], nbytes)
        yield by_session
        planned = GaugeMetricFamily("fuyoud_session_reserved_bytes",
                                    "Pinned memory each live session's memory plan reserved (held for it)",
                                    labels=["session"])
        for sid, nbytes in pool.reserved_by_session.items():
            planned.add_metric([str(sid)], nbytes)
        yield planned
        # Which namespace, and which job and data-parallel rank (namespaces "<job>.r<rank>"),
        # each session is: join on `session` to group the other per-session series by job.
        # (training_job, not job: Prometheus gives every series its scrape job's `job`.)
        session_info = GaugeMetricFamily("fuyoud_session_info",
                                         "Each live session's namespace, with its training job and rank when the "
                                         "namespace is <job>.r<rank> (a data-parallel rank; else empty); value 1",
                                         labels=["session", "namespace", "training_job", "rank"])
        buffers = GaugeMetricFamily("fuyoud_session_optimizer_buffers",
                                    "Optimizer buffers each live session holds now (steps, read-ahead, state cache)",
                                    labels=["session"])
        for sid, namespace in sorted(d.session_namespaces.items()):
            job, rank = job_rank(namespace)
            session_info.add_metric([str(sid), namespace, job, "" if rank is None else str(rank)], 1)
            buffers.add_metric([str(sid)], d.optimizer_buffers_held.get(namespace, 0))
        yield session_info
        yield buffers

        usage = d.store
        objects = GaugeMetricFamily("fuyoud_objects", "Objects in the store", labels=["kind"])
        obj_bytes = GaugeMetricFamily("fuyoud_object_bytes", "Bytes of object data in the store", labels=["kind"])
        for persistent, kind in ((True, "persistent"), (False, "transient")):
            objects.add_metric([kind], usage.objects[persistent])
            obj_bytes.add_metric([kind], usage.object_bytes[persistent])
        yield objects
        yield obj_bytes
        cap = GaugeMetricFamily("fuyoud_device_capacity_bytes", "Size of each device's data file", labels=["device"])
        used = GaugeMetricFamily("fuyoud_device_used_bytes", "Bytes allocated on each device", labels=["device"])
        available = GaugeMetricFamily("fuyoud_device_available_bytes",
                                      "Bytes still allocatable on each device (free in its data file, plus what an "
                                      "\"auto\" data file may still grow by)", labels=["device"])
        for i, (_, capacity, in_use, room) in enumerate(usage.devices):
            cap.add_metric([str(i)], capacity)
            used.add_metric([str(i)], in_use)
            available.add_metric([str(i)], room)
        yield cap
        yield used
        yield available
        depth = GaugeMetricFamily("fuyoud_io_queue_depth", "Engine requests in flight on each device now",
                                  labels=["device"])
        for i, n in enumerate(usage.in_flight):
            depth.add_metric([str(i)], n)
        yield depth
        lifetime = CounterMetricFamily(
            "fuyoud_device_lifetime_bytes",
            "Bytes moved on each device over the array's whole life, kept across restarts (drive endurance)",
            labels=["device", "direction"])
        for (dev, direction), n in sorted(usage.lifetime.items()):
            lifetime.add_metric([str(dev), direction], n)
        yield lifetime
