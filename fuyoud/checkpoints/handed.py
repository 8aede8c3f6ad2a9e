"""A checkpoint directory the client holds: the daemon reaches it only through the
descriptors the client handed (fuyoud/sessions/handed.py), never by path.

This is how a tenant's checkpoints are written and read: the client, with its own rights,
creates ``DIR.partial-<pid>-<n>/`` and its ``objects/NNNNNN.bin`` files (or opens an
existing checkpoint's directory and files for reading) and hands their descriptors; the
daemon writes the objects' bytes into them (or reads them), and the client writes the
manifest the daemon returns, then renames the directory into place. Every file is the
user's, in a directory the user chose, and the daemon can write and read there nothing
the user could not (docs/design/threat-model.md). ``HandedLocation`` and ``HandedDir``
stand in for ``Location`` and ``CheckpointDir`` (files.py) in the checkpointer.

Names a client hands (each once):
    "dir"                   the checkpoint's directory (new: the partial one), O_RDONLY
    "manifest.json", "client_state.bin"   restore and delete: the existing files, O_RDONLY
    "objects/NNNNNN.bin"    copy: new, empty files opened for writing (checkpoint), or
                            the existing ones (restore)
"""
from __future__ import annotations

import fcntl
import os
import stat
from pathlib import Path

from fuyoud.checkpoints.files import FILE_LAYOUT, MANIFEST, OBJECT_FILE_RE, real_path
from fuyoud.errors import DataLoss, FailedPrecondition, InvalidArgument, NotFound
from fuyoud.sessions.handed import Handed
from fuyoud.sessions.names import shown

DIR = "dir"


def _check_name(name: str) -> None:
    if name != DIR and name not in FILE_LAYOUT and not OBJECT_FILE_RE.match(name):
        raise InvalidArgument(f"the client handed {shown(name)}, which is not a file of a checkpoint")


class HandedLocation:
    """Where the checkpoint is, as the client's descriptors say (``new``: the partial
    directory of one being written, renamed to ``name`` by the client afterwards)."""

    def __init__(self, directory: str, handed: Handed, new: bool):
        if not isinstance(directory, str) or not directory.startswith("/"):
            handed.close()
            raise InvalidArgument(f"checkpoint directory must be an absolute path, got {shown(directory)}")
        self.handed = handed
        try:
            for name in handed.names:
                _check_name(name)
            self.dir_fd = handed.pop(DIR)
            st = os.fstat(self.dir_fd)
            if not stat.S_ISDIR(st.st_mode):
                raise InvalidArgument("the checkpoint directory the client handed is not a directory")
            real = real_path(self.dir_fd)
            self.name = Path(directory).name
            if new:
                if not real.name.startswith(f"{self.name}.partial"):
                    raise InvalidArgument(f"the directory the client handed ({shown(real.name)}) is not a partial "
                                          f"directory of {shown(self.name)}")
                self.path = real.parent / self.name
            else:
                self.path = real
        except BaseException:
            self.close()
            raise
        self.parent_fd = self.dir_fd  # (require_room: the same filesystem)

    def close(self) -> None:
        self.handed.close()
        if getattr(self, "dir_fd", -1) >= 0:
            os.close(self.dir_fd)
            self.dir_fd = -1

    def __enter__(self) -> "HandedLocation":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def device(self) -> int:
        return os.fstat(self.dir_fd).st_dev

    def exists(self) -> bool:
        return False  # (the client made a new directory; an existing DIR it refused itself)

    def new_checkpoint(self) -> "HandedCheckpoint":
        return HandedCheckpoint(self)

    def open(self, owner: int | None = None, single_links: bool = False) -> "HandedDir":
        """The handed checkpoint, for reading. Owner and links are not checked: the daemon
        reads only what the client could open itself."""
        return HandedDir(self)

    def remove(self, name: str | None = None) -> None:
        """Nothing: the client removes its own directory."""


class HandedDir:
    """An existing checkpoint's files, as handed: ``CheckpointDir``'s reading interface."""

    def __init__(self, location: HandedLocation):
        self.location, self.path, self.fd = location, location.path, location.dir_fd

    def close(self) -> None:
        pass  # (the location closes what it holds)

    def __enter__(self) -> "HandedDir":
        return self

    def __exit__(self, *exc) -> None:
        pass

    def has_manifest(self) -> bool:
        return self.location.handed.has(MANIFEST)

    def open_file(self, rel: str, size: int | None = None, limit: int | None = None,
                  missing_ok: bool = False) -> int | None:
        if not self.location.handed.has(rel):
            if missing_ok:
                return None
            raise DataLoss(f"checkpoint {self.path} lacks {rel} (the client handed no such file)")
        fd = self.location.handed.pop(rel)
        try:
            st = os.fstat(fd)
            where = f"{rel} of checkpoint {self.path}"
            if not stat.S_ISREG(st.st_mode):
                raise InvalidArgument(f"{where} is not a regular file")
            if size is not None and st.st_size != size:
                raise DataLoss(f"{where} holds {st.st_size} bytes, the manifest says {size}")
            if limit is not None and st.st_size > limit:
                raise InvalidArgument(f"{where} is larger than {limit} bytes")
            os.lseek(fd, 0, os.SEEK_SET)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def read(self, rel: str, limit: int, missing_ok: bool = False) -> bytes:
        fd = self.open_file(rel, limit=limit, missing_ok=missing_ok)
        if fd is None:
            return b""
        with os.fdopen(fd, "rb", buffering=0) as f:
            data = f.read(limit + 1)
        if len(data) > limit:
            raise InvalidArgument(f"{rel} of checkpoint {self.path} is larger than {limit} bytes")
        return data


class HandedCheckpoint:
    """A checkpoint being written into the client's files: ``NewCheckpoint``'s interface.
    The object files are the client's (empty, writable); the manifest and client state are
    kept here for the reply (the client writes them, then renames the directory)."""

    def __init__(self, location: HandedLocation):
        self.location = location
        self.kept: dict[str, bytes] = {}

    def require_objects(self, count: int) -> None:
        """The client handed exactly ``count`` object files (it counted the namespace's
        persistent objects before asking; a different count means they changed since)."""
        handed = sum(1 for n in self.location.handed.names if OBJECT_FILE_RE.match(n))
        if handed != count:
            raise FailedPrecondition(f"the namespace has {count} persistent objects to copy but the client handed "
                                     f"{handed} files for them (its objects changed in between): retry")

    def create(self, rel: str) -> int:
        if not OBJECT_FILE_RE.match(rel):
            raise ValueError(f"{rel} is not an object file")
        try:
            fd = self.location.handed.pop(rel)
        except InvalidArgument:
            raise NotFound(f"the client handed no file {rel} for checkpoint {self.location.path}") from None
        try:
            st = os.fstat(fd)
            flags = fcntl.fcntl(fd, fcntl.F_GETFL)
            if not stat.S_ISREG(st.st_mode) or st.st_size != 0:
                raise InvalidArgument(f"{rel} of checkpoint {self.location.path}: the client handed a file that is "
                                      "not a new, empty regular file")
            if flags & os.O_ACCMODE not in (os.O_WRONLY, os.O_RDWR) or flags & os.O_APPEND:
                raise InvalidArgument(f"{rel} of checkpoint {self.location.path}: the client handed a file not open "
                                      "for writing (or open for appending)")
        except BaseException:
            os.close(fd)
            raise
        return fd

    def write(self, rel: str, data: bytes) -> None:
        self.kept[rel] = bytes(data)

    def publish(self) -> None:
        pass  # (the client renames its partial directory once it has the manifest)

    def discard(self) -> None:
        pass  # (the location closes what was not used; the client removes its directory)

