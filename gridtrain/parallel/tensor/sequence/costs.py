"""What sequence parallelism sends and saves, for ``gridtrain estimate``
(``estimate/collectives.py`` and ``estimate/memory.py`` call these through ``GEOMETRY``;
``c`` is the collectives' builder): the ring's K/V blocks (``attention.py``, ``ring.py``),
the token losses summed over SEQUENCE (``loss.py``) and what ring attention keeps for
backward. Torch-free, as the rest of the geometry half."""

from __future__ import annotations

from typing import Any

from gridtrain.parallel.mode import ParallelMode as PM


def attention(c: Any) -> None:
    n, kv = c.geo.size, c.t * c.spec.hidden  # k and v blocks hold every head
    if c.sc.ring == "online":
        c.add(PM.SEQUENCE, "ring_pass", 2 * kv * (n - 1), "e", "ring K/V (forward)", fwd=1)
        c.add(PM.SEQUENCE, "ring_pass", 2 * kv * (n - 1), "e", "ring K/V (backward)")
        c.add(PM.SEQUENCE, "ring_pass", 2 * kv * n, "f", "ring dK/dV accumulators")
    else:
        c.add(PM.SEQUENCE, "ring_pass", 2 * kv * (2 * n - 2), "e", "RingQK / RingAV: K, V",
              fwd=0.5)  # fmt: skip
        c.add(PM.SEQUENCE, "ring_pass", 2 * kv * n, "e", "RingQK / RingAV: dK, dV")


def loss(c: Any) -> None:
    c.ar(PM.SEQUENCE, 1, "f", "loss over the sequence (forward and backward)", 2)
    c.ar(PM.SEQUENCE, 1, "f", "token count over the sequence")


def attention_items(g: Any, sc: Any, spec: Any, t: float, heads: float, nb: dict) -> list:
    """What ring attention saves for ``t`` positions of ``heads`` heads on one rank: 'online'
    its fp32 output and log-sum-exp; 'standard' its ``s/N x S`` probability rows (fp32, and a
    compute-dtype copy under amp) and the causal mask."""
    s = spec.seq_len
    if sc.ring == "online":
        return [("ring attention output (fp32)", t * spec.hidden * 4), ("lse", t * heads * 4)]
    probs = t * heads * s
    items = [("ring attention probabilities", probs * 4), ("causal mask", t / g.size * s)]
    if nb["e"] != 4:
        items.append(("probabilities (compute dtype)", probs * nb["e"]))
    return items
