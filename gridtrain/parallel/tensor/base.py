"""The one base of every sharded layer: made from a dense module, it keeps this rank's shards.

A sharded layer is built *from* the dense module it replaces (``nn.Linear``,
``nn.Embedding``, a norm, a library's transposed Linear...): its parameters are this rank's cut
of the dense module's current values, tagged with their shard specs, under the
dense module's parameter names, so full state dicts keep the dense keys and
shapes. The dense module is kept on the meta device (no memory) as the layer's
*dense twin*: ``reset_parameters`` materialises a copy, runs its own init (same
draws as the dense model) and re-cuts, which is how ``gt.lazy_init`` models
materialise only their shards.
"""

from __future__ import annotations

import copy

import torch
from torch import Tensor, nn

from gridtrain.parallel.context import ParallelContext, get_context
from gridtrain.parallel.sharding import shard_shape, shard_tensor
from gridtrain.parallel.tags import ShardSpec, as_spec, get_shard_spec, set_shard_spec
from gridtrain.parallel.tensor.probe import PROBE_ROWS, stand_ins


class CtxRef:
    """Holds a layer's context; ``copy.deepcopy`` of a model keeps the same context
    (process groups cannot be copied)."""

    def __init__(self, ctx: ParallelContext):
        self.ctx = ctx

    def __deepcopy__(self, memo) -> CtxRef:
        return self


class _Twin:
    """The dense module on the meta device, hidden from ``nn.Module``'s child registry."""

    def __init__(self, dense: nn.Module):
        self.module = dense


# Linear classes that store their weight ``[in, out]`` (Hugging Face's ``Conv1D``), registered
# by the model library's support above ``parallel/`` (``gridtrain.hf``): the planner and the
# layers treat them as Linears without naming a library's class
TRANSPOSED_LINEARS: list[type[nn.Module]] = []


def register_transposed_linear(cls: type[nn.Module]) -> None:
    """Plan ``cls`` (and its subclasses) as a Linear whose ``weight`` is ``[in, out]`` and whose
    forward computes ``x W + b``."""
    if cls not in TRANSPOSED_LINEARS:
        TRANSPOSED_LINEARS.append(cls)


def is_transposed_linear(module: nn.Module) -> bool:
    """Whether ``module`` is of a class ``register_transposed_linear`` registered."""
    return isinstance(module, tuple(TRANSPOSED_LINEARS))


def linear_dims(dense: nn.Module) -> tuple[int, int, bool]:
    """(in_features, out_features, transposed) of an ``nn.Linear`` or a transposed Linear."""
    if is_transposed_linear(dense):
        return dense.weight.shape[0], dense.weight.shape[1], True
    if isinstance(dense, nn.Linear):
        return dense.in_features, dense.out_features, False
    raise TypeError(f"expected an nn.Linear or a Hugging Face Conv1D, got {type(dense).__name__}")


def own_forward(layer: ShardedModule, parts: int) -> bool:
    """Whether ``layer``'s dense embedding computes more than ``nn.Embedding``'s lookup (a
    subclass with its own forward); if so its buffers are kept on ``layer`` for
    ``run_dense``, which runs that forward on one of ``parts`` column blocks of the table.
    Raises ValueError when the forward does not compute each column on its own
    (``check_column_local``)."""
    dense = layer.dense
    own = isinstance(dense, nn.Embedding) and type(dense).forward is not nn.Embedding.forward
    if own:
        check_column_local(dense, parts)
        layer.keep_buffers()
    return own


PROBE_TOKENS = 8


def check_column_local(dense: nn.Embedding, parts: int) -> None:
    """Raise ValueError unless ``dense``'s own forward, run on a block of the table's columns,
    gives that block of its output: an extra that is elementwise (Gemma's scale) or acts on
    rows (OPT's position offset) passes; one that mixes columns (a norm over the embedding,
    Inkling's ``embed_norm``) or holds full-width weights of its own does not, and run on a
    block it would compute something else, silently.

    Probed on random values (the weights may be on meta): a table of ``PROBE_ROWS`` rows at
    full width, called with ``PROBE_TOKENS`` ones (token ids, or an attention mask from which
    the forward derives positions), compared with the same forward on each block."""
    gen = torch.Generator().manual_seed(0)
    width = dense.embedding_dim
    rows = min(dense.num_embeddings, PROBE_ROWS)
    table = torch.randn(rows, width, generator=gen, dtype=torch.float64)
    tensors = stand_ins(dense, gen, weight=table)
    ids = torch.ones(1, PROBE_TOKENS, dtype=torch.long)
    step = width // parts
    why = (
        f"{type(dense).__name__}'s own forward must compute each column of the embedding on "
        f"its own, as it runs on a block of {step} of the {width} columns on each rank"
    )
    try:
        full = torch.func.functional_call(dense, tensors, (ids,))
        blocks = [
            torch.func.functional_call(
                dense, {**tensors, "weight": table[:, i * step : (i + 1) * step]}, (ids,)
            )
            for i in range(parts)
        ]
        same = torch.allclose(torch.cat(blocks, dim=-1), full, rtol=1e-12, atol=1e-12)
    except Exception as err:  # noqa: BLE001 - the forward's own failure on a block
        raise ValueError(f"{why}; on a block it fails ({type(err).__name__}: {err})") from None
    if not same:
        raise ValueError(
            f"{why}; it mixes columns (a norm over the embedding dim?), so run on a block it "
            "computes something else: keep it whole with 'replicate' in parallel.tensor.plan "
            "under 1d, or use another tensor mode"
        )


def check_divisible(layer: str, arg: str, value: int, by: int, why: str) -> None:
    """Raise a ValueError naming the argument unless ``by`` divides ``value``."""
    if value % by:
        raise ValueError(f"{layer}: {arg}={value} must be divisible by {by} ({why})")


class ShardedModule(nn.Module):
    """Base of the tensor-parallel layers (see the module docstring).

    Subclasses call ``super().__init__(dense, ctx)`` and then ``self.shard(name, spec)``
    for each dense parameter they keep a shard of (``spec`` () = replicated).
    """

    gt_parallel = True  # the planner never descends into (or re-wraps) this module

    def __init__(self, dense: nn.Module, ctx: ParallelContext | None):
        super().__init__()
        self._ctx = CtxRef(ctx or get_context())
        self._twin = _Twin(dense)
        self._tied: set[str] = set()  # parameters owned (and initialised) by another layer

    @property
    def ctx(self) -> ParallelContext:
        return self._ctx.ctx

    @property
    def dense(self) -> nn.Module:
        """The dense twin (on the meta device once the layer is built)."""
        return self._twin.module

    def shard(self, name: str, spec=(), source: Tensor | None = None) -> nn.Parameter | None:
        """Register this rank's shard of the dense parameter ``name`` under ``spec``.

        ``source`` overrides the dense tensor (a tied weight's); a meta source gives a
        meta shard (materialised later by ``reset_parameters``). None stays None.
        """
        full = getattr(self.dense, name) if source is None else source
        if full is None:
            self.register_parameter(name, None)
            return None
        spec = as_spec(spec)
        piece = shard_tensor(full.detach(), spec, self.ctx)
        if not piece.is_meta:
            piece = piece.to(self.ctx.device)
        param = nn.Parameter(piece, requires_grad=full.requires_grad)
        set_shard_spec(param, *spec)
        self.register_parameter(name, param)
        return param

    def tie(self, name: str, param: nn.Parameter) -> None:
        """Use ``param`` (another layer's shard of the same dense tensor) as ``name``."""
        mine = getattr(self, name)
        if get_shard_spec(mine) != get_shard_spec(param) or mine.shape != param.shape:
            raise ValueError(
                f"{type(self).__name__}: cannot tie '{name}' of local shape {tuple(mine.shape)} "
                f"split {_fmt(get_shard_spec(mine))} to a weight of shape {tuple(param.shape)} "
                f"split {_fmt(get_shard_spec(param))}"
            )
        self.register_parameter(name, param)
        self._tied.add(name)

    def keep_buffers(self) -> None:
        """Register the dense module's own buffers on this layer (values and persistence
        kept), for ``run_dense``."""
        dense = self.dense
        for name, buf in dense.named_buffers(recurse=False):
            persistent = name not in dense._non_persistent_buffers_set
            self.register_buffer(name, buf, persistent=persistent)

    def run_dense(self, params: dict[str, Tensor], *args, **kwargs):
        """The dense module's own forward (``torch.func.functional_call`` on the twin), with
        ``params`` and this layer's buffers in place of its tensors: a layer that changes
        only the tensors a module computes with keeps everything else it does."""
        tensors = {**dict(self.named_buffers(recurse=False)), **params}
        return torch.func.functional_call(self.dense, tensors, args, kwargs)

    def release_dense(self) -> None:
        """Move the dense twin to the meta device: its values now live in the shards."""
        self._twin.module = self._twin.module.to("meta")

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """The dense module's own init (same draws as the dense model), this rank's cut."""
        twin = copy.deepcopy(self.dense).to_empty(device="cpu")
        init = getattr(twin, "reset_parameters", None)
        if init is None:
            raise NotImplementedError(
                f"{type(self.dense).__name__} has no reset_parameters(): load its weights "
                "(gt.load_full_state_dict / gridtrain.hf.load_pretrained) instead"
            )
        init()
        for name, param in self.named_parameters(recurse=False):
            full = getattr(twin, name, None)
            if full is not None and name not in self._tied:
                param.copy_(shard_tensor(full, get_shard_spec(param), self.ctx))

    def local_shape(self, dense_shape, spec) -> tuple[int, ...]:
        return shard_shape(dense_shape, spec, self.ctx)


def _fmt(spec: ShardSpec) -> str:
    if not spec:
        return "nowhere (replicated)"
    return ", ".join(
        f"dim {s.dim} over {s.mode.name}" + (f" ({s.parts} packed)" if s.parts > 1 else "")
        for s in spec
    )


def describe_spec(spec: ShardSpec) -> str:
    """``spec`` in words, for plans and errors."""
    return _fmt(spec)
