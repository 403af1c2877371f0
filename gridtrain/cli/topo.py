"""``gridtrain topo``: the rank grid and every process group of a config, starting nothing."""

from __future__ import annotations

import argparse

from gridtrain.cli.usage import UsageError, load_config
from gridtrain.parallel.layout import Layout
from gridtrain.parallel.topology_views import format_rank, format_topology, summarize_topology

DESCRIPTION = (
    "Print how --world-size ranks are cut into data, pipeline, tensor (and per-mode) groups "
    "under this config, without starting any process. By default one line per mode: group "
    "count, size, the stride between a group's ranks and rank 0's group, a few lines at any "
    "world size."
)


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Add the ``topo`` sub-command to ``gridtrain``'s sub-parsers."""
    topo = subparsers.add_parser(
        "topo",
        help="print the rank grid and its process groups, starting nothing",
        description=DESCRIPTION,
    )
    topo.add_argument("--config", required=True, help="gridtrain config (.py, .yaml or .yml)")
    topo.add_argument("--world-size", "--world_size", type=int, required=True, metavar="N")
    view = topo.add_mutually_exclusive_group()
    view.add_argument("--rank", type=int, metavar="R", help="every group of rank R, in full")
    view.add_argument("--full", action="store_true", help="every group of every mode, in full")
    topo.set_defaults(handler=cmd_topo, parser=topo)
    return topo


def cmd_topo(args: argparse.Namespace) -> int:
    """Print the view of the grid the arguments ask for; returns the exit code."""
    cfg = load_config(args.config)
    cfg.check_world_size(args.world_size)
    if args.rank is not None and not 0 <= args.rank < args.world_size:
        raise UsageError(f"--rank must be in [0, {args.world_size}), got {args.rank}")
    layout = Layout(cfg, args.world_size, args.rank or 0)
    if args.full:
        print(format_topology(layout))
    elif args.rank is not None:
        print(format_rank(layout))
    else:
        print(summarize_topology(layout))
    return 0
