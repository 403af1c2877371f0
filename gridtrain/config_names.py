"""The names a config may use: mixed-precision modes and tensor-parallel plan styles.

Defined here, below everything else, so the config schema validates against them without
importing the packages that implement them (``gridtrain.amp`` re-exports ``AMP_TYPE``; the
planner, ``gridtrain.parallel.tensor.plan``, reads ``STYLES``). No torch import.
"""

from enum import Enum


class AMP_TYPE(str, Enum):  # noqa: N801 - the legacy spelling users write in configs
    """Mixed-precision mode for ``fp16 = dict(mode=...)``."""

    TORCH = "torch"  # autocast fp16 + GradScaler
    NAIVE = "naive"  # fp16 model, fp32 master weights, dynamic loss scaler
    APEX = "apex"  # NVIDIA apex O-levels when installed
    BF16 = "bf16"  # autocast bf16, no scaler


# the layer styles a tensor-parallel plan may name (the Hugging Face ``tp_plan`` vocabulary,
# plus gridtrain's own), each with what it does
STYLES = {
    "colwise": "Linear: output features split (output stays sharded); on an Embedding: the "
    "embedding dim split",
    "rowwise": "Linear: input features split, partial products all-reduced (replicated output)",
    "colwise_gather_output": "Linear: output features split, then all-gathered (replicated output)",
    "rowwise_split_input": "Linear: row-parallel on a replicated input (each rank cuts its slice)",
    "packed_colwise": "Linear/Conv1D whose output packs several equal blocks (fused q/k/v, "
    "gate/up): each block split column-wise, so every rank keeps whole heads of each",
    "embedding_rowwise": "Embedding: vocabulary split, partial rows all-reduced",
    "embedding_colwise": "Embedding: embedding dim split, output all-gathered",
    "vocab_parallel": "output Linear (LM head, classifier): logits stay sharded over the "
    "classes; pair with gt.nn.CrossEntropyLoss",
    "gather_output": "output Linear (LM head, classifier): full logits on every rank "
    "(2d/2.5d/3d: the mode's Classifier)",
    "norm": "LayerNorm / RMSNorm over the last dim, in the mode's layout",
    "auto": "the mode's own layer (2d/2.5d/3d: every Linear is a SUMMA / cube Linear)",
    "replicate": "leave the module as it is (every rank holds it whole)",
}
