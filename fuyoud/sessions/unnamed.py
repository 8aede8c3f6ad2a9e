"""Unnamed namespaces: the ones the daemon names for sessions that name none.

Nobody can come back to such a namespace (a client cannot name it: the form
``session-<id>-<8 hex digits>`` is the daemon's alone), so what it holds goes when its
session closes, but for the objects of its snapshot checkpoints, which go when the
checkpoint is deleted; and where a daemon died with such sessions live (SIGKILL, the OOM
killer, a power cut), at its next start (namespaces.reclaim_left_behind). The index
records which namespaces the daemon named (IndexDB.claim_namespace): what it deletes
never rests on the name alone, which a client could have chosen before the form was
kept.
"""
from __future__ import annotations

import re
import secrets

from fuyoud.errors import InvalidArgument
from fuyoud.sessions.names import shown

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
