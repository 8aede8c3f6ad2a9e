"""The compute device: where the model runs, and how bytes cross between it and the
daemon's shared memory.

Two kinds, one interface (the engine, the offloader, the gradient pool and the
activation swapper are written against it):

* ``HostDevice`` (the CPU): the model computes on host memory, so parameters,
  gradients and activations can *be* views of shared memory. ``shares_host_memory`` is
  true and the engine makes no copies at all; events are complete from birth.
* ``CudaDevice``: the model's tensors live in GPU memory. Every shared segment the
  session maps is registered with ``cudaHostRegister`` (so copies run at pinned speed,
  asynchronously, into the very pages the daemon's io_uring reads and writes), and bytes
  move on two side streams: *upload* (host -> GPU: weights, activations coming back) and
  *download* (GPU -> host: gradients, activations leaving). Events order them against
  the compute stream (nothing is read before it is written, nothing reused while a copy
  is in flight) without synchronising the device; ``then`` runs host-side work (e.g.
  submitting an optimizer step) on a helper thread once an event has completed, so the
  training thread never blocks on a copy.

Any other object with this interface can stand in (the tests use a CPU stand-in for a
discrete accelerator whose copies run late on a worker thread, to prove the ordering).
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future

import torch

from fuyou_client.device import heap

log = logging.getLogger(__name__)


class Done:
    """An event that has already happened (host compute is synchronous)."""

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


DONE = Done()


def call_into(fut: Future, fn) -> None:
    try:
        fut.set_result(fn())
    except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on the future
        fut.set_exception(exc)


class Device:
    """What the engine needs of a compute device. Subclasses: HostDevice, CudaDevice."""

    torch_device: torch.device
    shares_host_memory: bool  # tensors on the device may be views of shared memory
    computes_in_its_memory = True  # the model's activations take its memory (the device plan counts them)

    def register(self, address: int, nbytes: int) -> None:
        """Host memory (a shared segment) that copies will use; before its first use."""

    def unregister(self, address: int) -> None:
        """Before the segment at ``address`` is unmapped."""

    def empty(self, nbytes: int) -> torch.Tensor:
        """``nbytes`` of uninitialised device memory, as a uint8 tensor."""
        return torch.empty(nbytes, dtype=torch.uint8, device=self.torch_device)

    def record(self):
        """An event marking the compute stream's work enqueued so far."""
        return DONE

    def wait(self, event) -> None:
        """Make the compute stream's later work wait for ``event`` (not the host)."""
        event.synchronize()

    def upload(self, dst: torch.Tensor, src: torch.Tensor, after=None):
        """Copy host ``src`` into device ``dst`` once ``after`` (an event) has happened;
        returns the copy's event."""
        if after is not None:
            after.synchronize()
        dst.copy_(src)
        return DONE

    def upload_new(self, src: torch.Tensor, after=None):
        """A new device tensor holding host ``src`` (uploaded once ``after`` happened);
        returns (tensor, event). Its memory is safe from work the compute stream still
        has queued on what was freed before."""
        t = torch.empty(src.shape, dtype=src.dtype, device=self.torch_device)
        return t, self.upload(t, src, after)

    def download(self, dst: torch.Tensor, src: torch.Tensor, after=None):
        """Copy device ``src`` into host ``dst`` after the compute stream's work so far
        (and ``after``); returns the copy's event. ``src`` must not be freed before it."""
        if after is not None:
            after.synchronize()
        dst.copy_(src)
        return DONE

    def then(self, event, fn) -> Future:
        """``fn()`` once ``event`` has happened, off the training thread where that
        matters; a future of its result. Calls run in the order they were asked for."""
        fut: Future = Future()
        event.synchronize()
        call_into(fut, fn)
        return fut

    def synchronize(self) -> None:
        """Wait (host) for everything enqueued on the device."""

    def timer(self):
        """A function returning seconds, for profiling: on an asynchronous device it
        synchronises first, so that the time includes the work enqueued before."""
        return time.perf_counter

    def memory_allocated(self) -> int | None:
        """Bytes the framework has allocated on the device (None where it cannot tell)."""
        return None

    def memory_available(self) -> int | None:
        """Bytes this process may plan on the device now (None: the device is host memory,
        planned as such): what is free, with what this process's allocator holds."""
        return None

    def memory_reserve(self) -> int:
        """Bytes of ``memory_available`` the device needs for itself beyond what is planned."""
        return 0

    def block_done(self) -> None:
        """A block's forward or backward has ended (its temporaries are freed)."""

    def thread_turn_done(self) -> None:
        """The calling thread, one of several that take turns computing (block-major's
        micro-batches), has enqueued its turn's work: give back what the framework keeps
        per computing thread. Here, autocast's casts of weights, which each thread keeps
        until its autocast ends (its whole forward, every block's weights)."""
        torch.clear_autocast_cache()

    def close(self) -> None:
        pass


class HostDevice(Device):
    """The CPU: compute on host memory, shared memory used in place."""

    torch_device = torch.device("cpu")
    shares_host_memory = True

    def block_done(self) -> None:
        heap.trim()  # (the block's temporaries were malloc'ed, freed around what it keeps: heap.py)


class _Thread:
    """One helper thread running queued calls in order (CudaDevice.then)."""

    def __init__(self, name: str):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            try:
                item()
            except BaseException:  # noqa: BLE001 - the calls report their own errors; the thread must live on
                log.exception("a call on %s failed", self._thread.name)

    def submit(self, fn) -> None:
        self._queue.put(fn)

    def drain(self) -> None:
        """Until every call queued so far has run (at once on the thread itself)."""
        if threading.current_thread() is self._thread:
            return
        done = threading.Event()
        self._queue.put(done.set)
        done.wait()

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=60)


def cuda_reserve(total: int) -> int:
    """What a CUDA device of ``total`` bytes keeps beyond the device plan (memory/device_plan.py):
    cuBLAS workspaces (32 MiB per handle and stream on Hopper), kernels' own scratch and
    the caching allocator's fragmentation: 512 MiB and 5% of the device, stated, not measured."""
    return (512 << 20) + total // 20


class CudaDevice(Device):
    """An NVIDIA GPU: shared segments registered with cudaHostRegister, copies on an
    upload and a download side stream, ordered by events."""

    shares_host_memory = False

    def __init__(self, index: int | None = None):
        if not torch.cuda.is_available():
            raise RuntimeError("CUDA is not available: attach on the CPU (the model's parameters on the CPU)")
        index = torch.cuda.current_device() if index is None else index
        self.torch_device = torch.device("cuda", index)
        self._cudart = torch.cuda.cudart()
        self.upload_stream = torch.cuda.Stream(self.torch_device)
        self.download_stream = torch.cuda.Stream(self.torch_device)
        self._registered: set[int] = set()
        self._helper = _Thread(f"fuyou-cuda{index}")

    def _compute(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.torch_device)

    def register(self, address: int, nbytes: int) -> None:
        if address in self._registered:
            return
        with torch.cuda.device(self.torch_device):
            rc = self._cudart.cudaHostRegister(address, nbytes, 0)  # cudaHostRegisterDefault
        if int(rc) != 0:
            raise RuntimeError(f"cudaHostRegister of {nbytes} bytes of shared memory failed (CUDA error {int(rc)}); "
                               "check the memlock limit (LimitMEMLOCK=infinity, ulimit -l)")
        self._registered.add(address)

    def unregister(self, address: int) -> None:
        if address in self._registered:
            self._registered.discard(address)
            with torch.cuda.device(self.torch_device):
                self._cudart.cudaHostUnregister(address)

    def record(self):
        return self._compute().record_event()

    def wait(self, event) -> None:
        if not isinstance(event, Done):
            self._compute().wait_event(event)

    def _copy(self, stream, dst, src, after, compute_first: bool):
        if compute_first:
            stream.wait_stream(self._compute())
        if after is not None and not isinstance(after, Done):
            stream.wait_event(after)
        with torch.cuda.stream(stream), torch.no_grad():
            dst.copy_(src, non_blocking=True)
            if src.is_cuda:  # the caching allocator must not hand src's memory out before the copy ran
                src.record_stream(stream)
            if dst.is_cuda:
                dst.record_stream(stream)
            event = torch.cuda.Event(blocking=True)  # a host waiting on it sleeps rather than spins
            event.record(stream)
            return event

    def upload(self, dst, src, after=None):
        return self._copy(self.upload_stream, dst, src, after, compute_first=False)

    def upload_new(self, src, after=None):
        # Allocated on the upload stream: memory the compute stream freed may still be in
        # use by its queued kernels, and a copy on another stream would not wait for them.
        with torch.cuda.stream(self.upload_stream):
            t = torch.empty(src.shape, dtype=src.dtype, device=self.torch_device)
        event = self._copy(self.upload_stream, t, src, after, compute_first=False)
        t.record_stream(self._compute())  # freed later on the compute stream: reused only after its use there
        return t, event

    def download(self, dst, src, after=None):
        return self._copy(self.download_stream, dst, src, after, compute_first=True)

    def then(self, event, fn) -> Future:
        fut: Future = Future()

        def run():
            try:
                event.synchronize()
                with torch.cuda.device(self.torch_device):
                    result = fn()
            except BaseException as exc:  # noqa: BLE001 - a device error (or fn's) goes to the waiter
                fut.set_exception(exc)
            else:
                fut.set_result(result)

        self._helper.submit(run)
        return fut

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.torch_device)
        self._helper.drain()  # host work queued behind copies (gradient additions) writes shared memory too

    def timer(self):
        def now() -> float:
            torch.cuda.synchronize(self.torch_device)
            return time.perf_counter()

        return now

    def memory_allocated(self) -> int | None:
        return torch.cuda.memory_allocated(self.torch_device)

    def _limit(self) -> int:
        """What this process's allocator may hold: the device, or the share of it
        ``torch.cuda.set_per_process_memory_fraction`` allows."""
        total = torch.cuda.get_device_properties(self.torch_device).total_memory
        return int(total * torch.cuda.get_per_process_memory_fraction(self.torch_device))

    def memory_available(self) -> int | None:
        free, _ = torch.cuda.mem_get_info(self.torch_device)
        return min(free + torch.cuda.memory_reserved(self.torch_device), self._limit())

    def memory_reserve(self) -> int:
        return cuda_reserve(self._limit())

    def thread_turn_done(self) -> None:
        # torch keeps a cuBLAS workspace per (handle, stream), a handle per thread, until the
        # process ends: 32 MiB each on Hopper (about 8 elsewhere), taken from the caching
        # allocator. Block-major runs each micro-batch's forward in a thread of its own, so
        # 128 micro-batches held 4 GiB of workspaces: on an H200 capped at 4 GiB the step ran
        # out of memory with 2.9 GiB allocated that no tensor held. Freed here, the next
        # thread's workspace reuses the memory in stream order (the threads share a stream).
        super().thread_turn_done()
        clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
        if clear is not None:
            clear()

    def close(self) -> None:
        self._helper.close()
        for address in list(self._registered):
            self.unregister(address)


def resolve(device, model: torch.nn.Module) -> Device:
    """``attach(device=...)``: a Device, a torch device or its name, or None (where the
    model's parameters are)."""
    if isinstance(device, Device):
        return device
    if device is None:
        kinds = {p.device for p in model.parameters()}
        if len(kinds) > 1:
            raise ValueError(f"the model's parameters are on several devices ({sorted(map(str, kinds))}); "
                             "move the model to one device before attach")
        device = kinds.pop() if kinds else torch.device("cpu")
    device = torch.device(device)
    if device.type == "cpu":
        return HostDevice()
    if device.type == "cuda":
        return CudaDevice(device.index)
    raise ValueError(f"fuyou computes on the CPU or on CUDA devices, not {device}")


def after(device: Device, event, start) -> Future:
    """A future of the future that ``start()`` returns, called once ``event`` happened
    (on the device's helper thread): how a step is submitted after its gradients'
    download without blocking the training thread."""
    outer: Future = Future()

    def relay(inner: Future) -> None:
        exc = inner.exception()
        outer.set_exception(exc) if exc is not None else outer.set_result(inner.result())

    def go():
        start().add_done_callback(relay)

    device.then(event, go).add_done_callback(lambda f: f.exception() is not None and outer.set_exception(f.exception()))
    return outer
