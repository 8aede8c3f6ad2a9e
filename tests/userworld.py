"""The user's world for tests: the host's fuyoud as the shipped systemd unit runs it, and
training users who are other uids.

``host_daemon(root)`` lays out under ``root`` what deploy/fuyoud.service, sysusers.d and
tmpfiles.d make (a state directory 0750 with its data and checkpoints directories, a
runtime directory 0750, all the daemon's) and runs the real fuyoud with deploy/fuyoud.toml
(its paths moved under ``root``, no ``checkpoint_dirs``, the suite's SMALL limits) as its
own uid and gid, no supplementary groups, umask 0027, the unit's memlock and file limits,
NOTIFY_SOCKET and WATCHDOG_USEC as systemd sets them. ``run_as_user(script, ...)`` runs
training code as another uid, in a home directory of its own (0700), umask 0022.

How, without touching the host:

* Names. fuyoud admits a client by its uid's groups (getpwuid, getgrouplist), so the users
  need entries in /etc/passwd and /etc/group. Each process here runs in a mount namespace
  of its own where a passwd and a group file (the host's plus ours, ``<root>/etc``) are
  bind-mounted over /etc's; the host's files are not changed and the mounts go with the
  process.
* Code. Each process starts as root and imports what it will run (fuyoud's modules for the
  daemon; fuyou_client's, torch, transformers' lazily loaded classes the script names for a
  user, and every module those packages' sources import, function-level imports included)
  before it drops to the other uid: the interpreter, its standard library or the checkout
  may live where that uid cannot read (a pyenv under /root, a clone in a 0700 home), and
  nothing is read from them afterwards. With FUYOU_USER_WORLD_HIDE_CHECKOUT=1 each process
  also mounts an empty 0700 tmpfs over the checkout after its imports, as a checkout in a
  0700 directory would be: a module the pre-import missed then fails here too.
* Leftovers. The daemon and each user process are process groups of their own, killed
  when done; ``root`` is removed when ``host_daemon`` exits, whatever happened.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import grp
import json
import os
import pwd
import resource
import secrets
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path
from typing import Iterator, Sequence

import pytest

from conftest import SMALL, merge

CHECKOUT = Path(__file__).resolve().parents[1]
SHIPPED_CONFIG = CHECKOUT / "deploy" / "fuyoud.toml"
HIDE_ENV = "FUYOU_USER_WORLD_HIDE_CHECKOUT"


@dataclasses.dataclass(frozen=True)
class Identity:
    """A user of the test world: its name (in the namespace's passwd), uid, primary gid
    (its own group, as useradd makes) and supplementary groups."""
    name: str
    uid: int
    gid: int
    groups: tuple[int, ...] = ()


# Fixed ids unlikely to exist on a host (Debian's dynamically allocated range starts at 60000,
# systemd's dynamic users at 61184; these are above both and below nobody's 65534).
DAEMON = Identity("fuyoud", 64100, 64100)                 # sysusers.d: u fuyoud -:fuyoud
TRAINER = Identity("fytrainer", 64101, 64101, (64100,))   # `usermod -aG fuyoud fytrainer`
OUTSIDER = Identity("fyoutsider", 64102, 64102)           # a user of the host, not in group fuyoud
IDENTITIES = (DAEMON, TRAINER, OUTSIDER)

SYSTEMD_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
WATCHDOG_USEC = 30_000_000  # the unit's WatchdogSec=30
PASS_ENV = ("LANG", "LC_ALL", "TZ", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "PYTHONHASHSEED", "PYTHONPATH", "FUYOU_TEST")

# Modules imported lazily (on first use of an attribute) that a process needs after the drop.
DAEMON_IMPORTS = ("grpc._channel", "grpc._server", "grpc._interceptor", "grpc._simple_stubs",
                  "grpc_health.v1.health", "concurrent.futures.thread", "encodings.idna", "logging.handlers")
USER_IMPORTS = ("torch", "grpc._channel", "grpc._interceptor", "concurrent.futures.thread", "encodings.idna",
                "transformers.GPT2Config", "transformers.GPT2LMHeadModel", "transformers.LlamaConfig",
                "transformers.LlamaForCausalLM", "transformers.Trainer", "transformers.TrainingArguments",
                "transformers.AutoModelForCausalLM", "transformers.AutoTokenizer", "trl", "peft",
                # (found missing with FUYOU_USER_WORLD_HIDE_CHECKOUT=1: save_pretrained's, torch.save's)
                "numpy.ctypeslib", "safetensors.torch", "torch.utils.serialization", "torch.utils.data",
                # (torch.load of the Trainer's RNG state decodes with latin1)
                "encodings.latin_1", "encodings.ascii", "encodings.utf_16", "encodings.utf_32",
                "importlib.readers", "importlib.resources.readers")  # (datasets: package data)

# Runs as root, then as the user: tests/userworld_launcher.py.
LAUNCHER = Path(__file__).resolve().parent / "userworld_launcher.py"


def _hidden() -> list[str]:
    return [str(CHECKOUT)] if os.environ.get(HIDE_ENV) == "1" else []


def _launcher_argv(*, uid: int, gid: int, groups: Sequence[int], umask: int, cwd: Path, etc: Path | None,
                   walk: Sequence[str], names: Sequence[str], script: str | None = None, args: Sequence[str] = (),
                   daemon_argv: Sequence[str] | None = None, rlimits: Sequence[tuple[str, int]] = ()) -> list[str]:
    spec = {"uid": uid, "gid": gid, "groups": list(groups), "umask": umask, "cwd": str(cwd),
            "etc": str(etc) if etc else None, "hide": _hidden(), "walk": list(walk), "names": list(names),
            "script": script, "args": list(args), "daemon_argv": list(daemon_argv) if daemon_argv else None,
            "rlimits": [list(r) for r in rlimits], "parent": os.getpid()}
    return [sys.executable, str(LAUNCHER), json.dumps(spec)]


def write_names(etc: Path, root: Path, state_dir: Path) -> None:
    """``etc/passwd`` and ``etc/group``: the host's entries plus the test world's users
    (those whose name or id is one of ours left out), world-readable as /etc's are."""
    etc.mkdir(parents=True, exist_ok=True)
    etc.chmod(0o755)
    ours_names = {i.name for i in IDENTITIES}
    homes = {DAEMON.name: str(state_dir)}
    passwd = [f"{i.name}:x:{i.uid}:{i.gid}:fuyou test user:{homes.get(i.name, str(root / 'home' / i.name))}:"
              f"{'/usr/sbin/nologin' if i is DAEMON else '/bin/sh'}" for i in IDENTITIES]
    group = [f"{i.name}:x:{i.gid}:" + ",".join(u.name for u in IDENTITIES if i.gid in u.groups) for i in IDENTITIES]

    def host(path: str, ids: set[int]) -> list[str]:
        try:
            lines = Path(path).read_text().splitlines()
        except OSError:
            return []
        kept = []
        for line in lines:
            fields = line.split(":")
            if len(fields) >= 3 and (fields[0] in ours_names or fields[2] in {str(x) for x in ids}):
                continue
            kept.append(line)
        return kept

    for name, lines, ids in (("passwd", passwd, {i.uid for i in IDENTITIES}),
                             ("group", group, {i.gid for i in IDENTITIES})):
        path = etc / name
        path.write_text("\n".join(host(f"/etc/{name}", ids) + lines) + "\n")
        path.chmod(0o644)


class UserScriptFailed(AssertionError):
    """A user's script exited non-zero or ran out of time; the message has both outputs."""

    def __init__(self, what: str, returncode: int | None, stdout: str, stderr: str):
        super().__init__(f"{what}\n--- stdout ---\n{stdout[-6000:]}\n--- stderr ---\n{stderr[-12000:]}")
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def make_home(home: Path, uid: int, gid: int) -> Path:
    """``home`` as useradd -m makes it: 0700, the user's (its parent made 0755 if missing)."""
    home = Path(home)
    if not home.parent.exists():
        home.parent.mkdir(parents=True, mode=0o755)
        home.parent.chmod(0o755)
    if not home.exists():
        home.mkdir(mode=0o700)
        os.chown(home, uid, gid)
        home.chmod(0o700)
    return home


def run_as_user(script: str, *, uid: int, gids: Sequence[int], home: Path, env: dict[str, str] | None = None,
                timeout: float = 240.0, gid: int | None = None, etc: Path | None = None, args: Sequence[str] = (),
                imports: Sequence[str] = USER_IMPORTS, walk: Sequence[str] = ("fuyou_client", "fuyou_proto", "encodings"),
                check: bool = True) -> tuple[int, str, str]:
    """Run ``script`` (Python source) as ``uid`` (primary group ``gid``, default the uid's
    own; supplementary groups ``gids``), HOME=cwd=``home`` (made 0700 and the user's if
    missing), umask 0022, HF caches in ``home`` and offline. Before the drop, as root, it
    imports every module of the packages in ``walk`` (and what their sources import),
    ``imports`` (dotted names: ``transformers.Trainer`` resolves the lazy class) and what
    the script imports or names (``transformers.X``). ``etc``: a directory with passwd and
    group files to see instead of /etc's (``host_daemon``'s ``.etc``). ``args``: the
    script's sys.argv[1:]. Returns (returncode, stdout, stderr); raises UserScriptFailed
    with both outputs when the script fails (unless ``check=False``) or runs past
    ``timeout`` seconds (its process group is then killed)."""
    gid = uid if gid is None else gid
    home = make_home(Path(home), uid, gid)
    name = next((i.name for i in IDENTITIES if i.uid == uid), str(uid))
    child_env = {k: os.environ[k] for k in PASS_ENV if k in os.environ}
    child_env.update(PATH=SYSTEMD_PATH, HOME=str(home), USER=name, LOGNAME=name, SHELL="/bin/sh",
                     HF_HOME=str(home / ".cache" / "huggingface"), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                     PYTHONUNBUFFERED="1", PYTHONDONTWRITEBYTECODE="1")
    child_env.update(env or {})
    argv = _launcher_argv(uid=uid, gid=gid, groups=gids, umask=0o022, cwd=home, etc=etc, walk=walk, names=imports,
                          script=script, args=args)
    proc = subprocess.Popen(argv, cwd=home, env=child_env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc.pid)
        out, err = proc.communicate()
        raise UserScriptFailed(f"user script (uid {uid}) ran past {timeout:.0f} s", None, out, err) from None
    except BaseException:
        _kill_group(proc.pid)
        proc.communicate()
        raise
    finally:
        _kill_group(proc.pid)  # (anything it left running)
    if check and proc.returncode != 0:
        raise UserScriptFailed(f"user script (uid {uid}) exited with {proc.returncode}", proc.returncode, out, err)
    return proc.returncode, out, err


class HostDaemon:
    """The running host daemon of ``host_daemon``."""

    def __init__(self, root: Path, process: subprocess.Popen, config: dict, notify: socket.socket,
                 log_path: Path, log_reader):
        self.root = root
        self.process = process
        self.config = config
        self.uid, self.gid = DAEMON.uid, DAEMON.gid
        self.identity = DAEMON
        self.state_dir = Path(config["daemon"]["state_dir"])
        self.runtime_dir = Path(config["daemon"]["runtime_dir"])
        self.data_dirs = [Path(p) for p in config["storage"]["data_dirs"]]
        self.socket = str(self.runtime_dir / "fuyoud.sock")  # control: connect()/attach(socket=...)
        self.session_socket = str(self.runtime_dir / "session.sock")
        self.etc = root / "etc"
        self.config_path = self.etc / "fuyoud.toml"
        self._notify = notify
        self._notices: list[str] = []
        self._log_path = log_path
        self._log_reader = log_reader
        self._log: str | None = None

    @property
    def pid(self) -> int:
        return self.process.pid

    def home(self, user: Identity) -> Path:
        return self.root / "home" / user.name

    def log(self) -> str:
        if self._log is not None:
            return self._log
        self._log_reader.seek(0)
        return self._log_reader.read().decode(errors="replace")

    def notices(self) -> list[str]:
        """What the daemon has told its supervisor so far (sd_notify messages)."""
        if self._notify.fileno() != -1:
            self._notify.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                while True:
                    self._notices.append(self._notify.recv(4096).decode(errors="replace"))
        return list(self._notices)

    def run_as(self, user: Identity, script: str, **kw) -> tuple[int, str, str]:
        """``run_as_user`` as ``user`` in its home under this world, with this world's names."""
        return run_as_user(script, uid=user.uid, gid=user.gid, gids=user.groups, home=self.home(user), etc=self.etc,
                           **kw)

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM, wait (SIGKILL after ``timeout``); the exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        _kill_group(self.process.pid)
        if self._log is None:
            self._log = self.log()
            self._log_reader.close()
        self.notices()
        self._notify.close()
        return self.process.returncode


def shipped_config(root: Path, extra: dict | None = None) -> dict:
    """deploy/fuyoud.toml with /var/lib/fuyoud and /run/fuyoud moved under ``root``, no
    ``[daemon] checkpoint_dirs`` (the default: <state_dir>/checkpoints), metrics on a free
    loopback port, the suite's SMALL limits, then ``extra``."""
    with open(SHIPPED_CONFIG, "rb") as f:
        shipped = tomllib.load(f)
    moves = {"/var/lib/fuyoud": str(root / "state"), "/run/fuyoud": str(root / "run")}

    def moved(v):
        if isinstance(v, list):
            return [moved(x) for x in v]
        if isinstance(v, str):
            for old, new in moves.items():
                if v == old or v.startswith(old + "/"):
                    return new + v[len(old):]
        return v

    cfg = {section: {k: moved(v) for k, v in values.items()} for section, values in shipped.items()}
    cfg["daemon"].pop("checkpoint_dirs", None)
    cfg["metrics"]["listen"] = "127.0.0.1:0"
    return merge(merge(cfg, SMALL), extra or {})


@contextlib.contextmanager
def host_daemon(root: Path, config: dict | None = None, env: dict[str, str] | None = None,
                timeout: float = 90.0) -> Iterator[HostDaemon]:
    """The host's fuyoud under ``root`` (a short, new or empty directory: socket paths stay
    under 108 bytes), laid out and run as deploy/fuyoud.service does (see the module's doc),
    with ``config`` merged over the shipped file and SMALL, ``env`` added to systemd's
    environment. Yields a HostDaemon once it has said READY=1; stops it (if the test did not)
    and removes ``root`` afterwards."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    try:
        root.chmod(0o755)  # (/tmp's mkdtemp: 0700; /var/lib and /run are 0755)
        cfg = shipped_config(root, config)
        state, run = Path(cfg["daemon"]["state_dir"]), Path(cfg["daemon"]["runtime_dir"])
        write_names(root / "etc", root, state)
        (root / "home").mkdir(mode=0o755, exist_ok=True)
        # StateDirectory=fuyoud, RuntimeDirectory=fuyoud (0750) and tmpfiles.d's data and checkpoints.
        for d in (state, state / "data", state / "checkpoints", run, *map(Path, cfg["storage"]["data_dirs"])):
            d.mkdir(parents=True, exist_ok=True)
            os.chown(d, DAEMON.uid, DAEMON.gid)
            d.chmod(0o750)
        from fuyou_client.connection.launch import to_toml

        config_path = root / "etc" / "fuyoud.toml"  # (/etc/fuyoud/fuyoud.toml: root's, readable)
        config_path.write_text(to_toml(cfg))
        config_path.chmod(0o644)
        (root / "notify").mkdir(mode=0o755)
        notify_path = root / "notify" / "notify.sock"  # (/run/systemd/notify: srwxrwxrwx)
        notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        notify.bind(str(notify_path))
        notify_path.chmod(0o777)
        log_path = root / "journal.log"
        daemon_env = {k: os.environ[k] for k in PASS_ENV if k in os.environ}
        daemon_env.update(PATH=SYSTEMD_PATH, HOME=str(state), USER=DAEMON.name, LOGNAME=DAEMON.name,
                          SHELL="/usr/sbin/nologin", NOTIFY_SOCKET=str(notify_path),
                          WATCHDOG_USEC=str(WATCHDOG_USEC), INVOCATION_ID=secrets.token_hex(16))
        daemon_env.update(env or {})
        argv = _launcher_argv(uid=DAEMON.uid, gid=DAEMON.gid, groups=[], umask=0o027, cwd=Path("/"),
                              etc=root / "etc", walk=("fuyoud", "fuyou_proto"), names=DAEMON_IMPORTS,
                              daemon_argv=["--config", str(config_path), "--exit-with-parent"],
                              rlimits=[("RLIMIT_MEMLOCK", resource.RLIM_INFINITY), ("RLIMIT_NOFILE", 65536)])
        with open(os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600), "ab") as log:
            log_reader = open(log_path, "rb")
            proc = subprocess.Popen(argv, cwd="/", env=daemon_env, stdin=subprocess.DEVNULL, stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        daemon = HostDaemon(root, proc, cfg, notify, log_path, log_reader)
        try:
            deadline = time.monotonic() + timeout
            notify.settimeout(0.2)
            while True:
                try:
                    message = notify.recv(4096).decode(errors="replace")
                    daemon._notices.append(message)
                    if "READY=1" in message.split("\n"):
                        break
                except socket.timeout:
                    pass
                if proc.poll() is not None or time.monotonic() > deadline:
                    code = daemon.stop(5)
                    raise RuntimeError(f"fuyoud did not become ready (exit code {code}); log:\n{daemon.log()[-4000:]}")
            yield daemon
        finally:
            daemon.stop()
    finally:
        shutil.rmtree(root, ignore_errors=True)


def proc_status(pid: int) -> dict[str, str]:
    """/proc/<pid>/status as {field: value}."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        out[key] = value.strip()
    return out


def owners(path: Path) -> dict[str, tuple[int, int, int]]:
    """Every path under ``path`` (itself too): (uid, gid, mode), relative names."""
    out = {}
    for p in [path, *sorted(path.rglob("*"))]:
        st = p.lstat()
        out[str(p.relative_to(path))] = (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode))
    return out


@functools.cache
def skip_reason() -> str | None:
    """Why the user's world cannot be made here, or None: it needs root, a mount namespace
    (for the users' names) and setuid to another uid, and a Python that still runs after
    the drop; the last three are tried in a subprocess."""
    if sys.platform != "linux":
        return "the user's world needs Linux"
    if os.geteuid() != 0:
        return "the user's world needs root (to run the daemon and clients as other uids)"
    for ident in IDENTITIES:
        with contextlib.suppress(KeyError):
            return f"uid {ident.uid} is {pwd.getpwuid(ident.uid).pw_name!r} on this host: the test users need free ids"
        with contextlib.suppress(KeyError):
            return f"gid {ident.gid} is {grp.getgrgid(ident.gid).gr_name!r} on this host: the test users need free ids"
    root = Path(tempfile.mkdtemp(prefix="fyuw-", dir="/tmp"))
    try:
        root.chmod(0o755)
        write_names(root / "etc", root, root / "state")
        probe = ("import grp, os, pwd, json\n"
                 "print(json.dumps([os.getuid(), os.getgid(), sorted(os.getgroups()),\n"
                 f"                  pwd.getpwuid(os.getuid()).pw_name, grp.getgrgid({DAEMON.gid}).gr_mem, os.getcwd()]))\n")
        try:
            _, out, _ = run_as_user(probe, uid=TRAINER.uid, gids=TRAINER.groups, home=root / "home" / TRAINER.name,
                                    etc=root / "etc", imports=("json",), walk=(), timeout=60)
        except UserScriptFailed as exc:
            return f"cannot run Python as uid {TRAINER.uid} in a mount namespace of its own: {exc}"
        got = json.loads(out.strip().splitlines()[-1])
        want = [TRAINER.uid, TRAINER.gid, sorted(TRAINER.groups), TRAINER.name, [TRAINER.name],
                str(root / "home" / TRAINER.name)]
        if got != want:
            return f"a process dropped to uid {TRAINER.uid} is not who it should be: {got} (expected {want})"
        return None
    finally:
        shutil.rmtree(root, ignore_errors=True)


needs_user_world = pytest.mark.skipif(skip_reason() is not None, reason=f"no user's world here: {skip_reason()}")


def _unreadable_to_others() -> str | None:
    """Where this checkout's Python packages cannot be read by another uid (a clone under a
    0700 home, or the checkout hidden), the first such directory, else None."""
    if os.environ.get(HIDE_ENV) == "1":
        return f"{CHECKOUT} ({HIDE_ENV}=1)"
    import transformers

    for path in (Path(transformers.__file__).resolve().parent, CHECKOUT):
        for d in [path, *path.parents]:
            mode = d.stat().st_mode
            if not mode & stat.S_IXOTH or (d == path and not mode & stat.S_IROTH):
                return str(d)
    return None


# Trainers' runs (transformers, TRL, PEFT): besides their modules, imported before the drop,
# they read package data and metadata as they go (TRL's model card template, accelerate's
# is_peft_available): the packages must be readable by the training user, as a user's own
# environment is. Where this checkout's are not, these tests skip saying so.
needs_readable_packages = pytest.mark.skipif(
    _unreadable_to_others() is not None,
    reason=f"the training user cannot read this checkout's packages ({_unreadable_to_others()} is closed to other "
           "uids): Trainer, TRL and PEFT read package data and metadata as they run")
