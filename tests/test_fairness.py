"""Tenants served in turn (fuyoud/concurrency/fairness.py): the SSD array's turns and the optimizer's
CPU go round the sessions that wait, so a tenant with many requests in flight does not
take the share of one with few."""
from __future__ import annotations

import mmap
import threading

from conftest import random_bytes, wait_until
from fuyoud.concurrency.fairness import FairTurns
from fuyoud.io.threadpool import ThreadPoolEngine
from fuyoud.memory.staging import StagingPool
from fuyoud.storage import transfer
from fuyoud.storage.device import Device
from fuyoud.storage.index import IndexDB
from fuyoud.storage.store import ReadItem, Store, WriteItem

MiB = 1 << 20


def test_turns_go_round_the_owners_that_wait():
    """One slot, held; four waiters of A queue, then one of B: B is served right after the
    first A, not after all four (a plain lock serves whoever it wakes)."""
    turns = FairTurns(1)
    turns.acquire("holder")
    order, threads = [], []

    def waiter(owner, tag):
        turns.acquire(owner)
        order.append(tag)
        turns.release()

    for i, (owner, tag) in enumerate([("A", "a1"), ("A", "a2"), ("A", "a3"), ("A", "a4"), ("B", "b1")]):
        t = threading.Thread(target=waiter, args=(owner, tag))
        t.start()
        threads.append(t)
        wait_until(lambda n=i + 1: sum(turns.waiting().values()) == n, f"waiter {tag} queued", poll=0.002)
    turns.release()
    for t in threads:
        t.join(30)
    assert order == ["a1", "b1", "a2", "a3", "a4"]
    assert turns.granted["A"] == 4 and turns.granted["B"] == 1


def test_busy_owners_hold_equal_shares_of_the_slots():
    """Four slots; A keeps eight requests waiting, B two: each time a slot frees it goes to
    the other owner in turn, so both hold two slots (A held all four as a plain queue)."""
    turns = FairTurns(4)
    for _ in range(4):
        turns.acquire("A")  # (A holds every slot: B arrives later)
    gate = threading.Event()
    held = {"A": 0, "B": 0}
    lock = threading.Lock()

    def worker(owner):
        turns.acquire(owner)
        with lock:
            held[owner] += 1
        gate.wait(30)

    workers = [threading.Thread(target=worker, args=(o,), daemon=True) for o in "AAAAAAAA"]
    for w in workers:
        w.start()
    wait_until(lambda: turns.waiting().get("A") == 8, "A's waiters queued", poll=0.002)
    more = [threading.Thread(target=worker, args=("B",), daemon=True) for _ in range(2)]
    for w in more:
        w.start()
    wait_until(lambda: turns.waiting().get("B") == 2, "B's waiters queued", poll=0.002)
    for _ in range(4):
        turns.release()  # (A's first four let go)
    wait_until(lambda: sum(held.values()) == 4, "the slots handed over", poll=0.002)
    assert held == {"A": 2, "B": 2}
    gate.set()


class Recording(ThreadPoolEngine):
    """A real engine that records the size of each batch it is given."""

    def __init__(self):
        super().__init__(4)
        self.batches: list[int] = []

    def execute(self, requests):
        self.batches.append(sum(len(r.buf) for r in requests))
        return super().execute(requests)


def test_a_large_transfer_takes_the_array_in_windows_on_its_namespaces_turns(tmp_path):
    engine = Recording()
    store = Store([Device(0, tmp_path / "ssd0", 256 * MiB)], IndexDB(tmp_path / "index.sqlite"), engine,
                  StagingPool(2 * MiB, MiB + 8192), chunk_size=MiB, stripe_size=4 * MiB)
    try:
        data = random_bytes(96 * MiB, 3)
        src, dst = mmap.mmap(-1, len(data)), mmap.mmap(-1, len(data))  # (page-aligned: O_DIRECT in place)
        src[:] = data
        store.write([WriteItem("tenant-a", "big", memoryview(src), persistent=True)])
        assert len(engine.batches) == 3 and max(engine.batches) <= transfer.WINDOW_BYTES
        store.read([ReadItem("tenant-a", "big", memoryview(dst))])
        assert dst[:] == data
        assert store.io.turns.granted["tenant-a"] == 6
    finally:
        store.close()
        engine.close()
