"""Optimizer buffers shared by sessions (the ranks of data-parallel jobs): steps served
first come, first served, and a budget of buffers per session (fuyoud/optimizer/buffers.py)."""
from __future__ import annotations

import threading
import time

import pytest
import torch

import fuyou_client
from conftest import in_process_config
from fuyou_client import AdamW
from fuyoud.config import ConfigError, from_dict
from fuyoud.optimizer.buffers import StateBuffers

MiB = 1 << 20
A, B = "job.r0", "job.r1"


def wait_until(cond, what: str, seconds: float = 30.0) -> None:
    """Poll for a state another thread reaches (a liveness bound, not a timing assertion)."""
    deadline = time.monotonic() + seconds
    while not cond():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.005)


class Waiter(threading.Thread):
    """acquire_blocking on a thread; ``got`` is set once it holds a buffer."""

    def __init__(self, buffers: StateBuffers, owner: str | None = None, log: list | None = None, tag=None,
                 hold: bool = True):
        super().__init__(daemon=True)
        self.buffers, self.owner, self.log, self.tag, self.hold = buffers, owner, log, tag, hold
        self.view = None
        self.got = threading.Event()

    def run(self):
        view = self.buffers.acquire_blocking(4096, self.owner)
        if self.log is not None:
            self.log.append(self.tag)
        if self.hold:
            self.view = view
        else:
            self.buffers.release(view)
        self.got.set()


def queue(buffers: StateBuffers, *waiters: Waiter) -> None:
    """Start each waiter once the one before it is queued: a known arrival order."""
    for w in waiters:
        before = buffers.waiting
        w.start()
        wait_until(lambda: buffers.waiting == before + 1, "the waiter queued")


def test_waiters_are_served_in_arrival_order():
    buffers = StateBuffers(1, 4 * MiB)
    held = buffers.acquire_blocking(4096)
    order: list[int] = []
    waiters = [Waiter(buffers, log=order, tag=i, hold=False) for i in range(6)]
    queue(buffers, *waiters)
    buffers.release(held)
    for w in waiters:
        w.join(30)
    assert order == list(range(6))
    assert buffers.spare() == 1 and buffers.waiting == 0


def test_a_freed_buffer_goes_to_the_first_waiter_not_to_a_newcomer():
    """release() hands the buffer to the waiter itself: at no moment is it free for a
    read-ahead (try_acquire) or a newcomer's acquire_blocking to take first."""
    buffers = StateBuffers(2, 8 * MiB)
    mine = [buffers.acquire_blocking(4096), buffers.acquire_blocking(4096)]
    first = Waiter(buffers)
    queue(buffers, first)
    assert buffers.try_acquire(4096) is None  # (none free anyway)
    buffers.release(mine.pop())
    assert buffers.spare() == 0 and buffers.try_acquire(4096) is None  # already the waiter's
    first.got.wait(30)
    newcomer = Waiter(buffers)
    queue(buffers, newcomer)
    buffers.release(first.view)
    newcomer.got.wait(30)
    assert newcomer.view is not None
    buffers.release(newcomer.view)
    buffers.release(mine.pop())
    assert buffers.spare() == 2 and buffers.in_use == 0


def test_a_session_at_its_budget_waits_while_another_proceeds():
    buffers = StateBuffers(4, 16 * MiB, session_buffers=2)
    a = [buffers.acquire_blocking(4096, A), buffers.acquire_blocking(4096, A)]
    assert buffers.try_acquire(4096, owner=A) is None  # at its budget, two buffers free
    third = Waiter(buffers, A)
    queue(buffers, third)
    assert buffers.spare() == 2 and not third.got.is_set()
    # Another session is not held up by the waiting one: its step and its read-ahead go on.
    b = buffers.acquire_blocking(4096, B)
    assert buffers.held() == {A: 2, B: 1}
    assert buffers.try_acquire(4096, leave=1, owner=B) is None  # a read-ahead leaves one of B's budget
    assert buffers.try_acquire(4096, leave=1, owner="other") is None  # ... and one of the pool
    buffers.release(a.pop())  # room in A's budget: the waiter is served
    third.got.wait(30)
    assert third.view is not None and buffers.held() == {A: 2, B: 1}
    for view in (*a, third.view, b):
        buffers.release(view)
    assert buffers.held() == {} and buffers.spare() == 4
    # No owner (a group's header read): never charged, never limited.
    views = [buffers.acquire_blocking(4096) for _ in range(4)]
    assert buffers.held() == {}
    for view in views:
        buffers.release(view)


def test_a_session_at_its_budget_gets_one_of_its_own_cached_buffers_back():
    """The state cache gives back the waiting session's own kept buffer (another
    session's would not help it), and keeps none while one of its session's steps waits."""
    buffers = StateBuffers(4, 16 * MiB, session_buffers=2)
    cached = {A: buffers.acquire_blocking(4096, A), B: buffers.acquire_blocking(4096, B)}
    asked: list = []

    def evict(owner):
        asked.append(owner)
        for ns in ([owner] if owner is not None else list(cached)):
            if ns in cached:
                buffers.release(cached.pop(ns))
                return True
        return False

    buffers.evict = evict
    step = buffers.acquire_blocking(4096, A)
    assert buffers.may_keep(step, 1)  # nobody waits
    second = Waiter(buffers, A)
    second.start()
    second.got.wait(30)
    assert asked[0] == A and A not in cached and B in cached
    assert buffers.held() == {A: 2, B: 1}
    third = Waiter(buffers, A)
    queue(buffers, third)  # (asks again now and then: A keeps nothing to give)
    assert not buffers.may_keep(step, 1)  # a step of A waits: A's step gives its buffer back
    assert buffers.may_keep(cached[B], 1)  # another session's may stay cached
    buffers.release(step)
    third.got.wait(30)
    for view in (second.view, third.view, cached.pop(B)):
        buffers.release(view)
    assert buffers.spare() == 4


def test_a_waiter_that_gives_up_leaves_the_queue():
    buffers = StateBuffers(1, 4 * MiB)
    held = buffers.acquire_blocking(4096)
    failures: list = []

    def evict(owner):  # an error while waiting (e.g. the state cache failing)
        failures.append(owner)
        raise RuntimeError("boom")

    buffers.evict = evict
    with pytest.raises(RuntimeError, match="boom"):
        buffers.acquire_blocking(4096)
    buffers.evict = None
    assert buffers.waiting == 0
    buffers.release(held)
    assert buffers.spare() == 1


def test_session_buffers_config():
    assert from_dict({}).optimizer.session_buffers == 0  # no limit beyond the pool
    assert from_dict({"optimizer": {"buffers": 4, "session_buffers": 4}}).optimizer.session_buffers == 4
    for bad in (-1, 7):
        with pytest.raises(ConfigError, match=r"\[optimizer.session_buffers\].*from 1 to \[optimizer.buffers\] \(6\)"):
            from_dict({"optimizer": {"session_buffers": bad}})
    with pytest.raises(ConfigError, match=r"\[optimizer.session_buffers\]: expected int"):
        from_dict({"optimizer": {"session_buffers": "2"}})
    with pytest.raises(ValueError):
        StateBuffers(2, 8 * MiB, session_buffers=3)


def test_ranks_of_a_job_step_concurrently_within_their_budgets(short_tmp):
    """Three sessions (two ranks of a job and another job) step chunked and whole groups
    at once through 4 buffers, each session within 2: every step completes (chunked
    steps taking extra buffers never deadlock with the waiters), bitwise torch's, and
    no session ever held more than its budget."""
    from fuyoud.server import Daemon

    cfg = in_process_config(short_tmp, optimizer__buffers=4, optimizer__buffer_budget="80MiB",
                            optimizer__session_buffers=2, storage__capacity_per_device="1GiB")
    daemon = Daemon(cfg)
    buffers = daemon.optimizer.buffers
    most: dict[str, int] = {}
    take = buffers._take

    def counting_take(nbytes, owner):  # (called with the buffers' lock held)
        view = take(nbytes, owner)
        if owner is not None:
            most[owner] = max(most.get(owner, 0), buffers._held[owner])
        return view

    buffers._take = counting_take
    daemon.start()
    sizes = [1_500_007, 70_001, 30_011]  # the first larger than a 20 MiB buffer: chunked
    hyper = dict(betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1)
    try:
        sock = str(cfg.daemon.control_path)
        with fuyou_client.connect(sock, namespace=A) as s0, fuyou_client.connect(sock, namespace=B) as s1, \
                fuyou_client.connect(sock, namespace="other") as s2:
            sessions = [s0, s1, s2]
            state = []
            for k, s in enumerate(sessions):
                gen = torch.Generator().manual_seed(k)
                init = [torch.randn(n, generator=gen) for n in sizes]
                weights, grads = [], []
                for i, w0 in enumerate(init):
                    w = s.allocate(w0.numel() * 4)
                    w.tensor(torch.float32).copy_(w0)
                    s.create_group(f"g{i}", w, AdamW(**hyper))
                    weights.append(w)
                    grads.append(s.allocate(w0.numel() * 4))
                ref = [torch.nn.Parameter(w.clone()) for w in init]
                state.append((weights, grads, ref, torch.optim.AdamW(ref, lr=1e-2, fused=True, **hyper)))
            for it in range(3):
                futures = []
                for k, (s, (weights, grads, ref, opt)) in enumerate(zip(sessions, state)):
                    gen = torch.Generator().manual_seed(100 * k + it)
                    for p, g in zip(ref, grads):
                        p.grad = torch.randn(p.numel(), generator=gen)
                        g.tensor(torch.float32).copy_(p.grad)
                    opt.step()
                    futures += [s.step_group_async(f"g{i}", grads[i], 1e-2, out=weights[i])
                                for i in reversed(range(len(sizes)))]
                for f in futures:
                    f.result(300)
            for weights, _, ref, _ in state:
                for w, p in zip(weights, ref):
                    assert torch.equal(w.tensor(torch.float32)[:p.numel()], p.data)
        assert set(most) >= {A, B, "other"} and max(most.values()) <= 2
        wait_until(lambda: buffers.held() == {}, "the sessions' cached states given back")
        assert buffers.waiting == 0
    finally:
        daemon.stop()
