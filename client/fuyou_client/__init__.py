"""fuyou_client: the training process's side of Fuyou.

`connect()` opens a session with the host's fuyoud; `start_daemon()` runs a private one.
"""
from fuyou_client.buffers import SharedBuffer
from fuyou_client.checkpoints import load_exported
from fuyou_client.daemon import DaemonProcess, start_daemon
from fuyou_client.attach import attach
from fuyou_client.blockmajor import micro_batch_rng
from fuyou_client.engine import Engine
from fuyou_client.errors import (DaemonUnavailable, DataLoss, FailedPrecondition, FuyouClientError, InternalError,
                                 InvalidArgument, NamespaceBusy, NonFinite, ObjectNotFound, PermissionDenied,
                                 ResourceExhausted, SessionClosed)
from fuyou_client.optim import SGD, AdamW, GroupInfo, StepInfo
from fuyou_client.options import AttachOptions
from fuyou_client.session import In, ObjectInfo, Out, Session, connect
from fuyou_client.sizing import plan

__all__ = [
    "attach", "plan", "AttachOptions", "micro_batch_rng", "Engine", "load_exported", "connect", "Session", "AdamW", "SGD", "GroupInfo", "StepInfo",
    "SharedBuffer", "ObjectInfo", "In", "Out", "start_daemon", "DaemonProcess",
    "FuyouClientError", "DaemonUnavailable", "DataLoss", "FailedPrecondition", "InternalError", "InvalidArgument",
    "NamespaceBusy", "ObjectNotFound", "NonFinite", "PermissionDenied", "ResourceExhausted", "SessionClosed",
]
