"""What the daemon's parts share when they run at once: the threads a part starts (joined
before the daemon closes what they use) and turns shared fairly between sessions (the SSD
array's, the optimizer's compute)."""
from fuyoud.concurrency.fairness import FairTurns
from fuyoud.concurrency.threads import Threads

__all__ = ["FairTurns", "Threads"]
