"""`fuyoud [--config FILE]`: run the daemon in the foreground (systemd runs it so too).
`fuyoud install-service`: install the systemd unit and its companions (fuyoud/operations/install.py)."""
from __future__ import annotations

import argparse
import logging
import shutil
import sys
from pathlib import Path

from fuyoud import __version__
from fuyoud.config import ConfigError, load
from fuyoud.operations import logs


def exit_with_parent() -> None:
    """Stop (as on SIGTERM) when the process that started this one ends: a thread waits on
    a pidfd of the parent process. (PR_SET_PDEATHSIG, the fallback where pidfds are missing,
    fires when the parent *thread* ends: a daemon started from a worker thread stopped with
    that thread.)"""
    import os
    import select
    import signal
    import threading

    parent = os.getppid()
    try:
        fd = os.pidfd_open(parent)
    except (AttributeError, OSError):  # (Linux before 5.3)
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        fd = None
    if os.getppid() != parent:  # it died before we watched (we were handed to another parent)
        os.kill(os.getpid(), signal.SIGTERM)
    if fd is not None:
        def watch() -> None:
            select.select([fd], [], [])  # (readable once the process has exited)
            os.kill(os.getpid(), signal.SIGTERM)

        threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["install-service"]:
        from fuyoud.operations.install import main as install_main

        return install_main(argv[1:])
    parser = argparse.ArgumentParser(prog="fuyoud", description="The Fuyou daemon: SSD-backed memory for fine-tuning.",
                                     epilog="`fuyoud install-service --help`: install the systemd unit.")
    parser.add_argument("--config", metavar="FILE", help="TOML config (default: the embedded defaults)")
    parser.add_argument("--check-config", action="store_true", help="validate the config and exit")
    parser.add_argument("--log-level", choices=["debug", "info", "warning", "error"],
                        help="override [daemon.log_level]")
    parser.add_argument("--exit-with-parent", action="store_true",
                        help="stop (as on SIGTERM) when the process that started this one dies "
                             "(private daemons of fuyou_client.start_daemon)")
    parser.add_argument("--remove-when-stopped", metavar="DIR", action="append", default=[],
                        help="remove DIR, data files and all, once stopped, however the daemon was stopped "
                             "(private daemons' temporary directories; DIR must be the config's state_dir or "
                             "runtime_dir)")
    parser.add_argument("--log-format", choices=["auto", "logfmt", "journald"], help="override [daemon.log_format]")
    parser.add_argument("--version", action="version", version=f"fuyoud {__version__}")
    args = parser.parse_args(argv)
    if args.exit_with_parent:
        exit_with_parent()
    try:
        config = load(args.config)
    except ConfigError as exc:
        print(f"fuyoud: bad config: {exc}", file=sys.stderr)
        return 2
    ours = {config.daemon.state_dir.resolve(), config.daemon.runtime_dir.resolve()}
    removals = [Path(d).resolve() for d in args.remove_when_stopped]
    for d in removals:
        if d not in ours:
            print(f"fuyoud: --remove-when-stopped {d}: only the config's state_dir ({config.daemon.state_dir}) or "
                  f"runtime_dir ({config.daemon.runtime_dir}) may be removed", file=sys.stderr)
            return 2
    if args.check_config:
        print(f"fuyoud: {args.config or 'embedded defaults'}: OK")
        return 0
    logs.setup(args.log_level or config.daemon.log_level, args.log_format or config.daemon.log_format)
    dump_stacks_on_signal()
    return _serve(config, removals)


def dump_stacks_on_signal() -> None:
    """Every thread's Python stack to stderr (the journal, or a private daemon's log) on
    SIGUSR1 (`systemctl kill -s USR1 fuyoud`: what a daemon that does not answer or will not
    stop is waiting for) and on a fatal signal in native code."""
    import faulthandler
    import signal

    faulthandler.enable(file=sys.stderr, all_threads=True)
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)


def _serve(config, removals: list[Path]) -> int:
    from fuyoud.server import Daemon, StartFailed, StopFailed  # heavy imports after argument checks

    log = logging.getLogger("fuyoud")
    store = [config.daemon.state_dir.resolve(), *(Path(d).resolve() for d in config.data_dirs)]
    outlives = not any(p == r or r in p.parents for p in store for r in removals)
    try:
        daemon = Daemon(config, store_outlives=outlives)
    except Exception as exc:  # start-up failures: say what and stop (removing nothing: the directory
        log.error("cannot start: %s", exc)  # may be another daemon's, which refused us)
        return 1
    try:
        daemon.run_until_signalled()
    except StartFailed as exc:
        log.error("cannot start: %s", exc)
        return 1
    except StopFailed as exc:
        log.error("stopped, but not cleanly: %s", exc)
        return 1
    finally:  # (stopped: the store closed its data files, so their space is free at once)
        ours = {config.daemon.state_dir.resolve()}  # (its data lock was ours; the sockets' directory only
        if daemon.owns_runtime_dir:                   # where no other daemon served there)
            ours.add(config.daemon.runtime_dir.resolve())
        for d in removals:
            if d in ours:
                log.info("removing %s (--remove-when-stopped)", d)
                shutil.rmtree(d, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
