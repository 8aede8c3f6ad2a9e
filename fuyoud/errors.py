"""Errors the daemon reports to clients. Each carries the gRPC status code it maps to;
the message says what was wrong and, where it helps, what to do."""
from __future__ import annotations

import grpc


class FuyouError(Exception):
    code: grpc.StatusCode = grpc.StatusCode.INTERNAL
    kind: str = "internal"  # bounded label value for fuyoud_errors_total


class InvalidArgument(FuyouError):
    code, kind = grpc.StatusCode.INVALID_ARGUMENT, "invalid_argument"


class NotFound(FuyouError):
    code, kind = grpc.StatusCode.NOT_FOUND, "not_found"


class AlreadyExists(FuyouError):
    code, kind = grpc.StatusCode.ALREADY_EXISTS, "already_exists"


class PermissionDenied(FuyouError):
    code, kind = grpc.StatusCode.PERMISSION_DENIED, "permission_denied"


class Unauthenticated(FuyouError):
    code, kind = grpc.StatusCode.UNAUTHENTICATED, "unauthenticated"


class NonFinite(FuyouError):
    """A step would have put NaN or infinite values into an optimizer state: refused, the
    committed state kept."""
    code, kind = grpc.StatusCode.OUT_OF_RANGE, "non_finite"


class ResourceExhausted(FuyouError):
    code, kind = grpc.StatusCode.RESOURCE_EXHAUSTED, "resource_exhausted"


class OutOfMemoryBudget(ResourceExhausted):
    kind = "memory_budget"


class StorageFull(ResourceExhausted):
    kind = "storage_full"


class QuotaExceeded(ResourceExhausted):
    kind = "quota"


class UserLimitExceeded(ResourceExhausted):
    """One user's sessions together would pass a [limits] limit (sessions/user_limits.py)."""
    kind = "user_limit"


class DataLoss(FuyouError):
    """The SSD failed a transfer (errno) or returned fewer bytes than asked."""
    code, kind = grpc.StatusCode.DATA_LOSS, "io_error"


class ChecksumMismatch(DataLoss):
    """Bytes read back do not match the checksum committed with them."""
    kind = "checksum"


class Unavailable(FuyouError):
    code, kind = grpc.StatusCode.UNAVAILABLE, "unavailable"


class FailedPrecondition(FuyouError):
    """The request is well formed but the system is not in a state to serve it."""
    code, kind = grpc.StatusCode.FAILED_PRECONDITION, "failed_precondition"
