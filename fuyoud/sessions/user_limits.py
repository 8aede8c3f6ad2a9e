"""What one user may take of the daemon, over all its sessions and training jobs
together ([limits]), and who a tenant is for the daemon's fair turns.

One user is one uid (SO_PEERCRED at the handshake: it cannot be claimed). Budgets per
session and quotas per namespace bound a session; nothing in them stops a user with
many sessions from holding the host. These do:

- ``user_sessions``: the sessions one uid holds at once (those closing included: they
  hold memory until they have given it back). Refused at the handshake.
- ``user_pinned``: the pinned memory one uid's sessions hold together (each session's
  reservation or its segments, whichever is larger, as the pool counts it). Refused at
  Reserve and Allocate (memory/pool.py).
- ``user_ssd``: the bytes one uid's namespaces hold on the SSD array (objects,
  snapshots, writes in flight). Refused when a write or a snapshot is allocated
  (storage/store.py).

Each is a number, a percentage of what it divides (the pinned budget; the array's
capacity: its data files plus what "auto" files may still grow by) or "auto": AUTO_SHARE
of it on a shared host (more than one user besides root and the daemon's own may open
a session: ``allow_uids`` and the members of the allowed group), none on a host with one
training user, who may use everything. A refusal names the limit, its setting and what
the user's sessions hold, and is counted by limit
(``fuyoud_user_limit_refusals_total{limit}``).

Fair turns (concurrency/fairness.py) go round users, then round each user's jobs: a
training job is a data-parallel rank's ``<job>.r<rank>`` without its rank, else the
namespace itself (``tenant``).
"""
from __future__ import annotations

import grp
import os
import pwd
from typing import Callable

from fuyoud.config import AUTO_SHARE, Share
from fuyoud.errors import UserLimitExceeded
from fuyoud.sessions.names import job_rank

# The limit a refusal met: the label of fuyoud_user_limit_refusals_total.
SESSIONS, PINNED, SSD = "sessions", "pinned", "ssd"
LIMITS = (SESSIONS, PINNED, SSD)


def training_users(allow_uids: list[int], group: str) -> set[int]:
    """The uids besides root and the daemon's own that may open a session: ``allow_uids``
    and the members of ``group`` (by name, else the daemon's own group): by its member
    list and by primary group."""
    users = set(allow_uids)
    try:
        g = grp.getgrnam(group) if group else grp.getgrgid(os.getgid())
    except KeyError:  # (a group with no entry, as under DynamicUser: nobody is a member by name)
        g = None
    if g is not None:
        for name in g.gr_mem:
            try:
                users.add(pwd.getpwnam(name).pw_uid)
            except KeyError:
                pass
        users.update(p.pw_uid for p in pwd.getpwall() if p.pw_gid == g.gr_gid)
    return users - {0, os.getuid()}


class UserLimits:
    """The [limits] of a running daemon, resolved: ``sessions`` a count, ``pinned`` bytes
    (0: none), ``ssd(capacity)`` bytes of an array of that capacity (0: none)."""

    def __init__(self, sessions: int, pinned: Share, ssd: Share, pinned_budget: int, shared: bool,
                 on_refused: Callable[[str], None] = lambda limit: None):
        self.sessions = sessions
        self.shared = shared
        self.pinned = pinned.of(pinned_budget, shared)
        self._pinned_share, self._ssd_share = pinned, ssd
        self._on_refused = on_refused

    @classmethod
    def from_config(cls, config, on_refused: Callable[[str], None] = lambda limit: None) -> "UserLimits":
        d, limits = config.daemon, config.limits
        shared = len(training_users(d.allow_uids, d.allow_group or d.socket_group)) > 1
        return cls(limits.user_sessions, Share.parse(limits.user_pinned), Share.parse(limits.user_ssd),
                   config.memory.pinned_budget, shared, on_refused)

    @property
    def limits_ssd(self) -> bool:
        """Whether user_ssd limits anything (``ssd`` is 0 for no limit)."""
        return self._ssd_share.of(1 << 62, self.shared) != 0

    def ssd(self, capacity: int) -> int:
        return self._ssd_share.of(capacity, self.shared)

    def refuse(self, limit: str, uid: int, holds: str, then: str) -> UserLimitExceeded:
        """The refusal (counted) of what would take uid ``uid`` past ``limit``: ``holds``
        says what it holds (and what it asked), ``then`` what to do."""
        assert limit in LIMITS, limit
        self._on_refused(limit)
        key = {SESSIONS: "user_sessions", PINNED: "user_pinned", SSD: "user_ssd"}[limit]
        setting = (f"[limits] user_sessions = {self.sessions}" if limit == SESSIONS
                   else (self._pinned_share if limit == PINNED else self._ssd_share).setting(key, self.shared))
        return UserLimitExceeded(f"uid {uid} {holds}, past the most one user may hold ({setting}); {then}")


def tenant(uid: int | None, namespace: str) -> tuple[int | None, str]:
    """(user, job) of a namespace held by ``uid``: whom the fair turns serve."""
    job, rank = job_rank(namespace)
    return uid, (job if rank is not None else namespace)
