"""A CPU stand-in for a discrete accelerator, at the engine's device seam
(fuyou_client.device.Device): what the CUDA path does, provable without a GPU.

Its memory is its own (the engine allocates device tensors for parameters, gradients,
weight slots and activations; none may be a view of shared memory), and its copies run
*late*: each direction has a worker thread (like CUDA's upload and download streams,
which run independently of each other) that sleeps a random while before every copy
and then fires the copy's event. So code that reads a copy's destination before its
event, reuses a source or destination while a copy is in flight, or submits a step
before its gradients have left, trains on wrong bytes, and the bitwise comparisons with
torch fail. Compute itself is the CPU's: synchronous, so events recorded on the
"compute stream" are complete at once and waiting for an event blocks.
"""
from __future__ import annotations

import queue
import random
import threading
from concurrent.futures import Future

import torch

from fuyou_client.device.devices import DONE, Device, call_into


class Event:
    def __init__(self):
        self._done = threading.Event()
        self.error: BaseException | None = None

    def set(self) -> None:
        self._done.set()

    def synchronize(self) -> None:
        if not self._done.wait(60):
            raise TimeoutError("a copy of the stand-in device never ran")
        if self.error is not None:
            raise RuntimeError("a copy of the stand-in device failed") from self.error

    def query(self) -> bool:
        return self._done.is_set()


class _Worker:
    def __init__(self, name: str, rng: random.Random, max_delay: float):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._rng, self._max_delay = rng, max_delay
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (job := self._queue.get()) is not None:
            try:
                threading.Event().wait(self._rng.uniform(0, self._max_delay))
                job()
            except BaseException as exc:  # noqa: BLE001 - surfaced by the test
                self.error = exc

    def put(self, job) -> None:
        self._queue.put(job)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(10)


class LateCopyDevice(Device):
    """``capacity``: its memory, in bytes (None: unbounded). With one, what the engine
    allocates on it (weight slots, gradient buffers, resident groups, uploaded kept inputs)
    is counted while alive, an allocation beyond it raises ``torch.OutOfMemoryError`` as
    CUDA's allocator does, ``peak`` is the most ever held, and ``memory_available`` is
    what is left (the device plan's budget). The model's activations are the CPU's and
    not counted."""
    torch_device = torch.device("cpu")
    shares_host_memory = False
    computes_in_its_memory = False  # (its compute is the CPU's: only what the engine allocates is on it)

    def __init__(self, seed: int = 0, max_delay: float = 0.003, helper_delay: float | None = None,
                 capacity: int | None = None):
        rng = random.Random(seed)
        self._up = _Worker("upload", rng, max_delay)
        self._down = _Worker("download", rng, max_delay)
        self._helper = _Worker("helper", rng, max_delay if helper_delay is None else helper_delay)
        self.registered: dict[int, int] = {}  # address -> bytes, like cudaHostRegister
        self.ever_registered = 0
        self.uploads = self.downloads = 0
        self.bytes_up = self.bytes_down = 0  # per link, since construction (tests difference them per iteration)
        self.allocated: list[torch.Tensor] = []  # (unbounded only: every allocation, kept alive)
        self.capacity = capacity
        self._live: list[tuple[int, int]] = []  # (storage weak reference, bytes)
        self.peak = 0
        self.turns_done: list[str] = []  # thread_turn_done's callers' names, in order

    def register(self, address: int, nbytes: int) -> None:
        assert address not in self.registered, "a segment registered twice"
        self.registered[address] = nbytes
        self.ever_registered += 1

    def unregister(self, address: int) -> None:
        del self.registered[address]

    def is_registered(self, t: torch.Tensor) -> bool:
        ptr = t.data_ptr()
        return any(a <= ptr < a + n for a, n in self.registered.items())

    def thread_turn_done(self) -> None:
        super().thread_turn_done()
        self.turns_done.append(threading.current_thread().name)

    def live_bytes(self) -> int:
        """Bytes of its allocations still alive."""
        alive = []
        for ref, n in self._live:
            if torch.UntypedStorage._expired(ref):
                torch.UntypedStorage._free_weak_ref(ref)
            else:
                alive.append((ref, n))
        self._live = alive
        return sum(n for _, n in alive)

    def memory_available(self) -> int | None:
        return None if self.capacity is None else self.capacity - self.live_bytes()

    def memory_allocated(self) -> int | None:
        return None if self.capacity is None else self.live_bytes()

    def empty(self, nbytes: int) -> torch.Tensor:
        if self.capacity is not None:
            live = self.live_bytes()
            if live + nbytes > self.capacity:
                raise torch.OutOfMemoryError(f"stand-in device out of memory: tried to allocate {nbytes} bytes with "
                                             f"{live} of its {self.capacity} in use")
        t = torch.full((nbytes,), 0xA5, dtype=torch.uint8)  # garbage, as device memory would be
        if self.capacity is None:
            self.allocated.append(t)
        else:
            self._live.append((t.untyped_storage()._weak_ref(), nbytes))
            self.peak = max(self.peak, live + nbytes)
        return t

    def _copy(self, worker: _Worker, dst, src, after, host: torch.Tensor) -> Event:
        assert self.is_registered(host), "a copy to or from host memory that is not registered"
        event = Event()

        def job():
            try:
                if after is not None:
                    after.synchronize()
                with torch.no_grad():
                    dst.copy_(src)
            except BaseException as exc:
                event.error = exc
                raise
            finally:
                event.set()

        worker.put(job)
        return event

    def upload(self, dst, src, after=None):
        self.uploads += 1
        self.bytes_up += src.numel() * src.element_size()
        return self._copy(self._up, dst, src, after, src)

    def upload_new(self, src, after=None):
        t = self.empty(src.numel() * src.element_size()).view(src.dtype).view(src.shape)
        return t, self.upload(t, src, after)

    def download(self, dst, src, after=None):
        self.downloads += 1
        self.bytes_down += src.numel() * src.element_size()
        return self._copy(self._down, dst, src, after, dst)

    def record(self):
        return DONE

    def wait(self, event) -> None:
        event.synchronize()

    def then(self, event, fn) -> Future:
        fut: Future = Future()

        def job():
            event.synchronize()
            call_into(fut, fn)

        self._helper.put(job)
        return fut

    def synchronize(self) -> None:
        for worker in (self._up, self._down, self._helper):
            done = Event()
            worker.put(done.set)
            done.synchronize()
            if worker.error is not None:
                raise worker.error

    def close(self) -> None:
        self.synchronize()
        for worker in (self._up, self._down, self._helper):
            worker.close()
