"""Reference counts of extents, so that objects can share them.

A snapshot of an object (a checkpoint on the same array) is a second index row that
points at the same extents: nothing is copied, and since every write goes to fresh
extents (see index.py) the shared ones never change. An extent returns to its device's
allocator when the last object holding it is gone. Callers hold the store's lock.
"""
from __future__ import annotations

from typing import Sequence

from fuyoud.storage.device import Device
from fuyoud.storage.layout import Layout


class ExtentRefs:
    def __init__(self, devices: Sequence[Device]):
        self.devices = devices
        self._refs: dict[tuple[int, int], int] = {}

    def adopt(self, layout: Layout) -> None:
        """Extents just allocated for ``layout``: one holder."""
        for e in layout.extents:
            self._refs[(e.device, e.offset)] = 1

    def share(self, layout: Layout) -> None:
        """One more object holds ``layout``'s extents."""
        for e in layout.extents:
            self._refs[(e.device, e.offset)] += 1

    def load(self, layout: Layout) -> None:
        """An object found in the index at start-up: reserve its extents, or count it as
        one more holder of extents another object already reserved."""
        for e in layout.extents:
            key = (e.device, e.offset)
            if key in self._refs:
                self._refs[key] += 1
            else:
                self.devices[e.device].allocator.reserve(e.offset, e.length)
                self._refs[key] = 1

    def release(self, layout: Layout) -> None:
        """An object let go of ``layout``: extents nobody else holds are free again."""
        for e in layout.extents:
            key = (e.device, e.offset)
            self._refs[key] -= 1
            if self._refs[key] == 0:
                del self._refs[key]
                self.devices[e.device].allocator.free(e.offset, e.length)
