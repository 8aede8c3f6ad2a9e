"""The gRPC servicer: proto/fuyou.proto's `Fuyou` service over the daemon's parts.

The data-plane methods are here, the operator ones (Status, ListSessions, Drain,
Checkpoint, Report) in fuyoud/api/admin.py. Every method here authenticates its session
from the `x-fuyou-session` metadata and checks that the objects it names are in the
session's namespace; fuyoud/api/handler.py maps FuyouError subclasses to their gRPC status
codes. Handlers are thin: the work is in the pool, the store and the session registry.
"""
from __future__ import annotations

import logging
import os

from fuyou_proto import pb, rpc
from fuyou_proto import dtype_name, state_dtype_name, state_dtype_value
from fuyou_proto.contract import SNAPSHOT_PREFIX, STATE_PREFIX, group_of
from fuyoud import failpoints
from fuyoud.api.checkpoints import CheckpointMethods
from fuyoud.api.handler import handler as _handler
from fuyoud.errors import InvalidArgument, PermissionDenied
from fuyoud.memory.pool import BufferRef
from fuyoud.optimizer.group import Group, itemsize, state_bytes
from fuyoud.optimizer.layout import HEADER
from fuyoud.optimizer.kernels import OptimizerSpec
from fuyoud.optimizer.tensors import Piece
from fuyoud.sessions.names import check_name as _check_name, shown
from fuyoud.storage.index import ObjectMeta
from fuyoud.storage.store import ReadItem, WriteItem

log = logging.getLogger(__name__)
MAX_ITEMS = 65536


def _ref(msg: pb.BufferRef) -> BufferRef:
    return BufferRef(msg.segment, msg.offset, msg.length, msg.generation)


RESERVED = {STATE_PREFIX: "optimizer groups", SNAPSHOT_PREFIX: "checkpoint snapshots"}


def _check_writable(name: str) -> str:
    """Names a client may write directly (the reserved prefixes belong to the daemon)."""
    for prefix, owner in RESERVED.items():
        if name.startswith(prefix):
            raise InvalidArgument(f"object names under {prefix!r} belong to {owner}: {shown(name)}")
    return name


def _spec(msg: pb.OptimizerSpec) -> OptimizerSpec:
    try:
        state_dtype = state_dtype_name(msg.state_dtype)
    except ValueError as exc:
        raise InvalidArgument(str(exc)) from None
    return OptimizerSpec(msg.kind, msg.beta1, msg.beta2, msg.eps, msg.weight_decay, msg.momentum,
                         msg.dampening, msg.nesterov, state_dtype)


def _dtype(value: int, what: str, needed: bool = True) -> str:
    """A request's DType as torch names it; "" for an unspecified one that is not
    ``needed``."""
    if not needed and value == pb.DTYPE_UNSPECIFIED:
        return ""
    try:
        return dtype_name(value)
    except ValueError as exc:
        raise InvalidArgument(f"{what}: {exc}") from None


def _pieces(values, group: Group) -> tuple[Piece, ...]:
    """A StepGroup's ``tensors``: (numel, offset, tensor numel) triples that cover the
    group's elements, each within its tensor; () for none."""
    if not values:
        return ()
    if len(values) % 3 or len(values) > 3 * MAX_ITEMS:
        raise InvalidArgument(f"tensors: {len(values)} numbers are not (numel, offset, tensor numel) triples "
                              f"(at most {MAX_ITEMS})")
    pieces = tuple(Piece(*values[i:i + 3]) for i in range(0, len(values), 3))
    for p in pieces:
        if not p.numel or p.offset + p.numel > p.tensor_numel:
            raise InvalidArgument(f"tensors: {p.numel} elements from offset {p.offset} do not fit a tensor of "
                                  f"{p.tensor_numel}")
    if sum(p.numel for p in pieces) != group.numel:
        raise InvalidArgument(f"tensors: the pieces hold {sum(p.numel for p in pieces)} elements, group "
                              f"{group.name!r} {group.numel}")
    return pieces


def group_info(group: Group, chunked: bool) -> pb.GroupInfo:
    spec = group.spec.to_dict()
    spec["state_dtype"] = state_dtype_value(spec["state_dtype"])
    return pb.GroupInfo(name=group.name, optimizer=pb.OptimizerSpec(**spec), numel=group.numel,
                        step=group.step, state_bytes=state_bytes(group.spec, group.numel), weights_offset=HEADER,
                        chunked=chunked)


def object_info(meta: ObjectMeta) -> pb.ObjectInfo:
    return pb.ObjectInfo(name=meta.name, namespace=meta.namespace, size=meta.size, persistent=meta.persistent,
                         devices=len(meta.layout.extents), version=meta.version)


class FuyouServicer(CheckpointMethods, rpc.FuyouServicer):
    @staticmethod
    def _namespace(session, requested: str) -> str:
        if requested and requested != session.namespace:
            raise PermissionDenied(
                f"namespace {shown(requested)} is not this session's ({session.namespace!r}): a session "
                "reaches only its own objects")
        return session.namespace

    def _items(self, items) -> None:
        if not items:
            raise InvalidArgument("request has no items")
        if len(items) > MAX_ITEMS:
            raise InvalidArgument(f"too many items in one request ({len(items)} > {MAX_ITEMS})")

    # Allocate and Reserve need no check that the session is still open: the pool refuses
    # a released session under its own lock, and what lands before the release goes with it.
    @_handler
    def Allocate(self, request, context):
        session = self._session(context)
        failpoints.hit("allocate.looked_up")
        ref, new_segment = self.pool.allocate(session.id, request.size, user=session.uid)
        if new_segment is not None:
            # The client must hold the segment before it can use the handle. (A duplicate of
            # its fd: a release racing in closes the segment's own, whose number could then
            # name another file.)
            fd = self.pool.segment_fd(session.id, new_segment)
            try:
                session.send_segment(new_segment.id, new_segment.size, fd)
            finally:
                os.close(fd)
        return pb.BufferRef(segment=ref.segment, offset=ref.offset, length=ref.length, generation=ref.generation)

    @_handler
    def Reserve(self, request, context):
        session = self._session(context)
        failpoints.hit("reserve.looked_up")
        reserved = self.pool.reserve(session.id, request.bytes, user=session.uid)
        return pb.ReserveReply(reserved_bytes=reserved, held_bytes=self.pool.usage().by_session.get(session.id, 0))

    @_handler
    def Free(self, request, context):
        session = self._session(context)
        self.pool.free(session.id, _ref(request))
        return pb.Empty()

    @_handler
    def SwapOut(self, request, context):
        session = self._session(context)
        self._items(request.items)
        pool = self.pool
        items, seen = [], set()
        for it in request.items:
            name = _check_name(it.name)
            _check_writable(name)
            if name in seen:
                raise InvalidArgument(f"object {shown(name)} appears twice in one SwapOut")
            seen.add(name)
            src = pool.view(session.id, _ref(it.buffer), it.offset, it.length or None)
            items.append(WriteItem(self._namespace(session, it.namespace), name, src, it.persistent, session.id))
        if any(it.persistent for it in items):
            self.sessions.claim_namespace(session)
        metas = self.store.write(items)
        if session.closed:  # the client died while we wrote: none of its transient objects may outlive it
            self.store.drop_transient(session.id)
        return pb.SwapOutReply(objects=[object_info(m) for m in metas])

    @_handler
    def SwapIn(self, request, context):
        session = self._session(context)
        self._items(request.items)
        store, pool = self.store, self.pool
        items = []
        for it in request.items:
            namespace, name = self._namespace(session, it.namespace), _check_name(it.name)
            length = it.length
            if not length:
                size = store.stat(namespace, name).size
                if it.object_offset > size:
                    raise InvalidArgument(f"object offset {it.object_offset} is past the end of "
                                          f"{shown(it.name)} ({size} bytes)")
                length = size - it.object_offset
            dst = pool.view(session.id, _ref(it.buffer), it.offset, length)
            items.append(ReadItem(namespace, name, dst, it.object_offset))
        store.read(items)
        return pb.Empty()

    @_handler
    def Delete(self, request, context):
        session = self._session(context)
        namespace = self._namespace(session, request.namespace)
        names = [_check_name(n) for n in request.names]
        self.store.delete(namespace, names, request.missing_ok)
        for n in names:
            if n.startswith(STATE_PREFIX):
                self.optimizer.forget(namespace, group_of(n))
        return pb.Empty()

    @_handler
    def Stat(self, request, context):
        session = self._session(context)
        namespace = self._namespace(session, request.namespace)
        return object_info(self.store.stat(namespace, _check_name(request.name)))

    @_handler
    def ListObjects(self, request, context):
        session = self._session(context)
        metas = self.store.list(self._namespace(session, request.namespace), request.prefix)
        return pb.ListObjectsReply(objects=[object_info(m) for m in metas])

    @_handler
    def CreateGroup(self, request, context):
        session = self._session(context)
        name = _check_name(request.name)
        spec, numel = _spec(request.optimizer), request.numel
        if request.step and not request.with_state:
            raise InvalidArgument(f"group {shown(name)}: step {request.step} without with_state (a group created "
                                  "from weights only starts at step 0)")
        if request.with_state:
            nbytes = state_bytes(spec, numel) - HEADER
            what = f"the whole state of {numel} parameters ({spec.kind}, state dtype {spec.state_dtype})"
        else:
            nbytes, what = numel * 4, f"the fp32 weights of {numel} parameters"
        try:
            body = self.pool.view(session.id, _ref(request.weights), request.offset, nbytes)
        except InvalidArgument as exc:
            raise InvalidArgument(f"group {shown(name)}: {what} take {nbytes} bytes from offset {request.offset}: "
                                  f"{exc}") from None
        self.sessions.claim_namespace(session)
        group = self.optimizer.create(session.namespace, session.id, name, spec, body, numel, request.step)
        return group_info(group, self.optimizer.chunked(group))

    @_handler
    def GetGroup(self, request, context):
        session = self._session(context)
        group = self.optimizer.get(session.namespace, _check_name(request.name))
        return group_info(group, self.optimizer.chunked(group))

    @_handler
    def StepGroup(self, request, context):
        session = self._session(context)
        pool, opt = self.pool, self.optimizer
        group = opt.get(session.namespace, _check_name(request.name))
        grad_dtype = _dtype(request.grad_dtype, "grad_dtype")
        out_dtype = _dtype(request.out_dtype, "out_dtype",
                           needed=request.HasField("weights_out") or bool(request.weights_object))
        grads = pool.view(session.id, _ref(request.grads), request.grads_offset, group.numel * itemsize(grad_dtype))
        out = None
        if request.HasField("weights_out"):
            out = pool.view(session.id, _ref(request.weights_out), request.weights_out_offset,
                            group.numel * itemsize(out_dtype))
        scale = request.grad_scale if request.HasField("grad_scale") else 1.0
        weights_object = ""
        if request.weights_object:
            weights_object = _check_writable(_check_name(request.weights_object))
        hyper = _spec(request.hyper) if request.HasField("hyper") else None
        masters = None
        if request.HasField("masters"):
            masters = pool.view(session.id, _ref(request.masters), request.masters_offset, group.numel * 4)
        result = opt.step(group, grads, grad_dtype, out, out_dtype, request.lr, scale, session.id, weights_object,
                          hyper, masters, _pieces(request.tensors, group))
        self.metrics.observe_step(result)
        return pb.StepGroupReply(step=result.step, read_seconds=result.read_s, compute_seconds=result.compute_s,
                                 write_seconds=result.write_s, prefetched=result.prefetched,
                                 cached_bytes=result.cached_bytes, masters_bytes=result.masters_bytes)

    @_handler
    def FetchWeights(self, request, context):
        session = self._session(context)
        group = self.optimizer.get(session.namespace, _check_name(request.name))
        out_dtype = _dtype(request.out_dtype, "out_dtype")
        out = self.pool.view(session.id, _ref(request.out), request.out_offset, group.numel * itemsize(out_dtype))
        return pb.FetchWeightsReply(served=self.optimizer.fetch_weights(group, out, out_dtype))

    @_handler
    def CloseSession(self, request, context):
        session = self._session(context)
        self.sessions.close(session, "closed by client")
        return pb.Empty()
