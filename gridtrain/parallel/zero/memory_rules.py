"""The memory model both ``engine.memory()`` and ``gridtrain estimate`` speak: the categories
of what one rank holds, and which of them each ZeRO stage shards and when. Imports nothing.

Categories (bytes of distinct storages, a DTensor by its local shard, each storage once;
``engine.memory()`` reports each on the device and in host memory):

* ``parameters``: the model's parameters as this rank holds them: its tensor-parallel /
  pipeline shard; stage 3 (FSDP2) the sharded rows plus the units gathered at the moment;
  Gemini the compute-dtype device copies (and a streamed chunk's host copy). The
  all-gather buffers of stages 1-2 after the step count here too.
* ``masters``: the optimizer's parameters where they are not the model's: fp32 copies
  (naive fp16; ZeRO 1-2 with naive fp16 or offload: this rank's rows; Gemini: its host
  rows). A ZeRO 1-2 master viewing the model's rows adds nothing. FSDP2's sharded fp32
  parameters are counted as ``parameters``.
* ``gradients``: every gradient held: ``.grad`` of the model's parameters and of the
  masters (the row accumulators), FSDP2's unsharded gradients, Gemini's host rows and
  staging buffers, and the communication buffers of buckets in flight (all-reduce copies,
  reduce-scatter send and receive buffers).
* ``optimizer_state``: every tensor in ``optimizer.state`` (a DTensor by its local shard).
* ``activations``: peak only: the distinct storages autograd holds for backward (tensors
  saved by ``save_for_backward`` / ops, parameters and views of them excluded), most at
  once over the step.

What stays sharded between two backwards of one optimizer step (``gradients_between_backwards``):
no ZeRO and stage 1 hold the full local gradient; stage 2 and stage 3 hold this rank's rows
(1/dp) plus nothing in flight (stage 2's buckets are drained at each backward's end; at most
``IN_FLIGHT_BUCKETS`` run at once during a backward); stage 3 with ``keep_unsharded_grads``
holds the full unsharded gradient (compute dtype) besides its rows; Gemini holds its rows
in host memory.

Gemini's host link (``gemini_link_bytes``, ``GEMINI_STAGING_BUFFERS``): each backward's
gradient rows cross it in the compute dtype when the run is bf16 (the compute gradients are
bf16 already; a group of several ranks reduces in fp32 first) and in the masters' dtype
otherwise, and are summed into the fp32 rows on the host; the masters go back to the device
in the compute dtype (cast on the host). A chunk's gradients are reduce-scattered on the device
from a buffer of the masters' dtype over a group of several ranks, of the link's over one
(``gemini_reduce_bytes``). The link's pinned host buffers (``gemini_host_buffers``) count as
gradients (staging) and parameters (upload casts). ``offload_plan`` turns these into bytes
per step and host bytes, ``gridtrain estimate`` into each category's bytes; the runtime takes
its dtypes and buffer counts from the same functions.

Everything here is plain Python on ints and strings (no torch), so ``gridtrain estimate``
imports it without torch; names and signatures are kept stable for it.
"""

from __future__ import annotations

PARAMETERS = "parameters"
MASTERS = "masters"
GRADIENTS = "gradients"
OPTIMIZER_STATE = "optimizer_state"
ACTIVATIONS = "activations"
CATEGORIES = (PARAMETERS, MASTERS, GRADIENTS, OPTIMIZER_STATE, ACTIVATIONS)

IN_FLIGHT_BUCKETS = 2  # stage 2: reduce-scatter buckets running at once within a backward

FULL, ROWS, FULL_AND_ROWS, HOST_ROWS = "full", "rows", "full+rows", "host rows"

# Gemini: pinned host buffers of the largest chunk's row segment (in the link's gradient
# dtype) that the gradients of a backward land in before the host adds them to the rows; and
# as many compute-dtype buffers the masters are cast into before each upload
GEMINI_STAGING_BUFFERS = 2


def reduces_each_backward(
    stage: int | None, offload: bool = False, keep_unsharded_grads: bool = False
) -> bool:
    """Whether gradients leave the device in every backward (accumulation micro-step, pipeline
    micro-batch) rather than once, in the window's last: stage 2, stage 3 unless
    ``keep_unsharded_grads``, and Gemini (stage 3 with offload)."""
    if stage == 2 or (stage == 3 and offload):
        return True
    return stage == 3 and not keep_unsharded_grads


def gradients_between_backwards(
    stage: int | None, offload: bool = False, keep_unsharded_grads: bool = False
) -> str:
    """What a rank holds of its gradients between two backwards of one step: ``FULL`` (the
    local gradient of every parameter), ``ROWS`` (its 1/dp rows, accumulated in the masters'
    dtype: fp32 where they are copies), ``FULL_AND_ROWS`` (stage 3 keeping unsharded
    gradients: the full ones, then its rows at the step) or ``HOST_ROWS`` (Gemini)."""
    if stage == 3 and offload:
        return HOST_ROWS
    if reduces_each_backward(stage, offload, keep_unsharded_grads):
        return ROWS
    return FULL_AND_ROWS if stage == 3 else FULL


def gemini_link_bytes(compute_bytes: int, master_bytes: int = 4, bf16: bool = False) -> tuple:
    """Gemini's bytes per element over the host link: ``(gradient, upload)``.

    ``gradient``: one backward's rows sent to the host: ``compute_bytes`` when the run is bf16
    (``bf16``: ``fp16 = dict(mode="bf16")``), else ``master_bytes`` (fp16 runs too: the fp32
    mean of a group's loss-scaled gradients may fall outside fp16's range); the host sums them
    in ``master_bytes``.
    ``upload``: the masters' rows going back to the device after a step, and a streamed chunk's
    fetches: the compute dtype, never wider than the masters."""
    gradient = compute_bytes if bf16 else master_bytes
    return gradient, min(compute_bytes, master_bytes)


def gemini_reduce_bytes(
    group: int, compute_bytes: int, master_bytes: int = 4, bf16: bool = False
) -> int:
    """Bytes per element of the device buffer a Gemini chunk's gradients are reduce-scattered
    from: the masters' dtype over a group of several ranks (the mean of ``group`` compute-dtype
    gradients is summed wide, then its rows cast for the link), else the link's gradient dtype."""
    if group > 1:
        return master_bytes
    return gemini_link_bytes(compute_bytes, master_bytes, bf16)[0]


def gemini_host_buffers(
    largest_segment: int,
    largest_cast_segment: int,
    compute_bytes: int,
    master_bytes: int = 4,
    bf16: bool = False,
) -> dict[str, int]:
    """Host bytes of Gemini's pinned link buffers, by category: ``GRADIENTS``, the
    ``GEMINI_STAGING_BUFFERS`` buffers of the largest chunk's row segment (elements) in the
    link's gradient dtype that a backward's gradients land in; ``PARAMETERS``, as many of the
    largest resident chunk's segment (``largest_cast_segment``) in the compute dtype that its
    masters are cast into before an upload, where the compute dtype is narrower."""
    grad, _ = gemini_link_bytes(compute_bytes, master_bytes, bf16)
    cast = largest_cast_segment * compute_bytes if compute_bytes < master_bytes else 0
    return {
        GRADIENTS: GEMINI_STAGING_BUFFERS * largest_segment * grad,
        PARAMETERS: GEMINI_STAGING_BUFFERS * cast,
    }
