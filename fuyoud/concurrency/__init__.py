"""What the daemon's parts share when they run at once: the threads a part starts (joined
before the daemon closes what they use), a fixed set of them running jobs (work that may
block, handed off by a thread that must not), one thread serving many descriptors, and
turns shared fairly between sessions (the SSD array's, the optimizer's compute)."""
from fuyoud.concurrency.fairness import FairTurns
from fuyoud.concurrency.loop import EventLoop
from fuyoud.concurrency.threads import Threads
from fuyoud.concurrency.workers import Workers

__all__ = ["EventLoop", "FairTurns", "Threads", "Workers"]
