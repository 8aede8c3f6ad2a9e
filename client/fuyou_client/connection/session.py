"""A client session with fuyoud: the session socket, the gRPC channel, shared memory.

    with fuyou_client.connect() as s:              # the host's daemon
        buf = s.allocate(1 << 30)                  # pinned shared memory, mapped here
        buf.tensor(torch.float32)[:] = ...         # fill it in place
        s.swap_out("weights/0", buf)               # to the SSD array
        s.swap_in("weights/0", buf)                # and back

Transfers take whole buffers or ranges of them; ``*_async`` variants return futures and
``swap_out_many`` / ``swap_in_many`` batch several objects into one request.
"""
from __future__ import annotations

import json
import os
import select
import socket
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import grpc

from fuyou_client import errors
from fuyou_client.connection import checkpoint_files
from fuyou_client.connection.buffers import Segment, SharedBuffer
from fuyou_client.connection.futures import all_of, flatten, wrap_future  # noqa: F401 (all_of, flatten: re-exported)
from fuyou_client.connection.reach import denied, reachable
from fuyou_client.optim import DTYPE_NAMES, AdamW, GroupInfo, SGD, StepInfo
from fuyou_proto import SESSION_METADATA_KEY, pb, rpc
from fuyou_proto import dtype_value

MAX_MESSAGE = 64 * 1024
MAX_FDS_PER_MESSAGE = 250  # descriptors in one hand-over message (the kernel's SCM_MAX_FD is 253)
HAND_TIMEOUT = 60.0  # seconds to wait for the daemon to say it has a hand-over
# A checkpoint's manifest comes back in its reply: room for one of many objects.
CHANNEL_OPTIONS = [("grpc.max_receive_message_length", 128 << 20)]


def default_socket() -> str:
    """$FUYOUD_SOCKET, else the daemon's default control socket for this user."""
    env = os.environ.get("FUYOUD_SOCKET")
    if env:
        return env
    base = os.environ.get("XDG_RUNTIME_DIR") or "/tmp"
    return str(Path(base) / f"fuyoud-{os.getuid()}" / "fuyoud.sock")


@dataclass(frozen=True)
class ObjectInfo:
    name: str
    namespace: str
    size: int
    persistent: bool
    devices: int
    version: int

    @classmethod
    def from_pb(cls, m: pb.ObjectInfo) -> "ObjectInfo":
        return cls(m.name, m.namespace, m.size, m.persistent, m.devices, m.version)


@dataclass
class Out:
    """One object of a batched swap-out: ``length`` bytes of ``buffer`` from ``offset``."""
    name: str
    buffer: SharedBuffer
    offset: int = 0
    length: int | None = None
    persistent: bool = False

    def to_pb(self) -> pb.SwapOutItem:
        length = self.buffer.size - self.offset if self.length is None else self.length
        return pb.SwapOutItem(name=self.name, buffer=self.buffer.ref, offset=self.offset, length=length,
                              persistent=self.persistent)


@dataclass
class In:
    """One object of a batched swap-in: object bytes from ``object_offset`` into the buffer."""
    name: str
    buffer: SharedBuffer
    offset: int = 0
    length: int | None = None  # None: the rest of the object
    object_offset: int = 0

    def to_pb(self) -> pb.SwapInItem:
        return pb.SwapInItem(name=self.name, buffer=self.buffer.ref, offset=self.offset,
                             object_offset=self.object_offset, length=self.length or 0)


def _call(fn, request, metadata, timeout=None):
    try:
        return fn(request, metadata=metadata, timeout=timeout)
    except grpc.RpcError as exc:
        raise errors.from_rpc_error(exc) from None


class Session:
    def __init__(self, socket_path: str | None = None, namespace: str | None = None, timeout: float = 10.0):
        self.socket_path = socket_path or default_socket()
        reachable(self.socket_path, timeout)
        self._channel = grpc.insecure_channel(f"unix:{self.socket_path}", options=CHANNEL_OPTIONS)
        self._stub = rpc.FuyouStub(self._channel)
        self._admin_stub = rpc.FuyouAdminStub(self._channel)
        try:
            status = self._admin_stub.Status(pb.StatusRequest(), timeout=timeout, wait_for_ready=True)
        except grpc.RpcError as exc:
            self._channel.close()
            raise errors.DaemonUnavailable(
                f"no fuyoud answers at {self.socket_path} ({exc.code().name}): start it with "
                "`systemctl start fuyoud` or `fuyoud`, or use fuyou_client.start_daemon()") from None
        self.daemon_status = status
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        try:
            try:
                self._sock.connect(status.session_socket)
            except PermissionError:
                raise denied(status.session_socket, "the daemon's session socket") from None
            self._sock.sendall(json.dumps({"hello": 1, "namespace": namespace, "client": "fuyou_client"}).encode())
            reply = json.loads(self._sock.recv(MAX_MESSAGE) or b"null")
        except errors.PermissionDenied:
            self._sock.close()
            self._channel.close()
            raise
        except (OSError, ValueError) as exc:
            self._sock.close()
            self._channel.close()
            raise errors.DaemonUnavailable(f"session handshake with {status.session_socket} failed: {exc}") from None
        if not isinstance(reply, dict) or "error" in reply or "token" not in reply:
            self._sock.close()
            self._channel.close()
            err = (reply or {}).get("error", {"code": "UNKNOWN", "message": f"unexpected reply {reply!r}"})
            raise errors.from_code(err["code"], err["message"])
        self.id: int = reply["session"]
        self.namespace: str = reply["namespace"]
        self._metadata = ((SESSION_METADATA_KEY, reply["token"]),)
        self._segments: dict[int, Segment] = {}
        self._seg_lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._acks: dict[str, dict | None] = {}  # hand-over key -> the daemon's error, or None
        self._device = None  # a compute device every mapped segment is registered with
        self.closed = False

    # -- memory ---------------------------------------------------------------------
    def allocate(self, nbytes: int) -> SharedBuffer:
        """Pinned shared memory of ``nbytes`` bytes, mapped in this process."""
        ref = _call(self._stub.Allocate, pb.AllocateRequest(size=nbytes), self._metadata)
        segment = self._segment(ref.segment)
        segment.live_buffers += 1
        return SharedBuffer(self._free, ref, segment, nbytes)

    def reserve(self, nbytes: int) -> int:
        """Have the daemon hold ``nbytes`` of pinned memory for this session in all (what
        it holds counts; 0 gives the reservation up): allocations within them are then
        never refused for room another session took. ResourceExhausted, naming what the
        other sessions hold, when the daemon's budget cannot. Returns the reservation
        (0 from a daemon older than reservations: nothing is held then)."""
        try:
            reply = self._stub.Reserve(pb.ReserveRequest(bytes=nbytes), metadata=self._metadata)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                return 0
            raise errors.from_rpc_error(exc) from None
        return reply.reserved_bytes

    def _segment(self, segment_id: int) -> Segment:
        """The mapping of a segment; its fd arrived on the session socket before the reply."""
        with self._seg_lock:
            while segment_id not in self._segments:
                self._read_message()
            return self._segments[segment_id]

    def _read_message(self, timeout: float | None = None) -> None:
        """One message from the session socket (the caller holds ``_seg_lock``): a new
        segment (mapped, and registered with the device) or the answer to a hand-over
        (kept in ``_acks``). ``timeout``: DaemonUnavailable if none comes within it."""
        if timeout is not None and not select.select([self._sock], [], [], timeout)[0]:
            raise errors.DaemonUnavailable(f"fuyoud did not answer on the session socket within {timeout:g} s")
        msg, fds, _, _ = socket.recv_fds(self._sock, MAX_MESSAGE, 4)
        if not msg:
            raise errors.DaemonUnavailable("fuyoud closed the session socket")
        info = json.loads(msg)
        if "handed" in info and not fds:
            self._acks[info["handed"]] = info.get("error")
            return
        if "segment" not in info or len(fds) != 1:
            for fd in fds:
                os.close(fd)
            raise errors.FuyouClientError(f"unexpected message on the session socket: {info!r}")
        seg = Segment(info["segment"], info["size"], fds[0])
        self._segments[info["segment"]] = seg
        if self._device is not None:
            seg.register(self._device)

    @property
    def pinned_bytes(self) -> int:
        """The shared memory this session holds (its segments, as the daemon counts them)."""
        with self._seg_lock:
            return sum(seg.size for seg in self._segments.values())

    def use_device(self, device) -> None:
        """Register every shared segment, mapped now or later, with a compute device
        (``fuyou_client.device.devices``: cudaHostRegister on CUDA); None unregisters them."""
        with self._seg_lock:
            for seg in self._segments.values():
                if device is None:
                    seg.close_registration()
                else:
                    seg.register(device)
            self._device = device

    def _free(self, buf: SharedBuffer) -> None:
        if self.closed:
            return
        _call(self._stub.Free, buf.ref, self._metadata)
        with self._seg_lock:
            seg = buf.segment
            seg.live_buffers -= 1
            if seg.live_buffers == 0:  # the daemon dropped the segment: drop our mapping too
                self._segments.pop(seg.id, None)
                seg.close()

    # -- objects --------------------------------------------------------------------
    def swap_out(self, name: str, buffer: SharedBuffer, offset: int = 0, length: int | None = None,
                 persistent: bool = False) -> ObjectInfo:
        """Store ``buffer[offset:offset+length]`` as object ``name``; returns when it is committed."""
        return self.swap_out_many([Out(name, buffer, offset, length, persistent)])[0]

    def swap_out_many(self, items: Sequence[Out]) -> list[ObjectInfo]:
        reply = _call(self._stub.SwapOut, pb.SwapOutRequest(items=[i.to_pb() for i in items]), self._metadata)
        return [ObjectInfo.from_pb(o) for o in reply.objects]

    def swap_out_async(self, items: Sequence[Out]) -> Future:
        """Start a batched swap-out; the future's result is the list of ObjectInfo."""
        call = self._stub.SwapOut.future(pb.SwapOutRequest(items=[i.to_pb() for i in items]), metadata=self._metadata)
        return wrap_future(call, lambda r: [ObjectInfo.from_pb(o) for o in r.objects])

    def swap_in(self, name: str, buffer: SharedBuffer, offset: int = 0, length: int | None = None,
                object_offset: int = 0) -> None:
        """Copy object bytes (from ``object_offset``; all the rest by default) into the buffer."""
        self.swap_in_many([In(name, buffer, offset, length, object_offset)])

    def swap_in_many(self, items: Sequence[In]) -> None:
        _call(self._stub.SwapIn, pb.SwapInRequest(items=[i.to_pb() for i in items]), self._metadata)

    def swap_in_async(self, items: Sequence[In]) -> Future:
        call = self._stub.SwapIn.future(pb.SwapInRequest(items=[i.to_pb() for i in items]), metadata=self._metadata)
        return wrap_future(call, lambda r: None)

    def delete(self, *names: str, missing_ok: bool = False) -> None:
        _call(self._stub.Delete, pb.DeleteRequest(names=list(names), missing_ok=missing_ok), self._metadata)

    def delete_async(self, *names: str) -> Future:
        """Delete objects (missing ones are fine) without waiting."""
        req = pb.DeleteRequest(names=list(names), missing_ok=True)
        return wrap_future(self._stub.Delete.future(req, metadata=self._metadata))

    def stat(self, name: str) -> ObjectInfo:
        return ObjectInfo.from_pb(_call(self._stub.Stat, pb.StatRequest(name=name), self._metadata))

    def objects(self, prefix: str = "") -> list[ObjectInfo]:
        reply = _call(self._stub.ListObjects, pb.ListObjectsRequest(prefix=prefix), self._metadata)
        return [ObjectInfo.from_pb(o) for o in reply.objects]

    # -- optimizer groups ---------------------------------------------------------------
    def create_group(self, name: str, weights: SharedBuffer, optimizer: AdamW | SGD, offset: int = 0,
                     numel: int | None = None, *, state: bool = False, step: int = 0) -> GroupInfo:
        """A parameter group whose fp32 master weights start as ``weights[offset:]`` and whose
        optimizer state lives on the SSD array (persistent object ``optim/<name>``).

        With ``state``, ``weights[offset:]`` holds the whole state of ``numel`` parameters
        instead (moments too, as the state object lays it out after its header:
        ``optimizer.state_bytes(numel) - HEADER`` bytes, what swap_in of ``optim/<g>``
        from ``weights_offset`` gives) and the group starts at step count ``step``: a
        job resuming at another world size re-shards its optimizer state so."""
        return self.create_group_async(name, weights, optimizer, offset, numel, state=state, step=step).result()

    def create_group_async(self, name: str, weights: SharedBuffer, optimizer: AdamW | SGD, offset: int = 0,
                           numel: int | None = None, *, state: bool = False, step: int = 0) -> Future:
        """``create_group`` without waiting: the future's result is the GroupInfo. The daemon
        reads ``weights`` until it is done (leave them unchanged until then)."""
        if state and numel is None:
            raise ValueError("create_group(state=True) needs numel: the buffer's size does not tell it")
        numel = (weights.size - offset) // 4 if numel is None else numel
        req = pb.CreateGroupRequest(name=name, optimizer=optimizer.to_pb(), weights=weights.ref, offset=offset,
                                    numel=numel, with_state=state, step=step)
        return wrap_future(self._stub.CreateGroup.future(req, metadata=self._metadata), GroupInfo.from_pb)

    def group(self, name: str) -> GroupInfo:
        """An existing group (also one created before a daemon restart)."""
        return GroupInfo.from_pb(_call(self._stub.GetGroup, pb.GetGroupRequest(name=name), self._metadata))

    def _step_request(self, name, grads, lr, grads_offset, grad_dtype, out, out_offset, out_dtype, grad_scale,
                      weights_object, hyper, masters=None, masters_offset=0, tensors=()):
        req = pb.StepGroupRequest(name=name, grads=grads.ref, grads_offset=grads_offset,
                                  grad_dtype=dtype_value(DTYPE_NAMES[grad_dtype]), lr=lr, weights_object=weights_object,
                                  out_dtype=dtype_value(DTYPE_NAMES[out_dtype]))
        if out is not None:
            req.weights_out.CopyFrom(out.ref)
            req.weights_out_offset = out_offset
        if grad_scale is not None:
            req.grad_scale = grad_scale
        if hyper is not None:
            req.hyper.CopyFrom(hyper.to_pb())
        if masters is not None:
            req.masters.CopyFrom(masters.ref)
            req.masters_offset = masters_offset
        req.tensors.extend(tensors)
        return req

    def step_group(self, name: str, grads: SharedBuffer, lr: float, *, grads_offset: int = 0,
                   grad_dtype=None, out: SharedBuffer | None = None, out_offset: int = 0, out_dtype=None,
                   grad_scale: float | None = None, hyper: AdamW | SGD | None = None) -> StepInfo:
        """One optimizer step of a group: gradients from ``grads`` (times ``grad_scale``), the
        new weights into ``out`` (in ``out_dtype``) when given. Blocks until committed."""
        return self.step_group_async(name, grads, lr, grads_offset=grads_offset, grad_dtype=grad_dtype, out=out,
                                     out_offset=out_offset, out_dtype=out_dtype, grad_scale=grad_scale,
                                     hyper=hyper).result()

    def step_group_async(self, name: str, grads: SharedBuffer, lr: float, *, grads_offset: int = 0,
                         grad_dtype=None, out: SharedBuffer | None = None, out_offset: int = 0, out_dtype=None,
                         grad_scale: float | None = None, weights_object: str = "",
                         hyper: AdamW | SGD | None = None, masters: SharedBuffer | None = None,
                         masters_offset: int = 0, tensors: Sequence[int] = ()) -> Future:
        """Submit a group's step; the future's result is a StepInfo. ``weights_object``
        names a transient object that receives the new weights (``out_dtype``) too.
        ``hyper``: this step's hyperparameters (``lr`` aside), where they differ from the
        group's (a scheduler changed them); the same optimizer and state dtype.
        ``masters``: the group's fp32 master weights at its current step (from
        ``masters_offset``), as this client read them: a step in chunks takes them from
        there instead of the SSD; leave them unchanged until the step is done. ``tensors``:
        the parameters behind the group's elements, (numel, offset, tensor numel) triples
        flat (GroupSpec.tensors), so that each is stepped as torch.optim steps it."""
        import torch

        req = self._step_request(name, grads, lr, grads_offset, grad_dtype or torch.float32, out, out_offset,
                                 out_dtype or torch.float32, grad_scale, weights_object, hyper, masters, masters_offset,
                                 tensors)
        return wrap_future(self._stub.StepGroup.future(req, metadata=self._metadata), StepInfo.from_pb)

    def status(self) -> pb.StatusReply:
        """The daemon's Status (engine, devices, memory, SSD bytes moved; its session list
        holds this session only)."""
        return _call(self._admin_stub.Status, pb.StatusRequest(), self._metadata)

    def fetch_weights_async(self, name: str, out: SharedBuffer, dtype, out_offset: int = 0) -> Future:
        """Ask the daemon for a group's weights (into ``out`` from byte ``out_offset``) from
        a read-ahead of its state (see the proto); the future's result says whether it
        served them."""
        req = pb.FetchWeightsRequest(name=name, out=out.ref, out_offset=out_offset,
                                     out_dtype=dtype_value(DTYPE_NAMES[dtype]))
        return wrap_future(self._stub.FetchWeights.future(req, metadata=self._metadata), lambda r: r.served)

    def checkpoint(self, directory: str | os.PathLike, timeout: float = 60.0, mode: str = "auto",
                   client_state: bytes = b"") -> pb.CheckpointReply:
        """Checkpoint this session's persistent objects (optimizer state included) into
        ``directory``, a new directory this process may create (connection/checkpoint_files.py: the
        client creates its files and hands them to the daemon, which writes only through
        them), at a point between optimizer steps. ``mode``: "snapshot" (the objects stay on
        the array, sharing extents: no copy), "copy" (files in the directory), "auto"
        (snapshot when the directory is on the array's filesystem and the daemon's store
        outlives it). See proto/fuyou.proto."""
        return checkpoint_files.write(self, directory, timeout, mode, client_state)

    def restore(self, directory: str | os.PathLike) -> pb.RestoreReply:
        """Bring a checkpoint's objects into this session's namespace (all or nothing)."""
        return checkpoint_files.restore(self, directory)

    def delete_checkpoint(self, directory: str | os.PathLike) -> None:
        """Remove a checkpoint: its directory and, for a snapshot, the extents it holds."""
        checkpoint_files.delete(self, directory)

    def hand(self, key: str, names: Sequence[str], fds: Sequence[int]) -> None:
        """Hand the daemon descriptors (``fds``, one per name; the caller keeps and closes its
        own) for the request that will name ``key`` (fuyoud/sessions/handed.py), and wait for
        the daemon to say it has them: the request that follows on the gRPC channel finds them."""
        if len(names) != len(fds):
            raise ValueError("one name per descriptor")
        per = MAX_FDS_PER_MESSAGE
        with self._send_lock:
            for start in range(0, max(len(fds), 1), per):
                message = {"hand": key, "names": list(names[start:start + per]), "last": start + per >= len(fds)}
                try:
                    socket.send_fds(self._sock, [json.dumps(message).encode()], list(fds[start:start + per]))
                except OSError as exc:
                    raise errors.DaemonUnavailable(f"cannot hand files to fuyoud on the session socket: {exc}") \
                        from None
        with self._seg_lock:
            while key not in self._acks:
                self._read_message(timeout=HAND_TIMEOUT)
            error = self._acks.pop(key)
        if error is not None:
            raise errors.from_code(error.get("code", "UNKNOWN"), error.get("message", "hand-over refused"))

    def call(self, method: str, request, timeout: float | None = None):
        """A unary call of service Fuyou as this session (errors as fuyou_client.errors)."""
        return _call(getattr(self._stub, method), request, self._metadata, timeout=timeout)

    def report_async(self, iterations: int, iteration_seconds: float, exposed_optimizer_seconds: float,
                     activation_bytes_to_host: int = 0, activation_bytes_to_ssd: int = 0) -> Future:
        """Tell the daemon this client's figures since its last report (its metrics
        export them: iterations, time waited for the optimizer, activation traffic)."""
        req = pb.ReportRequest(iterations=iterations, iteration_seconds=iteration_seconds,
                               exposed_optimizer_seconds=exposed_optimizer_seconds,
                               activation_bytes_to_host=activation_bytes_to_host,
                               activation_bytes_to_ssd=activation_bytes_to_ssd)
        return wrap_future(self._stub.Report.future(req, metadata=self._metadata))

    @property
    def stub(self) -> rpc.FuyouStub:
        """The raw gRPC stub (with ``metadata`` below) for calls this class does not wrap."""
        return self._stub

    @property
    def admin_stub(self) -> rpc.FuyouAdminStub:
        """The raw stub of the operator's service (Status, ListSessions, Drain)."""
        return self._admin_stub

    @property
    def metadata(self) -> tuple:
        return self._metadata

    # -- lifetime -------------------------------------------------------------------
    def close(self) -> None:
        """End the session: the daemon releases its memory and transient objects."""
        if self.closed:
            return
        try:
            self._stub.CloseSession(pb.Empty(), metadata=self._metadata, timeout=10)
        except grpc.RpcError:
            pass  # the daemon is gone or the session already ended: nothing left to release
        self.closed = True
        self._sock.close()
        self._channel.close()
        with self._seg_lock:
            for seg in self._segments.values():
                seg.close()
            self._segments.clear()

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def connect(socket_path: str | None = None, namespace: str | None = None, timeout: float = 10.0) -> Session:
    """Open a session with the daemon at ``socket_path`` (default: $FUYOUD_SOCKET or the
    default path). ``namespace`` names where persistent objects live; one live session at
    a time may hold a namespace."""
    return Session(socket_path, namespace, timeout)
