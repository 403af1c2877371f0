"""Device presets: peak FLOP/s, memory, memory bandwidth and the two link speeds of a cluster.

Bandwidths are per GPU and one direction, bytes/s: ``nvlink`` inside a node
(H100/H200 SXM: NVLink 4, 900 GB/s both ways; A100: NVLink 3, 600 GB/s), and
``internode`` the network share of one GPU (one 400 Gb/s NDR NIC per H100/H200,
one 200 Gb/s HDR NIC per A100 as on Selene). ``peak_fp32`` is what fp32 matmuls run at
(TF32 off, torch's default).

The efficiency model's constants and where each comes from:

* ``peak_flops``, ``peak_fp32``, ``hbm_bw``, ``memory``, ``nvlink``, ``internode``: the
  vendors' data sheets (H100/H200 SXM: 989.4 dense bf16 TFLOP/s, 66.9 fp32; A100 SXM 80 GB:
  312, 19.5).
* ``efficiency`` (the fraction of peak a large GEMM reaches) and ``gemm_half`` (a GEMM runs at
  ``n / (n + gemm_half)`` of that, ``n`` its smallest local dimension): fitted, A100 to
  Narayanan et al. 2021 Table 1 (ten rows, hidden 2304 to 25600: every row within 0.92-1.09
  of the paper's throughput), H100/H200 to GPT-2 124M and 350M measured on one H200
  (``benchmarks/estimate_vs_published.py --measure``, ``benchmarks/RESULTS.md``).
  ``estimate.calibration`` lists those runs; ``--search`` prints the nearest beside each pick.
* ``alpha_intra`` / ``alpha_inter`` (a collective step's latency): NCCL's measured small-message
  latencies on NVLink and InfiniBand (nccl-tests, a few microseconds), not fitted here.
* ``pcie`` (ZeRO offload's host link): PCIe 4 x16's practical 25 GB/s; ``cpu_adam``: torch's
  fused CPU AdamW on 16 cores (``benchmarks/offload.py``).
* In ``estimator.py``: ``TRAFFIC`` (each saved activation byte written and read once, its
  gradient written and read once, over ``hbm_bw``) and ``RESERVED_GPU`` (2 GiB: CUDA context,
  NCCL buffers, allocator slack) are assumptions the calibration absorbs.
"""

from __future__ import annotations

import dataclasses

GiB = 2**30


class DeviceError(ValueError):
    """An unknown device preset or an impossible override."""


@dataclasses.dataclass(frozen=True)
class DeviceSpec:
    name: str
    peak_flops: float  # dense bf16/fp16 tensor-core FLOP/s
    peak_fp32: float  # fp32 FLOP/s (no TF32)
    memory: float  # bytes usable by one rank
    hbm_bw: float  # bytes/s
    nvlink: float  # bytes/s per GPU, one direction, inside a node
    internode: float  # bytes/s per GPU, one direction, between nodes
    gpus_per_node: int = 8
    alpha_intra: float = 2e-6  # seconds per collective step inside a node
    alpha_inter: float = 8e-6  # seconds per collective step across nodes
    efficiency: float = 0.7  # fraction of peak that large GEMMs reach
    gemm_half: float = 256  # a GEMM's smallest dimension at which it runs at half that
    pcie: float = 25e9  # host link (ZeRO offload), bytes/s
    cpu_adam: float = 3.8e9  # host AdamW, parameters/s (torch's fused CPU kernel, 16 cores)
    fused_rms_norm: bool = True  # CUDA's fused RMSNorm keeps input + rstd; CPU's composite more

    def peak_for(self, amp: str | None) -> float:
        """Matmul FLOP/s for the config's precision (None: fp32)."""
        return self.peak_fp32 if amp is None else self.peak_flops


PRESETS: dict[str, DeviceSpec] = {
    d.name: d
    for d in (
        DeviceSpec("h100-80g", 989.4e12, 66.9e12, 80 * GiB, 3.35e12, 450e9, 50e9),
        DeviceSpec("h200-141g", 989.4e12, 66.9e12, 141e9, 4.8e12, 450e9, 50e9),
        DeviceSpec("a100-80g", 312e12, 19.5e12, 80 * GiB, 2.04e12, 300e9, 25e9, efficiency=0.7),
        DeviceSpec(
            "cpu",
            2e11,
            1e11,
            64 * GiB,
            20e9,
            5e9,
            1.25e9,
            gpus_per_node=8,
            alpha_intra=3e-5,
            alpha_inter=1e-4,
            efficiency=0.5,
            pcie=20e9,
            fused_rms_norm=False,
        ),  # fmt: skip
    )
}


def get_device(name: str, **overrides) -> DeviceSpec:
    """A preset by name with fields overridden (None values are ignored)."""
    spec = PRESETS.get(name.lower())
    if spec is None:
        raise DeviceError(f"unknown device {name!r}; choose one of {', '.join(PRESETS)}")
    changes = {k: v for k, v in overrides.items() if v is not None}
    for key, value in changes.items():
        if not hasattr(spec, key):
            raise DeviceError(f"device has no field {key!r}")
        if value <= 0:
            raise DeviceError(f"device {key} must be > 0, got {value}")
    return dataclasses.replace(spec, **changes)
