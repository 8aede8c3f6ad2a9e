"""Futures of the session's calls: a gRPC call as a concurrent.futures.Future raising
fuyou_client's errors, several as one, a future of a future as one."""
from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import Sequence

import grpc

from fuyou_client import errors


def wrap_future(call: grpc.Future, convert=lambda r: r) -> Future:
    """A concurrent.futures.Future that raises fuyou_client errors."""
    fut: Future = Future()

    def done(c: grpc.Future) -> None:
        if c.cancelled():  # (never by this client: a channel closed under it)
            fut.set_exception(errors.DaemonUnavailable("the request was cancelled: the session's channel closed"))
            return
        exc = c.exception()
        if exc is None:
            fut.set_result(convert(c.result()))
        elif isinstance(exc, grpc.RpcError):
            fut.set_exception(errors.from_rpc_error(exc))
        else:
            fut.set_exception(exc)

    call.add_done_callback(done)
    return fut


def all_of(futures: Sequence[Future], combine=list) -> Future:
    """One future for several: done when every one is (so that no buffer they use is
    reused early), with ``combine(results)``, or the first one's error."""
    out: Future = Future()
    left = [len(futures)]
    lock = threading.Lock()

    def one_done(_f: Future) -> None:
        with lock:
            left[0] -= 1
            if left[0]:
                return
        errors_ = [f.exception() for f in futures if f.exception() is not None]
        if errors_:
            out.set_exception(errors_[0])
        else:
            try:
                out.set_result(combine([f.result() for f in futures]))
            except Exception as exc:  # noqa: BLE001 - handed to the waiter
                out.set_exception(exc)

    for f in futures:
        f.add_done_callback(one_done)
    return out


def flatten(outer: Future) -> Future:
    """A future of a future's result, as one (a step submitted from a callback)."""
    out: Future = Future()

    def inner_done(inner: Future) -> None:
        exc = inner.exception()
        out.set_exception(exc) if exc is not None else out.set_result(inner.result())

    def outer_done(f: Future) -> None:
        exc = f.exception()
        if exc is not None:
            out.set_exception(exc)
        else:
            f.result().add_done_callback(inner_done)

    outer.add_done_callback(outer_done)
    return out
