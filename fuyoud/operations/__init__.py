"""Running as a service: logs (logfmt, journald), the systemd notifications and watchdog,
the once-a-second chores, one reading of the daemon's state (``Snapshot``), the
Prometheus metrics, and installing the systemd unit (``fuyoud install-service``).

``Metrics`` is named here but imported when first asked for: it brings torch and
prometheus-client, and ``fuyoud``'s command line sets up its logs from this package
before it checks its arguments."""
from fuyoud.operations.housekeeping import Housekeeping
from fuyoud.operations.sdnotify import notify
from fuyoud.operations.snapshot import Snapshot
from fuyoud.operations.watchdog import Watchdog

__all__ = ["Housekeeping", "Metrics", "Snapshot", "Watchdog", "notify"]


def __getattr__(name: str):
    if name == "Metrics":
        from fuyoud.operations.metrics import Metrics
        return Metrics
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
