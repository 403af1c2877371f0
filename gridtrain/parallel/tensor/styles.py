"""The layer styles a tensor-parallel plan may name (the Hugging Face ``tp_plan`` vocabulary,
plus gridtrain's own). Kept free of torch imports: the config schema validates against it."""

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
