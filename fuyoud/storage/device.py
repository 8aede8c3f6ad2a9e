"""One SSD of the array: a preallocated data file in a directory on it.

The file is created once at the configured capacity (fallocate, so a full disk is found
at start-up, not in the middle of a run) and opened with O_DIRECT where the file system
allows it. An exclusive flock keeps a second daemon off the same directory.
"""
from __future__ import annotations

import fcntl
import logging
import os
from pathlib import Path

from fuyoud.allocator import ExtentAllocator
from fuyoud.units import format_size
from fuyou_proto.contract import PAGE as BLOCK

log = logging.getLogger(__name__)

DATA_FILE = "fuyou.data"
LOCK_FILE = "fuyou.lock"


class DeviceError(RuntimeError):
    pass


class Device:
    def __init__(self, index: int, directory: Path, capacity: int, direct: bool = True):
        self.index = index
        self.directory = Path(directory)
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
            self.fd, self.direct = self._open(direct)
        except BaseException:
            os.close(self._lock_fd)
            raise
        self.allocator = ExtentAllocator(capacity, BLOCK)

    def _open(self, direct: bool) -> tuple[int, bool]:
        flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC
        fd = os.open(self.path, flags, 0o600)
        try:
            os.fchmod(fd, 0o600)  # every tenant's state: the daemon's alone (also a file an older fuyoud made)
            size = os.fstat(fd).st_size
            if size < self.capacity:
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
        os.close(self.fd)
        os.close(self._lock_fd)
