"""The rule that keeps a checkpoint from depending on storage that is going away.

A snapshot checkpoint copies nothing: it is index rows that share the live objects'
extents on the daemon's SSD array, so it lives exactly as long as that daemon's store.
A *temporary* daemon deletes its store when it stops: ``start_daemon()`` without a
``state_dir`` (the docs' examples, the tests, a notebook) starts fuyoud with
``--remove-when-stopped`` for the directories it made. A snapshot taken there would look
complete and be lost with the daemon.

The daemon knows its store's life and says it (``StatusReply.store_outlives_daemon``); it
also resolves mode "auto" to a copy where its store goes with it. The client reads no
``/proc`` and no daemon configuration: this module only asks the daemon's status.
Asking for ``mode="snapshot"`` explicitly is still honoured.
"""
from __future__ import annotations


def store_goes_with_daemon(status) -> bool:
    """Whether the daemon whose ``StatusReply`` this is deletes its store when it stops."""
    return not status.store_outlives_daemon


def checkpoint_mode(session, mode: str) -> str:
    """The mode to ask the daemon for: "auto" stays "auto" (the daemon resolves it: a copy
    where its store goes with it, a snapshot on its array's filesystem otherwise)."""
    return mode
