"""Sequence parallelism inside a Hugging Face model: ring attention through ``transformers``'
attention-function registry, and global positions for each rank's block of tokens.

Models that support attention backends (``_supports_attention_backend``: GPT-2, the
Llama family) call ``ALL_ATTENTION_FUNCTIONS[config._attn_implementation]`` and build
their masks with ``ALL_MASK_ATTENTION_FUNCTIONS[...]``. gridtrain registers both under
``"gridtrain_ring"`` (``AttentionInterface.register`` / ``AttentionMaskInterface.register``)
and switches the model to it, so the model's own code runs ring attention:

* the mask function reads the pattern the model asks for (causal, bidirectional, or a
  causal sliding window) and hands on a ``RingMask``: that pattern and the 2-D padding mask
  of this rank's keys (``[B, S/N]``, True = attend), instead of an ``S/N x S/N`` block that
  cannot see the other ranks' keys; ring attention applies the pattern over global
  positions. Any other pattern (packed sequences, chunked attention, overlays such as
  image tokens) is refused;
* the attention function implements every argument the model's attention passes:
  ``dropout``, ``scaling``, ``is_causal``, ``sliding_window`` (checked against the mask's
  window), ``softcap`` (Gemma2) and ``s_aux`` sinks (gpt-oss), repeats grouped key/value
  heads (GQA) and calls ``gridtrain.parallel.tensor.sequence.ring_attention``. Arguments
  that carry no attention math for whole training sequences are listed (``INERT``); any
  other is a ``PlanError`` naming it and the model;
* a forward pre-hook passes ``position_ids`` starting at this rank's offset
  (``gt.nn.position_ids``), so learned (GPT-2) and rotary (Llama) positions are global,
  and refuses ``labels=``: HF's loss shifts labels by one inside the model, which would
  cross shards; labels are shifted by the user before the batch is split.

``install`` first refuses layers ring attention does not cover and code that mixes positions
outside attention (``sequence_checks.py``: linear attention, convolutions, chunked attention,
random draws outside dropout), then runs the model's training forward once on the meta device
after switching it, called as a step calls it, so that an argument, a mask pattern or keys
cached during the forward (Dory) ring attention refuses is refused at ``gt.initialize``.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from gridtrain.hf.modes import sequence_modes
from gridtrain.hf.sequence_checks import (
    RandomDraws,
    advice,
    refuse_unsupported_layers,
    training,
)
from gridtrain.parallel import comm
from gridtrain.parallel.context import ParallelContext, get_context
from gridtrain.parallel.mode import ParallelMode
from gridtrain.parallel.tensor.plan import PlanError
from gridtrain.parallel.tensor.sequence import position_ids as sequence_positions
from gridtrain.parallel.tensor.sequence import ring_attention
from gridtrain.parallel.tensor.trace import run_on_meta

logger = logging.getLogger("gridtrain")
NAME = "gridtrain_ring"
# keywords transformers hands every attention function that describe no attention math over
# whole training sequences (its own sdpa and eager functions read none of them): positions
# (the mask carries packing, refused there), cache and output switches of the model call, the
# loss's token count
INERT = frozenset(
    {
        "position_ids",
        "use_cache",
        "output_router_logits",
        "output_hidden_states",
        "num_items_in_batch",
        "deterministic",
    }
)
# keywords that only matter when set: a flash-attention varlen layout (packed sequences),
# weights to return
UNSET_ONLY = frozenset(
    {
        "cu_seq_lens_q",
        "cu_seq_lens_k",
        "max_length_q",
        "max_length_k",
        "seq_idx",
        "output_attentions",
    }
)


@dataclass(frozen=True)
class RingMask:
    """What ``ring_mask`` hands the attention: the pattern over global positions and this
    rank's ``[B, S/N]`` padding mask (True = attend; None: no padding)."""

    causal: bool
    window: int | None
    padding: Tensor | None


def ring_attention_forward(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: RingMask | Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    s_aux: Tensor | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """``transformers``' attention signature: ``[B, H, s, D]`` in, ``[B, s, H, D]`` out."""
    _refuse_unknown(module, kwargs)
    _refuse_cached_keys(module, query, key)
    causal, window, padding = _pattern(module, attention_mask, is_causal, sliding_window, query)
    if key.shape[1] != query.shape[1]:  # grouped-query attention: one kv head per group
        groups = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    q, k, v = query.contiguous(), key.contiguous(), value.contiguous()
    mods = dict(window=window, softcap=softcap, sinks=s_aux)
    out = ring_attention(q, k, v, causal, padding, dropout, scaling, **mods)
    return out.transpose(1, 2).contiguous(), None


def _refuse_unknown(module: nn.Module, kwargs: dict[str, Any]) -> None:
    for name, value in kwargs.items():
        if name in INERT or (name in UNSET_ONLY and value in (None, False)):
            continue
        shown = f"a tensor of shape {tuple(value.shape)}" if isinstance(value, Tensor) else value
        raise PlanError(
            f"sequence parallelism: {_model_name(module)}'s attention passes {name}={shown}, "
            f"which ring attention does not implement; {advice()}"
        )


def _refuse_cached_keys(module: nn.Module, query: Tensor, key: Tensor) -> None:
    """Keys beyond the query's positions come from a key/value cache filled during this
    forward (Dory's recurrent loops attend to the keys of earlier passes when ``use_cache``
    is on); ring attention attends over the sequence's own positions only."""
    if key.shape[2] != query.shape[2]:
        raise PlanError(
            f"sequence parallelism: {_model_name(module)}'s attention is given {key.shape[2]} "
            f"keys for {query.shape[2]} positions (keys cached earlier in the forward: "
            f"use_cache={getattr(module.config, 'use_cache', None)} in its config); ring "
            "attention attends over the sequence's own positions only: set "
            "model.config.use_cache = False before gt.initialize if the model trains without "
            f"its cache, else use a layout without tensor mode {sequence_modes()}"
        )


def _pattern(module, mask, is_causal, sliding_window, query) -> tuple[bool, int | None, Any]:
    """(causal, window, padding: True = a padded key) of one attention call: the mask's pattern (what sdpa and eager
    apply in one process), checked against the attention's own ``sliding_window``."""
    if isinstance(mask, Tensor):
        raise PlanError(
            f"sequence parallelism: {_model_name(module)} hands its attention a prepared mask of "
            f"shape {tuple(mask.shape)}; ring attention takes the model's own mask pattern "
            "(pass a [batch, seq] attention_mask, not a 4-D one)"
        )
    if mask is None:  # the model built no mask: the attention's own arguments say it all
        causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
        return causal, sliding_window, None
    total = query.shape[2] * get_context().world_size(ParallelMode.SEQUENCE)
    if sliding_window is not None and min(sliding_window, total) != min(
        mask.window or total, total
    ):
        raise PlanError(
            f"sequence parallelism: {_model_name(module)}'s attention passes sliding_window="
            f"{sliding_window} but its mask has window {mask.window}: they disagree"
        )
    return mask.causal, mask.window, None if mask.padding is None else ~mask.padding.bool()


def ring_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function=None,
    attention_mask: Tensor | None = None,
    config=None,
    local_size: int | None = None,
    allow_is_causal_skip: bool = True,
    allow_is_bidirectional_skip: bool = True,
    dtype=None,
    device=None,
    use_vmap: bool = False,
    **kwargs: Any,
) -> RingMask:
    """The mask function for ``NAME``: the model's pattern and this rank's padding mask."""
    from transformers.masking_utils import bidirectional_mask_function, causal_mask_function

    if kwargs:
        raise PlanError(f"sequence parallelism: the mask function got {sorted(kwargs)}")
    if q_offset or kv_offset or q_length != kv_length:
        raise PlanError(
            "ring attention runs on whole training sequences: a key/value cache (generation) "
            "is not supported under sequence parallelism"
        )
    pure = allow_is_causal_skip and allow_is_bidirectional_skip  # no packing, no overlay
    if mask_function is causal_mask_function:
        return RingMask(True, None, attention_mask)
    if mask_function in (bidirectional_mask_function, None):
        return RingMask(False, None, attention_mask)
    if pure and local_size is not None and _is_sliding(mask_function, local_size):
        return RingMask(True, local_size, attention_mask)
    what = getattr(mask_function, "__qualname__", type(mask_function).__name__)
    raise PlanError(
        f"sequence parallelism: {getattr(config, 'model_type', 'the model')} asks for a mask "
        f"pattern ({what}) other than causal, bidirectional or a causal sliding window "
        "(packed sequences, chunked attention, a bidirectional window, or an overlay such as "
        f"image tokens); ring attention computes those three only: {advice()}"
    )


def _is_sliding(mask_function, window: int) -> bool:
    """``mask_function`` is the causal sliding window of ``window`` keys, checked on the rows
    where the window starts and ends against every key of two windows (a pattern of the
    distance ``q - kv``)."""
    with torch.device("cpu"):  # also inside the meta dry run, for what the function creates
        q = torch.tensor([0, 1, window - 1, window, window + 1, 2 * window + 1])[:, None]
        kv = torch.arange(2 * window + 2)[None, :]
        zero = torch.zeros((), dtype=torch.long)
        got = torch.as_tensor(mask_function(zero, zero, q, kv)).expand(q.shape[0], kv.shape[1])
        return bool(torch.equal(got, (kv <= q) & (kv > q - window)))


def _model_name(module: nn.Module) -> str:
    """The model (its architecture, else its config's model type) and the attention's class."""
    config = getattr(module, "config", None)
    model = (getattr(config, "architectures", None) or [getattr(config, "model_type", None)])[0]
    return f"{model} ({type(module).__name__})" if model else type(module).__name__


def install(model: nn.Module, ctx: ParallelContext) -> None:
    """Switch ``model`` to ring attention and global positions (a mode that cuts the sequence), and
    run it once on meta so that what ring attention refuses is refused now."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    refuse_unsupported_layers(model)
    AttentionInterface.register(NAME, ring_attention_forward)
    AttentionMaskInterface.register(NAME, ring_mask)
    try:
        model.set_attn_implementation(NAME)
    except (ValueError, AttributeError):  # older checks: set the config field directly
        model.config._attn_implementation = NAME
    if model.config._attn_implementation != NAME:
        raise PlanError(f"{type(model).__name__}: could not switch attention to ring attention")
    model.register_forward_pre_hook(_global_positions(ctx), with_kwargs=True)
    _dry_run(model)


def _dry_run(model: nn.Module) -> None:
    """The model's forward on meta (no memory, no compute, no collective): a ``PlanError``
    from the attention or the mask function, or a random draw outside dropout
    (``sequence_checks.RandomDraws``), surfaces at ``gt.initialize``. Run as the model is,
    without a cache, then in training mode as a step calls it (the config's ``use_cache``:
    Dory attends to keys it cached earlier in the same forward)."""
    ids = torch.zeros((1, 4), dtype=torch.long)
    call = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    runs = [(contextlib.nullcontext, {**call, "use_cache": False}), (training, call)]
    draws = RandomDraws(model)
    for mode, example in runs:
        try:
            with mode(model):
                run_on_meta(model, example, modes=(draws,))
        except PlanError:
            raise
        except Exception as err:  # noqa: BLE001 - a model that cannot run on meta: the first step checks
            _refuse_mask_reader(model, err)
            logger.debug("ring attention: no dry run of %s on meta (%s)", type(model).__name__, err)
        draws.refuse()  # also when the run stopped later: what was drawn before is known


def _refuse_mask_reader(model: nn.Module, err: Exception) -> None:
    """A model whose own code computes with the mask (Doge builds a dynamic mask from its
    values) fails on the ``RingMask`` pattern the mask function hands on: refused by name."""
    if type(err) in (AttributeError, TypeError) and "RingMask" in str(err):
        raise PlanError(
            f"sequence parallelism: {type(model).__name__}'s own code computes with its "
            f"attention mask ({type(err).__name__}: {err}); a mask built from a rank's part of "
            "the sequence cannot be applied under sequence parallelism: ring attention takes "
            f"the mask pattern (causal, bidirectional or a causal sliding window) only; {advice()}"
        ) from err


def _global_positions(ctx: ParallelContext):
    def hook(module: nn.Module, args: tuple, kwargs: dict):
        if kwargs.get("labels") is not None:
            raise ValueError(
                "sequence parallelism: do not pass labels= to the model (its internal shift "
                "would cross shards); shift the labels yourself and give them to "
                "engine.criterion(out, labels)"
            )
        if kwargs.get("output_attentions", getattr(module.config, "output_attentions", False)):
            raise PlanError(
                f"sequence parallelism: {type(module).__name__} is asked for output_attentions; "
                "ring attention never holds the whole [S, S] attention weights"
            )
        if kwargs.get("position_ids") is not None:
            if kwargs.get("attention_mask") is None:  # transformers reads packing from them
                _refuse_packed(kwargs["position_ids"], ctx)
            return None  # given by the user: split with the batch like every [B, S] tensor
        tokens = kwargs.get("input_ids", args[0] if args else None)
        if tokens is None:
            tokens = kwargs.get("inputs_embeds")
        if not isinstance(tokens, Tensor):
            return None
        kwargs["position_ids"] = sequence_positions(tokens.shape[1], tokens.device, ctx)[None]
        return args, kwargs

    return hook


def _refuse_packed(position_ids: Tensor, ctx: ParallelContext) -> None:
    """Packed sequences (positions restarting inside a row, read by ``transformers`` as
    separate sequences) are refused: a restart at a shard boundary is invisible to the rank
    after it, so the check runs on the whole gathered rows, the same on every rank."""
    from transformers.masking_utils import find_packed_sequence_indices

    if position_ids.is_meta:
        return
    rows = comm.all_gather_raw(position_ids.contiguous(), 1, ctx.group(ParallelMode.SEQUENCE))
    if find_packed_sequence_indices(rows) is not None:
        raise PlanError(
            "sequence parallelism: position_ids restart inside a row (packed sequences, which "
            "transformers separates by a block mask); ring attention computes causal, "
            "bidirectional and causal sliding window patterns only: unpack the batch or pass "
            "an attention_mask"
        )
