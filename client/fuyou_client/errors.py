"""Exceptions of fuyou_client: one per failure a caller can act on differently."""
from __future__ import annotations

import grpc
import torch


class FuyouClientError(Exception):
    """Base class. ``code`` is the daemon's gRPC status code name where there is one."""

    code = "UNKNOWN"


class InvalidArgument(FuyouClientError, ValueError):
    """A request the daemon refused as malformed (or, for optimizer settings such as
    ``AdamW(eps=nan)``, that the client refuses before sending it): a ValueError."""
    code = "INVALID_ARGUMENT"


class ObjectNotFound(FuyouClientError, KeyError):
    code = "NOT_FOUND"

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class PermissionDenied(FuyouClientError):
    code = "PERMISSION_DENIED"


class NamespaceBusy(FuyouClientError):
    code = "ALREADY_EXISTS"


class ResourceExhausted(FuyouClientError):
    """A pinned-memory budget is spent or the SSD array is full."""
    code = "RESOURCE_EXHAUSTED"


class DeviceOutOfMemory(ResourceExhausted, torch.OutOfMemoryError):
    """The compute device ran out of memory in a step the device plan admitted (something
    else took memory after attach): the message names the plan's figures and what was
    allocated; it is a ``torch.OutOfMemoryError`` too, as the error it stands for."""


class DataLoss(FuyouClientError):
    """The SSD failed a transfer; the message names the device and the object."""
    code = "DATA_LOSS"


class NonFinite(FuyouClientError, FloatingPointError):
    """A step refused because it would have put NaN or infinite values into the optimizer
    state: by the daemon (that group's gradients or update were not finite; its committed
    state and step count are kept), or by ``engine.step()`` with ``max_grad_norm`` (the
    global gradient norm was not finite; no group stepped). The message names the groups.
    Loss scaling's skip: ``except NonFinite: engine.zero_grad(); continue``."""
    code = "OUT_OF_RANGE"


class DaemonUnavailable(FuyouClientError):
    """No daemon at the socket, or it died or is shutting down."""
    code = "UNAVAILABLE"


class SessionClosed(FuyouClientError):
    code = "UNAUTHENTICATED"


class FailedPrecondition(FuyouClientError):
    """Well formed, but not now: e.g. a checkpoint whose groups did not reach a common
    step within its timeout. Retrying later can succeed."""
    code = "FAILED_PRECONDITION"


class InternalError(FuyouClientError):
    """A bug in fuyoud; its log has the traceback."""
    code = "INTERNAL"


# One class per status code the daemon sends (fuyou_proto.contract.ERROR_CODES).
BY_CODE = {cls.code: cls for cls in (InvalidArgument, ObjectNotFound, PermissionDenied, NamespaceBusy,
                                     ResourceExhausted, DataLoss, NonFinite, DaemonUnavailable, SessionClosed,
                                     FailedPrecondition, InternalError)}


def from_code(code: str, message: str) -> FuyouClientError:
    return BY_CODE.get(code, FuyouClientError)(message)


# What gRPC's transport says, with INTERNAL, of a stream reset or dropped under a call.
TRANSPORT_RESETS = ("RST_STREAM", "Stream removed", "Socket closed", "Connection reset")


def from_rpc_error(exc: grpc.RpcError) -> FuyouClientError:
    code = exc.code()
    if code == grpc.StatusCode.UNAVAILABLE:
        details = exc.details() or ""
        if details.startswith("fuyoud is"):  # the daemon's own word: draining, shutting down
            return DaemonUnavailable(details)
        return DaemonUnavailable(
            f"fuyoud is not reachable ({details}). If it died, everything it committed is safe on the SSD "
            "array: restart it (systemctl restart fuyoud, or fuyou_client.start_daemon on the same state "
            "directory) and continue with attach(model, resume=DIR) from your last engine.save_checkpoint(DIR)")
    if code == grpc.StatusCode.INTERNAL and any(t in (exc.details() or "") for t in TRANSPORT_RESETS):
        # (gRPC's own INTERNAL for a stream the other end reset or dropped mid-call: the daemon
        # stopped or died under it; fuyoud's own INTERNAL says "internal error in <method>")
        return DaemonUnavailable(
            f"fuyoud's connection broke during this request ({exc.details()}): it stopped or died. Everything it "
            "committed is safe on the SSD array: once fuyoud runs again, continue with attach(model, resume=DIR) "
            "from your last engine.save_checkpoint(DIR)")
    if code == grpc.StatusCode.CANCELLED:  # (the client cancels none of its calls: the daemon, stopping, did)
        return DaemonUnavailable(
            f"fuyoud cancelled this request ({exc.details() or 'CANCELLED'}): it is stopping and the request ran "
            "past its grace period. Everything it committed is safe on the SSD array: once fuyoud runs again, "
            "continue with attach(model, resume=DIR) from your last engine.save_checkpoint(DIR)")
    err = from_code(code.name, exc.details() or code.name)
    err.code = code.name
    return err
