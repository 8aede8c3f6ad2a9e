"""fuyou_client: the training process's side of Fuyou.

``attach(model)`` hooks a model up to the host's fuyoud; ``connect()`` opens a session
with it; ``start_daemon()`` runs a private one. The subpackages, in the order their
imports flow (each imports only those before it): connection, device, model, memory,
offload, gradients, groups, steps, activations, blockmajor, checkpoints, parallel,
sizing, engine, integrations (docs/architecture.md).
"""
from fuyou_client.blockmajor import micro_batch_rng
from fuyou_client.checkpoints import load_exported
from fuyou_client.connection import DaemonProcess, In, ObjectInfo, Out, Session, SharedBuffer, connect, start_daemon
from fuyou_client.engine import AttachOptions, Engine, attach, attach_frozen, serve_optimizer
from fuyou_client.errors import (DaemonUnavailable, DataLoss, FailedPrecondition, FuyouClientError, InternalError,
                                 InvalidArgument, NamespaceBusy, NonFinite, ObjectNotFound, PermissionDenied,
                                 ResourceExhausted, SessionClosed)
from fuyou_client.optim import SGD, AdamW, GroupInfo, StepInfo
from fuyou_client.sizing import plan

__all__ = [
    "attach", "attach_frozen", "serve_optimizer", "plan", "AttachOptions", "micro_batch_rng", "Engine", "load_exported", "connect", "Session", "AdamW", "SGD", "GroupInfo", "StepInfo",
    "SharedBuffer", "ObjectInfo", "In", "Out", "start_daemon", "DaemonProcess",
    "FuyouClientError", "DaemonUnavailable", "DataLoss", "FailedPrecondition", "InternalError", "InvalidArgument",
    "NamespaceBusy", "ObjectNotFound", "NonFinite", "PermissionDenied", "ResourceExhausted", "SessionClosed",
]
