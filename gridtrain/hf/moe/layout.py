"""The expert layout as ``engine.plan`` prints it: which experts of each layer this rank holds."""

from __future__ import annotations

from dataclasses import dataclass, field

from gridtrain.hf.moe.experts import Placement


def _shape(shape: tuple[int, ...]) -> str:
    return "[" + ",".join(str(s) for s in shape) + "]"


@dataclass
class ExpertTable:
    """``ep`` ranks per EXPERT group, ``replicas`` ranks per EXPERT_DATA group; one placement
    per experts module spread (none at ep 1: ``modules`` experts modules kept whole)."""

    ep: int
    replicas: int
    places: dict[str, Placement] = field(default_factory=dict)
    modules: int = 0

    def __str__(self) -> str:
        if not self.places:
            return (
                f"experts: {self.modules} experts modules kept whole on every rank "
                "(moe.expert_parallel_size 1), planned as one block each"
            )
        lines = [
            f"experts: moe.expert_parallel_size {self.ep}: each layer's experts spread over "
            f"EXPERT ({self.ep} ranks), dropless all-to-all; expert gradients averaged over "
            f"EXPERT_DATA ({self.replicas} ranks)"
        ]
        rows = [("module", "experts", "this rank", "shard (dense -> this rank)")]
        for name, p in self.places.items():
            held = f"{p.first}-{p.first + p.local - 1}" if p.local > 1 else str(p.first)
            shards = "; ".join(f"{t} {_shape(d)}->{_shape(s)}" for t, (d, s) in p.shapes.items())
            rows.append((name, str(p.num_experts), held, shards))
        widths = [max(len(r[i]) for r in rows) for i in range(3)]
        for r in rows:
            lines.append("  " + "  ".join(c.ljust(w) for c, w in zip(r[:3], widths)) + "  " + r[3])
        return "\n".join(lines)
