"""fuyouctl: the operator's command line, a client of a running fuyoud (its admin service,
over the control socket) and of the planner (``fuyouctl plan``). It lives beside the
training process's package, not in the daemon's: it uses both the daemon's config and the
client's planner, and neither of those packages imports the other."""
from fuyouctl.cli import main, parser

__all__ = ["main", "parser"]
