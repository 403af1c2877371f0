"""A Hugging Face causal LM as a list of pipeline layers, cut along the model's own layer list.

The cut points come from ``transformers``' pipeline plan where the model has one
(``_pp_plan`` = ``base_model_pp_plan`` prefixed, plus ``lm_head``: Llama, Qwen2,
Mistral...): ``model.embed_tokens``, every ``model.layers.i``, ``model.norm``,
``lm_head``. GPT-2 has none; its list is ``wte``, ``wpe``, every ``h.i``, ``ln_f``,
``lm_head``. Each layer keeps its module path (so a stage's state dict has the dense
keys) and gets a ``gt_pipeline_run`` that calls it the way the model's forward would.

What travels between stages is a tuple ``(hidden_states, position_ids[, attention_mask])``:
the padding mask of a dict batch (``dict(input_ids=..., attention_mask=...)``, the HF
convention) reaches every stage, and each decoder layer rebuilds its causal mask
(``create_causal_mask``) and rotary embeddings from it, as the model's forward does
once. The last layer returns the HF output object (``CausalLMOutputWithPast``), so the
loss reads ``out.logits`` as without a pipeline.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch.nn.functional as F
from torch import Tensor, nn

from gridtrain.hf.attention import positions_for
from gridtrain.hf.patches import give_reset_parameters


def pipeline_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(module path, module)`` in execution order, each with its ``gt_pipeline_run``."""
    cfg = model.config
    if not cfg.architectures:
        cfg.architectures = [type(model).__name__]
    give_reset_parameters(model)  # gt.lazy_init: each stage re-initialises what it keeps
    if getattr(cfg, "model_type", None) == "gpt2":
        layers = _gpt2_layers(model)
    elif getattr(model, "_pp_plan", None):
        layers = _planned_layers(model)
    else:
        raise TypeError(
            f"{type(model).__name__} has no pipeline plan (_pp_plan) and gridtrain has none "
            "for it; list its layers with a pipeline_layers() method"
        )
    for _, module, run in layers:
        module.gt_pipeline_run = run
    return [(name, module) for name, module, _ in layers]


def _gpt2_layers(model: nn.Module) -> list[tuple[str, nn.Module, Any]]:
    if not hasattr(model, "lm_head"):
        raise TypeError(f"pipeline parallelism takes GPT2LMHeadModel, got {type(model).__name__}")
    base, cfg = model.transformer, model.config
    base.wpe.gt_dropout = base.drop.p  # GPT2Model's embedding dropout, applied after wpe
    layers = [("transformer.wte", base.wte, _embed), ("transformer.wpe", base.wpe, _gpt2_wpe)]
    layers += [(f"transformer.h.{i}", h, _block(cfg, None)) for i, h in enumerate(base.h)]
    layers += [("transformer.ln_f", base.ln_f, _plain), ("lm_head", model.lm_head, _head)]
    return layers


def _planned_layers(model: nn.Module) -> list[tuple[str, nn.Module, Any]]:
    layers = []
    base_model = getattr(model, "base_model", model)
    rotary = getattr(base_model, "rotary_emb", None)
    names = _execution_order(model)
    for index, name in enumerate(names):
        module = model.get_submodule(name)
        if isinstance(module, nn.ModuleList):
            for i, layer in enumerate(module):
                if rotary is not None:  # each decoder layer computes cos/sin on its stage
                    layer.gt_rotary = rotary  # a buffer-only child: no state-dict keys
                layers.append((f"{name}.{i}", layer, _block(model.config, i)))
        elif index == 0:
            layers.append((name, module, _embed))
        elif index == len(names) - 1 and name == "lm_head":
            layers.append((name, module, _head))
        else:
            layers.append((name, module, _plain))
    return layers


def _execution_order(model: nn.Module) -> list[str]:
    """The pipeline plan's module paths, base model first (``_pp_plan`` lists ``lm_head``
    first; ``config.base_model_pp_plan`` keeps the base model's order)."""
    prefix = ""
    for name, module in model.named_modules():
        if module is getattr(model, "base_model", model):
            prefix = f"{name}." if name else ""
            break
    base = [prefix + k for k in (getattr(model.config, "base_model_pp_plan", None) or {})]
    return base + [k for k in model._pp_plan if k not in base]


# ---- how each layer is called (``run(module, *previous outputs, **batch on stage 0)``) --------
def _embed(module: nn.Module, *args: Tensor, **batch: Any) -> tuple[Tensor, ...]:
    ids = batch.pop("input_ids", args[0] if args else None)
    if ids is None:
        raise ValueError("the first pipeline stage needs input_ids (a tensor or a dict key)")
    mask = batch.pop("attention_mask", None)
    positions = batch.pop("position_ids", None)
    if batch:
        raise ValueError(f"pipeline: batch keys {sorted(batch)} are not supported")
    positions = positions_for(ids) if positions is None else positions
    out = (module(ids), positions)
    return out if mask is None else (*out, mask.long())


def _gpt2_wpe(module: nn.Module, hidden: Tensor, positions: Tensor, *mask: Tensor):
    p = module.gt_dropout if module.training else 0.0
    hidden = F.dropout(hidden + module(positions), p, module.training)
    return (hidden, positions, *mask)


def _block(config, layer_index: int | None):
    def run(layer: nn.Module, hidden: Tensor, positions: Tensor, *mask: Tensor):
        kwargs: dict[str, Any] = {
            "attention_mask": _mask(config, layer_index, hidden, positions, mask),
            "position_ids": positions,
        }
        rotary = getattr(layer, "gt_rotary", None)
        if rotary is not None:
            kwargs["position_embeddings"] = rotary(hidden, positions)
        out = layer(hidden, **kwargs)
        out = out[0] if isinstance(out, tuple) else out
        return (out, positions, *mask)

    return run


def _mask(config, layer_index, hidden: Tensor, positions: Tensor, mask: tuple[Tensor, ...]):
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    padding = mask[0] if mask else None
    sliding = getattr(config, "sliding_window", None) is not None
    types = getattr(config, "layer_types", None)
    if types is not None and layer_index is not None:
        sliding = types[layer_index] == "sliding_attention"
    make = create_sliding_window_causal_mask if sliding else create_causal_mask
    # transformers < 5.20 names the cache argument past_key_values
    cache = "cache" if "cache" in inspect.signature(make).parameters else "past_key_values"
    kwargs = {cache: None}
    return make(
        config=config,
        inputs_embeds=hidden,
        attention_mask=padding,
        position_ids=positions,
        **kwargs,
    )


def _plain(module: nn.Module, hidden: Tensor, positions: Tensor, *mask: Tensor):
    return (module(hidden), positions, *mask)


def _head(module: nn.Module, hidden: Tensor, positions: Tensor, *mask: Tensor):
    from transformers.modeling_outputs import CausalLMOutputWithPast

    return CausalLMOutputWithPast(logits=module(hidden))
