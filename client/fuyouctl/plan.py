"""``fuyouctl plan``: the planner (``fuyou_client.sizing``) for this host as fuyoud is
configured here. The one part of fuyouctl that uses the client's package; it imports it
(and torch) only when the command runs, so the daemon's commands need not wait for it."""
from __future__ import annotations

import argparse

from fuyoud.config import load


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The plan command's arguments, as the planner defines them."""
    from fuyou_client.sizing.cli import add_arguments as planner_arguments
    planner_arguments(parser)


def run(args) -> int:
    """The planner, for this host as fuyoud is configured here (its data directories,
    measured; its pinned and buffer budgets) unless the host is described."""
    from fuyou_client.sizing import cli

    describes = args.ram is not None or args.ssd is not None
    cfg = load(args.config)
    defaults = {} if describes else {"pinned_budget": cfg.session_budget, "buffer_budget": cfg.optimizer.buffer_budget}
    return cli.run(args, data_dirs=cfg.data_dirs, defaults=defaults)
