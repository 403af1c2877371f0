"""A tensor mode's torch-free half: the config, ``Layout`` and the modes' geometry load no layer.

``gridtrain topo`` and ``gridtrain estimate`` build a ``Layout`` of any size with no process;
the config checks each mode's sizes before any process exists. Both read the modes' geometry
(``parallel/tensor/<mode>/geometry.py``) and must not pull in torch, the process groups or a
mode's layers: a fresh interpreter imports the layout module, builds a layout of every mode,
and reports what it loaded.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = """
import json, sys
from gridtrain.config import Config
from gridtrain.parallel.layout import Layout

tensor = {"1d": dict(size=2), "2d": dict(size=4), "2.5d": dict(size=8, depth=2),
          "3d": dict(size=8), "sequence": dict(size=2)}
ranks = {}
for mode, kw in tensor.items():
    config = Config.from_dict(dict(parallel=dict(tensor=dict(mode=mode, **kw))))
    ranks[mode] = Layout(config, 2 * kw["size"], 1).world_size()
print(json.dumps({"ranks": ranks, "modules": sorted(sys.modules)}))
"""


def test_layout_loads_no_torch_and_no_layer():
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, check=True
    )
    report = json.loads(out.stdout.splitlines()[-1])
    # every mode's layout was built (each over two tensor blocks)
    assert report["ranks"] == {"1d": 4, "2d": 8, "2.5d": 16, "3d": 16, "sequence": 4}
    loaded = report["modules"]
    assert not [m for m in loaded if m == "torch" or m.startswith("torch.")]
    runtime = ("runtime", "layers", "linear", "loss", "mha", "grid", "cube", "attention")
    layer_modules = [
        m for m in loaded if m.startswith("gridtrain.parallel.") and m.rsplit(".", 1)[-1] in runtime
    ]
    assert layer_modules == []
    for gone in ("gridtrain.parallel.context", "gridtrain.parallel.comm", "gridtrain.nn"):
        assert gone not in loaded
    # the geometry half of every mode is what the layouts read
    for mode in ("mode_1d", "mode_2d", "mode_3d", "sequence", "none"):
        assert f"gridtrain.parallel.tensor.{mode}.geometry" in loaded
