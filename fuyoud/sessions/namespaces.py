"""Namespaces as the operator sees them (fuyouctl namespaces, delete-namespace): what each
holds on the SSD array, and deleting one's state.

A namespace's *state* is every object in it but its snapshot checkpoints' (those share
extents with the state and go when the checkpoint is deleted). A namespace with neither
has no owner either: its owner row goes with its last object.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

from fuyou_proto.contract import SNAPSHOT_PREFIX
from fuyoud.errors import InvalidArgument, NotFound
from fuyoud.sessions.names import shown, valid_namespace
from fuyoud.units import format_size

log = logging.getLogger(__name__)


@dataclass
class NamespaceUsage:
    name: str
    owner: int | None
    unnamed: bool = False  # the daemon named it, for a session that named none
    objects: int = 0
    bytes: int = 0
    snapshot_objects: int = 0
    snapshot_bytes: int = 0
    session_id: int = 0  # the live session holding it, 0: none
    checkpoints: int = 0


def survey(store, sessions) -> list[NamespaceUsage]:
    """Every namespace with objects or a recorded owner, by name."""
    index = store.index_db
    live = {s.namespace: s for s in sessions.all()}
    checkpoints = index.checkpoint_counts()
    unnamed = index.unnamed_namespaces() | {s.namespace for s in live.values() if s.ephemeral}
    found = []
    for name in sorted(store.namespaces() | set(index.owned_namespaces())):
        u = NamespaceUsage(name, index.namespace_owner(name), name in unnamed,
                           session_id=live[name].id if name in live else 0, checkpoints=checkpoints.get(name, 0))
        for m in store.list(name):
            if m.name.startswith(SNAPSHOT_PREFIX):
                u.snapshot_objects, u.snapshot_bytes = u.snapshot_objects + 1, u.snapshot_bytes + m.size
            else:
                u.objects, u.bytes = u.objects + 1, u.bytes + m.size
        found.append(u)
    return found


def delete_state(store, namespace: str) -> tuple[int, int]:
    """Delete a namespace's state (not its snapshot checkpoints' objects) and forget its
    owner once nothing of it stays. No live session may hold it. Returns (objects, bytes)."""
    state = [m for m in store.list(namespace) if not m.name.startswith(SNAPSHOT_PREFIX)]
    store.delete(namespace, [m.name for m in state], missing_ok=True)
    if not store.list(namespace):
        store.index_db.release_namespace(namespace)
    return len(state), sum(m.size for m in state)


def delete(store, optimizer, sessions, namespace: str) -> tuple[int, int, int]:
    """The operator's delete: refused while a live session holds the namespace, and no
    session may open it meanwhile. Returns (objects, bytes) deleted and the snapshot
    objects kept."""
    if not valid_namespace(namespace):
        raise InvalidArgument(f"bad namespace {shown(namespace)}")
    if namespace not in store.namespaces() and store.index_db.namespace_owner(namespace) is None:
        raise NotFound(f"no namespace {shown(namespace)} on the SSD array (fuyouctl namespaces lists them)")
    with sessions.withheld(namespace):
        optimizer.forget(namespace)
        count, size = delete_state(store, namespace)
        kept = len(store.list(namespace))
    log.info("namespace %s deleted by the operator: %d objects (%s); %d objects of its snapshot checkpoints kept",
             namespace, count, format_size(size), kept)
    return count, size, kept


def reclaim_left_behind(store) -> int:
    """At start-up: delete the state of every namespace an earlier daemon named (for a
    session that named none) and left (it stopped without closing the session; every
    session of it is over). The index records which they are: a name alone could be a
    client's, chosen before the daemon kept the form. Returns the bytes freed."""
    freed = 0
    for namespace in sorted(store.index_db.unnamed_namespaces()):
        count, size = delete_state(store, namespace)
        freed += size
        if count:
            log.warning("deleted the %d objects (%s) of %s, the unnamed namespace of a session of an earlier "
                        "fuyoud that stopped without closing it", count, format_size(size), namespace)
    return freed
