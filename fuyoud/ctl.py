"""`fuyouctl`: ask a running fuyoud what it is doing."""
from __future__ import annotations

import argparse
import json
import sys

import grpc
from google.protobuf.json_format import MessageToDict
from grpc_health.v1 import health_pb2, health_pb2_grpc

from fuyou_proto import pb, rpc
from fuyoud.config import ConfigError, load
from fuyoud.units import format_size


def _socket(args) -> str:
    if args.socket:
        return args.socket
    return str(load(args.config).daemon.control_path)


def cmd_status(args) -> int:
    with grpc.insecure_channel(f"unix:{_socket(args)}") as ch:
        reply = rpc.FuyouStub(ch).Status(pb.StatusRequest(), timeout=args.timeout)
    if args.json:
        print(json.dumps(MessageToDict(reply, preserving_proto_field_name=True), indent=2))
        return 0
    print(f"fuyoud {reply.version} (pid {reply.pid})")
    print(f"  I/O engine   {reply.io_engine} ({reply.io_engine_reason})")
    print(f"  pinned       {format_size(reply.pinned_used_bytes)} of {format_size(reply.pinned_budget_bytes)}")
    print(f"  sessions     {reply.sessions}")
    print(f"  objects      {reply.objects}")
    print(f"  SSD traffic  {format_size(reply.bytes_read)} read, {format_size(reply.bytes_written)} written since start")
    print(f"  metrics      {reply.metrics_url or 'off'}")
    for d in reply.devices:
        print(f"  device {d.index}     {d.path}: {format_size(d.used_bytes)} used of {format_size(d.capacity_bytes)}")
    return 0


def cmd_health(args) -> int:
    with grpc.insecure_channel(f"unix:{_socket(args)}") as ch:
        reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=args.timeout)
    name = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(name)
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fuyouctl", description="Inspect a running fuyoud.")
    parser.add_argument("--socket", help="the daemon's control socket (default: from --config or the defaults)")
    parser.add_argument("--config", help="read the socket path from this fuyoud config")
    parser.add_argument("--timeout", type=float, default=5.0)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("status", help="engine, devices, memory, sessions")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_status)
    sub.add_parser("health", help="the grpc.health.v1 status").set_defaults(func=cmd_health)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ConfigError as exc:
        print(f"fuyouctl: {exc}", file=sys.stderr)
        return 2
    except grpc.RpcError as exc:
        print(f"fuyouctl: cannot reach fuyoud at {_socket(args)}: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
