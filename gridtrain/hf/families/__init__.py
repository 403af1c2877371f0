"""Hugging Face families that need more than the model's own plans, one file each, by
``config.model_type``.

Most families need nothing here: their ``_tp_plan`` (tensor plan), ``_pp_plan`` (pipeline
units) and ``ep_plan`` (experts), or the traced plan where they have none, are read as they
are. A family whose own plans are missing or wrong for gridtrain registers a ``Family``
with what it adds (``registry.py``): its tensor plan, the fixes its code needs once its
layers are sharded (``localise``, run by ``after_apply`` and the planner's forward on this
rank's shapes), its pipeline units and, for a mixture-of-experts family, how it computes its
router loss (``moe``). Built in: ``gpt2.py`` (no ``_tp_plan`` nor ``_pp_plan``; fused
``c_attn``), ``phi3.py`` (fused ``qkv_proj`` / ``gate_up_proj`` split as packed blocks), and
the router losses of ``mixtral.py``, ``qwen2_moe.py``, ``qwen3_moe.py``, ``gpt_oss.py``,
``deepseek_v3.py``. A user's family, or a replacement of a built-in one, is registered the
same way before ``gt.initialize`` (``register_family(..., replace=True)`` to override).
"""

from gridtrain.hf.families.registry import (
    FAMILIES,
    Family,
    family_of,
    register_family,
    unregister_family,
)

__all__ = ["FAMILIES", "Family", "family_of", "register_family", "unregister_family"]
