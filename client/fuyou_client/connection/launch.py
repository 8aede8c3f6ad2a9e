"""A private fuyoud for demos, notebooks and tests: started as a child process with a
generated config, ready when it says READY=1 (the systemd notify protocol), stopped
with SIGTERM.

    with fuyou_client.start_daemon(state_dir="/tmp/fy") as daemon:
        with fuyou_client.connect(daemon.socket) as session:
            ...
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import weakref
from pathlib import Path
from typing import Any

from fuyou_client.errors import DaemonUnavailable


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return str(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    s = str(v).replace("\\", "\\\\").replace('"', '\\"')
    return f'"{s}"'


def to_toml(config: dict[str, dict[str, Any]]) -> str:
    return "".join(f"[{section}]\n" + "".join(f"{k} = {_toml_value(v)}\n" for k, v in values.items()) + "\n"
                   for section, values in config.items())


class DaemonProcess:
    def __init__(self, process: subprocess.Popen, state_dir: Path, socket: str, config_path: Path, log_path: Path,
                 temporary: list[Path] | None = None, log_reader=None):
        self.process = process
        self.state_dir = state_dir
        self.socket = socket
        self.config_path = config_path
        self.log_path = log_path
        self.temporary = list(temporary or [])  # directories start_daemon made: the daemon removes them
        self._log_reader = log_reader  # (open: the log stays readable when the daemon removed its directory)
        self._log: str | None = None  # the log, kept once the daemon stopped
        # A daemon killed (the OOM killer) cannot remove its temporary directory: this process
        # does, when it ends or drops this object.
        weakref.finalize(self, _remove_if_exited, process, self.temporary)

    @property
    def pid(self) -> int:
        return self.process.pid

    def log(self) -> str:
        if self._log is not None:
            return self._log
        if self._log_reader is not None:
            return _read_all(self._log_reader)
        return self.log_path.read_text(errors="replace")

    def status(self, timeout: float = 10.0):
        """The daemon's Status reply (no session needed): version, devices, metrics URL..."""
        import grpc

        from fuyou_proto import pb, rpc

        with grpc.insecure_channel(f"unix:{self.socket}") as channel:
            return rpc.FuyouAdminStub(channel).Status(pb.StatusRequest(), timeout=timeout)

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM, wait; returns the exit code (SIGKILL after ``timeout``). A temporary
        state directory (start_daemon without one) goes with the daemon, its data files
        too (the daemon removes it as it stops; this makes sure after a SIGKILL); ``log()``
        still gives the log."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self._log_reader is not None:
            self._log = _read_all(self._log_reader)
            self._log_reader.close()
            self._log_reader = None
        if self.temporary:
            if self._log is None:
                try:
                    self._log = self.log_path.read_text(errors="replace")
                except OSError:
                    self._log = ""
            for path in self.temporary:
                shutil.rmtree(path, ignore_errors=True)
            self.temporary.clear()  # (the list the finalizer holds too)
        return self.process.returncode

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()

    def __enter__(self) -> "DaemonProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _remove_if_exited(process: subprocess.Popen, temporary: list[Path]) -> None:
    if process.poll() is not None:  # (a live daemon removes them itself as it stops)
        for path in temporary:
            shutil.rmtree(path, ignore_errors=True)


def _read_all(f) -> str:
    f.seek(0)
    return f.read().decode(errors="replace")


def _write_private(path: Path, data: bytes) -> None:
    """A file only this user may read, whatever the umask."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with open(fd, "wb") as f:
        os.fchmod(fd, 0o600)
        f.write(data)


def start_daemon(state_dir: str | os.PathLike | None = None, config: dict[str, dict[str, Any]] | None = None,
                 timeout: float = 60.0, env: dict[str, str] | None = None) -> DaemonProcess:
    """Start fuyoud in the background with the embedded defaults, its state (data files,
    index, sockets) under ``state_dir`` (a new temporary directory by default), plus any
    ``config`` overrides ({"section": {"key": value}}). Returns once it serves. The daemon
    stops by itself if this process dies without stopping it. A temporary state directory
    is removed, data files and all, when the daemon stops (``stop()``, the end of a
    ``with`` block, or this process's end, an exception or a kill included: the daemon
    removes it itself); one you name is kept."""
    temporary = []
    state = Path(state_dir) if state_dir else Path(tempfile.mkdtemp(prefix="fuyoud-"))
    if not state_dir:
        temporary.append(state)
    state.mkdir(parents=True, exist_ok=True, mode=0o700)
    runtime = state / "run"
    if len(str(runtime / "session.sock")) > 100:  # unix socket paths are limited to 108 bytes
        runtime = Path(tempfile.mkdtemp(prefix="fuyoud-run-"))
        temporary.append(runtime)
    merged: dict[str, dict[str, Any]] = {
        "daemon": {"state_dir": str(state), "runtime_dir": str(runtime)},
        "metrics": {"listen": "127.0.0.1:0"},
    }
    for section, values in (config or {}).items():
        merged.setdefault(section, {}).update(values)
    config_path = state / "fuyoud.toml"
    _write_private(config_path, to_toml(merged).encode())
    log_path = state / "fuyoud.log"
    sock = merged["daemon"].get("control_socket") or str(Path(merged["daemon"]["runtime_dir"]) / "fuyoud.sock")

    notify_dir = Path(tempfile.mkdtemp(prefix="fuyoud-notify-"))  # (a socket path: short, whatever the state's)
    notify_path = notify_dir / "notify.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as notify:
        notify.bind(str(notify_path))
        child_env = dict(os.environ if env is None else env, NOTIFY_SOCKET=str(notify_path))
        with open(os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600), "ab") as log:
            log_reader = open(log_path, "rb")
            removals = [a for path in temporary for a in ("--remove-when-stopped", str(path))]
            proc = subprocess.Popen([sys.executable, "-m", "fuyoud", "--config", str(config_path), "--exit-with-parent",
                                     *removals], stdout=log, stderr=subprocess.STDOUT, env=child_env,
                                    start_new_session=True)
        deadline = time.monotonic() + timeout
        while True:
            notify.settimeout(0.2)
            try:
                if b"READY=1" in notify.recv(4096):
                    break
            except socket.timeout:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                if proc.poll() is None:
                    proc.kill()
                proc.wait()
                tail = _read_all(log_reader)[-2000:]
                log_reader.close()
                shutil.rmtree(notify_dir, ignore_errors=True)
                for path in temporary:
                    shutil.rmtree(path, ignore_errors=True)
                raise DaemonUnavailable(f"fuyoud did not become ready (exit code {proc.returncode}); log:\n{tail}")
    shutil.rmtree(notify_dir, ignore_errors=True)
    return DaemonProcess(proc, state, sock, config_path, log_path, temporary, log_reader)
