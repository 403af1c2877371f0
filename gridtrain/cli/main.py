"""The ``gridtrain`` command: its parser and entry point; each sub-command is a module of its own.

Every sub-command checks what it can (files, host lists, the config's layout for the world
size it is about to use) before it starts any process: a command line that cannot run
exits with code 2 and a one-line message.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from gridtrain.cli.argv import split_at_script
from gridtrain.cli.usage import UsageError
from gridtrain.config import ConfigError

# sub-command -> the module that adds its parser; only the one asked for is imported, so
# `gridtrain run` starts its job without importing torch in the launcher process
COMMANDS = {
    "run": "gridtrain.cli.run",
    "topo": "gridtrain.cli.topo",
    "estimate": "gridtrain.estimate.cli",
}

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


def build_parser(commands: list[str] | None = None) -> argparse.ArgumentParser:
    """The ``gridtrain`` argument parser with its ``run``, ``topo`` and ``estimate`` sub-commands
    (only ``commands`` of them where given)."""
    parser = argparse.ArgumentParser(
        prog="gridtrain",
        description="Config-driven data, pipeline and tensor parallel training.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"gridtrain {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMANDS if commands is None else commands:
        importlib.import_module(COMMANDS[name]).add_parser(sub)
    return parser


def _version() -> str:
    """The installed distribution's version (``pip install -e .`` included)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("gridtrain")
    except PackageNotFoundError:
        return "(not installed: run from a checkout)"


def _parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """The parsed command line; ``run``'s is cut at the script (``cli/argv``), so no argument
    of the script is ever read as one of ``gridtrain run``'s."""
    if argv[:1] != ["run"]:
        return parser.parse_args(argv)
    from gridtrain.cli.run import FLAGS  # build_parser imported it already

    head, tail = split_at_script(argv[1:], FLAGS)
    args = parser.parse_args(["run", *head])
    args.script_args = tail
    return args


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``gridtrain`` console script; returns the exit code.

    Usage errors and impossible layouts exit with code 2 and a one-line
    message, before any process is started.
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    words = [a for a in argv if not a.startswith("-")]
    if words[:1] and words[0] in COMMANDS:
        parser = build_parser(words[:1])
    else:  # --version needs no sub-command (estimate and topo import torch)
        parser = build_parser([] if "--version" in argv and not words else None)
    args = _parse(parser, argv)
    try:
        return args.handler(args)
    except (UsageError, ConfigError) as err:
        args.parser.error(str(err))  # prints usage + message, exits 2
    return 2  # unreachable: error() exits
