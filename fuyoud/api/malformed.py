"""Requests whose bytes are not the message their method takes: INVALID_ARGUMENT.

gRPC's Python server parses a request with the method's deserializer before any servicer
code runs; when parsing raises, it answers INTERNAL ("Exception deserializing request!"),
which says the daemon failed where the client sent garbage. This interceptor wraps each
method's deserializer: bytes that do not parse become a marker, and the method answers
it with INVALID_ARGUMENT naming the message it expected, without running. Every service
the server has gets it (fuyou.Fuyou, fuyou.FuyouAdmin, grpc.health.v1.Health); a
streaming request's messages are checked one by one as they arrive.
"""
from __future__ import annotations

import logging
from typing import Callable

import grpc

log = logging.getLogger(__name__)


class _Malformed:
    """What a deserializer gives back for bytes that do not parse."""
    __slots__ = ("error", "size")

    def __init__(self, error: Exception, size: int):
        self.error, self.size = error, size


def _message(method: str, deserializer, bad: _Malformed) -> str:
    expected = getattr(getattr(deserializer, "__self__", None), "__name__", "its request message")
    return (f"malformed request to {method}: {bad.size} bytes that are not a valid {expected} "
            f"({type(bad.error).__name__})")


class MalformedRequests(grpc.ServerInterceptor):
    """``on_malformed(method)`` is called for each malformed request (for a metric)."""

    def __init__(self, on_malformed: Callable[[str], None] = lambda method: None):
        self._on_malformed = on_malformed

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        method, parse = handler_call_details.method, handler.request_deserializer

        def deserialize(data: bytes):
            try:
                return parse(data)
            except Exception as exc:  # noqa: BLE001 - any parse failure is the caller's bad bytes
                return _Malformed(exc, len(data))

        def refuse(bad: _Malformed, context: grpc.ServicerContext):
            self._on_malformed(method)
            text = _message(method, parse, bad)
            log.debug("%s", text)
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, text)

        def checked(messages, context):
            for m in messages:
                if isinstance(m, _Malformed):
                    refuse(m, context)
                yield m

        for kind in ("unary_unary", "unary_stream"):  # (one request message: checked before the method)
            inner = getattr(handler, kind)
            if inner is not None:
                def behaviour(request, context, inner=inner):
                    if isinstance(request, _Malformed):
                        refuse(request, context)
                    return inner(request, context)
                return handler._replace(request_deserializer=deserialize, **{kind: behaviour})
        if handler.stream_unary is not None:
            inner = handler.stream_unary
            return handler._replace(request_deserializer=deserialize,
                                    stream_unary=lambda it, context: inner(checked(it, context), context))
        inner = handler.stream_stream
        return handler._replace(request_deserializer=deserialize,
                                stream_stream=lambda it, context: inner(checked(it, context), context))
