"""A checkpoint directory on disk: its layout, its manifest's schema, and file access that
never leaves it.

    DIR/manifest.json      format, mode, namespace, step, groups, objects
    DIR/client_state.bin   what the client asked to keep (opaque bytes to the daemon)
    DIR/objects/NNNNNN.bin copy mode: each object's bytes

The daemon reads and writes these as its own user, in directories a tenant may name, so
every access goes through descriptors: the parent directory is opened and its real path
(``/proc/self/fd``) checked against the allowed roots, the checkpoint directory and each
file are opened relative to it with ``O_NOFOLLOW``, and only the names above can be
opened at all (a manifest's file entries must match ``objects/NNNNNN.bin``). What is
opened must be a regular file (a directory for the directories), with one link where
the caller is a tenant (a hard link would name a file the tenant cannot read), owned by
whom the caller says, and no larger than the caller's limit. Nothing here trusts a
manifest: ``parse_manifest`` checks every field's type and range and returns a
``Manifest``; which namespace and owner a checkpoint has is decided by the caller from
the daemon's index (fuyoud/checkpoints/checkpointer.py).
"""
from __future__ import annotations

import errno
import json
import os
import re
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path

from fuyoud.errors import (DataLoss, FailedPrecondition, FuyouError, InvalidArgument, NotFound, PermissionDenied,
                           ResourceExhausted)
from fuyoud.sessions.names import shown, valid_namespace
from fuyoud.units import align_up, format_size

FORMAT = "fuyou-checkpoint/1"
MANIFEST = "manifest.json"
CLIENT_STATE = "client_state.bin"
OBJECTS = "objects"
FILE_LAYOUT = (MANIFEST, CLIENT_STATE)  # the files beside objects/
OBJECT_FILE_RE = re.compile(r"^objects/([0-9]{6})\.bin$")
MAX_MANIFEST = 64 << 20
MAX_CLIENT_STATE = 16 << 20
MAX_OBJECTS = 1 << 20
MAX_OBJECT_BYTES = 1 << 50
DIR_MODE = 0o700  # a checkpoint directory and its objects/: the daemon's alone
FILE_MODE = 0o600
_OPEN_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def object_file(index: int) -> str:
    return f"{OBJECTS}/{index:06d}.bin"


def real_path(fd: int) -> Path:
    return Path(os.readlink(f"/proc/self/fd/{fd}"))


class Location:
    """Where a checkpoint directory is (or will be): its parent, opened and confined, and
    its name in it. Every later operation is relative to the parent's descriptor, so
    replacing a path component with a symlink after the check changes nothing."""

    def __init__(self, directory: str, roots: list[Path] | None):
        if not isinstance(directory, str) or not directory.startswith("/"):
            raise InvalidArgument(f"checkpoint directory must be an absolute path on the daemon's host, "
                                  f"got {shown(directory)}")
        path = Path(directory)
        if ".." in path.parts or path.name in ("", ".", ".."):
            raise InvalidArgument(f"checkpoint directory {shown(directory)} must name a directory, without '..'")
        self.name = path.name
        try:
            self.parent_fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except FileNotFoundError:
            raise FailedPrecondition(f"the parent of checkpoint directory {shown(directory)} does not exist") from None
        except NotADirectoryError:
            raise InvalidArgument(f"the parent of checkpoint directory {shown(directory)} is not a directory") from None
        except PermissionError:
            raise PermissionDenied(f"fuyoud may not open the parent of checkpoint directory {shown(directory)}") \
                from None
        self.parent = real_path(self.parent_fd)
        self.path = self.parent / self.name
        if roots is not None and not any(self.path.is_relative_to(r) and self.path != r for r in roots):
            os.close(self.parent_fd)
            raise PermissionDenied(f"checkpoints go only under {', '.join(map(str, roots))} ([daemon] "
                                   f"checkpoint_dirs), not {shown(directory)}")

    def close(self) -> None:
        os.close(self.parent_fd)

    def __enter__(self) -> "Location":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def device(self) -> int:
        return os.fstat(self.parent_fd).st_dev

    def exists(self) -> bool:
        try:
            os.stat(self.name, dir_fd=self.parent_fd, follow_symlinks=False)
            return True
        except FileNotFoundError:
            return False

    def new_checkpoint(self) -> "NewCheckpoint":
        return NewCheckpoint(self)

    def open(self, owner: int | None = None, single_links: bool = False) -> "CheckpointDir":
        """The existing checkpoint directory (not a symlink), for reading."""
        try:
            fd = os.open(self.name, _OPEN_DIR, dir_fd=self.parent_fd)
        except FileNotFoundError:
            raise NotFound(f"no checkpoint at {self.path}") from None
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                raise InvalidArgument(f"checkpoint {self.path} is not a directory (symlinks are refused)") from None
            raise FailedPrecondition(f"cannot open checkpoint {self.path}: {exc.strerror}") from None
        st = os.fstat(fd)
        if owner is not None and st.st_uid != owner:
            os.close(fd)
            raise PermissionDenied(f"checkpoint {self.path} is owned by uid {st.st_uid}, not uid {owner}")
        return CheckpointDir(fd, self.path, owner, single_links)

    def remove(self, name: str | None = None) -> None:
        """Remove the directory ``name`` (default: the checkpoint's) and everything in it,
        without following symlinks."""
        try:
            shutil.rmtree(name or self.name, dir_fd=self.parent_fd)
        except FileNotFoundError:
            pass

    def partials(self) -> list[str]:
        """Names of unfinished writes of this checkpoint (``NAME.partial-<pid>``)."""
        prefix = f"{self.name}.partial-"
        return [n for n in os.listdir(self.parent_fd) if n.startswith(prefix)]


class CheckpointDir:
    """An open checkpoint directory: reads its files, confined to it."""

    def __init__(self, fd: int, path: Path, owner: int | None, single_links: bool):
        self.fd, self.path, self.owner, self.single_links = fd, path, owner, single_links

    def close(self) -> None:
        os.close(self.fd)

    def __enter__(self) -> "CheckpointDir":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def has_manifest(self) -> bool:
        """Whether the directory has a manifest entry at all (what it is, ``read`` checks)."""
        try:
            os.stat(MANIFEST, dir_fd=self.fd, follow_symlinks=False)
        except FileNotFoundError:
            return False
        return True

    def open_file(self, rel: str, size: int | None = None, limit: int | None = None,
                  missing_ok: bool = False) -> int | None:
        """A descriptor of the checkpoint's file ``rel`` (one of the names of the layout),
        checked: a regular file, of ``size`` bytes exactly or at most ``limit``."""
        if rel in (MANIFEST, CLIENT_STATE):
            dir_fd, name, close_dir = self.fd, rel, False
        elif OBJECT_FILE_RE.match(rel):
            try:
                dir_fd = os.open(OBJECTS, _OPEN_DIR, dir_fd=self.fd)
            except OSError:
                raise DataLoss(f"checkpoint {self.path} has no {OBJECTS}/ directory") from None
            name, close_dir = rel.split("/", 1)[1], True
        else:
            raise InvalidArgument(f"checkpoint {self.path}: the manifest names file {shown(rel)}; only "
                                  "objects/NNNNNN.bin files are part of a checkpoint")
        try:
            try:
                fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=dir_fd)
            except FileNotFoundError:
                if missing_ok:
                    return None
                raise DataLoss(f"checkpoint {self.path} lacks {rel}") from None
            except OSError as exc:
                if exc.errno == errno.ELOOP:
                    raise InvalidArgument(f"checkpoint {self.path}: {rel} is a symlink; refused") from None
                raise DataLoss(f"cannot open {rel} of checkpoint {self.path}: {exc.strerror}") from None
        finally:
            if close_dir:
                os.close(dir_fd)
        try:
            self._check(fd, rel, size, limit)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _check(self, fd: int, rel: str, size: int | None, limit: int | None) -> None:
        st = os.fstat(fd)
        where = f"{rel} of checkpoint {self.path}"
        if not stat.S_ISREG(st.st_mode):
            raise InvalidArgument(f"{where} is not a regular file")
        if self.owner is not None and st.st_uid != self.owner:
            raise PermissionDenied(f"{where} is owned by uid {st.st_uid}, not uid {self.owner}")
        if self.single_links and st.st_nlink != 1:
            raise PermissionDenied(f"{where} has {st.st_nlink} hard links; a checkpoint's files have one")
        if size is not None and st.st_size != size:
            raise DataLoss(f"{where} holds {st.st_size} bytes, the manifest says {size}")
        if limit is not None and st.st_size > limit:
            raise InvalidArgument(f"{where} is larger than {limit} bytes")

    def read(self, rel: str, limit: int, missing_ok: bool = False) -> bytes:
        fd = self.open_file(rel, limit=limit, missing_ok=missing_ok)
        if fd is None:
            return b""
        with os.fdopen(fd, "rb", buffering=0) as f:
            data = f.read(limit + 1)
        if len(data) > limit:
            raise InvalidArgument(f"{rel} of checkpoint {self.path} is larger than {limit} bytes")
        return data


def refuse_existing(location: Location) -> None:
    if location.exists():
        raise FailedPrecondition(f"checkpoint directory {location.path} already exists; name a new one")


# The manifest's size, over-estimated: its fixed fields, and per object its entry and its
# group's (the optimizer's settings) in indented JSON, besides the object's name twice.
MANIFEST_BASE = 4096
MANIFEST_PER_OBJECT = 1024


def copy_bytes(objects: list[tuple[str, int]], client_state: int, block: int) -> int:
    """What a copy checkpoint of ``objects`` ((name, size) each) takes on a filesystem of
    ``block``-byte blocks: each object's file, the client state and the manifest, each
    rounded up to whole blocks, and the two directories. A small over-estimate: refusing
    a checkpoint that would just have fit costs less than one that fails mid-way."""
    manifest = MANIFEST_BASE + sum(MANIFEST_PER_OBJECT + 2 * len(name) for name, _ in objects)
    files = [size for _, size in objects] + [client_state, manifest]
    return sum(align_up(n, block) for n in files) + 2 * block


def require_room(location: Location, objects: list[tuple[str, int]], client_state: int) -> None:
    """ResourceExhausted, before anything is written, unless a copy of ``objects`` fits
    the free space of the filesystem the checkpoint directory goes to."""
    st = os.fstatvfs(location.parent_fd)
    free = st.f_bavail * st.f_frsize
    needed = copy_bytes(objects, client_state, st.f_frsize or 4096)
    if needed > free:
        raise ResourceExhausted(
            f"checkpoint {location.path} needs {needed:,} bytes ({format_size(needed)}) for the copies of "
            f"{len(objects)} objects and its manifest, but its filesystem has {free:,} bytes ({format_size(free)}) "
            "free; nothing was written. Name a directory on a filesystem with room, free space on this one, or "
            "take a snapshot (mode 'snapshot', in a directory on the SSD array's filesystem: nothing is copied)")


def write_failure(path: Path, exc: OSError) -> FuyouError:
    """The error for a checkpoint whose write failed with ``exc`` (its partial directory
    removed): ResourceExhausted where the filesystem is full, FailedPrecondition else."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return ResourceExhausted(f"cannot write checkpoint {path}: {exc.strerror} (its filesystem filled while the "
                                 "checkpoint was written: another writer took the room); nothing of it was left. "
                                 "Free space there, or name a directory on another filesystem")
    return FailedPrecondition(f"cannot write checkpoint {path}: {exc.strerror or exc}")


class NewCheckpoint:
    """A checkpoint being written: ``NAME.partial-<pid>`` in the location's parent, renamed
    to NAME by ``publish`` (so NAME is complete or absent), removed by ``discard``."""

    def __init__(self, location: Location):
        refuse_existing(location)
        self.location = location
        self.partial = f"{location.name}.partial-{os.getpid()}"
        parent = location.parent_fd
        self.fd = self.objects_fd = -1
        try:
            os.mkdir(self.partial, DIR_MODE, dir_fd=parent)
            self.fd = os.open(self.partial, _OPEN_DIR, dir_fd=parent)
            os.mkdir(OBJECTS, DIR_MODE, dir_fd=self.fd)
            self.objects_fd = os.open(OBJECTS, _OPEN_DIR, dir_fd=self.fd)
        except OSError as exc:
            self._close()
            location.remove(self.partial)
            raise write_failure(location.path, exc) from None
        # mkdir's mode passed through the umask: make it exact.
        os.fchmod(self.fd, DIR_MODE)
        os.fchmod(self.objects_fd, DIR_MODE)

    def create(self, rel: str) -> int:
        """A new file of the layout, mode 0600, for writing."""
        if rel in (MANIFEST, CLIENT_STATE):
            dir_fd, name = self.fd, rel
        elif OBJECT_FILE_RE.match(rel):
            dir_fd, name = self.objects_fd, rel.split("/", 1)[1]
        else:
            raise ValueError(f"{rel} is not a file of a checkpoint")
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE,
                     dir_fd=dir_fd)
        os.fchmod(fd, FILE_MODE)
        return fd

    def write(self, rel: str, data: bytes) -> None:
        fd = self.create(rel)
        try:
            view, done = memoryview(data), 0
            while done < len(view):
                done += os.write(fd, view[done:])
            os.fsync(fd)
        finally:
            os.close(fd)

    def publish(self) -> None:
        os.fsync(self.objects_fd)
        os.fsync(self.fd)
        parent = self.location.parent_fd
        os.rename(self.partial, self.location.name, src_dir_fd=parent, dst_dir_fd=parent)
        os.fsync(parent)
        self._close()

    def discard(self) -> None:
        self._close()
        self.location.remove(self.partial)

    def _close(self) -> None:
        for fd in (self.objects_fd, self.fd):
            if fd >= 0:
                os.close(fd)
        self.objects_fd = self.fd = -1


# -- the manifest ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class ObjectEntry:
    name: str
    size: int
    version: int
    file: str = ""  # copy mode
    crc32: int = 0  # copy mode
    snapshot: str = ""  # snapshot mode: the linked object's name


@dataclass(frozen=True)
class Manifest:
    mode: str
    namespace: str
    step: int
    groups: list[dict]
    objects: list[ObjectEntry]


def _int(value, what: str, low: int, high: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise InvalidArgument(f"checkpoint manifest: {what} must be an integer in [{low}, {high}], "
                              f"got {shown(value, 32)}")
    return value


def _str(value, what: str) -> str:
    if not isinstance(value, str):
        raise InvalidArgument(f"checkpoint manifest: {what} must be a string, got {type(value).__name__}")
    return value


def _object_name(value, what: str) -> str:
    from fuyoud.sessions.names import check_name  # (the rule object names follow everywhere)

    try:
        return check_name(_str(value, what))
    except InvalidArgument as exc:
        raise InvalidArgument(f"checkpoint manifest: {what}: {exc}") from None


def parse_manifest(data: bytes) -> Manifest:
    """The manifest's fields, each checked for type and range; InvalidArgument otherwise."""
    try:
        raw = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError:
        raise InvalidArgument("checkpoint manifest is not UTF-8") from None
    except ValueError as exc:
        raise InvalidArgument(f"checkpoint manifest is not JSON (line {getattr(exc, 'lineno', '?')}, column "
                              f"{getattr(exc, 'colno', '?')})") from None
    except RecursionError:
        raise InvalidArgument("checkpoint manifest nests too deeply") from None
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        raise InvalidArgument(f"not a {FORMAT} checkpoint manifest")
    mode = raw.get("mode")
    if mode not in ("copy", "snapshot"):
        raise InvalidArgument(f"checkpoint manifest: mode must be copy or snapshot, got {shown(mode, 32)}")
    namespace = raw.get("namespace")
    if not valid_namespace(namespace):
        raise InvalidArgument(f"checkpoint manifest: bad namespace {shown(namespace, 32)}")
    step = _int(raw.get("step"), "step", 0, 2**63 - 1)
    groups = raw.get("groups", [])
    if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
        raise InvalidArgument("checkpoint manifest: groups must be a list of objects")
    items = raw.get("objects")
    if not isinstance(items, list) or len(items) > MAX_OBJECTS:
        raise InvalidArgument(f"checkpoint manifest: objects must be a list of at most {MAX_OBJECTS}")
    objects, names, files = [], set(), set()
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise InvalidArgument(f"checkpoint manifest: objects[{i}] is not an object")
        name = _object_name(item.get("name"), f"objects[{i}].name")
        size = _int(item.get("size"), f"objects[{i}].size", 0, MAX_OBJECT_BYTES)
        version = _int(item.get("version", 0), f"objects[{i}].version", 0, 2**63 - 1)
        if name in names:
            raise InvalidArgument(f"checkpoint manifest: object {shown(name)} appears twice")
        names.add(name)
        if mode == "copy":
            file = _str(item.get("file"), f"objects[{i}].file")
            if not OBJECT_FILE_RE.match(file) or file in files:
                raise InvalidArgument(f"checkpoint manifest: objects[{i}].file must be a distinct "
                                      f"objects/NNNNNN.bin, got {shown(file, 32)}")
            files.add(file)
            crc = _int(item.get("crc32"), f"objects[{i}].crc32", 0, 2**32 - 1)
            objects.append(ObjectEntry(name, size, version, file=file, crc32=crc))
        else:
            snapshot = _object_name(item.get("snapshot"), f"objects[{i}].snapshot")
            objects.append(ObjectEntry(name, size, version, snapshot=snapshot))
    return Manifest(mode, namespace, step, groups, objects)
