"""`fuyouctl`: see and steer a running fuyoud.

    fuyouctl status                 engine, devices, memory, throughput now, sessions
    fuyouctl sessions               the live sessions: uid, pid, job and rank, model size,
                                    last activity (the operator's view: needs the admin token)
    fuyouctl drain [--wait]         stop accepting new sessions; --cancel reopens
    fuyouctl checkpoint SESSION DIR copy a session's state to DIR on the daemon's host
    fuyouctl namespaces             every namespace on the SSD array: owner, state, snapshot
                                    checkpoints, the live session holding it
    fuyouctl delete-namespace NAME  delete a namespace's state (not its checkpoints);
                                    --job JOB: every rank's of a data-parallel job
    fuyouctl health                 the grpc.health.v1 status (exit 0 when serving)
    fuyouctl plan MODEL [...]       will MODEL fit this host (or the one described), how fast:
                                    the planner (fuyou_client.sizing); needs no daemon

Tables for people by default, ``--json`` for scripts. drain, checkpoint and the
namespaces' commands need the admin token the daemon keeps next to its control socket
(readable by root and the daemon's user).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import grpc
from google.protobuf.json_format import MessageToDict
from grpc_health.v1 import health_pb2, health_pb2_grpc

from fuyou_proto import ADMIN_METADATA_KEY, pb, rpc
from fuyouctl.plan import add_arguments as add_plan_arguments, run as run_plan
from fuyoud.config import ConfigError, load
from fuyoud.sessions.names import job_rank
from fuyoud.units import format_size


class CtlError(Exception):
    """A problem fuyouctl reports in one line and exit code 1."""


def _socket(args) -> str:
    if args.socket:
        return args.socket
    return str(load(args.config).daemon.control_path)


def _admin_metadata(args) -> tuple:
    path = Path(args.admin_token_file or Path(_socket(args)).parent / "admin.token")
    try:
        token = path.read_text().strip()
    except PermissionError:
        raise CtlError(f"{args.command} needs the admin token in {path}, which this user may not read: "
                       "run fuyouctl as root or as the daemon's user") from None
    except FileNotFoundError:
        raise CtlError(f"no admin token at {path}: is fuyoud running with that control socket?") from None
    return ((ADMIN_METADATA_KEY, token),)


def _operator_metadata(args) -> tuple:
    """The admin token where this user may read it (sessions are listed to the operator
    only), else nothing."""
    try:
        return _admin_metadata(args)
    except CtlError:
        return ()


NOT_OPERATOR = "(sessions are shown to the operator only: run fuyouctl as root or as the daemon's user)"


def _print_json(message) -> None:
    """Every field, zeros and empty lists too (a script need not know protobuf's defaults:
    uid 0 is root)."""
    print(json.dumps(MessageToDict(message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True),
                     indent=2))


def table(headers: list[str], rows: list[list[str]]) -> str:
    """Left-aligned columns, two spaces apart."""
    widths = [max(len(str(x)) for x in col) for col in zip(headers, *rows)]
    return "\n".join("  ".join(str(x).ljust(w) for x, w in zip(row, widths)).rstrip() for row in [headers, *rows])


def _ago(t: float) -> str:
    s = max(0, int(time.time() - t))
    return f"{s}s ago" if s < 120 else f"{s // 60}m ago" if s < 7200 else f"{s // 3600}h ago"


def _params(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return str(n)


def _by_job(session) -> tuple:
    """Sessions of one data-parallel job together, by rank; the others (no job) first, by id."""
    job, rank = job_rank(session.namespace)
    return job, -1 if rank is None else rank, session.id


def sessions_table(sessions) -> str:
    """JOB and RANK come from namespaces ``<job>.r<rank>`` (one session per rank of a
    data-parallel job), empty for others; PLANNED is what the session's memory plan
    reserved (held for it; "-": none)."""
    if not sessions:
        return "no sessions"
    rows = []
    for s in sorted(sessions, key=_by_job):
        job, rank = job_rank(s.namespace)
        rows.append([s.id, s.uid, s.pid, s.namespace, job, "" if rank is None else rank, _params(s.model_params),
                     s.groups, s.step, format_size(s.pinned_bytes),
                     format_size(s.reserved_bytes) if s.reserved_bytes else "-", format_size(s.persistent_bytes),
                     _ago(s.last_active)])
    return table(["ID", "UID", "PID", "NAMESPACE", "JOB", "RANK", "PARAMS", "GROUPS", "STEP", "PINNED", "PLANNED",
                  "ON SSD", "LAST ACTIVE"], rows)


def cmd_status(args, channel) -> int:
    stub = rpc.FuyouAdminStub(channel)
    metadata = _operator_metadata(args)
    reply = stub.Status(pb.StatusRequest(), metadata=metadata, timeout=args.timeout)
    if args.json:
        _print_json(reply)
        return 0
    state = "draining (no new sessions)" if reply.draining else "serving"
    print(f"fuyoud {reply.version} (pid {reply.pid}), {state}, up {reply.uptime_seconds} s")
    print(f"  I/O engine   {reply.io_engine} ({reply.io_engine_reason})")
    print(f"  pinned       {format_size(reply.pinned_used_bytes)} of {format_size(reply.pinned_budget_bytes)}")
    print(f"  throughput   {format_size(int(reply.read_bytes_per_second))}/s read, "
          f"{format_size(int(reply.write_bytes_per_second))}/s written (last 5 s)")
    print(f"  SSD traffic  {format_size(reply.bytes_read)} read, {format_size(reply.bytes_written)} written since start")
    print(f"  objects      {reply.objects}")
    print(f"  metrics      {reply.metrics_url or 'off'}")
    print()
    print(table(["DEVICE", "PATH", "USED", "FILE", "AVAILABLE"],
                [[d.index, d.path, format_size(d.used_bytes), format_size(d.capacity_bytes),
                  format_size(d.available_bytes if d.HasField("available_bytes") else d.capacity_bytes - d.used_bytes)]
                 for d in reply.devices]))
    print()
    print(sessions_table(reply.session_list) if metadata else f"{reply.sessions} session(s) {NOT_OPERATOR}")
    return 0


def cmd_sessions(args, channel) -> int:
    stub = rpc.FuyouAdminStub(channel)
    metadata = _operator_metadata(args)
    reply = stub.ListSessions(pb.Empty(), metadata=metadata, timeout=args.timeout)
    if args.json:
        _print_json(reply)
    else:
        print(sessions_table(reply.sessions) if metadata else NOT_OPERATOR)
    return 0


def cmd_drain(args, channel) -> int:
    stub = rpc.FuyouAdminStub(channel)
    metadata = _admin_metadata(args)
    reply = stub.Drain(pb.DrainRequest(cancel=args.cancel), metadata=metadata, timeout=args.timeout)
    deadline = time.monotonic() + args.wait_timeout
    while args.wait and reply.sessions and time.monotonic() < deadline:
        time.sleep(0.5)
        reply = stub.Drain(pb.DrainRequest(cancel=args.cancel), metadata=metadata, timeout=args.timeout)
    if args.json:
        _print_json(reply)
    elif not reply.draining:
        print("accepting new sessions again")
    else:
        print(f"draining: no new sessions; {reply.sessions} session(s) still running")
    return 1 if args.wait and reply.sessions else 0


def cmd_checkpoint(args, channel) -> int:
    stub = rpc.FuyouStub(channel)
    directory = Path(args.directory).absolute()
    req = pb.CheckpointRequest(session_id=args.session, directory=str(directory), timeout_seconds=args.step_timeout,
                               mode=args.mode)
    reply = stub.Checkpoint(req, metadata=_admin_metadata(args), timeout=args.step_timeout + 3600)
    if args.json:
        _print_json(reply)
    else:
        print(f"checkpoint ({reply.mode}) of session {args.session} ({reply.namespace}) at step {reply.step}: "
              f"{reply.objects} objects, {format_size(reply.bytes)} in {reply.seconds:.2f} s -> {reply.directory}")
    return 0


def namespaces_table(namespaces) -> str:
    """STATE: what a run resumes from (every object but its snapshot checkpoints');
    SNAPSHOTS: its snapshot checkpoints' objects, which share extents with the state when
    taken."""
    if not namespaces:
        return "no namespaces"
    rows = [[n.name + (" (unnamed)" if n.unnamed else ""), n.uid if n.owned else "-", n.objects,
             format_size(n.bytes), format_size(n.snapshot_bytes), n.checkpoints, n.session_id or "-"]
            for n in namespaces]
    return table(["NAMESPACE", "OWNER", "OBJECTS", "STATE", "SNAPSHOTS", "CHECKPOINTS", "SESSION"], rows)


def cmd_namespaces(args, channel) -> int:
    reply = rpc.FuyouAdminStub(channel).ListNamespaces(pb.Empty(), metadata=_admin_metadata(args),
                                                        timeout=args.timeout)
    if args.json:
        _print_json(reply)
    else:
        print(namespaces_table(reply.namespaces))
    return 0


def cmd_delete_namespace(args, channel) -> int:
    stub, metadata = rpc.FuyouAdminStub(channel), _admin_metadata(args)
    if (args.namespace is None) == (args.job is None):
        raise CtlError("delete-namespace takes a namespace or --job JOB (every rank's namespace of that job)")
    names = [args.namespace]
    if args.job is not None:  # (a job's ranks: <job>.r<rank>; none deleted while one is held)
        ranks = [n for n in stub.ListNamespaces(pb.Empty(), metadata=metadata, timeout=args.timeout).namespaces
                 if job_rank(n.name)[0] == args.job]
        if not ranks:
            raise CtlError(f"no namespace of job {args.job!r} (<job>.r<rank>) on the SSD array")
        held = [f"{n.name} (session {n.session_id})" for n in ranks if n.session_id]
        if held:
            raise CtlError(f"job {args.job!r} is still running: {', '.join(held)}; nothing was deleted")
        names = [n.name for n in sorted(ranks, key=lambda n: job_rank(n.name)[1])]
    for name in names:
        reply = stub.DeleteNamespace(pb.DeleteNamespaceRequest(namespace=name), metadata=metadata,
                                     timeout=args.timeout)
        if args.json:
            _print_json(reply)
        else:
            kept = (f"; the {reply.snapshot_objects} objects of its snapshot checkpoints stay until they are deleted"
                    if reply.snapshot_objects else "")
            print(f"deleted {name}: {reply.objects} objects, {format_size(reply.bytes)}{kept}")
    return 0


def cmd_health(args, channel) -> int:
    reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=args.timeout)
    print(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1


def parser(plan: bool = True) -> argparse.ArgumentParser:
    """``plan``: with the plan command's arguments (they import fuyou_client, and torch:
    seconds that the other commands need not wait)."""
    p = argparse.ArgumentParser(prog="fuyouctl", description="See and steer a running fuyoud.")
    p.add_argument("--socket", help="the daemon's control socket (default: from --config or the defaults)")
    p.add_argument("--config", help="read the socket path from this fuyoud config")
    p.add_argument("--admin-token-file", help="default: admin.token beside the control socket")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for an answer")
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("status", help="engine, devices, memory, throughput, sessions")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_status)
    s = sub.add_parser("sessions", help="the live sessions")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_sessions)
    s = sub.add_parser("drain", help="stop accepting new sessions, let current ones finish")
    s.add_argument("--cancel", action="store_true", help="accept new sessions again")
    s.add_argument("--wait", action="store_true", help="wait until no session is left (exit 1 on timeout)")
    s.add_argument("--wait-timeout", type=float, default=3600.0)
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_drain)
    s = sub.add_parser("checkpoint", help="copy a session's persistent state to a directory")
    s.add_argument("session", type=int, help="session id (see `fuyouctl sessions`)")
    s.add_argument("directory", help="a new directory on the daemon's host")
    s.add_argument("--mode", choices=["auto", "snapshot", "copy"], default="auto",
                   help="snapshot: share the objects' extents on the SSD array (no copy); copy: files in "
                        "DIR; auto: snapshot when DIR is on the array's filesystem")
    s.add_argument("--step-timeout", type=float, default=60.0,
                   help="wait at most this long for a point between optimizer steps")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_checkpoint)
    s = sub.add_parser("namespaces", help="every namespace on the SSD array, what it holds, who holds it")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_namespaces)
    s = sub.add_parser("delete-namespace", help="delete a namespace's state (refused while a session holds it; "
                                                "its snapshot checkpoints stay)")
    s.add_argument("namespace", nargs="?")
    s.add_argument("--job", help="every namespace <JOB>.r<rank> of a data-parallel job (refused while one runs)")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_delete_namespace)
    sub.add_parser("health", help="the grpc.health.v1 status").set_defaults(func=cmd_health)
    s = sub.add_parser("plan", help="will a model fit this host, with which settings, how fast (no daemon needed)")
    if plan:
        add_plan_arguments(s)
    s.set_defaults(func=run_plan)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parser(plan="plan" in argv).parse_args(argv)
    try:
        if args.command == "plan":
            return args.func(args)
        with grpc.insecure_channel(f"unix:{_socket(args)}") as channel:
            return args.func(args, channel)
    except (ConfigError, CtlError) as exc:
        print(f"fuyouctl: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, ConfigError) else 1
    except grpc.RpcError as exc:
        code = exc.code()
        if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            print(f"fuyouctl: cannot reach fuyoud at {_socket(args)}: {code.name}: {exc.details()}", file=sys.stderr)
        else:
            print(f"fuyouctl: {args.command}: {code.name}: {exc.details()}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
