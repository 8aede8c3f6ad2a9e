"""Objects written piece by piece (restoring a checkpoint's files, chunked optimizer
steps) and committed at the end like any write: the old version, if any, stays until
the commit; the checksums are computed piece by piece. Built on the store's version
API (new_version, commit_versions, discard_versions) and its transfer layer."""
from __future__ import annotations

from dataclasses import replace
from typing import Sequence

from fuyoud.errors import InvalidArgument
from fuyoud.io.engine import Op
from fuyoud.storage import checksums
from fuyoud.storage.index import ObjectMeta
from fuyoud.storage.store import Store, WriteItem
from fuyoud.storage.transfer import Batch


class PendingWrite:
    def __init__(self, store: Store, meta: ObjectMeta):
        self.store, self.meta = store, meta
        self.open = True  # neither committed nor aborted yet
        self._sums = bytearray(4 * -(-meta.size // checksums.BLOCK)) if meta.persistent else None

    @classmethod
    def start(cls, store: Store, namespace: str, name: str, size: int, persistent: bool = True,
              session_id: int = 0) -> "PendingWrite":
        """A new version of ``namespace/name`` of ``size`` bytes, to be written in pieces."""
        return cls(store, store.new_version(namespace, name, size, persistent, session_id))

    def write(self, offset: int, src: memoryview) -> None:
        """Bytes [offset, offset + len(src)) of the object; offsets are 1 MiB aligned
        (checksum blocks), lengths too but for the object's tail."""
        if offset % checksums.BLOCK or offset < 0 or offset + len(src) > self.meta.size:
            raise InvalidArgument(f"piece [{offset}, {offset + len(src)}) of {self.meta.name!r} is unaligned or "
                                  f"outside its {self.meta.size} bytes")
        self.write_batch([(offset, src)], [checksums.block_checksums(src)] if self._sums is not None else [])

    def plan(self, pieces: Sequence[tuple[int, memoryview]]) -> tuple[Batch, list[WriteItem]]:
        """The transfer of ``pieces`` ((offset, bytes) each), for ``run``."""
        batch = Batch()
        for i, (offset, src) in enumerate(pieces):
            self.store.io.plan(batch, i, self.meta.layout, offset, src, Op.WRITE)
        return batch, [WriteItem(self.meta.namespace, self.meta.name, src) for _, src in pieces]

    def run(self, batch: Batch, items: list[WriteItem]) -> dict[int, Exception]:
        return self.store.io.execute(batch, Op.WRITE, items)

    def write_batch(self, pieces: Sequence[tuple[int, memoryview]], sums: Sequence[bytes],
                    errors: dict[int, Exception] | None = None) -> None:
        """Pieces written (unless ``errors`` says how their transfer, run apart, ended) and
        their block checksums (``sums``, one per piece, for persistent objects) recorded;
        on an error the write is aborted and the first error raised."""
        if errors is None:
            errors = self.run(*self.plan(pieces))
        if errors:
            self.abort()
            raise errors[min(errors)]
        if self._sums is not None:
            for (offset, _), block_sums in zip(pieces, sums):
                first = offset // checksums.BLOCK * 4
                self._sums[first:first + len(block_sums)] = block_sums
            self.meta = replace(self.meta, checksums=bytes(self._sums))

    @property
    def checksummed(self) -> bool:
        return self._sums is not None

    def commit(self) -> ObjectMeta:
        return commit_all(self.store, [self])[0]

    def abort(self) -> None:
        if self.open:
            self.open = False
            self.store.discard_versions([self.meta])


def commit_all(store: Store, pending: Sequence[PendingWrite]) -> list[ObjectMeta]:
    """Commit several pieced writes in one index transaction (all or none)."""
    for w in pending:
        w.open = False
    return store.commit_versions([w.meta for w in pending])
