"""What sequence parallelism cannot run exactly in a Hugging Face model, refused at initialize.

Under sequence parallelism (a tensor mode whose geometry ``splits_sequence``) each rank runs the model's own code on its ``S / N`` positions
and only attention looks across them (ring attention, ``attention.py``). Anything else that
mixes positions would see this rank's part of the sequence alone and train another model,
silently. So ``gt.initialize`` refuses, naming the layer:

* a layer ``config.layer_types`` calls something other than attention (MiniMax's and
  OLMo-Hybrid's ``linear_attention``, LFM2's ``conv``, Mamba layers of hybrids): a
  recurrence or convolution over positions, which would restart at each shard; and
  attention within chunks (Llama 4's ``chunked_attention``), a pattern ring attention lacks;
* an ``nn.Conv1d`` wider than one position (short convolutions, Mamba mixers);
* a random draw outside dropout in the training forward (PhiMoE's ``sparsemixer`` samples
  each token's experts): the draws of one process cannot be split by positions, and every
  rank would draw the same numbers for different tokens. Found by running the forward once
  on meta in training mode, watching torch's random functions (dropout, which gets its own
  per-rank stream, is not one of them).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from gridtrain.hf.modes import sequence_modes
from gridtrain.parallel.tensor.plan import PlanError

# layer kinds (config.layer_types) that are attention ring attention computes
ATTENTION_LAYERS = frozenset({"full_attention", "sliding_attention"})
RANDOM = frozenset(
    {
        torch.rand,
        torch.rand_like,
        torch.randn,
        torch.randn_like,
        torch.randint,
        torch.randint_like,
        torch.randperm,
        torch.bernoulli,
        torch.multinomial,
        torch.normal,
        torch.poisson,
        torch.Tensor.uniform_,
        torch.Tensor.normal_,
        torch.Tensor.exponential_,
        torch.Tensor.bernoulli_,
        torch.Tensor.random_,
        torch.Tensor.cauchy_,
        torch.Tensor.log_normal_,
        torch.Tensor.geometric_,
    }
)


def advice() -> str:
    """The way out every refusal here ends with."""
    return f"use a layout without tensor mode {sequence_modes()} for this model"


def refuse_unsupported_layers(model: nn.Module) -> None:
    """A ``PlanError`` naming the first layer ring attention does not cover or module that
    mixes positions outside attention (``config.layer_types``, then ``nn.Conv1d``)."""
    name = type(model).__name__
    kinds = list(getattr(model.config, "layer_types", None) or [])
    other = {i: k for i, k in enumerate(kinds) if k not in ATTENTION_LAYERS}
    chunked = [i for i, k in other.items() if k == "chunked_attention"]
    if chunked:  # attention, but in blocks of positions: a pattern ring attention lacks
        size = getattr(model.config, "attention_chunk_size", None)
        raise PlanError(
            f"sequence parallelism: {name}'s layer {_layer_path(model, chunked[0], len(kinds))}"
            f" is a 'chunked_attention' layer (config.layer_types; attention_chunk_size="
            f"{size}): ring attention computes causal, bidirectional and causal sliding "
            f"window attention, not attention within chunks; {advice()}"
        )
    if other:
        i, kind = next(iter(other.items()))
        raise PlanError(
            f"sequence parallelism: {name}'s layer {_layer_path(model, i, len(kinds))} is a "
            f"{kind!r} layer (config.layer_types; {len(other)} such layers), which mixes "
            f"positions outside attention: on a rank's part of the sequence it would restart "
            f"at the shard's first position; {advice()}"
        )
    for path, module in model.named_modules():
        if isinstance(module, nn.Conv1d) and module.kernel_size[0] > 1:
            raise PlanError(
                f"sequence parallelism: {name}'s '{path}' (nn.Conv1d, kernel "
                f"{module.kernel_size[0]}) mixes positions outside attention: on a rank's part "
                f"of the sequence it would not see the previous shard's last positions; "
                f"{advice()}"
            )


def _layer_path(model: nn.Module, index: int, count: int) -> str:
    """'path.index (Class)' of layer ``index`` in the model's list of ``count`` layers."""
    for path, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) == count:
            return f"'{path}.{index}' ({type(module[index]).__name__})"
    return str(index)


class RandomDraws(TorchFunctionMode):
    """Records the torch random functions called (``RANDOM``) and the innermost module whose
    forward called each; dropout's own draws happen inside ``F.dropout``, unseen."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model, self.draws, self._stack, self._hooks = model, [], [""], []

    def __enter__(self):
        for path, module in self.model.named_modules():
            self._hooks.append(module.register_forward_pre_hook(self._push(path)))
            self._hooks.append(module.register_forward_hook(self._pop, always_call=True))
        return super().__enter__()

    def __exit__(self, *exc):
        for h in self._hooks:
            h.remove()
        return super().__exit__(*exc)

    def _push(self, path: str) -> Callable:
        def hook(module, args):
            self._stack.append(path)

        return hook

    def _pop(self, module, args, output) -> None:
        self._stack.pop()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in RANDOM:
            self.draws.append((self._stack[-1], getattr(func, "__name__", str(func))))
        return func(*args, **(kwargs or {}))

    def refuse(self, mode: str | None = None) -> None:
        """A ``PlanError`` naming the first draw, if any (``mode``: a tensor mode other than
        sequence, whose ranks run replicated code such as a router on their own streams)."""
        if not self.draws:
            return
        path, func = self.draws[0]
        module = type(self.model.get_submodule(path)).__name__
        where = f"{type(self.model).__name__}'s '{path}' ({module})"
        if mode is not None:
            raise PlanError(
                f"tensor mode {mode!r}: {where} draws random numbers in its training forward "
                f"({func}, outside dropout), which ranks of a tensor group would draw from "
                "their own streams for the same tokens, so their copies of what it computes "
                "would differ; use data or pipeline parallelism for this model"
            )
        raise PlanError(
            f"sequence parallelism: {where} draws "
            f"random numbers in its training forward ({func}, outside dropout): one process's "
            f"draws cannot be cut by positions, and each rank would draw the same numbers for "
            f"its own tokens; {advice()}"
        )


def refuse_random_draws(model: nn.Module, mode: str) -> None:
    """Run ``model``'s training forward once on meta and refuse (``RandomDraws.refuse``) a
    random draw outside dropout under tensor ``mode``; a model that cannot run on meta is
    left to the planner's own checks."""
    from gridtrain.parallel.tensor.trace import run_on_meta

    ids = torch.zeros((1, 4), dtype=torch.long)
    draws = RandomDraws(model)
    try:
        with training(model):
            # no mask: Hugging Face's mask code reads its values, which meta tensors lack
            run_on_meta(model, {"input_ids": ids}, modes=(draws,))
    except Exception:  # noqa: BLE001 - what was drawn before the failure is still known
        pass
    draws.refuse(mode)


@contextlib.contextmanager
def training(model: nn.Module) -> Iterator[None]:
    """``model`` in training mode (what the checks must see), its modes restored after."""
    modes = {m: m.training for m in model.modules()}
    model.train()
    try:
        yield
    finally:
        for m, mode in modes.items():
            m.training = mode
