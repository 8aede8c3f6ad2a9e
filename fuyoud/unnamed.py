"""Unnamed namespaces: the ones the daemon names for sessions that name none.

Nobody can come back to such a namespace (a client cannot name it: the form
``session-<id>-<8 hex digits>`` is the daemon's alone), so what it holds goes when its
session closes, but for the objects of its snapshot checkpoints, which go when the
checkpoint is deleted. A daemon that died with such sessions live (SIGKILL, the OOM
killer, a power cut) left their state on the SSDs: the next start reclaims it, which the
name alone allows, since every session of an earlier daemon is over.
"""
from __future__ import annotations

import logging
import re
import secrets

from fuyou_proto.contract import SNAPSHOT_PREFIX
from fuyoud.errors import InvalidArgument
from fuyoud.names import shown
from fuyoud.units import format_size

log = logging.getLogger(__name__)

UNNAMED_RE = re.compile(r"^session-[0-9]+-[0-9a-f]{8}$")


def unnamed_namespace(session_id: int) -> str:
    return f"session-{session_id}-{secrets.token_hex(4)}"


def is_unnamed(namespace: str) -> bool:
    return UNNAMED_RE.match(namespace) is not None


def refuse_unnamed(namespace: str) -> None:
    """A client may not name a namespace of the daemon's form."""
    if is_unnamed(namespace):
        raise InvalidArgument(f"namespace {shown(namespace)} has the form session-<n>-<8 hex digits>, which fuyoud "
                              "keeps for sessions that name no namespace (their state goes when they close): "
                              "choose another name")


def reclaim(store, namespace: str) -> tuple[int, int]:
    """Delete what an unnamed namespace holds but its snapshot checkpoints' objects, and
    forget its owner once nothing of it stays. Returns (objects, bytes) deleted."""
    left = [m for m in store.list(namespace) if not m.name.startswith(SNAPSHOT_PREFIX)]
    store.delete(namespace, [m.name for m in left], missing_ok=True)
    if not store.list(namespace):
        store.index_db.release_namespace(namespace)
    return len(left), sum(m.size for m in left)


def reclaim_left_behind(store) -> int:
    """At start-up: reclaim every unnamed namespace an earlier daemon left (it stopped
    without closing their sessions). Returns the bytes freed."""
    freed = 0
    for namespace in sorted(set(store.namespaces()) | set(store.index_db.owned_namespaces())):
        if is_unnamed(namespace):
            count, size = reclaim(store, namespace)
            freed += size
            if count:
                log.warning("deleted the %d objects (%s) of %s, the unnamed namespace of a session of an earlier "
                            "fuyoud that stopped without closing it", count, format_size(size), namespace)
    return freed
