"""Who computes when, in a ``train_step`` (schedule.py): each micro-batch's forward runs in
a thread of its own and exactly one computes at a time, in block-major order (``Turns``);
each micro-batch draws its dropout from generators of its own (``micro_batch_rng``)."""
from __future__ import annotations

import threading
from contextlib import contextmanager

import torch


@contextmanager
def micro_batch_rng(seed: int, k: int, device: torch.device | None = None):
    """The generators micro-batch ``k`` of a ``train_step`` whose seed was ``seed`` draws
    from: ``with micro_batch_rng(seed, k): loss_fn(mb).backward()`` in an ordinary loop
    draws the same dropout masks. The default generators are restored after."""
    cuda = device is not None and device.type == "cuda"
    with torch.random.fork_rng(devices=[device.index or 0] if cuda else [], device_type="cuda"):
        seed_generators(seed + k, device if cuda else None)
        yield


def seed_generators(seed: int, cuda: torch.device | None) -> None:
    torch.default_generator.manual_seed(seed)
    if cuda is not None:
        torch.cuda.default_generators[cuda.index or 0].manual_seed(seed)


def rng_state(cuda: torch.device | None):
    return torch.get_rng_state(), (torch.cuda.get_rng_state(cuda) if cuda is not None else None)


def set_rng_state(state, cuda: torch.device | None) -> None:
    torch.set_rng_state(state[0])
    if cuda is not None:
        torch.cuda.set_rng_state(state[1], cuda)


class Aborted(Exception):
    """Another micro-batch's thread failed: this one stops."""


class Turns:
    """Whose turn it is: one micro-batch's thread computes at a time, in a fixed order of
    (block, micro-batch) turns ("prologue" turns first: each micro-batch up to block 0).
    ``turn_done()`` runs on the thread that ends a turn, before the next one may start
    (the device gives back what it keeps per computing thread: device.devices)."""

    def __init__(self, order: list[tuple[int, int]], k: int, turn_done=lambda: None):
        self.order, self.i, self.turn_done = order, 0, turn_done
        self.ready = [threading.Event() for _ in range(k)]
        self.error: BaseException | None = None
        self.ready[order[0][1]].set()

    def wait(self, turn: tuple[int, int]) -> None:
        event = self.ready[turn[1]]
        event.wait()
        event.clear()
        if self.error is not None:
            raise Aborted
        if self.order[self.i] != turn:
            raise RuntimeError(f"the model called block {turn[0]} of micro-batch {turn[1]} when "
                               f"{self.order[self.i]} was due: train_step needs blocks called once each, in order")

    def advance(self) -> None:
        self.turn_done()
        self.i += 1
        if self.i < len(self.order):
            self.ready[self.order[self.i][1]].set()

    def abort(self, exc: BaseException) -> None:
        if self.error is None:
            self.error = exc
        for event in self.ready:
            event.set()
