"""What ``Engine.close`` does with the parameters: no parameter is left a view of the
shared memory that goes with the session (it would read zeros after close), and none
holds weights that may not be its trained ones.

A resident group's parameters are copied out of shared memory whatever ``materialize``
says; an offloaded group's are read back from the SSD array with ``materialize``, else
empty placeholders. A step still in flight lands first when it can; a group whose weights
in this process may not be its trained ones (a step whose outcome is unknown, new weights
that only a collective close does not run would bring, a read that failed) becomes empty
placeholders, and close raises naming it (``lost_weights``).
"""
from __future__ import annotations

import contextlib

import torch

from fuyou_client.errors import DaemonUnavailable, FuyouClientError, SessionClosed
from fuyou_client.groups import land_new_weights


def _known(exc: BaseException) -> bool:
    """The daemon's own outcome (a refused or failed step): its weights and committed state agree."""
    return isinstance(exc, FuyouClientError) and not isinstance(exc, (DaemonUnavailable, SessionClosed))


def settle_in_flight(groups, strategies, device, data_parallel: bool) -> dict:
    """Land the steps still in flight into the parameters held in this process (shared
    memory, a device copy, an offload="host" buffer); returns {group name: error or None}
    of the groups whose weights here may not be their trained ones."""
    lost: dict[str, BaseException | None] = {}
    in_process = [g for g in groups if g.offloaded is None or g.offloaded.host is not None]
    for g in in_process:
        if g.future is None:
            continue
        exc = g.future.exception()
        if exc is not None and not _known(exc):
            lost[g.spec.name] = exc
        elif data_parallel and g.offloaded is None:
            lost[g.spec.name] = exc  # (the shards' new weights: gathered at the barrier only)
        elif exc is None and not g.strategy.lands_weights:
            try:
                land_new_weights(device, g)  # (GPU: into the parameters)
            except Exception as failed:  # noqa: BLE001 - raised by close, the group named
                lost[g.spec.name] = failed
    kept_errors: list = []
    stepped: set = set()
    for strategy in strategies:  # (steps whose futures a strategy kept)
        results, errors = strategy.reclaim()
        stepped.update(results)
        kept_errors.extend(errors)
    unknown = next((e for e in kept_errors if not _known(e)), None)
    if unknown is not None:  # (a kept step's error does not name its group)
        for g in in_process:
            if g.submitted and g.future is None and g.spec.name not in stepped:
                lost.setdefault(g.spec.name, unknown)
    return lost


def detach_parameters(groups, offloader, materialize: bool, lost: dict) -> dict:
    """The parameters out of shared memory: a resident group's cloned (its trained
    weights), an offloaded group's read from the SSD array with ``materialize`` (else
    empty placeholders). The groups in ``lost``, and offloaded groups whose read fails,
    become empty placeholders. Never raises for a group: returns {name: error} of the
    groups whose read failed."""
    failed: dict[str, BaseException] = {}
    with torch.no_grad():
        for g in groups:
            og = g.offloaded
            keep = g.spec.name not in lost and (og is None or materialize)
            if og is not None and keep:
                try:
                    offloader.ensure(og)
                except Exception as exc:  # noqa: BLE001 - close raises, naming the group
                    failed[g.spec.name] = exc
                    keep = False
            for p in (og.params if og is not None else [p for _, p in g.spec.params]):
                p.grad = None
                if keep:
                    if p.data.numel():
                        p.data = p.data.clone()
                elif og is None:
                    p.data = torch.empty(0, dtype=p.dtype, device=p.device)
            if og is not None:
                with contextlib.suppress(Exception):
                    offloader.release(og, keep_params=keep, cache=False)
                if not keep:
                    for p, placeholder in zip(og.params, og.placeholders):
                        p.data = placeholder
    return failed


def lost_weights(lost: dict) -> RuntimeError:
    """The error close raises for the groups whose parameters it emptied."""
    cause = next((e for e in lost.values() if e is not None), None)
    why = f"{type(cause).__name__}: {str(cause).splitlines()[0][:200]}" if cause is not None else \
        "a step in flight, its new weights not gathered from the ranks"
    error = RuntimeError(
        f"engine.close(): the weights of group(s) {', '.join(sorted(lost))} in this process may not be their trained "
        f"ones ({why}), so their parameters are empty placeholders now; the daemon's committed state has the "
        "trained weights: attach(model, resume=...) from a checkpoint, or call engine.step() before close()")
    error.__cause__ = cause
    return error
