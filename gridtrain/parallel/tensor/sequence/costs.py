"""What sequence parallelism sends, for ``gridtrain estimate`` (``estimate/collectives.py``
calls these through ``GEOMETRY``; ``c`` is its builder): the ring's K/V blocks
(``attention.py``, ``ring.py``) and the token losses summed over SEQUENCE
(``loss.py``). Torch-free, as the rest of the geometry half."""

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
