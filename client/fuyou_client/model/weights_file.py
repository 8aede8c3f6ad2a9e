"""A safetensors checkpoint read for ``attach(weights=DIR)``: its index, its shards'
headers, and tensors read one layer group at a time (see client/materialize.py)."""
from __future__ import annotations

import contextlib
import json
import math
import mmap
import sys
from pathlib import Path

import torch

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


class Checkpoint:
    """A safetensors checkpoint: a directory (shards and an index, or one
    model.safetensors), an index file or one .safetensors file. Only headers are read
    here."""

    def __init__(self, path):
        from safetensors import safe_open
        self._open = safe_open
        root = Path(path)
        if not root.exists():
            raise FileNotFoundError(f"attach(weights=...): {root} does not exist")
        index = None
        if root.is_dir():
            if (root / INDEX_FILE).is_file():
                index = root / INDEX_FILE
            elif (root / SINGLE_FILE).is_file():
                root = root / SINGLE_FILE
            else:
                raise FileNotFoundError(
                    f"attach(weights=...): {root} has neither {INDEX_FILE} nor {SINGLE_FILE}; fuyou reads safetensors "
                    "checkpoints (save_pretrained(dir, safe_serialization=True) writes one)")
        elif root.name.endswith(".json"):
            index = root
        if index is not None:
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
                self.files = {str(k): index.parent / str(v) for k, v in weight_map.items()}
            except (ValueError, KeyError, TypeError, AttributeError) as exc:
                raise ValueError(f"{index} is not a safetensors index (a JSON object with a weight_map): {exc}") \
                    from None
            self.where = str(index.parent)
        else:
            with safe_open(root, framework="pt", device="cpu") as f:
                self.files = {key: root for key in f.keys()}
            self.where = str(root)

    def __contains__(self, key: str) -> bool:
        return key in self.files

    def header(self, key: str) -> tuple[list[int], str]:
        """A tensor's shape and safetensors dtype ("F32", "BF16", "I64"...), from its
        shard's header (read once per shard)."""
        if not hasattr(self, "_headers"):
            self._headers = {}
        path = self.files[key]
        if path not in self._headers:
            if not path.is_file():
                raise FileNotFoundError(f"tensor {key!r} is in shard {path.name}, which is missing from {self.where}")
            with path.open("rb") as f:
                size = int.from_bytes(f.read(8), "little")
                if not 2 <= size <= 100 << 20:
                    raise ValueError(f"{path} is not a safetensors file (a header of {size} bytes)")
                try:
                    self._headers[path] = json.loads(f.read(size))
                except ValueError:
                    raise ValueError(f"{path} is not a safetensors file (its header is not JSON)") from None
        entry = self._headers[path].get(key)
        if not isinstance(entry, dict):
            raise ValueError(f"tensor {key!r} is in the index of {self.where} but not in its shard {path.name}")
        return list(entry.get("shape", [])), str(entry.get("dtype", ""))

    @contextlib.contextmanager
    def reader(self):
        """``read(key, shape, dtype, what)``: shards are mapped on first use and unmapped when
        the block ends (so that only the pages of what was read were ever resident)."""
        handles: dict[Path, object] = {}
        with contextlib.ExitStack() as stack:
            def read(key: str, shape, dtype: torch.dtype, what: str) -> torch.Tensor:
                path = self.files[key]
                if path not in handles:
                    if not path.is_file():
                        raise FileNotFoundError(
                            f"{what} {key!r} is in shard {path.name}, which is missing from {self.where}")
                    handles[path] = stack.enter_context(self._open(path, framework="pt", device="cpu"))
                f = handles[path]
                try:
                    sl = f.get_slice(key)
                except Exception:  # noqa: BLE001 - safetensors raises its own error types
                    raise ValueError(f"{what} {key!r} is in the index of {self.where} but not in its shard "
                                   f"{path.name}") from None
                stored = list(sl.get_shape())
                if stored != list(shape):
                    raise ValueError(f"{what} {key!r} has shape {stored} in {self.where} but {list(shape)} in the "
                                     "model: the checkpoint is of another configuration")
                t = f.get_tensor(key)
                if dtype.is_floating_point and not t.dtype.is_floating_point:
                    raise ValueError(f"{what} {key!r} is {t.dtype} in {self.where}, not a floating-point tensor "
                                     f"(the model's is {dtype})")
                return t if t.dtype == dtype else own_memory_empty(t.shape, dtype).copy_(t)

            yield read


def own_memory_empty(shape, dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor in memory of its own, returned to the system when the tensor goes: an
    anonymous map for 1 MiB and more. (glibc serves blocks of a few MiB from its heap
    once a like-sized one was freed and keeps what is freed there: a block at a time,
    the heap would grow to the whole model.)"""
    return ReusedMaps().empty(shape, dtype)


class ReusedMaps:
    """``own_memory_empty`` that reuses the anonymous maps of tensors already gone: attach makes a
    block's tensors, uploads them and lets them go, block after block, and the model's
    init draws values it then overwrites into scratch tensors; fresh maps fault in every
    page each time (for a 7B model's init that made the draws half as fast, about 40 s of
    attach). A map is free again when this pool is the only one holding it (a tensor made
    from it holds a reference for as long as it, or a view of it, lives). ``close()``
    lets the pool's maps go (those still in use go with their tensors)."""

    def __init__(self) -> None:
        self._maps: list[mmap.mmap] = []

    def empty(self, shape, dtype: torch.dtype) -> torch.Tensor:
        shape = tuple(shape)
        count = math.prod(shape)
        nbytes = count * dtype.itemsize
        if nbytes < 1 << 20:
            return torch.empty(shape, dtype=dtype)
        free = [m for m in self._maps if len(m) >= nbytes and sys.getrefcount(m) == 3]  # (the list, m, the call)
        if free:
            memory = min(free, key=len)
        else:
            memory = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            self._maps.append(memory)
        return torch.frombuffer(memory, dtype=dtype, count=count).view(shape)

    def close(self) -> None:
        self._maps.clear()
