"""What the estimate's step times rest on: the runs its efficiency constants were fitted to.

Each ``Anchor`` is one measured or published run beside the estimate of the same run (the
tables of ``benchmarks/estimate_vs_published.py``, in ``benchmarks/RESULTS.md``). ``--search``
prints, next to each pick's MFU, the anchor nearest to it (same device family first, then the
closest model size and GPU count on a log scale) with that anchor's measured MFU and the
ratio estimate / measured of its step time: an MFU far above every anchor's is a number the
model has never been checked at.
"""

from __future__ import annotations

import dataclasses
import math


@dataclasses.dataclass(frozen=True)
class Anchor:
    label: str
    device: str  # the preset family it was run on ("h100", "a100")
    params: float  # model parameters
    gpus: int
    mfu: float  # measured (or published) model FLOPs utilisation
    time_ratio: float  # estimated / measured step time (1.0: exact; < 1: the estimate is fast)
    source: str


ANCHORS: tuple[Anchor, ...] = (
    Anchor("GPT-2 124M, 1 H200", "h100", 124e6, 1, 0.303, 0.66,
           "gpt_throughput.py, RESULTS.md"),
    Anchor("GPT-2 350M, 1 H200", "h100", 355e6, 1, 0.367, 0.72,
           "gpt_throughput.py, RESULTS.md"),
    Anchor("Megatron 1.7B, 32 A100", "a100", 1.7e9, 32, 137 / 312, 0.92,
           "Narayanan et al. 2021, Table 1"),
    Anchor("Megatron 18.4B, 256 A100", "a100", 18.4e9, 256, 135 / 312, 1.06,
           "Narayanan et al. 2021, Table 1"),
    Anchor("Megatron 145.6B, 1536 A100", "a100", 145.6e9, 1536, 148 / 312, 1.00,
           "Narayanan et al. 2021, Table 1"),
    Anchor("Megatron 1T, 3072 A100", "a100", 1008e9, 3072, 163 / 312, 1.09,
           "Narayanan et al. 2021, Table 1"),
)  # fmt: skip


def family(device_name: str) -> str:
    """``h100`` for the H100/H200 presets, ``a100``, else the name."""
    name = device_name.lower()
    return "h100" if name.startswith(("h100", "h200")) else name.split("-")[0]


def nearest(device_name: str, params: float, gpus: int) -> Anchor:
    """The anchor closest to a run: its device family if any is, then size and GPU count."""
    fam = family(device_name)
    pool = [a for a in ANCHORS if a.device == fam] or list(ANCHORS)
    return min(pool, key=lambda a: _distance(a, params, gpus))


def _distance(a: Anchor, params: float, gpus: int) -> float:
    return abs(math.log10(a.params / params)) + 0.5 * abs(math.log10(a.gpus / gpus))


def describe(a: Anchor) -> str:
    """``"GPT-2 350M, 1 H200: 36.7 % measured, est. time x0.72"``."""
    return f"{a.label}: {a.mfu:.1%} measured, est. time x{a.time_ratio:.2f}"
