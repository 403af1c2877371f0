"""Small fixes a Hugging Face model's own code needs once its layers are sharded or lazily built.

* Llama-family attention reshapes with ``-1`` heads and needs nothing; GPT-2 and Phi-3 get
  this rank's head counts from their family files (``families/``); any other attention that keeps its head counts or head width as
  attributes (OPT's ``num_heads``, Falcon's ``num_kv_heads``, OpenAI GPT's ``split_size``) gets this rank's where its projections are split (``localise_heads``):
  the planner's run on this rank's shapes checks the result before any weight moves.
* ``gt.lazy_init()`` builds the model on meta; the engine then allocates each rank's
  shards and re-runs ``reset_parameters``. HF modules without one (``Conv1D``,
  ``*RMSNorm``) get the model's own ``_init_weights``, and rotary embeddings, whose
  ``inv_freq`` is computed in ``__init__`` and never saved, are recomputed from the config.
"""

from __future__ import annotations

import types

import torch
from torch import nn

from gridtrain.parallel.tensor.base import is_transposed_linear
from gridtrain.parallel.tensor.norm import norm_kind

Undo = list[tuple[object, str, object]]  # (object, attribute, its value before), to restore


def set_undoable(undo: Undo, obj: object, attr: str, value: object) -> None:
    """``obj.attr = value``, remembering the old value in ``undo`` (see ``restore``)."""
    undo.append((obj, attr, getattr(obj, attr)))
    setattr(obj, attr, value)


def restore(undo: Undo) -> None:
    """Put back what ``set_undoable`` changed, last change first."""
    for obj, attr, old in reversed(undo):
        setattr(obj, attr, old)


# attributes an attention module may keep its (query or key/value) head counts, or the width
# of all its heads, in
HEAD_ATTRS = (
    "num_heads",
    "num_attention_heads",
    "n_head",
    "n_heads",
    "num_key_value_heads",
    "num_kv_heads",
)
# the width the model cuts a fused [q | k | v] output at (OpenAI GPT's split_size); never a
# width used otherwise (CodeGen's embed_dim // mp_num: localising it regroups the blocks)
WIDTH_ATTRS = ("split_size",)


def localise_heads(model: nn.Module, split_out: set[str], split: int, undo: Undo) -> None:
    """In every module with a direct child in ``split_out`` (the planned layers whose output
    stays split over the heads), head-count attributes equal to the config's query or
    key/value head count, and width attributes equal to all query heads' width, become this
    rank's (``split`` ways)."""
    if split == 1:
        return
    cfg = model.config
    counts = {
        _setting(cfg, k) for k in ("num_attention_heads", "num_key_value_heads", "num_kv_heads")
    }
    heads, head_dim = _setting(cfg, "num_attention_heads"), _setting(cfg, "head_dim")
    widths = {_setting(cfg, "hidden_size"), heads * head_dim if heads and head_dim else None}
    for name, module in model.named_modules():
        prefix = f"{name}." if name else ""
        if not any(f"{prefix}{child}" in split_out for child, _ in module.named_children()):
            continue
        for attrs, known in ((HEAD_ATTRS, counts), (WIDTH_ATTRS, widths)):
            for attr in attrs:
                value = getattr(module, attr, None)
                if type(value) is int and value in known and value % split == 0:
                    set_undoable(undo, module, attr, value // split)


def _setting(cfg, key: str) -> int | None:
    """``cfg.key`` where it is one int for the whole model (a per-layer one raises: None)."""
    try:
        value = getattr(cfg, key, None)
    except Exception:  # noqa: BLE001 - transformers' per-layer settings refuse a global read
        return None
    return value if type(value) is int else None


def give_reset_parameters(model: nn.Module) -> None:
    """Attach ``reset_parameters`` (the HF model's ``_init_weights``) where a layer has none."""
    init = getattr(model, "_init_weights", None)
    if init is None:
        return
    for module in model.modules():
        if hasattr(module, "reset_parameters") or not (
            is_transposed_linear(module) or norm_kind(module) is not None or is_rotary(module)
        ):
            continue
        module.reset_parameters = types.MethodType(_reset_with(init), module)


def _reset_with(init):
    def reset_parameters(self: nn.Module) -> None:
        if is_rotary(self):
            recompute_rotary(self)
            return
        with torch.no_grad():
            init(self)

    return reset_parameters


def is_rotary(module: nn.Module) -> bool:
    return isinstance(getattr(module, "inv_freq", None), torch.Tensor) and hasattr(module, "config")


@torch.no_grad()
def recompute_rotary(module: nn.Module) -> None:
    """``inv_freq`` (never in a checkpoint) from the config, as a fresh module computes it."""
    fresh = type(module)(config=module.config)
    for name, buf in fresh.named_buffers(recurse=False):
        mine = getattr(module, name, None)
        if isinstance(mine, torch.Tensor) and not mine.is_meta and mine.shape == buf.shape:
            mine.copy_(buf.to(mine.device, mine.dtype))
    if hasattr(fresh, "attention_scaling"):
        module.attention_scaling = fresh.attention_scaling


def recompute_all_rotary(model: nn.Module) -> None:
    for module in model.modules():
        if is_rotary(module):
            recompute_rotary(module)
