"""``fuyouctl plan``: the planner (``fuyou_client.sizing``) for this host as fuyoud is
configured here. The one part of fuyouctl that uses the client's package; it imports it
(and torch) only when the command runs, so the daemon's commands need not wait for it."""
from __future__ import annotations

import argparse

from fuyoud.config import load
from fuyoud.sessions.user_limits import UserLimits


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The plan command's arguments, as the planner defines them."""
    from fuyou_client.sizing.cli import add_arguments as planner_arguments
    planner_arguments(parser)


def run(args) -> int:
    """The planner, for this host as fuyoud is configured here (its data directories,
    measured; its pinned and buffer budgets, one user's share of the pinned one) unless
    the host is described."""
    from fuyou_client.sizing import cli

    describes = args.ram is not None or args.ssd is not None
    cfg = load(args.config)
    user = UserLimits.from_config(cfg).pinned  # (what one user may hold, [limits] user_pinned; 0: no limit)
    pinned = min(cfg.session_budget, user) if user else cfg.session_budget
    defaults = {} if describes else {"pinned_budget": pinned, "buffer_budget": cfg.optimizer.buffer_budget}
    return cli.run(args, data_dirs=cfg.data_dirs, defaults=defaults)
