"""Demo command lines whose defaults come from the config: argument > UPPER_CASE constant > default.

The parser runs before any process group exists, so ``--help`` and a misspelt flag answer at
once, with neither ``gridtrain run`` nor a config; ``fill_from_config`` then takes what the
command line left out from the config's constants (``ctx.config``), else from the table.
A table row is ``(argument, config constant, type, default, help)``.
"""

from __future__ import annotations

import argparse

Row = tuple[str, str, type, object, str]


def config_parser(description: str, rows: list[Row], sep: str = "-") -> argparse.ArgumentParser:
    """A parser with one ``--argument`` per row (``_`` in its name spelt ``sep``), unset by default."""
    parser = argparse.ArgumentParser(description=description)
    for name, const, typ, default, help_ in rows:
        shown = "" if default is None else f"default {default}; "
        parser.add_argument(
            f"--{name.replace('_', sep)}",
            dest=name,
            type=typ,
            default=None,
            help=f"{help_} ({shown}the config's {const} overrides the default)",
        )
    return parser


def fill_from_config(args: argparse.Namespace, config, rows: list[Row]) -> argparse.Namespace:
    """Every argument the command line left unset: the config's constant, else the row's default."""
    for name, const, _, default, _ in rows:
        if getattr(args, name) is None:
            setattr(args, name, getattr(config, const, default))
    return args
