"""The ``gridtrain`` command: its parser and entry point; each sub-command is a module of its own.

Every sub-command checks what it can (files, host lists, the config's layout for the world
size it is about to use) before it starts any process: a command line that cannot run
exits with code 2 and a one-line message.
"""

from __future__ import annotations

import argparse

from gridtrain.cli import run, topo
from gridtrain.cli.usage import UsageError
from gridtrain.config import ConfigError
from gridtrain.estimate import cli as estimate_cli

EXAMPLES = """\
examples:
  gridtrain run --nproc_per_node 4 --config demos/gpt/configs/dp2_tp2.py demos/gpt/train.py
  gridtrain run --nproc_per_node 2 --config demos/gpt/configs/tp1d_2.py \\
      demos/gpt/train.py --steps 50 --lr 3e-3
  gridtrain run --host node1,node2 --nproc_per_node 8 --config demos/gpt/configs/demo.py \\
      demos/gpt/train.py
  gridtrain run --hostfile hosts.txt --exclude node3 --nproc_per_node 8 \\
      --config demos/gpt/configs/demo.py demos/gpt/train.py
  gridtrain run --nproc_per_node 4 --max-restarts 3 --config demos/gpt/configs/dp2_tp2.py \\
      demos/gpt/train.py --checkpoint ckpt --save-every 20 --resume auto
  gridtrain topo --config configs/tp_2d.py --world-size 16
  gridtrain topo --config configs/tp_2d.py --world-size 16 --rank 5
(the configs and scripts named here ship with gridtrain: run these in its checkout)
"""


def build_parser() -> argparse.ArgumentParser:
    """The ``gridtrain`` argument parser with its ``run``, ``topo`` and ``estimate`` sub-commands."""
    parser = argparse.ArgumentParser(
        prog="gridtrain",
        description="Config-driven data, pipeline and tensor parallel training.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    run.add_parser(sub)
    topo.add_parser(sub)
    estimate_cli.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``gridtrain`` console script; returns the exit code.

    Usage errors and impossible layouts exit with code 2 and a one-line
    message, before any process is started.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.handler(args)
    except (UsageError, ConfigError) as err:
        args.parser.error(str(err))  # prints usage + message, exits 2
    return 2  # unreachable: error() exits
