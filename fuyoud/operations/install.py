"""`fuyoud install-service`: put fuyoud under systemd.

Writes, under ``--root`` (default ``/``):

    etc/systemd/system/fuyoud.service   deploy/fuyoud.service with ExecStart= pointing at
                                        this fuyoud and ReadWritePaths= at the config's
                                        state, data and checkpoint directories (under
                                        ProtectSystem=strict it may write nowhere else)
    etc/sysusers.d/fuyoud.conf          the fuyoud user and group
    etc/tmpfiles.d/fuyoud.conf          its directories, the config's data and checkpoint
                                        directories included (ReadWritePaths= must name
                                        directories that exist when the unit starts)
    etc/fuyoud/fuyoud.toml              deploy/fuyoud.toml, only if there is none yet

and, when the root is ``/``, runs systemd-sysusers, systemd-tmpfiles --create and
systemctl daemon-reload. It never starts the service: `systemctl enable --now fuyoud`.
"""
from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

from fuyoud.config import ConfigError, load

UNIT_EXEC = "ExecStart=/usr/local/bin/fuyoud --config /etc/fuyoud/fuyoud.toml"
UNIT_PATHS = "ReadWritePaths=/var/lib/fuyoud"
UNIT_MOUNTS = "RequiresMountsFor=/var/lib/fuyoud"


def deploy_dir() -> Path:
    """deploy/ of a source checkout (editable installs), else the copy a wheel installs
    under <prefix>/share/fuyou/deploy."""
    candidates = [Path(__file__).resolve().parents[2] / "deploy",
                  Path(sysconfig.get_path("data")) / "share" / "fuyou" / "deploy"]
    for c in candidates:
        if (c / "fuyoud.service").is_file():
            return c
    raise FileNotFoundError(f"fuyoud's deploy files are missing (looked in {', '.join(map(str, candidates))})")


def fuyoud_executable() -> Path:
    found = shutil.which("fuyoud") or str(Path(sys.executable).parent / "fuyoud")
    path = Path(found).absolute()
    if not path.exists():
        raise FileNotFoundError(f"no fuyoud executable found (looked for {path}); install fuyou with pip first")
    return path


def render_unit(template: str, executable: Path, config: Path, writable: list[Path]) -> str:
    if UNIT_EXEC not in template or UNIT_PATHS not in template or UNIT_MOUNTS not in template:
        raise ValueError("deploy/fuyoud.service lost its ExecStart=, ReadWritePaths= or RequiresMountsFor= line")
    paths = " ".join(dict.fromkeys(str(p) for p in writable))
    # RequiresMountsFor=: an SSD that is not mounted must stop the start, not leave the daemon
    # filling (or tmpfiles.d creating) a directory of that name on the root file system.
    return (template.replace(UNIT_EXEC, f"ExecStart={executable} --config {config}")
            .replace(UNIT_PATHS, f"ReadWritePaths={paths}").replace(UNIT_MOUNTS, f"RequiresMountsFor={paths}"))


def render_tmpfiles(template: str, directories: list[Path]) -> str:
    """The shipped entries plus one ``d`` line for each configured directory they lack."""
    listed = {line.split()[1] for line in template.splitlines() if line.startswith("d ")}
    extra = [f"d {d} 0750 fuyoud fuyoud -" for d in directories if str(d) not in listed]
    if not extra:
        return template
    return template.rstrip("\n") + "\n# From /etc/fuyoud/fuyoud.toml (fuyoud install-service):\n" + "\n".join(extra) + "\n"


def install(root: Path, executable: Path, run_tools: bool, out=sys.stdout) -> list[Path]:
    src = deploy_dir()
    config_path = Path("/etc/fuyoud/fuyoud.toml")
    config_file = root / config_path.relative_to("/")
    written = []
    if not config_file.exists():
        config_file.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src / "fuyoud.toml", config_file)
        written.append(config_file)
    cfg = load(config_file)  # the unit must let the daemon write where this config says
    writable = list(dict.fromkeys([cfg.daemon.state_dir, *cfg.data_dirs, *cfg.checkpoint_dirs]))
    if str(executable).startswith(("/root/", "/home/")):
        print(f"warning: {executable} is under a home directory, which user fuyoud may not be able to "
              "read; install fuyou into a system location (e.g. python3 -m venv /opt/fuyou)", file=out)
    files = {
        "etc/systemd/system/fuyoud.service": render_unit((src / "fuyoud.service").read_text(), executable,
                                                        config_path, writable),
        "etc/sysusers.d/fuyoud.conf": (src / "sysusers.d" / "fuyoud.conf").read_text(),
        "etc/tmpfiles.d/fuyoud.conf": render_tmpfiles((src / "tmpfiles.d" / "fuyoud.conf").read_text(),
                                                      writable[1:]),
    }
    for rel, text in files.items():
        dest = root / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_text(text)
        written.append(dest)
    for path in written:
        print(f"wrote {path}", file=out)
    if run_tools:
        for cmd in (["systemd-sysusers", "/etc/sysusers.d/fuyoud.conf"],
                    ["systemd-tmpfiles", "--create", "/etc/tmpfiles.d/fuyoud.conf"],
                    ["systemctl", "daemon-reload"]):
            print("running " + " ".join(cmd), file=out)
            subprocess.run(cmd, check=True)
    print("next: edit /etc/fuyoud/fuyoud.toml (data_dirs on your SSDs; re-run install-service after changing "
          "them), then `systemctl enable --now fuyoud`; add training users with `usermod -aG fuyoud USER`", file=out)
    return written


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="fuyoud install-service", description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", default="/", help="install under this directory instead of / (packaging, tests)")
    parser.add_argument("--executable", help="the fuyoud to run (default: this one)")
    parser.add_argument("--no-reload", action="store_true",
                        help="do not run systemd-sysusers, systemd-tmpfiles and systemctl daemon-reload")
    args = parser.parse_args(argv)
    root = Path(args.root).absolute()
    try:
        executable = Path(args.executable).absolute() if args.executable else fuyoud_executable()
        install(root, executable, run_tools=root == Path("/") and not args.no_reload)
    except (ConfigError, FileNotFoundError, ValueError, subprocess.CalledProcessError, PermissionError) as exc:
        print(f"fuyoud install-service: {exc}", file=sys.stderr)
        return 1
    return 0
