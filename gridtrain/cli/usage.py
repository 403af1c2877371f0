"""What every sub-command checks before it starts anything: the command line and the config."""

from __future__ import annotations

from pathlib import Path

from gridtrain.config import Config, ConfigError


class UsageError(ValueError):
    """A command line that cannot run; the message names the argument."""


def load_config(path: str) -> Config:
    """``Config.from_file`` with every failure as a ``ConfigError`` that names the file."""
    if not Path(path).is_file():
        raise UsageError(f"--config '{path}' does not exist")
    try:
        return Config.from_file(path)
    except ConfigError as err:
        raise ConfigError(f"--config {path}: {err}") from None
    except Exception as err:  # noqa: BLE001 - a config is user code; report, don't trace back
        raise ConfigError(f"--config {path} failed to load: {type(err).__name__}: {err}") from None
