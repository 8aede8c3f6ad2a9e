"""fuyoud's configuration: a TOML file over embedded defaults.

Every option has a default that works with no file at all: data under a local state
directory, sockets under a runtime directory, metrics on 127.0.0.1. Unknown keys and
bad values are refused with a message naming the key, so a typo never silently falls
back to a default.
"""
from __future__ import annotations

import dataclasses
import grp
import os
import pwd
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fuyou_proto.contract import PAGE
from fuyoud.units import format_size, parse_size



class ConfigError(ValueError):
    """A config file or value that fuyoud refuses; the message names the key."""


AUTO_SHARE = 0.75  # what a [limits] "auto" gives one user of a shared host (fuyoud/sessions/user_limits.py)
_PERCENT = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*%\s*$")


@dataclass(frozen=True)
class Share:
    """A [limits] size: ``nbytes``, or ``fraction`` of a whole, or "auto" (both None)."""
    nbytes: int | None = None
    fraction: float | None = None

    @classmethod
    def parse(cls, value: object) -> "Share":
        """"auto", "NN%" (0-100, not 0) or a size ("48GiB", a number of bytes, not 0);
        ValueError otherwise."""
        if value == "auto":
            return cls()
        if isinstance(value, str) and (m := _PERCENT.match(value)):
            percent = float(m[1])
            if not 0 < percent <= 100:
                raise ValueError(f"{value!r}: a percentage above 0 and at most 100")
            return cls(fraction=percent / 100)
        nbytes = parse_size(value)
        if nbytes <= 0:
            raise ValueError(f"{value!r}: a positive size, a percentage or \"auto\"")
        return cls(nbytes=nbytes)

    def of(self, whole: int, shared: bool) -> int:
        """The bytes this allows of ``whole``; 0: no limit."""
        if self.nbytes is not None:
            return self.nbytes
        fraction = self.fraction if self.fraction is not None else (AUTO_SHARE if shared else None)
        return 0 if fraction is None or fraction >= 1 else int(whole * fraction)

    def setting(self, key: str, shared: bool) -> str:
        """How a refusal names this setting."""
        if self.nbytes is not None:
            return f"[limits] {key} = {format_size(self.nbytes)}"
        if self.fraction is not None:
            return f"[limits] {key} = {self.fraction * 100:g}%"
        return f"[limits] {key} = \"auto\": {AUTO_SHARE * 100:g}% on this shared host"


def _default_state_dir() -> Path:
    """``$XDG_STATE_HOME/fuyoud``, else ``~/.local/state/fuyoud``."""
    base = os.environ.get("XDG_STATE_HOME") or os.path.expanduser("~/.local/state")
    return Path(base) / "fuyoud"


def _default_runtime_dir() -> Path:
    """``$XDG_RUNTIME_DIR/fuyoud-<uid>``, else ``/tmp/fuyoud-<uid>``."""
    base = os.environ.get("XDG_RUNTIME_DIR") or "/tmp"
    return Path(base) / f"fuyoud-{os.getuid()}"


def _default_pinned_budget() -> int:
    """Half of physical memory. It is a ceiling, not a reservation: segments are made
    when a session asks, and each client plans its buffers to need only what keeps its
    run at speed (a 7B-class model's blocks about 5 GiB), so a dedicated training server
    serves models whose blocks are GBs (a 70B-class block is 1.7 GB in bf16) without a
    config, and the other half stays for the training process, the page cache and
    whatever else runs. A shared workstation sets it lower (and session_budget)."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return total // 2 // PAGE * PAGE


@dataclass
class DaemonSection:
    """[daemon]: where the daemon keeps its state and sockets, who may connect, its logs.

      ``state_dir``: the persistent index and, unless ``[storage] data_dirs`` says
      otherwise, the data files.
      ``runtime_dir``: the directory of the sockets.
      ``control_socket``: the gRPC control socket; empty: ``<runtime_dir>/fuyoud.sock``.
      ``session_socket``: the socket clients open sessions on; empty:
      ``<runtime_dir>/session.sock``.
      ``socket_mode``: the file mode of both sockets (``0o660``: the owner and its
      group); a mode that gives others any access is refused.
      ``socket_group``: the group owning both sockets (its members may become clients);
      empty: the daemon's group.
      ``tcp_listen``: "host:port" to also serve gRPC over TCP (sessions still need the
      unix socket); empty: no TCP.
      ``grpc_workers``: threads serving gRPC requests.
      ``log_level``: "debug", "info", "warning" or "error".
      ``log_format``: one line per event, key=value: "logfmt" (with timestamps),
      "journald" (a syslog priority prefix, no timestamp), or "auto": the journald
      format when stderr is the journal (under systemd), else logfmt.
      ``checkpoint_dirs``: where clients of other uids may have the daemon write and read
      checkpoints by path (it acts with its own permissions there); empty:
      ``<state_dir>/checkpoints``. Clients of the daemon's own uid, root and operators
      may name any directory. fuyou_client never asks by path: it creates a checkpoint's
      files itself, wherever its user can write, and hands the daemon their descriptors.
      ``allow_uids``: who may open a session beyond the daemon's own uid, root and the
      members of ``allow_group``: these uids. Everyone else is refused even if the socket
      mode lets them in.
      ``allow_group``: the group whose members may open a session; empty: the sockets'
      group (``socket_group``, else the daemon's own group).
    """
    state_dir: Path = field(default_factory=_default_state_dir)
    runtime_dir: Path = field(default_factory=_default_runtime_dir)
    control_socket: str = ""
    session_socket: str = ""
    socket_mode: int = 0o660
    socket_group: str = ""
    tcp_listen: str = ""
    grpc_workers: int = 16
    log_level: str = "info"
    log_format: str = "auto"
    checkpoint_dirs: list[Path] = field(default_factory=list)
    allow_uids: list[int] = field(default_factory=list)
    allow_group: str = ""

    @property
    def socket_gid(self) -> int:
        """The socket group's id, -1 for "leave as created"."""
        if not self.socket_group:
            return -1
        return grp.getgrnam(self.socket_group).gr_gid

    def admits(self, uid: int) -> bool:
        """May a process of ``uid`` open a session?"""
        if uid in (0, os.getuid()) or uid in self.allow_uids:
            return True
        name = self.allow_group or self.socket_group
        try:  # (the daemon's own group by number: it may have no entry, as under DynamicUser or in a container)
            gid = grp.getgrnam(name).gr_gid if name else os.getgid()
            user = pwd.getpwuid(uid)
        except KeyError:  # (a group or user with no entry: nobody is a member by name)
            return False
        return gid == user.pw_gid or gid in os.getgrouplist(user.pw_name, user.pw_gid)

    @property
    def control_path(self) -> Path:
        return Path(self.control_socket) if self.control_socket else self.runtime_dir / "fuyoud.sock"

    @property
    def session_path(self) -> Path:
        return Path(self.session_socket) if self.session_socket else self.runtime_dir / "session.sock"


@dataclass
class MemorySection:
    """[memory]: the pool of pinned shared memory that clients' buffers come from.

      ``pinned_budget``: bytes of pinned shared memory for all sessions together. A
      ceiling, not a reservation: segments are made as sessions ask.
      ``session_budget``: bytes one session (one training process) may hold; 0: the whole
      ``pinned_budget``. A client whose smallest memory plan does not fit is refused at
      attach.
      ``segment_size``: shared memory is handed out in memfd segments of this many bytes
      (a multiple of 2 MiB); a larger buffer gets a segment of its own.
      ``lock``: mlock the shared segments: "yes", "no", or "auto" (try, and carry on
      unlocked if refused).
      ``huge_pages``: the pages behind shared segments: "hugetlb", "thp" (transparent
      huge pages), "off" (4 KiB pages), or "auto": hugetlb if reserved, else transparent
      huge pages, else 4 KiB (fuyoud/memory/hugepages.py).
      ``staging_size``: bytes of daemon-private bounce buffers for the unaligned heads and
      tails of transfers.
    """
    pinned_budget: int = field(default_factory=_default_pinned_budget)
    session_budget: int = 0
    segment_size: int = 64 << 20
    lock: str = "auto"
    huge_pages: str = "auto"
    staging_size: int = 16 << 20


@dataclass
class StorageSection:
    """[storage]: the SSD array: one data file per SSD, objects striped over them.

      ``data_dirs``: one directory per SSD, each holding one data file; empty:
      ``<state_dir>/data``.
      ``capacity_per_device``: bytes of each device's data file, preallocated; 0 ("auto"):
      the file grows on demand while its file system keeps ``keep_free`` bytes free
      (storage/device.py).
      ``keep_free``: with "auto" capacity, the bytes the data files leave free on their
      file system for everything else; 0 ("auto"): 5% of it, at least 1 GiB and at most
      16 GiB.
      ``stripe_size``: objects larger than this many bytes are striped over the devices
      in units of it.
      ``direct_io``: use O_DIRECT (bypass the page cache); buffered I/O where the file
      system refuses it.
      ``namespace_quota``: bytes one namespace (one training run) may hold on the array;
      0: no limit.
    """
    data_dirs: list[Path] = field(default_factory=list)
    capacity_per_device: int = 0
    keep_free: int = 0
    stripe_size: int = 4 << 20
    direct_io: bool = True
    namespace_quota: int = 0


@dataclass
class IOSection:
    """[io]: the I/O engine that moves bytes between shared memory and the SSD array.

      ``engine``: "io_uring", "threadpool", or "auto" (io_uring where it works, else the
      thread pool).
      ``queue_depth``: requests in flight per io_uring batch.
      ``chunk_size``: transfers are cut into requests of at most this many bytes.
      ``threads``: worker threads of the threadpool engine.
    """
    engine: str = "auto"
    queue_depth: int = 32
    chunk_size: int = 1 << 20
    threads: int = 16


@dataclass
class OptimizerSection:
    """[optimizer]: daemon-private memory holding optimizer state while it is read ahead,
    stepped and written back: ``buffers`` buffers within ``buffer_budget`` bytes. A group
    whose state plus weights (AdamW fp32: 16 bytes per parameter) fits one is stepped whole
    and read ahead; a larger one in chunks (fuyoud/optimizer/chunks.py).

      ``buffer_budget``: bytes of all the buffers together.
      ``buffers``: how many buffers. Six cover a client's backward read-ahead (2 groups
      deep), steps in flight and a spare.
      ``state_cache``: buffers beyond three free ones keep the state of the group just
      stepped until its next step, which then reads nothing from the SSD.
      ``session_buffers``: the most of those buffers one session (a rank of a
      data-parallel job) holds at once: its steps, read-aheads and cached states
      together; a session at its budget waits even with buffers free. 0: no limit beyond
      the pool. Steps of all sessions are served first come, first served either way.
    """
    buffer_budget: int = 1 << 30
    buffers: int = 6
    state_cache: bool = True
    session_buffers: int = 0


@dataclass
class LimitsSection:
    """[limits]: what one user (uid) may take of the daemon, over all its sessions and
    jobs together (fuyoud/sessions/user_limits.py). A shared host is one where more than
    one user besides root and the daemon's own may open a session (``allow_uids``, the
    allowed group's members).

      ``user_sessions``: sessions one uid holds at once.
      ``user_pinned``: pinned memory one uid's sessions hold together (reservations or
      segments): a size, a percentage of ``[memory] pinned_budget`` ("50%"), or "auto":
      75% of it on a shared host, no limit on a host with one training user.
      ``user_ssd``: bytes one uid's namespaces hold on the SSD array: a size, a
      percentage of the array's capacity (its data files and what "auto" files may
      still grow by), or "auto" (as ``user_pinned``).
    """
    user_sessions: int = 64
    user_pinned: str = "auto"
    user_ssd: str = "auto"


@dataclass
class MetricsSection:
    """[metrics]: the Prometheus endpoint.

      ``enabled``: serve the metrics over HTTP.
      ``listen``: "host:port" of the endpoint (port 0 picks a free port).
    """
    enabled: bool = True
    listen: str = "127.0.0.1:9464"


@dataclass
class Config:
    daemon: DaemonSection = field(default_factory=DaemonSection)
    memory: MemorySection = field(default_factory=MemorySection)
    storage: StorageSection = field(default_factory=StorageSection)
    io: IOSection = field(default_factory=IOSection)
    optimizer: OptimizerSection = field(default_factory=OptimizerSection)
    limits: LimitsSection = field(default_factory=LimitsSection)
    metrics: MetricsSection = field(default_factory=MetricsSection)

    @property
    def data_dirs(self) -> list[Path]:
        return self.storage.data_dirs or [self.daemon.state_dir / "data"]

    @property
    def checkpoint_dirs(self) -> list[Path]:
        return self.daemon.checkpoint_dirs or [self.daemon.state_dir / "checkpoints"]

    @property
    def session_budget(self) -> int:
        return self.memory.session_budget or self.memory.pinned_budget


_SIZE_KEYS = {
    "memory.pinned_budget", "memory.session_budget", "memory.segment_size", "memory.staging_size",
    "storage.capacity_per_device", "storage.stripe_size", "io.chunk_size", "optimizer.buffer_budget",
    "storage.namespace_quota", "storage.keep_free",
}
_AUTO_ZERO = {"storage.capacity_per_device", "storage.keep_free"}  # "auto" is stored as 0
_CHOICES = {
    "memory.lock": {"auto", "yes", "no"},
    "memory.huge_pages": {"auto", "hugetlb", "thp", "off"},
    "io.engine": {"auto", "io_uring", "threadpool"},
    "daemon.log_level": {"debug", "info", "warning", "error"},
    "daemon.log_format": {"auto", "logfmt", "journald"},
}
_SHARES = {"limits.user_pinned", "limits.user_ssd"}  # a size, a percentage or "auto" (user_limits.Share)
_POSITIVE = {"limits.user_sessions", "daemon.grpc_workers", "io.queue_depth", "io.threads", "optimizer.buffers"}
_PAGE_MULTIPLES = {
    "memory.segment_size", "memory.staging_size", "storage.stripe_size", "io.chunk_size",
    "storage.capacity_per_device",
}


def _convert(key: str, annotation: Any, value: Any) -> Any:
    if key in _SHARES:
        try:
            Share.parse(value)
        except ValueError as exc:
            raise ConfigError(f"[{key}]: {exc}; want a size (\"48GiB\"), a percentage (\"50%\") or \"auto\"") from None
        return str(value)
    if key in _AUTO_ZERO and value == "auto":
        return 0
    if key in _SIZE_KEYS:
        try:
            return parse_size(value)
        except ValueError as exc:
            raise ConfigError(f"[{key}]: {exc}") from None
    expected = {"int": int, "str": str, "bool": bool, "Path": (str,), "list[Path]": list, "list[int]": list}[annotation]
    if not isinstance(value, expected) or (annotation == "int" and isinstance(value, bool)):
        raise ConfigError(f"[{key}]: expected {annotation}, got {type(value).__name__} {value!r}")
    if annotation == "Path":
        return Path(os.path.expanduser(value))
    if annotation == "list[int]":
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value):
            raise ConfigError(f"[{key}]: expected a list of uids (non-negative integers), got {value!r}")
        return list(value)
    if annotation == "list[Path]":
        if not all(isinstance(v, str) and v for v in value):
            raise ConfigError(f"[{key}]: expected a list of directory paths, got {value!r}")
        return [Path(os.path.expanduser(v)) for v in value]
    return value


def _validate(cfg: Config) -> None:
    for key, choices in _CHOICES.items():
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        if value not in choices:
            raise ConfigError(f"[{key}]: {value!r} is not one of {sorted(choices)}")
    for key in _POSITIVE | _PAGE_MULTIPLES:
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        if value == 0 and key in _AUTO_ZERO:
            continue
        if value <= 0:
            raise ConfigError(f"[{key}]: must be positive, got {value}")
        if key in _PAGE_MULTIPLES and value % PAGE:
            raise ConfigError(f"[{key}]: must be a multiple of {PAGE} bytes, got {value}")
    if cfg.memory.segment_size % (2 << 20):
        raise ConfigError(f"[memory.segment_size]: must be a multiple of 2 MiB, got {cfg.memory.segment_size}")
    if cfg.memory.pinned_budget < cfg.memory.segment_size:
        raise ConfigError("[memory.pinned_budget] is smaller than [memory.segment_size]")
    if cfg.memory.session_budget > cfg.memory.pinned_budget:
        raise ConfigError("[memory.session_budget] exceeds [memory.pinned_budget]")
    if cfg.optimizer.buffer_budget < cfg.optimizer.buffers * (2 << 20):
        raise ConfigError("[optimizer.buffer_budget] must give each of [optimizer.buffers] at least 2 MiB")
    if not 0 <= cfg.optimizer.session_buffers <= cfg.optimizer.buffers:
        raise ConfigError(f"[optimizer.session_buffers]: {cfg.optimizer.session_buffers} is not a number of buffers "
                          f"from 1 to [optimizer.buffers] ({cfg.optimizer.buffers}), or 0 for no limit per session")
    if cfg.daemon.socket_mode & ~0o777 or cfg.daemon.socket_mode & 0o007:
        raise ConfigError(f"[daemon.socket_mode]: {cfg.daemon.socket_mode:#o} must be a file mode giving others "
                          "no access (e.g. 0o660)")
    for key in ("socket_group", "allow_group"):
        name = getattr(cfg.daemon, key)
        if name:
            try:
                grp.getgrnam(name)
            except KeyError:
                raise ConfigError(f"[daemon.{key}]: no group {name!r} on this host") from None
    if len(set(cfg.data_dirs)) != len(cfg.data_dirs):
        raise ConfigError("[storage.data_dirs] lists a directory twice")


def from_dict(data: dict[str, Any]) -> Config:
    """Build a validated Config from parsed TOML (missing keys take their defaults)."""
    cfg = Config()
    for section_name, section_value in data.items():
        if section_name not in {f.name for f in dataclasses.fields(Config)}:
            raise ConfigError(f"unknown section [{section_name}]")
        if not isinstance(section_value, dict):
            raise ConfigError(f"[{section_name}] must be a table")
        section = getattr(cfg, section_name)
        fields = {f.name: f for f in dataclasses.fields(section)}
        for key, value in section_value.items():
            if key not in fields:
                raise ConfigError(
                    f"unknown key [{section_name}.{key}] (known: {', '.join(sorted(fields))})")
            setattr(section, key, _convert(f"{section_name}.{key}", fields[key].type, value))
    _validate(cfg)
    return cfg


def load(path: str | os.PathLike | None) -> Config:
    """Read a TOML file (``None``: the embedded defaults only)."""
    if path is None:
        return from_dict({})
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    try:
        return from_dict(data)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None
