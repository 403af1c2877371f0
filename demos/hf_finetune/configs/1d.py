"""1D tensor parallelism over 2 processes (`--nproc_per_node 2`): GPT-2 by gridtrain's plan
(c_attn split per head), Llama by its own `_tp_plan`; logits gathered."""

parallel = dict(tensor=dict(size=2, mode="1d"))
