"""Who a client is and what it may name: the rules for object names and namespaces (and
how a refused value is echoed), unnamed namespaces, the session registry and its reaper,
the session socket (handshake, fd passing, death detection), whether a session's process
is still there, and the namespaces on the SSD array."""
from fuyoud.sessions.listener import SessionListener
from fuyoud.sessions.names import check_name, check_namespace, job_rank, shown, valid_namespace
from fuyoud.sessions.registry import Session, SessionRegistry

__all__ = ["Session", "SessionListener", "SessionRegistry", "check_name", "check_namespace", "job_rank", "shown",
           "valid_namespace"]
