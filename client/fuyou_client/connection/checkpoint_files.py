"""The client's side of a checkpoint directory: it is the user's.

The client creates, opens and removes the directory and its files with the user's own
rights, and hands fuyoud their descriptors over the session socket (fuyoud/sessions/
handed.py); the daemon writes and reads only through them (fuyoud/checkpoints/handed.py).
So a checkpoint goes wherever the user can write (a Trainer's ``output_dir`` in a home
directory, under the host's daemon running as its own user), every file in it is the
user's, and the daemon can do nothing there that the user could not.

Writing: ``DIR.partial-<pid>-<hex>/`` with ``objects/NNNNNN.bin`` (one new file per
persistent object, for a copy), handed; the daemon copies the objects into them at a
point between steps and returns the manifest; the client writes ``manifest.json`` and
``client_state.bin``, syncs, renames the directory to ``DIR`` (complete or absent) and
commits it: only then does the daemon record it and keep a snapshot's objects, so a
process that dies mid-checkpoint leaves nothing on the array (its session's end removes
them; a ``DIR.partial-*`` left in the user's directory is the user's to remove).
A snapshot's objects stay on the daemon's array, so its directory holds the manifest
alone (the object files handed in "auto" mode are removed again, still empty).
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import secrets
import shutil
import stat
from pathlib import Path

from fuyou_client import errors
from fuyou_proto import pb
from fuyou_proto.contract import SNAPSHOT_PREFIX

MANIFEST = "manifest.json"
CLIENT_STATE = "client_state.bin"
OBJECTS = "objects"
NAMED_FILE = re.compile(r"^objects/[0-9]{6}\.bin$")  # (a manifest's file entries)
MAX_MANIFEST = 64 << 20
DIR_MODE = 0o700
FILE_MODE = 0o600
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC


def _absolute(directory) -> Path:
    return Path(os.path.abspath(os.fspath(directory)))


def _write_file(dir_fd: int, name: str, data: bytes) -> None:
    fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE, dir_fd=dir_fd)
    try:
        view, done = memoryview(data), 0
        while done < len(view):
            done += os.write(fd, view[done:])
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, _DIR_FLAGS)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _objects_to_copy(session) -> int:
    """How many files a copy needs: the namespace's persistent objects, but its snapshots'."""
    return sum(1 for o in session.objects() if o.persistent and not o.name.startswith(SNAPSHOT_PREFIX))


def _open_to_read(name: str, dir_fd: int, path: Path) -> int:
    try:
        return os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=dir_fd)
    except PermissionError:
        raise errors.PermissionDenied(f"this process may not read {name} of checkpoint {path}") from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise errors.InvalidArgument(f"checkpoint {path}: {name} is a symlink; refused") from None
        raise


def _files_named(dir_fd: int) -> list[str]:
    """The object files the checkpoint's manifest names (``objects/NNNNNN.bin``; only those
    are handed: another file in objects/ is none of the daemon's business). Nothing where the
    manifest is missing or not one: the daemon then says what is wrong with it."""
    try:
        fd = os.open(MANIFEST, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=dir_fd)
    except OSError:
        return []
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_MANIFEST:
            return []
        with os.fdopen(os.dup(fd), "rb") as f:
            raw = json.loads(f.read(MAX_MANIFEST + 1))
        listed = raw.get("objects") if isinstance(raw, dict) else None
        files = [o.get("file") for o in listed if isinstance(o, dict)] if isinstance(listed, list) else []
    except (OSError, ValueError, RecursionError):
        return []
    finally:
        os.close(fd)
    return sorted({f.split("/", 1)[1] for f in files if isinstance(f, str) and NAMED_FILE.match(f)})


def _create_new(name: str, dir_fd: int) -> int:
    return os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE, dir_fd=dir_fd)


def _open_objects(directory: Path, files: list[str], open_one, names: list[str], fds: list[int]) -> None:
    """Open each of ``files`` in ``directory``/objects/ with ``open_one(name, dir_fd)``,
    appending the layout's name and the descriptor (the caller closes them)."""
    if not files:
        return
    objects_fd = os.open(directory / OBJECTS, _DIR_FLAGS)
    try:
        for name in files:
            fds.append(open_one(name, objects_fd))
            names.append(f"{OBJECTS}/{name}")
    finally:
        os.close(objects_fd)


def _write_failure(target: Path, exc: OSError) -> Exception:
    """The error for a checkpoint the client could not write (its partial directory gone)."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return errors.ResourceExhausted(f"cannot write checkpoint {target}: {exc.strerror}; nothing of it was left. "
                                        "Free space there, or name a directory on another filesystem")
    return exc


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)


def _hand(session, names: list[str], fds: list[int]) -> str:
    """Hand ``fds`` (closed here, however it ends) under a new key; returns the key."""
    try:
        key = f"ckpt-{secrets.token_hex(8)}"
        session.hand(key, names, fds)
        return key
    finally:
        _close_all(fds)


def write(session, directory, timeout: float, mode: str, client_state: bytes) -> pb.CheckpointReply:
    """Checkpoint the session's namespace into the new directory ``directory`` (see the
    module's docstring); the reply names the mode the daemon chose."""
    target = _absolute(directory)
    if target.exists() or target.is_symlink():
        raise errors.FailedPrecondition(f"checkpoint directory {target} already exists; name a new one")
    if not target.parent.is_dir():
        raise errors.FailedPrecondition(f"the parent of checkpoint directory {target} does not exist")
    partial = target.parent / f"{target.name}.partial-{os.getpid()}-{secrets.token_hex(3)}"
    try:
        os.mkdir(partial, DIR_MODE)
    except PermissionError:
        raise errors.PermissionDenied(f"cannot create checkpoint directory {target}: this process may not write "
                                      f"in {target.parent}") from None
    except OSError as exc:
        raise _write_failure(target, exc) from None
    try:
        os.chmod(partial, DIR_MODE)  # (mkdir's mode went through the umask)
        os.mkdir(partial / OBJECTS, DIR_MODE)
        count = 0 if mode == "snapshot" else _objects_to_copy(session)
        names, fds = ["dir"], [os.open(partial, _DIR_FLAGS)]
        try:
            _open_objects(partial, [f"{i:06d}.bin" for i in range(count)], _create_new, names, fds)
        except BaseException:
            _close_all(fds)
            raise
        key = _hand(session, names, fds)
        reply = session.call("Checkpoint", pb.CheckpointRequest(
            directory=str(target), timeout_seconds=timeout, mode=mode, client_state=client_state, handed=key),
            timeout=timeout + 3600)
        if reply.mode == "snapshot":  # (its objects stayed on the array: the files handed for a copy are empty)
            for name in os.listdir(partial / OBJECTS):
                os.unlink(partial / OBJECTS / name)
        dir_fd = os.open(partial, _DIR_FLAGS)
        try:
            _write_file(dir_fd, CLIENT_STATE, client_state)
            _write_file(dir_fd, MANIFEST, reply.manifest)
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
        _fsync_dir(partial / OBJECTS)
        os.rename(partial, target)
        _fsync_dir(target.parent)
    except BaseException as exc:
        shutil.rmtree(partial, ignore_errors=True)
        if isinstance(exc, OSError):
            raise _write_failure(target, exc) from None
        raise
    try:  # (until then the daemon keeps nothing of it: a process that dies here leaves nothing on the array)
        session.call("CommitCheckpoint", pb.CommitCheckpointRequest(directory=reply.directory), timeout=600)
    except BaseException:
        shutil.rmtree(target, ignore_errors=True)
        raise
    return reply


@contextlib.contextmanager
def _handed_existing(session, directory, objects: bool):
    """Hand the existing checkpoint ``directory``'s files (``objects``: its object files
    too); yields (its absolute path, the key)."""
    path = _absolute(directory)
    try:
        dir_fd = os.open(path, _DIR_FLAGS | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise errors.ObjectNotFound(f"no checkpoint at {path}") from None
    except PermissionError:
        raise errors.PermissionDenied(f"this process may not open checkpoint {path}") from None
    except OSError as exc:
        if exc.errno in (errno.ENOTDIR, errno.ELOOP):
            raise errors.InvalidArgument(f"checkpoint {path} is not a directory (symlinks are refused: name the "
                                         "directory itself)") from None
        raise
    names, fds = ["dir"], [dir_fd]
    try:
        for name in (MANIFEST, CLIENT_STATE):
            try:
                fds.append(_open_to_read(name, dir_fd, path))
                names.append(name)
            except FileNotFoundError:
                pass
        if objects:
            _open_objects(path, _files_named(dir_fd), lambda name, d: _open_to_read(name, d, path / OBJECTS),
                          names, fds)
    except BaseException:
        _close_all(fds)
        raise
    key = _hand(session, names, fds)
    yield path, key


def restore(session, directory) -> pb.RestoreReply:
    """Bring the checkpoint in ``directory`` into the session's namespace (all or nothing)."""
    with _handed_existing(session, directory, objects=True) as (path, key):
        return session.call("Restore", pb.RestoreRequest(directory=str(path), handed=key), timeout=3600)


def delete(session, directory) -> None:
    """Remove the checkpoint in ``directory``: the daemon forgets it (a snapshot's extents
    go back to the array), then the client removes the directory."""
    with _handed_existing(session, directory, objects=False) as (path, key):
        session.call("DeleteCheckpoint", pb.DeleteCheckpointRequest(directory=str(path), handed=key), timeout=600)
    shutil.rmtree(path)
