"""The rule that keeps a checkpoint from depending on storage that is going away.

A snapshot checkpoint copies nothing: it is index rows that share the live objects'
extents on the daemon's SSD array, so it lives exactly as long as that daemon's store.
A *temporary* daemon deletes its store when it stops: ``start_daemon()`` without a
``state_dir`` (the docs' examples, the tests, a notebook) starts fuyoud with
``--remove-when-stopped`` for the directories it made. A snapshot taken there looked
complete and was lost with the daemon ("lost its objects" at resume).

The rule: a checkpoint in mode "auto" is a snapshot only where the daemon's store
outlives the daemon; a temporary daemon's checkpoints are self-contained copies (files
in the directory, with their checksums) that any later daemon on the host restores.
What a daemon will delete is read from its own command line (``/proc/<pid>/cmdline``,
the pid its status reports): its ``--remove-when-stopped`` directories, against its
state directory (its index) and its data files. A daemon whose command line cannot be
read (another pid namespace) is taken as the host's, whose store persists. Asking for
``mode="snapshot"`` explicitly is still honoured.
"""
from __future__ import annotations

import tomllib
from pathlib import Path

REMOVE = "--remove-when-stopped"


def _argv(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    return [a.decode(errors="replace") for a in raw.split(b"\0") if a]


def _option(argv: list[str], name: str) -> list[str]:
    """Every value of ``name`` (``--name V`` or ``--name=V``)."""
    values = []
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            values.append(argv[i + 1])
        elif arg.startswith(name + "="):
            values.append(arg[len(name) + 1:])
    return values


def _within(path: Path, directory: Path) -> bool:
    return path == directory or directory in path.parents


def store_goes_with_daemon(status) -> bool:
    """Whether the daemon whose ``StatusReply`` this is deletes its store (its index or any
    data file) when it stops."""
    argv = _argv(status.pid)
    if argv is None or not any("fuyoud" in a for a in argv[:3]):
        return False
    removed = [Path(d).resolve() for d in _option(argv, REMOVE)]
    if not removed:
        return False
    store = [Path(d.path).resolve() for d in status.devices]
    configs = _option(argv, "--config")
    try:
        with open(configs[-1], "rb") as f:
            state_dir = tomllib.load(f).get("daemon", {}).get("state_dir")
    except (OSError, IndexError, tomllib.TOMLDecodeError):
        return True  # (it removes something of its own and we cannot tell what: the safe side)
    if state_dir:
        store.append(Path(state_dir).resolve())
    return any(_within(p, r) for p in store for r in removed)


def checkpoint_mode(session, mode: str) -> str:
    """The mode to ask the daemon for: "auto" becomes "copy" where the store goes with the
    daemon (see the module's docstring); anything else as given."""
    if mode != "auto":
        return mode
    return "copy" if store_goes_with_daemon(session.daemon_status) else mode

