"""One SSD of the array: a data file in a directory on it.

With a configured capacity the file is created once at that size (fallocate, so a full
disk is found at start-up, not in the middle of a run). With ``capacity_per_device =
"auto"`` (the default) it starts at the size it has (empty when new) and grows on demand
(``grow``, fallocate again, in steps of at least GROW_STEP) for as long as the file system
keeps ``keep_free`` bytes free for everything else on it (exports, checkpoint copies,
the other users of the disk): a private daemon then holds what its disk can give,
and no more than its objects need. A full disk is then found when a client attaches
(it checks ``available()``) or, if something else filled it since, as a clear error on
the write that needed room, which commits nothing. The file never shrinks while the
daemon runs. It is opened with O_DIRECT where the file system allows it. An exclusive
flock keeps a second daemon off the same directory.
"""
from __future__ import annotations

import fcntl
import logging
import os
from pathlib import Path

from fuyoud.memory.allocator import ExtentAllocator
from fuyoud.units import format_size
from fuyou_proto.contract import PAGE as BLOCK

log = logging.getLogger(__name__)

DATA_FILE = "fuyou.data"
LOCK_FILE = "fuyou.lock"


class DeviceError(RuntimeError):
    pass


GROW_STEP = 1 << 30  # the least an "auto" data file grows by (fewer, larger extents)


def keep_free_default(directory: Path) -> int:
    """What an "auto" data file leaves free on its file system by default: 5% of the
    file system, at least 1 GiB and at most 16 GiB."""
    st = os.statvfs(directory)
    return min(max(st.f_blocks * st.f_frsize // 20, 1 << 30), 16 << 30)


class Device:
    def __init__(self, index: int, directory: Path, capacity: int, direct: bool = True, keep_free: int = 0):
        """``capacity`` 0: "auto" (grows on demand while ``keep_free`` bytes stay free on
        the file system; 0 there: ``keep_free_default``)."""
        self.index = index
        self.directory = Path(directory)
        self.auto = capacity == 0
        self.capacity = capacity
        self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.path = self.directory / DATA_FILE
        self._lock_fd = os.open(self.directory / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            raise DeviceError(f"{self.directory} is in use by another fuyoud (lock {LOCK_FILE})") from None
        try:
            self.keep_free = keep_free or keep_free_default(self.directory)
            self.fd, self.direct = self._open(direct)
        except BaseException:
            os.close(self._lock_fd)
            raise
        self.allocator = ExtentAllocator(self.capacity, BLOCK)

    def _fs_free(self) -> int:
        st = os.statvfs(self.directory)
        return st.f_bavail * st.f_frsize

    def growable(self) -> int:
        """Bytes an "auto" data file may still grow by (0 for a fixed capacity)."""
        if not self.auto:
            return 0
        return max(0, self._fs_free() - self.keep_free) // BLOCK * BLOCK

    def available(self) -> int:
        """Bytes still allocatable here: free in the data file plus what it may grow by."""
        return self.allocator.free_bytes + self.growable()

    def grow(self, need: int) -> bool:
        """(the store's lock held) Grow an "auto" data file so that a hole of ``need``
        bytes fits at its end: by at least GROW_STEP and an eighth of its size, within
        ``growable()``. False when it cannot (fixed capacity, or the file system would
        keep less than ``keep_free`` free)."""
        room = self.growable()
        tail = self.allocator.tail_free()
        need = max(0, -(-(need - tail) // BLOCK) * BLOCK)
        if room < need or not need:
            return False
        step = min(room, max(need, GROW_STEP, self.capacity // 8 // BLOCK * BLOCK))
        try:
            os.posix_fallocate(self.fd, self.capacity, step)
        except OSError as exc:
            log.warning("%s: growing the data file by %s failed: %s", self.path, format_size(step), exc.strerror)
            return False
        self.capacity += step
        self.allocator.extend(self.capacity)
        log.info("%s grew to %s", self.path, format_size(self.capacity))
        return True

    def _open(self, direct: bool) -> tuple[int, bool]:
        flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC
        fd = os.open(self.path, flags, 0o600)
        try:
            os.fchmod(fd, 0o600)  # every tenant's state: the daemon's alone (also a file an older fuyoud made)
            size = os.fstat(fd).st_size
            if self.auto:  # (what it has now; it grows on demand)
                self.capacity = size // BLOCK * BLOCK
            elif size < self.capacity:
                # Check first: a full disk is a start-up error, never a mid-run surprise.
                st = os.statvfs(self.directory)
                free = st.f_bavail * st.f_frsize
                if free < self.capacity - size:
                    raise DeviceError(
                        f"not enough space in {self.directory} for a {format_size(self.capacity)} "
                        f"data file ({format_size(free)} free); lower [storage.capacity_per_device] "
                        "or free space")
                try:
                    os.posix_fallocate(fd, 0, self.capacity)
                except OSError as exc:
                    os.ftruncate(fd, size)  # leave the file as it was
                    raise DeviceError(f"cannot preallocate {format_size(self.capacity)} in {self.path}: "
                                      f"{exc.strerror}") from None
            elif size > self.capacity:
                log.info("%s is %s, larger than the configured capacity; using %s", self.path,
                         format_size(size), format_size(self.capacity))
        except BaseException:
            os.close(fd)
            raise
        if not direct:
            return fd, False
        try:
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_DIRECT)
            return fd, True
        except OSError as exc:  # tmpfs and some others refuse O_DIRECT
            log.warning("%s: O_DIRECT refused (%s); using buffered I/O", self.path, exc.strerror)
            return fd, False

    def sync(self) -> None:
        os.fdatasync(self.fd)

    def close(self) -> None:
        """Close the data file and give up the directory's lock (both, even if the first
        close fails; idempotent)."""
        fds, self.fd, self._lock_fd = (self.fd, self._lock_fd), -1, -1
        try:
            if fds[0] >= 0:
                os.close(fds[0])
        finally:
            if fds[1] >= 0:
                os.close(fds[1])
