"""The resources an iteration is replayed on (iteration.py): in-order ones (the GPU's
compute stream, its copy engines, the SSD array, ...) on a ``Timeline``, and fuyoud's
steps (``Daemon``: state read ahead into a few optimizer buffers, stepped, written back)."""
from __future__ import annotations

from collections import Counter

GB = 1e9


class Timeline:
    """In-order resources: an operation starts when its resource has finished the one before and
    its inputs are ready ((time, cause) pairs). A gap of the GPU is charged to its inputs in the
    order they arrive, each for the time from the one before it to its own arrival."""

    def __init__(self):
        self.free: dict[str, float] = {}
        self.busy, self.stalls, self.bytes = Counter(), Counter(), Counter()

    def op(self, resource: str, seconds: float, *ready: tuple[float, str]) -> float:
        start = self.free.get(resource, 0.0)
        for when, cause in sorted(ready, key=lambda r: r[0]):
            if when > start:
                self.stalls[cause] += (when - start) * (resource == "gpu")
                start = when
        self.free[resource] = start + seconds
        self.busy[resource] += seconds
        return self.free[resource]

    def move(self, link: str, what: str, nbytes: float) -> None:
        self.bytes[f"{link}: {what}"] += nbytes


class Daemon:
    """fuyoud's steps: a group's state (``io[g]``: bytes read, written) is read into one of
    ``buffers`` optimizer buffers once asked for and a buffer is free (reads in step order),
    stepped once its gradients are there, and written back. Groups in ``in_memory`` keep
    their state in host memory: AdamW only."""

    def __init__(self, t: Timeline, r, order: list, sizes: dict, io: dict, in_memory=()):  # (r: iteration.Rates)
        self.t, self.r, self.sizes, self.io, self.buffers = t, r, sizes, io, r.optimizer_buffers
        self.queue, self.in_memory = [g for g in order if g not in in_memory], set(in_memory)
        self.asked, self.read, self.written, self.ends = {}, {}, [], []

    def ask(self, group, when: float) -> None:
        self.asked.setdefault(group, when)
        while len(self.read) < min(len(self.queue), len(self.written) + self.buffers) \
                and self.queue[len(self.read)] in self.asked:
            i, g = len(self.read), self.queue[len(self.read)]
            free = self.written[i - self.buffers] if i >= self.buffers else 0.0
            self.t.move("ssd", "read state", self.io[g][0])
            self.read[g] = self.t.op("ssd", self.io[g][0] / self.r.ssd_read / GB, (self.asked[g], ""), (free, ""))

    def step(self, group, grads: float) -> float:
        n = self.sizes[group]
        if group in self.in_memory:
            self.ends.append(self.t.op("adam", n / self.r.adam, (grads, "")))
            return self.ends[-1]
        self.ask(group, grads)
        adam = self.t.op("adam", n / self.r.adam, (grads, ""), (self.read[group], ""))
        nbytes, state = self.io[group][1], self.io[group][0]
        self.t.move("ssd", "write state" + " and weights" * (nbytes > state), nbytes)
        self.written.append(self.t.op("ssd", nbytes / self.r.ssd_write / GB, (adam, "")))
        self.ends.append(self.written[-1])
        self.ask(group, grads)  # (its buffer is free: the next read may go)
        return self.ends[-1]
