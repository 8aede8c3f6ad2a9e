"""Objects written piece by piece (restoring a checkpoint's files) and committed at the
end like any write: the old version, if any, stays until the commit; the checksums are
computed piece by piece."""
from __future__ import annotations

from dataclasses import replace

from fuyoud.errors import InvalidArgument
from fuyoud.io.engine import Op
from fuyoud.storage import checksums
from fuyoud.storage.index import ObjectMeta
from fuyoud.storage.store import Store, WriteItem, _Batch


class PendingWrite:
    def __init__(self, store: Store, meta: ObjectMeta):
        self.store, self.meta = store, meta
        self._open = True
        self._sums = bytearray(4 * -(-meta.size // checksums.BLOCK)) if meta.persistent else None

    def write(self, offset: int, src: memoryview) -> None:
        """Bytes [offset, offset + len(src)) of the object; offsets are 1 MiB aligned
        (checksum blocks), lengths too but for the object's tail."""
        if offset % checksums.BLOCK or offset < 0 or offset + len(src) > self.meta.size:
            raise InvalidArgument(f"piece [{offset}, {offset + len(src)}) of {self.meta.name!r} is unaligned or "
                                  f"outside its {self.meta.size} bytes")
        batch = _Batch()
        self.store._plan(batch, 0, self.meta.layout, offset, src, Op.WRITE)
        errors = self.store._execute(batch, Op.WRITE, [WriteItem(self.meta.namespace, self.meta.name, src)])
        if errors:
            self.abort()
            raise errors[0]
        if self._sums is not None:
            first = offset // checksums.BLOCK * 4
            sums = checksums.block_checksums(src)
            self._sums[first:first + len(sums)] = sums
            self.meta = replace(self.meta, checksums=bytes(self._sums))

    def commit(self) -> ObjectMeta:
        self._open = False
        try:
            self.store._commit([self.meta])
        except BaseException:
            self.store._free_layouts([self.meta.layout])
            raise
        finally:
            self.store._unreserve([self.meta])
        return self.meta

    def abort(self) -> None:
        if self._open:
            self._open = False
            self.store._free_layouts([self.meta.layout])
            self.store._unreserve([self.meta])
