"""Device presets: peak FLOP/s, memory, memory bandwidth and the two link speeds of a cluster.

Bandwidths are per GPU and one direction, bytes/s: ``nvlink`` inside a node
(H100/H200 SXM: NVLink 4, 900 GB/s both ways; A100: NVLink 3, 600 GB/s), and
``internode`` the network share of one GPU (one 400 Gb/s NDR NIC per H100/H200,
one 200 Gb/s HDR NIC per A100 as on Selene). ``alpha`` is the per-step latency
of a collective on that link. ``efficiency`` is the fraction of peak a large
GEMM reaches (cuBLAS on big bf16 shapes); ``peak_fp32`` is what fp32 matmuls
run at (TF32 off, torch's default).
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
