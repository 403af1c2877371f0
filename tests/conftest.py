"""Make tests/ importable (harness) in pytest and in the spawned worker processes."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
