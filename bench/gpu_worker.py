"""A bench/gpu.py case's worker process: the case named on its command line (Fuyou from
gpu_cases.py, the in-GPU ceilings from gpu_inmem.py, ZeRO-Infinity from gpu_zero.py), driven
over stdin ("iter", "profile") with one JSON reply line each. It sits above the three case
modules, which import only gpu_cases.py: no circle among them."""
from __future__ import annotations

import gc
import json
import os
import sys
from pathlib import Path

from gpu_cases import Fuyou, MicroTooLarge


_replies = None  # the worker's channel to the run: its original stdout


def census(top: int = 12) -> str:
    """What a case that failed held on the GPU: its live CUDA tensors by shape and dtype, the
    largest totals first, and the allocator's figures (a step that ran out of memory names
    what grew with the micro-batches)."""
    import collections
    import torch
    if not torch.cuda.is_available():
        return "census: no CUDA"
    count, size, storages = collections.Counter(), collections.Counter(), {}
    for obj in gc.get_objects():
        try:
            if isinstance(obj, torch.Tensor) and obj.is_cuda:
                key = (tuple(obj.shape), str(obj.dtype).removeprefix("torch."), obj.grad_fn is not None)
                count[key] += 1
                size[key] += obj.numel() * obj.element_size()
                storages[obj.untyped_storage().data_ptr()] = obj.untyped_storage().nbytes()
        except Exception:  # noqa: BLE001 - objects that die or refuse inspection mid-scan
            continue
    unheld = torch.cuda.memory_allocated() - sum(storages.values())
    lines = [f"census: {unheld / 2**30:.2f} GiB allocated that no live tensor holds (per-thread cuBLAS workspaces, "
             "copies pending on another stream, autograd's saved tensors)",
             f"census: {torch.cuda.memory_allocated() / 2**30:.2f} GiB allocated, "
             f"{torch.cuda.max_memory_allocated() / 2**30:.2f} GiB peak, {torch.cuda.memory_reserved() / 2**30:.2f} GiB "
             f"reserved; live CUDA tensors (shape, dtype, has a graph): count, GiB"]
    lines += [f"  {k}: {count[k]}, {size[k] / 2**30:.3f}" for k, _ in size.most_common(top)]
    return "\n".join(lines)


def reply(obj) -> None:
    _replies.write("@@ " + json.dumps(obj) + "\n")
    _replies.flush()


def worker(name: str, spec: dict) -> None:
    global _replies
    _replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # whatever the libraries print goes to the worker's log, not into the channel
    if spec.get("cpu"):  # (the smoke test: several workers and a daemon share a few cores)
        import torch
        torch.set_num_threads(1)
    if name == "zero":
        from gpu_zero import Zero as case_type
    elif name in ("ceiling", "inmem"):
        import gpu_inmem
        case_type = {"ceiling": gpu_inmem.Ceiling, "inmem": gpu_inmem.InMem}[name]
    else:
        case_type = {"fuyou": Fuyou}[name]
    try:
        case = case_type(spec)
    except MicroTooLarge as exc:
        reply({"ready": False, "micro_too_large": str(exc)})
        return
    reply({"ready": True, **case.info})
    for line in sys.stdin:
        command = line.strip()
        if command == "iter":  # (the first one counts its FLOPs)
            try:
                reply(case.iteration(count=case.hw_per_token is None))
            except BaseException as exc:
                import traceback
                traceback.print_exc()
                # (after the traceback: the run keeps the log's tail)
                print(f"{census()}\nfailed: {type(exc).__name__}: {str(exc)[:400]}", file=sys.stderr, flush=True)
                raise SystemExit(1) from None
        elif command == "profile":
            reply(case.profile(Path(spec["profile_dir"])))
        else:
            break
    if hasattr(case, "close"):
        case.close()
