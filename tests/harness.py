"""Moved to tests/helpers/harness.py; kept while other branches still import it from here."""

from helpers.harness import *  # noqa: F403
from helpers.harness import run_distributed  # noqa: F401
